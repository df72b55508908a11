"""The fast selection paths choose exactly as the code they replaced (``former_selections``):
DBDPC / PACT's cutoff bisection sharing density, distances and the first round across cutoffs;
DivPrune's and CDPruner's greedy loops with host indices on the CPU."""
from __future__ import annotations

import former_selections as former
import pytest
import torch

from vlm_prune.methods import dbdpc as dbdpc_module
from vlm_prune.methods import divprune
from vlm_prune.methods.cdpruner import KernelRows, conditional_kernel, dpp_greedy_map, relevance
from vlm_prune.methods.dbdpc import DensityPeaks, dbdpc
from vlm_prune.methods.divprune import max_min_diverse
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
    targets, cutoffs = ((1, n // 10, n // 4, n // 2, n - 3), (0.21, 0.1)) if n <= 1024 else ((n // 4,), (0.21,))
    for target in targets:  # past one distance block (1,024 rows) a single case: the former code is slow
        for d_c in cutoffs:
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
    from vlm_prune.kernels import cosine_distance_torch, density, density_rank

    x = clustered(1100, 24, 5)
    peaks = DensityPeaks(x)
    assert torch.equal(peaks.ranks, density_rank(density(x, 2.0)))
    # the distances are cosine_distance's blocks, and symmetric (rounds read rows for columns)
    blocks = torch.cat([cosine_distance_torch(x[r0 : r0 + 1024], x) for r0 in (0, 1024)])
    assert torch.equal(peaks.dist, blocks) and torch.equal(peaks.dist, peaks.dist.T)
    assert torch.equal(DensityPeaks(x, bandwidth=0.5).ranks, density_rank(density(x, 0.5)))


@pytest.mark.parametrize("dense_max", [4096, 1], ids=["dense", "rows"])
@pytest.mark.parametrize("n,d,seed,dup", [(2, 3, 0, 0), (97, 16, 1, 0), (576, 64, 2, 0), (300, 8, 3, 50)])
def test_divprune_host_loop_equals_the_former_device_loop(n, d, seed, dup, dense_max, monkeypatch) -> None:
    """The CPU loop with host indices picks as the former on-device loop (dense and rows on demand)."""
    monkeypatch.setattr(divprune, "DENSE_MAX", dense_max)
    monkeypatch.setattr(former, "DENSE_MAX", dense_max)
    x = clustered(n, d, seed, duplicates=dup)
    for k in sorted({1, 2, n // 4, n // 2, n}):
        assert torch.equal(max_min_diverse(x, k, chunk=64), former.max_min_diverse(x, k, chunk=64)), k


def low_rank_kernel_case(n: int, d: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g)  # residuals vanish past the rank
    return x, relevance(x, torch.randn(3, d, generator=g))


@pytest.mark.parametrize("n,d,rank,seed", [(80, 96, 96, 0), (576, 64, 64, 1), (200, 32, 5, 2), (64, 16, 16, 3)])
def test_cdpruner_host_loop_equals_the_former_device_loop(n, d, rank, seed) -> None:
    """Dense kernels and rows on demand, full rank and past the rank (the diagonal fallback)."""
    x, rel = low_rank_kernel_case(n, d, rank, seed)
    for k in sorted({1, n // 8, n // 4, rank + 3 if rank + 3 <= n else n, n}):
        dense = dpp_greedy_map(KernelRows(conditional_kernel(x, rel)), k)
        assert torch.equal(dense, former.dpp_greedy_map(former.KernelRows(conditional_kernel(x, rel)), k)), k
        factored = dpp_greedy_map(KernelRows(features=x, rel=rel), k)
        assert torch.equal(factored, former.dpp_greedy_map(former.KernelRows(features=x, rel=rel), k)), k


def test_cdpruner_host_loop_compares_eps_as_float32() -> None:
    """A residual equal to float32(eps) stops the greedy, as the device loop's float32 comparison:
    item 1's residual is exactly float32(1e-10) (> 1e-10 in double), item 2 duplicates item 0, so
    the diagonal fallback takes 2 before 1, where a double comparison would have taken 1 first."""
    eps32 = float(torch.tensor(1e-10, dtype=torch.float32))
    kernel = torch.tensor([[4.0, 0.0, 4.0], [0.0, eps32, 0.0], [4.0, 0.0, 4.0]])
    assert dpp_greedy_map(kernel, 3).tolist() == former.dpp_greedy_map(kernel, 3).tolist() == [0, 2, 1]


def test_conditional_kernel_in_place_equals_the_former_product() -> None:
    x, rel = low_rank_kernel_case(300, 48, 48, 7)
    assert torch.equal(conditional_kernel(x, rel), former.conditional_kernel(x, rel))


def test_selections_take_inputs_that_require_grad() -> None:
    """Outside the engine's no_grad (a direct call on trainable features) the fast paths select
    as the former code instead of failing on in-place / out= products."""
    x = clustered(120, 16, 9).requires_grad_()
    rel = torch.rand(120).requires_grad_()
    assert torch.equal(max_min_diverse(x, 30), former.max_min_diverse(x, 30))
    assert torch.equal(dpp_greedy_map(KernelRows(features=x, rel=rel), 30),
                       former.dpp_greedy_map(former.KernelRows(features=x, rel=rel), 30))
    assert torch.equal(dpp_greedy_map(conditional_kernel(x, rel), 30),
                       former.dpp_greedy_map(former.conditional_kernel(x, rel), 30))
    assert same(dbdpc(x, 0.3, extra=x[:9]), former.dbdpc(x, 0.3, extra=x[:9]))
