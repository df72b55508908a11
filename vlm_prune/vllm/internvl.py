"""InternVL (Hugging Face format, ``InternVLForConditionalGeneration``) served by vLLM with a vision-stage
method of vlm_prune.

vLLM 0.32 serves this checkpoint class with ``InternS1ForConditionalGeneration``
(vllm/model_executor/models/interns1.py: InternViT tower, pixel shuffle 0.5, MLP projector, the
language model of ``text_config``); the plugin's class is that one with the LLaVA-1.5 pattern of
vlm_prune/vllm/llava.py (docs/design/vllm-plugin.md):

- An image is cut into tiles (plus a thumbnail) by the processor; each tile is ``image_seq_length``
  tokens after the pixel shuffle, and vLLM writes the image as ``<img>`` + the tiles' tokens as ONE
  run of ``<IMG_CONTEXT>`` + ``</img>``. As in ``wrap()`` (adapters/internvl.py) the image's run is
  one item: ``keep`` / ``budget`` count over all of its tiles, a one-tile image keeps its square grid,
  a multi-tile image has none (grid-aware methods pool 1-D). The processor gives the run
  ``method.n_keep(tiles x image_seq_length)`` slots, so the scheduler and the KV cache only ever see
  kept tokens; ``<img>`` / ``</img>`` stay.
- Kept tokens keep their original positions (offsets in extra embedding channels; the language model
  rotates by vLLM's own 1-D RoPE on one of the runner's three equal position rows, as on Gemma 3:
  ``FirstPositionRow``, ``plain_rotary``), ``</img>`` and the text after the image continue from the
  unpruned length.
- Video: the processor writes each frame as ``Frame i: <img>`` + one tile's tokens + ``</img>`` (vLLM
  with ``<video>`` tokens, transformers with ``<IMG_CONTEXT>``), and ``wrap()`` sees each frame's run as
  an item of its own: so each frame keeps ``method.n_keep(image_seq_length)`` tokens on its grid, and
  every item's generator is seeded by its index among all the prompt's runs (images and frames in
  prompt order), as in ``wrap()``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.interns1 import (
    InternS1DummyInputsBuilder,
    InternS1ForConditionalGeneration,
    InternS1MultiModalProcessor,
    InternS1ProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.multimodal.processing import PromptReplacement, PromptUpdate, PromptUpdateDetails, cached_encode

from vlm_prune.methods.base import Method
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
    reduced,
    spec_from,
    spec_of,
    square_grid,
    tag_items,
)
from vlm_prune.vllm.qwen2_vl import _item, _without_spec

#: each item's unpruned count of visual tokens (where the text after it continues)
FULL_KEY = "vlm_prune_full"
#: the index of an item's first ``<img>`` run among the prompt's runs (wrap()'s item index: its generator)
FIRST_RUN_KEY = "vlm_prune_first_run"


def keeps_all(method: Method, n: int) -> bool:
    return method.n_keep(n, 1) >= n


class PrunedInternVLProcessingInfo(InternS1ProcessingInfo):
    def method(self, mm_kwargs: Mapping[str, object] | None = None) -> Method:
        return method_of(spec_of(self.get_hf_config(), mm_kwargs))


class PrunedInternVLMultiModalProcessor(InternS1MultiModalProcessor):
    """InternS1's processor; an image's run of ``<IMG_CONTEXT>`` gets the kept count of slots, and
    each item carries its question ids, rank, spec and unpruned count to the encoder."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _apply_hf_processor_main(self, mm_items: Any, hf_kwargs: Mapping[str, object]) -> Any:
        return super()._apply_hf_processor_main(mm_items, _without_spec(hf_kwargs))

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        updates = super()._get_prompt_updates(mm_items, _without_spec(hf_processor_mm_kwargs), out_mm_kwargs)
        method = self.info.method(hf_processor_mm_kwargs)
        hf_processor = self.info.get_hf_processor()
        tokenizer = self.info.get_tokenizer()
        data = out_mm_kwargs.get_data()
        tiles = data["image_num_patches"].tolist() if "image_num_patches" in data else []
        per_tile = hf_processor.image_seq_length

        def image(item_idx: int) -> PromptUpdateDetails:
            n = tiles[item_idx] * per_tile  # one run over all its tiles: a grid for one tile only (reduce_tiles)
            k = dry_run_slots(self.info, hf_processor_mm_kwargs, n, square_grid(n) if tiles[item_idx] == 1 else None)
            text = hf_processor.start_image_token + hf_processor.image_token * k + hf_processor.end_image_token
            return PromptUpdateDetails.select_token_id(cached_encode(tokenizer, text, add_special_tokens=False),
                                                       hf_processor.image_token_id)

        video_update = next(u for u in updates if u.modality == "video")
        frames = data["video_num_patches"].tolist() if "video_num_patches" in data else []
        video_id = cached_encode(tokenizer, hf_processor.video_token, add_special_tokens=False)[0]  # as vLLM's own

        def video(item_idx: int) -> Any:
            if keeps_all(method, per_tile):
                return video_update.replacement(item_idx)
            # each frame its own item on its grid, as wrap() prunes the frames' runs
            k = dry_run_slots(self.info, hf_processor_mm_kwargs, per_tile, square_grid(per_tile))
            run = hf_processor.start_image_token + hf_processor.video_token * k + hf_processor.end_image_token
            text = "\n".join(f"Frame{i + 1}: {run}" for i in range(frames[item_idx]))
            ids = cached_encode(tokenizer, text, add_special_tokens=False)
            return PromptUpdateDetails.select_token_id(ids, video_id)

        return [PromptReplacement(modality="image", target=[hf_processor.image_token_id], replacement=image),
                PromptReplacement(modality="video", target=video_update.target, replacement=video)]

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = method_of(spec)
        out = super().apply(inputs, timing_ctx)
        per_tile = self.info.get_hf_processor().image_seq_length
        tiles = {modality: [int(item["image_num_patches" if modality == "image" else "video_num_patches"].data)
                            if item is not None else 0 for item in items]
                 for modality, items in out["mm_kwargs"].items()}
        # wrap() sees every <img> run of the prompt as an item (a video's frames too): each item's first run
        order = sorted((r.offset, modality, rank) for modality, rs in out["mm_placeholders"].items()
                       for rank, r in enumerate(rs))
        first, runs = {}, 0
        for _, modality, rank in order:
            first[modality, rank] = runs
            runs += 1 if modality == "image" else tiles[modality][rank]
        return tag_items(out, spec, method, self._template_suffix(),
                         lambda modality, rank: {FULL_KEY: tiles[modality][rank] * per_tile,
                                                 FIRST_RUN_KEY: first[modality, rank]})


@MULTIMODAL_REGISTRY.register_processor(PrunedInternVLMultiModalProcessor, info=PrunedInternVLProcessingInfo,
                                        dummy_inputs=InternS1DummyInputsBuilder)
class VlmPruneInternVLForConditionalGeneration(OffsetChannels, FirstPositionRow, InternS1ForConditionalGeneration,
                                               SupportsMRoPE):
    """vLLM's InternVL (InternS1 class, HF format) with a vlm_prune vision-stage method (random, pool,
    divprune, cdpruner) on images."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.tile_tokens = self.num_image_token
        text = self.config.text_config  # vLLM's own rotary embeddings on one position row (as Gemma 3)
        plain_rotary(self.language_model.model.layers, lambda i: text.rope_parameters)

    def embed_multimodal(self, **kwargs: object) -> Any:
        extras = {k: kwargs.pop(k, None) for k in (QUERY_KEY, RANK_KEY, SPEC_KEY, FULL_KEY, FIRST_RUN_KEY)}
        out: list[torch.Tensor] = []
        for modality, inputs in self._parse_and_validate_multimodal_inputs(**kwargs).items():
            if inputs is None:
                continue
            if inputs["type"] not in ("pixel_values", "pixel_values_videos"):
                raise ValueError("vlm_prune.vllm prunes images given as pixels; embedding inputs are not supported")
            for b, feats in enumerate(self._process_vision_input(inputs)):
                item = {k: _item(v, b) for k, v in extras.items()}
                feats = feats.reshape(-1, feats.shape[-1])
                if modality == "images":
                    out.append(self._reduce(feats, item))
                else:  # a video: each frame is an item of its own (one tile), as wrap() sees its runs
                    n = self.tile_tokens
                    out.append(torch.cat([self._reduce(feats[f * n:(f + 1) * n], item, f)
                                          for f in range(feats.shape[0] // n)]))
        return out

    def _reduce(self, feats: torch.Tensor, item: dict[str, Any], run: int = 0) -> torch.Tensor:
        """One image's (or video frame's: its ``run``) kept rows in order, with their offsets from their
        slots in three extra channels."""
        spec = spec_from(item[SPEC_KEY], spec_of(self.config))
        method = method_of(spec)
        n = feats.shape[0]
        if keeps_all(method, n):
            return torch.cat([feats, encode_offsets(torch.zeros(n, dtype=torch.long), feats.dtype)], dim=1)
        first = item[FIRST_RUN_KEY]
        item = {**item, RANK_KEY: torch.tensor([(int(first.reshape(-1)[0]) if first is not None else 0) + run])}
        idx, kept = reduce_tiles(method, spec, feats, item, self.tile_tokens, self.language_model.model.embed_tokens)
        return with_offsets(method, idx, kept)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """Positions of the unpruned sequence (three identical rows): an image's slots start where its
        tokens started (forward() moves each kept token to its own), the rows after its last slot
        (``</img>``, the text) continue from the unpruned length. Methods whose official code feeds
        the shorter sequence (DivPrune, CDPruner: ``renumber_positions``, as wrap() on InternVL) keep
        vLLM's contiguous positions."""
        return unpruned_positions(len(input_tokens), mm_features, lambda f: renumbers(f, self.config))


def reduce_tiles(method: Method, spec: dict[str, Any], feats: torch.Tensor, item: dict[str, Any], tile_tokens: int,
                 embed_tokens: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vlm_prune.vllm.llava.reduced` on one image's tokens [N, D] (all its tiles, as wrap()'s
    pixel-shuffle adapters hand it over: a square grid for one tile, none for several; the item's
    question embedded by ``embed_tokens``, its generator from the spec's seed and its rank): the kept
    indices and their features."""
    n = feats.shape[0]
    text = None
    if item[QUERY_KEY] is not None:
        text = embed_tokens(item[QUERY_KEY].reshape(-1).to(feats.device).long())
    grid = square_grid(n) if n == tile_tokens else None
    rank = item[RANK_KEY]
    return reduced(method, feats, grid, text, spec, rank, int(rank.reshape(-1)[0]) if rank is not None else 0)


def with_offsets(method: Method, idx: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Kept rows ``kept`` at indices ``idx`` with each one's offset from its slot (zero where the method
    renumbers positions, as wrap())."""
    offsets = idx - torch.arange(idx.numel(), device=idx.device)
    if getattr(method, "renumber_positions", False):  # the official code's shorter sequence (wrap() too)
        offsets = torch.zeros_like(offsets)
    return torch.cat([kept, encode_offsets(offsets, kept.dtype)], dim=1)


def renumbers(feature: MultiModalFeatureSpec, hf_config: Any) -> bool:
    """Whether the method of a media item renumbers positions (the request's spec, or the engine's)."""
    elem = feature.data.get(SPEC_KEY) if feature.data is not None else None
    spec = spec_from(elem.data if elem is not None else None, spec_of(hf_config))
    return bool(getattr(method_of(spec), "renumber_positions", False))


def unpruned_positions(n_tokens: int, mm_features: list[MultiModalFeatureSpec],
                       renumbered: Any = lambda f: False, full_key: str = FULL_KEY) -> tuple[torch.Tensor, int]:
    """[3, n_tokens] positions (identical rows) and the decode shift of a prompt whose media items hold
    fewer embedding rows than their unpruned count (``full_key`` of each item, shared evenly by the
    item's runs of embedding rows: an image's one run, a video's frames): each run starts at its
    unpruned position, and the rows after it (closing tokens, the next frame's text, the text after
    the item) continue from the run's unpruned length; items for which ``renumbered(feature)`` holds
    shift nothing (the shorter sequence numbered without gaps)."""
    pos = torch.arange(n_tokens, dtype=torch.long)
    shift = 0
    for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
        start, length = f.mm_position.offset, f.mm_position.length
        is_embed = f.mm_position.is_embed
        if is_embed is None:
            is_embed = torch.ones(length, dtype=torch.bool)
        zero = torch.zeros(1, dtype=torch.int)
        edges = torch.diff(is_embed.int(), prepend=zero, append=zero)
        runs = list(zip(torch.nonzero(edges == 1).squeeze(1).tolist(), torch.nonzero(edges == -1).squeeze(1).tolist()))
        elem = f.data.get(full_key) if f.data is not None else None
        embeds = int(is_embed.sum())
        full = int(elem.data.reshape(-1)[0]) if elem is not None and not renumbered(f) else embeds
        for a, b in runs:
            gap = max(0, full // len(runs) - (b - a))
            pos[start + b:] += gap
            shift += gap
    return pos[None].expand(3, -1).clone(), shift
