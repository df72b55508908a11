"""Attention rows computed on the side: softmax(q k^T * scale) for a few query rows.

Used by FastV and AdaptInfer so the model itself can keep SDPA / FlashAttention. Two entry points:

- ``attention_to_keys``: the head-averaged probability rows themselves, [B, Q, S].
- ``attention_key_scores``: those rows reduced to one score per key, [B, S], with optional
  causal positions, per-row (per-head) weights and grouped-query keys.

Each has a PyTorch reference (``*_torch``, same arguments minus ``backend``) and a Triton kernel
(``vlm_prune.kernels.attention_rows_triton``) that never forms the full [Q, S] logits matrix:
a first pass keeps a running max and sum per query row (online softmax), a second pass
recomputes the logits tile by tile and accumulates the normalised probabilities.
"""
from __future__ import annotations

import torch
from vlm_prune.kernels._dispatch import resolve_backend, triton_module


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, Q, d] and [B, Hkv, S, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch size or head dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]}) for GQA")


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat GQA key heads the Hugging Face way (query head h uses key head h // (H // Hkv))."""
    return k.repeat_interleave(heads // k.shape[1], dim=1) if k.shape[1] != heads else k


def attention_to_keys_torch(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for :func:`attention_to_keys` (memory O(B H Q S))."""
    _check_heads(q, k)
    logits = torch.einsum("bhqd,bhsd->bhqs", q.float(), _repeat_kv(k, q.shape[1]).float()) * scale
    logits = logits.masked_fill(~key_mask[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.mean(1)


def attention_to_keys(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor, scale: float, *, backend: str = "auto"
) -> torch.Tensor:
    """Head-averaged softmax probabilities of selected query rows over all keys.

    q: [B, H, Q, d]; k: [B, Hkv, S, d] with Hkv dividing H (GQA heads are repeated implicitly);
    float32 / bfloat16 / float16, computed in float32. key_mask: [B, Q, S] or [B, 1, S] bool,
    True where the row may attend to the key. Returns [B, Q, S] float32; a row with no allowed
    key is all zeros. Memory: the output plus O(B H Q) softmax statistics on the Triton path
    (the reference holds [B, H, Q, S] float32). The S x S matrix is never formed.
    """
    _check_heads(q, k)
    b, _, nq, _ = q.shape
    s = k.shape[2]
    if key_mask.dtype != torch.bool or key_mask.shape not in ((b, nq, s), (b, 1, s)):
        raise ValueError(f"key_mask must be a bool [B, Q, S] or [B, 1, S] = {(b, nq, s)} tensor, got {key_mask.dtype} {tuple(key_mask.shape)}")
    if resolve_backend(backend, q, k, key_mask) == "torch":
        return attention_to_keys_torch(q, k, key_mask, scale)
    return triton_module("attention_rows_triton").attention_to_keys_triton(q, k, key_mask, scale)


def _check_score_args(q, k, key_mask, q_pos, k_pos, row_weights, head_reduce) -> None:
    _check_heads(q, k)
    b, h, nq, _ = q.shape
    s = k.shape[2]
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, s)):
        raise ValueError(f"key_mask must be a bool [B, S] = {(b, s)} tensor, got {key_mask.dtype} {tuple(key_mask.shape)}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("causal masking needs both q_pos [B, Q] and k_pos [B, S]; pass both or neither")
    if q_pos is not None and (tuple(q_pos.shape) != (b, nq) or tuple(k_pos.shape) != (b, s)):
        raise ValueError(f"q_pos must be [B, Q] = {(b, nq)} and k_pos [B, S] = {(b, s)}, got {tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
    if row_weights is not None and tuple(row_weights.shape) not in ((b, nq), (b, h, nq)):
        raise ValueError(f"row_weights must be [B, Q] = {(b, nq)} or [B, H, Q] = {(b, h, nq)}, got {tuple(row_weights.shape)}")
    if head_reduce not in ("mean", "sum"):
        raise ValueError(f"head_reduce must be 'mean' or 'sum', got {head_reduce!r}")


def attention_key_scores_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    head_reduce: str = "mean",
) -> torch.Tensor:
    """Reference for :func:`attention_key_scores` (memory O(B H Q S))."""
    _check_score_args(q, k, key_mask, q_pos, k_pos, row_weights, head_reduce)
    b, h, nq, _ = q.shape
    s = k.shape[2]
    logits = torch.einsum("bhqd,bhsd->bhqs", q.float(), _repeat_kv(k, h).float()) * scale
    allowed = torch.ones(b, nq, s, dtype=torch.bool, device=q.device)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :]
    if q_pos is not None:
        allowed = allowed & (k_pos[:, None, :] <= q_pos[:, :, None])
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # [B, H, Q, S]
    if row_weights is not None:
        w = row_weights.float()
        probs = probs * (w[:, None, :, None] if w.dim() == 2 else w[..., None])
    per_head = probs.sum(2)  # [B, H, S]
    return per_head.mean(1) if head_reduce == "mean" else per_head.sum(1)


def attention_key_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    head_reduce: str = "mean",
    backend: str = "auto",
) -> torch.Tensor:
    """Attention each key receives from a set of query rows: [B, S] float32.

    score[b, s] = reduce_h sum_q w[b, (h,) q] * softmax_s(q[b,h,q] . k[b,h,s] * scale), where
    reduce_h is the mean (default) or sum over the H query heads.

    q: [B, H, Q, d]; k: [B, Hkv, S, d] with Hkv dividing H (GQA: query head h reads key head
    h // (H // Hkv); no copy is made on the Triton path); float32 / bfloat16 / float16, computed
    in float32. key_mask: [B, S] bool, keys any row may see (default all). q_pos [B, Q] and
    k_pos [B, S] (integers, both or neither): causal, key s allowed for row q iff
    k_pos[s] <= q_pos[q]. row_weights: [B, Q] or [B, H, Q] (default 1). Rows with no allowed key
    contribute 0. Memory on the Triton path: the [B, S] output plus O(B H Q) softmax statistics;
    the [Q, S] logits are never stored (the reference holds [B, H, Q, S] float32).
    """
    _check_score_args(q, k, key_mask, q_pos, k_pos, row_weights, head_reduce)
    extra = [t for t in (key_mask, q_pos, k_pos, row_weights) if t is not None]
    args = {"scale": scale, "key_mask": key_mask, "q_pos": q_pos, "k_pos": k_pos, "row_weights": row_weights,
            "head_reduce": head_reduce}
    if resolve_backend(backend, q, k, *extra) == "torch":
        return attention_key_scores_torch(q, k, **args)
    return triton_module("attention_rows_triton").attention_key_scores_triton(q, k, **args)
