"""LLaVA-1.5 (``LlavaForConditionalGeneration``: CLIP vision tower + Llama / Vicuna)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.clip_tower import CLIPTowerAdapter
from vlm_prune.adapters.hf_vlm import scatter_reduction, source_of
from vlm_prune.adapters.vision_towers import FeatureLayerTap
from vlm_prune.methods.visionzip import TowerFeatures


class LlavaAdapter(CLIPTowerAdapter):
    """576 visual tokens per 336px image on a 24 x 24 grid (CLS dropped by the 'default' strategy).

    One tower row per image, so vision methods that need the tower's attention (VisionZip) get
    it from a tap on the feature layer, and ViT-stage methods (AS-ViT, ToMe) run inside the
    CLIP tower (see vlm_prune.adapters.clip_tower); their survivors reach the LLM as a
    vision-stage reduction at their original slots.
    """

    family = "llava"
    stages = FAMILY_STAGES[family]
    model_classes = ("LlavaForConditionalGeneration",)
    def placeholder_count(self, out: Any, item: Any) -> int:
        """An image fills the tower's feature tokens of placeholders, however many survive ToMe / AS-ViT."""
        run = getattr(out, "vlm_prune_vit", None)
        return self.tower_stage.n_features(run) if self.tower_stage is not None and run is not None else len(item)

    def make_tap(self) -> FeatureLayerTap:
        cfg = self.model.config
        return FeatureLayerTap(
            self.inner.vision_tower, cfg.vision_feature_layer, cfg.vision_feature_select_strategy == "default"
        )

    def tower_attention_fn(self, out: Any, modality: str) -> Callable[[int, int], tuple] | None:
        """(attention, keys, TowerFeatures) of an image: VisionZip's official variant merges the
        feature layer's outputs (recomputed from the tapped input) before the model's projector."""
        rows = getattr(out, "vlm_prune_tower_input", None)
        if self.tap is None or rows is None:
            return None
        drop_cls = self.model.config.vision_feature_select_strategy == "default"
        last_qk = self.last_layer_qk()

        def view(item: int, frame: int) -> tuple:
            attention, keys = self.tap.attention_of(rows[source_of(out, item)])
            feats = self.tap.output_of(rows[source_of(out, item)])
            tower = TowerFeatures(feats[1:] if drop_cls else feats, feats[0] if drop_cls else None,
                                  self.inner.multi_modal_projector, last_qk)
            return attention, keys, tower

        return view

    def last_layer_qk(self) -> Callable | None:
        """The tower's last layer's q / k projections (heads as one) of a feature-layer output row
        [T, C], when the feature layer's output is that layer's input (vision_feature_layer -2)."""
        tower = self.inner.vision_tower
        layers = getattr(tower, "vision_model", tower).encoder.layers
        if self.model.config.vision_feature_layer != -2:
            return None
        last = layers[-1]

        def qk(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                h = last.layer_norm1(x[None])
                return last.self_attn.q_proj(h)[0], last.self_attn.k_proj(h)[0]

        return qk

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
        self.request.pending.records.append(record)
        return self.rebuild(modality, out, feats)
