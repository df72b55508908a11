"""Qwen2-VL and Qwen2.5-VL served by vLLM with a vision-stage or frames method of vlm_prune.

The same three steps as the LLaVA-1.5 class (vlm_prune/vllm/llava.py, docs/design/vllm-plugin.md), on vLLM's own
Qwen classes:

1. Slots: each image gets ``method.n_keep(N)`` placeholders, N = its tokens after the 2 x 2 merger
   ((H / 28) x (W / 28) at Qwen's 14 px patches); a video gets that count per temporal slice (two
   frames), as ``wrap()`` budgets each slice of a Qwen video.
2. Choice: ``embed_multimodal`` runs vLLM's tower and merger, then the method object's
   ``reduce_image`` per image / slice with the VisionContext ``wrap()`` builds (the merged grid, a
   generator seeded ``seed * 1_000_003 + rank``, the question's input embeddings). The frames
   methods ``uniform`` / ``keyscore`` (vlm_prune/vllm/frames.py) keep whole slices of a video
   instead, chosen in the encoder from its [T, N, D] slices; images are then left alone.
3. Positions: Qwen's M-RoPE gives every visual token a (t, h, w) position; ``wrap()`` keeps each
   kept token's original one, the text after an item continues from the unpruned item's largest
   position + 1, and decoding from there. ``get_mrope_input_positions`` lays the prompt out that
   way with every slot of an item at the item's first position; the encoder sends each kept
   token's (t, h, w) offset from it in 9 extra embedding channels (three base-64 digits per axis),
   which ``embed_input_ids`` strips and ``forward`` adds to the positions of the same step.

VisionZip is refused: it reads the CLS attention of a CLIP-like tower's feature layer, which
Qwen's tower (no CLS token, window attention in 2.5) does not have; ``wrap()`` refuses it too.
QuoTA runs per request as two passes (frames.quota_request), per temporal slice as wrap() runs it on
Qwen: pass 1 sends each slice (its two frames) as a one-slice video whose merged map the encoder fits
into ``score_grid`` (bilinear, fit_grid) at the M-RoPE positions of that grid; pass 2's plan resizes
each slice's map to its share and the kept tokens fill the video's first slots at (t of their
slice, row and column in the resized grid from the video's origin), as wrap()'s PositionRewrite.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.model_executor.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.multimodal.processing import PromptReplacement, PromptUpdate

from vlm_prune.adapters.qwen2_vl import unpatchify
from vlm_prune.methods.base import Method, VisionContext, item_generator
from vlm_prune.vllm.config import refusal
from vlm_prune.vllm.frames import (
    QUOTA_REFUSAL,
    frames_plan,
    is_frames,
    quota_phase,
    strip_quota,
)
from vlm_prune.vllm.llava import (
    QUERY_KEY,
    RANK_KEY,
    SPEC_KEY,
    OffsetChannels,
    PrunedLlavaMultiModalProcessor,
    decode_offsets,
    dry_run_slots,
    encode_offsets,
    method_of,
    spec_from,
    spec_of,
    tag_items,
)
from vlm_prune.vllm.safety import dry_run_image, dry_run_video, engine_dims

#: extra embedding channels: three base-64 digits for each of the t, h, w position offsets
OFFSET_CHANNELS = 9


def encode_positions(offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[3, k] non-negative (t, h, w) offsets -> [k, 9] channels."""
    return torch.cat([encode_offsets(offsets[a], dtype) for a in range(3)], dim=1)


def decode_positions(channels: torch.Tensor) -> torch.Tensor:
    """[k, 9] channels -> [3, k] offsets."""
    return torch.stack([decode_offsets(channels[:, 3 * a : 3 * a + 3]) for a in range(3)])


def _without_spec(kwargs: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in kwargs.items() if k != "vlm_prune"}


def _check(method: Method, arch: str) -> Method:
    reason = refusal(arch, method.name)
    if method.name == "quota" and reason == QUOTA_REFUSAL:  # per request (quota_request); frames_slots refuses
        return method                                       # a request without scores
    if reason:
        raise ValueError(reason)
    return method


class _PrunedInfo:
    """Processing info: the request's method; the spec never reaches Hugging Face's processor."""

    def method(self, mm_kwargs: Mapping[str, object] | None = None) -> Method:
        cfg = self.get_hf_config()
        return _check(method_of(strip_quota(spec_of(cfg, mm_kwargs))), cfg.architectures[0])

    def slots(self, mm_kwargs: Mapping[str, object] | None, n: int, grid: tuple[int, int] | None) -> int:
        """An image's slots of its ``n`` tokens on ``grid``, dry-run (llava.dry_run_slots) after the family's refusals."""
        self.method(mm_kwargs)
        return dry_run_slots(self, mm_kwargs, n, grid)

    def get_hf_processor(self, **kwargs: object) -> Any:
        return super().get_hf_processor(**_without_spec(kwargs))

    def get_image_processor(self, **kwargs: object) -> Any:
        return super().get_image_processor(**_without_spec(kwargs))


class _PrunedProcessor:
    """Qwen's processor with ``method.n_keep`` slots per image / temporal slice, plus each item's
    question ids, rank within its prompt and spec (encoder kwargs and, where the method reads
    them, part of its cache key), as for LLaVA."""

    _template_suffix = PrunedLlavaMultiModalProcessor._template_suffix

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, _without_spec(hf_kwargs))

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
                            ) -> Sequence[PromptUpdate]:
        method = self.info.method(hf_processor_mm_kwargs)
        spec = spec_of(self.info.get_hf_config(), hf_processor_mm_kwargs)
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        updates = super()._get_prompt_updates(mm_items, _without_spec(hf_processor_mm_kwargs), out_mm_kwargs)

        def pruned(item_idx: int, modality: str, full: Any) -> Any:
            t, h, w = (int(x) for x in out_mm_kwargs[modality][item_idx][f"{modality}_grid_thw"].data)
            return self._slots(modality, full(item_idx), t, (h // merge, w // merge), method, spec)

        return [PromptReplacement(modality=u.modality, target=u.target,
                                  replacement=partial(pruned, modality=u.modality, full=u.replacement))
                for u in updates]

    def _slots(self, modality: str, ids: Any, t: int, grid: tuple[int, int], method: Method,
               spec: dict[str, Any]) -> Any:
        """An item's replacement: its unpruned placeholder ids ``ids`` (t slices of a rows x cols
        ``grid``) cut to the method's slots."""
        if is_frames(method):  # a frames method keeps whole slices of a video, leaves images alone
            if modality == "image":
                return ids
            if quota_phase(spec) == "score":  # QuoTA's pass 1: each slice's map fitted into score_grid
                return ids[:1] * (t * _score_rows(grid, spec))
            return ids[:1] * dry_run_video(spec, t, len(ids) // t, grid, **engine_dims(self.info))
        return ids[:1] * (t * dry_run_image(spec, len(ids) // t, grid, **engine_dims(self.info)))

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        spec = spec_of(self.info.get_hf_config(), inputs.hf_processor_mm_kwargs)
        method = self.info.method(inputs.hf_processor_mm_kwargs)
        return tag_items(super().apply(inputs, timing_ctx), spec, method, self._template_suffix())


def _score_grid(grid: tuple[int, int], spec: dict[str, Any]) -> tuple[int, int]:
    """A QuoTA scoring request's map: the slice's merged grid fitted into the spec's score grid."""
    limit = spec["quota"].get("grid") or grid
    return min(grid[0], limit[0]), min(grid[1], limit[1])


def _score_rows(grid: tuple[int, int], spec: dict[str, Any]) -> int:
    rows, cols = _score_grid(grid, spec)
    return rows * cols


def _item(value: Any, b: int) -> torch.Tensor | None:
    if value is None:
        return None
    return value[b] if isinstance(value, (list, tuple)) or value.dim() > 1 else value


class _PrunedQwen(OffsetChannels):
    """The model side: the method fills the slots, kept tokens keep their (t, h, w) positions."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        mm = vllm_config.model_config.get_multimodal_config()
        if getattr(mm, "video_pruning_rate", None):
            raise ValueError("vlm_prune.vllm prunes with its own method: leave vLLM's --video-pruning-rate (EVS) unset")
        if getattr(vllm_config.compilation_config, "cudagraph_mm_encoder", False):
            raise ValueError("vlm_prune.vllm runs the method after the vision tower, which vLLM's encoder CUDA graphs "
                             "skip: turn off compilation_config.cudagraph_mm_encoder")
        _check(method_of(spec_of(self.config)), self.config.architectures[0])
        #: the latest (normed input, rotary cos, rotary sin) of the attention of the tower's last block (FastVID /
        #: HoliTom's salience); the hook sits on the attention: Qwen2.5-VL's blocks may be compiled, which skips
        #: a block's own hooks
        self._last_block_input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.visual.blocks[-1].attn.register_forward_pre_hook(self._keep_last_block_input, with_kwargs=True)

    def _keep_last_block_input(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("x")
        if x is not None:
            self._last_block_input = (x.detach(), kwargs.get("rotary_pos_emb_cos"), kwargs.get("rotary_pos_emb_sin"))

    def _slice_attention(self, start: int, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """FastVID's Qwen salience of one temporal slice (as wrap()'s QwenTowerTap): its h x w patches
        are rows ``start`` .. ``start + h w`` of the last block's (normed) attention input of the latest tower call."""
        from vlm_prune.adapters.vision_towers import qwen_slice_salience

        attn, vc = self.visual.blocks[-1].attn, self.config.vision_config
        if getattr(attn, "tp_size", 1) > 1 or getattr(self, "use_data_parallel", False):
            raise ValueError("fastvid and holitom read the attention of Qwen's whole vision tower for each video: run "
                             "the tower on one rank (tensor_parallel_size=1, mm_encoder_tp_mode left at 'weights')")
        x, cos, sin = self._last_block_input
        n = grid[0] * grid[1]
        heads, d = attn.num_attention_heads_per_partition, attn.hidden_size_per_attention_head
        with torch.no_grad():
            qkv, _ = attn.qkv(x[start : start + n])
            q, k, _ = qkv.reshape(n, 3, heads, d).unbind(1)
            q, k = attn.apply_rotary_emb(torch.stack([q, k]), cos[start : start + n], sin[start : start + n]).unbind(0)
        window = getattr(vc, "window_size", None)  # Qwen2.5-VL's attention windows order the tower's rows
        side = None if window is None else window // vc.spatial_merge_size // vc.patch_size
        return qwen_slice_salience(q, k, grid, vc.spatial_merge_size, side)

    # ---- encoder: the method picks what fills the slots -------------------------------------
    def embed_multimodal(self, **kwargs: object) -> Any:
        query, rank, spec = kwargs.pop(QUERY_KEY, None), kwargs.pop(RANK_KEY, None), kwargs.pop(SPEC_KEY, None)
        if kwargs.get("image_embeds") is not None or kwargs.get("video_embeds") is not None:
            raise ValueError("vlm_prune.vllm prunes images and videos given as pixels; embeddings inputs are not supported")
        video = kwargs.get("pixel_values_videos") is not None
        if video and kwargs.get("pixel_values") is not None:
            raise RuntimeError("vlm_prune: one encoder call with images and videos (vLLM groups them by modality)")
        grids = kwargs.get("video_grid_thw" if video else "image_grid_thw")
        seconds = kwargs.get("second_per_grid_ts") if video else None
        patches = kwargs.get("pixel_values_videos") if video else None
        items = super().embed_multimodal(**kwargs)
        if not items:
            return items
        grids = torch.as_tensor(grids).reshape(-1, 3) if not isinstance(grids, (list, tuple)) else torch.stack(
            [torch.as_tensor(g).reshape(3) for g in grids])
        out, start = [], 0
        rows = [0, *torch.cumsum(grids.prod(-1), 0).tolist()]  # each item's first row in the tower's input
        for b, feats in enumerate(items):
            pixels = None
            if patches is not None and not isinstance(patches, (list, tuple)):  # the frames for KeyScore's proposals
                n_patches = int(grids[b].prod())
                pixels = unpatchify(patches[start : start + n_patches], tuple(int(x) for x in grids[b]),
                                    self.config.vision_config)
                start += n_patches
            t_factor = 1.0
            if video:
                s = _item(seconds, b)
                per_second = getattr(self.config.vision_config, "tokens_per_second", 1.0)
                t_factor = (float(s.reshape(-1)[0]) if s is not None else 1.0) * per_second
            raw = _item(spec, b)
            item_spec = spec_from(raw, spec_of(self.config))
            out.append(self._reduce(b, feats, [int(x) for x in grids[b]], t_factor, item_spec,
                                    _item(query, b), _item(rank, b), video, pixels, int(rows[b])))
        return out

    def _reduce(self, b: int, features: torch.Tensor, grid: list[int], t_factor: float, spec: dict[str, Any],
                query: torch.Tensor | None, rank: torch.Tensor | None, video: bool = False,
                pixels: torch.Tensor | None = None, tower_row: int = 0) -> torch.Tensor:
        """One image / video: the vision method on each temporal slice, or the frames method on the
        video's [T, N, D] slices (as wrap() on Qwen), the kept features followed by their (t, h, w)
        offsets from the item's first position. ``tower_row``: the item's first patch row in the
        tower's input (FastVID / HoliTom's salience per slice)."""
        m = self.config.vision_config.spatial_merge_size
        t, rows, cols = grid[0], grid[1] // m, grid[2] // m
        n = rows * cols
        method = _check(method_of(strip_quota(spec)), self.config.architectures[0])
        seed = int(spec.get("seed", 0))
        gen = item_generator(seed, int(rank.reshape(-1)[0]) if rank is not None else 0)
        text = None
        if query is not None:
            text = self.language_model.model.embed_tokens(query.reshape(-1).to(features.device).long())
        kept, index = [], []
        if video and is_frames(method) and quota_phase(spec) == "score":  # QuoTA's pass 1 (as wrap()'s scorer)
            from vlm_prune.adapters.hf_vlm import fit_grid

            r, c = _score_grid((rows, cols), spec)
            maps = fit_grid(features.reshape(t, n, -1), (rows, cols), (r, c)).reshape(t * r * c, -1)
            k = torch.arange(t * r * c)
            t_pos = k // (r * c)
            if t_factor != 1.0:
                t_pos = (t_pos.double() * t_factor).long()
            offsets = torch.stack([t_pos, (k % (r * c)) // c, k % c])
            return torch.cat([maps.to(features.dtype), encode_positions(offsets, features.dtype)], dim=1)
        if is_frames(method):  # whole slices of a video (images untouched, as wrap(frames=...))
            idx, feats = torch.arange(t * n, device=features.device), features
            if video:
                tower = None
                if getattr(method, "wants_tower_attention", False):  # FastVID, HoliTom: the tower's salience per slice
                    h, w = grid[1], grid[2]
                    tower = (lambda f: self._slice_attention(tower_row + f * h * w, (h, w)))
                plan = frames_plan(method, self._scored(features).reshape(t, n, -1), (rows, cols), text_features=text,
                                   pixels=pixels, spec=spec, tower_attention=tower)
                red = plan.reduction
                idx = red.indices.to(features.device)
                feats = features[idx] if red.features is None else red.features.to(features.dtype)
                if plan.token_coords is not None:  # QuoTA's resized maps: (slice, row, col) in the new grid
                    coords = plan.token_coords.cpu()
                    t_pos = coords[:, 0]
                    if t_factor != 1.0:
                        t_pos = (t_pos.double() * t_factor).long()
                    offsets = torch.stack([t_pos, coords[:, 1], coords[:, 2]])
                    return torch.cat([feats, encode_positions(offsets, features.dtype).to(feats.device)], dim=1)
            order = torch.argsort(idx)
            kept.append(feats[order])
            index.append(idx[order])
        with torch.no_grad():
            for s in range(0 if is_frames(method) else t):
                frame = features[s * n : (s + 1) * n]
                ctx = VisionContext(features=self._scored(frame), n_keep=method.n_keep(n, 1), grid=(rows, cols),
                                    text_embeds=text, generator=gen, image_index=b)
                state = gen.get_state()
                red = method.reduce_image(ctx)
                if red.sizes is not None:
                    raise ValueError(f"method {method.name!r} merges tokens with sizes (proportional attention), which "
                                     "vLLM's attention cannot weight; use a method that keeps or replaces tokens")
                idx = red.indices.to(features.device)
                feats = frame[idx] if red.features is None else self._rewritten(method, frame, ctx, red, state)
                order = torch.argsort(idx)
                kept.append(feats[order])
                index.append(idx[order] + s * n)
        idx = torch.cat(index)
        t_pos = idx // n
        if video and self.slice_origins:  # every slice at its own origin (Qwen3-VL: its timestamp before it)
            t_pos = torch.zeros_like(t_pos)
        elif t_factor != 1.0:  # Qwen2.5-VL videos: a slice's position is its time in tokens_per_second units
            t_pos = (t_pos.double() * t_factor).long()
        offsets = torch.stack([t_pos, (idx % n) // cols, idx % cols])
        return torch.cat([torch.cat(kept), encode_positions(offsets, features.dtype)], dim=1)

    #: each temporal slice of a video has its own M-RoPE origin (the slots' positions start there)
    slice_origins = False

    def _scored(self, features: torch.Tensor) -> torch.Tensor:
        """The channels of an item's encoder output that the method reads (all of them here)."""
        return features

    def _rewritten(self, method: Method, frame: torch.Tensor, ctx: VisionContext, red: Any,
                   state: torch.Tensor) -> torch.Tensor:
        """The features of a frame that ``red`` rewrote (pool's averages), all channels."""
        return red.features.to(frame.dtype)

    # ---- positions: kept tokens at their original (t, h, w) positions -----------------------
    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
                                  ) -> tuple[torch.Tensor, int]:
        """The unpruned prompt's positions: text as Qwen lays it out, every slot of an item at the
        item's first position (forward() adds each kept token's offset), the text after an item
        from the unpruned item's largest position + 1; decoding continues from there."""
        n_tokens = len(input_tokens)
        pos = torch.empty(3, n_tokens, dtype=torch.long)
        features = sorted(mm_features, key=lambda f: f.mm_position.offset)
        cursor, nxt = 0, 0
        for f, (offset, t, h, w, t_factor) in zip(features, self.iter_mm_grid_thw(features)):
            raw = f.data.get(SPEC_KEY) if f.data is not None else None
            if raw is not None and f.modality == "video":
                spec = spec_from(raw.data, {})
                if quota_phase(spec) == "score":  # a QuoTA scoring request: a video of the fitted grid
                    h, w = _score_grid((h, w), spec)
            pos[:, cursor:offset] = torch.arange(offset - cursor) + nxt
            base = nxt + offset - cursor
            k = f.mm_position.length
            pos[:, offset : offset + k] = base
            t_last = int((t - 1) * t_factor) if t_factor != 1.0 else t - 1
            nxt = base + max(t_last, h - 1, w - 1) + 1
            cursor = offset + k
        pos[:, cursor:] = torch.arange(n_tokens - cursor) + nxt
        return pos, nxt + (n_tokens - cursor) - n_tokens

    # ---- positions: (t, h, w) offsets through OffsetChannels ------------------------------------
    offset_channels = OFFSET_CHANNELS

    def decode_channels(self, channels: torch.Tensor) -> torch.Tensor:
        return decode_positions(channels)

    def report_positions(self, positions: torch.Tensor, rows: torch.Tensor) -> list:
        """[3][k] (t, h, w) positions of the visual rows."""
        return positions[:, rows].tolist()


class PrunedQwen2VLProcessingInfo(_PrunedInfo, Qwen2VLProcessingInfo):
    pass


class PrunedQwen2VLMultiModalProcessor(_PrunedProcessor, Qwen2VLMultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(
    PrunedQwen2VLMultiModalProcessor, info=PrunedQwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class VlmPruneQwen2VLForConditionalGeneration(_PrunedQwen, Qwen2VLForConditionalGeneration):
    """vLLM's Qwen2-VL with a vlm_prune method (random, pool, divprune, cdpruner; video: uniform, keyscore, vidcom2,
    fastvid, holitom, dycoke, quota)."""


class PrunedQwen2_5_VLProcessingInfo(_PrunedInfo, Qwen2_5_VLProcessingInfo):
    pass


class PrunedQwen2_5_VLMultiModalProcessor(_PrunedProcessor, Qwen2_5_VLMultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(
    PrunedQwen2_5_VLMultiModalProcessor, info=PrunedQwen2_5_VLProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class VlmPruneQwen2_5_VLForConditionalGeneration(_PrunedQwen, Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL with a vlm_prune method (random, pool, divprune, cdpruner; video: uniform, keyscore,
    vidcom2, fastvid, holitom, dycoke, quota)."""
