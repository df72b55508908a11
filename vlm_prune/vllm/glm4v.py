"""GLM-4.1V and GLM-4.5V served by vLLM with a vision-stage or frames method of vlm_prune.

The Qwen3-VL plugin's machinery (vlm_prune/vllm/qwen3_vl.py on qwen2_vl.py: slots, the method in
``embed_multimodal``, kept tokens at their original M-RoPE positions through offset channels, a
video's slots per temporal slice at the slice's own origin) on vLLM's own GLM-4.1V class, with
GLM's layout read in vLLM 0.32's ``model_executor/models/glm4_1v.py`` and transformers'
``models/glm4v`` (``Glm4vProcessor.replace_frame_token_id``, ``Glm4vModel.get_rope_index``),
as ``wrap()`` handles it (``adapters/glm4v.py``):

- **Video slices hold image placeholders.** A video is written as ``<|begin_of_video|>`` and, per
  temporal slice, ``<|begin_of_image|>`` + the slice's ``<|image|>`` tokens + ``<|end_of_image|>`` +
  its whole second as text, then ``<|end_of_video|>``. So each slice's run of the image token gets
  the method's slots of that slice (uniform / dycoke: the slices their plan keeps, which follow from
  the budget alone); a dropped slice's start / end tokens and timestamp stay, as in ``wrap()``.
- **Positions.** Every image and every slice of a video starts at the position after the text
  before it (the slice's grid at t = 0), the text after it from that position + max(rows, cols),
  which is Qwen3-VL's layout with the image start / end tokens around each slice.
- **No DeepStack**: the method reads and keeps the merger's features as they are.
- Refused as on Qwen3-VL (config.REFUSALS): the tower-attention methods (GLM's tower has no CLS
  token), keyscore and vidcom2 (their per-slice counts come from features, after the processor wrote
  each slice's run), quota (as ``wrap()`` refuses it on GLM).

GLM-4.5V (``Glm4vMoeForConditionalGeneration``) is the same model side on vLLM's GLM-4.5V class: its MoE
language model routes each kept token as it comes.
"""
from __future__ import annotations

from vllm.model_executor.models.glm4_1v import (
    Glm4vDummyInputsBuilder,
    Glm4vForConditionalGeneration,
    Glm4vMoeForConditionalGeneration,
    Glm4vMultiModalProcessor,
    Glm4vProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vlm_prune.vllm.qwen2_vl import _PrunedInfo
from vlm_prune.vllm.qwen3_vl import _SlicedProcessor, _SlicedVideo


class PrunedGlm4vProcessingInfo(_PrunedInfo, Glm4vProcessingInfo):
    pass


class PrunedGlm4vMultiModalProcessor(_SlicedProcessor, Glm4vMultiModalProcessor):
    """GLM-4.1V's processor with the method's slots: per image, per temporal slice of a video inside the
    slice's ``<|begin_of_image|>`` ... ``<|end_of_image|>`` (GLM writes video slices with the image token)."""

    def slice_token(self) -> int:
        return self.info.get_hf_config().image_token_id


class _PrunedGlm4v(_SlicedVideo):
    """GLM's model side: a video slice's run lies between ``<|begin_of_image|>`` and ``<|end_of_image|>``."""

    def slice_bounds(self) -> tuple[int, int]:
        return self.config.image_start_token_id, self.config.image_end_token_id


@MULTIMODAL_REGISTRY.register_processor(
    PrunedGlm4vMultiModalProcessor, info=PrunedGlm4vProcessingInfo, dummy_inputs=Glm4vDummyInputsBuilder
)
class VlmPruneGlm4vForConditionalGeneration(_PrunedGlm4v, Glm4vForConditionalGeneration):
    """vLLM's GLM-4.1V with a vlm_prune method (random, pool, divprune, cdpruner; video: uniform, dycoke)."""


@MULTIMODAL_REGISTRY.register_processor(
    PrunedGlm4vMultiModalProcessor, info=PrunedGlm4vProcessingInfo, dummy_inputs=Glm4vDummyInputsBuilder
)
class VlmPruneGlm4vMoeForConditionalGeneration(_PrunedGlm4v, Glm4vMoeForConditionalGeneration):
    """vLLM's GLM-4.5V (GLM-4.1V's layout on an MoE language model) with a vlm_prune method, as GLM-4.1V."""
