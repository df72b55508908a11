"""STACFP frame proposals (KeyScore paper, arXiv 2510.06509; no official code).

Each frame i of N becomes x_i = [v_i ; gamma_time * i / (N - 1)], with v_i its HSV colour
histogram; k-means runs for every k in a range and keeps the k with the best silhouette score;
each cluster proposes its medoid frame.

Choices the paper leaves open (unverified, all configurable): the histogram has 8 x 4 x 4
(H x S x V) bins and is L2-normalised, so colour distances lie in [0, sqrt(2)] and comparable
with gamma_time = 0.5; k ranges over 2..16 (capped at N - 1); k-means uses 4 restarts, seed 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Proposals:
    """indices: medoid frame per cluster, ascending. labels: cluster of every frame.
    k: the chosen cluster count. silhouette: its score (nan when no clustering ran)."""

    indices: np.ndarray
    labels: np.ndarray
    k: int
    silhouette: float


def require_stacfp_packages() -> None:
    """STACFP needs OpenCV (HSV histograms) and scikit-learn (k-means, silhouette): the ``video`` extra."""
    import importlib.util

    missing = [pkg for mod, pkg in (("cv2", "opencv-python-headless"), ("sklearn", "scikit-learn"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise ImportError(f"STACFP frame proposals need {' and '.join(missing)}: pip install 'vlm-prune[video]'"
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
    ids, labels = np.unique(labels, return_inverse=True)
    onehot = np.eye(ids.size)[labels]  # [N, K]
    sums = dist @ onehot  # [N, K] summed distance of each point to each cluster
    size = onehot.sum(0)
    own = size[labels]
    a = sums[np.arange(labels.size), labels] / np.maximum(own - 1, 1)
    other = np.where(onehot.astype(bool), np.inf, sums / size)
    b = other.min(1)
    score = np.where(own > 1, (b - a) / np.maximum(a, b), 0.0)
    return float(np.nan_to_num(score).mean())


def cluster_proposals(
    x: np.ndarray, k_range: tuple[int, int] = (2, 16), seed: int = 0, n_init: int = 4
) -> Proposals:
    """k-means on the rows of x for k in k_range (inclusive, capped at N - 1 and at the number
    of distinct rows); the best-silhouette k wins (smallest k on ties). N < 3: every row."""
    from sklearn.cluster import KMeans

    n = x.shape[0]
    k_lo, k_hi = k_range
    if k_lo < 2 or k_hi < k_lo:
        raise ValueError(f"k_range must be (k_min, k_max) with 2 <= k_min <= k_max, got {k_range}")
    k_hi = min(k_hi, n - 1, len(np.unique(x, axis=0)))
    if n < 3 or k_hi < 2:
        return Proposals(np.arange(n, dtype=np.int64), np.arange(n), n, float("nan"))
    k_lo = min(k_lo, k_hi)
    dist = pairwise_distances(x)  # shared by every k's silhouette and the medoids
    best: tuple[float, int, np.ndarray] | None = None
    for k in range(k_lo, k_hi + 1):
        labels = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit_predict(x)
        if len(np.unique(labels)) < 2:
            continue
        score = silhouette(dist, labels)
        if best is None or score > best[0] + 1e-12:
            best = (score, k, labels)
    if best is None:
        return Proposals(np.arange(n, dtype=np.int64), np.arange(n), n, float("nan"))
    score, k, labels = best
    return Proposals(medoids(dist, labels), labels, k, score)


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
