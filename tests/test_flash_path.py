"""The FlashAttention-2 path on CPU: transformers' real FA2 glue (unpadding, cu_seqlens, 2-D
key-padding masks, position ids, KV cache) with only the flash kernel replaced by the exact
PyTorch stand-in of tests/flash_attn_standin.py. The real CUDA kernel still needs a GPU."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import test_invariants as inv
import vlm_prune
from vlm_prune.frames.holitom import HoliTom
from vlm_prune.frames.prunevid import PruneVid
from flash_attn_standin import (  # noqa: F401  (flash_attn_standin is a fixture)
    flash_attn_func,
    flash_attn_standin,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    installed,
)
from reference import masked_llm_reference

FA = "flash_attention_2"
CASES = ["llava", "onevision_video", "qwen2_vl_image", "llava_next", "qwen2_5_vl"]
_build = inv.build  # test_invariants' model cache: one model per (family, attention), same seed


# ---- the stand-in against a plain masked softmax attention ------------------------------------
def masked_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, softcap: float = 0.0,
) -> torch.Tensor:
    """One sequence, head by head: q [sq, H, d], k / v [sk, Hk, d], allowed [sq, sk] bool; query
    head h reads key head h // (H / Hk); a row without allowed keys is 0."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        logits = q[:, h] @ k[:, h // group].T * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        for i in range(q.shape[0]):
            if allowed[i].any():
                out[i, h] = torch.softmax(logits[i, allowed[i]], 0) @ v[allowed[i], h // group]
    return out


def band(sq: int, sk: int, causal: bool, left: int = -1) -> torch.Tensor:
    """[sq, sk] allowed keys, bottom-right aligned: the diagonal of query i is key i + sk - sq."""
    ones = torch.ones(sq, sk, dtype=torch.bool)
    allowed = ones.tril(sk - sq) if causal else ones
    return allowed & ones.triu(sk - sq - left) if left >= 0 else allowed


def cu(lengths: list[int]) -> torch.Tensor:
    """int32 cu_seqlens of packed sequences of these lengths."""
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("causal", [True, False])
def test_standin_varlen_ragged_gqa(causal: bool) -> None:
    """Ragged packed sequences, 4 query heads on 2 key heads, a custom scale; with causal, the
    mask is bottom-right aligned (sq < sk sees the whole prefix, sq > sk leaves early rows 0)."""
    g = torch.Generator().manual_seed(0)
    lens_q, lens_k = [5, 1, 3, 4, 0], [5, 6, 3, 2, 2]
    q = torch.randn(sum(lens_q), 4, 8, generator=g)
    k, v = (torch.randn(sum(lens_k), 2, 8, generator=g) for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                 softmax_scale=0.3, causal=causal)
    for sq, sk, q0, k0 in zip(lens_q, lens_k, cu(lens_q).tolist(), cu(lens_k).tolist()):
        ref = masked_softmax_attention(q[q0:q0 + sq], k[k0:k0 + sk], v[k0:k0 + sk], band(sq, sk, causal), 0.3)
        torch.testing.assert_close(out[q0:q0 + sq], ref, atol=1e-6, rtol=0)
    if causal:  # the 4 queries on 2 keys: the first two see no key at all
        assert out[9:11].abs().sum() == 0 and out[11:13].abs().min() > 0


def test_standin_dense_window_softcap() -> None:
    """flash_attn_func on a dense batch: bottom-right causal with a left window, softcap, default scale."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 8, generator=g)
    k, v = (torch.randn(2, 7, 1, 8, generator=g) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True, window_size=(2, 2), softcap=2.0)
    for b in range(2):
        ref = masked_softmax_attention(q[b], k[b], v[b], band(3, 7, True, left=2), 8**-0.5, softcap=2.0)
        torch.testing.assert_close(out[b], ref, atol=1e-6, rtol=0)


def test_standin_rejects_what_the_kernel_would() -> None:
    """Inputs the real kernel cannot take (or would misread) raise instead of giving a result."""
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_varlen_func(q, q, q, cu([4]), cu([4]), 4, 4, dropout_p=0.1)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen_func(q, q, q, cu([4]).long(), cu([4]), 4, 4)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, q, q, cu([4]), cu([4]), 3, 4)
    with pytest.raises(ValueError, match="partition"):
        flash_attn_varlen_func(q, q, q, cu([3]), cu([4]), 4, 4)
    with pytest.raises(NotImplementedError, match="paged"):
        flash_attn_with_kvcache(q[None], q[None], q[None])


def test_standin_is_loaded_by_transformers_and_removed_after() -> None:
    """Inside ``installed()`` transformers' lazy import returns the stand-in; after it, sys.modules
    and transformers' availability checks and cached functions are as before."""
    import transformers.modeling_flash_attention_utils as fa_utils

    names = ("is_flash_attn_2_available", "_loaded_implementation", "_flash_varlen_fn", "_pad_fn")
    before = {n: getattr(fa_utils, n) for n in names}
    matrix_before = dict(fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2])
    module_before = sys.modules.get("flash_attn")
    with installed():
        (fn, varlen, _, pad, unpad), _ = fa_utils.lazy_import_flash_attention(FA)
        assert fn is flash_attn_func and varlen is flash_attn_varlen_func
        assert (pad, unpad) == (fa_utils._pad_input, fa_utils._unpad_input)
    assert {n: getattr(fa_utils, n) for n in names} == before
    assert fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2] == matrix_before
    assert sys.modules.get("flash_attn") is module_before


# ---- the models under FlashAttention-2 ------------------------------------------------------
def models(case: str) -> tuple[torch.nn.Module, torch.nn.Module, Callable[..., dict]]:
    """(FA2 model, SDPA model with the same weights, input maker) for a case of test_invariants."""
    fa, make = _build(case, FA)
    sdpa, _ = _build(case, "sdpa")
    for (name, a), b in zip(fa.state_dict().items(), sdpa.state_dict().values()):
        assert torch.equal(a, b), name
    return fa, sdpa, make


def pruned_run(
    model: torch.nn.Module, method: Any, inp: dict, **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prefill logits, kept rows, 20-step greedy generation) of ``model`` wrapped with ``method``."""
    vlm_prune.wrap(model, method, **kw)
    try:
        logits, gen = inv.run(model, inp)
        return logits, model.vlm_prune.last_rows, gen  # rows (and PACT's records) of generate's prefill
    finally:
        vlm_prune.unwrap(model)


@pytest.mark.usefixtures("flash_attn_standin")
@pytest.mark.parametrize("case", CASES)
def test_identity_under_flash(case: str) -> None:
    """Invariant 1 under FA2: test_invariants' identity check (keep=1.0 equals the unwrapped FA2
    model: prefill, left and right padding, batch 2, 20-step greedy generate twice) on FA2 models."""
    import transformers.modeling_flash_attention_utils as fa_utils

    assert _build(case, FA)[0].model.language_model.config._attn_implementation == FA
    inv.test_identity_when_everything_is_kept(case, FA)
    assert fa_utils._flash_varlen_fn is flash_attn_varlen_func  # the stand-in ran, not a fallback


@pytest.mark.usefixtures("flash_attn_standin")
@pytest.mark.parametrize("case, method", [
    *[(case, method) for case in CASES for method in ("random", "fastv")],
    *[(case, "adaptinfer") for case in CASES[:3]],
    ("llava", "visionzip"), ("onevision_video", "visionzip"), ("onevision_video", "uniform"),
    ("onevision_video", "vidcom2"), ("onevision_video", "fastvid"),
    pytest.param("onevision_video", HoliTom(layer=2), id="onevision_video-holitom"),  # outer + inner merge
    pytest.param("onevision_video", HoliTom(inner=False), id="onevision_video-holitom_outer"),
    ("onevision_video", "dycoke"),
    *[(case, "fastvid") for case in ("qwen2_vl_video", "qwen2_5_vl_video")],
    *[pytest.param(case, HoliTom(layer=2), id=f"{case}-holitom") for case in ("qwen2_vl_video", "qwen2_5_vl_video")],
    ("onevision_video", "framefusion"), ("qwen2_vl_video", "framefusion"),
    *[("llava", method) for method in ("fastervlm", "vispruner", "dart", "pdrop", "sparsevlm", "mustdrop")],
    pytest.param("onevision_video", PruneVid(layer=2, tau=0.0), id="onevision_video-prunevid"),
    ("llava_next", "hired"), ("llava", "hired"), ("llava", "prumerge"),
])
def test_pruned_flash_equals_pruned_sdpa(case: str, method: str) -> None:
    """Removal under FA2 keeps the same rows as under SDPA, with equal logits there and the same
    20-step greedy generation: vision stage (random; VisionZip computes the attention rows of an FA2
    tower on the side), in the LLM (FastV, AdaptInfer: attention rows on the side), frames (uniform)."""
    fa, sdpa, make = models(case)
    inp = make()
    ref_logits, ref_rows, ref_gen = pruned_run(sdpa, method, inp, keep=0.3)
    logits, rows, gen = pruned_run(fa, method, inp, keep=0.3)
    assert torch.equal(rows, ref_rows)
    kept = rows >= 0
    assert kept.sum() < inp["attention_mask"].sum()
    torch.testing.assert_close(logits[kept], ref_logits[kept], atol=1e-5, rtol=0)
    assert torch.equal(gen, ref_gen)


@pytest.mark.usefixtures("flash_attn_standin")
@pytest.mark.parametrize("case", ["llava", "onevision_video", "qwen2_vl_image"])
def test_pact_under_flash_counts_merged_keys_once(case: str) -> None:
    """PACT under FA2 (no proportional attention: a merged key counts as one token) equals the
    masked full-sequence reference with the same merges and no log-size bias, run on the SDPA
    model; its cached 20-step greedy generation equals a recomputation without cache."""
    from vlm_prune.methods.pact import PACT

    fa, sdpa, make = models(case)
    inp = make()
    seen = {}

    class Recording(PACT):
        def select(self, ctx: Any) -> list:
            seen["origin"], seen["reds"] = ctx.extras["origin"], super().select(ctx)
            return seen["reds"]

    method = Recording(layer=2, rho=0.75, cutoff=0.6)  # the official knobs: merges happen
    logits, rows, gen = pruned_run(fa, method, inp)
    b, s = inp["input_ids"].shape
    kept = torch.zeros(b, s, dtype=torch.bool)
    centre = torch.zeros(b, s, dtype=torch.bool)
    feats = torch.zeros(b, s, fa.config.text_config.hidden_size)
    merged = 0
    for i, red in enumerate(seen["reds"]):
        origin = seen["origin"][i][red.indices]
        kept[i, origin] = True
        if red.features is not None:
            centre[i, origin], feats[i, origin] = True, red.features.float()
            merged += int((red.sizes > 1).sum())
    assert merged, "the test needs at least one real merge"
    ref = masked_llm_reference(sdpa, inp, 2, kept, merged=(centre, feats, torch.ones(b, s)))
    inv.assert_kept_rows_equal(logits, rows, ref)
    vlm_prune.wrap(fa, method)
    try:
        with torch.no_grad():
            no_cache = fa.generate(**inp, max_new_tokens=20, min_new_tokens=20, do_sample=False, use_cache=False)
    finally:
        vlm_prune.unwrap(fa)
    assert torch.equal(gen, no_cache)


@pytest.mark.usefixtures("flash_attn_standin")
@pytest.mark.parametrize("method", ["random", "fastv", "pact"])
@pytest.mark.parametrize("case", ["llava", "onevision_video", "qwen2_vl_image"])
def test_batch_equals_samples_alone_under_flash(case: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 4 under FA2: test_invariants' check (each sample of a left-padded batch equals
    that sample alone, prefill and 10-step generate) on FA2 models. The kept row counts are
    ragged (different prompt lengths; PACT also keeps different visual counts on llava and
    onevision_video), and a sample alone has position-id gaps but no padding."""
    fa, make = _build(case, FA)
    vlm_prune.wrap(fa, method, keep=0.3)
    try:
        with torch.no_grad():
            fa(**make())
        rows = fa.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(fa)
    counts = (rows >= 0).sum(1)
    assert counts[0] != counts[1]
    monkeypatch.setattr(inv, "build", lambda c, attn="sdpa": _build(c, FA))
    inv.test_batch_equals_samples_alone(case, method)
