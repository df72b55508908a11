"""FastVID and HoliTom on Qwen2-VL / Qwen2.5-VL video: the tower salience the adapter gives each
temporal slice against a small, independently written re-statement of FastVID's official
Qwen2.5-VL signal (LunarShen/FastVID@a40a109cb8df20e8c2c17c6850f8269717369990,
fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py:
``Qwen2_5_VLVisionFlashAttention2.forward`` called with ``grid_thw`` in the tower's last block,
and the ``reverse_indices`` mapping at the end of ``Qwen2_5_VisionTransformerPretrainedModel.forward``),
computed the official way - on the whole tower sequence inside the last block's attention, with
transformers' own window index - then the plans against fastvid_plan / holitom_plan on it.
The same file's allocation (the "FastVID" block of ``Qwen2_5_VLForConditionalGeneration.forward``:
DySeg, the DySeg_ignore runs, STPrune and the context merge) is re-stated below against
``fastvid_plan(..., ignore=...)``. HoliTom has no official Qwen version (cokeshao/HoliTom@e9b2972
ships LLaVA-OneVision / LLaVA-Video only); it reads the same signal here. None of the official code
is copied.
"""
from __future__ import annotations

import math

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.adapters.vision_towers import window_order
from vlm_prune.frames.fastvid import FastVID, fastvid_plan, qwen_frame_counts
from vlm_prune.frames.holitom import HoliTom, holitom_plan

from test_budgets import _one_thread  # noqa: E402,F401  (autouse: one thread)

_MODELS: dict = {}


def model_of(v25: bool, attn: str = "sdpa"):
    if (v25, attn) not in _MODELS:
        _MODELS[v25, attn] = T.tiny_qwen2_vl(attn, v25=v25)
    return _MODELS[v25, attn]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x.float() * cos[:, None].float() + turned.float() * sin[:, None].float()


def official_salience(model, inp: dict) -> list[torch.Tensor]:
    """[t, U] per video, as the official computes it in the last block's attention: q, k of the
    whole tower sequence after the 2-D RoPE, per video the mean query of each temporal slice, the
    keys averaged over each run of 4 (a merged token in the tower's order), softmax over the slice,
    mean over the query axis and heads; then back from the tower's window order with the argsort of
    transformers' window index (Qwen2.5-VL; Qwen2-VL's tower keeps raster order)."""
    visual = model.model.visual
    attn = visual.blocks[-1].attn
    seen = {}

    def keep(module, args, kwargs):
        seen["x"], seen["pe"] = args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model.model.get_video_features(inp["pixel_values_videos"], inp["video_grid_thw"])
    finally:
        handle.remove()
    x, (cos, sin) = seen["x"], seen["pe"]
    s, heads = x.shape[0], attn.num_heads
    with torch.no_grad():
        q, k, _ = attn.qkv(x).reshape(s, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = _rotate(q, cos, sin).transpose(0, 1), _rotate(k, cos, sin).transpose(0, 1)  # [heads, S, d]
    d = q.shape[-1]
    out, start = [], 0
    for i, (t, h, w) in enumerate(inp["video_grid_thw"].tolist()):
        n = t * h * w
        qv = q[:, start : start + n].reshape(heads, t, h * w, d).mean(-2, keepdim=True)
        kv = k[:, start : start + n].reshape(heads, t, h * w // 4, 4, d).mean(-2)
        weights = torch.softmax(qv @ kv.transpose(-2, -1) / d**0.5, dim=-1).mean(2).mean(0)  # [t, U]
        if hasattr(visual, "window_size"):
            from transformers.vision_utils import get_vision_window_index

            index, _ = get_vision_window_index(inp["video_grid_thw"][i : i + 1], visual.spatial_merge_size,
                                               visual.window_size, visual.patch_size)
            weights = weights.reshape(-1)[torch.argsort(index)].reshape(t, -1)
        out.append(weights)
        start += n
    return out


def recorded(model, inp: dict, method) -> list[tuple[torch.Tensor, torch.Tensor, int, object]]:
    """Per video: (the slices' features, the salience the method was given, n_total, its plan)."""
    seen = []
    base = type(method)

    class Recording(base):
        def allocate(self, ctx):
            plan = super().allocate(ctx)
            salience = torch.stack([ctx.tower_attention(i)[0] for i in range(ctx.features.shape[0])])
            seen.append((ctx.features, salience, ctx.n_total, plan))
            return plan

    method.__class__ = Recording
    vlm_prune.wrap(model, method, keep=0.3)
    T.forward_stats(model, inp)
    return seen


@pytest.mark.parametrize("rows, cols, side", [(4, 4, 2), (6, 4, 4), (5, 7, 3), (3, 3, 8), (2, 6, 1)])
def test_window_order_is_the_towers(rows, cols, side):
    """The raster index of each merged token in the tower's order equals transformers' window index."""
    from transformers.vision_utils import get_vision_window_index

    index, _ = get_vision_window_index(torch.tensor([[1, 2 * rows, 2 * cols]]), 2, side * 2 * 4, 4)
    assert torch.equal(window_order(rows, cols, side), index)
    assert torch.equal(window_order(rows, cols, None), torch.arange(rows * cols))


#: (the method as wrapped, its plan function on the same knobs): FastVID with merged anchors (d=0.5,
#: c=2 segments); HoliTom, which reads the same signal, with half of each slice's dynamic tokens kept by
#: salience and half merged as DPC-kNN contextual tokens (d=0.5)
PLANS = {
    "fastvid": (lambda: FastVID(d=0.5, c=2), lambda f, s, n: fastvid_plan(f, s, n, c=2, d=0.5)),
    "holitom": (lambda: HoliTom(tau=0.5, d=0.5, inner=False), lambda f, s, n: holitom_plan(f, s, n, tau=0.5, d=0.5)),
}
#: the methods as wrapped whole: HoliTom's inner merge before layer 2 of the tiny models' 6 (default 18)
WHOLE = {"fastvid": lambda: "fastvid", "holitom": lambda: HoliTom(layer=2)}


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("v25", [False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def test_salience_and_plan_equal_the_official_qwen_signal(v25, name):
    """Through wrap() on a batch of two videos: each slice's salience equals the official signal
    (2 slices x 16 merged tokens; Qwen2.5-VL's 2 x 2 windows reorder them), and the plan (kept
    slots, merged features, tokens per slice) equals the method's plan function on it."""
    model = model_of(v25)
    inp = T.qwen2_vl_inputs(model, video=True)
    ref = official_salience(model, inp)
    method, plan_of = PLANS[name]
    seen = recorded(model, inp, method())
    assert len(seen) == 2
    for (features, salience, n_total, plan), want in zip(seen, ref):
        assert salience.shape == (2, 16) and n_total == 9  # 0.3 of 32, floored
        torch.testing.assert_close(salience, want, atol=1e-6, rtol=1e-5)
        expect = plan_of(features, want, n_total)
        assert torch.equal(plan.reduction.indices, expect.reduction.indices)
        torch.testing.assert_close(plan.reduction.features, expect.reduction.features, atol=0, rtol=0)
        assert plan.tokens_per_frame == expect.tokens_per_frame


@pytest.mark.parametrize("v25", [False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def test_fastvid_salient_tokens_are_the_top_of_the_official_signal(v25):
    """d=0 (every kept token salient): each slice keeps the top of the official signal."""
    model = model_of(v25)
    inp = T.qwen2_vl_inputs(model, video=True, seed=4)
    ref = official_salience(model, inp)
    for (_, _, n_total, plan), want in zip(recorded(model, inp, FastVID(d=0.0)), ref):
        top = torch.cat([torch.topk(want[i], k).indices.sort().values + 16 * i for i, k in enumerate((5, 4))])
        assert n_total == 9 and torch.equal(plan.reduction.indices, top)  # the odd token to the first slice


@pytest.mark.parametrize("method", ["fastvid", "holitom"])
@pytest.mark.parametrize("v25", [False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def test_eager_equals_sdpa(v25, method):
    """The tap recomputes the signal from the last block's input: an eager and an SDPA tower with
    the same weights keep the same rows, with the same logits there and the same greedy answer."""
    out = {}
    for attn in ("eager", "sdpa"):
        model = model_of(v25, attn)
        inp = T.qwen2_vl_inputs(model, video=True)
        vlm_prune.wrap(model, WHOLE[method](), keep=0.3)
        try:
            with torch.no_grad():
                logits = model(**inp).logits
                rows = model.vlm_prune.last_rows
                gen = model.generate(**inp, max_new_tokens=6, do_sample=False)
        finally:
            vlm_prune.unwrap(model)
        out[attn] = logits, rows, gen
    (l1, r1, g1), (l2, r2, g2) = out["eager"], out["sdpa"]
    assert torch.equal(r1, r2) and bool((r1 < 0).any())
    torch.testing.assert_close(l1[r1 >= 0], l2[r2 >= 0], atol=1e-5, rtol=0)
    assert torch.equal(g1, g2)


@pytest.mark.parametrize("method", ["fastvid", "holitom"])
@pytest.mark.parametrize("v25", [False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def test_keep_one_is_bit_identical(v25, method):
    """keep=1.0 with the tower tapped: the prefill logits and the greedy answer equal the unwrapped
    model's bit for bit, and unwrap() removes the tap."""
    model = model_of(v25)
    inp = T.qwen2_vl_inputs(model, video=True)
    with torch.no_grad():
        ref_logits = model(**inp).logits
        ref_gen = model.generate(**inp, max_new_tokens=6, do_sample=False)
    block = model.model.visual.blocks[-1]
    hooks = len(block._forward_pre_hooks)
    vlm_prune.wrap(model, WHOLE[method](), keep=1.0)
    try:
        assert len(block._forward_pre_hooks) == hooks + 1
        with torch.no_grad():
            logits = model(**inp).logits
            gen = model.generate(**inp, max_new_tokens=6, do_sample=False)
        assert model.vlm_prune.last_stats["visual_tokens_out"] == [32, 32]
    finally:
        vlm_prune.unwrap(model)
    assert len(block._forward_pre_hooks) == hooks
    assert torch.equal(logits, ref_logits) and torch.equal(gen, ref_gen)


# ---- the official Qwen2.5-VL allocation (DySeg_ignore) -----------------------------------------
def _runs(cut: list[int], length: int) -> list[int]:
    """Lengths of the pieces of ``length`` frames cut after each index of ``cut`` (sorted)."""
    if not cut:
        return [length]
    return [cut[0] + 1, *[b - a for a, b in zip(cut[:-1], cut[1:])], length - cut[-1] - 1]


def official_fastvid_qwen(video: torch.Tensor, attn: torch.Tensor, retention: float, c: int, tau: float,
                          ignore: float, d: float, p: int, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The official Qwen2.5-VL block on one video [T, N, D] with salience [T, N]: (kept slots
    ascending, their features). Segments from the normalised frame means (the c - 1 least similar
    pairs and every pair below tau); per segment the retained count, context max(int(. d), 1), the
    runs of frames >= ignore alike (only a run's last frame keeps tokens), salient tokens split over
    the runs, context over every p-th run (reversed, capped at half a frame); top salience, density
    peaks of the rest, and every other non-salient token of the segment merged into each frame's
    context tokens (its own excluded) with weight clamp(1 / (n + 1), beta)."""
    t, n, dim = video.shape
    g = video.mean(1)
    g = g / g.norm(dim=1, keepdim=True)
    sim = (g[:-1] * g[1:]).sum(1)
    cut = torch.unique(torch.cat([torch.topk(sim, c - 1, largest=False).indices, torch.nonzero(sim < tau).squeeze(1)]))
    sizes = _runs(sorted(cut.tolist()), t)
    keep, feats, base = [], [], 0
    retain = int(n * retention)
    for length in sizes:
        hidden, sal, gf = video[base : base + length], attn[base : base + length], g[base : base + length]
        seg_retain = retain * length
        seg_ctx = max(int(seg_retain * d), 1)
        seg_sal = seg_retain - seg_ctx
        if length == 1:
            f_sal, f_ctx = [seg_sal], [seg_ctx]
        else:
            inner = (gf[:-1] * gf[1:]).sum(1)
            runs = _runs(sorted(torch.nonzero(inner < ignore).squeeze(1).tolist()), length)
            v = len(runs)
            shares = [seg_sal // v + (1 if i < seg_sal % v else 0) for i in range(v)]
            tn = math.ceil(v / p)
            ctx_shares = [seg_ctx // tn + (1 if i < seg_ctx % tn else 0) for i in range(tn)]
            run_ctx, j = [], 0
            for i in range(v):
                if i % p == 0:
                    run_ctx.append(min(ctx_shares[j], n // 2))
                    j += 1
                else:
                    run_ctx.append(0)
            run_ctx.reverse()
            f_sal, f_ctx = [], []
            for i in range(v):
                f_sal += [0] * (runs[i] - 1)
                f_ctx += [0] * (runs[i] - 1)
                if run_ctx[i] == 0:
                    f_sal.append(min(shares[i], n))
                    f_ctx.append(0)
                else:
                    f_ctx.append(min(run_ctx[i], n // 2))
                    f_sal.append(min(shares[i], n - f_ctx[-1]))
        salient, contexts = [], []
        for f in range(length):
            top = torch.topk(sal[f], f_sal[f]).indices if f_sal[f] > 0 else torch.zeros(0, dtype=torch.long)
            if f_ctx[f] > 0:
                rest = torch.tensor([i for i in range(n) if i not in set(top.tolist())])
                x = hidden[f][rest]
                dist = torch.cdist(x[None], x[None])[0] / dim**0.5
                density = (-(torch.topk(dist, 4, dim=-1, largest=False).values ** 2).mean(-1)).exp()
                denser = (density[None, :] > density[:, None]).float()
                parent = (dist * denser + dist.max() * (1 - denser)).min(-1).values
                contexts.append(rest[torch.topk(parent * density, f_ctx[f]).indices.sort().values] + f * n)
            salient.append(top + f * n)
        flat = hidden.reshape(length * n, dim)
        unit = flat / flat.norm(dim=-1, keepdim=True)
        salient = torch.cat(salient)
        keep.append(salient + base * n)
        feats.append(flat[salient])
        for ctx_idx in contexts:
            kept = set(salient.tolist()) | set(ctx_idx.tolist())
            merge = torch.tensor([i for i in range(length * n) if i not in kept])
            onehot = torch.zeros(merge.numel(), ctx_idx.numel())
            onehot[torch.arange(merge.numel()), (unit[merge] @ unit[ctx_idx].T).argmax(1)] = 1
            w = (1 / (onehot.sum(0)[:, None] + 1)).clamp(min=beta)
            mean = onehot.T @ flat[merge] / onehot.sum(0).clamp(min=1)[:, None]
            keep.append(ctx_idx + base * n)
            feats.append(w * flat[ctx_idx] + (1 - w) * mean)
        base += length
    index, order = torch.sort(torch.cat(keep))
    return index, torch.cat(feats)[order]


def _scenes_with_repeats() -> torch.Tensor:
    """8 frames of 16 tokens: scene A (frames 0-3, 0 and 1 near copies), scene B (4-7, 6 and 7 near
    copies); consecutive frame means ~0.9997, 0.81, 0.87, -0.13, 0.88, 0.88, 0.9999 alike."""
    g = torch.Generator().manual_seed(0)
    n, dim = 16, 12
    a, b = torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g)
    noise = [0.02, 0.02, 0.6, 0.6, 0.02, 0.6, 0.02, 0.02]
    return torch.stack([(a if i < 4 else b) + noise[i] * torch.randn(n, dim, generator=g) for i in range(8)])


@pytest.mark.parametrize("c, p", [(2, 2), (4, 1)], ids=["two-scenes-anchor-every-2nd-run", "four-segments-every-run"])
def test_fastvid_qwen_allocation_equals_the_official_block(c, p):
    """ignore=0.95: near-copy frames give their tokens to the run's last frame, the context goes to
    every p-th run from the segment's end; kept slots and merged features equal the official block's
    (whose counts spend the budget here: asserted)."""
    video = _scenes_with_repeats()
    attn = torch.rand(8, 16, generator=torch.Generator().manual_seed(5))
    ref_slots, ref_feats = official_fastvid_qwen(video, attn, 0.5, c, 0.5, 0.95, 0.4, p, 0.6)
    assert ref_slots.numel() == 64
    plan = fastvid_plan(video, attn, 64, c=c, tau=0.5, d=0.4, p=p, beta=0.6, ignore=0.95)
    assert torch.equal(plan.reduction.indices, ref_slots)
    torch.testing.assert_close(plan.reduction.features, ref_feats, atol=1e-6, rtol=1e-6)
    assert plan.tokens_per_frame[0] == 0 and plan.tokens_per_frame[6] == 0  # the first of each near-copy pair


def test_fastvid_qwen_counts_spend_the_budget_exactly():
    """Where the official caps lose tokens (context above half a frame), the rest goes to salient
    tokens of the frames that keep tokens; a dropped frame gets some only when those are full."""
    sim = torch.tensor([0.99, 0.5, 0.5, 0.1, 0.5, 0.5, 0.99])
    # segments [4, 4] (cut at 3); runs [2, 1, 1] and [1, 1, 2]; retain 8: context 12 -> one anchor (p=4) capped at 8
    sal, ctx = qwen_frame_counts([4, 4], sim, 16, 64, 0.4, 4, 0.95)
    assert ctx == [0, 0, 0, 8, 0, 0, 0, 8]
    # salient 7, 7, 6 per segment's runs (56 kept in all); the 8 left: one each to the 6 keeping frames, then 2
    assert sal == [0, 9, 9, 7, 8, 8, 0, 7] and sum(sal) + sum(ctx) == 64
    sal, ctx = qwen_frame_counts([4, 4], sim, 16, 120, 0.4, 4, 0.95)  # kept frames full: dropped ones too
    assert sum(sal) + sum(ctx) == 120 and all(s + c <= 16 for s, c in zip(sal, ctx)) and sal[0] > 0
    sal, ctx = qwen_frame_counts([4, 4], sim, 16, 3, 0.4, 4, 0.95)  # below a token per frame
    assert sum(ctx) == 0 and sal == [0, 1, 1, 1, 0, 0, 0, 0]


def test_fastvid_qwen_top_up_false_is_the_official_short_count():
    """Near-duplicate frames: each segment is one run whose last frame alone keeps tokens, at most a
    frame's 16 however many frames the run stands for; top_up=False keeps the official block's tokens
    (32 of the budget 64), the default spends the budget."""
    g = torch.Generator().manual_seed(1)
    video = torch.randn(16, 12, generator=g) + 0.01 * torch.randn(8, 16, 12, generator=g)
    attn = torch.rand(8, 16, generator=torch.Generator().manual_seed(5))
    ref_slots, ref_feats = official_fastvid_qwen(video, attn, 0.5, 2, 0.5, 0.95, 0.4, 4, 0.6)
    assert ref_slots.numel() == 32  # two segments, 16 each: the official ends half short
    plan = fastvid_plan(video, attn, 64, c=2, tau=0.5, d=0.4, p=4, beta=0.6, ignore=0.95, top_up=False)
    assert torch.equal(plan.reduction.indices, ref_slots)
    torch.testing.assert_close(plan.reduction.features, ref_feats, atol=1e-6, rtol=1e-6)
    full = fastvid_plan(video, attn, 64, c=2, tau=0.5, d=0.4, p=4, beta=0.6, ignore=0.95)
    assert full.reduction.indices.numel() == 64
    # the docstring's figures: near-duplicate slices (one run per segment) cut into c = 8 segments
    for sizes, n, n_total, reached in (([1, 1, 1, 1, 1, 9, 1, 1], 416, 1664, 1144), ([21, 1, 1, 1, 5, 1, 1, 1], 256, 2211, 926)):
        sim = torch.full((sum(sizes) - 1,), 0.99)
        assert sum(map(sum, qwen_frame_counts(sizes, sim, n, n_total, 0.4, 4, 0.95, top_up=False))) == reached
        assert sum(map(sum, qwen_frame_counts(sizes, sim, n, n_total, 0.4, 4, 0.95))) == n_total
    with pytest.raises(ValueError, match="top_up must be True"):
        FastVID(top_up=None)


def test_fastvid_qwen_setting_runs_on_qwen2_5_vl():
    """FastVID(tau=0.84, ignore=0.95), the official Qwen2.5-VL setting, through wrap(): the plan is
    fastvid_plan with those knobs on the official salience, at exactly the budget."""
    model = model_of(True)
    inp = T.qwen2_vl_inputs(model, video=True)
    ref = official_salience(model, inp)
    for (features, _, n_total, plan), want in zip(recorded(model, inp, FastVID(tau=0.84, ignore=0.95)), ref):
        expect = fastvid_plan(features, want, n_total, tau=0.84, ignore=0.95)
        assert torch.equal(plan.reduction.indices, expect.reduction.indices) and plan.reduction.indices.numel() == 9
