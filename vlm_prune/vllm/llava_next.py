"""LLaVA-NeXT served by vLLM with a vision-stage method of vlm_prune (out-of-tree model class).

The LLaVA-1.5 pattern (vlm_prune/vllm/llava.py, docs/design/vllm-plugin.md) on LLaVA-NeXT's anyres images, as
``wrap()`` runs them (adapters/llava_next.py):

- An image is its base tile's tokens, then the unpadded grid of its high-resolution tiles with one
  ``image_newline`` token ending every row. The newlines are not visual tokens: they are always kept,
  never seen by a method, never counted. The budget is the README's: ``method.n_keep(V)`` of the
  image's V visual tokens (base + unpadded tiles) reach the language model. Slots per image: that
  count plus the image's newlines, both known from the image size in the processor.
- ``random``, ``pool``, ``divprune`` see the image's visual tokens as one sequence (no grid);
  ``cdpruner`` and ``hired`` select per crop (``reduce_crops``: the base image, then each tile) with
  the crop of every packed token, found by packing a crop-id map with vLLM's own
  ``_merge_image_patch_embeddings`` (so the tile order and the unpadding are the model's). HiRED reads
  each tower row's [CLS] attention in its early layer and in the feature layer, recomputed on the side
  from the layers' inputs (forward pre-hooks), as wrap()'s taps do.
- Kept rows keep their original positions, or are renumbered where the method's official code feeds
  the shorter sequence (DivPrune, CDPruner, HiRED by default), as in wrap(); offsets travel in three
  extra embedding channels (llava.OffsetChannels), the text after an image continues from its unpruned
  length.

Refused per request (config.validate_spec): the methods wrap() refuses on LLaVA-NeXT (visionzip,
fastervlm, vispruner, prumerge) and HiRED without keep / budget, whose official count is known only
after the tower ran (each tile's floored share, then cut by the unpadding).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.llava import LlavaDummyInputsBuilder, _get_num_hidden_layers
from vllm.model_executor.models.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextMultiModalProcessor,
    LlavaNextProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import ImageProcessorItems

from vlm_prune.methods.base import Method, VisionContext
from vlm_prune.methods.hired import TileAttention
from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    FirstPositionRow,
    OffsetChannels,
    item_inputs,
    pack_kept,
    PrunedLlavaMultiModalProcessor,
    check_cls_method,
    dry_run_slots,
    layer_attention,
    method_of,
    plain_rotary,
    spec_from,
    spec_of,
    tag_items,
)
from vlm_prune.vllm.onevision import FULL_KEY, VlmPruneLlavaOnevisionForConditionalGeneration, _item, _scatter


def tile_map(config: Any, image_size: torch.Tensor, tiles: int, per_tile: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(crop [N], local [N]) of an image's packed tokens (its ``tiles`` tower rows of ``per_tile`` patches, the
    (height, width) ``image_size``): the tower row within the image (0: the base image) and the patch within
    that row of each token, -1 for the newlines; packed by vLLM's own ``_merge_image_patch_embeddings`` (wrap()
    packs the same map with the HF model's ``pack_image_features``)."""
    crop = torch.arange(1, tiles + 1, device=device, dtype=torch.float32)
    patch = torch.arange(1, per_tile + 1, device=device, dtype=torch.float32)
    layout = torch.stack([crop[:, None].expand(-1, per_tile), patch[None].expand(tiles, -1)], -1)
    stand_in = SimpleNamespace(config=config, image_newline=torch.zeros(2, device=device))
    packed = LlavaNextForConditionalGeneration._merge_image_patch_embeddings(
        stand_in, image_size, layout, strategy="spatial_unpad")
    return packed[:, 0].round().long() - 1, packed[:, 1].round().long() - 1


class PrunedLlavaNextProcessingInfo(LlavaNextProcessingInfo):
    """Each image gets the count of placeholder slots ``wrap()`` keeps for it: the method's count of its
    visual tokens plus its newline tokens."""

    def method(self, mm_kwargs: Mapping[str, object] | None = None) -> Method:
        return method_of(spec_of(self.get_hf_config(), mm_kwargs))

    def image_newlines(self, *, image_width: int, image_height: int) -> int:
        """The image's ``image_newline`` rows (one per row of its unpadded tiles)."""
        enc = self.get_vision_encoder_info()
        rows, cols = get_anyres_image_grid_shape((image_height, image_width), self.get_hf_config().image_grid_pinpoints,
                                                 enc.get_image_size())
        _, newlines = self._get_num_unpadded_features(original_height=image_height, original_width=image_width,
                                                      npatches=enc.get_patch_grid_length(), num_patch_height=rows,
                                                      num_patch_width=cols)
        return newlines

    def unpruned_image_tokens(self, *, image_width: int, image_height: int) -> int:
        return super().get_num_image_tokens(image_width=image_width, image_height=image_height)

    def get_num_image_tokens(self, *, image_width: int, image_height: int,
                             mm_kwargs: Mapping[str, object] | None = None) -> int:
        n = self.unpruned_image_tokens(image_width=image_width, image_height=image_height)
        method = self.method(mm_kwargs)
        check_cls_method(method, self.get_hf_config())
        if method.name == "hired":
            built = _get_num_hidden_layers(self.get_hf_config())
            if method.early_layer >= built:
                raise ValueError(f"hired early_layer={method.early_layer}: vLLM builds the tower's first {built} layers "
                                 "(up to the feature layer); choose an early layer below it")
        newlines = self.image_newlines(image_width=image_width, image_height=image_height)
        crops = None
        if getattr(method, "per_crop", False):  # CDPruner, HiRED select per crop: the image's own tile map
            enc = self.get_vision_encoder_info()
            rows, cols = get_anyres_image_grid_shape((image_height, image_width),
                                                     self.get_hf_config().image_grid_pinpoints, enc.get_image_size())
            crops = tile_map(self.get_hf_config(), torch.tensor([image_height, image_width]), 1 + rows * cols,
                             enc.get_patch_grid_length() ** 2, torch.device("cpu"))
        return dry_run_slots(self, mm_kwargs, n - newlines, None, crops) + newlines


class PrunedLlavaNextMultiModalProcessor(LlavaNextMultiModalProcessor):
    """LLaVA-NeXT's processor with pruned slot counts, each image's question ids, rank, spec and unpruned
    length attached (llava.py's processor does the same for LLaVA-1.5)."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix
    _get_prompt_updates = PrunedLlavaMultiModalProcessor._get_prompt_updates

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, {k: v for k, v in hf_kwargs.items() if k != "vlm_prune"})

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)

        def full(modality: str, rank: int) -> dict[str, int]:
            size = inputs.mm_data_items.get_items("image", ImageProcessorItems).get_image_size(rank)
            return {FULL_KEY: self.info.unpruned_image_tokens(image_width=size.width, image_height=size.height)}

        return tag_items(super().apply(inputs, timing_ctx), spec, method_of(spec), self._template_suffix(), full)


@MULTIMODAL_REGISTRY.register_processor(PrunedLlavaNextMultiModalProcessor, info=PrunedLlavaNextProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class VlmPruneLlavaNextForConditionalGeneration(OffsetChannels, FirstPositionRow, LlavaNextForConditionalGeneration, SupportsMRoPE):
    """vLLM's LLaVA-NeXT with a vlm_prune vision-stage method (random, pool, divprune, cdpruner, hired with
    keep / budget)."""

    #: OneVision's: the CLIP tower in every naming, ``image_newline``, the language model
    hf_to_vllm_mapper = VlmPruneLlavaOnevisionForConditionalGeneration.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        text = self.config.text_config  # vLLM's own rotary embeddings on one position row (FirstPositionRow)
        plain_rotary(self.language_model.model.layers, lambda i: text.rope_parameters)
        layers = self.vision_tower.vision_model.encoder.layers
        #: tower layers whose inputs the current encoder call keeps (HiRED's early and feature layers)
        self._wanted: set[int] = set()
        self._inputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(partial(self._keep_input, i))

    def _keep_input(self, index: int, module: torch.nn.Module, args: tuple) -> None:
        if index in self._wanted:
            self._inputs[index] = args[0].detach()

    # ---- encoder ------------------------------------------------------------------------------
    def embed_multimodal(self, **kwargs: object) -> Any:
        extras = {k: kwargs.pop(k, None) for k in (QUERY_KEY, RANK_KEY, SPEC_KEY, FULL_KEY)}
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        if image_input["type"] != "pixel_values":
            raise ValueError("vlm_prune.vllm prunes images given as pixels; image_embeds inputs are not supported")
        count = len(image_input["pixel_values"])
        items = [{k: _item(v, b) for k, v in extras.items()} for b in range(count)]
        methods = [method_of(spec_from(item[SPEC_KEY], spec_of(self.config))) for item in items]
        feature_layer = len(self.vision_tower.vision_model.encoder.layers) - 1
        self._wanted = {i for m in methods if m.name == "hired" for i in (feature_layer, m.early_layer)}
        self._inputs = {}
        try:
            patch_embeddings = self._process_image_pixels(image_input)
        finally:
            self._wanted = set()
        image_sizes = image_input.get("image_sizes")
        if image_sizes is None:
            raise ValueError("vlm_prune.vllm needs each LLaVA-NeXT image's size (image_sizes) to find its tiles")
        out, first_row = [], 0
        for b, tiles in enumerate(patch_embeddings):
            packed = self._merge_image_patch_embeddings(image_sizes[b], tiles, strategy="spatial_unpad")
            crop, local = tile_map(self.config, image_sizes[b], tiles.shape[0], tiles.shape[1], packed.device)
            rows = range(first_row, first_row + tiles.shape[0])
            out.append(self._reduce(methods[b], packed, crop, local, rows, items[b]))
            first_row += tiles.shape[0]
        self._inputs = {}
        return out

    def _reduce(self, method: Method, feats: torch.Tensor, crop: torch.Tensor, local: torch.Tensor, rows: range,
                item: dict[str, Any]) -> torch.Tensor:
        """One image's kept rows (in order) with their offsets from their slots in three extra channels."""
        _, _, gen, rank, text = item_inputs(self, item, feats.device)
        newline = crop < 0
        visual = torch.nonzero(~newline).squeeze(1)
        with torch.no_grad():
            if getattr(method, "per_crop", False):  # CDPruner, HiRED: one selection per crop, as wrap()
                tiles = None
                if method.name == "hired":
                    tiles = partial(self._tile_attention, method, rows, crop, local)
                ctx = VisionContext(features=feats, n_keep=method.n_keep(visual.numel(), 1), text_embeds=text,
                                    generator=gen, image_index=rank, tower_tiles=tiles)
                red = method.reduce_crops(ctx, crop)
                keep, new = _scatter(feats, torch.arange(feats.shape[0], device=feats.device), red, always=newline)
            else:
                ctx = VisionContext(features=feats[visual], n_keep=method.n_keep(visual.numel(), 1), grid=None,
                                    text_embeds=text, generator=gen, image_index=rank)
                keep, new = _scatter(feats, visual, method.reduce_image(ctx), always=newline)
        return pack_kept(keep, new, method)

    def _tile_attention(self, method: Method, rows: range, crop: torch.Tensor, local: torch.Tensor) -> TileAttention:
        """HiRED's view of one image: each tower row's [CLS] attention in the early and the feature layer."""
        layers = self.vision_tower.vision_model.encoder.layers
        feature_layer = len(layers) - 1

        def attention(index: int) -> torch.Tensor:
            inputs = self._inputs[index][rows.start:rows.stop]
            return torch.stack([layer_attention(layers[index], row, True)[0] for row in inputs])

        return TileAttention(early=attention(method.early_layer), late=attention(feature_layer), crop=crop, local=local)

    # ---- positions: kept tokens at their original positions (OneVision's: FULL_KEY per item) ---------
    get_mrope_input_positions = VlmPruneLlavaOnevisionForConditionalGeneration.get_mrope_input_positions

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(weights)
