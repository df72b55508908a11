"""DBDPC: Distance-Bounded Density Peak Clustering, the merging step of PACT.

PACT (Dhouib et al., CVPR 2025, "PACT: Pruning and Clustering-Based Token Reduction for
Faster Visual Language Models"; orailix/PACT). A pure function on a feature matrix; PACT calls
it on layer-L keys. Defaults follow the official code: density bandwidth 2, greedy finish when
a round yields fewer than 10 centres, extra (pruned) points re-attached within 1.5 d_c.
The distance, density and nearest-denser blocks come from :mod:`vlm_prune.kernels` (Triton on
CUDA): only the greedy finish holds a square distance matrix, over the points it walks. Each
round searches nearest denser points among the still unassigned points only (the same centres
as a search over all points restricted to them, at |U|^2 instead of N^2 per round).

Precision: everything here runs in float32. The official code clusters the keys in the model's
half precision, where rounding moves its own centres (Jaccard 0.35-0.90 against its float32
result in our comparison); float32 is the deliberate choice here, so results can differ from
the official run on the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_prune.kernels import cosine_distance, density, density_rank, nearest_denser


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


def find_centres(points: torch.Tensor, ranks: torch.Tensor, d_c: float, min_new: int = 10) -> torch.Tensor:
    """DBDPC centre selection over points [N, D] with distinct density ranks [N]; returns [C].

    Each round, among the still unassigned points U: delta_i = cosine distance to the nearest
    denser point of U (infinity for the densest); points with delta_i > d_c become centres, and
    every point within d_c of a new centre is assigned. When a round yields fewer than
    ``min_new`` centres, the rest is finished greedily: remaining points by descending density
    become centres unless within d_c of an existing centre.
    """
    unassigned = torch.ones(points.shape[0], dtype=torch.bool, device=points.device)
    centres: list[int] = []
    while bool(unassigned.any()):
        u = torch.nonzero(unassigned).squeeze(1)
        delta, _ = nearest_denser(points[u], ranks[u])  # among the unassigned points only
        new = u[delta > d_c]
        centres.extend(new.tolist())
        covered = (cosine_distance(points[u], points[new]) <= d_c).any(dim=1)
        unassigned[u[covered]] = False
        unassigned[new] = False
        if new.numel() < min_new:
            _greedy_finish(points, ranks, d_c, unassigned, centres)
            break
    return torch.tensor(centres, dtype=torch.long, device=points.device)


def _greedy_finish(
    points: torch.Tensor, ranks: torch.Tensor, d_c: float, unassigned: torch.Tensor, centres: list[int]
) -> None:
    """Walk the unassigned points by descending density; each one not within d_c of a centre
    becomes one. The points left are never within d_c of an earlier centre, so only the new
    greedy centres need checking."""
    rest = torch.nonzero(unassigned).squeeze(1)
    rest = rest[torch.argsort(ranks[rest], descending=True)]
    near = (cosine_distance(points[rest], points[rest]) <= d_c).cpu()
    taken = torch.zeros(rest.numel(), dtype=torch.bool)
    for i, point in enumerate(rest.tolist()):
        if not bool(taken[i]):
            centres.append(point)
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

    Density rho_i = sum_j exp(-(d_ij / bandwidth)^2), replaced by its rank as in the official
    code (equal densities: the lower index ranks higher). Every point joins its nearest centre
    (always within d_c). Rows of ``extra`` [M, D] (PACT's pruned tokens) join the nearest centre
    when within ``extra_factor * d_c``, else get -1.
    """
    device = points.device
    m = 0 if extra is None else extra.shape[0]
    if points.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return Clustering(empty, empty, torch.full((m,), -1, dtype=torch.long, device=device))
    ranks = density_rank(density(points, bandwidth))
    centres = find_centres(points, ranks, d_c, min_new)
    labels = cosine_distance(points, points[centres]).argmin(dim=1)
    labels[centres] = torch.arange(centres.numel(), device=device)
    if m == 0:
        return Clustering(centres, labels, torch.zeros(0, dtype=torch.long, device=device))
    best, extra_labels = cosine_distance(extra, points[centres]).min(dim=1)
    extra_labels = torch.where(best <= extra_factor * d_c, extra_labels, torch.full_like(extra_labels, -1))
    return Clustering(centres, labels, extra_labels)
