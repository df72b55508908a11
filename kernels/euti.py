"""EUTI token importance of PACT (Dhouib et al., CVPR 2025; orailix/PACT), attention-free.

qbar_h = mean over valid i of q_i,h;  a_h(j) = softmax over valid j of (qbar_h . k_j,h * scale);
s_j = mean_h a_h(j) * hidden_norm_j, and 0 for invalid j. Only H x N logits exist: cost O(N H d).
PyTorch reference ``euti_scores_torch``; Triton kernel in ``vlm_prune.kernels.euti_triton``.
"""
from __future__ import annotations

import torch
from vlm_prune.kernels._dispatch import resolve_backend, triton_module


def _check(q: torch.Tensor, k: torch.Tensor, hidden_norm: torch.Tensor, valid: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q must be [B, H, N, d] and k [B, Hkv, N, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key heads ({k.shape[1]}) for GQA")
    b, _, n, _ = q.shape
    if tuple(hidden_norm.shape) != (b, n):
        raise ValueError(f"hidden_norm must be [B, N] = {(b, n)}, got {tuple(hidden_norm.shape)}")
    if valid.dtype != torch.bool or tuple(valid.shape) != (b, n):
        raise ValueError(f"valid must be a bool [B, N] = {(b, n)} tensor, got {valid.dtype} {tuple(valid.shape)}")


def euti_scores_torch(
    q: torch.Tensor, k: torch.Tensor, hidden_norm: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Reference for :func:`euti_scores` (memory O(B H N) float32)."""
    _check(q, k, hidden_norm, valid)
    h = q.shape[1]
    k = k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k
    vf = valid.float()
    qbar = (q.float() * vf[:, None, :, None]).sum(2) / vf.sum(1).clamp(min=1)[:, None, None]  # [B, H, d]
    logits = torch.einsum("bhd,bhnd->bhn", qbar, k.float()) * scale
    probs = torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.where(valid, probs.mean(1) * hidden_norm.float(), 0.0)


def euti_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    hidden_norm: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """EUTI importance of every position (PACT): [B, N] float32.

    q: [B, H, N, d] queries and k: [B, Hkv, N, d] keys of layer L, both BEFORE RoPE (Hkv divides
    H; query head h reads key head h // (H // Hkv)); float32 / bfloat16 / float16, computed in
    float32. hidden_norm: [B, N] ||x_j||_2 of the hidden states entering the layer. valid:
    [B, N] bool, the positions N of the spec (system prompt + visual tokens); invalid positions
    neither enter the mean query nor the softmax, and score 0. scale: usually d ** -0.5.
    Memory: the output plus O(B H d) on the Triton path (two fused passes over k).
    """
    _check(q, k, hidden_norm, valid)
    if resolve_backend(backend, q, k, hidden_norm, valid) == "torch":
        return euti_scores_torch(q, k, hidden_norm, valid, scale)
    return triton_module("euti_triton").euti_scores_triton(q, k, hidden_norm, valid, scale)
