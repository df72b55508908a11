"""STACFP's silhouette and medoids from one shared distance matrix equal scikit-learn's
silhouette_score and the per-cluster medoid search they replace."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sklearn")
from sklearn.metrics import silhouette_score  # noqa: E402

from vlm_prune.frames.stacfp import medoids, pairwise_distances, silhouette  # noqa: E402


@pytest.mark.parametrize("seed,k", [(0, 2), (1, 5), (2, 16), (3, 31)])
def test_silhouette_equals_sklearn(seed: int, k: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 129))
    labels = np.concatenate([np.arange(k), rng.integers(0, k, 32 - k)])  # k = 31: singletons score 0
    assert silhouette(pairwise_distances(x), labels) == pytest.approx(silhouette_score(x, labels), abs=1e-12)


def test_medoids_from_the_shared_distances() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(20, 6))
    labels = rng.integers(0, 4, 20)
    expected = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        d = np.linalg.norm(x[members, None, :] - x[None, members, :], axis=-1).sum(1)
        expected.append(members[int(np.argmin(d))])
    assert medoids(pairwise_distances(x), labels).tolist() == sorted(expected)
