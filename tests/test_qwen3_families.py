"""What Qwen3-VL and GLM-4.xV need beyond the shared invariants / generate() matrix (which run on
them too): DeepStack features follow every removal and merge, slot-packing frames methods are
refused, GLM's video frames (image placeholders) are told apart from images."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tiny_models_qwen3 as Q
import vlm_prune
from reference import capture_lm_inputs, float_mask, injections_of, positions_of, recording, run_layers
from vlm_prune.frames.quota import QuoTA
from vlm_prune.methods import PACT
from vlm_prune.methods.simple import pool_cells

_MODELS: dict = {}


def model(name: str):
    if name not in _MODELS:
        _MODELS[name] = {"qwen3_vl": Q.tiny_qwen3_vl, "glm4v": Q.tiny_glm4v, "qwen3_5": Q.tiny_qwen3_5}[name]()
    return _MODELS[name]


def test_deepstack_changes_the_output():
    """The tiny Qwen3-VL's DeepStack additions matter (else the tests below could not fail)."""
    m = model("qwen3_vl")
    inp = Q.qwen3_vl_inputs(m)
    with torch.no_grad(), capture_lm_inputs(m) as seen:
        full = m(**inp).logits
    cap = seen[0]
    lm = m.model.language_model
    with torch.no_grad():
        plain = m.lm_head(lm(inputs_embeds=cap["inputs_embeds"], position_ids=cap["position_ids"],
                             attention_mask=inp["attention_mask"]).last_hidden_state)
    assert (full - plain).abs().max() > 1e-2


def test_pool_pools_the_deepstack_features_too():
    """Pool writes each pooled cell's average into one slot: the DeepStack maps the language
    model receives hold the same average of the same cells (torch's adaptive pooling of the
    unwrapped tower's maps), at the same kept slots."""
    assert_deepstack_pooled("pool", keep=0.5, video=False)


def assert_deepstack_pooled(methods, keep: float, video: bool) -> None:
    """Wrapped with ``methods`` at ``keep`` (8 of each image's / kept slice's 16 tokens left), the
    DeepStack maps at each sample's kept slots are torch's adaptive pooling of the unwrapped tower's
    maps of the image / of the slice the frames stage kept."""
    m = model("qwen3_vl")
    inp = Q.qwen3_vl_inputs(m, video=video)
    key = "video" if video else "image"
    with torch.no_grad():
        encode = m.model.get_video_features if video else m.model.get_image_features
        maps = encode(inp[f"pixel_values{'_videos' if video else ''}"], inp[f"{key}_grid_thw"]).deepstack_features
    vlm_prune.wrap(m, methods, keep=keep)
    try:
        with torch.no_grad(), capture_lm_inputs(m) as seen:
            m(**inp)
        rows = m.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(m)
    mask, full = injections_of(seen[0])
    bands = pool_cells(4, 4, 8)  # two bands of four cells: a 2 x 4 adaptive pooling grid
    r, c = len(bands), bands[0]
    assert bands == [c] * r
    for b in range(2):
        slots = torch.nonzero(inp["mm_token_type_ids"][b] > 0).squeeze(1)
        kept = rows[b][rows[b] >= 0]
        kept_visual = kept[mask[b, kept]]
        assert kept_visual.numel() == r * c
        t = int(torch.nonzero(slots == kept_visual[0]).squeeze()) // 16  # the slice kept (0 for an image)
        for layer, per_item in enumerate(maps):
            grid = per_item[b][16 * t : 16 * (t + 1)].t().reshape(1, -1, 4, 4)
            expected = F.adaptive_avg_pool2d(grid, (r, c))[0].reshape(grid.shape[1], -1).t()
            torch.testing.assert_close(full[layer, b, kept_visual], expected, atol=1e-6, rtol=0)


def test_a_merge_before_a_deepstack_layer_merges_its_features():
    """PACT before decoder layer 1 (DeepStack adds after layers 0 and 1): a cluster's row gets the
    size-weighted mean of its members' layer-1 additions. Reference: the unwrapped decoder layers
    on the whole sequence, removed rows masked as keys from layer 1 on, the centres' hidden states
    replaced by the merged ones and log(size) on their keys, the centres' layer-1 additions
    replaced by the members' mean."""
    m = model("qwen3_vl")
    inp = Q.qwen3_vl_inputs(m)
    method = recording(PACT, layer=1, rho=0.75, cutoff=0.6)
    vlm_prune.wrap(m, method)
    try:
        with torch.no_grad():
            logits = m(**inp).logits
        rows = m.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(m)
    seen_select = method.seen
    with torch.no_grad(), capture_lm_inputs(m) as seen:
        m(**inp)
    cap = seen[0]
    embeds = cap["inputs_embeds"]
    b, s, d = embeds.shape
    mask, inject = injections_of(cap)
    inject = inject.clone()
    valid = inp["attention_mask"].bool()
    kept = torch.zeros(b, s, dtype=torch.bool)
    centre = torch.zeros(b, s, dtype=torch.bool)
    feats = torch.zeros(b, s, d)
    sizes = torch.ones(b, s)
    merges = 0
    for i, red in enumerate(seen_select["reds"]):
        origin = seen_select["origin"][i]
        kept[i, origin[red.indices]] = True
        centre[i, origin[red.indices]] = True
        feats[i, origin[red.indices]] = red.features.float()
        sizes[i, origin[red.indices]] = red.sizes.float()
        into = red.merged_into
        for row in red.indices.tolist():
            members = origin[torch.nonzero(into == row).squeeze(1)]
            if members.numel() > 1:
                merges += 1
                inject[1, i, origin[row]] = inject[1, i, members].mean(0)  # every member has size 1 here
    assert merges > 0, "the test needs at least one real merge"
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    before = causal & valid[:, None, :]
    after = before & kept[:, None, :]
    bias = torch.log(sizes).masked_fill(~kept, 0.0)
    m_before, m_after = float_mask(before, embeds.dtype), float_mask(after, embeds.dtype, bias)
    replace = (1, lambda h: torch.where(centre[..., None], feats.to(h.dtype), h))
    with torch.no_grad():
        ref = run_layers(m, embeds, positions_of(cap, b, s), lambda i: m_before if i < 1 else m_after, replace,
                         (mask, inject))
    for i in range(b):
        k = rows[i] >= 0
        torch.testing.assert_close(logits[i, k], ref[i, rows[i][k]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_vl", "glm4v"])
def test_quota_is_refused_at_wrap_time_with_the_reason(name):
    m = model(name)
    fixed = QuoTA(scorer=lambda pixels, prompt: torch.linspace(0.9, 0.1, pixels.shape[0]))
    with pytest.raises(ValueError, match="supports videos laid out as one run.*timestamp.*frames='uniform'"):
        vlm_prune.wrap(m, frames=fixed, keep=0.5)
    assert not hasattr(m, "vlm_prune")


@pytest.mark.parametrize("frames", ["uniform", "keyscore"])
@pytest.mark.parametrize("name, inputs", [("qwen3_vl", Q.qwen3_vl_inputs), ("glm4v", Q.glm4v_inputs),
                                          ("qwen3_5", Q.qwen3_vl_inputs)])
def test_frames_methods_drop_whole_slices_at_their_own_slots(name, inputs, frames):
    """A video of 2 temporal slices, each its own run behind its timestamp: uniform / KeyScore frames
    at keep 0.5 keep one slice per sample, at its own slots; the stage says video (GLM: told from
    images by mm_token_type_ids, although both use the image placeholder)."""
    m = model(name)
    inp = inputs(m, video=True)
    vlm_prune.wrap(m, frames=frames, keep=0.5)
    try:
        with torch.no_grad():
            m(**inp)
        stats, rows = m.vlm_prune.last_stats, m.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(m)
    stage = stats["stages"][0]
    assert (stage["stage"], stage["modality"]) == ("frames", "video")
    per_frame = [v["tokens_per_frame"] for v in stage["videos"]]
    assert all(sorted(p) == [0, 16] for p in per_frame), per_frame
    slots = torch.nonzero(inp["mm_token_type_ids"] == 2)
    for b in range(2):
        mine = slots[slots[:, 0] == b, 1]
        slice_slots = mine[16 * per_frame[b].index(16):][:16]  # the kept slice's own run
        kept = rows[b][rows[b] >= 0]
        assert torch.equal(kept[torch.isin(kept, mine)], slice_slots)


def test_a_frames_and_pool_pipeline_pools_the_kept_slices_deepstack_features():
    """uniform + pool on a Qwen3-VL video (keep 0.25 of 2 slices x 16 tokens: one slice, pooled to 8):
    the DeepStack maps at the kept slots are the adaptive pooling of the kept slice's maps."""
    assert_deepstack_pooled(["uniform", "pool"], keep=0.25, video=True)


@pytest.mark.parametrize("build", [lambda: Q.tiny_qwen3_vl(moe=True), lambda: Q.tiny_qwen3_5(moe=True)],
                         ids=["qwen3_vl_moe", "qwen3_5_moe"])
def test_moe_router_logits_are_refused_and_plain_calls_run(build):
    """A wrapped MoE model runs (its forward reads router_logits from the language model's output,
    None there) and refuses output_router_logits: the layers' rows differ after a removal."""
    m = build()
    inp = Q.qwen3_vl_inputs(m)
    with torch.no_grad():
        ref = m(**inp).logits
    vlm_prune.wrap(m, "random", keep=1.0)
    try:
        with torch.no_grad():
            assert torch.equal(m(**inp).logits, ref)
            with pytest.raises(ValueError, match="output_router_logits.*unwrap"):
                m(**inp, output_router_logits=True)
    finally:
        vlm_prune.unwrap(m)


@pytest.mark.parametrize("build, inputs", [
    pytest.param(Q.tiny_qwen3_vl, Q.qwen3_vl_inputs, id="qwen3_vl"),
    pytest.param(lambda: Q.tiny_qwen3_vl(moe=True), Q.qwen3_vl_inputs, id="qwen3_vl_moe"),
    pytest.param(Q.tiny_qwen3_5, Q.qwen3_vl_inputs, id="qwen3_5"),
    pytest.param(lambda: Q.tiny_qwen3_5(moe=True), Q.qwen3_vl_inputs, id="qwen3_5_moe"),
    pytest.param(Q.tiny_glm4v, Q.glm4v_inputs, id="glm4v"),
])
def test_placeholders_that_do_not_match_the_grids_get_the_clear_message_in_generate(build, inputs):
    """generate() builds M-RoPE positions from the placeholders before the model runs, where transformers
    fails with a bare "shape mismatch" (or StopIteration); the wrapped model says what is wrong first:
    a placeholder missing, one too many, an image's pixels and grid missing."""
    m = build()
    inp = inputs(m, batch=2)
    ids, tok = inp["input_ids"], m.config.image_token_id
    first, last = int((ids[0] == tok).nonzero()[0]), int((ids[0] == tok).nonzero()[-1])
    missing, extra = ids.clone(), ids.clone()
    missing[0, first], extra[0, last + 2] = 7, tok
    cases = [({"input_ids": missing}, 31, "2 images of 16, 16 tokens"),
             ({"input_ids": extra}, 33, "2 images of 16, 16 tokens"),
             ({"pixel_values": inp["pixel_values"][:64], "image_grid_thw": inp["image_grid_thw"][:1]}, 32, "1 image of 16 tokens")]
    vlm_prune.wrap(m, "random", keep=0.5)
    try:
        for change, tokens, items in cases:
            bad = {**inp, **change, "mm_token_type_ids": (change.get("input_ids", ids) == tok).int()}
            with pytest.raises(ValueError) as err, torch.no_grad():
                m.generate(**bad, max_new_tokens=2)
            assert str(err.value).startswith(f"Image features and image tokens do not match, tokens: {tokens}, "
                                              f"features: {32 if '2 images' in items else 16} rows ({items}): the input "
                                              f"has {tokens} image placeholder tokens; build it with the model's processor")
        with torch.no_grad():
            m.generate(**inp, max_new_tokens=2)  # the right inputs still run
    finally:
        vlm_prune.unwrap(m)
