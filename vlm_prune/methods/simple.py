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


def pool_cells(rows: int, cols: int, n_keep: int) -> list[int]:
    """Cells per row band of a rows x cols grid pooled to exactly ``n_keep`` cells.

    The band count r keeps the grid's aspect ratio (r ~ rows * sqrt(n_keep / (rows * cols))), raised
    where a band could not hold its share (r >= n_keep / cols); every band gets n_keep // r cells and
    the n_keep % r left over add one cell to bands spread evenly over the height. Where n_keep is a
    product r x c this is the r x c adaptive pooling grid."""
    if not 1 <= n_keep <= rows * cols:
        raise ValueError(f"a {rows} x {cols} grid pools to 1..{rows * cols} cells, not {n_keep}")
    scale = math.sqrt(n_keep / (rows * cols))
    r = min(rows, n_keep, max(1, math.floor(rows * scale + 1e-9), -(-n_keep // cols)))
    c, extra = divmod(n_keep, r)
    return [c + ((i + 1) * extra // r - i * extra // r) for i in range(r)]


@register
class Pool(VisionMethod):
    """Spatial average pooling of each image's token grid down to the budget.

    The grid (rows x cols) is average-pooled to exactly ``n_keep`` cells: row bands in the grid's
    aspect ratio, each split into equal column cells (:func:`pool_cells`; an r x c adaptive
    pooling grid where n_keep = r * c); each pooled token takes the slot (and position id) of the
    original token at its cell's centre. Images whose tokens do not form one rectangular grid
    (LLaVA-NeXT anyres with newline tokens) are pooled 1-D along the token sequence. Defaults: none beyond keep / budget.
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
            idx = [(a + b - 1) // 2 for a, b in _windows(n, ctx.n_keep)]
            return Reduction(torch.tensor(idx, device=feats.device), pooled.to(feats.dtype))
        rows, cols = ctx.grid
        bands = pool_cells(rows, cols, ctx.n_keep)
        band_rows = _windows(rows, len(bands))
        grid = feats.t().reshape(1, d, rows, cols).float()
        if len(set(bands)) == 1:  # an r x c grid: torch's adaptive pooling
            pooled = F.adaptive_avg_pool2d(grid, (len(bands), bands[0]))[0].reshape(d, -1).t()
        else:  # each row band pooled to its own cell count
            pooled = torch.cat([F.adaptive_avg_pool2d(grid[:, :, r0:r1], (1, cells))[0].reshape(d, -1).t()
                                for (r0, r1), cells in zip(band_rows, bands)])
        idx = [((r0 + r1 - 1) // 2) * cols + (c0 + c1 - 1) // 2
               for (r0, r1), cells in zip(band_rows, bands) for c0, c1 in _windows(cols, cells)]
        return Reduction(torch.tensor(idx, device=feats.device), pooled.to(feats.dtype))


def _windows(n: int, cells: int) -> list[tuple[int, int]]:
    """Adaptive pooling's ``cells`` windows [start, end) over n elements."""
    return [((i * n) // cells, ((i + 1) * n + cells - 1) // cells) for i in range(cells)]
