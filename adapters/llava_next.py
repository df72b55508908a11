"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): anyres tiles, image_newline, unpadding.

Each image's tokens (base tile, then the unpadded high-resolution grid with a newline token
ending every row) are one item without a rectangular grid: grid-aware methods (pool) fall
back to 1-D pooling along the sequence.
"""
from __future__ import annotations

from typing import Any

from vlm_prune.adapters.hf_vlm import HFVLMAdapter, Item


class LlavaNextAdapter(HFVLMAdapter):
    family = "llava_next"
    model_classes = ("LlavaNextForConditionalGeneration",)

    def items(self, modality: str, out: Any) -> list[Item]:
        return [Item(f, 1, None) for f in out.pooler_output]

    def check_methods(self) -> None:
        vit = self.state.methods.get("vit")
        if vit is not None:
            raise ValueError(
                f"method {vit.name!r} prunes inside the vision tower, which vlm_prune supports on LLaVA-1.5 "
                "(LlavaForConditionalGeneration) only: LLaVA-NeXT packs its anyres tiles after the tower "
                "(unpadding, a newline per row), so pruned tiles have no fixed place in the LLM input. Use a "
                "vision-stage method instead, e.g. wrap(model, 'divprune', keep=...)"
            )
        super().check_methods()
