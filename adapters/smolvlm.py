"""SmolVLM and Idefics3 (``SmolVLMForConditionalGeneration``, ``Idefics3ForConditionalGeneration``:
SigLIP-style tower + pixel-shuffle connector + Llama text model).

transformers 5.25 generates ``models/smolvlm`` from ``models/idefics3`` (modular): the two models
share their layout, so one adapter serves both. Quirks:

- The processor splits an image into ``rows x cols`` tiles plus a global (downscaled) tile, each a
  square image the tower encodes on its own; the connector pixel-shuffles every tile
  (``scale_factor``: s x s patches folded into one token, row-major) to
  ``image_seq_len`` tokens on a square grid. The prompt writes a tile as
  ``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` x ``<image>``, the global tile as
  ``<fake_token_around_image><global-img>`` + ``<image>`` x ``image_seq_len`` +
  ``<fake_token_around_image>``: an image is several placeholder runs (one per tile) separated by
  text tokens, and it ends with its global tile. An image the processor does not split is its
  global tile alone.
- ``get_image_features`` returns one ``pooler_output`` entry per SAMPLE (all of its tiles, padding
  tiles of all-zero pixels removed), not per image.
- Video (SmolVLM2): the processor writes each sampled frame as one global tile behind
  ``Frame from MM:SS:`` text and hands the frames to the model as images (``pixel_values``; the
  model has no video input), so a video is a run of one-tile images that only the text tells
  apart from separate images.

vlm_prune treats an image as the tiles up to and including its global tile (``keep`` / ``budget``
are per image, as for every family): a one-tile image keeps its square grid, a split image is one
item without a rectangular grid (grid-aware methods pool 1-D, as on InternVL and LLaVA-NeXT); the
reduced features are cut back into the model's per-sample entries. The global tile is told from
the other tiles by the token in front of its run: the one in front of a sample's last run (every
image ends with its global tile), so no tokenizer is needed. A video's frames are one-tile images:
vision and in-LLM methods prune each frame with the per-image budget, and frames methods are not
offered (nothing in the model's inputs marks which images are frames).

The tower has no CLS token and VisionZip taps CLIP / SigLIP towers of LLaVA / OneVision only, so
ViT-stage methods and VisionZip are refused at wrap time.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch

from vlm_prune.adapters.generic import FamilyTable, TableAdapter
from vlm_prune.adapters.hf_vlm import Item


class SmolVLMAdapter(TableAdapter):
    table = FamilyTable(
        family="smolvlm",
        model_classes=("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"),
        language_model="text_model", vision_tower="vision_model", projector="connector",
    )

    @property
    def tile_tokens(self) -> int:
        """Tokens of one tile after the pixel shuffle (the model's ``image_seq_len``)."""
        return int(self.inner.image_seq_len)

    def _marker(self, sample: int, row: int) -> torch.Tensor | None:
        """The token in front of a tile's placeholder run (its id, or its embedding in a call with
        inputs_embeds); None at the start of the sequence."""
        if row < 0:
            return None
        req = self.request
        if req.embeds is not None:
            return req.embeds[sample, row]
        return req.input_ids[sample, row]

    def _images(self, modality: str) -> list[int]:
        """Placeholder rows of every image of the request in order: its tiles' runs up to and
        including the run behind the global-image marker."""
        mask = self.request.masks[modality]
        out = []
        for b, row in enumerate(mask):
            idx = torch.nonzero(row).squeeze(1)
            if not idx.numel():
                continue
            cuts = torch.nonzero(idx[1:] != idx[:-1] + 1).squeeze(1) + 1
            bounds = [0, *cuts.tolist(), idx.numel()]
            starts = [int(idx[a]) for a in bounds[:-1]]
            runs = [b2 - a for a, b2 in zip(bounds[:-1], bounds[1:])]
            if any(r != self.tile_tokens for r in runs):
                raise ValueError(
                    f"SmolVLM / Idefics3: sample {b} has placeholder runs of {runs} tokens; every tile is one run of "
                    f"image_seq_len={self.tile_tokens} <image> tokens behind its <row_r_col_c> / <global-img> token "
                    "(build the prompt with the model's processor)"
                )
            last = self._marker(b, starts[-1] - 1)
            n = 0
            for start, run in zip(starts, runs):
                n += run
                marker = self._marker(b, start - 1)
                if marker is None or last is None or torch.equal(marker, last):
                    out.append(n)
                    n = 0
        return out

    def item_lengths(self, modality: str, out: Any) -> list[int]:
        images = self._images(modality)
        total = sum(len(p) for p in out.pooler_output)
        if sum(images) != total:
            raise ValueError(
                f"Image features and image tokens do not match, tokens: {sum(images)}, features: {total}: the prompt's "
                f"<image> tokens must be the tiles the encoder saw (build the inputs with the model's processor)"
            )
        return images

    def items(self, modality: str, out: Any) -> list[Item]:
        flat = torch.cat(list(out.pooler_output))
        lengths = self.item_lengths(modality, out)
        side = math.isqrt(self.tile_tokens)
        grid = (side, side) if side * side == self.tile_tokens else None
        return [Item(f, 1, grid if n == self.tile_tokens else None) for f, n in zip(flat.split(lengths), lengths)]

    def rebuild(self, modality: str, out: Any, feats: list[torch.Tensor]) -> Any:
        old = out.pooler_output
        out = copy.copy(out)
        parts = torch.cat(feats).split([len(p) for p in old])
        out.pooler_output = torch.stack(parts) if isinstance(old, torch.Tensor) else type(old)(parts)
        return out
