"""STACFP frame proposals (KeyScore paper, arXiv 2510.06509; no official code).

Each frame i of N becomes x_i = [v_i ; gamma_time * i / (N - 1)], with v_i its HSV colour
histogram; k-means runs for every k in a range and keeps the k with the best silhouette score;
each cluster proposes its medoid frame.

Choices the paper leaves open (unverified, all configurable): the histogram has 8 x 4 x 4
(H x S x V) bins and is L2-normalised, so colour distances lie in [0, sqrt(2)] and comparable
with gamma_time = 0.5; k ranges over 2..16 (capped at N - 1); k-means uses 4 restarts, seed 0.

k-means is :func:`kmeans`: scikit-learn's ``KMeans`` algorithm (k-means++ seeding with
2 + ln k local trials, Lloyd iterations to tol 1e-4 of the mean feature variance, the restart
of lowest inertia; read in scikit-learn 1.9.1, ``sklearn/cluster/_kmeans.py``: ``_kmeans_plusplus``,
``_tolerance``, ``_kmeans_single_lloyd``) in torch, every k of the range and
every restart in one batch, so the whole search is a few tensor operations per iteration instead
of 60 separate fits. Its random draws come from a torch generator, so the chosen clusters equal
scikit-learn's on well-separated data but can differ on ambiguous data (tests/test_stacfp_fast.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Proposals:
    """indices: medoid frame per cluster, ascending. labels: cluster of every frame.
    k: the chosen cluster count. silhouette: its score (nan when no clustering ran)."""

    indices: np.ndarray
    labels: np.ndarray
    k: int
    silhouette: float


def require_stacfp_packages() -> None:
    """STACFP needs OpenCV (HSV histograms): the ``video`` extra."""
    import importlib.util

    if importlib.util.find_spec("cv2") is None:
        raise ImportError("STACFP frame proposals need opencv-python-headless: pip install 'vlm-prune[video]'"
                          " (or, for KeyScore inside a model, KeyScore(proposals='all') to score every frame)")


def hsv_histograms(frames: np.ndarray, bins: tuple[int, int, int] = (8, 4, 4)) -> np.ndarray:
    """[T, H, W, 3] uint8 RGB frames -> [T, prod(bins)] L2-normalised HSV colour histograms."""
    import cv2

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3] RGB, got {frames.dtype} {frames.shape}")
    out = np.empty((frames.shape[0], int(np.prod(bins))), dtype=np.float64)
    for i, frame in enumerate(frames):
        hsv = cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2HSV)
        hist = cv2.calcHist([hsv], [0, 1, 2], None, list(bins), [0, 180, 0, 256, 0, 256]).ravel()
        out[i] = hist / max(float(np.linalg.norm(hist)), 1e-12)
    return out


def stacfp_features(hists: np.ndarray, gamma_time: float = 0.5) -> np.ndarray:
    """x_i = [v_i ; gamma_time * i / (N - 1)] (the time term is 0 for a single frame)."""
    n = hists.shape[0]
    t = np.arange(n, dtype=np.float64) / max(n - 1, 1)
    return np.concatenate([hists, gamma_time * t[:, None]], axis=1)


def pairwise_distances(x: np.ndarray) -> np.ndarray:
    """[N, N] Euclidean distances between the rows of x (exact zeros on the diagonal)."""
    d = np.sqrt(np.maximum(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1), 0.0))
    np.fill_diagonal(d, 0.0)
    return d


def medoids(dist: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per cluster, the member with the smallest summed distance (``dist`` [N, N]) to the other
    members (lowest index on ties); ascending frame indices."""
    out = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        d = dist[np.ix_(members, members)].sum(1)
        out.append(members[int(np.flatnonzero(d <= d.min() + 1e-9)[0])])
    return np.sort(np.asarray(out, dtype=np.int64))


def silhouette(dist: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette (b - a) / max(a, b) over all points from precomputed distances, as
    ``sklearn.metrics.silhouette_score``: a point alone in its cluster scores 0."""
    return float(silhouettes(dist, torch.as_tensor(np.unique(labels, return_inverse=True)[1])[None])[0])


def _sq_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., N, M] squared Euclidean distances between the rows of a [..., N, D] and b [..., M, D]
    (by |a|^2 - 2 a.b + |b|^2, clamped at 0; float64 keeps the error far below the data's scale)."""
    d = (a * a).sum(-1)[..., :, None] - 2 * a @ b.transpose(-1, -2) + (b * b).sum(-1)[..., None, :]
    return d.clamp(min=0)


def kmeans(x: np.ndarray | torch.Tensor, ks: Sequence[int], n_init: int = 4, seed: int = 0,
           max_iter: int = 300, tol: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of the rows of x [N, D] for every k of ``ks`` at once, ``n_init`` restarts each.

    scikit-learn's KMeans (algorithm="lloyd", init="k-means++") batched in float64 torch:
    k-means++ seeding (first centre uniform; each next one the best of 2 + int(ln k) candidates
    drawn in proportion to the squared distance to the nearest centre), then Lloyd steps until
    the labels stop changing or the centres move less than ``tol`` times the mean feature variance
    (squared shift summed over centres), at most ``max_iter``; an emptied cluster keeps its centre.
    Per k the restart of lowest inertia wins (the first on ties). Deterministic for a ``seed``.
    Returns (labels [len(ks), N] long, inertia [len(ks)] float64).
    """
    x = torch.as_tensor(x, dtype=torch.float64)
    n = x.shape[0]
    k_run = torch.tensor([k for k in ks for _ in range(n_init)])  # run r clusters into k_run[r]
    if k_run.numel() == 0 or int(k_run.min()) < 1 or int(k_run.max()) > n:
        raise ValueError(f"k-means needs 1 <= k <= {n} (the number of rows) for every k, got {list(ks)}")
    runs, k_max = k_run.numel(), int(k_run.max())
    gen = torch.Generator().manual_seed(seed)
    d_xx = _sq_distances(x, x)
    # k-means++ seeding, all runs together (a run stops adding centres at its own k)
    trials = 2 + torch.log(k_run.double()).long()
    first = torch.randint(n, (runs,), generator=gen)
    centres = x[first][:, None, :].repeat(1, k_max, 1)
    closest = d_xx[first]  # [R, N] squared distance to the nearest centre so far
    arange = torch.arange(runs)
    for c in range(1, k_max):
        grow = k_run > c
        pot = closest.sum(1, keepdim=True)
        draws = torch.rand(runs, int(trials.max()), generator=gen, dtype=torch.float64) * pot
        cand = torch.searchsorted(closest.cumsum(1), draws).clamp(max=n - 1)  # [R, L]
        cand_closest = torch.minimum(closest[:, None, :], d_xx[cand])  # [R, L, N]
        cand_pot = cand_closest.sum(-1).masked_fill(torch.arange(cand.shape[1]) >= trials[:, None], float("inf"))
        best = cand_pot.argmin(1)
        closest = torch.where(grow[:, None], cand_closest[arange, best], closest)
        centres[:, c] = torch.where(grow[:, None], x[cand[arange, best]], centres[:, c])
    # Lloyd iterations; converged runs are frozen
    unused = torch.arange(k_max) >= k_run[:, None]  # [R, k_max] centres a run does not have
    tol_abs = float(x.var(0, unbiased=False).mean()) * tol
    labels = torch.full((runs, n), -1, dtype=torch.long)
    active = torch.ones(runs, dtype=torch.bool)
    for _ in range(max_iter):
        new_labels = _sq_distances(x, centres).masked_fill(unused[:, None, :], float("inf")).argmin(-1)
        onehot = torch.nn.functional.one_hot(new_labels, k_max).to(x.dtype)  # [R, N, k_max]
        counts = onehot.sum(1)
        means = (onehot.transpose(1, 2) @ x) / counts.clamp(min=1)[..., None]
        new_centres = torch.where((counts > 0)[..., None], means, centres)
        shift = ((new_centres - centres) ** 2).sum((1, 2))
        strict = (new_labels == labels).all(1)
        centres = torch.where(active[:, None, None] & ~strict[:, None, None], new_centres, centres)
        labels = torch.where(active[:, None], new_labels, labels)
        active &= ~(strict | (shift <= tol_abs))
        if not bool(active.any()):
            break
    d = _sq_distances(x, centres).masked_fill(unused[:, None, :], float("inf"))
    inertia, labels = d.min(-1)
    inertia = inertia.sum(1).reshape(len(ks), n_init)
    pick = inertia.argmin(1)  # first restart on ties
    return labels.reshape(len(ks), n_init, n)[torch.arange(len(ks)), pick], inertia[torch.arange(len(ks)), pick]


def silhouettes(dist: np.ndarray | torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`silhouette` of several labelings [K, N] of the same points at once -> [K] float64."""
    dist = torch.as_tensor(dist, dtype=torch.float64)
    labels = torch.as_tensor(labels, dtype=torch.long)
    onehot = torch.nn.functional.one_hot(labels, int(labels.max()) + 1).to(torch.float64)  # [K, N, C]
    sums = dist @ onehot  # [K, N, C] summed distance of each point to each cluster
    size = onehot.sum(1)  # [K, C]
    own = size.gather(1, labels)  # [K, N]
    a = sums.gather(2, labels[..., None])[..., 0] / (own - 1).clamp(min=1)
    other = (sums / size.clamp(min=1)[:, None, :]).masked_fill(onehot.bool() | (size == 0)[:, None, :], float("inf"))
    b = other.min(-1).values
    score = torch.where(own > 1, (b - a) / torch.maximum(a, b), torch.zeros_like(a))
    return torch.nan_to_num(score, nan=0.0, posinf=0.0, neginf=0.0).mean(1)


def cluster_proposals(
    x: np.ndarray, k_range: tuple[int, int] = (2, 16), seed: int = 0, n_init: int = 4
) -> Proposals:
    """k-means (:func:`kmeans`) on the rows of x for k in k_range (inclusive, capped at N - 1 and
    at the number of distinct rows); the best-silhouette k wins (smallest k on ties). N < 3: every row."""
    n = x.shape[0]
    k_lo, k_hi = k_range
    if k_lo < 2 or k_hi < k_lo:
        raise ValueError(f"k_range must be (k_min, k_max) with 2 <= k_min <= k_max, got {k_range}")
    k_hi = min(k_hi, n - 1, len(np.unique(x, axis=0)))
    if n < 3 or k_hi < 2:
        return Proposals(np.arange(n, dtype=np.int64), np.arange(n), n, float("nan"))
    k_lo = min(k_lo, k_hi)
    dist = pairwise_distances(x)  # shared by every k's silhouette and the medoids
    ks = list(range(k_lo, k_hi + 1))
    labels, _ = kmeans(x, ks, n_init=n_init, seed=seed)
    scores = silhouettes(dist, labels).tolist()
    best: tuple[float, int] | None = None
    for i, score in enumerate(scores):
        if len(torch.unique(labels[i])) < 2:
            continue
        if best is None or score > best[0] + 1e-12:
            best = (score, i)
    if best is None:
        return Proposals(np.arange(n, dtype=np.int64), np.arange(n), n, float("nan"))
    score, i = best
    chosen = np.unique(labels[i].numpy(), return_inverse=True)[1]  # clusters numbered 0.. by first label
    return Proposals(medoids(dist, chosen), chosen, ks[i], score)


def stacfp_proposals(
    frames: np.ndarray,
    k_range: tuple[int, int] = (2, 16),
    gamma_time: float = 0.5,
    bins: tuple[int, int, int] = (8, 4, 4),
    seed: int = 0,
) -> Proposals:
    """STACFP on uint8 RGB frames [T, H, W, 3]: one medoid proposal per colour-time cluster."""
    require_stacfp_packages()
    x = stacfp_features(hsv_histograms(frames, bins), gamma_time)
    return cluster_proposals(x, k_range, seed)
