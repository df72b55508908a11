"""Qwen2-VL and Qwen2.5-VL: M-RoPE (3-D position ids), rope_deltas, images and video.

The vision tower merges 2 x 2 patches, so an image of grid (t, h, w) patches gives
(h/2) x (w/2) tokens per temporal slice; a video's frames pair up through the temporal patch
size, so a video item has t = frames / 2 slices. Kept tokens keep their original 3-D positions
(gathered by the engine), and decode positions come from generate(), which continues them
with the model's rope_deltas, i.e. from the unpruned length.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item
from vlm_prune.engine import LMSpec, default_positions


def _rope_positions(p: torch.Tensor) -> torch.Tensor:
    return p[1:] if p.shape[0] == 4 else p


def _layer_positions(p: torch.Tensor) -> torch.Tensor | None:
    return p[0] if p.shape[0] == 4 else None


def _qwen_positions(position_ids, b, s, past, device, segs):
    return default_positions(position_ids, b, s, past, device, segs, dims=3)


class Qwen2VLAdapter(HFVLMAdapter):
    family = "qwen2_vl"
    model_classes = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    stages: ClassVar[tuple[str, ...]] = ("frames", "vision", "llm")
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features", "video": "get_video_features"}

    def lm_spec(self) -> LMSpec:
        spec = super().lm_spec()
        spec.rope_positions = _rope_positions
        spec.layer_position_ids = _layer_positions
        spec.default_positions = _qwen_positions
        return spec

    def items(self, modality: str, out: Any) -> list[Item]:
        key = "image_grid_thw" if modality == "image" else "video_grid_thw"
        grids = getattr(out, "vlm_prune_call", {}).get(key)
        if grids is None:
            raise ValueError(f"Qwen2-VL {modality} features need {key} in the model inputs (the processor returns it)")
        merge = self.model.config.vision_config.spatial_merge_size
        out_items = []
        for f, (t, h, w) in zip(out.pooler_output, grids.tolist()):
            out_items.append(Item(f, int(t), (int(h) // merge, int(w) // merge)))
        return out_items
