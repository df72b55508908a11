"""GLM-4.1V / GLM-4.5V / GLM-4.6V: Qwen2-VL's layout (M-RoPE 3-D positions, rope_deltas, 2 x 2
merged patches) with GLM's own quirks.

- Video frames use the IMAGE placeholder id: every temporal slice is ``<|begin_of_image|>`` +
  image placeholders + ``<|end_of_image|>`` + its timestamp text, inside ``<|begin_of_video|>`` ...
  ``<|end_of_video|>``; only ``mm_token_type_ids`` (1 image, 2 video) tells a video's slots from an
  image's, as transformers' ``Glm4vModel.get_placeholder_mask`` and ``get_rope_index`` do. The
  adapter splits the placeholder rows the same way (without ``mm_token_type_ids``: by which pixels the
  call carries). Kept tokens keep their 3-D positions; each slice's positions start after the text
  before it.
- Partial rotary (half of each head) on M-RoPE's axes: the engine applies the language model's own
  ``apply_rotary_pos_emb`` wherever a method needs rotated keys.
- QuoTA is refused for the reason given on Qwen3-VL (per-slice runs behind timestamps).

transformers 5.25's own beam search / ``num_return_sequences`` on GLM video fails before any
pruning (``_expand_multimodal_outputs`` counts ``video_token_id`` placeholders, which GLM's
processor never writes; the unwrapped model raises a bare ``torch.cat()`` error): the wrapped
model's generate() refuses those calls first, with that reason.

Read side by side with transformers 5.25 ``models/glm4v/modeling_glm4v.py`` and
``processing_glm4v.py`` (``replace_frame_token_id``).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.hf_vlm import Request, placeholder_runs
from vlm_prune.adapters.qwen2_vl import Qwen2VLAdapter


class Glm4vAdapter(Qwen2VLAdapter):
    family = "glm4v"
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]
    model_classes: ClassVar[tuple[str, ...]] = (
        "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration", "Glm46VForConditionalGeneration")

    def placeholder_ids(self) -> dict[str, int]:
        tok = self.model.config.image_token_id
        return {"image": tok, "video": tok}  # GLM's video frames hold image placeholders

    def check_generate_inputs(self, input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        config = kwargs.get("generation_config") or self.model.generation_config
        copies = max(kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1,
                     kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1)
        if copies > 1 and (kwargs.get("pixel_values_videos") is not None or kwargs.get("video_grid_thw") is not None):
            raise ValueError(
                "transformers cannot expand GLM video inputs for num_beams > 1 or num_return_sequences > 1 (it counts "
                "video placeholders GLM's processor never writes; the unwrapped model fails there too): generate with "
                "num_beams=1 and num_return_sequences=1, or repeat the inputs in the batch, one row per answer")
        super().check_generate_inputs(input_ids, kwargs)

    def new_request(self, args: tuple, kwargs: dict[str, Any]) -> Request | None:
        request = super().new_request(args, kwargs)
        if request is None:
            return None
        slots = request.masks["image"]
        types = kwargs.get("mm_token_type_ids")
        if types is not None:
            # the prompt's types; rows generated after it (use_cache=False, draft tokens) are text, and after a
            # cached prefix only the last columns are this call's
            s = slots.shape[1]
            types = torch.nn.functional.pad(types, (0, max(0, s - types.shape[1])))[:, -s:]
            video = slots & (types.to(slots.device) == 2)
        else:
            encoded = kwargs.get("mm_encoder_outputs") or {}
            with_video = kwargs.get("pixel_values_videos") is not None or encoded.get("video") is not None
            with_image = kwargs.get("pixel_values") is not None or encoded.get("image") is not None
            video = slots if with_video and not with_image else slots & False
        request.masks = {"image": slots & ~video, "video": video}
        request.counts = {m: placeholder_runs(mask) for m, mask in request.masks.items()}
        request.pending.images_per_sample = [sum(c) for c in zip(*request.counts.values())]
        return request
