"""DivPrune: keep the most diverse subset of an image's visual tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.registry import register


#: up to this many tokens the whole distance matrix (<= 64 MiB float32) is one matrix product,
#: faster than rows on demand; beyond it memory stays O(chunk N)
DENSE_MAX = 4096


def max_min_diverse(features: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """Greedy max-min diversity subset of the rows of ``features`` [N, D] by cosine distance.

    First the row whose nearest neighbour is farthest; then, repeatedly, the row whose distance
    to its nearest chosen row is largest. Returns [k] indices in the order chosen. (As the
    official code; chosen rows are also excluded explicitly, so duplicates cannot be re-picked.)
    Up to :data:`DENSE_MAX` rows the distances are one N x N product; beyond, memory is O(chunk N):
    the first pick reduces ``chunk`` rows of distances at a time and each later step computes
    only the distance row of the newest pick. On accelerators no host sync inside the loop; on
    the CPU the loop keeps its indices on the host (the same picks, fewer operations per step).
    """
    n = features.shape[0]
    k = max(0, min(int(k), n))
    device = features.device
    if k == 0 or n == 1:
        return torch.zeros(k, dtype=torch.long, device=device)
    xn = F.normalize(features.detach().float(), dim=1)  # indices only: no autograd graph
    if n <= DENSE_MAX:
        # 1 - cos clamped at 0, in place; the diagonal set to inf: the nearest other row, and a
        # pick's own entry is overwritten with -inf right after it is read
        dist = (xn @ xn.T).neg_().add_(1.0).clamp_(min=0.0).fill_diagonal_(float("inf"))
        nn_dist = dist.min(dim=1).values  # symmetric: row min = column min

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
    min_dist = torch.full((n,), float("inf"), device=device)
    if device.type == "cpu":  # host indices cost nothing here: fewer, cheaper ops per step
        picks = [int(nn_dist.argmax())]
        for _ in range(1, k):
            j = picks[-1]
            torch.minimum(min_dist, dist[j] if n <= DENSE_MAX else row(torch.tensor([j])), out=min_dist)
            min_dist[j] = float("-inf")
            picks.append(int(min_dist.argmax()))
        return torch.tensor(picks, dtype=torch.long)
    chosen = torch.empty(k, dtype=torch.long, device=device)
    chosen[0] = nn_dist.argmax()
    for i in range(1, k):
        j = chosen[i - 1 : i]
        min_dist = torch.minimum(min_dist, row(j))
        min_dist.index_fill_(0, j, float("-inf"))
        chosen[i] = min_dist.argmax()
    return chosen


@register
class DivPrune(ShorterSequence, VisionMethod):
    """DivPrune (Alvar et al., CVPR 2025, "DivPrune: Diversity-based Visual Token Pruning for
    Large Multimodal Models"; vbdi/divprune at a6889f78; its ``DivPrune()`` selection function
    was read in verbatim copies other repositories carry, and tests/test_fidelity_vision.py
    re-states it).

    Per image, keep the ``n_keep`` tokens chosen by greedy max-min diversity
    (:func:`max_min_diverse`) on the cosine distance of the projected features, in their
    original order and slots. ``positions``: "renumber" (default: the official LLaVA code concatenates the
    kept tokens between the text pieces and numbers the shorter sequence 0..n-1; decode continues from
    that count) or "keep" (original position ids, gaps stay: the project's behaviour before issue 30);
    Qwen2-VL's M-RoPE positions are always kept. No other knob beyond keep / budget.
    """

    name = "divprune"
    paper = "DivPrune, Alvar et al., CVPR 2025 (vbdi/divprune)"

    def __init__(self, positions: str | None = None, keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        check_positions("DivPrune", positions)
        self.positions = positions

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        return Reduction(torch.sort(max_min_diverse(ctx.features, ctx.n_keep)).values)
