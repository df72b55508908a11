"""LLaVA-1.5 (``LlavaForConditionalGeneration``: CLIP vision tower + Llama / Vicuna)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.adapters.hf_vlm import HFVLMAdapter
from vlm_prune.adapters.vision_towers import tower_feature_attention


class LlavaAdapter(HFVLMAdapter):
    """576 visual tokens per 336px image on a 24 x 24 grid (CLS dropped by the 'default' strategy)."""

    family = "llava"
    model_classes = ("LlavaForConditionalGeneration",)

    def tower_attention_fn(self, out: Any, modality: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None:
        cfg = self.model.config
        return tower_feature_attention(
            self.inner.vision_tower, out, cfg.vision_feature_layer, cfg.vision_feature_select_strategy
        )
