"""QuoTA (arXiv 2503.08689): prompts, parser, weights, allocation, resize variants, the Method."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlm_prune.frames.quota import (
    PLAIN_PROMPTS,
    FramePrompts,
    QuoTA,
    allocate_tokens,
    cap_weights,
    decouple_prompt,
    decoupling_finished,
    frame_prompt,
    frame_weights,
    grid_for,
    parse_decoupled_objects,
    quota_plan,
    resize_frame,
    scorer_flops,
    tome_merge,
)
from vlm_prune.methods.base import FramesContext
from vlm_prune.registry import make_method


def _features(t: int = 4, rows: int = 4, cols: int = 4, d: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, rows * cols, d, generator=torch.Generator().manual_seed(seed))


# ---- decoupling -----------------------------------------------------------------------------
def test_decouple_prompt_is_the_official_three_example_prompt():
    text = decouple_prompt("How many red cups are on the table?")
    assert text.startswith("How many red cups are on the table?\nTo answer this question, please follow the following step")
    lines = text.split("\n")
    assert all(line.startswith("    ") for line in lines[2:])  # indented as in the official triple-quoted string
    assert [line.strip() for line in lines if line.strip().startswith("# Example")] == [
        "# Example 1:", "# Example 2:", "# Example 3:"]
    assert lines[-1] == "    Step 1: no" and 'Step 3: ["blue ballons", "long table"]' in text


@pytest.mark.parametrize(
    "answer, expected",
    [
        ('Step 1: yes\nStep 2: ["cup", "table", "red"]\nStep 3: ["cup", "table"]', ["cup", "table"]),
        ("**Step 1:** Yes\n**Step 2:** ['dog', 'ball']\n**Step 3:** ['Dog', 'BALL']", ["dog", "ball"]),
        ("Step 1: no", []),
        ("step 1 - NO, nothing physical\nStep 3: ['x']", []),
        ("Step 1: yes\nStep 2: [\u201cman in black\u201d]\nStep 3: [\u201cMan in black\u201d, \u201cwoman\u201d]",
         ["man in black", "woman"]),
        ("Step 1: yes\nStep 2: cat\nStep 3: cat, dog.", ["cat", "dog"]),
        ("Step 1: yes\nStep 2: [\"sky\"]\nStep 3: null", []),
        ("Step 1: yes\nStep 3: ```python\n['car', 'car', 'tree']\n```", ["car", "tree"]),
        ("Step 1: yes\nStep 3: [cat, big dog]", ["cat", "big dog"]),  # not a Python literal
        ("I think we need a cat.", []),  # no Step 3 at all
        ("Step 1: yes\nStep 2: ['cat']", []),  # Step 3 missing
        ("", []),
        ("Step 3: ['bird']", []),  # the official parser needs Step 1: yes
        ("Step 1: yes\nStep 3: [1, 'bird', None]", ["bird"]),
    ],
)
def test_parse_decoupled_objects_messy_answers(answer, expected):
    assert parse_decoupled_objects(answer) == expected


@pytest.mark.parametrize("answer, done", [
    ("Step 1: yes\nStep 2: ['cup']\nStep 3: ['cu", False), ("Step 1: yes\nStep 2: ['cup']", False),
    ("Step 1: yes\nStep 2: ['cup']\nStep 3: ['cup']", True), ("Step 1: No", True),
    ("Step 1: yes\nStep 3: null", True), ("Step 1:", False), ("", False)])
def test_decoupling_stops_only_once_the_answer_parses(answer, done):
    assert decoupling_finished(answer) is done


def test_frame_prompts_are_the_official_ones():
    with_objects = frame_prompt("What is he holding?", ["cup", "man"])
    assert with_objects == "Does the image contain any object of cup, man? A. yes, B. no\nAnswer with the option's letter directly."
    without = frame_prompt("What is he holding?", [])
    assert without == ("What is he holding?\nDoes the image contain sufficient information to answer the given "
                       "question? A. yes, B. no\nAnswer with the option's letter directly.")
    assert frame_prompt("what colour is the shape ?", ["shape"], PLAIN_PROMPTS) == "is there a shape ?"
    assert frame_prompt("is there a coloured shape ?", [], PLAIN_PROMPTS) == "is there a coloured shape ?"


def test_prompt_scores_from_answer_probabilities():
    probs = torch.tensor([[0.6, 0.2], [0.1, 0.3]])
    torch.testing.assert_close(PLAIN_PROMPTS.score(probs), torch.tensor([0.75, 0.25]))
    torch.testing.assert_close(FramePrompts().score(probs[:, :1]), torch.tensor([0.6, 0.1]))


# ---- weights, allocation, grid --------------------------------------------------------------
def test_weights_are_squared_scaled_scores_normalised():
    w = frame_weights(torch.tensor([0.5, 0.25, 0.0]))
    np.testing.assert_allclose(w, [0.8, 0.2, 0.0])
    np.testing.assert_allclose(frame_weights(torch.zeros(4)), [0.25] * 4)


def test_budgets_truncate():
    w = np.array([0.8, 0.2, 0.0])
    assert allocate_tokens(w, 10) == [8, 2, 0]
    assert allocate_tokens(w, 7) == [5, 1, 0]  # 5.6 -> 5, 1.4 -> 1
    assert allocate_tokens(np.full(49, 1 / 49), 49 * 4)[0] == 3  # float error: 3.9999... -> 3, as the official


@pytest.mark.parametrize(
    "n, grid", [(1, (1, 1)), (2, (2, 1)), (3, (2, 1)), (4, (2, 2)), (5, (2, 2)), (6, (3, 2)),
                (8, (3, 2)), (9, (3, 3)), (12, (4, 3)), (15, (4, 3)), (196, (14, 14)), (210, (15, 14))],
)
def test_grid_growth_rule(n, grid):
    assert grid_for(n) == grid


def test_cap_weights_is_the_official_one_pass_redistribution():
    # capped frames stay in the denominator, so the excess is under-spent
    np.testing.assert_allclose(cap_weights(np.array([0.7, 0.2, 0.1]), 0.4), [0.4, 0.2 + 0.2 / 0.7 * 0.3, 0.1 + 0.1 / 0.7 * 0.3])
    # frame 1 overflows in the second pass: capped, its overflow grows the excess later frames share
    w = cap_weights(np.array([0.5, 0.45, 0.05]), 0.46)
    excess = 0.04 + (0.45 + 0.45 / 0.96 * 0.04 - 0.46)
    np.testing.assert_allclose(w, [0.46, 0.46, 0.05 + 0.05 / 0.96 * excess])
    # zero-weight frames get nothing of the excess
    np.testing.assert_allclose(cap_weights(np.array([1.0, 0.0]), 0.6), [0.6, 0.0])


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
    torch.testing.assert_close(out, x[[0, 3, 7, 11, 15]])  # linspace(0, 15, 5).long(): truncated


def test_v4_token_merging_in_the_official_order():
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    torch.testing.assert_close(tome_merge(torch.stack([a, a, b, b]), 2), torch.stack([a, b]))
    a2 = torch.tensor([1.0, 0.2, 0.0])
    c = torch.tensor([0.0, 0.0, 1.0])
    out = tome_merge(torch.stack([a, a2, c]), 2)  # A = (a, c), B = (a2): a merges into a2; output [unmerged A, B]
    torch.testing.assert_close(out, torch.stack([c, (a + a2) / 2]))
    # later rounds average with equal weights (sizes are not carried between rounds)
    x = torch.stack([a, a, a2, b])  # round 1 (r = 2): A=(a, a2) both merge into B[0]=a -> [(2a + a2) / 3, b]
    out = tome_merge(x, 1)  # round 2: the two remaining tokens averaged 1:1 (carried sizes would weigh 3:1)
    assert out.shape == (1, 3)
    torch.testing.assert_close(out[0], ((2 * a + a2) / 3 + b) / 2)


def test_v5_merges_rows_then_columns():
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    out = resize_frame(x, (4, 4), 6, "v5")  # grid (3, 2): rows of 4 -> 2 tokens, columns of 4 -> 3
    rows = torch.stack([tome_merge(r, 2) for r in x.reshape(4, 4, 4)])
    ref = torch.stack([tome_merge(rows[:, j], 3) for j in range(2)], dim=1).reshape(6, 4)
    torch.testing.assert_close(out, ref)


# ---- the plan -------------------------------------------------------------------------------
def test_zero_token_frames_are_dropped():
    feats = _features(4)
    plan = quota_plan(feats, (4, 4), 32, torch.tensor([1.0, 0.01, 1.0, 0.01]), "v1")
    assert plan.kept_frames == [0, 2]
    # w = 10000 / 20002 -> floor(15.99) = 15 tokens -> grid (4, 3); w = 1 / 20002 -> 0 tokens
    assert plan.tokens_per_frame == [12, 0, 12, 0]
    assert plan.reduction.features.shape[0] == sum(plan.tokens_per_frame)


@pytest.mark.parametrize("variant, per_frame", [("v1", [30, 0, 0, 0]), ("v2", [16, 0, 0, 0]),
                                                ("v3", [16, 0, 0, 0]), ("v4", [16, 0, 0, 0]), ("v5", [16, 0, 0, 0])])
def test_caps_under_spend_as_the_official(variant, per_frame):
    """A frame at its cap keeps 16 of 32; zero-score frames get no share of the excess."""
    feats = _features(4)
    plan = quota_plan(feats, (4, 4), 32, torch.tensor([1.0, 0.0, 0.0, 0.0]), variant)
    assert plan.tokens_per_frame == per_frame
    assert plan.reduction.indices.tolist() == list(range(sum(per_frame)))
    assert plan.reduction.features.shape == (sum(per_frame), 6)


def test_plan_on_an_unpooled_map_fills_the_pooled_slots():
    """LLaVA-OneVision: 4 frames of 2 x 2 slots, maps of 4 x 4; a high-score frame gets more than
    its 4 slots' worth of detail."""
    fine = _features(4)
    plan = quota_plan(fine, (4, 4), 16, torch.tensor([1.0, 0.2, 0.2, 0.2]), "v2", slots=16)
    assert plan.tokens_per_frame[0] > 4 and sum(plan.tokens_per_frame) <= 16
    with pytest.raises(ValueError, match="exceeds the video's 16 token slots"):
        quota_plan(fine, (4, 4), 17, torch.ones(4), "v1", slots=16)


@pytest.mark.parametrize("variant", ["v1", "v2", "v3", "v4", "v5"])
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
    for variant in ("v1", "v2", "v3", "v4", "v5"):
        plan = quota_plan(feats, (4, 4), 48, torch.full((3,), 0.7), variant)
        torch.testing.assert_close(plan.reduction.features, feats.reshape(48, 6))


# ---- the Method -----------------------------------------------------------------------------
def _ctx(feats, n_total, **kw) -> FramesContext:
    return FramesContext(features=feats, grid=(4, 4), n_total=n_total, **kw)


@pytest.mark.parametrize("variant", ["v1", "v3"])
def test_stub_scorer_keeps_exactly_the_preferred_frames(variant):
    feats = _features(5)
    seen = []

    def score_frames(prompts, tokens, grid):
        seen.append((prompts, tokens, grid))
        return torch.tensor([[0.0], [0.9], [0.0], [0.9], [0.0]])

    method = QuoTA(budget=32, variant=variant, decouple=False)
    plan = method.allocate(_ctx(feats, 32, query="Where is the cat?", score_frames=score_frames))
    assert plan.kept_frames == [1, 3] and plan.tokens_per_frame == [0, 16, 0, 16, 0]
    torch.testing.assert_close(plan.reduction.features, feats[[1, 3]].reshape(32, 6))
    assert seen == [([frame_prompt("Where is the cat?", [])], ["A"], (7, 7))]
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
               generate_text=lambda prompt, done, limit: "Step 1: yes\nStep 2: ['dog', 'sleep']\nStep 3: ['Dog']")
    plan = method.allocate(ctx)
    assert prompts == [frame_prompt("Is the dog asleep?", ["dog"])]
    assert plan.tokens_per_frame[1] == max(plan.tokens_per_frame)


def test_method_errors_and_registry():
    feats = _features(2)
    with pytest.raises(ValueError, match="frame scorer"):
        QuoTA(budget=8).allocate(_ctx(feats, 8, query="why?"))
    with pytest.raises(ValueError, match="2 frames"):
        QuoTA(budget=8).allocate(_ctx(feats, 8, query="why?", score_frames=lambda p, t, g: torch.ones(3, 1)))
    with pytest.raises(ValueError, match="variant"):
        QuoTA(variant="v9")
    # without a query every frame scores 1: uniform allocation
    plan = QuoTA(budget=16).allocate(_ctx(feats, 16))
    assert plan.tokens_per_frame == [6, 6]  # 8 tokens each -> grid (3, 2)
    method = make_method("quota", keep=0.25, variant="v2")
    assert isinstance(method, QuoTA) and method.n_keep(5 * 16) == 20
    assert method.describe()["variant"] == "v2"
