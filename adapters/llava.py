"""LLaVA-1.5 (``LlavaForConditionalGeneration``: CLIP vision tower + Llama / Vicuna)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.clip_tower import CLIPTowerAdapter
from vlm_prune.adapters.hf_vlm import scatter_reduction, source_of
from vlm_prune.adapters.vision_towers import FeatureLayerTap
from vlm_prune.methods.visionzip import TowerFeatures


def layer_qk(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CLIP encoder layer's query and key projections (all heads as one, [T, C] each) of its input
    row x [T, C] (PruMerge's attention)."""
    with torch.no_grad():
        h = layer.layer_norm1(x[None])
        return layer.self_attn.q_proj(h)[0], layer.self_attn.k_proj(h)[0]


def key_slots(ranks: torch.Tensor) -> torch.Tensor:
    """The slots of a protected-rank table [n] (-1: not protected), by rank (the stats' ``key_set``)."""
    slots = torch.nonzero(ranks >= 0).squeeze(1)
    return slots[torch.argsort(ranks[slots])]


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
        tower = self.inner.vision_tower
        last = getattr(tower, "vision_model", tower).encoder.layers[-1]

        def view(item: int, frame: int) -> tuple:
            row = rows[source_of(out, item)]
            attention, keys = self.tap.attention_of(row)
            feats = self.tap.output_of(row)
            # the last layer's input: the tapped row when the feature layer is the last, its output when the one before
            last_in = row if self.tap.layer is last else feats if self.tap.next_layer is last else None
            tower = TowerFeatures(feats[1:] if drop_cls else feats, feats[0] if drop_cls else None,
                                  self.inner.multi_modal_projector,
                                  None if last_in is None else (lambda x=last_in: layer_qk(last, x)))
            return attention, keys, tower

        return view

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
        protected = self.tower_stage.protected(out)
        if protected is not None:  # MustDrop's key set: rows its llm stage keeps
            self._commit_protected(modality, protected)
            record["key_set"] = [key_slots(t).tolist() for t in protected]
        if getattr(self.tower_stage.method, "renumber_positions", False):
            self.request.pending.renumber = True  # the official code feeds the LLM the shorter sequence
        self.request.pending.records.append(record)
        return self.rebuild(modality, out, feats)
