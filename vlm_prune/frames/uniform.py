"""Uniform frame subsampling: the blind frames-stage baseline."""
from __future__ import annotations

import torch

from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register


def uniform_indices(n_items: int, k: int) -> list[int]:
    """k indices spread evenly over range(n_items) (rounded linspace from first to last); all when k >= n."""
    if k >= n_items:
        return list(range(n_items))
    if k <= 0:
        return []
    if k == 1:
        return [(n_items - 1) // 2]
    return torch.linspace(0, n_items - 1, k).round().long().tolist()


def frames_plan(kept: list[int], t: int, n: int, device: torch.device | str = "cpu") -> FramesPlan:
    """A plan that keeps whole frames ``kept`` (ascending) at native resolution."""
    slots = [torch.arange(i * n, (i + 1) * n, device=device) for i in kept]
    kept_set = set(kept)
    per_frame = [n if i in kept_set else 0 for i in range(t)]
    return FramesPlan(Reduction(torch.cat(slots)), kept_frames=list(kept), tokens_per_frame=per_frame)


def whole_video(ctx: FramesContext) -> FramesPlan | None:
    """The plan that keeps every token when the budget covers the whole video (keep=1.0 or a budget
    of at least its tokens changes nothing: the library's rule), else None."""
    t, n, _ = ctx.features.shape
    if ctx.n_total < t * n:
        return None
    return FramesPlan(Reduction.keep_all(t * n, ctx.features.device), list(range(t)), [n] * t)


def partial_frame_plan(frame: int, t: int, n: int, k: int, device: torch.device | str = "cpu") -> FramesPlan:
    """A plan that keeps k (< n) evenly spaced tokens of one frame: budgets below one frame."""
    keep = torch.tensor(uniform_indices(n, k), dtype=torch.long, device=device) + frame * n
    per_frame = [k if i == frame else 0 for i in range(t)]
    return FramesPlan(Reduction(keep), kept_frames=[frame], tokens_per_frame=per_frame)


@register
class Uniform(FramesMethod):
    """Keep evenly spaced frames at native resolution: n_frames = n_total // N.

    The frames are the rounded linspace over [0, T-1] (the middle frame when only one fits).
    When the budget is smaller than one frame's N tokens, the middle frame keeps n_total of its
    tokens, evenly spaced. Defaults: none beyond keep / budget.
    """

    name = "uniform"
    paper = "baseline: uniform frame subsampling"

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        t, n, _ = ctx.features.shape
        device = ctx.features.device
        n_frames = ctx.n_total // n
        if n_frames >= 1:
            return frames_plan(uniform_indices(t, n_frames), t, n, device)
        return partial_frame_plan((t - 1) // 2, t, n, ctx.n_total, device)
