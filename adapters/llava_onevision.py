"""LLaVA-OneVision / LLaVA-Video (``LlavaOnevisionForConditionalGeneration``): images and video.

Video: every frame's tower features are projected and bilinearly pooled to a
ceil(h/2) x ceil(w/2) grid (196 tokens at 384px); a video is T frames of that grid followed by
one newline token, which is always kept (and, like the image newlines, never counted as a visual
token nor pruned or merged inside the LLM). The frames stage (QuoTA, KeyScore, uniform) sees the
[T, n, D] frame maps; vision methods reduce each frame separately. QuoTA (v1/v2/v3/v5) also gets
each frame's unpooled 27 x 27 map, kept on the side by a patch of ``apply_pooling``, as the
official code resizes that map. Images (anyres with newline tokens) are items without a
rectangular grid; their image_newline rows are not visual tokens either (``not_visual_rows``):
vision methods see, count and budget an image's other tokens only, and the newlines always stay.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.base import PerThread
from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item, fit_grid, source_of
from vlm_prune.adapters.vision_towers import FeatureLayerTap, pool_grid
from vlm_prune.methods.base import FramesContext


class LlavaOnevisionAdapter(HFVLMAdapter):
    family = "llava_onevision"
    model_classes = ("LlavaOnevisionForConditionalGeneration",)
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features", "video": "get_video_features"}

    #: the image / video newline tokens are not visual tokens: in-LLM methods never prune or merge
    #: them (the official PACT code keeps them) and the stats do not count them
    newline_not_visual = True

    def frame_grid(self) -> tuple[int, int]:
        vc = self.model.config.vision_config
        side = math.ceil((vc.image_size // vc.patch_size) / 2)
        return side, side

    def items(self, modality: str, out: Any) -> list[Item]:
        if modality == "image":
            return [Item(f, 1, None) for f in out.pooler_output]
        rows, cols = self.frame_grid()
        n = rows * cols
        return [Item(v, (v.shape[0] - 1) // n, (rows, cols), tail=1) for v in out.pooler_output]

    def make_tap(self) -> FeatureLayerTap:
        cfg = self.model.config
        return FeatureLayerTap(
            self.inner.vision_tower, cfg.vision_feature_layer, cfg.vision_feature_select_strategy == "default"
        )

    def tower_attention_fn(self, out: Any, modality: str) -> Any:
        """Video frames only: the tower row of frame t of video i is i * T + t; its attention and
        keys are bilinearly pooled to the frame's token grid as the model pools the features.
        (Image tokens are anyres tiles with newlines: no per-token tower row.)"""
        rows = getattr(out, "vlm_prune_tower_input", None)
        videos = getattr(out, "vlm_prune_call", {}).get("pixel_values_videos")
        if self.tap is None or rows is None or modality != "video" or videos is None:
            return None
        frames = videos.shape[1]
        vc = self.model.config.vision_config
        side = vc.image_size // vc.patch_size

        def attention(item: int, frame: int) -> tuple[torch.Tensor, torch.Tensor]:
            received, keys = self.tap.attention_of(rows[source_of(out, item) * frames + frame])
            grid, out_grid = (side, side), self.frame_grid()
            return pool_grid(received, grid, out_grid), pool_grid(keys, grid, out_grid)

        return attention

    # ---- frames stage (QuoTA) ------------------------------------------------------------------
    #: the latest unpooled video maps of this thread, until annotate_output moves them onto the output
    _unpooled = PerThread()

    def attach(self) -> None:
        super().attach()
        frames = self.state.methods.get("frames")
        if getattr(frames, "wants_unpooled", False):
            pool = self.patches.original(self.inner, "apply_pooling")

            def apply_pooling(features: torch.Tensor) -> torch.Tensor:
                self._unpooled = features  # [frames, 27 * 27, D] projected, before the 2x bilinear pooling
                return pool(features)

            self.patches.set(self.inner, "apply_pooling", apply_pooling)

    def annotate_output(self, modality: str, out: Any) -> None:
        super().annotate_output(modality, out)
        if modality == "video" and self._unpooled is not None:
            out.vlm_prune_unpooled, self._unpooled = self._unpooled, None

    def unpooled_grid(self) -> tuple[int, int]:
        vc = self.model.config.vision_config
        side = vc.image_size // vc.patch_size
        return side, side

    def frames_context(self, method: Any, it: Item, index: int, sample: int) -> FramesContext:
        ctx = super().frames_context(method, it, index, sample)
        out = self.request.out
        videos = getattr(out, "vlm_prune_call", {}).get("pixel_values_videos")
        if videos is not None:
            ctx.pixels = videos[source_of(out, index)]
        unpooled = getattr(out, "vlm_prune_unpooled", None)
        if unpooled is not None:
            src = source_of(out, index)
            ctx.unpooled = unpooled[src * it.frames : (src + 1) * it.frames]
            ctx.unpooled_grid = self.unpooled_grid()
        if self.state.processor is not None:
            frames, newline = ctx.features, it.features[-it.tail:]
            ctx.score_frames = lambda prompts, tokens, grid=None: self.score_frames(frames, newline, prompts, tokens, grid)
        return ctx

    def score_frames(self, frames: torch.Tensor, newline: torch.Tensor, prompts: list[str], tokens: list[str],
                     grid: tuple[int, int] | None = None) -> torch.Tensor:
        """QuoTA's default scorer: the unpruned model on one-frame videos made of each frame's
        already computed tokens [T, n, D] (bilinearly resized to at most ``grid``) and the video
        newline, one prompt per frame (or one shared), all frames in one batch.
        Returns probabilities [T, len(tokens)] of ``tokens`` as the next token."""
        t = frames.shape[0]
        prompts = prompts * t if len(prompts) == 1 else prompts
        frames = fit_grid(frames, self.frame_grid(), grid)
        video = torch.cat([frames, newline[None].expand(t, -1, -1)], dim=1)
        ids, mask = self.chat_batch(prompts, "video", video.shape[1])
        return self.score_prompts(ids, mask, tokens, BaseModelOutputWithPooling(pooler_output=video))

