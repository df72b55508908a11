"""A pure-PyTorch stand-in for the parts of ``flash_attn`` (FlashAttention-2) transformers calls.

The real package needs CUDA; this one runs the same contract on CPU, in float32 too, so the
transformers FlashAttention-2 glue (unpadding, cu_seqlens, 2-D masks, position ids, KV cache)
and vlm_prune's flash branch can be tested exactly. Semantics follow flash-attn >= 2.1:

- ``flash_attn_varlen_func``: sequences packed along the first axis, delimited by int32
  ``cu_seqlens``; a causal mask is aligned to the BOTTOM-RIGHT corner of each
  (seqlen_q, seqlen_k) block: query i sees key j iff j <= i + seqlen_k - seqlen_q.
  ``window_size=(left, right)`` (-1: unbounded) is measured from that same diagonal, and
  causal means right = 0. GQA: query head h reads key/value head h // (nheads // nheads_k).
  ``softcap > 0`` gives softcap * tanh(scale * q.k / softcap). A query row with no visible
  key outputs 0.
- ``flash_attn_func``: the same on a dense [B, S, H, d] batch.
- ``bert_padding.pad_input`` / ``unpad_input``: transformers' own copies of them.

The arithmetic is a plain float32 masked softmax, so results equal any other exact attention
to rounding. :func:`installed` (and the pytest fixture :func:`flash_attn_standin`) makes
transformers load it.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator

import pytest
import torch

_NO_WINDOW = (-1, -1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
    window: tuple[int, int], softcap: float,
) -> torch.Tensor:
    """One sequence: q [sq, H, d], k / v [sk, Hk, d] -> [sq, H, d]."""
    sq, heads = q.shape[:2]
    sk, kv_heads = k.shape[:2]
    k = k.repeat_interleave(heads // kv_heads, dim=1).float()
    v = v.repeat_interleave(heads // kv_heads, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # each query's own key column
    key = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= key >= diag - left
    if right >= 0:
        allowed &= key <= diag + right
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def _lengths(cu: torch.Tensor, total: int, max_len: int | torch.Tensor, name: str) -> list[int]:
    """Start offsets from ``cu_seqlens``, checked the way the kernel relies on them."""
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise ValueError(f"cu_seqlens_{name} must be a 1-D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}")
    starts = cu.tolist()
    lens = [b - a for a, b in zip(starts, starts[1:])]
    if starts[0] != 0 or starts[-1] != total or min(lens, default=0) < 0:
        raise ValueError(f"cu_seqlens_{name}={starts} does not partition {total} tokens")
    if max(lens, default=0) > int(max_len):
        raise ValueError(f"a sequence of {max(lens)} tokens exceeds max_seqlen_{name}={int(max_len)}")
    return starts


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | torch.Tensor, max_seqlen_k: int | torch.Tensor,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = _NO_WINDOW, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False, block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over packed sequences: q [total_q, H, d], k / v [total_k, Hk, d] -> [total_q, H, d].

    The signature is flash-attn's (transformers inspects it to choose the kwargs it passes);
    ``deterministic`` is moot here, the stand-in always is.
    """
    if dropout_p != 0.0:
        raise ValueError(f"the flash_attn stand-in is for inference: dropout_p must be 0, got {dropout_p}")
    if alibi_slopes is not None or return_attn_probs or block_table is not None:
        raise NotImplementedError("the flash_attn stand-in has no alibi_slopes, return_attn_probs or block_table")
    if q.shape[1] % k.shape[1] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"heads: q {q.shape[1]} must be a multiple of k {k.shape[1]}; k and v must match")
    starts_q = _lengths(cu_seqlens_q, q.shape[0], max_seqlen_q, "q")
    starts_k = _lengths(cu_seqlens_k, k.shape[0], max_seqlen_k, "k")
    if len(starts_q) != len(starts_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros_like(q)
    for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
        if q1 > q0:
            out[q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, causal, tuple(window_size), softcap)
    return out


def flash_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = _NO_WINDOW, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False,
) -> torch.Tensor:
    """Attention on a dense batch: q [B, Sq, H, d], k / v [B, Sk, Hk, d] -> [B, Sq, H, d]."""
    b, sq = q.shape[:2]
    sk = k.shape[1]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sq
    cu_k = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sk
    out = flash_attn_varlen_func(
        q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]),
        cu_q, cu_k, sq, sk, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    return out.view(q.shape)


def flash_attn_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
    v: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0, return_softmax_lse: bool = False,
) -> torch.Tensor:
    """Not provided, only its signature (transformers inspects it): transformers calls it for paged
    caches only (continuous batching), never in ``generate()`` with a DynamicCache, which goes
    through flash_attn_varlen_func / flash_attn_func."""
    raise NotImplementedError(
        "the flash_attn stand-in has no flash_attn_with_kvcache: transformers uses it only for paged "
        "attention (block_table, continuous batching); use generate() with a DynamicCache"
    )


def _modules() -> tuple[types.ModuleType, types.ModuleType]:
    """Fresh ``flash_attn`` and ``flash_attn.bert_padding`` module objects exposing the stand-in."""
    from transformers.modeling_flash_attention_utils import _pad_input, _unpad_input

    pkg = types.ModuleType("flash_attn", "pure-PyTorch stand-in for flash-attn 2 (tests only)")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    pkg.__path__ = []
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    padding.pad_input, padding.unpad_input = _pad_input, _unpad_input
    pkg.flash_attn_func, pkg.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    pkg.flash_attn_with_kvcache = flash_attn_with_kvcache
    pkg.bert_padding = padding
    return pkg, padding


#: transformers' lazily loaded flash functions (modeling_flash_attention_utils globals)
_LAZY_GLOBALS = (
    "_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn",
    "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn",
)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Make attn_implementation="flash_attention_2" load the stand-in inside the block; undone after.

    Installs ``flash_attn`` / ``flash_attn.bert_padding`` in sys.modules, reports FA2 (and not
    FA3 / FA4) available where transformers reads it (modeling_flash_attention_utils and its
    compatibility matrix, which modeling_utils checks, with CPU as a supported device), and
    clears transformers' lazily loaded flash functions so they are loaded from the stand-in,
    then restores all of it. Models built with FA2 must only run inside the block.
    """
    import transformers.modeling_flash_attention_utils as fa_utils

    pkg, padding = _modules()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flash_attn", pkg)
        mp.setitem(sys.modules, "flash_attn.bert_padding", padding)
        mp.setattr(fa_utils, "is_flash_attn_2_available", lambda kernels_fallback_ok=False: True)
        mp.setattr(fa_utils, "is_flash_attn_3_available", lambda kernels_fallback_ok=False: False)
        mp.setattr(fa_utils, "is_flash_attn_4_available", lambda kernels_fallback_ok=False: False)
        fa2 = fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]
        mp.setitem(fa2, "general_availability_check", lambda kernels_fallback_ok=False: True)
        mp.setitem(fa2, "supported_devices", (*fa2["supported_devices"], (lambda: True, "cpu")))
        for name in _LAZY_GLOBALS:
            mp.setattr(fa_utils, name, None)
        yield


@pytest.fixture
def flash_attn_standin() -> Iterator[None]:
    """The stand-in installed for one test (see :func:`installed`)."""
    with installed():
        yield
