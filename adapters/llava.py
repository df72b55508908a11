"""LLaVA-1.5 (``LlavaForConditionalGeneration``: CLIP vision tower + Llama / Vicuna)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.adapters.hf_vlm import HFVLMAdapter
from vlm_prune.adapters.vision_towers import FeatureLayerTap


class LlavaAdapter(HFVLMAdapter):
    """576 visual tokens per 336px image on a 24 x 24 grid (CLS dropped by the 'default' strategy).

    One tower row per image, so vision methods that need the tower's attention (VisionZip) get
    it from a tap on the feature layer.
    """

    family = "llava"
    model_classes = ("LlavaForConditionalGeneration",)
    tap: FeatureLayerTap | None = None

    def attach(self) -> None:
        super().attach()
        cfg = self.model.config
        if "vision" in self.state.methods and isinstance(cfg.vision_feature_layer, int):
            self.tap = FeatureLayerTap(
                self.inner.vision_tower, cfg.vision_feature_layer, cfg.vision_feature_select_strategy == "default"
            )

    def detach(self) -> None:
        if self.tap is not None:
            self.tap.remove()
            self.tap = None
        super().detach()

    def tower_attention_fn(self, out: Any, modality: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None:
        return self.tap.attention if self.tap is not None else None
