"""Gathering kept rows and averaging merged clusters, for ragged batches.

- ``gather_rows(x, index, valid)``: x [B, S, D] -> [B, K, D], zeros where ``valid`` is False.
- ``scatter_mean(x, assign, num_clusters, weights)``: weighted cluster means and cluster sizes;
  x [N, D] with assign [N], or batched x [B, N, D] with assign [B, N] (clusters per sample).

PyTorch references ``*_torch``; Triton kernels in ``vlm_prune.kernels.merge_triton`` (scatter_mean
sorts the assignments and sums each cluster's rows in one program: deterministic, no atomics).
"""
from __future__ import annotations

import torch
from vlm_prune.kernels._dispatch import resolve_backend, triton_module


def _check_gather(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
    if x.dim() != 3 or index.dim() != 2 or index.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [B, S, D] and index [B, K], got {tuple(x.shape)} and {tuple(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index must be int32 or int64, got {index.dtype}")
    if valid.dtype != torch.bool or valid.shape != index.shape:
        raise ValueError(f"valid must be a bool tensor shaped like index {tuple(index.shape)}, got {valid.dtype} {tuple(valid.shape)}")
    bad = valid & ((index < 0) | (index >= x.shape[1]))
    if bool(bad.any()):
        raise IndexError(f"valid entries of index must lie in [0, {x.shape[1]}); first bad (b, k): {bad.nonzero()[0].tolist()}")


def gather_rows_torch(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`gather_rows`."""
    _check_gather(x, index, valid)
    safe = torch.where(valid, index, 0).long()
    out = torch.gather(x, 1, safe[:, :, None].expand(-1, -1, x.shape[2]))
    return out.masked_fill(~valid[:, :, None], 0)


def gather_rows(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """out[b, k] = x[b, index[b, k]] where valid[b, k], else 0.

    x: [B, S, D] any dtype; index: [B, K] int32/int64 (entries under valid=False are ignored,
    the others must lie in [0, S) - checked, which costs one device sync); valid: [B, K] bool.
    Returns [B, K, D] in x's dtype. Memory: the output only.
    """
    _check_gather(x, index, valid)
    if resolve_backend(backend, x, index, valid) == "torch":
        return gather_rows_torch(x, index, valid)
    return triton_module("merge_triton").gather_rows_triton(x, index, valid)


def _flatten_batch(x: torch.Tensor, assign: torch.Tensor, num_clusters: int, weights: torch.Tensor | None):
    """Batched inputs [B, N, ...] -> flat [B*N, ...] with cluster ids offset by b * num_clusters."""
    if x.dim() not in (2, 3) or assign.shape != x.shape[:-1]:
        raise ValueError(f"x must be [N, D] or [B, N, D] with assign [N] or [B, N], got {tuple(x.shape)} and {tuple(assign.shape)}")
    if assign.dtype != torch.long:
        raise ValueError(f"assign must be int64 (torch.long), got {assign.dtype}")
    if weights is not None and weights.shape != assign.shape:
        raise ValueError(f"weights must be shaped like assign {tuple(assign.shape)}, got {tuple(weights.shape)}")
    if num_clusters < 0:
        raise ValueError(f"num_clusters must be >= 0, got {num_clusters}")
    if bool(((assign < -1) | (assign >= num_clusters)).any()):
        raise IndexError(f"assign entries must be -1 (discard) or in [0, {num_clusters})")
    if x.dim() == 2:
        return x, assign, weights
    b, n = assign.shape
    offsets = torch.arange(b, device=assign.device)[:, None] * num_clusters
    flat_assign = torch.where(assign >= 0, assign + offsets, -1).reshape(b * n)
    return x.reshape(b * n, -1), flat_assign, None if weights is None else weights.reshape(b * n)


def _unflatten(x: torch.Tensor, means: torch.Tensor, sizes: torch.Tensor, num_clusters: int):
    if x.dim() == 2:
        return means, sizes
    b = x.shape[0]
    return means.reshape(b, num_clusters, -1), sizes.reshape(b, num_clusters)


def scatter_mean_torch(
    x: torch.Tensor, assign: torch.Tensor, num_clusters: int, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`scatter_mean`."""
    flat_x, flat_a, flat_w = _flatten_batch(x, assign, num_clusters, weights)
    c = num_clusters * (x.shape[0] if x.dim() == 3 else 1)
    keep = flat_a >= 0
    w = torch.ones(flat_a.shape, device=x.device) if flat_w is None else flat_w.float()
    a, w, rows = flat_a[keep], w[keep], flat_x[keep].float()
    sizes = torch.zeros(c, device=x.device).index_add_(0, a, w)
    sums = torch.zeros(c, flat_x.shape[1], device=x.device).index_add_(0, a, rows * w[:, None])
    means = torch.where(sizes[:, None] != 0, sums / torch.where(sizes != 0, sizes, 1.0)[:, None], 0.0)
    return _unflatten(x, means.to(x.dtype), sizes, num_clusters)


def scatter_mean(
    x: torch.Tensor,
    assign: torch.Tensor,
    num_clusters: int,
    weights: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean of the rows of each cluster, and the cluster sizes.

    x: [N, D] (or [B, N, D]); assign: [N] (or [B, N]) int64 cluster id in [0, num_clusters), -1 to
    discard the row; weights: like assign, default 1. Returns means [C, D] (or [B, C, D]) in x's
    dtype, accumulated in float32, and sizes [C] (or [B, C]) float32 = sum of member weights.
    An empty (or zero-weight) cluster has mean 0 and size 0. Memory: outputs plus O(N) for the
    sort of the assignments on the Triton path.
    """
    flat_x, flat_a, flat_w = _flatten_batch(x, assign, num_clusters, weights)
    extra = [] if weights is None else [weights]
    if resolve_backend(backend, x, assign, *extra) == "torch":
        return scatter_mean_torch(x, assign, num_clusters, weights)
    c = num_clusters * (x.shape[0] if x.dim() == 3 else 1)
    means, sizes = triton_module("merge_triton").scatter_mean_triton(flat_x, flat_a, c, flat_w)
    return _unflatten(x, means, sizes, num_clusters)
