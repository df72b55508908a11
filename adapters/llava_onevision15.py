"""LLaVA-OneVision-1.5 (``LlavaOnevision15ForConditionalGeneration``: RICE-ViT tower + Qwen3).

Quirks (transformers 5.25 ``models/llava_onevision1_5``): the tower (``model.model.visual``,
tower and projector in one) encodes every image / video at its own resolution from flattened
patches in spatial-merge order, with one CLS token per frame that it drops, and merges 2 x 2
patches: an item of grid (t, h, w) patches (``image_grid_thw`` / ``video_grid_thw``) gives t
frames of (h / 2) x (w / 2) tokens, one ``pooler_output`` entry per image / video. The language
model (Qwen3) uses 1-D positions, so kept tokens keep their original position ids as on LLaVA.
The frames stage sees a video's t frames; QuoTA's custom scorers get the frames' pixels rebuilt
from the patches.

The tower is packed (all images in one sequence, ``cu_seqlens``) and is not a CLIP tower, so
ViT-stage methods and VisionZip are refused at wrap time.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from vlm_prune.adapters.generic import FamilyTable, TableAdapter
from vlm_prune.adapters.hf_vlm import Item, fit_grid, source_of
from vlm_prune.adapters.qwen2_vl import video_pixels
from vlm_prune.methods.base import FramesContext


class LlavaOnevision15Adapter(TableAdapter):
    table = FamilyTable(
        family="llava_onevision15", model_classes=("LlavaOnevision15ForConditionalGeneration",),
        feature_functions={"image": "get_image_features", "video": "get_video_features"},
        placeholders={"image": "image_token_id", "video": "video_token_id"},
        vision_tower="visual", projector="visual",
    )

    def _grids(self, modality: str, out: Any) -> list[list[int]]:
        key = f"{modality}_grid_thw"
        grids = getattr(out, "vlm_prune_call", {}).get(key)
        if grids is None:
            raise ValueError(f"LLaVA-OneVision-1.5 {modality} features need {key} in the model inputs (the processor returns it)")
        return [grids[source_of(out, i)].tolist() for i in range(len(out.pooler_output))]

    def items(self, modality: str, out: Any) -> list[Item]:
        merge = self.model.config.vision_config.spatial_merge_size
        return [Item(f, int(t), (int(h) // merge, int(w) // merge))
                for f, (t, h, w) in zip(out.pooler_output, self._grids(modality, out))]

    def frames_context(self, method: Any, it: Item, index: int, sample: int) -> FramesContext:
        """Adds the video's frames as pixels [T, C, H, W], rebuilt from its patches."""
        ctx = super().frames_context(method, it, index, sample)
        vc = self.model.config.vision_config
        layout = SimpleNamespace(spatial_merge_size=vc.spatial_merge_size, patch_size=vc.patch_size,
                                 temporal_patch_size=1)  # Qwen2-VL's patch order without temporal patches
        ctx.pixels = video_pixels(self.request.out, index, layout)
        if self.state.processor is not None:
            frames = ctx.features
            ctx.score_frames = lambda prompts, tokens, grid=None: self.score_frames(frames, it.grid, prompts, tokens, grid)
        return ctx

    def score_frames(self, frames: torch.Tensor, grid: tuple[int, int], prompts: list[str], tokens: list[str],
                     limit: tuple[int, int] | None = None) -> torch.Tensor:
        """QuoTA's default scorer: one-frame videos of each frame's tokens [T, rows*cols, D],
        bilinearly resized to at most ``limit`` (:meth:`score_frame_videos`; 1-D positions)."""
        return self.score_frame_videos(fit_grid(frames, grid, limit), prompts, tokens)
