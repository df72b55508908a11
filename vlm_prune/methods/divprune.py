"""DivPrune: keep the most diverse subset of an image's visual tokens."""
from __future__ import annotations

import torch

from vlm_prune.kernels import cosine_distance
from vlm_prune.methods.base import Reduction, VisionContext, VisionMethod
from vlm_prune.registry import register


def max_min_diverse(features: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy max-min diversity subset of the rows of ``features`` [N, D] by cosine distance.

    First the row whose nearest neighbour is farthest; then, repeatedly, the row whose distance
    to its nearest chosen row is largest. Returns [k] indices in the order chosen. (As the
    official code; chosen rows are also excluded explicitly, so duplicates cannot be re-picked.)
    """
    n = features.shape[0]
    k = max(0, min(int(k), n))
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=features.device)
    dist = cosine_distance(features, features)
    if n == 1:
        return torch.zeros(1, dtype=torch.long, device=features.device)
    nn_dist = dist + torch.diag(torch.full((n,), float("inf"), device=dist.device))
    first = int(nn_dist.min(dim=0).values.argmax())
    chosen = [first]
    min_dist = dist[first].clone()
    min_dist[first] = float("-inf")
    for _ in range(k - 1):
        j = int(min_dist.argmax())
        chosen.append(j)
        min_dist = torch.minimum(min_dist, dist[j])
        min_dist[j] = float("-inf")
    return torch.tensor(chosen, dtype=torch.long, device=features.device)


@register
class DivPrune(VisionMethod):
    """DivPrune (Alvar et al., CVPR 2025, "DivPrune: Diversity-based Visual Token Pruning for
    Large Multimodal Models"; vbdi/divprune).

    Per image, keep the ``n_keep`` tokens chosen by greedy max-min diversity
    (:func:`max_min_diverse`) on the cosine distance of the projected features, in their
    original order and slots. Defaults: none beyond keep / budget.
    """

    name = "divprune"
    paper = "DivPrune, Alvar et al., CVPR 2025 (vbdi/divprune)"

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        return Reduction(torch.sort(max_min_diverse(ctx.features, ctx.n_keep)).values)
