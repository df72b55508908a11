"""VideoLLaMA3 (``VideoLlama3ForConditionalGeneration``: SigLIP-based tower with 2-D rotary positions +
MLP projector + Qwen2), images only.

Quirks (transformers 5.25 ``models/video_llama_3``): the tower encodes each image at its own resolution
(``image_grid_thw``, patches packed into one sequence) and downsamples it by its own merge size
(``image_merge_sizes``, a bilinear ``pixel_unshuffle``), so an image is (h / m) x (w / m) tokens in
row-major order: its grid is read from the call's arguments. ``get_image_features`` returns one
``pooler_output`` entry per image and the model writes them with ``masked_scatter``: the common
layout.

Videos are refused with the reason: the processor runs the model's own token compression
(``video_compression_mask``: patches that repeat the previous frame are dropped) and the model drops
those rows from the encoder output inside ``forward``, after ``get_video_features``, so a video's
placeholders are fewer than its encoder rows and its frames are ragged runs behind timestamp text; see
docs/adding-a-model.md. The tower has no CLS token: no ViT stage, no VisionZip.
"""
from __future__ import annotations

from typing import Any

import torch

from vlm_prune.adapters.generic import FamilyTable, TableAdapter
from vlm_prune.adapters.hf_vlm import source_of


class VideoLlama3Adapter(TableAdapter):
    table = FamilyTable(
        family="videollama3", model_classes=("VideoLlama3ForConditionalGeneration",),
        feature_functions={"image": "get_image_features", "video": "get_video_features"},
        placeholders={"image": "image_token_id", "video": "video_token_id"},
        vision_tower="vision_model", projector="projector",
    )

    def before_features(self, modality: str, call: dict[str, Any]) -> None:
        if modality == "video":
            raise ValueError(
                "vlm_prune prunes VideoLLaMA3 images only: its videos go through the model's own token compression "
                "(video_compression_mask drops repeated patches inside forward, after the encoder), which leaves a "
                "video's placeholders fewer than its encoder rows. Ask about sampled frames as images, or unwrap the "
                "model for videos"
            )

    def item_grid(self, modality: str, out: Any, index: int, features: torch.Tensor) -> tuple[int, int] | None:
        call = getattr(out, "vlm_prune_call", {})
        thw, merge = call.get("image_grid_thw"), call.get("image_merge_sizes")
        if thw is None or merge is None:
            return super().item_grid(modality, out, index, features)
        i = source_of(out, index)
        m = int(merge[i])
        t, h, w = (int(v) for v in thw[i])
        return (h // m, w // m) if t * (h // m) * (w // m) == features.shape[0] and t == 1 else None
