"""DBDPC: Distance-Bounded Density Peak Clustering, the merging step of PACT.

PACT (Dhouib et al., CVPR 2025, "PACT: Pruning and Clustering-Based Token Reduction for
Faster Visual Language Models"; orailix/PACT). Pure functions on a feature matrix; PACT calls
them on layer-L keys. Defaults follow the official code: density bandwidth 2, greedy finish
when an iteration yields fewer than 10 centres, pruned tokens re-attached within 1.5 d_c.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Clustering:
    """Result of :func:`dbdpc`.

    centres: [C] indices (into the clustered points) of the cluster centres, in the order found.
    labels: [N] cluster of every clustered point, as an index into ``centres``.
    extra_labels: [M] cluster of every extra point (PACT's pruned tokens) as an index into
        ``centres``, or -1 when it lies farther than ``extra_factor * d_c`` from every centre.
    """

    centres: torch.Tensor
    labels: torch.Tensor
    extra_labels: torch.Tensor


def cosine_distance(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """max(0, 1 - cos) between the rows of x [N, D] and of y [M, D] (default x), float32."""
    xn = F.normalize(x.float(), dim=-1)
    yn = xn if y is None else F.normalize(y.float(), dim=-1)
    dist = (1.0 - xn @ yn.t()).clamp(min=0.0)
    if y is None:
        dist.fill_diagonal_(0.0)
    return dist


def density_ranks(dist: torch.Tensor, bandwidth: float = 2.0) -> torch.Tensor:
    """Rank (0 = sparsest) of the density rho_i = sum_j exp(-(d_ij / bandwidth)^2).

    Ranks replace the raw densities, as in the official code, so that ties and rounding cannot
    make two points equally dense. Equal densities are ranked by index.
    """
    rho = torch.exp(-((dist / bandwidth) ** 2)).sum(dim=1)
    order = torch.argsort(rho, stable=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(rho.numel(), device=rho.device)
    return ranks


def find_centres(dist: torch.Tensor, ranks: torch.Tensor, d_c: float, min_new: int = 10) -> torch.Tensor:
    """DBDPC centre selection over a [N, N] distance matrix; returns [C] centre indices.

    Each round, among the still unassigned points U: delta_i = distance to the nearest denser
    point of U (infinity for the densest); points with delta_i > d_c become centres, and every
    point within d_c of a new centre is assigned. When a round yields fewer than ``min_new``
    centres, the rest is finished greedily: remaining points by descending density become
    centres unless within d_c of an existing centre.
    """
    n = dist.shape[0]
    unassigned = torch.ones(n, dtype=torch.bool, device=dist.device)
    centres: list[int] = []
    while bool(unassigned.any()):
        u = torch.nonzero(unassigned).squeeze(1)
        du = dist[u][:, u]
        denser = ranks[u][None, :] > ranks[u][:, None]  # [i, j]: j denser than i
        delta = torch.where(denser, du, torch.full_like(du, float("inf"))).min(dim=1).values
        new = u[delta > d_c]
        centres.extend(new.tolist())
        covered = (dist[u][:, new] <= d_c).any(dim=1)
        unassigned[u[covered]] = False
        unassigned[new] = False
        if new.numel() < min_new:
            _greedy_finish(dist, ranks, d_c, unassigned, centres)
            break
    return torch.tensor(centres, dtype=torch.long, device=dist.device)


def _greedy_finish(
    dist: torch.Tensor, ranks: torch.Tensor, d_c: float, unassigned: torch.Tensor, centres: list[int]
) -> None:
    """Walk the unassigned points by descending density; each one not within d_c of a centre
    becomes one. The points left are never within d_c of an earlier centre, so only the new
    greedy centres need checking."""
    rest = torch.nonzero(unassigned).squeeze(1)
    rest = rest[torch.argsort(ranks[rest], descending=True)]
    near = (dist[rest][:, rest] <= d_c).cpu()
    taken = torch.zeros(rest.numel(), dtype=torch.bool)
    for i in range(rest.numel()):
        if not bool(taken[i]):
            centres.append(int(rest[i]))
            taken |= near[i]


def dbdpc(
    points: torch.Tensor,
    d_c: float,
    extra: torch.Tensor | None = None,
    extra_factor: float = 1.5,
    bandwidth: float = 2.0,
    min_new: int = 10,
) -> Clustering:
    """Cluster the rows of ``points`` [N, D] by cosine distance with cutoff ``d_c``.

    Every point joins its nearest centre (always within d_c). Rows of ``extra`` [M, D] (PACT's
    pruned tokens) join the nearest centre when within ``extra_factor * d_c``, else get -1.
    """
    if points.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=points.device)
        m = 0 if extra is None else extra.shape[0]
        return Clustering(empty, empty, torch.full((m,), -1, dtype=torch.long, device=points.device))
    dist = cosine_distance(points)
    centres = find_centres(dist, density_ranks(dist, bandwidth), d_c, min_new)
    labels = dist[:, centres].argmin(dim=1)
    labels[centres] = torch.arange(centres.numel(), device=points.device)
    if extra is None or extra.shape[0] == 0:
        extra_labels = torch.zeros(0, dtype=torch.long, device=points.device)
    else:
        d_extra = cosine_distance(extra, points[centres])
        best, extra_labels = d_extra.min(dim=1)
        extra_labels = torch.where(best <= extra_factor * d_c, extra_labels, torch.full_like(extra_labels, -1))
    return Clustering(centres, labels, extra_labels)


def cluster_mean(
    values: torch.Tensor, labels: torch.Tensor, n_clusters: int, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean of ``values`` [N, D] per cluster (labels [N] in 0..n_clusters-1, rows with
    label -1 are ignored) and each cluster's total weight. Computed in float32."""
    keep = labels >= 0
    w = torch.ones(values.shape[0], device=values.device) if weights is None else weights.float()
    w, lab, val = w[keep], labels[keep], values[keep].float()
    total = torch.zeros(n_clusters, device=values.device).index_add_(0, lab, w)
    sums = torch.zeros(n_clusters, values.shape[1], device=values.device).index_add_(0, lab, val * w[:, None])
    return sums / total.clamp(min=1e-12)[:, None], total
