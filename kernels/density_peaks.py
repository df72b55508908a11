"""Building blocks of DBDPC, the density-peak clustering of PACT (Dhouib et al., CVPR 2025;
orailix/PACT). The clustering loop itself lives in ``vlm_prune.methods``.

- ``cosine_distance(x, y)``: d_ij = max(0, 1 - cos(x_i, y_j)).
- ``density(x, bandwidth=2.0)``: rho_i = sum over valid j (i itself included) of
  exp(-(d_ij / bandwidth) ** 2). The official code fixes this width at 2 (``DBDPC(dc=2)``);
  it is NOT the clustering cutoff d_c (0.21 / 0.1), which only decides centres and assignment.
- ``density_rank(rho)``: PACT replaces rho by its rank before the loop (numerical stability).
- ``nearest_denser(x, rho)``: delta_i = distance to the nearest strictly denser point, and
  that point's index (the density-peak "parent").

Ties in rho follow one rule everywhere: point j is denser than point i iff
rho_j > rho_i, or rho_j == rho_i and j < i (the lower index wins). ``density_rank`` uses the same
rule, so ranks are distinct and exactly one valid point (the densest) has no denser point.
Cosines use x / max(||x||, 1e-12), as ``torch.nn.functional.normalize``: a zero vector is at
distance 1 from everything. Everything is computed in float32; the Triton kernels
(``vlm_prune.kernels.density_peaks_triton``) tile the N x N distances and never store them,
the references process ``chunk`` rows at a time (memory O(chunk N)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from vlm_prune.kernels._dispatch import resolve_backend, triton_module

CHUNK = 1024  # rows per step of the PyTorch references


def _check_points(x: torch.Tensor, valid: torch.Tensor | None, name: str = "x") -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [N, D], got {tuple(x.shape)}")
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (x.shape[0],)):
        raise ValueError(f"valid must be a bool [N] = ({x.shape[0]},) tensor, got {valid.dtype} {tuple(valid.shape)}")


def cosine_distance_torch(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`cosine_distance` (holds the [N, M] output only)."""
    return (1.0 - F.normalize(x.float(), dim=1) @ F.normalize(y.float(), dim=1).T).clamp(min=0.0)


def cosine_distance(x: torch.Tensor, y: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Pairwise cosine distance max(0, 1 - cos(x_i, y_j)): x [N, D], y [M, D] (any float dtype)
    -> [N, M] float32. Memory: the output plus O(N + M) inverse norms."""
    _check_points(x, None)
    _check_points(y, None, "y")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must have the same feature size D")
    if resolve_backend(backend, x, y) == "torch":
        return cosine_distance_torch(x, y)
    return triton_module("density_peaks_triton").cosine_distance_triton(x, y)


def density_torch(x: torch.Tensor, bandwidth: float = 2.0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for :func:`density` (memory O(CHUNK N))."""
    _check_points(x, valid)
    n = x.shape[0]
    ok = torch.ones(n, dtype=torch.bool, device=x.device) if valid is None else valid
    rho = torch.zeros(n, dtype=torch.float32, device=x.device)
    for r0 in range(0, n, CHUNK):
        rho[r0 : r0 + CHUNK] = density_of_rows(cosine_distance_torch(x[r0 : r0 + CHUNK], x), bandwidth, ok)
    return torch.where(ok, rho, 0.0)


def density_of_rows(d: torch.Tensor, bandwidth: float, ok: torch.Tensor) -> torch.Tensor:
    """sum_{valid j} exp(-(d_ij / bandwidth)^2) of distance rows d [R, N] (ok: [N] bool)."""
    return (torch.exp(-((d / bandwidth) ** 2)) * ok[None, :]).sum(1)


def cosine_distance_chunked(x: torch.Tensor) -> torch.Tensor:
    """[N, N] :func:`cosine_distance_torch` of x with itself, ``CHUNK`` rows per product: the same
    blocks (so the same values) as :func:`density_torch` and :func:`nearest_denser_torch` compute."""
    n = x.shape[0]
    x = x.detach()  # distances for selection only (matmul(out=) takes no autograd inputs)
    xn = F.normalize(x.float(), dim=1)
    out = torch.empty(n, n, device=x.device)
    for r0 in range(0, n, CHUNK):  # in place: 1 - cos, clamped, as cosine_distance_torch
        torch.matmul(F.normalize(x[r0 : r0 + CHUNK].float(), dim=1), xn.T, out=out[r0 : r0 + CHUNK])
    return out.neg_().add_(1.0).clamp_(min=0.0)


def density(
    x: torch.Tensor, bandwidth: float = 2.0, valid: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """DBDPC density rho_i = sum_{valid j} exp(-(d_ij / bandwidth)^2): x [N, D] -> [N] float32.

    bandwidth defaults to 2, the official PACT value (independent of the cutoff d_c). valid:
    [N] bool (default all); invalid points neither count as neighbours nor get a density (0).
    Memory O(N) on the Triton path: distance tiles are reduced in registers.
    """
    _check_points(x, valid)
    if bandwidth <= 0:
        raise ValueError(f"density bandwidth must be > 0, got {bandwidth}")
    extra = [] if valid is None else [valid]
    if resolve_backend(backend, x, *extra) == "torch":
        return density_torch(x, bandwidth, valid)
    return triton_module("density_peaks_triton").density_triton(x, bandwidth, valid)


def density_rank(rho: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Replace densities by ranks 0 .. n_valid - 1 (float32, highest rho = highest rank).

    Equal densities: the lower index gets the higher rank (the tie rule of this module).
    Invalid points get rank -1.
    """
    if rho.dim() != 1:
        raise ValueError(f"rho must be [N], got {tuple(rho.shape)}")
    ok = torch.ones_like(rho, dtype=torch.bool) if valid is None else valid
    order = torch.argsort(torch.where(ok, rho.float(), float("-inf")), descending=True, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(rho.numel(), device=rho.device)
    return torch.where(ok, ok.sum() - 1 - position, -1).float()


def _denser(rho_j: torch.Tensor, j: torch.Tensor, rho_i: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return (rho_j > rho_i) | ((rho_j == rho_i) & (j < i))


def nearest_denser_torch(
    x: torch.Tensor, rho: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`nearest_denser` (memory O(CHUNK N))."""
    _check_points(x, valid)
    n = x.shape[0]
    ok = torch.ones(n, dtype=torch.bool, device=x.device) if valid is None else valid
    rho = rho.float()
    idx = torch.arange(n, device=x.device)
    delta = torch.full((n,), float("inf"), device=x.device)
    parent = torch.full((n,), -1, dtype=torch.long, device=x.device)
    for r0 in range(0, n, CHUNK):
        rows = idx[r0 : r0 + CHUNK]
        d = cosine_distance_torch(x[rows], x)
        allowed = ok[None, :] & _denser(rho[None, :], idx[None, :], rho[rows, None], rows[:, None])
        best, arg = torch.where(allowed, d, float("inf")).min(1)
        found = torch.isfinite(best) & ok[rows]
        delta[rows] = torch.where(found, best, float("inf"))
        parent[rows] = torch.where(found, arg, -1)
    return delta, parent


def nearest_denser(
    x: torch.Tensor, rho: torch.Tensor, valid: torch.Tensor | None = None, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distance to, and index of, the nearest denser point: x [N, D], rho [N] ->
    (delta [N] float32, parent [N] int64).

    Only valid points (default all) are candidates and get a result; j is denser than i iff
    rho_j > rho_i or (rho_j == rho_i and j < i). Equal distances pick the lowest j. The densest
    valid point and every invalid point get delta = inf, parent = -1. Memory O(N) on the Triton
    path (running min per row over distance tiles).
    """
    _check_points(x, valid)
    if tuple(rho.shape) != (x.shape[0],):
        raise ValueError(f"rho must be [N] = ({x.shape[0]},), got {tuple(rho.shape)}")
    extra = [] if valid is None else [valid]
    if resolve_backend(backend, x, rho, *extra) == "torch":
        return nearest_denser_torch(x, rho, valid)
    return triton_module("density_peaks_triton").nearest_denser_triton(x, rho, valid)
