"""Mistral 3 (Pixtral tower) served by vLLM with a vision-stage method of vlm_prune.

The LLaVA-1.5 pattern (vlm_prune/vllm/llava.py, docs/design/vllm-plugin.md) on vLLM's own
``Mistral3ForConditionalGeneration`` (read in vLLM 0.32's ``model_executor/models/mistral3.py``), with
Mistral 3's quirk met as ``wrap()`` meets it (``adapters/mistral3.py``):

- **Rows of tokens with break tokens.** Pixtral encodes an image at its own resolution: an image of
  rows x cols merged patches is written ``([IMG] * cols + [IMG_BREAK]) * rows`` with the last break
  ``[IMG_END]``. ``wrap()`` budgets the rows x cols visual tokens only (the method sees that grid), keeps
  every break (text) and the kept tokens between them in their original order and positions, so how
  many tokens each row keeps depends on the image's features, while vLLM fixes the prompt before the
  tower runs. The plugin therefore writes ``k + rows - 1`` embedding slots and ``[IMG_END]``
  (k = the method's ``n_keep(rows x cols)``): the encoder fills the slots with the kept tokens and the
  ``[IMG_BREAK]`` tokens' own input embeddings, interleaved in their original order, each at its
  original position (offset channels, as on LLaVA). The language model computes what ``wrap()``'s does;
  the prompt's token ids show ``[IMG]`` at the slots that carry a break. An image that keeps all its
  tokens keeps vLLM's own layout (its breaks as text).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.mistral3 import (
    Mistral3DummyInputsBuilder,
    Mistral3ForConditionalGeneration,
    Mistral3MultiModalProcessor,
    Mistral3ProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails

from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    FirstPositionRow,
    OffsetChannels,
    PrunedLlavaMultiModalProcessor,
    VlmPruneLlavaForConditionalGeneration,
    _embeds_end,
    encode_offsets,
    method_of,
    plain_rotary,
    reduced,
    spec_from,
    spec_of,
    tag_items,
)
from vlm_prune.vllm.qwen2_vl import _check, _item, _PrunedInfo, _without_spec

#: each image's unpruned run of tokens (rows x (cols + 1)) and the id of [IMG_BREAK], from the processor
FULL_KEY = "vlm_prune_full"
BREAK_KEY = "vlm_prune_break"


def slot_layout(ids: list[int], image: int, k: int) -> list[int]:
    """An image's unpruned ``ids`` (rows of ``image`` tokens, each row ended by a break, the last by
    [IMG_END]) cut to ``k`` kept tokens: ``k + rows - 1`` slots of ``image`` (kept tokens and the breaks
    between rows, in the order the encoder decides) and the final [IMG_END]; ``ids`` themselves where
    nothing is dropped (vLLM's own layout)."""
    if k == ids.count(image):
        return ids
    rows = len(ids) - ids.count(image)
    return [image] * (k + rows - 1) + ids[-1:]


class PrunedMistral3ProcessingInfo(_PrunedInfo, Mistral3ProcessingInfo):
    """Each image gets the method's kept count of slots plus one per break between its rows."""

    def get_vision_encoder_info(self, mm_processor_kwargs: Mapping[str, object] | None = None) -> Any:
        return super().get_vision_encoder_info(_without_spec(mm_processor_kwargs or {}))


class PrunedMistral3MultiModalProcessor(Mistral3MultiModalProcessor):
    """Mistral 3's processor with the pruned slots, plus each image's question ids, rank, spec, unpruned
    length and break id (encoder kwargs; the question and rank part of its cache key where read)."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, _without_spec(hf_kwargs))

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        image = self.info.get_hf_config().image_token_index
        updates = super()._get_prompt_updates(mm_items, _without_spec(hf_processor_mm_kwargs), out_mm_kwargs)

        def pruned(item_idx: int, full: Any) -> PromptUpdateDetails:
            ids = list(full(item_idx).full)
            n = ids.count(image)
            rows = len(ids) - n  # one break per row, the last one [IMG_END]
            k = self.info.slots(hf_processor_mm_kwargs, n, (rows, n // rows))
            return PromptUpdateDetails.select_token_id(slot_layout(ids, image, k), image)

        return [PromptReplacement(modality=u.modality, target=u.target, replacement=partial(pruned, full=u.replacement))
                for u in updates]

    def _unpruned(self, mm_items: Any, rank: int) -> int:
        size = mm_items.get_items("image", ImageProcessorItems).get_image_size(rank)
        cols, rows = self.info.get_vision_encoder_info().get_patch_grid_size(image_width=size.width,
                                                                             image_height=size.height)
        return rows * (cols + 1)

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = self.info.method(inputs.hf_processor_mm_kwargs)
        processor = self.info.get_hf_processor()
        brk = self.info.get_tokenizer().get_vocab()[processor.image_break_token]
        full = partial(self._unpruned, inputs.mm_data_items)
        return tag_items(super().apply(inputs, timing_ctx), spec, method, self._template_suffix(),
                         lambda modality, rank: {FULL_KEY: full(rank), BREAK_KEY: brk})


@MULTIMODAL_REGISTRY.register_processor(
    PrunedMistral3MultiModalProcessor, info=PrunedMistral3ProcessingInfo, dummy_inputs=Mistral3DummyInputsBuilder
)
class VlmPruneMistral3ForConditionalGeneration(OffsetChannels, FirstPositionRow, Mistral3ForConditionalGeneration,
                                               SupportsMRoPE):
    """vLLM's Mistral 3 with a vlm_prune vision-stage method (random, pool, divprune, cdpruner)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _check(method_of(spec_of(self.config)), self.config.architectures[0])
        self.step = self.config.vision_config.patch_size * self.config.spatial_merge_size
        text = self.config.text_config  # vLLM's own rotary embeddings on one position row (as Gemma 3)
        plain_rotary(self.language_model.model.layers, lambda i: text.rope_parameters)

    # ---- encoder: the method picks what fills the slots, the breaks take theirs -------------
    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        self._query, self._rank = kwargs.pop(QUERY_KEY, None), kwargs.pop(RANK_KEY, None)
        self._spec, self._break = kwargs.pop(SPEC_KEY, None), kwargs.pop(BREAK_KEY, None)
        kwargs.pop(FULL_KEY, None)
        return super()._parse_and_validate_image_input(**kwargs)

    def _process_image_input(self, image_input: Any) -> list[torch.Tensor]:
        if image_input["type"] != "pixel_values_pixtral":
            raise ValueError("vlm_prune.vllm prunes images given as pixels; image_embeds inputs are not supported")
        sizes = [(img.shape[-2], img.shape[-1]) for img in image_input["pixel_values"]]
        out = []
        embeds = super()._process_image_input(image_input)
        if isinstance(embeds, torch.Tensor):  # one image, or images of one size stacked
            embeds = [embeds] if embeds.dim() == 2 else list(embeds)
        for b, (feats, (h, w)) in enumerate(zip(embeds, sizes)):
            rows, cols = math.ceil(h / self.step), math.ceil(w / self.step)
            if rows * cols != feats.shape[0]:
                raise RuntimeError(f"vlm_prune: {feats.shape[0]} tokens for an image of {rows} x {cols} merged patches")
            spec = spec_from(_item(self._spec, b), spec_of(self.config))
            method = _check(method_of(spec), self.config.architectures[0])
            query = _item(self._query, b)
            text = None
            if query is not None:
                text = self.language_model.embed_input_ids(query.reshape(-1).to(feats.device).long())
            idx, kept = reduced(method, feats, (rows, cols), text, spec, _item(self._rank, b), b)
            if idx.numel() == rows * cols:  # nothing dropped: vLLM's own layout, the breaks are text
                out.append(torch.cat([kept, encode_offsets(torch.zeros_like(idx), kept.dtype)], dim=1))
                continue
            brk = int(_item(self._break, b).reshape(-1)[0])
            breaks = self.language_model.embed_input_ids(torch.full((rows - 1,), brk, device=feats.device))
            # each row's tokens then its break, in the unpruned run's order (row r: r * (cols + 1) + col)
            order = torch.cat([idx // cols * (cols + 1) + idx % cols,
                               torch.arange(rows - 1, device=idx.device) * (cols + 1) + cols])
            order, perm = torch.sort(order)
            rows_out = torch.cat([kept, breaks.to(kept.dtype)])[perm]
            offsets = order - torch.arange(order.numel(), device=order.device)
            if getattr(method, "renumber_positions", False):  # the official code's shorter sequence (wrap() too)
                offsets = torch.zeros_like(offsets)
            out.append(torch.cat([rows_out, encode_offsets(offsets, rows_out.dtype)], dim=1))
        return out

    # ---- positions: kept tokens and breaks at their original positions ----------------------
    _renumbers = VlmPruneLlavaForConditionalGeneration._renumbers

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """Positions of the unpruned prompt: an image's slots contiguous from its first position (forward()
        moves each kept token and break to its own), its [IMG_END] and the text after it from the unpruned
        run's end on, decode steps from the unpruned length; methods that renumber keep vLLM's positions."""
        pos = torch.arange(len(input_tokens), dtype=torch.long)
        shift = 0
        for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if self._renumbers(f):
                continue
            r = f.mm_position
            dropped = int(f.data[FULL_KEY].data.reshape(-1)[0]) - r.length
            pos[r.offset + _embeds_end(r):] += dropped  # from [IMG_END] on
            shift += dropped
        return pos[None].expand(3, -1).clone(), shift
