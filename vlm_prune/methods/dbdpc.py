"""DBDPC: Distance-Bounded Density Peak Clustering, the merging step of PACT.

PACT (Dhouib et al., CVPR 2025, "PACT: Pruning and Clustering-Based Token Reduction for
Faster Visual Language Models"; orailix/PACT, ``transformers/PACT/utils.py``, class ``DBDPC``,
``fit_variant``, read at 423c799f). A pure function on a feature matrix; PACT calls it on
layer-L keys. Defaults follow the official code: density bandwidth 2, greedy finish when
a round yields fewer than 10 centres, extra (pruned) points re-attached within 1.5 d_c.
The distance, density and nearest-denser blocks come from :mod:`vlm_prune.kernels` (Triton on
CUDA). Up to :data:`DENSE_MAX` points the N x N distances are computed once and every round
reads them (:class:`DensityPeaks`, which also keeps the density ranks and the first round for
further cutoffs); beyond, each round computes what it needs and only the greedy finish holds a
square matrix, over the points it walks. Each round searches nearest denser points among the
still unassigned points only (the same centres as a search over all points restricted to them,
at |U|^2 instead of N^2 per round).

Precision: everything here runs in float32. The official code clusters the keys in the model's
half precision, where rounding moves its own centres (Jaccard 0.35-0.90 against its float32
result in our comparison); float32 is the deliberate choice here, so results can differ from
the official run on the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlm_prune.kernels import cosine_distance, density, density_rank, nearest_denser
from vlm_prune.kernels._dispatch import resolve_backend
from vlm_prune.kernels.density_peaks import CHUNK, cosine_distance_chunked, density_of_rows


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


#: up to this many points the N x N cosine distances are computed once (<= 64 MiB float32) and
#: every round, the greedy finish and every cutoff tried read them; beyond it each round computes
#: the distances it needs (memory O(chunk N) outside the greedy finish)
DENSE_MAX = 4096


class DensityPeaks:
    """The cutoff-independent part of DBDPC on points [N, D], computed once for any number of
    cutoffs (PACT with a token target tries up to 20, :func:`~vlm_prune.methods.pact.cluster_to_count`).

    Holds the density ranks, the first round's nearest-denser distances (all points unassigned:
    the same for every cutoff) and, up to :data:`DENSE_MAX` points, the N x N cosine distances
    (rounds read rows of them; a product of a few columns can round a cosine one float32 ulp
    apart from the same entry of the full product, so only a distance within one ulp of the
    cutoff could be decided differently from computing each block afresh).
    ``ranks`` may be given (distinct, as :func:`~vlm_prune.kernels.density_rank` returns).
    """

    def __init__(self, points: torch.Tensor, bandwidth: float = 2.0, ranks: torch.Tensor | None = None) -> None:
        self.points = points
        n = points.shape[0]
        self.dist: torch.Tensor | None = None
        rho = None
        if n <= DENSE_MAX and resolve_backend("auto", points) == "torch":
            # the blocks density_torch computes: the density comes from them, value for value
            self.dist = cosine_distance_chunked(points)
            if ranks is None:
                ok = torch.ones(n, dtype=torch.bool, device=points.device)
                rho = torch.cat([density_of_rows(self.dist[r0 : r0 + CHUNK], bandwidth, ok) for r0 in range(0, n, CHUNK)])
        elif n <= DENSE_MAX:
            self.dist = cosine_distance(points, points)
        if ranks is None:
            ranks = density_rank(density(points, bandwidth) if rho is None else rho)
        self.ranks = ranks
        # distances to denser points only (inf elsewhere): a round's delta is a row minimum
        self._denser = None if self.dist is None else torch.where(ranks[None, :] > ranks[:, None], self.dist, float("inf"))
        self._first_delta: torch.Tensor | None = None

    def _delta(self, u: torch.Tensor | None, unassigned: torch.Tensor | None = None) -> torch.Tensor:
        """Distance of each point of ``u`` (None: all) to its nearest denser point of ``u``
        (``unassigned``: u as an [N] mask)."""
        if self.dist is None:
            pts, ranks = (self.points, self.ranks) if u is None else (self.points[u], self.ranks[u])
            return nearest_denser(pts, ranks)[0]
        if u is None:
            return self._denser.min(dim=1).values
        # whole rows (a contiguous gather), the columns outside u masked
        return torch.where(unassigned[None, :], self._denser.index_select(0, u), float("inf")).min(dim=1).values

    def _covered(self, u: torch.Tensor | None, new: torch.Tensor, d_c: float) -> torch.Tensor:
        """[len(u)] bool (u None: all points): within d_c of a point of ``new``. The dense path
        reads the rows of ``new`` (the distances are symmetric)."""
        if self.dist is None:
            pts = self.points if u is None else self.points[u]
            return (cosine_distance(pts, self.points[new]) <= d_c).any(dim=1)
        near = (self.dist.index_select(0, new) <= d_c).any(dim=0)
        return near if u is None else near[u]

    def centres(self, d_c: float, min_new: int = 10) -> torch.Tensor:
        """DBDPC centre selection at cutoff ``d_c``; returns [C] indices in the order found.

        Each round, among the still unassigned points U: delta_i = cosine distance to the
        nearest denser point of U (infinity for the densest); points with delta_i > d_c become
        centres, and every point within d_c of a new centre is assigned. When a round yields
        fewer than ``min_new`` centres, the rest is finished greedily: remaining points by
        descending density become centres unless within d_c of an existing centre.
        """
        if self._first_delta is None:
            self._first_delta = self._delta(None)
        device = self.points.device
        new = torch.nonzero(self._first_delta > d_c).squeeze(1)  # round 1: every point unassigned
        unassigned = ~self._covered(None, new, d_c)
        centres: list[int] = []
        while True:
            centres.extend(new.tolist())
            unassigned[new] = False
            if new.numel() < min_new:
                self._greedy_finish(d_c, unassigned, centres)
                break
            u = torch.nonzero(unassigned).squeeze(1)
            if u.numel() == 0:
                break
            new = u[self._delta(u, unassigned) > d_c]  # nearest denser among the unassigned points only
            unassigned[u[self._covered(u, new, d_c)]] = False
        return torch.tensor(centres, dtype=torch.long, device=device)

    def _greedy_finish(self, d_c: float, unassigned: torch.Tensor, centres: list[int]) -> None:
        """Walk the unassigned points by descending density; each one not within d_c of a centre
        becomes one. The points left are never within d_c of an earlier centre, so only the new
        greedy centres need checking (a walk over host memory: one boolean row per centre)."""
        rest = torch.nonzero(unassigned).squeeze(1)
        if rest.numel() == 0:
            return
        rest = rest[torch.argsort(self.ranks[rest], descending=True)]
        if self.dist is not None and self.dist.device.type == "cpu":
            # only the greedy centres' rows are read: O(C |rest|), not |rest|^2
            dist, cols = self.dist.numpy(), rest.numpy()
            taken = np.zeros(cols.size, dtype=bool)
            for i, point in enumerate(cols.tolist()):
                if not taken[i]:
                    centres.append(point)
                    taken |= dist[point, cols] <= d_c
            return
        if self.dist is None:
            near = cosine_distance(self.points[rest], self.points[rest]) <= d_c
        else:
            near = (self.dist.index_select(0, rest) <= d_c).index_select(1, rest)
        near = near.cpu().numpy()
        taken = np.zeros(rest.numel(), dtype=bool)
        for i, point in enumerate(rest.tolist()):
            if not taken[i]:
                centres.append(point)
                taken |= near[i]

    def cluster(self, d_c: float, extra: torch.Tensor | None = None, extra_factor: float = 1.5,
                min_new: int = 10) -> Clustering:
        """:func:`dbdpc` at cutoff ``d_c`` from the shared ranks and distances."""
        return self.assign(self.centres(d_c, min_new), d_c, extra, extra_factor)

    def assign(self, centres: torch.Tensor, d_c: float, extra: torch.Tensor | None = None,
               extra_factor: float = 1.5) -> Clustering:
        """Every point to its nearest centre; rows of ``extra`` to the nearest centre within
        ``extra_factor * d_c``, else -1."""
        points, device = self.points, self.points.device
        to_centres = cosine_distance(points, points[centres]) if self.dist is None else self.dist.index_select(1, centres)
        labels = to_centres.argmin(dim=1)
        labels[centres] = torch.arange(centres.numel(), device=device)
        if extra is None or extra.shape[0] == 0:
            return Clustering(centres, labels, torch.zeros(0, dtype=torch.long, device=device))
        best, extra_labels = cosine_distance(extra, points[centres]).min(dim=1)
        extra_labels = torch.where(best <= extra_factor * d_c, extra_labels, torch.full_like(extra_labels, -1))
        return Clustering(centres, labels, extra_labels)


def find_centres(points: torch.Tensor, ranks: torch.Tensor, d_c: float, min_new: int = 10) -> torch.Tensor:
    """DBDPC centre selection over points [N, D] with distinct density ranks [N]; returns [C]
    (:meth:`DensityPeaks.centres`)."""
    if points.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=points.device)
    return DensityPeaks(points, ranks=ranks).centres(d_c, min_new)


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
    return DensityPeaks(points, bandwidth).cluster(d_c, extra, extra_factor, min_new)
