"""One budget language: every method x every adapter meets ``keep`` / ``budget``.

keep / budget is the number of visual tokens per image (per video for frames methods) that
reach the language model's last layer (the ViT's last block for timm models). For keep in
{1.0, 0.5, 0.25, 0.11, 0.05} and a budget, the achieved count is within one token per image of
the target, or wrap() warned (BudgetWarning) with the reachable value and last_stats carries
the note. keep=1.0 is the unwrapped model, bit for bit.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.frames.holitom import HoliTom
from vlm_prune.frames.prunevid import PruneVid
from vlm_prune.frames.quota import QuoTA
from vlm_prune.methods.base import BudgetWarning
from vlm_prune.registry import available_methods, method_class, method_stages

KEEPS = [1.0, 0.5, 0.25, 0.11, 0.05]
BUDGET = 3
TARGETS = [("keep", k) for k in KEEPS] + [("budget", BUDGET)]


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=12, num_heads=2, num_classes=10)
    with torch.no_grad():
        m.pos_embed.normal_(0, 1.0)
        m.cls_token.normal_(0, 1.0)
    return m.eval()


#: case -> (model builder, inputs builder, adapter family, frames per video (0: images))
CASES = {
    "llava": (T.tiny_llava, lambda m: T.llava_inputs(), "llava", 0),
    "llava_next": (T.tiny_llava_next, T.llava_next_inputs, "llava_next", 0),
    "onevision_image": (T.tiny_onevision, T.onevision_image_inputs, "llava_onevision", 0),
    "onevision_video": (T.tiny_onevision, lambda m: T.onevision_video_inputs(m, frames=4), "llava_onevision", 4),
    "qwen2_vl_image": (T.tiny_qwen2_vl, T.qwen2_vl_inputs, "qwen2_vl", 0),
    "qwen2_vl_video": (T.tiny_qwen2_vl, lambda m: T.qwen2_vl_inputs(m, video=True), "qwen2_vl", 2),
    "timm_vit": (_timm_vit, lambda m: {"x": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))},
                 "timm_vit", 0),
}

_built: dict = {}


def _model(case):
    if case not in _built:
        make, inputs, _, _ = CASES[case]
        model = make()
        _built[case] = (model, inputs(model))
    return _built[case]


def _spec(name):
    if name == "prunevid":  # its selection layer inside the tiny models' 6 decoder layers (default 11)
        return PruneVid(layer=2)
    if name == "holitom":  # its inner merge inside the tiny models' 6 decoder layers (default 18)
        return HoliTom(layer=2)
    if name == "quota":  # a fixed scorer: no processor / prompting needed to test budgets
        return QuoTA(scorer=lambda pixels, prompt: torch.linspace(0.2, 0.9, pixels.shape[0]), variant="v2")
    return name


def _run(model, inp, name, kind, value):
    """(output, last_stats, BudgetWarnings) of one prefill with the method, or None if the
    method does not apply to this model (wrap() says so)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        try:
            vlm_prune.wrap(model, _spec(name), **{kind: value})
        except ValueError as err:
            if any(s in str(err) for s in ("does not offer", "supports", "needs the model's processor", "at least 2 blocks")):
                return None
            raise
    try:
        with torch.no_grad():
            out = model(**inp)
        stats = model.vlm_prune.last_stats
    except ValueError as err:  # VisionZip on OneVision images: no per-token tower row
        if "LLaVA-OneVision videos" in str(err):
            return None
        raise
    finally:
        vlm_prune.unwrap(model)
    notes = [w for w in caught if issubclass(w.category, BudgetWarning)]
    return out, stats, notes


def prefill(model, inp, method, **kw):
    """(output, last_stats, last_rows) of one prefill of ``model`` wrapped with ``method``."""
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            out = model(**inp)
        return out, model.vlm_prune.last_stats, model.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(model)


def _counts(case, stats):
    """(visual tokens in, visual tokens reaching the last layer) per sample."""
    if case == "timm_vit":
        n_in = stats["vit"]["tokens_per_block"][0] - 1  # without the CLS token
        return [n_in] * 2, [stats["vit"]["patches_out"]] * 2
    return stats["visual_tokens_in"], stats["visual_tokens_out"]


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind, value", TARGETS, ids=[f"{k}={v}" for k, v in TARGETS])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", available_methods())
def test_every_method_meets_the_target(name, case, kind, value):
    model, inp = _model(case)
    if "frames" in method_stages(name) and not CASES[case][3]:
        pytest.skip("frames methods choose among a video's frames; this input has none")
    result = _run(model, inp, name, kind, value)
    if result is None:
        cls = method_class(name)
        assert cls.stage not in ("vision", "llm") or CASES[case][2] == "timm_vit" or \
            name in ("visionzip", "fastervlm", "vispruner", "hired", "prumerge") or \
            (cls.supported is not None and CASES[case][2] not in cls.supported), f"{name} should run on {case}"
        pytest.skip(f"{name} does not apply to {case} (wrap() says why)")
    out, stats, notes = result
    n_in, n_out = _counts(case, stats)
    frames = CASES[case][3]
    stage = method_class(name).stage
    # one token per image: a vision method reduces each frame of a video on its own
    units = frames if (frames and stage == "vision") else 1
    for got, n in zip(n_out, n_in):
        if kind == "keep":
            target = max(1, math.floor(value * n + 1e-9))
        else:
            target = min(n, value * units)
        if notes:  # wrap() warned: the note names the reachable value, last_stats keeps it
            assert stats.get("budget_notes")
            continue
        assert abs(got - target) <= units, f"{name} on {case}, {kind}={value}: {got} visual tokens, target {target} of {n}"
    if kind == "keep" and value == 1.0:
        with torch.no_grad():
            ref = _logits(model(**inp))
        got_logits = _logits(out)
        valid = inp["attention_mask"].bool() if "attention_mask" in inp else torch.ones(ref.shape[:-1], dtype=torch.bool)
        assert torch.equal(got_logits[valid], ref[valid]), f"{name} on {case}: keep=1.0 changed the outputs"


def test_wrapping_one_object_twice_applies_each_budget():
    """Method objects are configurations: wrap() never changes them."""
    from vlm_prune.methods import FastV, PACT

    model, inp = _model("llava")
    for method in (FastV(), PACT(layer=2)):
        seen = []
        for keep in (0.5, 0.25, 1.0):
            seen.append(prefill(model, inp, method, keep=keep)[1]["visual_tokens_out"])
        assert seen == [[8, 8], [4, 4], [16, 16]], (method, seen)
        assert method.keep is None and method.budget is None


def test_pipeline_target_is_the_final_count_and_keep_one_is_identity():
    model, inp = _model("llava")
    with torch.no_grad():
        ref = model(**inp).logits
    for keep, final in ((1.0, 16), (0.25, 4), (0.11, 1)):
        out, stats, _ = prefill(model, inp, ["random", "fastv"], keep=keep)
        assert stats["visual_tokens_out"] == [final, final]
        first = stats["stages"][0]["tokens_out"]
        assert all(final <= n <= 16 for n in first)  # the first stage takes its share only
        if keep == 1.0:
            assert torch.equal(out.logits, ref)


def test_layer_averaged_visual_tokens():
    """FastV before layer 2 of 6 at keep 0.25: layers 0-1 see 16 tokens, layers 2-5 see 4."""
    model, inp = _model("llava")
    stats = prefill(model, inp, "fastv", keep=0.25)[1]
    assert stats["visual_tokens_layer_avg"] == [pytest.approx((2 * 16 + 4 * 4) / 6)] * 2


def test_onevision_newline_tokens_are_never_pruned_in_the_llm():
    """The video's newline is not a visual token: not counted, always among the rows the LLM keeps."""
    model, inp = _model("onevision_video")
    newline_row = (inp["input_ids"] == T.VIDEO_TOKEN).int().cumsum(1).argmax(1)  # last video placeholder
    for name in ("fastv", "pact", "adaptinfer"):
        _, stats, rows = prefill(model, inp, name, keep=0.05)
        assert stats["visual_tokens_in"] == [16, 16] and stats["visual_tokens_out"] == [1, 1], name
        for b in range(2):
            assert int(newline_row[b]) in rows[b].tolist(), name


def test_describe_methods_lists_each_methods_knobs_with_defaults():
    described = {d["name"]: d for d in vlm_prune.describe_methods()}
    assert set(described) == set(available_methods())
    assert described["fastv"]["knobs"] == {"layer": 2, "query": "last"}
    assert described["pact"]["knobs"]["rho"] is None and described["pact"]["knobs"]["layer"] == 4
    assert described["adaptinfer"]["knobs"]["average"] is None and described["adaptinfer"]["own_defaults"]
    assert not described["random"]["own_defaults"]  # needs keep / budget
    assert all("keep" not in d["knobs"] and "budget" not in d["knobs"] for d in described.values())


@pytest.mark.parametrize("name", ["random", "pool", "divprune", "cdpruner"])
def test_onevision_image_newlines_never_count_against_a_vision_budget(name):
    """OneVision's anyres image: 32 visual tokens and 4 image_newline rows per image. Vision methods
    see the 32 only, keep the target of them exactly, and every newline row reaches the LLM."""
    model, inp = _model("onevision_image")
    newline = model.model.image_newline
    with torch.no_grad():
        feats = model.model.get_image_features(inp["pixel_values"], inp["image_sizes"],
                                               batch_num_images=torch.ones(2, dtype=torch.long)).pooler_output
    image_rows = [torch.nonzero(inp["input_ids"][b] == T.IMAGE_TOKEN).squeeze(1) for b in range(2)]
    newline_rows = [r[(f == newline).all(-1)] for r, f in zip(image_rows, feats)]
    assert [n.numel() for n in newline_rows] == [4, 4]
    for keep, target in ((0.5, 16), (0.25, 8), (0.05, 1)):
        _, stats, rows = prefill(model, inp, name, keep=keep)
        stage = stats["stages"][0]
        assert stage["tokens_in"] == [32, 32] == stats["visual_tokens_in"], name
        assert stage["tokens_out"] == [target, target] == stats["visual_tokens_out"], (name, keep)
        for b in range(2):
            assert set(newline_rows[b].tolist()) <= set(rows[b].tolist()), (name, keep)


def _llava_next_deep_tower():
    """The tiny LLaVA-NeXT with a 5-layer CLIP tower (4 layers up to the feature layer), so AS-ViT's
    three stages and ToMe's merges have room."""
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(0)
    cfg = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=T._llama(), image_token_id=T.IMAGE_TOKEN, image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
        vision_feature_layer=-2,
    )
    return T._finish(LlavaNextForConditionalGeneration(cfg), "sdpa")


@pytest.mark.parametrize("name", ["asvit", "tome"])
def test_llava_next_vit_budget_is_per_image_split_over_its_tiles(name):
    """keep / budget stay per image on LLaVA-NeXT: the target is split over the image's tiles
    (base + 2 here), ceil(target / 3) each; wrap() says how once, and the stage record gives
    each image's target beside the count reached."""
    model = _llava_next_deep_tower()
    inp = T.llava_next_inputs(model)  # 32 x 64 images: 3 tiles of 16 patches, no unpadding loss
    for kind, value, target, reached in (("budget", 3, 3, 3), ("keep", 0.25, 12, 12), ("budget", 8, 8, 9),
                                         ("budget", 30, 30, 30), ("keep", 0.11, 5, 6)):
        with pytest.warns(BudgetWarning, match="ceil\\(target / tiles\\)"):
            vlm_prune.wrap(model, name, **{kind: value})
        stats = T.forward_stats(model, inp)
        assert stats["visual_tokens_in"] == [48, 48]
        assert stats["stages"][0]["targets"] == [target, target], (kind, value)
        assert stats["visual_tokens_out"] == [reached, reached], (kind, value)
        assert stats["budget_notes"] and target <= reached <= target + 2
    # without keep / budget (the paper's own knob) nothing is split and wrap() has nothing to say
    own = vlm_prune.methods.ToMe(r=2) if name == "tome" else vlm_prune.methods.ASViT(mode="threshold", thresholds=[0, 0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        vlm_prune.wrap(model, own)
    vlm_prune.unwrap(model)


def test_llava_next_vit_budget_counts_the_unpadded_tokens():
    """A 32 x 50 image: unpadding keeps 16 base tokens + 4 rows of 6 tile tokens (and 4 newlines).
    keep=0.5 targets half of those 40, split over 3 tiles (7 each); the unpadding crops some
    survivors, so the image ends near (never over tiles - 1 above) its target."""
    model = _llava_next_deep_tower()
    inp = T.llava_next_inputs(model)
    sizes = torch.tensor([[32, 50]] * 2)
    with torch.no_grad():
        n = model.model.get_image_features(inp["pixel_values"], sizes).pooler_output[0].shape[0]
    assert n == 16 + 4 * 6 + 4
    ids, mask = T.prompts([[(T.IMAGE_TOKEN, n)]] * 2, "left", 1)
    inp = {**inp, "image_sizes": sizes, "input_ids": ids, "attention_mask": mask}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetWarning)
        vlm_prune.wrap(model, "asvit", keep=0.5)
    stats = T.forward_stats(model, inp)
    assert stats["visual_tokens_in"] == [40, 40] and stats["stages"][0]["targets"] == [20, 20]
    assert all(14 <= n <= 22 for n in stats["visual_tokens_out"]), stats["visual_tokens_out"]
