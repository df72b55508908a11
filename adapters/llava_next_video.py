"""LLaVA-NeXT-Video (``LlavaNextVideoForConditionalGeneration``): LLaVA-NeXT images and videos.

Images are LLaVA-NeXT's (anyres tiles, newline tokens, CLIP tower: see
vlm_prune.adapters.llava_next, whose handling this adapter inherits, ViT-stage methods
included). Videos (transformers 5.25 ``models/llava_next_video``, ``get_video_features``): every
frame goes through the same CLIP tower, the feature layer is pooled by
``spatial_pool_stride`` (2: a 24 x 24 map becomes 12 x 12) and projected; a video is T frames
of that grid, without newline tokens, under ``<video>`` placeholders. The frames stage
(uniform, KeyScore, QuoTA) sees the [T, n, D] frame maps; vision methods reduce each frame.

ViT-stage methods (ToMe, AS-ViT) prune image tiles inside the tower; the video pooler needs every
frame's full grid, so a call that brings videos to a model wrapped with one is refused with that
reason (use a vision-stage or frames method for videos).
"""
from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item, fit_grid, source_of
from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.llava_next import LlavaNextAdapter
from vlm_prune.methods.base import FramesContext


class LlavaNextVideoAdapter(LlavaNextAdapter):
    family = "llava_next_video"
    model_classes = ("LlavaNextVideoForConditionalGeneration",)
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features", "video": "get_video_features"}

    def frame_grid(self) -> tuple[int, int]:
        cfg = self.model.config
        side = (cfg.vision_config.image_size // cfg.vision_config.patch_size) // cfg.spatial_pool_stride
        return side, side

    def encoded(self, modality: str, out: Any) -> Any:
        """Videos as one [T * n, D] entry each: transformers before 5.22 splits the pooled frames
        per video as [T, n, D] (its forward flattens either form the same way)."""
        pooled = getattr(out, "pooler_output", None)
        if modality == "video" and pooled is not None and pooled[0].dim() == 3:
            out = copy.copy(out)
            out.pooler_output = tuple(v.flatten(0, 1) for v in pooled)
        return super().encoded(modality, out)

    def items(self, modality: str, out: Any) -> list[Item]:
        if modality == "image":
            return super().items(modality, out)
        rows, cols = self.frame_grid()
        return [Item(v, v.shape[0] // (rows * cols), (rows, cols)) for v in out.pooler_output]

    def before_features(self, modality: str, call: dict[str, Any]) -> None:
        method = None if self.tower_stage is None else self.tower_stage.method
        if modality == "video" and method is not None and method.keep != 1.0 and not self.bypassed:
            raise ValueError(
                f"{method.name!r} prunes inside the vision tower, which LLaVA-NeXT-Video runs on "
                "image tiles only: its video pooler needs every frame's full grid. Use a vision-stage method "
                "(e.g. 'divprune') or a frames method (e.g. frames='uniform') for videos"
            )
        super().before_features(modality, call)

    def reduce_features(self, modality: str, out: Any) -> Any:
        if modality == "video":
            return HFVLMAdapter.reduce_features(self, modality, out)
        return super().reduce_features(modality, out)

    def not_visual_rows(self, it: Item, index: int) -> Any:
        """Image newlines (from LLaVA-NeXT's crop map); video frames have none."""
        if self._crops is None:
            return None
        return super().not_visual_rows(it, index)

    def reduce_frames(self, method: Any, it: Item, sample: int, gen: Any, index: int) -> Any:
        """Video frames: each frame on its own (LLaVA-NeXT's per-crop selection is for image tiles)."""
        if self._crops is None:
            return HFVLMAdapter.reduce_frames(self, method, it, sample, gen, index)
        return super().reduce_frames(method, it, sample, gen, index)

    def frames_context(self, method: Any, it: Item, index: int, sample: int) -> FramesContext:
        ctx = super().frames_context(method, it, index, sample)
        videos = getattr(self.request.out, "vlm_prune_call", {}).get("pixel_values_videos")
        if videos is not None:
            ctx.pixels = videos[source_of(self.request.out, index)]
        if self.state.processor is not None:
            frames = ctx.features
            ctx.score_frames = lambda prompts, tokens, grid=None: self.score_frames(frames, prompts, tokens, grid)
        return ctx

    def score_frames(self, frames: torch.Tensor, prompts: list[str], tokens: list[str],
                     grid: tuple[int, int] | None = None) -> torch.Tensor:
        """QuoTA's default scorer: one-frame videos of each frame's tokens [T, n, D], bilinearly
        resized to at most ``grid`` (:meth:`score_frame_videos`)."""
        return self.score_frame_videos(fit_grid(frames, self.frame_grid(), grid), prompts, tokens)
