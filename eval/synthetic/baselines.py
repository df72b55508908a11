"""Model-free baselines a pruning method must beat on the synthetic benchmark.

The saturation heuristic (issue 16's audit): colourful things are what the questions are about, so
spend half the budget on the most saturated patches (images) or frames (clips) and the other half
at random. It reads only pixels; a method that does not beat it has learned nothing the
benchmark's rendering does not give away. Bench-only: not registered as a library method.

Saturation of a pixel is max(R, G, B) - min(R, G, B) on the processor's un-normalised pixels; a
token's (or frame's) saturation is the mean over its pixels.
"""
from __future__ import annotations

from typing import Any

import torch

from vlm_prune.frames.uniform import frames_plan, partial_frame_plan
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction, VisionContext, VisionMethod


def saturation(pixels: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """Per-pixel saturation [..., H, W] of normalised pixels [..., 3, H, W]."""
    shape = (3, 1, 1)
    rgb = pixels.float() * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)
    return rgb.amax(-3) - rgb.amin(-3)


def half_top_half_random(scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k indices: the ceil(k / 2) highest scores, then floor(k / 2) drawn at random from the rest; sorted."""
    k = max(0, min(k, scores.numel()))
    order = torch.argsort(scores.float(), descending=True, stable=True)
    top, rest = order[: k - k // 2], order[k - k // 2 :]
    pick = rest[torch.randperm(rest.numel(), generator=generator)[: k // 2]]
    return torch.sort(torch.cat([top, pick])).values


class PixelTap:
    """Keeps the pixels of the latest call of ``module`` (a forward pre-hook; give it the vision
    tower, which generate() calls with the batch's pixels before the prefill) for the image
    baseline, which sees only features. ``close()`` removes the hook."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.pixels: torch.Tensor | None = None
        self._hook = module.register_forward_pre_hook(self._grab, with_kwargs=True)

    def _grab(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        if isinstance(pixels, torch.Tensor):
            self.pixels = pixels

    def close(self) -> None:
        self._hook.remove()


class SaturationTokens(VisionMethod):
    """Images: half the budget on the most saturated patches, half random (bench baseline)."""

    name = "saturation"
    paper = "baseline: half most saturated patches, half random (issue 16)"

    def __init__(self, tap: PixelTap, mean: list[float], std: list[float], patch: int, **budget: Any) -> None:
        super().__init__(**budget)
        self.tap, self.mean, self.std, self.patch = tap, mean, std, patch

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        if self.tap.pixels is None:
            raise RuntimeError("the saturation baseline saw no pixel_values; call the model with pixel_values=")
        sat = saturation(self.tap.pixels[ctx.image_index].cpu(), self.mean, self.std)
        p = self.patch
        per_patch = sat.unfold(0, p, p).unfold(1, p, p).mean((-1, -2)).flatten()
        if per_patch.numel() != ctx.features.shape[0]:
            raise ValueError(f"{per_patch.numel()} patches of {p} px but {ctx.features.shape[0]} visual tokens")
        return Reduction(half_top_half_random(per_patch, ctx.n_keep, ctx.generator).to(ctx.features.device))


class SaturationFrames(FramesMethod):
    """Clips: half the frame budget on the most saturated frames, half random (bench baseline)."""

    name = "saturation"
    paper = "baseline: half most saturated frames, half random (issue 16)"

    def __init__(self, mean: list[float], std: list[float], seed: int = 0, **budget: Any) -> None:
        super().__init__(**budget)
        self.mean, self.std, self.seed = mean, std, seed

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        if ctx.pixels is None:
            raise RuntimeError("the saturation baseline needs the frames' pixels (FramesContext.pixels)")
        t, n, _ = ctx.features.shape
        scores = saturation(ctx.pixels.cpu(), self.mean, self.std).flatten(1).mean(1)
        device = ctx.features.device
        if ctx.n_total < n:
            return partial_frame_plan(int(scores.argmax()), t, n, ctx.n_total, device)
        gen = torch.Generator().manual_seed(self.seed)
        kept = half_top_half_random(scores, ctx.n_total // n, gen).tolist()
        plan = frames_plan(kept, t, n, device)
        plan.frame_scores = scores
        return plan
