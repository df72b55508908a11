"""FastVID and HoliTom on Qwen2-VL / Qwen2.5-VL video: the tower salience the adapter gives each
temporal slice against a small, independently written re-statement of FastVID's official
Qwen2.5-VL signal (LunarShen/FastVID@a40a109cb8df20e8c2c17c6850f8269717369990,
fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py:
``Qwen2_5_VLVisionFlashAttention2.forward`` called with ``grid_thw`` in the tower's last block,
and the ``reverse_indices`` mapping at the end of ``Qwen2_5_VisionTransformerPretrainedModel.forward``),
computed the official way - on the whole tower sequence inside the last block's attention, with
transformers' own window index - then the plans against fastvid_plan / holitom_plan on it.
HoliTom has no official Qwen version (cokeshao/HoliTom@e9b2972 ships LLaVA-OneVision / LLaVA-Video
only); it reads the same signal here. None of the official code is copied.
"""
from __future__ import annotations

import pytest
import torch

import tiny_models as T
import vlm_prune
from vlm_prune.adapters.vision_towers import window_order
from vlm_prune.frames.fastvid import FastVID, fastvid_plan
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
    "holitom": (lambda: HoliTom(tau=0.5, d=0.5), lambda f, s, n: holitom_plan(f, s, n, tau=0.5, d=0.5)),
}


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
        vlm_prune.wrap(model, method, keep=0.3)
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
    vlm_prune.wrap(model, method, keep=1.0)
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
