"""SmolVLM / Idefics3 quirks (adapters/smolvlm.py): an image is several tile runs up to its global
tile, encoder entries per sample, video frames as one-tile images; with the real processors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import tiny_models_llavalike as L
import vlm_prune
from tiny_models import IMAGE_TOKEN
from reference import grid_recording
from vlm_prune.methods.simple import Random

_built: dict = {}


def model_and_processor(idefics3: bool = False):
    if not idefics3:
        pytest.importorskip("num2words")  # SmolVLMProcessor needs it
    if idefics3 not in _built:
        _built[idefics3] = (L.tiny_smolvlm(idefics3=idefics3), L.smolvlm_processor(idefics3=idefics3))
    return _built[idefics3]


def picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def processed(proc, images: list[list[Image.Image]], **kw) -> dict:
    conv = lambda n: [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": "what colour ?"}]}]
    texts = [proc.apply_chat_template(conv(len(imgs)), add_generation_prompt=True) for imgs in images]
    return dict(proc(text=texts, images=images, padding=True, return_tensors="pt", **kw))


def stats_of(model, method, inp, **kw):
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            logits = model(**inp).logits
        return logits, model.vlm_prune.last_stats, model.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.parametrize("idefics3", [False, True])
def test_the_processors_tiles_are_grouped_into_images_with_per_image_budgets(idefics3):
    """The real processor splits a 32 x 64 picture into 1 x 2 tiles + its global tile (48 tokens) and a
    square one into 2 x 2 + global (80 tokens), each tile its own run behind a row / global token: the
    adapter counts one item per picture, keep / budget per picture, and keep=1.0 is the unwrapped model."""
    model, proc = model_and_processor(idefics3)
    inp = processed(proc, [[picture(32, 64, 0)], [picture(40, 40, 1), picture(32, 64, 2)]])
    assert inp["pixel_values"].shape[:2] == (2, 8)  # tiles of the fullest sample, padding tiles all zero
    with torch.no_grad():
        ref = model(**inp).logits
    logits, stats, _ = stats_of(model, "random", inp, keep=1.0)
    valid = inp["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], ref[valid], atol=1e-5, rtol=0)
    assert stats["stages"][0]["tokens_in"] == [48, 80, 48]
    assert stats["visual_tokens_in"] == [48, 128]
    method = grid_recording(Random)
    _, stats, rows = stats_of(model, method, inp, keep=0.5)
    assert stats["stages"][0]["tokens_out"] == [24, 40, 24]
    assert method.grids == [None, None, None]  # several tiles: no single rectangular grid
    # each picture keeps its share inside its own tiles: sample 1's first 80 placeholders are its first picture
    ids = inp["input_ids"]
    for b, spans, expected in ((0, [(0, 48)], [24]), (1, [(0, 80), (80, 128)], [40, 24])):
        slots = torch.nonzero(ids[b] == IMAGE_TOKEN).squeeze(1)
        kept = torch.isin(slots, rows[b][rows[b] >= 0])
        assert [int(kept[a:z].sum()) for a, z in spans] == expected
    _, stats, _ = stats_of(model, "divprune", inp, budget=6)
    assert stats["stages"][0]["tokens_out"] == [6, 6, 6]


def test_an_unsplit_image_is_one_tile_on_its_square_grid():
    model, proc = model_and_processor()
    inp = processed(proc, [[picture(32, 64, 0), picture(40, 40, 1)]], do_image_splitting=False)
    assert int((inp["input_ids"] == IMAGE_TOKEN).sum()) == 32
    method = grid_recording(Random)
    _, stats, _ = stats_of(model, method, inp, keep=0.25)
    assert stats["stages"][0]["tokens_in"] == [16, 16] and stats["stages"][0]["tokens_out"] == [4, 4]
    assert method.grids == [(4, 4), (4, 4)]  # pixel shuffle 8 x 8 patches -> 4 x 4 tokens, row-major


def test_video_frames_are_pruned_as_images_and_frames_methods_are_refused():
    """SmolVLM2's processor writes each frame as a global tile behind its timestamp text and hands the
    frames over as images: each frame is an item with the per-image budget; frames methods are not
    offered (nothing in the model's inputs says which images are frames)."""
    model, proc = model_and_processor()
    frames = np.random.default_rng(0).integers(0, 255, (4, 32, 32, 3), dtype=np.uint8)
    conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what ?"}]}]
    text = proc.apply_chat_template(conv, add_generation_prompt=True)
    inp = dict(proc(text=[text], videos=[frames], return_tensors="pt"))
    assert "pixel_values_videos" not in inp and inp["pixel_values"].shape[:2] == (1, 4)
    _, stats, _ = stats_of(model, "divprune", inp, budget=5)
    assert stats["stages"][0]["tokens_in"] == [16] * 4 and stats["stages"][0]["tokens_out"] == [5] * 4
    for name in ("uniform", "keyscore"):
        with pytest.raises(ValueError, match=f"method '{name}' works in the 'frames' stage, which the smolvlm adapter does not offer"):
            vlm_prune.wrap(model, name, keep=0.5)


@pytest.mark.parametrize("method, message", [
    ("visionzip", "method 'visionzip' supports llava, llava_onevision models; this model is handled by the 'smolvlm' adapter"),
    ("tome", "method 'tome' works in the 'vit' stage, which the smolvlm adapter does not offer"),
])
def test_tower_methods_are_refused_at_wrap_time(method, message):
    model, _ = model_and_processor()
    with pytest.raises(ValueError, match=message):
        vlm_prune.wrap(model, method, keep=0.5)
    assert not hasattr(model, "vlm_prune")


def test_inputs_embeds_find_the_images_as_input_ids_do():
    """With inputs_embeds the global-image marker is read from the embeddings: the same items, kept rows
    and logits as the input_ids call."""
    model, _ = model_and_processor()
    inp = L.smolvlm_inputs(model)
    ref, ref_stats, ref_rows = stats_of(model, "random", inp, keep=0.5)
    embeds = dict(inp)
    embeds["inputs_embeds"] = model.get_input_embeddings()(embeds.pop("input_ids"))
    logits, stats, rows = stats_of(model, "random", embeds, keep=0.5)
    assert stats["stages"][0]["tokens_in"] == ref_stats["stages"][0]["tokens_in"] == [48, 16, 16]
    assert torch.equal(rows, ref_rows)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_a_tile_run_of_the_wrong_length_is_refused_with_the_fix():
    model, _ = model_and_processor()
    inp = L.smolvlm_inputs(model, batch=1)
    ids = inp["input_ids"]
    first = int(torch.nonzero(ids[0] == IMAGE_TOKEN)[0, 0])
    inp["input_ids"] = torch.cat([ids[:, :first], ids[:, first + 1:], ids[:, :1]], 1)  # one placeholder short
    inp["attention_mask"] = torch.ones_like(inp["input_ids"])
    vlm_prune.wrap(model, "random", keep=0.5)
    try:
        with pytest.raises(ValueError, match=r"runs of \[15, 16, 16\] tokens; every tile is one run of image_seq_len=16"):
            with torch.no_grad():
                model(**inp)
    finally:
        vlm_prune.unwrap(model)
