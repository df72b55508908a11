"""The quirks of the LLaVA-like families of issue 29 (Mistral 3, InternVL, LLaVA-NeXT-Video,
Gemma 3) beyond the shared matrices (test_invariants, test_methods_matrix, test_generate_matrix,
which run every family): refusals with their reasons, per-image budgets where the encoder's
outputs are not one per image, non-contiguous placeholders, and Gemma 3's sliding window and
bidirectional image blocks."""
from __future__ import annotations

import pytest
import torch

import tiny_models_llavalike as L
import vlm_prune
from reference import capture_lm_inputs, positions_of
from tiny_models import IMAGE_TOKEN, forward_stats, prompts
from vlm_prune.methods import Pool

IMAGE_FAMILIES = {"mistral3": (L.tiny_mistral3, L.mistral3_inputs), "internvl": (L.tiny_internvl, L.internvl_inputs),
                  "gemma3": (L.tiny_gemma3, L.gemma3_inputs),
                  "onevision15": (L.tiny_onevision15, L.onevision15_inputs)}
_models: dict = {}


def model_of(name):
    if name not in _models:
        _models[name] = IMAGE_FAMILIES[name][0]()
    return _models[name]


@pytest.mark.parametrize("family", list(IMAGE_FAMILIES))
@pytest.mark.parametrize("method, message", [
    ("tome", "works in the 'vit' stage, which the .* adapter.* does not offer"),
    ("asvit", "works in the 'vit' stage, which the .* adapter.* does not offer"),
    ("visionzip", "method 'visionzip' supports llava, llava_onevision models"),
    ("uniform", "works in the 'frames' stage, which the .* adapter.* does not offer"),
])
def test_what_a_family_cannot_run_is_refused_at_wrap_time(family, method, message):
    if method == "uniform" and family == "onevision15":
        pytest.skip("LLaVA-OneVision-1.5 takes videos: the frames methods run there (test_generate_matrix)")
    """No CLS token / no CLIP layers in the tower (ViT stage), no tower tap (VisionZip), no video
    (frames): wrap() refuses with the reason and leaves the model unwrapped."""
    model = model_of(family)
    with pytest.raises(ValueError, match=message):
        vlm_prune.wrap(model, method, keep=0.5)
    assert getattr(model, "vlm_prune", None) is None


def test_llava_next_video_refuses_a_vit_stage_method_on_videos_and_runs_it_on_images():
    """ToMe prunes image tiles inside the CLIP tower; a video needs every frame's full grid for the
    model's pooler, so a call with a video is refused with the reason, and images still run."""
    model = L.tiny_llava_next_video()
    vlm_prune.wrap(model, "tome", keep=0.5)
    try:
        with pytest.raises(ValueError, match="LLaVA-NeXT-Video runs on image tiles only.*frames method"), torch.no_grad():
            model(**L.llava_next_video_inputs(model))
        with torch.no_grad():
            model(**L.llava_next_video_image_inputs(model))
        stats = model.vlm_prune.last_stats
        assert stats["stages"][0]["stage"] == "vit"
        assert all(o < i for o, i in zip(stats["visual_tokens_out"], stats["visual_tokens_in"]))
    finally:
        vlm_prune.unwrap(model)


def _kept_equals_hand_built(model, inp, method, **kw):
    """The wrapped prefill equals the language model run on each sample's kept rows only (reduced
    features in place) at their original positions; returns last_stats."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad(), capture_lm_inputs(model) as seen:
            logits = model(**inp).logits
        rows, stats = model.vlm_prune.last_rows, model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    embeds = seen[0]["inputs_embeds"]
    pos = positions_of(seen[0], *embeds.shape[:2])
    for i in range(embeds.shape[0]):
        keep = rows[i][rows[i] >= 0]
        with torch.no_grad():
            h = model.model.language_model(inputs_embeds=embeds[i : i + 1, keep], position_ids=pos[0, i : i + 1, keep],
                                           attention_mask=torch.ones(1, keep.numel(), dtype=torch.long)).last_hidden_state
        torch.testing.assert_close(logits[i, rows[i] >= 0], model.lm_head(h)[0], atol=1e-5, rtol=0)
    return stats


def test_internvl_budget_is_per_image_over_its_tiles():
    """InternVL's encoder returns one entry per tile: a 2-tile image and a 1-tile image are one
    item each (32 and 16 tokens), budget=10 keeps 10 of each image, and the result equals the
    hand-built shorter input; the 2-tile image has no single grid (pool pools 1-D)."""
    model = model_of("internvl")
    inp = L.internvl_inputs(model, tiles=[2, 1])
    seen = []

    class Recording(Pool):
        def reduce_image(self, ctx):
            seen.append((ctx.features.shape[0], ctx.grid))
            return super().reduce_image(ctx)

    stats = _kept_equals_hand_built(model, inp, Recording(), budget=10)
    assert seen == [(32, None), (16, (4, 4))]
    assert stats["visual_tokens_in"] == [32, 16] and stats["visual_tokens_out"] == [10, 10]  # row bands of 3, 3, 4 cells on 4 x 4
    stats = _kept_equals_hand_built(model, inp, "random", budget=10)
    assert stats["visual_tokens_out"] == [10, 10]


def test_internvl_placeholders_that_do_not_split_into_tiles_are_refused():
    model = model_of("internvl")
    inp = L.internvl_inputs(model, tiles=[1, 1])
    ids, mask = prompts([[(IMAGE_TOKEN, 8), (IMAGE_TOKEN, 8)], [(IMAGE_TOKEN, 16)]], seed=1, start=(92,), end=(93,))
    vlm_prune.wrap(model, "random", keep=0.5)
    try:
        with pytest.raises(ValueError, match="do not split into the encoder's 2 tiles of 16 tokens"), torch.no_grad():
            model(**{**inp, "input_ids": ids, "attention_mask": mask})
    finally:
        vlm_prune.unwrap(model)


def test_mistral3_images_keep_their_own_grid_and_break_tokens_stay():
    """Pixtral's variable resolution: each image's grid is (H / 8, W / 8) here (patch 4, merge 2),
    across [IMG_BREAK]-separated rows; the break and end tokens are text (never dropped), two
    images of one sample are two items with a budget each."""
    model = model_of("mistral3")
    inp = L.mistral3_inputs(model)
    grids = []

    class Recording(Pool):
        def reduce_image(self, ctx):
            grids.append(ctx.grid)
            return super().reduce_image(ctx)

    vlm_prune.wrap(model, Recording(), keep=0.5)
    stats = forward_stats(model, inp)
    assert grids == [(4, 4), (4, 6)]
    assert stats["visual_tokens_in"] == [16, 24] and stats["visual_tokens_out"] == [8, 12]
    _kept_equals_hand_built(model, inp, "random", keep=0.5)
    vlm_prune.wrap(model, "random", keep=0.5)
    try:
        with torch.no_grad():
            model(**inp)
        rows = model.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(model)
    ids = inp["input_ids"]
    for i in range(ids.shape[0]):
        kept = set(rows[i][rows[i] >= 0].tolist())
        text = torch.nonzero((ids[i] != IMAGE_TOKEN) & inp["attention_mask"][i].bool()).squeeze(1).tolist()
        assert set(text) <= kept
    # two images in one sample: two items, a budget each
    two = {"input_ids": None, "pixel_values": inp["pixel_values"], "image_sizes": inp["image_sizes"]}
    seq = [1, 5]
    for h, w in L.MISTRAL3_SIZES:
        for r in range(h // 8):
            seq += [IMAGE_TOKEN] * (w // 8) + [L.IMG_BREAK if r < h // 8 - 1 else L.IMG_END]
    two["input_ids"] = torch.tensor([seq + [7, 8]])
    two["attention_mask"] = torch.ones_like(two["input_ids"])
    vlm_prune.wrap(model, "random", budget=5)
    stats = forward_stats(model, two)
    assert stats["visual_tokens_in"] == [40] and stats["visual_tokens_out"] == [10]
    assert stats["stages"][0]["tokens_in"] == [16, 24] and stats["stages"][0]["tokens_out"] == [5, 5]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", ["random", "fastv"])
def test_gemma3_beyond_its_sliding_window_keep_one_equals_the_model(attn, method):
    """Gemma 3's sliding-window layers on calls longer than the window (8 columns here; prompts of
    27 and 31 columns, left-padded, then 12 generated tokens): nothing removed, the wrapped model
    equals the unwrapped one in the prefill, in every generated token (its sliding cache crops) and in a
    second turn on that cache (new rows after a cached prefix)."""
    from test_generate_matrix import multi_turn

    model = L.tiny_gemma3(attn, sliding_window=8)
    inp = L.gemma3_inputs(model)
    valid = inp["attention_mask"].bool()
    with torch.no_grad():
        ref_logits = model(**inp).logits
        ref = model.generate(**inp, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        ref_turn = multi_turn(model, inp, "new")
    vlm_prune.wrap(model, method, keep=1.0)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(**inp).logits[valid], ref_logits[valid], atol=1e-5, rtol=0)
            assert torch.equal(model.generate(**inp, max_new_tokens=12, min_new_tokens=12, do_sample=False), ref)
            assert torch.equal(multi_turn(model, inp, "new"), ref_turn)
    finally:
        vlm_prune.unwrap(model)


def test_gemma3_beyond_its_sliding_window_a_removal_equals_the_model_on_the_kept_rows():
    """Vision-stage removal on calls longer than the window: each sample's prefill logits and greedy
    answer equal the unwrapped model fed only its kept rows (their embeddings, original positions and
    image blocks), decoding with the model's own sliding cache: the window counts kept rows."""
    from transformers import DynamicCache

    model = L.tiny_gemma3(sliding_window=8)
    inp = L.gemma3_inputs(model)
    steps = 6
    vlm_prune.wrap(model, "random", keep=0.5)
    try:
        with capture_lm_inputs(model) as seen, torch.no_grad():
            logits = model(**inp).logits
            rows = model.vlm_prune.last_rows
            gen = model.generate(**inp, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    finally:
        vlm_prune.unwrap(model)
    b, s = inp["input_ids"].shape
    embeds, pos = seen[0]["inputs_embeds"], positions_of(seen[0], b, s)[0]
    embed = model.get_input_embeddings()
    for i in range(b):
        keep = rows[i][rows[i] >= 0]
        assert keep.numel() > 8  # the kept rows alone go beyond the window
        cache = DynamicCache(config=model.config.get_text_config())
        with torch.no_grad():
            out = model.model(inputs_embeds=embeds[i : i + 1, keep], position_ids=pos[i : i + 1, keep],
                              attention_mask=torch.ones(1, keep.numel(), dtype=torch.long),
                              token_type_ids=inp["token_type_ids"][i : i + 1, keep], cache=cache, use_cache=True)
            step_logits = model.lm_head(out.last_hidden_state)
            torch.testing.assert_close(logits[i, rows[i] >= 0], step_logits[0], atol=1e-5, rtol=0)
            tokens, nxt = [], int(pos[i, -1]) + 1
            for t in range(steps):
                token = step_logits[0, -1].argmax()
                tokens.append(int(token))
                n = keep.numel() + t + 1
                out = model.model(inputs_embeds=embed(token.view(1, 1)), position_ids=torch.tensor([[nxt + t]]),
                                  attention_mask=torch.ones(1, n, dtype=torch.long), cache=cache,
                                  use_cache=True)
                step_logits = model.lm_head(out.last_hidden_state)
        assert gen[i, s:].tolist() == tokens


def test_gemma3_image_blocks_follow_the_kept_tokens():
    """Without token_type_ids Gemma 3 attends causally: the wrapped model follows the call
    (pruned logits differ between the two calls exactly as the unwrapped model's do), and a
    prepared mask dict is refused with the alternative."""
    model = model_of("gemma3")
    inp = L.gemma3_inputs(model)
    causal = {k: v for k, v in inp.items() if k != "token_type_ids"}
    with torch.no_grad():
        ref_blocks, ref_causal = model(**inp).logits, model(**causal).logits
    valid = inp["attention_mask"].bool()
    assert (ref_blocks[valid] - ref_causal[valid]).abs().max() > 1e-3  # the blocks matter in this model
    vlm_prune.wrap(model, "random", keep=1.0)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(**causal).logits[valid], ref_causal[valid], atol=1e-5, rtol=0)
            torch.testing.assert_close(model(**inp).logits[valid], ref_blocks[valid], atol=1e-5, rtol=0)
            with pytest.raises(ValueError, match="pass attention_mask as \\[batch, columns\\]"):
                model(**{**inp, "attention_mask": {"full_attention": None, "sliding_attention": None}})
    finally:
        vlm_prune.unwrap(model)
