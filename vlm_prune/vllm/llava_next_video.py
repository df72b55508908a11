"""LLaVA-NeXT-Video served by vLLM with a vision-stage or frames-stage method of vlm_prune.

vLLM's own ``LlavaNextVideoForConditionalGeneration`` takes video only (one per prompt; images are not
wired into its class), so this plugin class serves its videos, as ``wrap()`` runs them
(adapters/llava_next_video.py): every frame goes through the CLIP tower, the feature layer is
average-pooled by ``spatial_pool_stride`` (a 8 x 8 map becomes 4 x 4) and projected; a video is T frame
maps without newline tokens.

- A vision method (random, pool, divprune, cdpruner) reduces each frame on its grid, keeping
  ``method.n_keep(N)`` of its N tokens (one generator over the frames, as wrap()).
- A frames method (uniform, keyscore, vidcom2, dycoke: vlm_prune/vllm/frames.py) plans the whole video
  on its [T, N, D] frame maps, with the processor's pixels and the question's embeddings, as wrap().
  Unlike on OneVision, uniform here lets the tower encode every frame (the kept ones are picked after).
- QuoTA runs per request in two passes (frames.quota_request), as wrap() with its default scorer
  (adapters/llava_next_video.py ``score_frames``): pass 1 asks the engine, unpruned, about each frame as a
  one-frame video whose pooled map the encoder fits into ``score_grid``; pass 2's plan (``quota_plan`` on
  the pooled frame maps: this family has no unpooled ones) follows the scores its spec carries.
- Slots per video: the kept count, known from the frame count and the budget in the processor; kept rows
  keep their original positions (or are renumbered where the method's official code does), as llava.py.

Refused per request (config.validate_spec): the tower-attention methods (wrap() refuses them on this
family; HiRED runs on its images only, which vLLM's class does not take) and fastvid / holitom (as wrap()).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.llava_next_video import (
    LlavaNextVideoDummyInputsBuilder,
    LlavaNextVideoForConditionalGeneration,
    LlavaNextVideoMultiModalProcessor,
    LlavaNextVideoProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import VideoProcessorItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate

from vlm_prune.methods.base import Method, Reduction, VisionContext
from vlm_prune.adapters.hf_vlm import fit_grid
from vlm_prune.vllm.frames import frames_reduction, is_frames, quota_phase, strip_quota
from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    FirstPositionRow,
    OffsetChannels,
    item_inputs,
    pack_kept,
    PrunedLlavaMultiModalProcessor,
    method_of,
    plain_rotary,
    spec_of,
    tag_items,
)
from vlm_prune.vllm.safety import dry_run_video, engine_dims
from vlm_prune.vllm.onevision import (
    FULL_KEY,
    VlmPruneLlavaOnevisionForConditionalGeneration,
    _item,
    _scatter,
    score_rows,
)


class PrunedLlavaNextVideoProcessingInfo(LlavaNextVideoProcessingInfo):
    """Each video gets the count of placeholder slots ``wrap()`` keeps for it."""

    def frame_grid(self) -> tuple[int, int]:
        side = math.isqrt(self._get_num_frame_tokens(image_width=0, image_height=0))
        return side, side

    def get_num_video_tokens(self, *, image_width: int, image_height: int, num_frames: int,
                             mm_kwargs: Mapping[str, object] | None = None) -> int:
        per_frame = self._get_num_frame_tokens(image_width=image_width, image_height=image_height)
        spec = spec_of(self.get_hf_config(), mm_kwargs)
        method = method_of(strip_quota(spec))
        if quota_phase(spec) == "score":  # QuoTA's pass 1: each frame's map fitted into score_grid
            return score_rows(self.frame_grid(), spec) * num_frames
        if is_frames(method):
            return dry_run_video(spec, num_frames, per_frame, self.frame_grid(), **engine_dims(self))
        return method.n_keep(per_frame, 1) * num_frames


class PrunedLlavaNextVideoMultiModalProcessor(LlavaNextVideoMultiModalProcessor):
    """LLaVA-NeXT-Video's processor with pruned slot counts, each video's question ids, rank, spec and
    unpruned length attached."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, {k: v for k, v in hf_kwargs.items() if k != "vlm_prune"})

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        video_token_id = self.info.get_hf_config().video_token_index

        def video(item_idx: int) -> list[int]:
            videos = mm_items.get_items("video", VideoProcessorItems)
            size = videos.get_frame_size(item_idx)
            n = self.info.get_num_video_tokens(image_width=size.width, image_height=size.height,
                                               num_frames=videos.get_num_frames(item_idx),
                                               mm_kwargs=hf_processor_mm_kwargs)
            return [video_token_id] * n

        return [PromptReplacement(modality="video", target=[video_token_id], replacement=video)]

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)

        def full(modality: str, rank: int) -> dict[str, int]:
            videos = inputs.mm_data_items.get_items("video", VideoProcessorItems)
            size = videos.get_frame_size(rank)
            per_frame = self.info._get_num_frame_tokens(image_width=size.width, image_height=size.height)
            if quota_phase(spec) == "score":  # a scoring request is its own (fitted) video: nothing shifts
                per_frame = score_rows(self.info.frame_grid(), spec)
            return {FULL_KEY: per_frame * videos.get_num_frames(rank)}

        return tag_items(super().apply(inputs, timing_ctx), spec, method_of(strip_quota(spec)), self._template_suffix(),
                         full)


@MULTIMODAL_REGISTRY.register_processor(PrunedLlavaNextVideoMultiModalProcessor,
                                        info=PrunedLlavaNextVideoProcessingInfo,
                                        dummy_inputs=LlavaNextVideoDummyInputsBuilder)
class VlmPruneLlavaNextVideoForConditionalGeneration(OffsetChannels, FirstPositionRow, LlavaNextVideoForConditionalGeneration,
                                                     SupportsMRoPE):
    """vLLM's LLaVA-NeXT-Video with a vlm_prune method on its videos (random, pool, divprune, cdpruner per
    frame; the frames methods uniform, keyscore, vidcom2, dycoke, quota)."""

    #: OneVision's: the CLIP tower in every naming, ``image_newline``, the language model
    hf_to_vllm_mapper = VlmPruneLlavaOnevisionForConditionalGeneration.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        text = self.config.text_config  # vLLM's own rotary embeddings on one position row (FirstPositionRow)
        plain_rotary(self.language_model.model.layers, lambda i: text.rope_parameters)
        self.frame_grid = (self.pooled_grid_length, self.pooled_grid_length)

    def embed_multimodal(self, **kwargs: object) -> Any:
        extras = {k: kwargs.pop(k, None) for k in (QUERY_KEY, RANK_KEY, SPEC_KEY, FULL_KEY)}
        video_input = self._parse_and_validate_video_input(**kwargs)
        if video_input is None:
            return []
        embeds = self._process_video_pixels(video_input)
        pixels = video_input["pixel_values_videos"]
        return [self._reduce(e, {k: _item(v, b) for k, v in extras.items()}, pixels[b]) for b, e in enumerate(embeds)]

    def _reduce(self, feats: torch.Tensor, item: dict[str, Any], pixels: torch.Tensor) -> torch.Tensor:
        """One video's kept rows (in order) with their offsets from their slots in three extra channels."""
        spec, method, gen, rank, text = item_inputs(self, item, feats.device, strip_quota)
        n = self.frame_grid[0] * self.frame_grid[1]
        t = feats.shape[0] // n
        if quota_phase(spec) == "score":  # QuoTA's pass 1: the frame maps fitted into score_grid (wrap()'s scorer)
            grid = spec["quota"].get("grid")
            maps = fit_grid(feats.reshape(t, n, -1), self.frame_grid, tuple(grid) if grid else None)
            rows = maps.reshape(-1, feats.shape[-1])
            return pack_kept(torch.ones(rows.shape[0], dtype=torch.bool, device=feats.device), rows, method)
        with torch.no_grad():
            if is_frames(method):
                red = frames_reduction(method, feats.reshape(t, n, -1), self.frame_grid, text_features=text,
                                       pixels=pixels, spec=spec)
            else:
                red = self._per_frame(method, feats, t, n, text, gen, rank)
        none = torch.zeros(feats.shape[0], dtype=torch.bool, device=feats.device)
        keep, new = _scatter(feats, torch.arange(feats.shape[0], device=feats.device), red, always=none)
        return pack_kept(keep, new, method)

    def _per_frame(self, method: Method, feats: torch.Tensor, t: int, n: int, text: torch.Tensor | None,
                   gen: torch.Generator, rank: int) -> Reduction:
        """A vision method on each frame on its grid, one generator over the frames (wrap()'s reduce_pieces)."""
        parts = []
        for f in range(t):
            frame = feats[f * n:(f + 1) * n]
            r = method.reduce_image(VisionContext(features=frame, n_keep=method.n_keep(n, 1), grid=self.frame_grid,
                                                  text_embeds=text, generator=gen, image_index=rank))
            if r.sizes is not None:
                raise ValueError(f"method {method.name!r} merges tokens with sizes, which vLLM's attention cannot weight")
            parts.append(Reduction(r.indices.to(feats.device) + f * n, frame[r.indices] if r.features is None else r.features))
        return Reduction(torch.cat([p.indices for p in parts]), torch.cat([p.features for p in parts]))

    # ---- positions: kept tokens at their original positions (OneVision's: FULL_KEY per item) ---------
    get_mrope_input_positions = VlmPruneLlavaOnevisionForConditionalGeneration.get_mrope_input_positions
