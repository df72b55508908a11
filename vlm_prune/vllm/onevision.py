"""LLaVA-OneVision served by vLLM with a vision-stage or frames-stage method of vlm_prune.

The LLaVA-1.5 pattern (vlm_prune/vllm/llava.py, docs/design/vllm-plugin.md), with OneVision's two kinds of items:

- **Images** (anyres: the base tile's tokens, then the unpadded tiles with one ``image_newline``
  token ending each row). As in ``wrap()`` (adapters/llava_onevision.py) the newline rows are not
  visual tokens: the method sees the image's other tokens as one sequence (no grid), keeps
  ``method.n_keep(visual)`` of them, and every newline stays. Slots per image: that count plus
  the image's newlines, both known from the image size in the processor.
- **Video** (T frames of a pooled ceil(h/2) x ceil(w/2) grid, then one newline): a vision method
  reduces each frame on its grid (one generator over the frames, as wrap(); VisionZip reads each
  frame's SigLIP feature-layer attention pooled to that grid, video only, as wrap()); a frames method
  (``uniform``, ``keyscore``: vlm_prune/vllm/frames.py) keeps whole frames; ``quota`` keeps the
  plan of its pass-1 scores (frames.quota_request) on the unpooled maps. Slots per video: the kept
  tokens plus the newline. ``uniform`` subsamples the frames in the processor, so the tower only
  encodes the frames it keeps.

Kept rows keep their original positions (offsets in extra embedding channels, the text after an
item continues from its unpruned length), as llava.py does.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers.models.llava_onevision.modeling_llava_onevision import (
    get_anyres_image_grid_shape,
)
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionDummyInputsBuilder,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionMultiModalProcessor,
    LlavaOnevisionProcessingInfo,
)
from vllm.model_executor.models.utils import WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
)
from vllm.multimodal.parse import ImageProcessorItems, VideoProcessorItems
from vllm.multimodal.processing import PromptReplacement, PromptUpdate

from vlm_prune.methods.base import Method, Reduction, VisionContext
from vlm_prune.vllm.config import ONEVISION_VISIONZIP_REFUSAL, TOWER_METHODS
from vlm_prune.vllm.frames import (
    frames_reduction,
    is_frames,
    quota_phase,
    strip_quota,
    uniform_frames,
)
from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    OffsetChannels,
    PrunedLlavaMultiModalProcessor,
    dry_run_slots,
    item_inputs,
    method_of,
    pack_kept,
    spec_from,
    spec_of,
    tag_items,
)
from vlm_prune.vllm.safety import dry_run_video, engine_dims

#: each item's unpruned placeholder count (where the text after it continues)
FULL_KEY = "vlm_prune_full"


class PrunedOnevisionProcessingInfo(LlavaOnevisionProcessingInfo):
    """Each image / video gets the count of placeholder slots ``wrap()`` keeps for it."""

    def method(self, mm_kwargs: Mapping[str, object] | None = None) -> Method:
        return method_of(strip_quota(spec_of(self.get_hf_config(), mm_kwargs)))

    def image_newlines(self, *, image_width: int, image_height: int) -> int:
        """The image's ``image_newline`` rows (one per row of its unpadded tiles)."""
        cfg = self.get_hf_config()
        enc = self.get_vision_encoder_info()
        rows, cols = get_anyres_image_grid_shape((image_height, image_width), cfg.image_grid_pinpoints,
                                                 enc.get_image_size())
        _, newlines = self._get_num_unpadded_features(original_height=image_height, original_width=image_width,
                                                      npatches=enc.get_patch_grid_length(), num_patch_height=rows,
                                                      num_patch_width=cols)
        return newlines

    def get_num_image_tokens(self, *, image_width: int, image_height: int,
                             mm_kwargs: Mapping[str, object] | None = None) -> int:
        n = super().get_num_image_tokens(image_width=image_width, image_height=image_height)
        m = self.method(mm_kwargs)
        if is_frames(m):
            return n  # a frames method leaves images alone (as wrap(frames=...))
        if m.name in TOWER_METHODS:
            if mm_kwargs is None:  # vLLM's profiling asks for the most tokens an image can take
                return n
            raise ValueError(ONEVISION_VISIONZIP_REFUSAL.format(name=m.name))
        newlines = self.image_newlines(image_width=image_width, image_height=image_height)
        return dry_run_slots(self, mm_kwargs, n - newlines) + newlines  # no grid: base and tiles, as the encoder

    def frame_grid(self) -> tuple[int, int]:
        side = math.isqrt(self._get_num_frame_tokens(image_width=0, image_height=0))
        return side, side

    def tower_grid(self) -> tuple[int, int]:
        side = self.get_vision_encoder_info().get_patch_grid_length()
        return side, side

    def get_num_video_tokens(self, *, image_width: int, image_height: int, num_frames: int,
                             mm_kwargs: Mapping[str, object] | None = None) -> int:
        per_frame = self._get_num_frame_tokens(image_width=image_width, image_height=image_height)
        spec = spec_of(self.get_hf_config(), mm_kwargs)
        m = method_of(strip_quota(spec))
        if quota_phase(spec) == "score":  # QuoTA's pass 1: each frame's map resized to at most score_grid
            return score_rows(self.frame_grid(), spec) * num_frames + 1
        if is_frames(m):
            return dry_run_video(spec, num_frames, per_frame, self.frame_grid(), unpooled_grid=self.tower_grid(),
                                 **engine_dims(self)) + 1
        return m.n_keep(per_frame, 1) * num_frames + 1


class PrunedOnevisionMultiModalProcessor(LlavaOnevisionMultiModalProcessor):
    """OneVision's processor with pruned slot counts, each item's question ids, rank, spec and
    unpruned length attached; uniform decodes only its kept frames."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _get_hf_mm_inputs(self, mm_items: Any, hf_kwargs: Mapping[str, object]) -> Any:
        spec = spec_of(self.info.get_hf_config(), hf_kwargs)
        hf_data, kwargs, passthrough = super()._get_hf_mm_inputs(
            mm_items, {k: v for k, v in hf_kwargs.items() if k != "vlm_prune"})
        method = method_of(strip_quota(spec))
        videos = hf_data.get("videos")
        if method.name == "uniform" and videos:
            per_frame = self.info._get_num_frame_tokens(image_width=0, image_height=0)
            hf_data["videos"] = [_subsample(v, uniform_frames(method, _num_frames(v), per_frame)) for v in videos]
        return hf_data, kwargs, passthrough

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        cfg = self.info.get_hf_config()

        def image(item_idx: int) -> list[int]:
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item_idx)
            n = self.info.get_num_image_tokens(image_width=size.width, image_height=size.height,
                                               mm_kwargs=hf_processor_mm_kwargs)
            return [cfg.image_token_index] * n

        def video(item_idx: int) -> list[int]:
            videos = mm_items.get_items("video", VideoProcessorItems)
            size = videos.get_frame_size(item_idx)
            n = self.info.get_num_video_tokens(image_width=size.width, image_height=size.height,
                                               num_frames=videos.get_num_frames(item_idx),
                                               mm_kwargs=hf_processor_mm_kwargs)
            return [cfg.video_token_index] * n

        return [PromptReplacement(modality="image", target=[cfg.image_token_index], replacement=image),
                PromptReplacement(modality="video", target=[cfg.video_token_index], replacement=video)]

    def _unpruned(self, mm_items: Any, modality: str, idx: int, *, spec: dict[str, Any]) -> int:
        if modality == "image":
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(idx)
            return LlavaOnevisionProcessingInfo.get_num_image_tokens(self.info, image_width=size.width,
                                                                      image_height=size.height)
        videos = mm_items.get_items("video", VideoProcessorItems)
        per_frame = self.info._get_num_frame_tokens(image_width=0, image_height=0)
        if quota_phase(spec) == "score":  # a scoring request is its own (resized) video: nothing shifts
            return score_rows(self.info.frame_grid(), spec) * videos.get_num_frames(idx) + 1
        return per_frame * videos.get_num_frames(idx) + 1

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = self.info.method(inputs.hf_processor_mm_kwargs)
        full = partial(self._unpruned, inputs.mm_data_items, spec=spec)
        return tag_items(super().apply(inputs, timing_ctx), spec, method, self._template_suffix(),
                         lambda modality, rank: {FULL_KEY: full(modality, rank)})


def score_rows(frame_grid: tuple[int, int], spec: dict[str, Any]) -> int:
    """Tokens per frame of a QuoTA scoring request: the frame map fitted into the spec's score grid."""
    grid = spec["quota"].get("grid") or frame_grid
    return min(frame_grid[0], grid[0]) * min(frame_grid[1], grid[1])


def _num_frames(video: Any) -> int:
    frames = video[0] if isinstance(video, tuple) else video
    return len(frames)


def _subsample(video: Any, keep: list[int] | None) -> Any:
    """The video with only frames ``keep`` (None: all)."""
    if keep is None:
        return video
    if isinstance(video, tuple):
        frames, meta = video
        return _subsample(frames, keep), meta
    if isinstance(video, (np.ndarray, torch.Tensor)):
        return video[keep]
    return [video[i] for i in keep]


@MULTIMODAL_REGISTRY.register_processor(PrunedOnevisionMultiModalProcessor, info=PrunedOnevisionProcessingInfo,
                                        dummy_inputs=LlavaOnevisionDummyInputsBuilder)
class VlmPruneLlavaOnevisionForConditionalGeneration(OffsetChannels, LlavaOnevisionForConditionalGeneration, SupportsMRoPE):
    """vLLM's LLaVA-OneVision with a vlm_prune method (random, pool, divprune, cdpruner, visionzip on video;
    the frames methods uniform, keyscore)."""

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_regex={re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?"): "vision_tower.vision_model."},
        orig_to_new_prefix={
            "model.language_model.": "language_model.model.",
            "model.multi_modal_projector.": "multi_modal_projector.",
            "model.image_newline": "image_newline",
            "lm_head.": "language_model.lm_head.",
        },
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        vc = self.config.vision_config
        side = math.ceil((vc.image_size // vc.patch_size) / 2)
        self.frame_grid = (side, side)
        self.tower_grid = (vc.image_size // vc.patch_size,) * 2
        self._feature_input: torch.Tensor | None = None
        self._unpooled: torch.Tensor | None = None
        self.vision_tower.vision_model.encoder.layers[-1].register_forward_pre_hook(self._keep_feature_input)

    def _keep_feature_input(self, module: torch.nn.Module, args: tuple) -> None:
        self._feature_input = args[0].detach()
    # ---- encoder ------------------------------------------------------------------------------
    def _video_pixels_to_features(self, vision_tower: Any, pixel_values: torch.Tensor) -> torch.Tensor:
        """vLLM's tower, projector and pooling; the projected maps before pooling are kept (QuoTA)."""
        feats = vision_tower(pixel_values, feature_select_strategy=self.config.vision_feature_select_strategy)
        feats = self.multi_modal_projector(feats)
        self._unpooled = feats
        return self.apply_pooling(feats)

    def embed_multimodal(self, **kwargs: object) -> Any:
        extras = {k: kwargs.pop(k, None) for k in (QUERY_KEY, RANK_KEY, SPEC_KEY, FULL_KEY)}
        by_modality = self._parse_and_validate_multimodal_inputs(**kwargs)
        out: list[torch.Tensor] = []
        for modality, inputs in by_modality.items():
            if modality == "image":
                if inputs["type"] != "pixel_values":
                    raise ValueError("vlm_prune.vllm prunes images given as pixels; image_embeds inputs are not supported")
                embeds = list(self._process_image_input(inputs))
                pixels = None
            else:
                embeds = [e.reshape(-1, e.shape[-1]) for e in self._process_video_pixels(inputs)]
                pixels = inputs["pixel_values_videos"]
            first_frame = 0  # the video's first row in the tower's batch (VisionZip's attention)
            for b, e in enumerate(embeds):
                item = {k: _item(v, b) for k, v in extras.items()}
                out.append(self._reduce(modality, e, item, None if pixels is None else pixels[b], first_frame))
                first_frame += 0 if pixels is None else len(pixels[b])
        return out

    def _reduce(self, modality: str, feats: torch.Tensor, item: dict[str, Any], pixels: torch.Tensor | None,
                first_frame: int = 0) -> torch.Tensor:
        """One item's kept rows (in order) with their offsets from their slots in three extra channels."""
        spec, method, gen, _, text = item_inputs(self, item, feats.device, strip_quota)
        full = int(item[FULL_KEY].reshape(-1)[0]) if item[FULL_KEY] is not None else feats.shape[0]
        with torch.no_grad():
            if modality == "image":
                keep, new = self._reduce_image(method, feats, text, gen)
            else:
                keep, new = self._reduce_video(method, feats, text, gen, full, pixels, first_frame, spec)
        return pack_kept(keep, new, method, self._origin(method, modality, new.shape[0], full))

    def _origin(self, method: Method, modality: str, rows: int, full: int) -> torch.Tensor:
        """Each encoded row's position in the unpruned item (its row, unless uniform decoded only
        its kept frames: then frame j of the encoded video is the j-th kept frame)."""
        ar = torch.arange(rows)
        if modality != "video" or method.name != "uniform" or rows == full:  # (QuoTA's scoring: rows == full)
            return ar
        n = self.frame_grid[0] * self.frame_grid[1]
        frames = uniform_frames(method, (full - 1) // n, n)
        starts = torch.tensor(frames + [(full - 1) // n]) * n  # the newline follows the last frame
        j = ar // n
        return starts[j] + (ar - j * n)

    def _reduce_image(self, method: Method, feats: torch.Tensor, text: torch.Tensor | None,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """keep [N] and the rows [N, D] after the method (wrap(): newlines kept, unseen and uncounted)."""
        if is_frames(method):
            return torch.ones(feats.shape[0], dtype=torch.bool, device=feats.device), feats
        newline = (feats == self.image_newline.to(feats.dtype)).all(-1)
        rows = torch.nonzero(~newline).squeeze(1)
        visual = feats[rows]
        ctx = VisionContext(features=visual, n_keep=method.n_keep(visual.shape[0], 1), grid=None, text_embeds=text,
                            generator=gen)
        red = method.reduce_image(ctx)
        return _scatter(feats, rows, red, always=newline)

    def _reduce_video(self, method: Method, feats: torch.Tensor, text: torch.Tensor | None, gen: torch.Generator,
                      full: int, pixels: torch.Tensor | None, first_frame: int = 0, spec: dict[str, Any] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.frame_grid[0] * self.frame_grid[1]
        body = feats.shape[0] - 1
        t = body // n
        tail = torch.zeros(feats.shape[0], dtype=torch.bool, device=feats.device)
        tail[body:] = True
        rows = torch.arange(body, device=feats.device)
        #: frames the tower encoded for the latest video (uniform: only the kept ones)
        self.last_encoded_frames = t
        if quota_phase(spec) == "score":  # QuoTA's pass 1: the frame maps fitted into score_grid (wrap()'s scorer)
            from vlm_prune.adapters.hf_vlm import fit_grid

            grid = spec["quota"].get("grid")
            maps = fit_grid(feats[:body].reshape(t, n, -1), self.frame_grid, tuple(grid) if grid else None)
            new = torch.cat([maps.reshape(-1, feats.shape[-1]), feats[body:]])
            return torch.ones(new.shape[0], dtype=torch.bool, device=feats.device), new
        if is_frames(method):
            if method.name == "uniform" and feats.shape[0] != full:  # the processor decoded only the kept frames
                return torch.ones(feats.shape[0], dtype=torch.bool, device=feats.device), feats
            unpooled = None if self._unpooled is None else self._unpooled[first_frame:first_frame + t]
            tower = None
            if getattr(method, "wants_tower_attention", False):  # FastVID, HoliTom: SigLIP's attention per frame
                tower = (lambda f: self._frame_attention(first_frame + f))
            red = frames_reduction(method, feats[:body].reshape(t, n, -1), self.frame_grid, text_features=text,
                                   pixels=pixels, spec=spec, unpooled=unpooled, unpooled_grid=self.tower_grid,
                                   tower_attention=tower)
            return _scatter(feats, rows, red, always=tail)
        parts = []
        for f in range(t):
            tower = None
            if method.name in TOWER_METHODS:
                tower = (lambda row=first_frame + f: self._frame_attention(row))
            ctx = VisionContext(features=feats[f * n:(f + 1) * n], n_keep=method.n_keep(n, 1), grid=self.frame_grid,
                                text_embeds=text, tower_attention=tower, generator=gen)
            r = method.reduce_image(ctx)
            if r.sizes is not None:
                raise ValueError(f"method {method.name!r} merges tokens with sizes, which vLLM's attention cannot weight")
            parts.append(Reduction(r.indices.to(feats.device) + f * n,
                                   feats[f * n:(f + 1) * n][r.indices] if r.features is None else r.features))
        red = Reduction(torch.cat([p.indices for p in parts]), torch.cat([p.features for p in parts]))
        return _scatter(feats, rows, red, always=tail)

    def _frame_attention(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """VisionZip's view of one video frame (as wrap()'s FeatureLayerTap on SigLIP, no CLS): the mean
        attention each token of the feature layer receives and its keys (mean over heads), bilinearly
        pooled to the frame's token grid as the model pools its features."""
        from vlm_prune.adapters.vision_towers import pool_grid

        layer = self.vision_tower.vision_model.encoder.layers[-1]
        attn = layer.self_attn
        if getattr(attn, "tp_size", 1) > 1:  # this rank holds only its share of the heads
            raise ValueError("visionzip, fastervlm and vispruner under tensor parallelism need the whole vision tower "
                             "on every rank: start vLLM with mm_encoder_tp_mode='data' (--mm-encoder-tp-mode data)")
        x = layer.layer_norm1(self._feature_input[row][None])
        qkv, _ = attn.qkv_proj(x)
        h, d = attn.num_heads_per_partition, attn.head_dim
        q, k, _ = qkv.split(h * d, dim=-1)
        q = q.view(1, -1, h, d).transpose(1, 2)
        k = k.view(1, -1, h, d).transpose(1, 2)
        probs = torch.softmax((q @ k.transpose(-1, -2)).float() * attn.scale, dim=-1)
        received, keys = probs[0].mean(0).mean(0), k[0].mean(0)
        return pool_grid(received, self.tower_grid, self.frame_grid), pool_grid(keys, self.tower_grid, self.frame_grid)

    # ---- positions: kept tokens at their original positions -----------------------------------
    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """Positions of the unpruned sequence: each item's k slots start where its unpruned rows
        started (forward() moves each kept row to its own), and the text after it continues from
        the unpruned length; decode steps from the unpruned total."""
        n_tokens = len(input_tokens)
        pos = torch.empty(n_tokens, dtype=torch.long)
        shift, cursor = 0, 0
        for f in sorted(mm_features, key=lambda f: f.mm_position.offset):
            start, k = f.mm_position.offset, f.mm_position.length
            pos[cursor:start] = torch.arange(cursor, start) + shift
            pos[start:start + k] = torch.arange(start, start + k) + shift
            elem = f.data.get(FULL_KEY) if f.data is not None else None
            full = int(elem.data.reshape(-1)[0]) if elem is not None else k
            spec_elem = f.data.get(SPEC_KEY) if f.data is not None else None
            spec = spec_from(spec_elem.data if spec_elem is not None else None, spec_of(self.config))
            if not getattr(method_of(strip_quota(spec)), "renumber_positions", False):  # VisionZip official: the shorter sequence
                shift += max(0, full - k)
            cursor = start + k
        pos[cursor:] = torch.arange(cursor, n_tokens) + shift
        return pos[None].expand(3, -1).clone(), shift

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((n, w) for n, w in weights if not re.search(r"vision_tower\.(vision_model\.)?head\.", n))


def _item(value: Any, b: int) -> torch.Tensor | None:
    if value is None:
        return None
    return value[b] if isinstance(value, (list, tuple)) or value.dim() > 1 else value


def _scatter(feats: torch.Tensor, rows: torch.Tensor, red: Reduction, always: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [N] and rows [N, D] after a reduction over ``feats[rows]`` (wrap()'s scatter_reduction):
    the kept rows at their slots, replaced features written there, ``always`` rows kept too."""
    if red.sizes is not None:
        raise ValueError("this method merges tokens with sizes (proportional attention), which vLLM's attention "
                         "cannot weight; use a method that keeps or replaces tokens")
    idx = rows[red.indices.to(rows.device)]
    keep = always.clone()
    keep[idx] = True
    new = feats
    if red.features is not None:
        new = feats.clone()
        new[idx] = red.features.to(feats.dtype)
    return keep, new
