"""Gemma 3 served by vLLM with a vision-stage method of vlm_prune (out-of-tree model class).

The LLaVA-1.5 pattern (vlm_prune/vllm/llava.py, docs/design/vllm-plugin.md: slots, the method in the encoder, kept
tokens at their original positions through offset channels) on vLLM's own
``Gemma3ForConditionalGeneration`` (read in vLLM 0.32's ``model_executor/models/gemma3_mm.py`` and
``gemma3.py``), with Gemma 3's quirks met as ``wrap()`` meets them (``adapters/gemma3.py``):

- **The image's markup.** vLLM replaces ``<start_of_image>`` in the prompt by
  ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens (the tower's patch grid average-pooled
  to 16 x 16 = 256 on the released checkpoints) + ``<end_of_image>\\n\\n``. The plugin writes the
  method's ``n_keep(256)`` soft tokens there; the markup stays (text, as in ``wrap()``).
- **Two rotary tables.** Gemma 3's sliding-window layers and its global layers (linear RoPE scaling on
  the 4B-27B checkpoints) rotate by different tables, so the plugin cannot use an M-RoPE section for
  its three identical position rows as on LLaVA (vLLM's linear-scaled rotary ignores sections): the
  ``mrope_section`` in the config only makes vLLM's runner ask ``get_mrope_input_positions`` for each
  prompt's positions; each layer keeps the rotary embedding vLLM's own Gemma 3 builds, and the
  language model gets the first row (the three are equal).
- **Bidirectional attention among an image's tokens** (vLLM's ``is_mm_prefix_lm``: the attention
  backend lets the embedding rows of one image see each other both ways). The kept tokens fill one
  contiguous run of slots, which is the range vLLM opens, so on a backend that implements it the kept
  tokens see each other both ways, as ``wrap()``'s blocks follow the kept rows. vLLM 0.32's CPU
  attention backend ignores these ranges (its builder never reads ``mm_req_doc_ranges``): vLLM's own
  Gemma 3 attends causally there, and so does the plugin, which then equals ``wrap()`` on the model fed
  without ``token_type_ids`` (causal, as transformers runs it then).
- **Sliding window.** vLLM's sliding-window layers see the last ``sliding_window`` cached tokens (the
  kept ones), as ``wrap()``'s do (``LMSpec.window``: the window counts the rows a layer holds).
- **Pan and scan** (``do_pan_and_scan``: extra crops, each its own 256 tokens in the same vLLM item,
  "Here is the original image ... and here are some crops ...") is refused: ``wrap()`` counts each crop
  as an image of its own, which one vLLM item cannot rank.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma3_mm import (
    Gemma3DummyInputsBuilder,
    Gemma3ForConditionalGeneration,
    Gemma3MultiModalProcessor,
    Gemma3ProcessingInfo,
)
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.multimodal.processing import PromptUpdateDetails

from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    FirstPositionRow,
    OffsetChannels,
    PrunedLlavaMultiModalProcessor,
    VlmPruneLlavaForConditionalGeneration,
    _embeds_end,
    method_of,
    plain_rotary,
    reduce_item,
    spec_from,
    spec_of,
    square_grid,
    tag_items,
)
from vlm_prune.vllm.qwen2_vl import _check, _item, _PrunedInfo, _without_spec

PAN_AND_SCAN_REFUSAL = (
    "vlm_prune.vllm serves Gemma 3 without pan and scan: its crops are extra images in one vLLM item, which wrap() "
    "counts as images of their own; send the request with do_pan_and_scan false (the processor's default)"
)


class PrunedGemma3ProcessingInfo(_PrunedInfo, Gemma3ProcessingInfo):
    """Each image gets the method's kept count of soft-token slots inside its markup."""

    def get_num_crops(self, *, image_width: int, image_height: int, processor: Any,
                      mm_kwargs: Mapping[str, object]) -> int:
        crops = super().get_num_crops(image_width=image_width, image_height=image_height, processor=processor,
                                      mm_kwargs=_without_spec(mm_kwargs))
        if crops:
            raise ValueError(PAN_AND_SCAN_REFUSAL)
        return crops

    def get_image_repl(self, *, image_width: int, image_height: int, processor: Any,
                       mm_kwargs: Mapping[str, object]) -> PromptUpdateDetails:
        full = super().get_image_repl(image_width=image_width, image_height=image_height, processor=processor,
                                      mm_kwargs=mm_kwargs)
        token = self.get_hf_config().image_token_index
        ids = list(full.full)
        first, n = ids.index(token), ids.count(token)
        k = self.slots(mm_kwargs, n, square_grid(n))  # the encoder's grid
        return PromptUpdateDetails.select_token_id(ids[:first] + [token] * k + ids[first + n:], token)

    def get_num_image_tokens(self, *, image_width: int, image_height: int, processor: Any,
                             mm_kwargs: Mapping[str, object]) -> int:
        n = super().get_num_image_tokens(image_width=image_width, image_height=image_height, processor=processor,
                                         mm_kwargs=mm_kwargs)
        return self.slots(mm_kwargs, n, square_grid(n))


class PrunedGemma3MultiModalProcessor(Gemma3MultiModalProcessor):
    """Gemma 3's processor, plus each image's question ids, rank within its prompt and spec (as LLaVA's)."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, _without_spec(hf_kwargs))

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = self.info.method(inputs.hf_processor_mm_kwargs)
        return tag_items(super().apply(inputs, timing_ctx), spec, method, self._template_suffix())


@MULTIMODAL_REGISTRY.register_processor(
    PrunedGemma3MultiModalProcessor, info=PrunedGemma3ProcessingInfo, dummy_inputs=Gemma3DummyInputsBuilder
)
class VlmPruneGemma3ForConditionalGeneration(OffsetChannels, FirstPositionRow, Gemma3ForConditionalGeneration,
                                             SupportsMRoPE):
    """vLLM's Gemma 3 with a vlm_prune vision-stage method (random, pool, divprune, cdpruner)."""

    #: the SigLIP tower in the hub's naming (vision_tower.vision_model.*) and transformers 5's (without it), as LLaVA's
    hf_to_vllm_mapper = VlmPruneLlavaForConditionalGeneration.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if getattr(vllm_config.compilation_config, "cudagraph_mm_encoder", False):
            raise ValueError("vlm_prune.vllm runs the method after the vision tower, which vLLM's encoder CUDA graphs "
                             "skip: turn off compilation_config.cudagraph_mm_encoder")
        _check(method_of(spec_of(self.config)), self.config.architectures[0])
        text = self.config.text_config  # the rotary embeddings of vLLM's own Gemma 3, one table per layer type
        plain_rotary(self.language_model.model.layers, lambda i: text.rope_parameters[text.layer_types[i]])
        self.n_image = self.config.mm_tokens_per_image
        side = int(round(self.n_image ** 0.5))
        self.grid = (side, side) if side * side == self.n_image else None

    # ---- encoder: the method picks what fills the slots -------------------------------------
    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        self._query = kwargs.pop(QUERY_KEY, None)
        self._rank = kwargs.pop(RANK_KEY, None)
        self._spec = kwargs.pop(SPEC_KEY, None)
        return super()._parse_and_validate_image_input(**kwargs)

    def _process_image_input(self, image_input: Any) -> list[torch.Tensor]:
        num_patches = image_input["num_patches"].tolist()
        if any(int(p) != 1 for p in num_patches):
            raise ValueError(PAN_AND_SCAN_REFUSAL)
        projected = self.multi_modal_projector(self.vision_tower(image_input["pixel_values"]))
        out = []
        for b in range(projected.shape[0]):
            spec = spec_from(_item(self._spec, b), spec_of(self.config))
            method = _check(method_of(spec), self.config.architectures[0])
            query, rank = _item(self._query, b), _item(self._rank, b)
            text = None
            if query is not None:
                text = self.language_model.model.embed_input_ids(query.reshape(-1).to(projected.device).long())
            out.append(reduce_item(method, projected[b], self.grid, text, spec, rank, b))
        return out

    # ---- positions: kept tokens at their original positions ---------------------------------
    _renumbers = VlmPruneLlavaForConditionalGeneration._renumbers

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """Positions of the unpruned prompt: each image's markup and its k slots contiguous (slot i at
        the first soft token's position + i; forward() moves each kept token to its own), the text after
        the image from the unpruned image's end on, decode steps from the unpruned length. Methods that
        renumber (``positions="renumber"``, DivPrune's and CDPruner's default on 1-D positions, as in
        ``wrap()``) keep vLLM's contiguous positions."""
        pos = torch.arange(len(input_tokens), dtype=torch.long)
        shift = 0
        for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
            r = f.mm_position
            if self._renumbers(f):
                continue
            dropped = self.n_image - (r.get_num_embeds() if r.is_embed is not None else r.length)
            pos[r.offset + _embeds_end(r):] += dropped  # from <end_of_image> on
            shift += dropped
        return pos[None].expand(3, -1).clone(), shift
