"""Qwen3-VL served by vLLM with a vision-stage or frames method of vlm_prune.

The Qwen2-VL plugin (vlm_prune/vllm/qwen2_vl.py: slots, the method in ``embed_multimodal``, kept
tokens at their original M-RoPE positions through offset channels) on vLLM's own Qwen3-VL class,
with Qwen3-VL's two differences, read in vLLM 0.32's ``model_executor/models/qwen3_vl.py`` and
handled as ``wrap()`` handles them (``adapters/qwen3_vl.py``):

- **DeepStack.** vLLM's encoder returns each item's tokens as [N, D * (1 + L)]: the merger's
  features, then the L DeepStack mergers' features of the same token, which ``embed_input_ids``
  splits off and the decoder adds to the visual rows after layers 0 .. L-1. The method scores the
  first D channels (what ``wrap()``'s method sees); a kept token keeps all its channels, so a
  dropped token leaves every DeepStack layer with its row. A method that rewrites features (pool's
  averages) is replayed on each DeepStack map with the generator state it started from and must
  choose the same tokens, as ``wrap()`` replays it; otherwise the request is refused with its reason.
- **Timestamps.** A video is written as ``<t seconds><|vision_start|>`` + the slice's tokens +
  ``<|vision_end|>`` per temporal slice, each slice's M-RoPE grid at t = 0 starting after the text
  before it. So each slice gets its own slots (the method's ``n_keep`` of it; uniform: the slices
  its plan keeps, which depend on the budget alone, computed in the processor), a dropped slice's
  timestamp and start / end tokens stay (as in ``wrap()``), and ``get_mrope_input_positions`` places
  each slice's slots at the slice's own origin, the text after it from the unpruned slice's
  largest position + 1 (transformers' ``get_rope_index`` and vLLM's layout). KeyScore chooses
  slices from the tower's features, after the processor has fixed how many tokens each slice's
  run holds, so it is refused on Qwen3-VL video; QuoTA is refused as ``wrap()`` refuses it there.

The slice machinery (``_SlicedProcessor``, ``_SlicedVideo``) also serves GLM-4.1V (vlm_prune/vllm/glm4v.py:
another slice token and other tokens around a slice); Qwen3-VL-MoE (below) and Qwen3.5 / Qwen3.5-MoE
(vlm_prune/vllm/qwen3_5.py) are the Qwen3-VL classes on vLLM's classes of those models.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeProcessingInfo
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.multimodal.processing import PromptUpdateDetails

from vlm_prune.methods.base import Method, VisionContext
from vlm_prune.vllm.frames import frames_plan, is_frames
from vlm_prune.vllm.qwen2_vl import (
    _PrunedInfo,
    _PrunedProcessor,
    _PrunedQwen,
    _without_spec,
)
from vlm_prune.vllm.safety import dry_run_image, dry_run_video, engine_dims

#: why a method that rewrites features cannot run when its replay on a DeepStack map chooses other tokens. It is
#: raised inside the engine, so no accepted request may reach it: of the served methods that run without the
#: tower's [CLS] attention only pool rewrites features, and its rows follow the grid alone (tested)
DEEPSTACK_REFUSAL = (
    "{name!r} rewrote visual features in a way vlm_prune cannot repeat on Qwen3-VL's DeepStack features (replayed on "
    "them it chose other tokens), so the rewritten tokens would get DeepStack features of other tokens. Use a method "
    "that only keeps / drops tokens (random, divprune, cdpruner, uniform) or pool"
)


def slice_counts(method: Method, spec: dict[str, Any], t: int, grid: tuple[int, int], dims: dict[str, Any]
                 ) -> list[int]:
    """Slots of each of a video's ``t`` slices of a rows x cols ``grid``, after the spec's dry run on those
    slices at the engine's width and dtype ``dims`` (vlm_prune.vllm.safety): the vision method's slots of
    each slice (an image of its own), or the tokens of each slice a frames plan whose counts need no
    features (uniform, dycoke) keeps."""
    n = grid[0] * grid[1]
    if not is_frames(method):
        return [dry_run_image(spec, n, grid, **dims)] * t
    dry_run_video(spec, t, n, grid, **dims)
    kept = frames_plan(method, torch.zeros(t, n, 1), grid).reduction.indices
    return torch.bincount(kept // n, minlength=t).tolist()


def with_slice_counts(ids: list[int], token: int, counts: list[int]) -> list[int]:
    """The video's unpruned replacement ``ids`` with its k-th run of ``token`` cut to ``counts[k]``."""
    out: list[int] = []
    run = 0
    for i, tok in enumerate(ids):
        if tok != token:
            out.append(tok)
        elif i == 0 or ids[i - 1] != token:
            out.extend([token] * counts[run])
            run += 1
    if run != len(counts):
        raise RuntimeError(f"vlm_prune: {run} runs of video tokens for {len(counts)} temporal slices")
    return out


class PrunedQwen3VLProcessingInfo(_PrunedInfo, Qwen3VLProcessingInfo):
    pass


class _SlicedProcessor(_PrunedProcessor):
    """A processor that writes each temporal slice of a video as its own run of ``slice_token``
    between other tokens (Qwen3-VL, GLM-4.1V): the method's slots per image as on Qwen2-VL, per slice
    of a video inside that slice's run (its timestamp and start / end tokens stay)."""

    def slice_token(self) -> int:
        """The placeholder id of a video's slices."""
        return self.info.get_hf_config().video_token_id

    def _apply_hf_processor_main(self, mm_items: Any, hf_kwargs: Mapping[str, object]) -> Any:
        return super()._apply_hf_processor_main(mm_items, _without_spec(hf_kwargs))

    def _slots(self, modality: str, ids: Any, t: int, grid: tuple[int, int], method: Method,
               spec: dict[str, Any]) -> Any:
        if modality == "image":
            return super()._slots(modality, ids, t, grid, method, spec)
        token = self.slice_token()
        full = ids.full if isinstance(ids, PromptUpdateDetails) else ids
        counts = slice_counts(method, spec, t, grid, engine_dims(self.info))
        return PromptUpdateDetails.select_token_id(with_slice_counts(list(full), token, counts), token)


class PrunedQwen3VLMultiModalProcessor(_SlicedProcessor, Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor with the method's slots: per image as on Qwen2-VL, per temporal slice of a
    video between its timestamp and start / end tokens."""


class _SlicedVideo(_PrunedQwen):
    """The model side of a processor that writes a video's temporal slices as separate runs: every
    slice's slots at the slice's own M-RoPE origin (the start token before it found from the item's
    offset on), the text after it from the unpruned slice's largest position + 1."""

    slice_origins = True

    def slice_bounds(self) -> tuple[int, int]:
        """The ids of the tokens just before and just after a video slice's run of placeholders."""
        return self.config.vision_start_token_id, self.config.vision_end_token_id

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """The unpruned prompt's positions (Qwen3-VL's and GLM-4.1V's layout): an image's slots at its
        first position, a video's slots of each slice at the slice's first position (after its start token),
        the text after an image / slice from its unpruned grid's largest position + 1; decoding from there."""
        m = self.config.vision_config.spatial_merge_size
        begin, finish = self.slice_bounds()
        n_tokens = len(input_tokens)
        pos = torch.empty(3, n_tokens, dtype=torch.long)
        cursor, nxt = 0, 0

        def place(start: int, k: int, rows: int, cols: int) -> None:
            nonlocal cursor, nxt
            pos[:, cursor:start] = torch.arange(start - cursor) + nxt
            base = nxt + start - cursor
            pos[:, start : start + k] = base
            nxt, cursor = base + max(rows, cols), start + k

        for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
            t, h, w = (int(x) for x in f.data[f"{f.modality}_grid_thw"].data)
            if f.modality == "image":
                place(f.mm_position.offset, f.mm_position.length, h // m, w // m)
                continue
            at = f.mm_position.offset
            for _ in range(t):
                start = input_tokens.index(begin, at) + 1
                end = input_tokens.index(finish, start)
                place(start, end - start, h // m, w // m)
                at = end + 1
        pos[:, cursor:] = torch.arange(n_tokens - cursor) + nxt
        return pos, nxt + (n_tokens - cursor) - n_tokens


class _PrunedQwen3(_SlicedVideo):
    """Qwen3-VL's model side: the method scores the merger's channels, DeepStack's follow."""

    def _scored(self, features: torch.Tensor) -> torch.Tensor:
        return features[:, : self.visual_dim]

    def _rewritten(self, method: Method, frame: torch.Tensor, ctx: VisionContext, red: Any,
                   state: torch.Tensor) -> torch.Tensor:
        """Rewritten main features, and each DeepStack map reduced by the same method from the same
        generator state (it must keep the same tokens)."""
        d = self.visual_dim
        out = [red.features.to(frame.dtype)]
        for level in range(1, frame.shape[1] // d):
            gen = torch.Generator()
            gen.set_state(state)
            replay = method.reduce_image(dataclasses.replace(ctx, features=frame[:, level * d : (level + 1) * d],
                                                             generator=gen))
            if replay.features is None or not torch.equal(replay.indices.cpu(), red.indices.cpu()):
                raise ValueError(DEEPSTACK_REFUSAL.format(name=method.name))
            out.append(replay.features.to(frame.dtype))
        return torch.cat(out, dim=1)


@MULTIMODAL_REGISTRY.register_processor(
    PrunedQwen3VLMultiModalProcessor, info=PrunedQwen3VLProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VlmPruneQwen3VLForConditionalGeneration(_PrunedQwen3, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL with a vlm_prune method (random, pool, divprune, cdpruner; video: uniform, dycoke)."""


class PrunedQwen3VLMoeProcessingInfo(_PrunedInfo, Qwen3VLMoeProcessingInfo):
    pass


@MULTIMODAL_REGISTRY.register_processor(
    PrunedQwen3VLMultiModalProcessor, info=PrunedQwen3VLMoeProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VlmPruneQwen3VLMoeForConditionalGeneration(_PrunedQwen3, Qwen3VLMoeForConditionalGeneration):
    """vLLM's Qwen3-VL-MoE with a vlm_prune method: the Qwen3-VL plugin (the language model routes each kept
    token as it comes; nothing of the plugin touches it)."""
