"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``) served
by vLLM with a vision-stage method of vlm_prune.

vLLM 0.32's classes (vllm/model_executor/models/idefics3.py, smolvlm.py: SigLIP-style tower, pixel
shuffle connector, Llama; images only) with the LLaVA-1.5 pattern of vlm_prune/vllm/llava.py
(docs/design/vllm-plugin.md). The quirk: the processor splits an image into ``rows x cols`` tiles plus a global tile
and writes each tile as its own run of ``image_seq_len`` ``<image>`` tokens behind text markers
(``<fake_token_around_image><row_r_col_c>``, ``<fake_token_around_image><global-img>``, newlines). As
in ``wrap()`` (adapters/smolvlm.py) the image is one item: ``keep`` / ``budget`` count over all of its
tiles' tokens, a one-tile image keeps its square grid, a split image has none. Which tile each kept
token comes from is only known after the encoder ran, but vLLM fixes the prompt (and the order the
language model attends in) in the processor. So a pruned image's range is written as:

- the markers before its first ``<image>`` (text, as vLLM writes them), then
- ``k + m`` slots, all filled by the encoder: the ``m`` markers between the first and the last
  ``<image>`` (their own token embeddings, the language model's ``embed_tokens``) and the ``k`` kept
  tokens, interleaved as ``wrap()`` leaves them (each kept token behind its own tile's marker), then
- the markers after its last ``<image>`` (text).

The language model thus sees exactly ``wrap()``'s rows in ``wrap()``'s order; only the token ids of
the in-between markers in the prompt read ``<image>`` (their embeddings are the markers'). Each row
keeps its original position (offsets in extra embedding channels; the language model rotates by vLLM's
own 1-D RoPE on one of the runner's three equal position rows, as on Gemma 3); DivPrune and CDPruner
renumber (their official code's shorter sequence), as wrap() does. An image the method keeps whole is
written as vLLM writes it.

vLLM's SmolVLM class builds ``SmolVLMProcessor``, which needs the ``num2words`` package.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.idefics3 import (
    Idefics3DummyInputsBuilder,
    Idefics3ForConditionalGeneration,
    Idefics3MultiModalProcessor,
    Idefics3ProcessingInfo,
)
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.smolvlm import SmolVLMForConditionalGeneration, SmolVLMProcessingInfo
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFeatureSpec, MultiModalFieldElem
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails, cached_encode

from vlm_prune.methods.base import Method
from vlm_prune.vllm.internvl import (
    FULL_KEY,
    keeps_all,
    reduce_tiles,
    renumbers,
    unpruned_positions,
    with_offsets,
)
from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    FirstPositionRow,
    OffsetChannels,
    PrunedLlavaMultiModalProcessor,
    dry_run_slots,
    encode_offsets,
    method_of,
    plain_rotary,
    spec_from,
    spec_of,
    square_grid,
    tag_items,
)
from vlm_prune.vllm.qwen2_vl import _item, _without_spec

#: the token ids between an image's first and last ``<image>`` (markers and its image tokens) as vLLM
#: writes the image unpruned; empty where the image is written unpruned
MIDDLE_KEY = "vlm_prune_middle"


def image_layout(repl_ids: list[int], image_id: int) -> tuple[list[int], list[int], list[int]]:
    """An image's token ids as (before its first ``<image>``, from there to its last ``<image>``, after)."""
    rows = [i for i, t in enumerate(repl_ids) if t == image_id]
    return repl_ids[: rows[0]], repl_ids[rows[0]: rows[-1] + 1], repl_ids[rows[-1] + 1:]


class PrunedIdefics3Info:
    """Mixin of the processing infos: the request's method."""

    def method(self, mm_kwargs: Mapping[str, object] | None = None) -> Method:
        return method_of(spec_of(self.get_hf_config(), mm_kwargs))


class PrunedIdefics3ProcessingInfo(PrunedIdefics3Info, Idefics3ProcessingInfo):
    pass


class PrunedSmolVLMProcessingInfo(PrunedIdefics3Info, SmolVLMProcessingInfo):
    pass


class PrunedIdefics3MultiModalProcessor(Idefics3MultiModalProcessor):
    """Idefics3's (and SmolVLM's) processor; a pruned image gets its kept slots plus its in-between
    markers (module docstring), each item its question ids, rank, spec, unpruned length and the
    in-between token ids for the encoder."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, _without_spec(hf_kwargs))

    def _postprocess_hf_mm_data(self, mm_data: Mapping[str, object], hf_processor_mm_kwargs: Mapping[str, object],
                                processed_data: Any) -> Any:
        return super()._postprocess_hf_mm_data(mm_data, _without_spec(hf_processor_mm_kwargs), processed_data)

    def _layout(self, mm_items: Any, item_idx: int, mm_kwargs: Mapping[str, object]) -> tuple[list[int], ...]:
        """(before, middle, after) of image ``item_idx`` as vLLM writes it unpruned."""
        hf_processor = self.info.get_hf_processor(**_without_spec(mm_kwargs))
        size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item_idx)
        text = self.info.get_image_repl(image_width=size.width, image_height=size.height, processor=hf_processor,
                                        mm_kwargs=_without_spec(mm_kwargs))
        return image_layout(cached_encode(self.info.get_tokenizer(), text, add_special_tokens=False),
                            hf_processor.image_token_id)

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        method = self.info.method(hf_processor_mm_kwargs)
        hf_processor = self.info.get_hf_processor(**_without_spec(hf_processor_mm_kwargs))
        image_id = hf_processor.image_token_id

        def image(item_idx: int) -> PromptUpdateDetails:
            before, middle, after = self._layout(mm_items, item_idx, hf_processor_mm_kwargs)
            n = middle.count(image_id)
            if keeps_all(method, n):
                return PromptUpdateDetails.select_token_id(before + middle + after, image_id)
            grid = square_grid(n) if n == hf_processor.image_seq_len else None  # a grid for one tile (reduce_tiles)
            slots = dry_run_slots(self.info, hf_processor_mm_kwargs, n, grid) + len(middle) - n
            ids = before + [image_id] * slots + after
            first, end = len(before), len(before) + slots
            return PromptUpdateDetails(full=ids, is_embed=lambda full: _span(len(full), first, end))

        return [PromptReplacement(modality="image", target=[image_id], replacement=image)]

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = method_of(spec)
        image_id = self.info.get_hf_config().image_token_id
        middles, fulls = [], []  # per image: its in-between ids (none: written unpruned), its unpruned embeddings
        items = inputs.mm_data_items.get_items("image", ImageProcessorItems) if "image" in inputs.mm_data_items else []
        for i in range(len(items)):
            _, middle, _ = self._layout(inputs.mm_data_items, i, inputs.hf_processor_mm_kwargs)
            whole = keeps_all(method, middle.count(image_id))
            middles.append([] if whole else middle)
            fulls.append(middle.count(image_id) if whole else len(middle))
        out = tag_items(super().apply(inputs, timing_ctx), spec, method, self._template_suffix(),
                        lambda modality, rank: {FULL_KEY: fulls[rank]})
        for rank, item in enumerate(out["mm_kwargs"].get("image", [])):
            if item is not None:
                item[MIDDLE_KEY] = MultiModalFieldElem(data=torch.tensor(middles[rank], dtype=torch.long),
                                                       field=MultiModalBatchedField())
        return out


def _span(n: int, first: int, end: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[first:end] = True
    return mask


class PrunedIdefics3Model(OffsetChannels):
    """The encoder and positions of the plugin's Idefics3 / SmolVLM classes (put before vLLM's class)."""

    def _plugin_init(self) -> None:
        self.tile_tokens = self.model.image_seq_len
        text = self.config.text_config  # vLLM's own rotary embeddings on one position row (as Gemma 3)
        plain_rotary(self.model.text_model.layers, lambda i: text.rope_parameters)

    def embed_multimodal(self, **kwargs: object) -> Any:
        extras = {k: kwargs.pop(k, None) for k in (QUERY_KEY, RANK_KEY, SPEC_KEY, FULL_KEY, MIDDLE_KEY)}
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        if image_input["type"] != "pixel_values":
            raise ValueError("vlm_prune.vllm prunes images given as pixels; image_embeds inputs are not supported")
        return [self._reduce(feats, {k: _item(v, b) for k, v in extras.items()})
                for b, feats in enumerate(self._process_image_input(image_input))]

    def _reduce(self, feats: torch.Tensor, item: dict[str, Any]) -> torch.Tensor:
        """One image's rows: its tokens (nothing pruned), or its in-between markers and kept tokens in
        wrap()'s order, each with its offset from its slot in three extra channels."""
        spec = spec_from(item[SPEC_KEY], spec_of(self.config))
        method = method_of(spec)
        n = feats.shape[0]
        middle = item[MIDDLE_KEY]
        if middle is None or middle.numel() == 0:
            return torch.cat([feats, encode_offsets(torch.zeros(n, dtype=torch.long), feats.dtype)], dim=1)
        middle = middle.reshape(-1).to(feats.device)
        embed = self.model.text_model.embed_tokens
        idx, kept = reduce_tiles(method, spec, feats, item, self.tile_tokens, embed)
        with torch.no_grad():
            is_image = middle == self.config.image_token_id
            image_rows = torch.nonzero(is_image).squeeze(1)
            marker_rows = torch.nonzero(~is_image).squeeze(1)
            rows = torch.cat([image_rows[idx], marker_rows])
            values = torch.cat([kept, embed(middle[marker_rows]).to(kept.dtype)])
            order = torch.argsort(rows)
            rows, values = rows[order], values[order]
        return with_offsets(method, rows, values)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """Positions of the unpruned sequence (three identical rows): a pruned image's slots start where
        its in-between span started (forward() moves each row to its own), the markers after it and the
        text continue from the unpruned length; renumbering methods keep vLLM's contiguous positions."""
        return unpruned_positions(len(input_tokens), mm_features, lambda f: renumbers(f, self.config))


@MULTIMODAL_REGISTRY.register_processor(PrunedIdefics3MultiModalProcessor, info=PrunedIdefics3ProcessingInfo,
                                        dummy_inputs=Idefics3DummyInputsBuilder)
class VlmPruneIdefics3ForConditionalGeneration(PrunedIdefics3Model, FirstPositionRow, Idefics3ForConditionalGeneration,
                                               SupportsMRoPE):
    """vLLM's Idefics3 with a vlm_prune vision-stage method (random, pool, divprune, cdpruner)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._plugin_init()


@MULTIMODAL_REGISTRY.register_processor(PrunedIdefics3MultiModalProcessor, info=PrunedSmolVLMProcessingInfo,
                                        dummy_inputs=Idefics3DummyInputsBuilder)
class VlmPruneSmolVLMForConditionalGeneration(PrunedIdefics3Model, FirstPositionRow, SmolVLMForConditionalGeneration,
                                              SupportsMRoPE):
    """vLLM's SmolVLM with a vlm_prune vision-stage method (random, pool, divprune, cdpruner)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._plugin_init()
