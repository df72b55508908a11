"""Triton kernels behind :mod:`vlm_prune.kernels.merge` (imported only when used).

``_gather``: one program per (sample, block of K, block of D) copies rows.
``_segment_mean``: the assignments are sorted once (stable) in PyTorch; one program per (cluster,
block of D) walks that cluster's contiguous run of rows and sums them in float32 - a fixed order,
so results are deterministic (no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather(x_ptr, idx_ptr, valid_ptr, out_ptr, K, D, sxb, sxs, sxd, sib, sik, svb, svk,
            BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = tl.load(valid_ptr + b * svb + offs_k * svk, mask=offs_k < K, other=0) != 0
    idx = tl.load(idx_ptr + b * sib + offs_k * sik, mask=ok, other=0)
    inside = (offs_k[:, None] < K) & (offs_d[None, :] < D)
    rows = tl.load(x_ptr + b * sxb + idx[:, None] * sxs + offs_d[None, :] * sxd, mask=inside & ok[:, None], other=0)
    tl.store(out_ptr + (b * K + offs_k[:, None]) * D + offs_d[None, :], rows, mask=inside)


@triton.jit
def _segment_mean(x_ptr, order_ptr, w_ptr, start_ptr, means_ptr, sizes_ptr, D, sxn, sxd,
                  HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    c = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(start_ptr + c)
    end = tl.load(start_ptr + c + 1)
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for r0 in range(start, end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        inside = offs_r < end
        rows = tl.load(order_ptr + offs_r, mask=inside, other=0)
        w = tl.load(w_ptr + rows, mask=inside, other=0.0).to(tl.float32) if HAS_W else inside.to(tl.float32)
        xt = tl.load(x_ptr + rows[:, None] * sxn + offs_d[None, :] * sxd,
                     mask=inside[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        acc += tl.sum(xt * w[:, None], axis=0)
        total += w
    size = tl.sum(total, axis=0)
    mean = tl.where(size != 0, acc / tl.where(size != 0, size, 1.0), 0.0)
    tl.store(means_ptr + c * D + offs_d, mean.to(means_ptr.dtype.element_ty), mask=offs_d < D)
    if tl.program_id(1) == 0:
        tl.store(sizes_ptr + c, size)


def gather_rows_triton(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Triton path of :func:`vlm_prune.kernels.gather_rows` (arguments checked there)."""
    b, _, d = x.shape
    k = index.shape[1]
    out = torch.empty(b, k, d, dtype=x.dtype, device=x.device)
    if out.numel():
        valid = valid.view(torch.uint8)
        bk, bd = 32, min(128, triton.next_power_of_2(d))
        _gather[(b, triton.cdiv(k, bk), triton.cdiv(d, bd))](x, index, valid, out, k, d, *x.stride(), *index.stride(),
                                                             *valid.stride(), BLOCK_K=bk, BLOCK_D=bd)
    return out


def scatter_mean_triton(x: torch.Tensor, assign: torch.Tensor, num_clusters: int, weights: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of :func:`vlm_prune.kernels.scatter_mean` on flat inputs x [N, D], assign [N]."""
    d = x.shape[1]
    means = torch.empty(num_clusters, d, dtype=x.dtype, device=x.device)
    sizes = torch.empty(num_clusters, dtype=torch.float32, device=x.device)
    if num_clusters == 0:
        return means, sizes
    keys, order = torch.sort(assign, stable=True)  # discarded rows (-1) come first and are skipped
    starts = torch.searchsorted(keys, torch.arange(num_clusters + 1, device=x.device))
    w = weights.contiguous() if weights is not None else sizes
    bd = min(128, max(16, triton.next_power_of_2(d)))
    _segment_mean[(num_clusters, triton.cdiv(max(d, 1), bd))](x, order, w, starts, means, sizes, d, *x.stride(),
                                                              HAS_W=weights is not None, BLOCK_R=32, BLOCK_D=bd)
    return means, sizes
