"""The selection code the fast paths replaced, kept verbatim as references
(``main`` at 9cd6db8): DBDPC and PACT's cutoff bisection recomputing density, distances and
assignment for every cutoff tried, DivPrune's and CDPruner's greedy loops as tensor ops with no
host sync. ``tests/test_selection_exact.py`` asserts the new code selects exactly as these."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.kernels import cosine_distance, density, density_rank, nearest_denser
from vlm_prune.methods.dbdpc import Clustering

CUTOFF_SEARCH_STEPS = 20
DENSE_MAX = 4096


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


def cluster_to_count(
    points: torch.Tensor, extra: torch.Tensor, target: int, d_c: float, extra_factor: float,
    importance: torch.Tensor,
) -> Clustering:
    """DBDPC of ``points`` with exactly ``target`` clusters (fewer only if fewer distinct points).

    Bisects the cutoff over [0, 2] (cosine distances), starting from ``d_c``: a larger cutoff
    gives fewer clusters. When no cutoff gives exactly ``target``, the clustering with the fewest
    clusters above it keeps the ``target`` centres of highest ``importance`` (EUTI); members of
    the other clusters join the nearest kept centre within ``extra_factor`` times the cutoff,
    like pruned tokens, or are dropped.
    """
    lo, hi, cut = 0.0, 2.0, d_c
    above: tuple[Clustering, float] | None = None
    for _ in range(CUTOFF_SEARCH_STEPS):
        cl = dbdpc(points, cut, extra=extra, extra_factor=extra_factor)
        n = cl.centres.numel()
        if n == target:
            return cl
        if n > target:
            lo = cut
            if above is None or n < above[0].centres.numel():
                above = (cl, cut)
        else:
            hi = cut
        cut = (lo + hi) / 2
    if above is None:  # even a zero cutoff merges duplicates below the target: keep them all
        return dbdpc(points, 0.0, extra=extra, extra_factor=extra_factor)
    cl, cut = above
    keep = torch.topk(importance[cl.centres].float(), target).indices.sort().values
    centres = cl.centres[keep]
    relabel = torch.full((cl.centres.numel() + 1,), -1, dtype=torch.long, device=points.device)
    relabel[keep] = torch.arange(target, device=points.device)
    labels = relabel[cl.labels]
    extra_labels = relabel[cl.extra_labels]  # -1 stays -1 (the last slot)
    loose_pts = labels < 0
    loose_extra = (cl.extra_labels >= 0) & (extra_labels < 0)
    for loose, pts, lab in ((loose_pts, points, labels), (loose_extra, extra, extra_labels)):
        if bool(loose.any()):
            best, nearest = cosine_distance(pts[loose], points[centres]).min(dim=1)
            lab[loose] = torch.where(best <= extra_factor * cut, nearest, torch.full_like(nearest, -1))
    return Clustering(centres, labels, extra_labels)


def max_min_diverse(features: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """Greedy max-min diversity subset of the rows of ``features`` [N, D] by cosine distance.

    First the row whose nearest neighbour is farthest; then, repeatedly, the row whose distance
    to its nearest chosen row is largest. Returns [k] indices in the order chosen. (As the
    official code; chosen rows are also excluded explicitly, so duplicates cannot be re-picked.)
    Up to :data:`DENSE_MAX` rows the distances are one N x N product; beyond, memory is O(chunk N):
    the first pick reduces ``chunk`` rows of distances at a time and each later step computes
    only the distance row of the newest pick. No host sync inside the loop.
    """
    n = features.shape[0]
    k = max(0, min(int(k), n))
    device = features.device
    if k == 0 or n == 1:
        return torch.zeros(k, dtype=torch.long, device=device)
    xn = F.normalize(features.float(), dim=1)
    if n <= DENSE_MAX:
        dist = (1.0 - xn @ xn.T).clamp(min=0.0)
        nn_dist = dist.clone().fill_diagonal_(float("inf")).min(dim=1).values  # symmetric: row min = column min

        def row(j: torch.Tensor) -> torch.Tensor:
            return dist.index_select(0, j)[0]
    else:
        nn_dist = torch.empty(n, device=device)
        for r0 in range(0, n, chunk):
            d = (1.0 - xn[r0 : r0 + chunk] @ xn.T).clamp(min=0.0)
            rows = torch.arange(d.shape[0], device=device)
            d[rows, rows + r0] = float("inf")
            nn_dist[r0 : r0 + chunk] = d.min(dim=1).values

        def row(j: torch.Tensor) -> torch.Tensor:
            return (1.0 - xn @ xn.index_select(0, j)[0]).clamp(min=0.0)
    chosen = torch.empty(k, dtype=torch.long, device=device)
    chosen[0] = nn_dist.argmax()
    min_dist = torch.full((n,), float("inf"), device=device)
    for i in range(1, k):
        j = chosen[i - 1 : i]
        min_dist = torch.minimum(min_dist, row(j))
        min_dist.index_fill_(0, j, float("-inf"))
        chosen[i] = min_dist.argmax()
    return chosen


class KernelRows:
    """Rows of a PSD kernel [N, N] on demand: ``rows(j [1])`` -> [N], and ``diagonal`` [N].

    Either a dense kernel, or the conditional kernel L = diag(r) S diag(r) in factored form
    (normalised features and r), so a greedy pass needs O(N D) memory, not O(N^2).
    """

    def __init__(self, kernel: torch.Tensor | None = None, features: torch.Tensor | None = None,
                 rel: torch.Tensor | None = None, chunk: int = 1024) -> None:
        if (kernel is None) == (features is None):
            raise ValueError("KernelRows takes either a dense kernel or features (with relevance rel)")
        self.kernel = None if kernel is None else kernel.float()
        if features is not None:
            self.xn = F.normalize(features.float(), dim=-1)
            self.rel = torch.ones(features.shape[0], device=features.device) if rel is None else rel.float()
            # the diagonal from square blocks of the Gram matrix: the values (and so the
            # tie-breaking of the first pick) of the dense kernel, in O(chunk N) memory
            gram = torch.cat([torch.diagonal(b @ b.T) for b in self.xn.split(chunk)])
            self.diagonal = self.rel * gram * self.rel
        else:
            self.diagonal = torch.diagonal(self.kernel).clone()

    def rows(self, j: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.index_select(0, j)[0]
        return self.rel.index_select(0, j) * (self.xn @ self.xn.index_select(0, j)[0]) * self.rel


def dpp_greedy_map(kernel: torch.Tensor | KernelRows, k: int, eps: float = 1e-10) -> torch.Tensor:
    """Greedy MAP inference of a DPP with PSD kernel [N, N] (a tensor or :class:`KernelRows`),
    by incremental Cholesky (Chen et al., NeurIPS 2018), as the official code: each step adds
    the item with the largest residual d_i^2 (the gain in log det), then updates every
    residual. Returns [k] indices in the order chosen. Once every residual is <= eps (k beyond
    the kernel's rank), the remaining picks go to the unchosen items of largest diagonal
    (relevance^2). The loop stays on the device: one host sync at the end, not one per step.
    """
    rows = kernel if isinstance(kernel, KernelRows) else KernelRows(kernel)
    diag = rows.diagonal
    n = diag.shape[0]
    k = max(0, min(int(k), n))
    cis = torch.zeros(k, n, device=diag.device)
    di2 = diag.clone()
    chosen = torch.zeros(k, dtype=torch.long, device=diag.device)
    ok = torch.zeros(k, dtype=torch.bool, device=diag.device)
    for i in range(k):
        j = di2.argmax().view(1)
        best = di2.index_select(0, j)
        chosen[i], ok[i] = j[0], best[0] > eps
        # the square root in double precision, as the official code takes it from a Python float
        e = (rows.rows(j) - cis[:i].index_select(1, j)[:, 0] @ cis[:i]) / best.clamp(min=eps).double().sqrt().float()
        cis[i] = e
        di2 = di2 - e * e
        di2.index_fill_(0, j, float("-inf"))
    n_ok = int(ok.cumprod(0).sum())  # picks before the first residual <= eps
    if n_ok == k:
        return chosen
    rest = diag.clone()
    rest[chosen[:n_ok]] = float("-inf")
    return torch.cat([chosen[:n_ok], torch.topk(rest, k - n_ok).indices])


def conditional_kernel(features: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    xn = F.normalize(features.float(), dim=-1)
    return rel[:, None] * (xn @ xn.t()) * rel[None, :]
