"""QuoTA (arXiv 2503.08689): prompts, parser, weights, allocation, resize variants, the Method."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_prune.frames.quota import (
    QuoTA,
    allocate_tokens,
    cap_weights,
    decouple_prompt,
    frame_prompt,
    frame_weights,
    grid_for,
    merge_tokens,
    parse_decoupled_objects,
    quota_plan,
    resize_frame,
)
from vlm_prune.methods.base import FramesContext
from vlm_prune.registry import make_method


def _features(t: int = 4, rows: int = 4, cols: int = 4, d: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, rows * cols, d, generator=torch.Generator().manual_seed(seed))


# ---- decoupling -----------------------------------------------------------------------------
def test_decouple_prompt_mentions_the_query_and_three_steps():
    text = decouple_prompt("How many red cups are on the table?")
    assert text.startswith("How many red cups are on the table?")
    assert all(f"Step {i}:" in text for i in (1, 2, 3))


@pytest.mark.parametrize(
    "answer, expected",
    [
        ('Step 1: yes\nStep 2: ["cup", "table", "red"]\nStep 3: ["cup", "table"]', ["cup", "table"]),
        ("**Step 1:** Yes\n**Step 2:** ['dog', 'ball']\n**Step 3:** ['dog', 'ball']", ["dog", "ball"]),
        ("Step 1: no", []),
        ("step 1 - NO, nothing physical\nStep 3: ['x']", []),
        ("Step 1: yes\nStep 2: [\u201cman in black\u201d]\nStep 3: [\u201cman in black\u201d, \u201cwoman\u201d]",
         ["man in black", "woman"]),
        ("Step 1: yes\nStep 2: cat\nStep 3: cat, dog.", ["cat", "dog"]),
        ("Step 1: yes\nStep 2: [\"sky\"]\nStep 3: null", []),
        ("Step 1: yes\nStep 3: ```python\n['car', 'car', 'tree']\n```", ["car", "tree"]),
        ("Step 1: yes\nStep 3: [cat, big dog]", ["cat", "big dog"]),  # not a Python literal
        ("I think we need a cat.", []),  # no Step 3 at all
        ("Step 1: yes\nStep 2: ['cat']", []),  # Step 3 missing
        ("", []),
        ("Step 3: [1, 'bird', None]", ["bird"]),
    ],
)
def test_parse_decoupled_objects_messy_answers(answer, expected):
    assert parse_decoupled_objects(answer) == expected


def test_frame_prompts():
    with_objects = frame_prompt("What is he holding?", ["cup", "man"])
    assert with_objects.startswith("Does the image contain any object of cup, man? A. yes B. no")
    without = frame_prompt("What is he holding?", [])
    assert without.startswith("What is he holding?\nDoes the image contain sufficient information")
    assert "A. yes B. no" in without


# ---- weights, allocation, grid --------------------------------------------------------------
def test_weights_are_squared_scaled_scores_normalised():
    w = frame_weights(torch.tensor([0.5, 0.25, 0.0]))
    torch.testing.assert_close(w, torch.tensor([0.8, 0.2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(frame_weights(torch.zeros(4)), torch.full((4,), 0.25, dtype=torch.float64))


def test_floor_budgets():
    w = torch.tensor([0.8, 0.2, 0.0], dtype=torch.float64)
    assert allocate_tokens(w, 10).tolist() == [8, 2, 0]
    assert allocate_tokens(w, 7).tolist() == [5, 1, 0]  # 5.6 -> 5, 1.4 -> 1
    assert allocate_tokens(w, 10, cap=6).tolist() == [6, 2, 0]


@pytest.mark.parametrize(
    "n, grid", [(1, (1, 1)), (2, (2, 1)), (3, (2, 1)), (4, (2, 2)), (5, (2, 2)), (6, (3, 2)),
                (8, (3, 2)), (9, (3, 3)), (12, (4, 3)), (15, (4, 3)), (196, (14, 14)), (210, (15, 14))],
)
def test_grid_growth_rule(n, grid):
    assert grid_for(n) == grid


def test_cap_weights_redistributes_excess():
    w = cap_weights(torch.tensor([0.7, 0.2, 0.1]), 0.4)
    torch.testing.assert_close(w, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64))
    # the first redistribution pushes a second frame over the cap
    w = cap_weights(torch.tensor([0.6, 0.3, 0.1]), 0.35)
    torch.testing.assert_close(w, torch.tensor([0.35, 0.35, 0.3], dtype=torch.float64))
    # a zero-weight frame takes the whole excess; a budget above the video puts all at the cap
    torch.testing.assert_close(cap_weights(torch.tensor([1.0, 0.0]), 0.6), torch.tensor([0.6, 0.4], dtype=torch.float64))
    torch.testing.assert_close(cap_weights(torch.tensor([1.0, 0.0]), 0.4), torch.tensor([0.4, 0.4], dtype=torch.float64))


# ---- resize variants ------------------------------------------------------------------------
def test_v1_bilinear_matches_interpolate_and_is_identity_at_native_size():
    x = _features(1)[0]
    out = resize_frame(x, (4, 4), 6, "v1")  # grid (3, 2)
    ref = F.interpolate(x.t().reshape(1, 6, 4, 4), size=(3, 2), mode="bilinear", align_corners=False)
    torch.testing.assert_close(out, ref[0].reshape(6, 6).t())
    torch.testing.assert_close(resize_frame(x, (4, 4), 16, "v1"), x)
    assert resize_frame(x, (4, 4), 30, "v1").shape == (30, 6)  # (6, 5): upsampling


def test_v2_pools_2x2_blocks():
    x = torch.arange(16.0).reshape(16, 1)  # value = row-major index on a 4x4 grid
    out = resize_frame(x, (4, 4), 4, "v2").flatten()
    assert out.tolist() == [2.5, 4.5, 10.5, 12.5]


def test_v3_subsamples_evenly():
    x = _features(1)[0]
    out = resize_frame(x, (4, 4), 5, "v3")
    torch.testing.assert_close(out, x[[0, 4, 8, 11, 15]])  # round(linspace(0, 15, 5)), half to even


def test_v4_token_merging():
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    torch.testing.assert_close(merge_tokens(torch.stack([a, a, b, b]), 2), torch.stack([a, b]))
    a2 = torch.tensor([1.0, 0.2, 0.0])
    c = torch.tensor([0.0, 0.0, 1.0])
    out = merge_tokens(torch.stack([a, a2, c]), 2)  # a (in A) merges into a2 (in B); c stays
    torch.testing.assert_close(out, torch.stack([(a + a2) / 2, c]))
    out = merge_tokens(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), 3)
    assert out.shape == (3, 4)  # several rounds of at most |A| merges


# ---- the plan -------------------------------------------------------------------------------
def test_zero_token_frames_are_dropped():
    feats = _features(4)
    plan = quota_plan(feats, (4, 4), 32, torch.tensor([1.0, 0.01, 1.0, 0.01]), "v1")
    assert plan.kept_frames == [0, 2]
    # w = 10000 / 20002 -> floor(15.99) = 15 tokens -> grid (4, 3); w = 1 / 20002 -> 0 tokens
    assert plan.tokens_per_frame == [12, 0, 12, 0]
    assert plan.reduction.features.shape[0] == sum(plan.tokens_per_frame)


@pytest.mark.parametrize("variant, per_frame", [("v1", [30, 0, 0, 0]), ("v2", [16, 4, 4, 4]),
                                                ("v3", [16, 5, 5, 5]), ("v4", [16, 5, 5, 5])])
def test_caps_and_redistribution(variant, per_frame):
    feats = _features(4)
    plan = quota_plan(feats, (4, 4), 32, torch.tensor([1.0, 0.0, 0.0, 0.0]), variant)
    assert plan.tokens_per_frame == per_frame
    assert plan.reduction.indices.tolist() == list(range(sum(per_frame)))
    assert plan.reduction.features.shape == (sum(per_frame), 6)


@pytest.mark.parametrize("variant", ["v1", "v2", "v3", "v4"])
def test_total_never_above_budget(variant):
    gen = torch.Generator().manual_seed(7)
    for trial in range(25):
        t = int(torch.randint(1, 9, (1,), generator=gen))
        rows, cols = (int(v) for v in torch.randint(1, 6, (2,), generator=gen))
        n_total = int(torch.randint(1, 2 * t * rows * cols + 1, (1,), generator=gen))
        n_total = min(n_total, t * rows * cols)
        p = torch.rand(t, generator=gen) ** 3
        plan = quota_plan(torch.randn(t, rows * cols, 3, generator=gen), (rows, cols), n_total, p, variant)
        assert 1 <= sum(plan.tokens_per_frame) <= n_total, (trial, plan.tokens_per_frame, n_total)
        assert plan.reduction.features.shape[0] == sum(plan.tokens_per_frame)
        if variant != "v1":
            assert max(plan.tokens_per_frame) <= rows * cols
        assert plan.kept_frames == [i for i, k in enumerate(plan.tokens_per_frame) if k > 0]


def test_keep_everything_with_flat_scores_is_identity():
    feats = _features(3)
    for variant in ("v1", "v2", "v3", "v4"):
        plan = quota_plan(feats, (4, 4), 48, torch.full((3,), 0.7), variant)
        torch.testing.assert_close(plan.reduction.features, feats.reshape(48, 6))


# ---- the Method -----------------------------------------------------------------------------
def _ctx(feats, n_total, **kw) -> FramesContext:
    return FramesContext(features=feats, grid=(4, 4), n_total=n_total, **kw)


@pytest.mark.parametrize("variant", ["v1", "v3"])
def test_stub_scorer_keeps_exactly_the_preferred_frames(variant):
    feats = _features(5)
    seen = []

    def score_frames(prompts):
        seen.append(prompts)
        return torch.tensor([0.0, 0.9, 0.0, 0.9, 0.0])

    method = QuoTA(budget=32, variant=variant, decouple=False)
    plan = method.allocate(_ctx(feats, 32, query="Where is the cat?", score_frames=score_frames))
    assert plan.kept_frames == [1, 3] and plan.tokens_per_frame == [0, 16, 0, 16, 0]
    torch.testing.assert_close(plan.reduction.features, feats[[1, 3]].reshape(32, 6))
    assert seen == [[frame_prompt("Where is the cat?", [])]]
    torch.testing.assert_close(plan.frame_scores, torch.tensor([0.0, 0.9, 0.0, 0.9, 0.0]))


def test_decoupled_objects_reach_the_custom_scorer():
    feats = _features(3)
    prompts = []

    def scorer(pixels, prompt):
        prompts.append(prompt)
        return pixels.mean(dim=(1, 2, 3))  # brighter frames score higher

    pixels = torch.stack([torch.full((3, 8, 8), v) for v in (0.1, 0.9, 0.2)])
    method = QuoTA(variant="v3", scorer=scorer)
    ctx = _ctx(feats, 16, query="Is the dog asleep?", pixels=pixels,
               generate_text=lambda prompt: "Step 1: yes\nStep 2: ['dog', 'sleep']\nStep 3: ['dog']")
    plan = method.allocate(ctx)
    assert prompts == [frame_prompt("Is the dog asleep?", ["dog"])]
    assert plan.tokens_per_frame[1] == max(plan.tokens_per_frame)


def test_method_errors_and_registry():
    feats = _features(2)
    with pytest.raises(ValueError, match="frame scorer"):
        QuoTA(budget=8).allocate(_ctx(feats, 8, query="why?"))
    with pytest.raises(ValueError, match="2 frames"):
        QuoTA(budget=8).allocate(_ctx(feats, 8, query="why?", score_frames=lambda p: torch.ones(3)))
    with pytest.raises(ValueError, match="variant"):
        QuoTA(variant="v9")
    # without a query every frame scores 1: uniform allocation
    plan = QuoTA(budget=16).allocate(_ctx(feats, 16))
    assert plan.tokens_per_frame == [6, 6]  # 8 tokens each -> grid (3, 2)
    method = make_method("quota", keep=0.25, variant="v2")
    assert isinstance(method, QuoTA) and method.n_keep(5 * 16) == 20
    assert method.describe()["variant"] == "v2"
