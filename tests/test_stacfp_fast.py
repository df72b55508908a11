"""STACFP's clustering: the batched torch k-means (:func:`kmeans`) against scikit-learn's KMeans,
the batched silhouette against ``silhouette_score``, and the medoid search from the shared
distance matrix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
from sklearn.cluster import KMeans  # noqa: E402
from sklearn.metrics import silhouette_score  # noqa: E402

from vlm_prune.frames.stacfp import (  # noqa: E402
    cluster_proposals, kmeans, medoids, pairwise_distances, silhouette, silhouettes,
)


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """True when the labelings a and b group the points alike (cluster numbers aside)."""
    pairs = set(zip(np.asarray(a).tolist(), np.asarray(b).tolist()))
    return len(pairs) == len(set(np.asarray(a).tolist())) == len(set(np.asarray(b).tolist()))


def blobs(seed: int, centres: int, per: int, dim: int = 129, spread: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """``centres`` well-separated clusters of ``per`` points each (shuffled) and their true labels."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(centres, dim))
    truth = rng.permutation(np.repeat(np.arange(centres), per))
    return means[truth] + spread * rng.normal(size=(truth.size, dim)), truth


@pytest.mark.parametrize("seed,k", [(0, 2), (1, 5), (2, 16), (3, 31)])
def test_silhouette_equals_sklearn(seed: int, k: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 129))
    labels = np.concatenate([np.arange(k), rng.integers(0, k, 32 - k)])  # k = 31: singletons score 0
    assert silhouette(pairwise_distances(x), labels) == pytest.approx(silhouette_score(x, labels), abs=1e-12)


def test_batched_silhouettes_equal_sklearn() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(24, 17))
    x[7] = x[3]  # a duplicate point: a = b = 0 for it scores 0, as in scikit-learn
    labelings = np.stack([np.arange(24) % k for k in (2, 3, 7, 12, 23)])
    got = silhouettes(pairwise_distances(x), torch.as_tensor(labelings))
    want = [silhouette_score(x, lab) for lab in labelings]
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6)


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


@pytest.mark.parametrize("seed,centres", [(0, 2), (1, 3), (2, 5), (3, 8)])
def test_kmeans_finds_sklearns_clusters_on_separated_data(seed: int, centres: int) -> None:
    x, truth = blobs(seed, centres, per=4)
    labels, inertia = kmeans(x, [centres], n_init=4, seed=seed)
    ref = KMeans(n_clusters=centres, n_init=4, random_state=seed).fit(x)
    assert same_partition(labels[0].numpy(), ref.labels_) and same_partition(labels[0].numpy(), truth)
    assert float(inertia[0]) == pytest.approx(ref.inertia_, rel=1e-9)


def test_kmeans_batched_over_k_reaches_sklearns_fit_for_every_k() -> None:
    """One batch over k = 2..6 (4 restarts each) on 4 separated blobs: every k's inertia is that of
    its own labels (centres = cluster means) and equals scikit-learn's best of 10 restarts where the
    optimum is clear (k <= 4: the blobs and their unions)."""
    x, _ = blobs(6, 4, per=5)
    ks = [2, 3, 4, 5, 6]
    labels, inertia = kmeans(x, ks, n_init=4, seed=0)
    for i, k in enumerate(ks):
        lab = labels[i].numpy()
        assert len(np.unique(lab)) == k
        own = sum(((x[lab == c] - x[lab == c].mean(0)) ** 2).sum() for c in np.unique(lab))
        assert float(inertia[i]) == pytest.approx(own, rel=1e-9)
        if k <= 4:
            ref = KMeans(n_clusters=k, n_init=10, random_state=0).fit(x)
            assert float(inertia[i]) == pytest.approx(ref.inertia_, rel=1e-9) and same_partition(lab, ref.labels_)


def test_kmeans_is_deterministic_and_validates_k() -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(30, 9))
    a, ia = kmeans(x, range(2, 12), seed=3)
    b, ib = kmeans(x, range(2, 12), seed=3)
    assert torch.equal(a, b) and torch.equal(ia, ib)
    assert bool((ia[1:] <= ia[:-1] + 1e-9).all())  # more clusters never fit worse here
    with pytest.raises(ValueError, match="1 <= k <= 30"):
        kmeans(x, [31])


def test_cluster_proposals_choose_the_same_k_as_sklearn_on_separated_data() -> None:
    """STACFP's selection: the k of best silhouette over 2..16 with scikit-learn's KMeans in place of
    the torch k-means gives the same k, clusters and medoids on well-separated clips."""
    for seed, centres in [(10, 3), (11, 6), (12, 9)]:
        x, truth = blobs(seed, centres, per=3)
        props = cluster_proposals(x, (2, 16))
        dist = pairwise_distances(x)
        ref = max(((silhouette(dist, KMeans(n_clusters=k, n_init=4, random_state=0).fit_predict(x)), -k)
                   for k in range(2, min(16, len(x) - 1) + 1)))
        assert props.k == -ref[1] == centres and same_partition(props.labels, truth)
        assert props.silhouette == pytest.approx(ref[0], abs=1e-9)
