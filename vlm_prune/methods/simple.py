"""The two blind baselines every comparison needs: random subset and spatial pooling."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, VisionContext, VisionMethod
from vlm_prune.registry import register


@register
class Random(VisionMethod):
    """Keep a uniformly random subset of each image's visual tokens (seeded).

    Defaults: the seed given to ``wrap(..., seed=0)``; the same seed gives the same subsets.
    Strong at mild budgets; it belongs in every table.
    """

    name = "random"
    paper = "baseline: uniform random subset"

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        perm = torch.randperm(n, generator=ctx.generator)[: ctx.n_keep]
        return Reduction(torch.sort(perm).values.to(ctx.features.device))


def pooled_grid(rows: int, cols: int, n_keep: int) -> tuple[int, int]:
    """The largest (r, c) grid with r * c <= n_keep that keeps the aspect ratio of rows x cols."""
    scale = math.sqrt(n_keep / (rows * cols))
    r = max(1, min(rows, math.floor(rows * scale + 1e-9)))
    c = max(1, min(cols, n_keep // r))
    return r, c


@register
class Pool(VisionMethod):
    """Spatial average pooling of each image's token grid down to the budget.

    The grid (rows x cols) is adaptively average-pooled to the largest grid with at most
    ``n_keep`` cells and the same aspect ratio; each pooled token takes the slot (and
    position id) of the original token at its cell's centre. Images whose tokens do not form
    one rectangular grid (LLaVA-NeXT anyres with newline tokens) are pooled 1-D along the
    token sequence. Defaults: none beyond keep / budget.
    """

    name = "pool"
    paper = "baseline: spatial average pooling"

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        feats = ctx.features
        n, d = feats.shape
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, feats.device)
        if ctx.grid is None or ctx.grid[0] * ctx.grid[1] != n:
            pooled = F.adaptive_avg_pool1d(feats.t().unsqueeze(0).float(), ctx.n_keep)[0].t()
            idx = _cell_centres_1d(n, ctx.n_keep, feats.device)
            return Reduction(idx, pooled.to(feats.dtype))
        rows, cols = ctx.grid
        r, c = pooled_grid(rows, cols, ctx.n_keep)
        grid = feats.t().reshape(1, d, rows, cols).float()
        pooled = F.adaptive_avg_pool2d(grid, (r, c))[0].reshape(d, r * c).t()
        ri = _cell_centres_1d(rows, r, feats.device)
        ci = _cell_centres_1d(cols, c, feats.device)
        idx = (ri[:, None] * cols + ci[None, :]).reshape(-1)
        return Reduction(idx, pooled.to(feats.dtype))


def _cell_centres_1d(n: int, cells: int, device: torch.device) -> torch.Tensor:
    """Index of the middle element of each of adaptive pooling's ``cells`` windows over n."""
    i = torch.arange(cells, device=device)
    start = (i * n) // cells
    end = ((i + 1) * n + cells - 1) // cells
    return (start + end - 1) // 2
