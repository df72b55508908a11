"""Triton kernels behind :mod:`vlm_prune.kernels.density_peaks` (imported only when used).

Every kernel builds cosine-distance tiles [BLOCK_N, BLOCK_M] from dots over BLOCK_D-wide slices
of the features, accumulated in float32 and scaled by inverse norms computed once in PyTorch.
bfloat16 / float16 features feed tensor cores (their products are exact in float32, so results
match the float32 reference up to summation order); float32 features use exact IEEE dots on
smaller tiles. Block sizes were chosen so no launch spills registers on sm_80 or sm_90
(``python -m vlm_prune.eval.kernel_report``).
``_density`` and ``_nearest_denser`` reduce each tile into per-row registers (a sum, a running
min with its index), so the N x N matrix is never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-12  # as torch.nn.functional.normalize


@triton.jit
def _dist_tile(x_ptr, y_ptr, inv_x, inv_y, offs_n, offs_m, N, M, D, sxn, sxd, syn, syd,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """max(0, 1 - cos) for rows offs_n of x against rows offs_m of y: [BLOCK_N, BLOCK_M]."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        xt = tl.load(x_ptr + offs_n[:, None] * sxn + offs_d[None, :] * sxd,
                     mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0)
        yt = tl.load(y_ptr + offs_m[:, None] * syn + offs_d[None, :] * syd,
                     mask=(offs_m[:, None] < M) & (offs_d[None, :] < D), other=0.0)
        acc = tl.dot(xt, tl.trans(yt), acc, input_precision="ieee")
    return tl.maximum(1.0 - acc * inv_x[:, None] * inv_y[None, :], 0.0)


@triton.jit
def _cosine(x_ptr, y_ptr, ix_ptr, iy_ptr, out_ptr, N, M, D, sxn, sxd, syn, syd,
            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    inv_x = tl.load(ix_ptr + offs_n, mask=offs_n < N, other=0.0)
    inv_y = tl.load(iy_ptr + offs_m, mask=offs_m < M, other=0.0)
    d = _dist_tile(x_ptr, y_ptr, inv_x, inv_y, offs_n, offs_m, N, M, D, sxn, sxd, syn, syd, BLOCK_N, BLOCK_M, BLOCK_D)
    tl.store(out_ptr + offs_n[:, None] * M + offs_m[None, :], d, mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))


@triton.jit
def _density(x_ptr, inv_ptr, valid_ptr, out_ptr, N, D, sxn, sxd, inv_bw,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inv_x = tl.load(inv_ptr + offs_n, mask=offs_n < N, other=0.0)
    rho = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, N, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        ok_m = tl.load(valid_ptr + offs_m, mask=offs_m < N, other=0) != 0
        inv_y = tl.load(inv_ptr + offs_m, mask=offs_m < N, other=0.0)
        d = _dist_tile(x_ptr, x_ptr, inv_x, inv_y, offs_n, offs_m, N, N, D, sxn, sxd, sxn, sxd, BLOCK_N, BLOCK_M, BLOCK_D) * inv_bw
        rho += tl.sum(tl.where(ok_m[None, :], tl.exp(-d * d), 0.0), axis=1)
    ok_n = tl.load(valid_ptr + offs_n, mask=offs_n < N, other=0) != 0
    tl.store(out_ptr + offs_n, tl.where(ok_n, rho, 0.0), mask=offs_n < N)


@triton.jit
def _nearest_denser(x_ptr, inv_ptr, valid_ptr, rho_ptr, delta_ptr, parent_ptr, N, D, sxn, sxd,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inv_x = tl.load(inv_ptr + offs_n, mask=offs_n < N, other=0.0)
    rho_n = tl.load(rho_ptr + offs_n, mask=offs_n < N, other=0.0)
    best = tl.full([BLOCK_N], float("inf"), tl.float32)
    arg = tl.full([BLOCK_N], -1, tl.int64)
    for m0 in range(0, N, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        ok_m = tl.load(valid_ptr + offs_m, mask=offs_m < N, other=0) != 0
        rho_m = tl.load(rho_ptr + offs_m, mask=offs_m < N, other=0.0)
        inv_y = tl.load(inv_ptr + offs_m, mask=offs_m < N, other=0.0)
        d = _dist_tile(x_ptr, x_ptr, inv_x, inv_y, offs_n, offs_m, N, N, D, sxn, sxd, sxn, sxd, BLOCK_N, BLOCK_M, BLOCK_D)
        denser = (rho_m[None, :] > rho_n[:, None]) | ((rho_m[None, :] == rho_n[:, None]) & (offs_m[None, :] < offs_n[:, None]))
        d = tl.where(ok_m[None, :] & denser, d, float("inf"))
        tile_best, tile_arg = tl.min(d, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = tile_best < best
        best = tl.where(better, tile_best, best)
        arg = tl.where(better, (m0 + tile_arg).to(tl.int64), arg)
    ok_n = tl.load(valid_ptr + offs_n, mask=offs_n < N, other=0) != 0
    found = ok_n & (best < float("inf"))
    tl.store(delta_ptr + offs_n, tl.where(found, best, float("inf")), mask=offs_n < N)
    tl.store(parent_ptr + offs_n, tl.where(found, arg, -1), mask=offs_n < N)


def _launch_config(x: torch.Tensor) -> dict:
    """Block sizes and launch options for the features' dtype (see the module docstring)."""
    if x.dtype == torch.float32:
        return {"BLOCK_N": 32, "BLOCK_M": 32, "BLOCK_D": 64, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_N": 32, "BLOCK_M": 64, "BLOCK_D": 64, "num_warps": 4, "num_stages": 2}


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.linalg.vector_norm(x.float(), dim=1).clamp(min=EPS)


def _valid_u8(valid: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    ok = torch.ones(n, dtype=torch.bool, device=device) if valid is None else valid.contiguous()
    return ok.view(torch.uint8)


def cosine_distance_triton(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Triton path of :func:`vlm_prune.kernels.cosine_distance` (arguments checked there)."""
    if x.dtype != y.dtype:  # a dot needs one operand dtype
        x, y = x.float(), y.float()
    n, d = x.shape
    m = y.shape[0]
    out = torch.empty(n, m, dtype=torch.float32, device=x.device)
    if n and m:
        config = _launch_config(x)
        _cosine[(triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(m, config["BLOCK_M"]))](
            x, y, _inv_norm(x), _inv_norm(y), out, n, m, d, *x.stride(), *y.stride(), **config)
    return out


def density_triton(x: torch.Tensor, bandwidth: float = 2.0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Triton path of :func:`vlm_prune.kernels.density` (arguments checked there)."""
    n, d = x.shape
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        config = _launch_config(x)
        _density[(triton.cdiv(n, config["BLOCK_N"]),)](x, _inv_norm(x), _valid_u8(valid, n, x.device), out, n, d,
                                                      *x.stride(), 1.0 / bandwidth, **config)
    return out


def nearest_denser_triton(x: torch.Tensor, rho: torch.Tensor, valid: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of :func:`vlm_prune.kernels.nearest_denser` (arguments checked there)."""
    n, d = x.shape
    delta = torch.empty(n, dtype=torch.float32, device=x.device)
    parent = torch.empty(n, dtype=torch.long, device=x.device)
    if n:
        config = _launch_config(x)
        _nearest_denser[(triton.cdiv(n, config["BLOCK_N"]),)](
            x, _inv_norm(x), _valid_u8(valid, n, x.device), rho.float().contiguous(), delta, parent, n, d,
            *x.stride(), **config)
    return delta, parent
