"""The fast selection paths choose exactly as the code they replaced (``former_selections``):
DBDPC / PACT's cutoff bisection sharing density, distances and the first round across cutoffs."""
from __future__ import annotations

import former_selections as former
import pytest
import torch

from vlm_prune.methods import dbdpc as dbdpc_module
from vlm_prune.methods.dbdpc import DensityPeaks, dbdpc
from vlm_prune.methods.pact import cluster_to_count


def clustered(n: int, d: int, seed: int, spread: float = 0.6, duplicates: int = 0) -> torch.Tensor:
    """n points around n / 10 directions (PACT-like keys: a shared offset plus cluster structure)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n // 10 + 1, d, generator=g)
    x = torch.randn(1, d, generator=g) + centres[torch.randint(0, centres.shape[0], (n,), generator=g)]
    x = x + spread * torch.randn(n, d, generator=g)
    if duplicates:
        x[-duplicates:] = x[:duplicates]  # exact ties in distance and density
    return x


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("centres", "labels", "extra_labels"))


CASES = [(60, 16, 0, 0.6, 0), (316, 64, 1, 0.6, 0), (316, 64, 2, 2.0, 0), (500, 32, 3, 0.3, 40), (1100, 24, 4, 0.6, 0)]


@pytest.mark.parametrize("dense_max", [4096, 1], ids=["dense", "rows"])
@pytest.mark.parametrize("n,d,seed,spread,dup", CASES)
def test_cluster_to_count_equals_the_former_bisection(n, d, seed, spread, dup, dense_max, monkeypatch) -> None:
    monkeypatch.setattr(dbdpc_module, "DENSE_MAX", dense_max)
    x = clustered(n, d, seed, spread, dup)
    extra = clustered(n // 2, d, seed + 100, spread)
    importance = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    for target in (1, n // 10, n // 4, n // 2, n - 3):
        for d_c in (0.21, 0.1):
            got = cluster_to_count(x, extra, target, d_c, 1.5, importance)
            assert same(got, former.cluster_to_count(x, extra, target, d_c, 1.5, importance)), (target, d_c)


@pytest.mark.parametrize("dense_max", [4096, 1], ids=["dense", "rows"])
@pytest.mark.parametrize("n,d,seed,spread,dup", CASES)
def test_dbdpc_equals_the_former_clustering(n, d, seed, spread, dup, dense_max, monkeypatch) -> None:
    monkeypatch.setattr(dbdpc_module, "DENSE_MAX", dense_max)
    x = clustered(n, d, seed, spread, dup)
    extra = clustered(7, d, seed + 1, spread)
    for d_c in (0.0, 0.05, 0.21, 0.5, 1.0, 2.0):
        assert same(dbdpc(x, d_c, extra=extra), former.dbdpc(x, d_c, extra=extra)), d_c
        assert same(dbdpc(x, d_c), former.dbdpc(x, d_c)), d_c


def test_density_peaks_ranks_equal_the_density_kernel() -> None:
    """The dense path takes the density from its own distance blocks: the same values (so the
    same ranks) as the density kernel, across a chunk boundary."""
    from vlm_prune.kernels import density, density_rank

    x = clustered(1100, 24, 5)
    assert torch.equal(DensityPeaks(x).ranks, density_rank(density(x, 2.0)))
    assert torch.equal(DensityPeaks(x, bandwidth=0.5).ranks, density_rank(density(x, 0.5)))
