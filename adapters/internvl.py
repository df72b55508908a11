"""InternVL (``InternVLForConditionalGeneration``: InternViT tower + Qwen2 / Llama).

Quirks (transformers 5.25 ``models/internvl``): an image is cut into tiles (448 px each, plus a
thumbnail), every tile goes through the tower as its own row, and a pixel shuffle
(``downsample_ratio`` 0.5) folds 2 x 2 patches into one token: 256 tokens per tile on a 16 x 16
grid. ``get_image_features`` returns one ``pooler_output`` entry per TILE; the processor writes
an image as ``<img>`` + 256 x tiles ``<IMG_CONTEXT>`` + ``</img>``, so an image is one
contiguous run of placeholders. vlm_prune treats the run as the image (``keep`` / ``budget``
are per image, as for every family): a one-tile image keeps its 16 x 16 grid, a multi-tile
image is one item without a rectangular grid (grid-aware methods pool 1-D, as on LLaVA-NeXT),
and the reduced features are cut back into the model's per-tile layout.

The InternViT layers are not CLIP layers, and VisionZip taps CLIP / SigLIP towers only, so the
ViT-stage methods and VisionZip are refused at wrap time.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from vlm_prune.adapters.generic import FamilyTable, TableAdapter
from vlm_prune.adapters.hf_vlm import Item


class InternVLAdapter(TableAdapter):
    table = FamilyTable(family="internvl", model_classes=("InternVLForConditionalGeneration",))

    def _runs(self, modality: str) -> list[int]:
        """Lengths of the contiguous placeholder runs of the request, sample by sample."""
        mask = self.request.masks[modality]
        out = []
        for row in mask:
            idx = torch.nonzero(row).squeeze(1)
            if idx.numel():
                cuts = torch.nonzero(idx[1:] != idx[:-1] + 1).squeeze(1) + 1
                bounds = [0, *cuts.tolist(), idx.numel()]
                out += [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        return out

    def item_lengths(self, modality: str, out: Any) -> list[int]:
        per_tile = out.pooler_output.shape[1]
        runs = self._runs(modality)
        if sum(runs) != out.pooler_output.shape[0] * per_tile or any(r % per_tile for r in runs):
            raise ValueError(
                f"InternVL: the prompt's {len(runs)} placeholder runs ({runs} tokens) do not split into the "
                f"encoder's {out.pooler_output.shape[0]} tiles of {per_tile} tokens; write each image as one run "
                "of <IMG_CONTEXT> tokens (the processor does)"
            )
        return runs

    def items(self, modality: str, out: Any) -> list[Item]:
        tiles = out.pooler_output
        flat = tiles.reshape(-1, tiles.shape[-1])
        side = int(round(tiles.shape[1] ** 0.5))
        grid = (side, side) if side * side == tiles.shape[1] else None
        lengths = self.item_lengths(modality, out)
        return [Item(f, 1, grid if n == tiles.shape[1] else None) for f, n in zip(flat.split(lengths), lengths)]

    def rebuild(self, modality: str, out: Any, feats: list[torch.Tensor]) -> Any:
        out = copy.copy(out)
        out.pooler_output = torch.cat(feats).reshape(out.pooler_output.shape)
        return out
