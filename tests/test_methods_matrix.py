"""Every token method on every VLM family where its preconditions hold: SDPA, batch 2 with
padding, a 20-step generate, and the keep ratio honoured in the stats."""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import tiny_models_llavalike as L
import tiny_models_qwen3 as Q
import vlm_prune
from vlm_prune.registry import method_class

MODELS = {
    "llava": (T.tiny_llava, lambda m: T.llava_inputs()),
    "llava_next": (T.tiny_llava_next, T.llava_next_inputs),
    "onevision": (T.tiny_onevision, lambda m: T.onevision_video_inputs(m, frames=4)),
    "qwen2_vl": (T.tiny_qwen2_vl, lambda m: T.qwen2_vl_inputs(m)),
    "mistral3": (L.tiny_mistral3, L.mistral3_inputs),
    "internvl": (L.tiny_internvl, L.internvl_inputs),
    "nextvideo": (L.tiny_llava_next_video, L.llava_next_video_inputs),
    "gemma3": (L.tiny_gemma3, L.gemma3_inputs),
    "ov15": (L.tiny_onevision15, L.onevision15_inputs),
    "qwen3_vl": (Q.tiny_qwen3_vl, lambda m: Q.qwen3_vl_inputs(m)),
    "glm4v": (Q.tiny_glm4v, lambda m: Q.glm4v_inputs(m)),
    "qwen3_5": (Q.tiny_qwen3_5, lambda m: Q.qwen3_vl_inputs(m)),
    "smolvlm": (L.tiny_smolvlm, L.smolvlm_inputs),
    "videollama3": (L.tiny_videollama3, L.videollama3_inputs),
}
TOKEN_METHODS = ["random", "pool", "divprune", "cdpruner", "visionzip", "fastv", "pact", "adaptinfer",
                 "fastervlm", "vispruner", "dart", "pdrop", "hired", "prumerge", "framefusion", "sparsevlm", "mustdrop"]
EXACT = {"random", "pool", "divprune", "cdpruner", "visionzip", "fastv", "fastervlm", "vispruner", "dart", "hired", "prumerge"}
#: in-LLM methods that land exactly on the target per video / image (floor(keep n) visual tokens reach the last layer)
EXACT_LLM = {"framefusion"}
#: (family, method) whose call (not wrap) is refused, with the message: the input lacks what the method needs
CALL_REFUSALS = {("nextvideo", "hired"): "hired .* runs on LLaVA-NeXT and LLaVA-1.5 images"}
#: (family, method) run with these knobs: PACT's default layer 4 is past the tiny Qwen3.5's 4 layers (2 reads the
#: keys of full-attention layer 1: layer 2 is a linear-attention layer)
KNOBS = {("qwen3_5", "pact"): {"layer": 2}}
_built: dict = {}


def model_and_inputs(name):
    if name not in _built:
        make, inputs = MODELS[name]
        model = make()
        _built[name] = (model, inputs(model))
    return _built[name]


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_method_runs_and_honours_keep(family, method):
    model, inp = model_and_inputs(family)
    cls = method_class(method)
    adapter_family = {"onevision": "llava_onevision", "nextvideo": "llava_next_video", "ov15": "llava_onevision15"}.get(family, family)
    if cls.supported is not None and adapter_family not in cls.supported:
        with pytest.raises(ValueError, match="supports"):
            vlm_prune.wrap(model, method, keep=0.5)
        return
    vlm_prune.wrap(model, cls(**KNOBS[family, method]) if (family, method) in KNOBS else method, keep=0.5)
    if (family, method) in CALL_REFUSALS:
        try:
            with pytest.raises(ValueError, match=CALL_REFUSALS[family, method]):
                model.generate(**inp, max_new_tokens=2)
        finally:
            vlm_prune.unwrap(model)
        return
    try:
        with torch.no_grad():
            gen = model.generate(**inp, max_new_tokens=20, min_new_tokens=20, do_sample=False)
            stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    assert gen.shape == (2, inp["input_ids"].shape[1] + 20)
    n_in = stats["visual_tokens_in"]
    n_out = stats["visual_tokens_out"]
    stage = stats["stages"][0]
    per_item = stage["tokens_in"]
    if method in EXACT:  # (OneVision video: per frame, 4 frames x floor(0.5 * 4))
        assert stage["tokens_out"] == [max(1, int(0.5 * n)) for n in per_item]
    elif method in EXACT_LLM:
        assert n_out == [max(1, int(0.5 * n)) for n in n_in], (n_in, n_out)
    else:
        assert all(0 < o <= i // 2 + 1 for i, o in zip(n_in, n_out)), (n_in, n_out)


@pytest.mark.parametrize("family", ["llava", "onevision"])
def test_visionzip_tower_attention_equals_eager_weights(family):
    """The tower attention VisionZip ranks by (computed on the side from the feature layer's
    input) equals the tower's own eager attention weights: the CLS row on CLIP, the attention
    each token receives on SigLIP, pooled to the frame grid as OneVision pools its features."""
    from vlm_prune.adapters.vision_towers import pool_grid
    from vlm_prune.methods import VisionZip

    model = (T.tiny_llava if family == "llava" else T.tiny_onevision)(attn="eager")
    inp = T.llava_inputs() if family == "llava" else T.onevision_video_inputs(model, frames=3)
    seen = []

    class Recording(VisionZip):
        def reduce_image(self, ctx):
            seen.append(ctx.tower_attention()[0])
            return super().reduce_image(ctx)

    vlm_prune.wrap(model, Recording(), keep=0.5)
    try:
        with torch.no_grad():
            model(**inp)
    finally:
        vlm_prune.unwrap(model)
    pixels = inp["pixel_values"] if family == "llava" else inp["pixel_values_videos"].flatten(0, 1)
    with torch.no_grad():
        layer = 0 if family == "llava" else -1  # vision_feature_layer -2 (LLaVA) / -1 (OneVision)
        att = model.model.vision_tower(pixels, output_attentions=True).attentions[layer]
    if family == "llava":
        expected = att[:, :, 0, 1:].mean(1)
    else:
        expected = torch.stack([pool_grid(a.mean(0).mean(0), (4, 4), (2, 2)) for a in att])
    torch.testing.assert_close(torch.stack(seen), expected.float(), atol=1e-5, rtol=0)


def test_visionzip_on_onevision_images_says_what_is_supported():
    """OneVision's anyres image tiles have no per-token tower row: a clear error at run time (the
    same wrapped model takes videos, where VisionZip runs)."""
    model = T.tiny_onevision()
    vlm_prune.wrap(model, "visionzip", keep=0.5)
    try:
        with pytest.raises(ValueError, match="LLaVA-OneVision videos"), torch.no_grad():
            model(**T.onevision_image_inputs(model))
        with torch.no_grad():
            model(**T.onevision_video_inputs(model, frames=2))
        stats = model.vlm_prune.last_stats
        assert all(o < i for o, i in zip(stats["visual_tokens_out"], stats["visual_tokens_in"]))
    finally:
        vlm_prune.unwrap(model)
