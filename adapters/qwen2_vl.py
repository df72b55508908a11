"""Qwen2-VL and Qwen2.5-VL: M-RoPE (3-D position ids), rope_deltas, images and video.

The vision tower merges 2 x 2 patches, so an image of grid (t, h, w) patches gives
(h/2) x (w/2) tokens per temporal slice; a video's frames pair up through the temporal patch
size, so a video item has t = frames / 2 slices. Kept tokens keep their original 3-D positions
(gathered by the engine), and decode positions come from generate(), which continues them
with the model's rope_deltas, i.e. from the unpruned length.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item, fit_grid, placeholder_mismatch, source_of
from vlm_prune.adapters.vision_towers import QwenTowerTap
from vlm_prune.engine import LMSpec, PositionRewrite, default_positions
from vlm_prune.methods.base import FramesContext


def _rope_positions(p: torch.Tensor) -> torch.Tensor:
    return p[1:] if p.shape[0] == 4 else p


def _layer_positions(p: torch.Tensor) -> torch.Tensor | None:
    return p[0] if p.shape[0] == 4 else None


def _qwen_positions(position_ids, b, s, past, device, segs):
    return default_positions(position_ids, b, s, past, device, segs, dims=3)


class Qwen2VLAdapter(HFVLMAdapter):
    family = "qwen2_vl"
    model_classes = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features", "video": "get_video_features"}
    #: M-RoPE: (t, h, w) positions, which a removal keeps (methods that renumber refuse)
    multi_axis_positions: ClassVar[bool] = True

    def lm_spec(self) -> LMSpec:
        spec = super().lm_spec()
        spec.rope_positions = _rope_positions
        spec.layer_position_ids = _layer_positions
        spec.default_positions = _qwen_positions
        return spec

    def check_generate_inputs(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        """Placeholders that do not match the grids: generate() builds M-RoPE positions from them before
        the model runs, and transformers fails there with a bare "shape mismatch" (Qwen3-VL, Qwen3.5,
        GLM-4.1V) or StopIteration; say what the model's own check says, with the counts, first."""
        if input_ids is None:
            return
        merge = self.model.config.vision_config.spatial_merge_size
        rows: dict[int, list[int]] = {}  # placeholder id -> tokens of each image / video using it (GLM: one id)
        for modality, tok in self.placeholder_ids().items():
            grid = kwargs.get(f"{modality}_grid_thw")
            if grid is not None:
                rows.setdefault(tok, []).extend(int(g) // merge**2 for g in grid.prod(-1).tolist())
        for modality, tok in self.placeholder_ids().items():
            tokens = int((input_ids == tok).sum())
            if tok in rows and tokens != sum(rows[tok]):
                raise ValueError(placeholder_mismatch(modality, tokens, rows[tok]))

    def items(self, modality: str, out: Any) -> list[Item]:
        key = "image_grid_thw" if modality == "image" else "video_grid_thw"
        grids = getattr(out, "vlm_prune_call", {}).get(key)
        if grids is None:
            raise ValueError(f"Qwen2-VL {modality} features need {key} in the model inputs (the processor returns it)")
        merge = self.model.config.vision_config.spatial_merge_size
        out_items = []
        grids = [grids[source_of(out, i)].tolist() for i in range(len(out.pooler_output))]
        for f, (t, h, w) in zip(out.pooler_output, grids):
            out_items.append(Item(f, int(t), (int(h) // merge, int(w) // merge)))
        return out_items

    def make_tap(self) -> QwenTowerTap | None:
        """A tap on the tower's last block, for the frames methods that rank a video's tokens by the
        tower's attention (FastVID, HoliTom); vision-stage methods get none (Qwen's tower has no CLS)."""
        if not getattr(self.state.methods.get("frames"), "wants_tower_attention", False):
            return None
        return QwenTowerTap(self.inner.visual)

    def tower_attention_fn(self, out: Any, modality: str) -> Any:
        """Video only: temporal slice ``frame`` of video ``item`` is the h x w patch rows after the
        earlier videos' and slices' in the tower's input; its salience and keys per merged token
        (:meth:`QwenTowerTap.slice_attention`), in the order of the slice's features."""
        saved = getattr(out, "vlm_prune_tower_input", None)
        grids = getattr(out, "vlm_prune_call", {}).get("video_grid_thw")
        if self.tap is None or saved is None or modality != "video" or grids is None:
            return None

        def attention(item: int, frame: int) -> tuple[torch.Tensor, torch.Tensor]:
            src = source_of(out, item)
            _, h, w = (int(x) for x in grids[src])
            start = int(grids[:src].prod(-1).sum()) + frame * h * w
            return self.tap.slice_attention(saved, start, (h, w))

        return attention

    def frames_planned(self, modality: str, it: Item, offset: int, plan: Any) -> None:
        """Resized frame maps (QuoTA) get M-RoPE positions of their resized grid: each token keeps
        its source slice's temporal position, and (row, col) in the new grid from the video's
        spatial origin (as get_rope_index lays out a video of that grid)."""
        if plan.token_coords is None:
            return
        flat = torch.nonzero(self.request.masks[modality])
        n_native = it.grid[0] * it.grid[1]
        coords = plan.token_coords.to(flat.device)
        rows = flat[offset + plan.reduction.indices.to(flat.device), 1]  # the slots the kept tokens fill
        frame_rows = flat[offset + coords[:, 0] * n_native, 1]
        self.request.pending.position_rewrites.append(
            PositionRewrite(int(flat[offset, 0]), rows, frame_rows, int(flat[offset, 1]), coords[:, 1:])
        )

    def frames_context(self, method: Any, it: Item, index: int, sample: int) -> FramesContext:
        ctx = super().frames_context(method, it, index, sample)
        ctx.pixels = video_pixels(self.request.out, index, self.model.config.vision_config)
        if self.state.processor is not None:
            frames = ctx.features
            ctx.score_frames = lambda prompts, tokens, grid=None: self.score_frames(frames, it.grid, prompts, tokens, grid)
        return ctx

    def score_frames(self, frames: torch.Tensor, grid: tuple[int, int], prompts: list[str], tokens: list[str],
                     limit: tuple[int, int] | None = None) -> torch.Tensor:
        """QuoTA's default scorer: the unpruned model on one-slice videos made of each temporal
        slice's already computed tokens [t, rows*cols, D] (bilinearly resized to at most
        ``limit``, with M-RoPE positions of that grid), one prompt per slice, all in one batch.
        Returns probabilities [t, len(tokens)] of ``tokens`` as the next token."""
        t = frames.shape[0]
        prompts = prompts * t if len(prompts) == 1 else prompts
        frames = fit_grid(frames, grid, limit)
        rows, cols = (min(g, lim) for g, lim in zip(grid, limit or grid))
        merge = self.model.config.vision_config.spatial_merge_size
        ids, mask = self.chat_batch(prompts, "video", rows * cols)
        device = self.model.device
        encoded = BaseModelOutputWithPooling(pooler_output=list(frames))
        saved = getattr(self.inner, "rope_deltas", None)  # the scorer must not leave its deltas to generate()
        try:
            return self.score_prompts(
                ids, mask, tokens, encoded,
                video_grid_thw=torch.tensor([[1, rows * merge, cols * merge]] * t, device=device),
                mm_token_type_ids=((ids == self.placeholder_ids()["video"]) * 2).int().to(device),
            )
        finally:
            self.inner.rope_deltas = saved

def unpatchify(patches: torch.Tensor, grid: tuple[int, int, int], vc: Any) -> torch.Tensor:
    """Frames [t, C, H, W] (the first frame of each temporal patch) from Qwen2-VL's flattened
    patches [t*h*w, C*tp*p*p], inverting the order its image processor flattens them in:
    (t, h/m, w/m, m, m, C, tp, p, p) from (t, tp, C, h/m, m, p, w/m, m, p)."""
    t, h, w = grid
    m, tp, p = vc.spatial_merge_size, vc.temporal_patch_size, vc.patch_size
    c = patches.shape[1] // (tp * p * p)
    x = patches.reshape(t, h // m, w // m, m, m, c, tp, p, p).permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
    return x.reshape(t, tp, c, h * p, w * p)[:, 0]


def video_pixels(out: Any, index: int, layout: Any) -> torch.Tensor | None:
    """Video ``index``'s frames as pixels [T, C, H, W], rebuilt from the patches its feature call got
    (``pixel_values_videos`` / ``video_grid_thw``; None when the call had none); ``layout`` gives
    ``spatial_merge_size``, ``patch_size`` and ``temporal_patch_size``."""
    call = getattr(out, "vlm_prune_call", {})
    patches, grids = call.get("pixel_values_videos"), call.get("video_grid_thw")
    if patches is None or grids is None:
        return None
    src = source_of(out, index)
    start = int(grids[:src].prod(-1).sum())
    t, h, w = (int(x) for x in grids[src])
    return unpatchify(patches[start : start + t * h * w], (t, h, w), layout)
