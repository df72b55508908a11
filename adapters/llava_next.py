"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): anyres tiles, image_newline, unpadding.

Each image's tokens (base tile, then the unpadded high-resolution grid with a newline token
ending every row) are one item without a rectangular grid: grid-aware methods (pool) fall
back to 1-D pooling along the sequence.

The image_newline tokens are not visual tokens (``newline_not_visual``): vision-stage methods
see an image's other tokens only and the newlines are always kept, in-LLM methods never prune
or merge them, and the stats do not count them. Vision-stage methods that select per crop
(``per_crop``: CDPruner, as its official code) get each image's tokens with the crop of every
token (the base image, then each high-resolution tile; -1 for the newlines), found by packing a
crop-id map with the model's own ``pack_image_features``.

ViT-stage methods (AS-ViT, ToMe) run inside the CLIP tower (vlm_prune.adapters.clip_tower)
with every tile of every image as one tower row, all rows keeping the same number of tokens.
Before the model packs the tiles, each tile's survivors are scattered back to its full grid
(dropped positions hold zeros); the model's own ``pack_image_features`` then packs the
features, and the same function packs a keep mask and merge sizes (newline tokens: always
kept, size 1), so every image's kept placeholders and sizes reach the engine as a
vision-stage reduction at their original positions. ``keep`` / ``budget`` stay per image there:
an image's target (of its visual tokens after unpadding) is split over its tiles, each tile
keeping ceil(target / tiles) (:meth:`LlavaNextAdapter.tile_share`); all tower rows keep one
count, so an image can end up to tiles - 1 tokens over its target, and under it where the
unpadding crops survivors - wrap() says so once (:meth:`LlavaNextAdapter.vit_budget_note`).
"""
from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.base import PerThread
from vlm_prune.adapters.clip_tower import CLIPTowerAdapter
from vlm_prune.adapters.hf_vlm import Item, source_of
from vlm_prune.adapters.vision_towers import FeatureLayerTap
from vlm_prune.methods.base import Reduction, VisionContext
from vlm_prune.methods.hired import TileAttention


class LlavaNextAdapter(CLIPTowerAdapter):
    family = "llava_next"
    stages = FAMILY_STAGES[family]
    model_classes = ("LlavaNextForConditionalGeneration",)

    #: the image_newline rows are not visual tokens (never counted, pruned or merged)
    newline_not_visual = True
    #: per image of the encoder output being reduced (this thread): [N] crop of each token, -1 for newlines
    _crops = PerThread()

    def items(self, modality: str, out: Any) -> list[Item]:
        return [Item(f, 1, None) for f in out.pooler_output]

    def tiles_per_image(self, image_sizes: Any) -> list[int]:
        """Tower rows (base image + anyres tiles) of each image, as the model counts them."""
        cfg = self.model.config
        module = importlib.import_module(type(self.inner).__module__)
        return [module.image_size_to_num_patches(s, cfg.image_grid_pinpoints, cfg.vision_config.image_size)
                for s in image_sizes]

    def crop_ids(self, image_sizes: Any, n_per_tile: int, device: torch.device) -> list[torch.Tensor]:
        """[N] per image: the crop (tower row within the image) of each packed token, -1 for the
        image_newline tokens; packed by the model's own ``pack_image_features``."""
        return [crop for crop, _ in self.tile_map(image_sizes, n_per_tile, device)]

    def tile_map(self, image_sizes: Any, n_per_tile: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(crop [N], local [N]) per image: the tower row within the image and the token within
        that row of each packed token, -1 for the image_newline tokens; packed by the model's own
        ``pack_image_features`` (so the unpadding and the tile order are the model's)."""
        tiles = self.tiles_per_image(image_sizes)
        crop = torch.cat([torch.arange(1, t + 1, device=device, dtype=torch.float32) for t in tiles])
        local = torch.arange(1, n_per_tile + 1, device=device, dtype=torch.float32)
        layout = torch.stack([crop[:, None].expand(-1, n_per_tile), local[None].expand(crop.numel(), -1)], -1)
        packed, _ = self.patches.original(self.inner, "pack_image_features")(
            layout.split(tiles), image_sizes, self.model.config.vision_feature_select_strategy,
            image_newline=torch.zeros(2, device=device),
        )
        return [(p[:, 0].round().long() - 1, p[:, 1].round().long() - 1) for p in packed]

    # ---- per-tile [CLS] attention (HiRED) ---------------------------------------------------------
    #: tap on the early tower layer a method asks for (``early_layer``), beside the feature-layer tap
    early_tap: FeatureLayerTap | None = None

    def make_tap(self) -> FeatureLayerTap | None:
        """Taps on the feature layer and the method's early layer, for vision methods that read the
        tower's attention per anyres tile (HiRED); None for the others."""
        method = self.state.methods.get("vision")
        if not getattr(method, "needs_tower_attention", False) or not getattr(method, "per_crop", False):
            return None
        tower, cfg = self.inner.vision_tower, self.model.config
        self.early_tap = FeatureLayerTap(tower, method.early_layer + 1, True)  # hidden_states[l + 1]: layer l's output
        self.patches.track(self.early_tap.handle)
        return FeatureLayerTap(tower, cfg.vision_feature_layer, True)

    def detach(self) -> None:
        if self.early_tap is not None:
            self.early_tap.remove()
            self.early_tap = None
        super().detach()

    def annotate_output(self, modality: str, out: Any) -> None:
        super().annotate_output(modality, out)
        if self.early_tap is not None:
            out.vlm_prune_early_input = self.early_tap.input

    def tile_attention(self, index: int) -> TileAttention:
        """The tower's per-tile [CLS] attention of item ``index`` of the encoder output being reduced
        (early and feature layer, recomputed on the side from the tapped layer inputs)."""
        out = self.request.out
        image_sizes = out.vlm_prune_call["image_sizes"]
        j = source_of(out, index)
        tiles = self.tiles_per_image(image_sizes)
        rows = slice(sum(tiles[:j]), sum(tiles[: j + 1]))
        late = torch.stack([self.tap.attention_of(r)[0] for r in out.vlm_prune_tower_input[rows]])
        early = torch.stack([self.early_tap.attention_of(r)[0] for r in out.vlm_prune_early_input[rows]])
        crop, local = self.tile_map(image_sizes, late.shape[1], late.device)[j]
        return TileAttention(early=early, late=late, crop=crop, local=local)

    # ---- ViT-stage methods: one image budget over its tiles -------------------------------------
    def feature_tokens_per_tile(self) -> int:
        vcfg = self.model.config.vision_config
        return (vcfg.image_size // vcfg.patch_size) ** 2 + (self.model.config.vision_feature_select_strategy == "full")

    def tile_share(self, method: Any, image_sizes: Any) -> tuple[int | None, list[int] | None]:
        """(patch tokens each tower row keeps, each image's target) for a ViT-stage method with
        keep / budget: the target is the method's count of the image's visual tokens (after the
        model's unpadding, newlines excluded), split over its tiles (base image included) as
        ceil(target / tiles); the largest share when images have different tile counts, since
        every tower row keeps the same number. (None, None) without keep / budget."""
        if image_sizes is None or (method.keep is None and method.budget is None):
            return None, None
        tiles = self.tiles_per_image(image_sizes)
        crops = self.crop_ids(image_sizes, self.feature_tokens_per_tile(), torch.device("cpu"))
        targets = [method.n_keep(int((c >= 0).sum()), 1) for c in crops]
        share = max(math.ceil(t / n) for t, n in zip(targets, tiles))
        cls = 0 if self.model.config.vision_feature_select_strategy == "default" else 1  # 'full': CLS is a visual token
        return max(1, share - cls), targets

    def before_features(self, modality: str, call: dict[str, Any]) -> None:
        if self.tower_stage is not None:
            self.tower_stage.row_target = self.tile_share(self.tower_stage.method, call.get("image_sizes"))[0]

    def vit_budget_note(self, method: Any) -> str | None:
        """wrap()'s note for a ViT-stage method with keep / budget: how the per-image target is met."""
        if (method.keep is None and method.budget is None) or method.keep == 1.0:
            return None
        return (
            f"{method.name} on LLaVA-NeXT prunes inside the vision tower, where every anyres tile (the base "
            "image included) keeps the same number of tokens: an image's target is split over its tiles, "
            "ceil(target / tiles) each, so an image keeps up to tiles - 1 tokens over its target, and fewer "
            "where the model's unpadding crops padded rows of the tile grid; each call's vit stage record "
            "gives the targets and the counts reached"
        )

    def reduce_features(self, modality: str, out: Any) -> Any:
        if self.tower_stage is not None:
            return self.reduce_tower_output(modality, out)
        if "vision" not in self.state.methods:
            return super().reduce_features(modality, out)
        self._crops = self.crop_ids(out.vlm_prune_call["image_sizes"], self.feature_tokens_per_tile(),
                                    out.pooler_output[0].device)
        try:
            return super().reduce_features(modality, out)
        finally:
            self._crops = None

    def not_visual_rows(self, it: Item, index: int) -> torch.Tensor | None:
        """The image's newline tokens, from its crop map (-1)."""
        return (self._crops[source_of(self.request.out, index)] < 0).to(it.features.device)

    def reduce_frames(self, method: Any, it: Item, sample: int, gen: torch.Generator, index: int) -> Reduction:
        """Vision methods see an image's visual tokens only; its newline tokens are always kept.
        Methods that select per crop (``per_crop``) get the crop of every token."""
        if getattr(method, "per_crop", False):
            crops = self._crops[source_of(self.request.out, index)].to(it.features.device)
            tiles = (lambda: self.tile_attention(index)) if self.tap is not None and self.early_tap is not None else None
            ctx = VisionContext(
                features=it.features, n_keep=method.n_keep(int((crops >= 0).sum()), 1),
                text_embeds=self.text_embeds(sample).detach(), generator=gen, image_index=index, tower_tiles=tiles,
            )
            return method.reduce_crops(ctx, crops)
        return super().reduce_frames(method, it, sample, gen, index)

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

    def reduce_tower_output(self, modality: str, out: Any) -> Any:
        """Hand a pruned tower's survivors (ViT-stage methods) to the engine, packed per image."""
        stage = self.tower_stage
        run = stage.run_of(out)
        feats = out.pooler_output
        image_sizes = out.vlm_prune_call["image_sizes"]
        cfg = self.model.config
        tiles = self.tiles_per_image(image_sizes)
        rows = out.last_hidden_state.shape[0]
        if sum(tiles) != rows:
            raise ValueError(f"the tower encoded {rows} tiles but the model's {len(tiles)} images have {sum(tiles)}")
        device = feats[0].device
        slots, sizes = stage.survivors(run, rows, device)
        # channel 0: kept, 1: merge size, 2: visual; dropped positions: (0, 1, 1), newline tokens: (1, 1, 0)
        layout = torch.zeros(rows, stage.n_features(run), 3, device=device)
        layout[..., 1:] = 1.0
        values = torch.stack([torch.ones_like(slots, dtype=torch.float32),
                              sizes.float() if sizes is not None else torch.ones_like(slots, dtype=torch.float32)], -1)
        layout[..., :2].scatter_(1, slots[..., None].expand(-1, -1, 2), values)
        packed, _ = self.patches.original(self.inner, "pack_image_features")(
            layout.split(tiles), image_sizes, cfg.vision_feature_select_strategy,
            image_newline=torch.tensor([1.0, 1.0, 0.0], device=device),
        )
        src = [source_of(out, i) for i in range(len(feats))]  # the encoded image of each (repeated) one
        keep_list = [packed[j][:, 0] > 0.5 for j in src]
        size_list = [packed[j][:, 1] for j in src]
        visual = [packed[j][:, 2] > 0.5 for j in src]
        self._commit_vision(modality, keep_list, size_list)
        record = stage.record(run, [int(v.sum()) for v in visual], [int((k & v).sum()) for k, v in zip(keep_list, visual)])
        targets = self.tile_share(stage.method, image_sizes)[1]
        if targets is not None:
            record["targets"] = [targets[j] for j in src]
        self.request.pending.records.append(record)
        return out
