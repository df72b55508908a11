"""The engine's fastest-exact masks (engine.segment_mask) against the additive float mask.

Every fast form (no mask: SDPA's / FlashAttention's causal kernel; a boolean mask where only
padding needs one) must give the valid rows bit-identical results to the float-mask path:
kernel-level on SDPA, and end to end (prefill logits + greedy generate) with padding, in-LLM
removals and PACT's merges, with the float path forced through a monkeypatch.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import test_invariants as inv
import vlm_prune
from flash_attn_standin import flash_attn_standin  # noqa: F401  (fixture)
from vlm_prune import engine
from vlm_prune.engine import allowed_keys, float_mask, segment_mask


def reference_mask(impl: str, key_valid: torch.Tensor, key_bias: torch.Tensor, q_valid: torch.Tensor,
                   dtype: torch.dtype, blocks: Any = None, window: int | None = None) -> torch.Tensor:
    """The slow forms every segment used before: float mask, or FlashAttention's 2-D padding mask."""
    return key_valid.long() if "flash" in impl else float_mask(key_valid, key_bias, q_valid, dtype, blocks, window)


def kind(mask: Any) -> str:
    return "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float" if mask.is_floating_point() else "2d")


def sdpa(q, k, v, mask, gqa: bool) -> torch.Tensor:
    causal = mask is None and q.shape[2] > 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("q_len,past,pad,bias", [
    (37, 0, False, False),   # prefill, nothing to mask -> None
    (37, 0, True, False),    # prefill with left padding -> bool
    (37, 0, True, True),     # merged keys -> float
    (1, 40, False, False),   # decode step -> None
    (1, 40, True, False),    # decode step with padding -> bool
    (5, 40, False, False),   # several new rows after a cache -> bool (SDPA's causal is top-left)
])
def test_sdpa_fast_forms_equal_float_mask(q_len: int, past: int, pad: bool, bias: bool, gqa: bool) -> None:
    g = torch.Generator().manual_seed(q_len + past)
    b, h, kv, d = 2, 4, q_len + past, 16
    key_valid = torch.ones(b, kv, dtype=torch.bool)
    if pad:
        key_valid[1, :6] = False
    q_valid = key_valid[:, -q_len:]
    key_bias = torch.zeros(b, kv)
    if bias:
        key_bias[0, 8:12] = torch.log(torch.tensor([2.0, 3.0, 1.0, 5.0]))
    q = torch.randn(b, h, q_len, d, generator=g)
    k, v = (torch.randn(b, h // 2 if gqa else h, kv, d, generator=g) for _ in range(2))
    fast = segment_mask("sdpa", key_valid, key_bias, q_valid, torch.float32)
    expected = "float" if bias else "bool" if pad or q_len not in (1, kv) else "none"
    assert kind(fast) == expected
    slow = float_mask(key_valid, key_bias, q_valid, torch.float32)
    out, ref = sdpa(q, k, v, fast, gqa), sdpa(q, k, v, slow, gqa)
    ok = q_valid[:, None, :, None].expand_as(out)
    assert torch.equal(out[ok], ref[ok])
    assert torch.isfinite(out).all()


def test_forms_per_implementation() -> None:
    """FlashAttention: None without padding, the 2-D key mask with; eager: always the float mask."""
    valid = torch.ones(2, 9, dtype=torch.bool)
    zeros = torch.zeros(2, 9)
    assert segment_mask("flash_attention_2", valid, zeros, valid, torch.float32) is None
    padded = valid.clone()
    padded[0, 0] = False
    assert torch.equal(segment_mask("flash_attention_2", padded, zeros, padded, torch.float32), padded.long())
    assert kind(segment_mask("eager", valid, zeros, valid, torch.float32)) == "float"
    # as in transformers' masks, padding masks keys, not queries: a left-padding row sees no key,
    # a right-padding row the valid keys before it, a valid row every valid key up to itself
    padded[1, -2:] = False
    allowed = allowed_keys(padded, padded)
    assert allowed[0, 0].tolist() == [False] * 9
    assert allowed[0, 3].tolist() == [False, True, True, True] + [False] * 5
    assert allowed[1, 8].tolist() == [True] * 7 + [False] * 2
    # a sliding window of 3 columns: a row sees the valid keys less than 3 columns before it; a
    # window covering the keys changes nothing (SDPA keeps its causal fast path)
    assert allowed_keys(padded, padded, window=3)[1, 6].tolist() == [False] * 4 + [True] * 3 + [False] * 2
    assert segment_mask("sdpa", valid, zeros, valid, torch.float32, window=9) is None
    windowed = segment_mask("sdpa", valid, zeros, valid, torch.float32, window=3)
    assert kind(windowed) == "bool" and windowed[0, 0, 8].tolist() == [False] * 6 + [True] * 3
    with pytest.raises(ValueError, match="FlashAttention path has no sliding window"):
        segment_mask("flash_attention_2", valid, zeros, valid, torch.float32, window=3)


def forms_and_outputs(model, inp, method, keep, fast: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, Any, Any]:
    """(mask forms used, prefill logits of the kept valid rows, greedy tokens)."""
    seen: Counter = Counter()
    build = segment_mask if fast else reference_mask

    def recording(*args: Any) -> Any:
        mask = build(*args)
        seen[kind(mask)] += 1
        return mask

    monkeypatch.setattr(engine, "segment_mask", recording)
    vlm_prune.wrap(model, method, keep=keep)
    try:
        logits, gen = inv.run(model, inp, steps=6)
        rows = model.vlm_prune.last_rows
    finally:
        vlm_prune.unwrap(model)
        monkeypatch.undo()
    return seen, logits[rows >= 0], gen


def pact() -> Any:
    from vlm_prune.methods.pact import PACT

    return PACT(layer=2, rho=0.75, cutoff=0.6)  # the official knobs (no target): merges happen


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
@pytest.mark.parametrize("case", ["llava", "onevision_video", "qwen2_vl_image"])
def test_fast_masks_equal_float_masks_end_to_end(case: str, attn: str, monkeypatch: pytest.MonkeyPatch, request) -> None:
    """Prefill logits (valid rows) and a greedy generate are bit-identical with the fast masks
    and with every segment on the slow mask: batch 1 and a left-padded batch 2, keep=1.0, an
    in-LLM removal (FastV) and PACT's merges (log-size bias)."""
    if attn != "sdpa":
        request.getfixturevalue("flash_attn_standin")
    model, make = inv.build(case, attn)
    used: Counter = Counter()
    for batch in (1, 2):
        inp = make(batch=batch)
        for method, keep in (("fastv", 1.0), ("fastv", 0.4), (pact(), None)):
            seen, logits, gen = forms_and_outputs(model, inp, method, keep, True, monkeypatch)
            _, ref_logits, ref_gen = forms_and_outputs(model, inp, method, keep, False, monkeypatch)
            assert torch.equal(logits, ref_logits), (batch, method, keep)
            assert torch.equal(gen, ref_gen), (batch, method, keep)
            used += seen
    expected = {"none", "bool", "float"} if attn == "sdpa" else {"none", "2d"}
    assert expected <= set(used), used  # every fast form really ran
