"""QuoTA fidelity: our allocation and resize equal an independently written re-statement of the
official algorithm (MAC-AutoML/QuoTA ``token_compress`` / ``scale_weights`` and ToMe's bipartite
soft matching, read through the fzm121516/QuoTA mirror; commits in vlm_prune/frames/quota.py) on
fixed tensors, for v1-v5, at the official shapes (27 x 27 unpooled SigLIP maps; v4 on the
14 x 14 pooled ones); and the LLaVA-OneVision adapter feeds the language model exactly that."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tiny_models as T
import vlm_prune
from reference import capture_lm_inputs
from vlm_prune.frames.quota import QuoTA, quota_plan


# ---- the re-statement (written from the algorithm's description, not from either code) -------
def ref_scale(w: np.ndarray, top: float) -> np.ndarray:
    w = w.copy()
    spill = 0.0
    for i, v in enumerate(w):
        if v > top:
            spill, w[i] = spill + v - top, top
    if spill > 0:
        denom = w.sum()
        for i in range(len(w)):
            if w[i] < top:
                w[i] = w[i] + w[i] / denom * spill
                if w[i] > top:
                    spill, w[i] = spill + w[i] - top, top
    return w


def ref_shape(k: int) -> tuple[int, int]:
    hh = ww = int(math.sqrt(k))
    if hh * ww < k:
        if (hh + 1) * ww <= k:
            hh += 1
        elif hh * (ww + 1) <= k:
            ww += 1
    return hh, ww


def ref_bipartite(x: torch.Tensor, r: int) -> torch.Tensor:
    r = min(r, x.shape[0] // 2)
    if r <= 0:
        return x
    evens, odds = x[0::2], x[1::2]
    ne, no = evens / evens.norm(dim=1, keepdim=True), odds / odds.norm(dim=1, keepdim=True)
    val, idx = (ne @ no.T).max(dim=1)
    ranked = sorted(range(len(val)), key=lambda i: (-float(val[i]), i))
    acc, cnt = odds.clone(), [1.0] * odds.shape[0]
    for i in ranked[:r]:
        acc[idx[i]] = acc[idx[i]] + evens[i]
        cnt[idx[i]] += 1
    return torch.cat([evens[ranked[r:]], acc / torch.tensor(cnt)[:, None]])


def ref_merge_to(x: torch.Tensor, k: int) -> torch.Tensor:
    while x.shape[0] > k:
        x = ref_bipartite(x, x.shape[0] - k)
    return x


def ref_token_compress(maps: torch.Tensor, side: int, p: list[float], target: int, version: str) -> list[torch.Tensor]:
    raw = np.array([(s * 100) ** 2 for s in p])
    w = raw / raw.sum(axis=0, keepdims=True)
    if version != "v1":
        w = ref_scale(w, maps.shape[1] / target)
    out = []
    for i in range(maps.shape[0]):
        k = int(target * w[i])
        if k <= 0:
            continue
        if version == "v3":
            out.append(maps[i][torch.linspace(0, maps.shape[1] - 1, k).long().tolist()])
            continue
        if version == "v4":
            out.append(ref_merge_to(maps[i], k))
            continue
        hh, ww = ref_shape(k)
        img = maps[i].view(side, side, -1).permute(2, 0, 1)[None]
        if version == "v1":
            res = F.interpolate(img, size=[hh, ww], mode="bilinear")[0]
        elif version == "v2":
            res = F.adaptive_avg_pool2d(img, (hh, ww))[0]
        else:  # v5
            grid = maps[i].view(side, side, -1)
            by_row = torch.stack([ref_merge_to(grid[y], ww) for y in range(side)])
            res = torch.stack([ref_merge_to(by_row[:, c], hh) for c in range(ww)], dim=1).permute(2, 0, 1)
        out.append(res.permute(1, 2, 0).reshape(hh * ww, -1))
    return out


def pooled(maps: torch.Tensor, side: int) -> torch.Tensor:
    """LLaVA's 2x bilinear pooling of [T, side*side, D] maps (ceil), as get_2dPool / apply_pooling."""
    half = math.ceil(side / 2)
    img = maps.view(maps.shape[0], side, side, -1).permute(0, 3, 1, 2)
    return F.interpolate(img, size=[half, half], mode="bilinear").permute(0, 2, 3, 1).reshape(maps.shape[0], half * half, -1)


# ---- fixed tensors at the official shapes -----------------------------------------------------
SIDE, FRAMES = 27, 6
SCORES = {
    "capped": [0.99, 0.2, 0.1, 0.05, 0.15, 0.05],  # frame 0 over every cap
    "overflow": [0.93, 0.88, 0.3, 0.02, 0.0, 0.4],  # v4: a second frame overflows in the second pass
    "spread": [0.61, 0.47, 0.52, 0.33, 0.58, 0.49],
}


@pytest.fixture(scope="module")
def maps() -> torch.Tensor:
    return torch.randn(FRAMES, SIDE * SIDE, 8, generator=torch.Generator().manual_seed(13))


@pytest.mark.parametrize("case", sorted(SCORES))
@pytest.mark.parametrize("version", ["v1", "v2", "v3", "v4", "v5"])
@pytest.mark.parametrize("target", [FRAMES * 196, FRAMES * 49])
def test_allocation_and_resize_equal_the_official(maps, version, case, target):
    p = SCORES[case]
    src = pooled(maps, SIDE) if version == "v4" else maps
    grid = (14, 14) if version == "v4" else (SIDE, SIDE)
    expected = ref_token_compress(src, grid[0], p, target, version)
    plan = quota_plan(src, grid, target, torch.tensor(p, dtype=torch.float64), version, slots=FRAMES * 196)
    kept = [k for k in plan.tokens_per_frame if k > 0]
    assert kept == [e.shape[0] for e in expected]
    torch.testing.assert_close(plan.reduction.features, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_the_cases_exercise_caps_overflow_and_upsampling(maps):
    """Guard the fixtures: capped frames under-spend, v4 overflows in the second pass, v1 goes
    beyond the native 27 x 27."""
    t = FRAMES * 196
    raw = np.array([(s * 100) ** 2 for s in SCORES["overflow"]])
    w = raw / raw.sum()
    top = 196 / t
    assert (w > top).sum() >= 1 and ref_scale(w, top).sum() < 1 - 1e-3
    first = ref_scale(w, top)
    assert (np.isclose(first, top)).sum() > (w > top).sum()  # more frames capped than at the start
    plan = quota_plan(maps, (SIDE, SIDE), t, torch.tensor(SCORES["capped"]), "v1", slots=t)
    assert max(plan.tokens_per_frame) > SIDE * SIDE


def test_onevision_feeds_the_llm_the_official_resize_of_the_unpooled_maps():
    """Through wrap(): QuoTA v1 / v2 / v5 read the unpooled projector map (4 x 4 in the tiny model,
    not the pooled 2 x 2) and the video rows entering the language model are exactly the
    official resize of it, followed by the newline."""
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, batch=1, frames=4)
    p = [0.9, 0.1, 0.5, 0.3]
    with torch.no_grad():
        cfg = model.config
        hidden = model.model.vision_tower(inp["pixel_values_videos"][0], output_hidden_states=True).hidden_states
        unpooled = model.model.multi_modal_projector(hidden[cfg.vision_feature_layer])
    for version in ("v1", "v2", "v5"):
        quota = QuoTA(scorer=lambda pixels, prompt: torch.tensor(p), variant=version)
        vlm_prune.wrap(model, quota, budget=12)
        try:
            with torch.no_grad(), capture_lm_inputs(model) as seen:
                model(**inp)
            rows = model.vlm_prune.last_rows[0]
        finally:
            vlm_prune.unwrap(model)
        expected = torch.cat(ref_token_compress(unpooled, 4, p, 12, version))
        video = torch.nonzero(inp["input_ids"][0] == T.VIDEO_TOKEN).squeeze(1)
        kept = [r for r in rows.tolist() if r in set(video.tolist())]  # original slots, in order
        got = seen[0]["inputs_embeds"][0, kept]
        assert got.shape[0] == expected.shape[0] + 1  # + the newline, always kept
        torch.testing.assert_close(got[:-1], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[-1], model.model.image_newline.detach(), atol=1e-6, rtol=0)


def test_keep_one_is_the_identity_and_flat_scores_reproduce_the_models_pooling():
    """v1 with equal scores gives each frame budget / T tokens of its unpooled 4 x 4 map, bilinearly
    resized: at 4 tokens a frame (2 x 2) exactly LLaVA-OneVision's own pooling. keep=1.0 changes
    nothing and scores nothing at all."""
    model = T.tiny_onevision()
    inp = T.onevision_video_inputs(model, batch=2, frames=4)
    with torch.no_grad():
        ref = model(**inp).logits
    called = []

    def flat(pixels, prompt):
        called.append(prompt)
        return torch.full((4,), 0.5)

    for variant in ("v1", "v2"):
        vlm_prune.wrap(model, QuoTA(scorer=flat, variant=variant), keep=1.0)
        try:
            with torch.no_grad():
                out = model(**inp).logits
        finally:
            vlm_prune.unwrap(model)
        assert torch.equal(out, ref) and called == []
    plan = quota_plan(torch.randn(4, 16, 8), (4, 4), 16, torch.full((4,), 0.5), "v1", slots=16)
    assert plan.tokens_per_frame == [4] * 4
    fine = torch.randn(4, 16, 8)
    torch.testing.assert_close(quota_plan(fine, (4, 4), 16, torch.full((4,), 0.5), "v1", slots=16).reduction.features,
                               pooled(fine, 4).reshape(16, 8), atol=1e-6, rtol=0)
