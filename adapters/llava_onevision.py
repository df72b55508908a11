"""LLaVA-OneVision / LLaVA-Video (``LlavaOnevisionForConditionalGeneration``): images and video.

Video: every frame's tower features are projected and bilinearly pooled to a
ceil(h/2) x ceil(w/2) grid (196 tokens at 384px); a video is T frames of that grid followed by
one newline token, which is always kept. The frames stage (QuoTA, KeyScore, uniform) sees the
[T, n, D] frame maps; vision methods reduce each frame separately. Images (anyres with newline
tokens) are items without a rectangular grid.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item


class LlavaOnevisionAdapter(HFVLMAdapter):
    family = "llava_onevision"
    model_classes = ("LlavaOnevisionForConditionalGeneration",)
    stages: ClassVar[tuple[str, ...]] = ("frames", "vision", "llm")
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features", "video": "get_video_features"}

    def frame_grid(self) -> tuple[int, int]:
        vc = self.model.config.vision_config
        side = math.ceil((vc.image_size // vc.patch_size) / 2)
        return side, side

    def items(self, modality: str, out: Any) -> list[Item]:
        if modality == "image":
            return [Item(f, 1, None) for f in out.pooler_output]
        rows, cols = self.frame_grid()
        n = rows * cols
        return [Item(v, (v.shape[0] - 1) // n, (rows, cols), tail=1) for v in out.pooler_output]
