"""LLaVA-OneVision / LLaVA-Video (``LlavaOnevisionForConditionalGeneration``): images and video.

Video: every frame's tower features are projected and bilinearly pooled to a
ceil(h/2) x ceil(w/2) grid (196 tokens at 384px); a video is T frames of that grid followed by
one newline token, which is always kept. The frames stage (QuoTA, KeyScore, uniform) sees the
[T, n, D] frame maps; vision methods reduce each frame separately. Images (anyres with newline
tokens) are items without a rectangular grid.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item
from vlm_prune.adapters.vision_towers import FeatureLayerTap, pool_grid
from vlm_prune.methods.base import FramesContext


class LlavaOnevisionAdapter(HFVLMAdapter):
    family = "llava_onevision"
    model_classes = ("LlavaOnevisionForConditionalGeneration",)
    stages: ClassVar[tuple[str, ...]] = ("frames", "vision", "llm")
    feature_functions: ClassVar[dict[str, str]] = {"image": "get_image_features", "video": "get_video_features"}

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
            received, keys = self.tap.attention_of(rows[item * frames + frame])
            grid, out_grid = (side, side), self.frame_grid()
            return pool_grid(received, grid, out_grid), pool_grid(keys, grid, out_grid)

        return attention

    def frames_context(self, method: Any, it: Item, index: int, sample: int) -> FramesContext:
        ctx = super().frames_context(method, it, index, sample)
        videos = getattr(self.request.out, "vlm_prune_call", {}).get("pixel_values_videos")
        if videos is not None:
            ctx.pixels = videos[index]
            if self.state.processor is not None:
                ctx.score_frames = lambda prompts, px=videos[index]: self.score_frames(px, prompts)
        return ctx

    def score_frames(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """QuoTA's default scorer: the model itself, one frame per prompt, P("A") of the answer.

        pixels: [T, C, H, W] one video's frames as the processor prepared them. prompts: one
        for every frame, or one shared by all. Returns p [T] (float32, CPU).
        """
        t = pixels.shape[0]
        prompts = prompts * t if len(prompts) == 1 else prompts
        rows, cols = self.frame_grid()
        ids, mask = self.chat_batch(prompts, "video", rows * cols + 1)
        letter = self.answer_letter_id("A")
        device = self.model.device
        with self.unpruned(), torch.no_grad():
            logits = self.model(
                input_ids=ids.to(device), attention_mask=mask.to(device), pixel_values_videos=pixels[:, None].to(device)
            ).logits[:, -1]
        return torch.softmax(logits.float(), dim=-1)[:, letter].cpu()
