"""DivPrune / CDPruner in linear memory and DBDPC's per-round search over the unassigned points:
the same selections as the dense formulations they replace (written out here as references)."""
from __future__ import annotations

import pytest
import torch

from vlm_prune.kernels import cosine_distance, density, density_rank, nearest_denser
from vlm_prune.methods import VisionContext, cdpruner, divprune
from vlm_prune.methods.cdpruner import CDPruner, KernelRows, conditional_kernel, dpp_greedy_map, relevance
from vlm_prune.methods.dbdpc import find_centres
from vlm_prune.methods.divprune import max_min_diverse


def dense_max_min(features: torch.Tensor, k: int) -> list[int]:
    """DivPrune's greedy on the full N x N distance matrix (the former implementation)."""
    dist = cosine_distance(features, features)
    n = dist.shape[0]
    first = int((dist + torch.diag(torch.full((n,), float("inf")))).min(dim=0).values.argmax())
    chosen, min_dist = [first], dist[first].clone()
    min_dist[first] = float("-inf")
    for _ in range(k - 1):
        j = int(min_dist.argmax())
        chosen.append(j)
        min_dist = torch.minimum(min_dist, dist[j])
        min_dist[j] = float("-inf")
    return chosen


def dense_dpp(kernel: torch.Tensor, k: int, eps: float = 1e-10) -> list[int]:
    """Greedy DPP MAP on a dense kernel with a host round trip per step (the former implementation)."""
    n = kernel.shape[0]
    cis, di2, chosen = torch.zeros(k, n), torch.diagonal(kernel).clone(), []
    for i in range(k):
        j = int(di2.argmax())
        if float(di2[j]) <= eps:
            break
        chosen.append(j)
        e = (kernel[j] - cis[:i, j] @ cis[:i]) / float(di2[j]) ** 0.5
        cis[i] = e
        di2 = di2 - e * e
        di2[j] = float("-inf")
    rest = torch.diagonal(kernel).clone()
    rest[chosen] = float("-inf")
    return chosen + torch.topk(rest, k - len(chosen)).indices.tolist()


@pytest.mark.parametrize("dense_max", [4096, 1])  # the dense product, and rows on demand
@pytest.mark.parametrize("n,d,k,chunk", [(2, 3, 2, 1024), (97, 16, 30, 1024), (300, 40, 299, 64), (513, 24, 128, 100)])
def test_divprune_linear_memory_selects_as_the_dense_greedy(n, d, k, chunk, dense_max, monkeypatch) -> None:
    monkeypatch.setattr(divprune, "DENSE_MAX", dense_max)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n))
    assert max_min_diverse(x, k, chunk=chunk).tolist() == dense_max_min(x, k)


@pytest.mark.parametrize("n,d,k", [(80, 96, 40), (200, 256, 199), (300, 512, 75)])
def test_cdpruner_kernel_rows_select_as_the_dense_kernel(n: int, d: int, k: int, monkeypatch) -> None:
    """Full-rank kernels (d >= n): the factored rows and the dense kernel pick as the former code."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, d, generator=g)
    r = relevance(x, torch.randn(4, d, generator=g))
    expected = dense_dpp(conditional_kernel(x, r), k)
    assert dpp_greedy_map(KernelRows(features=x, rel=r), k).tolist() == expected
    assert dpp_greedy_map(conditional_kernel(x, r), k).tolist() == expected
    features_ctx = VisionContext(x, k, text_embeds=None)
    for dense_max in (4096, 1):  # CDPruner itself: dense kernel for small images, rows on demand beyond
        monkeypatch.setattr(cdpruner, "DENSE_MAX", dense_max)
        ones = dense_dpp(conditional_kernel(x, torch.ones(n)), k)
        assert CDPruner().reduce_image(features_ctx).indices.tolist() == sorted(ones)


def test_cdpruner_beyond_the_kernel_rank_falls_back_to_relevance() -> None:
    """A rank-2 kernel: past its rank the residuals vanish and the rest go by the diagonal,
    exactly as the former code (dense kernel, exact zeros)."""
    kernel = torch.zeros(6, 6)
    kernel[:3, :3] = 1.0
    kernel[3:, 3:] = 4.0  # residuals become exact zeros after one pick per block
    picks = dpp_greedy_map(kernel, 5).tolist()
    assert picks == dense_dpp(kernel, 5)
    assert picks[:2] == [3, 0] and set(picks[2:4]) == {4, 5} and picks[4] in (1, 2)


def test_cdpruner_rows_need_a_kernel_or_features() -> None:
    with pytest.raises(ValueError, match="either a dense kernel or features"):
        KernelRows()


def all_points_centres(points: torch.Tensor, ranks: torch.Tensor, d_c: float, min_new: int = 10) -> list[int]:
    """DBDPC rounds searching nearest denser points over all N points, masked to the unassigned
    ones (the former implementation), then the greedy finish."""
    unassigned = torch.ones(points.shape[0], dtype=torch.bool)
    centres: list[int] = []
    while bool(unassigned.any()):
        delta, _ = nearest_denser(points, ranks, valid=unassigned)
        new = torch.nonzero(unassigned & (delta > d_c)).squeeze(1)
        centres.extend(new.tolist())
        u = torch.nonzero(unassigned).squeeze(1)
        unassigned[u[(cosine_distance(points[u], points[new]) <= d_c).any(dim=1)]] = False
        unassigned[new] = False
        if new.numel() < min_new:
            rest = torch.nonzero(unassigned).squeeze(1)
            rest = rest[torch.argsort(ranks[rest], descending=True)]
            near = cosine_distance(points[rest], points[rest]) <= d_c
            taken = torch.zeros(rest.numel(), dtype=torch.bool)
            for i, point in enumerate(rest.tolist()):
                if not bool(taken[i]):
                    centres.append(point)
                    taken |= near[i]
            break
    return centres


@pytest.mark.parametrize("seed,n,d_c", [(0, 400, 0.21), (1, 900, 0.1), (2, 900, 0.3), (3, 60, 0.05)])
def test_dbdpc_rounds_over_unassigned_points_find_the_same_centres(seed: int, n: int, d_c: float) -> None:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n // 10 + 1, 32, generator=g)
    points = torch.randn(1, 32, generator=g) + centres[torch.randint(0, centres.shape[0], (n,), generator=g)]
    points = points + 0.6 * torch.randn(n, 32, generator=g)
    ranks = density_rank(density(points, 2.0))
    found = find_centres(points, ranks, d_c).tolist()
    assert found == all_points_centres(points, ranks, d_c)
    assert len(found) > 1
