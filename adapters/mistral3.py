"""Mistral 3 (``Mistral3ForConditionalGeneration``: Pixtral vision tower + Mistral / Ministral).

Quirks (transformers 5.25 ``models/mistral3``): Pixtral encodes each image at its own
resolution, and the projector's patch merger folds 2 x 2 patches, so an image of H x W pixels
gives (H / 28) x (W / 28) tokens (``image_sizes``, patch 14, ``spatial_merge_size`` 2): the
image's grid is read from the call's ``image_sizes``. The processor ends every row of ``[IMG]``
placeholders with an ``[IMG_BREAK]`` token and the image with ``[IMG_END]``, so an image's
placeholders are not contiguous; break tokens are text (never pruned, not counted), and images
are told apart by the encoder's own per-image outputs, not by placeholder runs.

The Pixtral tower has no CLS token and no per-image tower row (images are packed into one
sequence), so ViT-stage methods and VisionZip are refused at wrap time.
"""
from __future__ import annotations

from typing import Any

import torch

from vlm_prune.adapters.generic import FamilyTable, TableAdapter
from vlm_prune.adapters.hf_vlm import source_of


class Mistral3Adapter(TableAdapter):
    table = FamilyTable(family="mistral3", model_classes=("Mistral3ForConditionalGeneration",))

    def item_grid(self, modality: str, out: Any, index: int, features: torch.Tensor) -> tuple[int, int] | None:
        sizes = getattr(out, "vlm_prune_call", {}).get("image_sizes")
        if sizes is None:
            return super().item_grid(modality, out, index, features)
        step = self.model.config.vision_config.patch_size * self.model.config.spatial_merge_size
        h, w = (int(v) // step for v in sizes[source_of(out, index)])
        return (h, w) if h * w == features.shape[0] else None
