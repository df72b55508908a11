"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): anyres tiles, image_newline, unpadding.

Each image's tokens (base tile, then the unpadded high-resolution grid with a newline token
ending every row) are one item without a rectangular grid: grid-aware methods (pool) fall
back to 1-D pooling along the sequence.

ViT-stage methods (AS-ViT, ToMe) run inside the CLIP tower (vlm_prune.adapters.clip_tower)
with every tile of every image as one tower row, all rows keeping the same number of tokens.
Before the model packs the tiles, each tile's survivors are scattered back to its full grid
(dropped positions hold zeros); the model's own ``pack_image_features`` then packs the
features, and the same function packs a keep mask and merge sizes (newline tokens: always
kept, size 1), so every image's kept placeholders and sizes reach the engine as a
vision-stage reduction at their original positions.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from vlm_prune.adapters.clip_tower import CLIPTowerAdapter
from vlm_prune.adapters.hf_vlm import Item


class LlavaNextAdapter(CLIPTowerAdapter):
    family = "llava_next"
    model_classes = ("LlavaNextForConditionalGeneration",)

    def items(self, modality: str, out: Any) -> list[Item]:
        return [Item(f, 1, None) for f in out.pooler_output]

    def attach_tower_outputs(self) -> None:
        """Scatter a pruned tower's per-tile survivors back to full tiles before the model packs them."""
        original = self.patches.original(self.inner, "pack_image_features")

        @functools.wraps(original)
        def pack(image_features: Any, *args: Any, **kwargs: Any) -> Any:
            run, self.tower_stage.finished = self.tower_stage.finished, None
            if run is None:
                return original(image_features, *args, **kwargs)
            tiles = [f.shape[0] for f in image_features]
            feats = torch.cat(list(image_features))
            slots, _ = self.tower_stage.survivors(run, feats.shape[0], feats.device)
            full = feats.new_zeros(feats.shape[0], self.tower_stage.n_features(run), feats.shape[-1])
            full.scatter_(1, slots[..., None].expand(-1, -1, feats.shape[-1]), feats)
            return original(full.split(tiles), *args, **kwargs)

        self.patches.set(self.inner, "pack_image_features", pack)

    def reduce_features(self, modality: str, out: Any) -> Any:
        if self.tower_stage is None:
            return super().reduce_features(modality, out)
        stage = self.tower_stage
        run = stage.run_of(out)
        feats = out.pooler_output
        image_sizes = out.vlm_prune_call["image_sizes"]
        cfg = self.model.config
        module = importlib.import_module(type(self.inner).__module__)
        tiles = [module.image_size_to_num_patches(s, cfg.image_grid_pinpoints, cfg.vision_config.image_size)
                 for s in image_sizes]
        rows = out.last_hidden_state.shape[0]
        if len(feats) != len(tiles) or sum(tiles) != rows:
            raise ValueError(
                f"the tower encoded {rows} tiles but {len(feats)} images of {sum(tiles)} tiles reached the model; "
                f"{stage.method.name!r} does not support num_beams / num_return_sequences > 1 in generate()"
            )
        device = feats[0].device
        slots, sizes = stage.survivors(run, rows, device)
        # channel 0: kept, channel 1: merge size; dropped positions: (0, 1), newline tokens: (1, 1)
        layout = torch.zeros(rows, stage.n_features(run), 2, device=device)
        layout[..., 1] = 1.0
        values = torch.stack([torch.ones_like(slots, dtype=torch.float32),
                              sizes.float() if sizes is not None else torch.ones_like(slots, dtype=torch.float32)], -1)
        layout.scatter_(1, slots[..., None].expand(-1, -1, 2), values)
        packed, _ = self.patches.original(self.inner, "pack_image_features")(
            layout.split(tiles), image_sizes, cfg.vision_feature_select_strategy,
            image_newline=torch.ones(2, device=device),
        )
        keep_list = [p[:, 0] > 0.5 for p in packed]
        size_list = [p[:, 1] for p in packed]
        self._commit_vision(modality, keep_list, size_list)
        record = stage.record(run, [int(k.numel()) for k in keep_list], [int(k.sum()) for k in keep_list])
        self.request.pending.records.append(record)
        return out
