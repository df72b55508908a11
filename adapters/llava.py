"""LLaVA-1.5 (``LlavaForConditionalGeneration``: CLIP vision tower + Llama / Vicuna)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.adapters.clip_tower import CLIPTowerStage
from vlm_prune.adapters.hf_vlm import HFVLMAdapter, scatter_reduction
from vlm_prune.adapters.vision_towers import FeatureLayerTap


class LlavaAdapter(HFVLMAdapter):
    """576 visual tokens per 336px image on a 24 x 24 grid (CLS dropped by the 'default' strategy).

    One tower row per image, so vision methods that need the tower's attention (VisionZip) get
    it from a tap on the feature layer, and ViT-stage methods (AS-ViT, ToMe) run inside the
    CLIP tower (see vlm_prune.adapters.clip_tower); their survivors reach the LLM as a
    vision-stage reduction at their original slots.
    """

    family = "llava"
    model_classes = ("LlavaForConditionalGeneration",)
    stages = ("vision", "vit", "llm")
    tower_stage: CLIPTowerStage | None = None

    def __init__(self, model: torch.nn.Module, state: Any) -> None:
        super().__init__(model, state)
        if "vit" in state.methods:
            cfg = model.config
            self.tower_stage = CLIPTowerStage(
                model.model.vision_tower, state.methods["vit"], cfg.vision_feature_layer,
                cfg.vision_feature_select_strategy, self.patches, active=lambda: not self.decoder.bypass,
            )
            #: tower layers the ViT-stage method spans (up to the feature layer)
            self.depth = self.tower_stage.depth

    def attach(self) -> None:
        super().attach()
        if self.tower_stage is not None:
            self.tower_stage.attach()
            self._patch_features("image", "get_image_features")

    def make_tap(self) -> FeatureLayerTap:
        cfg = self.model.config
        return FeatureLayerTap(
            self.inner.vision_tower, cfg.vision_feature_layer, cfg.vision_feature_select_strategy == "default"
        )

    def tower_attention_fn(self, out: Any, modality: str) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None:
        rows = getattr(out, "vlm_prune_tower_input", None)
        if self.tap is None or rows is None:
            return None
        return lambda item, frame: self.tap.attention_of(rows[item])

    def reduce_features(self, modality: str, out: Any) -> Any:
        if self.tower_stage is None:
            return super().reduce_features(modality, out)
        reds, record = self.tower_stage.reductions(out)
        feats, keep_list, size_list = [], [], []
        for red, n in zip(reds, record["tokens_in"]):
            f, keep, sizes = scatter_reduction(red.features.new_zeros(n, red.features.shape[-1]), red)
            feats.append(f)
            keep_list.append(keep)
            size_list.append(sizes)
        self._commit_vision(modality, keep_list, size_list)
        self.decoder.pending.records.append(record)
        return self.rebuild(modality, out, feats)
