"""Frames + vision pipelines honour the target (README "Budgets"): the frames stage leaves its share
of the video's tokens, the vision stage reduces each kept frame so that the video lands on the
pipeline rule's count - the target when it is the last stage. Every frames x vision pair, on the
tiny LLaVA-OneVision and Qwen2-VL video models."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import vlm_prune
from vlm_prune.methods.base import BudgetWarning, Reduction, apportion
from vlm_prune.registry import available_methods, method_class
from test_budgets import _model, _spec, prefill

FRAMES = [n for n in available_methods() if method_class(n).stage == "frames"]
VISION = [n for n in available_methods() if method_class(n).stage == "vision"]
TARGETS = [("keep", 1.0), ("keep", 0.5), ("keep", 0.25), ("keep", 0.11), ("budget", 3)]
#: the video cases of test_budgets (tiny OneVision, 4 frames of 2 x 2 tokens; tiny Qwen2-VL, 2 temporal
#: slices of 4 x 4), with their adapter families
MODELS = {"onevision_video": "llava_onevision", "qwen2_vl_video": "qwen2_vl"}


def _frames_spec(frames):
    """The frames method of a pair: HoliTom's outer stage (its inner merge takes the llm stage and
    refuses other methods), the others as test_budgets builds them."""
    if frames == "holitom":
        from vlm_prune.frames.holitom import HoliTom

        return HoliTom(inner=False)
    return _spec(frames)


def _refusal(frames, vision, family):
    """The message wrap() must refuse the pair with on this family, or None."""
    if method_class(frames).resizes_frames and method_class(vision).needs_tower_attention:
        return f"resizes or merges away; after '{frames}' use random, pool, divprune or cdpruner"
    if method_class(frames).supported is not None and family not in method_class(frames).supported:
        return "supports"
    if method_class(vision).supported is not None and family not in method_class(vision).supported:
        return "supports"
    return None


@pytest.mark.parametrize("kind, value", TARGETS, ids=[f"{k}={v}" for k, v in TARGETS])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("vision", VISION)
@pytest.mark.parametrize("frames", FRAMES)
def test_frames_and_vision_pipeline_meets_the_target(frames, vision, model_name, kind, value):
    model, inp = _model(model_name)
    refusal = _refusal(frames, vision, MODELS[model_name])
    if refusal:
        with pytest.raises(ValueError, match=refusal):
            vlm_prune.wrap(model, [_frames_spec(frames), vision], **{kind: value})
        assert not vlm_prune.api.is_wrapped(model)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        vlm_prune.wrap(model, [_frames_spec(frames), vision], **{kind: value})
    try:
        with torch.no_grad():
            out = model(**inp)
        stats = model.vlm_prune.last_stats
    finally:
        vlm_prune.unwrap(model)
    warned = any(issubclass(w.category, BudgetWarning) for w in caught)
    frames_rec, vision_rec = stats["stages"]
    assert (frames_rec["stage"], frames_rec["method"], vision_rec["stage"], vision_rec["method"]) == \
        ("frames", frames, "vision", vision)
    assert vision_rec["tokens_in"] == frames_rec["tokens_out"] and vision_rec["tokens_out"] == stats["visual_tokens_out"]
    for n, mid, got, planned, video in zip(stats["visual_tokens_in"], frames_rec["tokens_out"],
                                           stats["visual_tokens_out"], frames_rec["videos"], vision_rec["videos"]):
        target = max(1, math.floor(value * n + 1e-9)) if kind == "keep" else min(n, value)
        asked, kept = video["targets"], video["tokens_per_frame"]
        assert sum(kept) == got and all(0 <= k <= a <= p for k, a, p in zip(kept, asked, planned["tokens_per_frame"]))
        if warned and mid < target:  # QuoTA's official allocation fell short already (warned)
            assert got == mid
            continue
        # the vision stage asks the frames for exactly the target, shared by their tokens
        assert mid >= target and sum(asked) == target, (frames, vision, n, mid, asked, target)
        assert kept == asked and got == target, f"{frames}+{vision} on {model_name}, {kind}={value}: {got} of {n}"
    if kind == "keep" and value == 1.0:
        with torch.no_grad():
            ref = model(**inp).logits
        valid = inp["attention_mask"].bool()
        assert torch.equal(out.logits[valid], ref[valid])


def test_the_issue_case_keyscore_divprune_at_a_quarter():
    """keyscore+divprune at keep 0.25 (the demo's preset): a quarter of the video, not a half."""
    stats = prefill(*_model("onevision_video"), ["keyscore", "divprune"], keep=0.25)[1]
    assert stats["visual_tokens_in"] == [16, 16] and stats["visual_tokens_out"] == [4, 4]
    assert [r["tokens_out"] for r in stats["stages"]] == [[8, 8], [4, 4]]  # sqrt(0.25) of 16, then the target


def test_three_stage_pipeline_shares_the_reduction_evenly():
    """uniform+divprune+pact at keep 0.25 of 16: stage i of 3 leaves round(16 * 0.25 ** (i / 3))
    at most (uniform keeps whole frames of 4 tokens: 8 of its 10), the last lands on 4."""
    stats = prefill(*_model("onevision_video"), ["uniform", "divprune", "pact"], keep=0.25)[1]
    assert [r["stage"] for r in stats["stages"]] == ["frames", "vision", "llm"]
    assert [r["tokens_out"] for r in stats["stages"]] == [[8, 8], [round(16 * 0.25 ** (2 / 3))] * 2, [4, 4]]


def test_visionzip_after_uniform_reports_merges_over_the_video_slots():
    stats = prefill(*_model("onevision_video"), ["uniform", "visionzip"], keep=0.25)[1]
    record = stats["stages"][1]
    assert [v["targets"] for v in record["videos"]] == [[2, 0, 0, 2]] * 2  # uniform keeps frames 0 and 3 of 4
    for into, frames in zip(record["merged_into"], stats["stages"][0]["videos"]):
        assert len(into) == 16
        dropped = [t for t, k in enumerate(frames["tokens_per_frame"]) if k == 0]
        assert all(into[t * 4 + j] == -1 for t in dropped for j in range(4))  # dropped frames merge nowhere
        assert len({v for v in into if v >= 0}) == 4  # the four tokens kept


def test_apportion_shares_in_proportion():
    assert apportion(8, [4, 4]) == [4, 4]
    assert apportion(7, [4, 4, 4]) == [3, 2, 2]
    assert apportion(2, [4, 4, 4]) == [1, 1, 0]
    assert apportion(10, [3, 5, 9]) == [2, 3, 5]
    assert apportion(100, [3, 5]) == [3, 5]
    for total in range(0, 18):
        shares = apportion(total, [3, 5, 9])
        assert sum(shares) == total and all(0 <= s <= n for s, n in zip(shares, [3, 5, 9]))


def test_reduction_then_composes_slots_features_and_merges():
    first = Reduction(torch.tensor([1, 3, 4, 6]))  # of 8 rows
    feats = torch.arange(6.0).reshape(2, 3)
    after = Reduction(torch.tensor([0, 2]), features=feats, sizes=torch.tensor([2.0, 2.0]),
                      merged_into=torch.tensor([0, 0, 2, 2]))
    out = first.then(after, 8)
    assert out.indices.tolist() == [1, 4] and torch.equal(out.features, feats)
    assert out.sizes.tolist() == [2.0, 2.0]
    assert out.merged_into.tolist() == [-1, 1, -1, 1, 4, -1, 4, -1]
