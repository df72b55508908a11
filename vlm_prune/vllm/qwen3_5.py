"""Qwen3.5 and Qwen3.5-MoE served by vLLM with a vision-stage or frames method of vlm_prune.

vLLM 0.32's Qwen3.5 class (``model_executor/models/qwen3_5.py``) is its Qwen3-VL class with another
language model: Qwen3-VL's tower (no DeepStack here), processor (``Qwen3VLMultiModalProcessor``:
timestamps before each temporal slice of a video) and M-RoPE layout, on a decoder that alternates
Gated DeltaNet (linear attention: a recurrent state and a short causal convolution, vLLM's mamba
cache) and full-attention layers. So the Qwen3-VL plugin (vlm_prune/vllm/qwen3_vl.py) serves it as
it is: the pruned rows never reach the language model, the recurrent states only ever see the kept
rows, exactly as ``wrap()``'s vision / frames stages on Qwen3.5 (``adapters/qwen3_5.py``), whose
in-LLM methods vLLM refuses anyway. Refused as on Qwen3-VL, under Qwen3.5's name (config.REFUSALS).

vLLM tunes a Qwen3.5 engine's config by its architecture name (``MODELS_CONFIG_MAP``: the recurrent
state's dtype from the checkpoint's ``mamba_ssm_dtype``); the plugin's class gets the same hook.
"""
from __future__ import annotations

from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeProcessingInfo,
    Qwen3_5ProcessingInfo,
)
from vllm.model_executor.models.qwen3_vl import Qwen3VLDummyInputsBuilder
from vllm.multimodal import MULTIMODAL_REGISTRY

from vlm_prune.vllm.qwen2_vl import _PrunedInfo
from vlm_prune.vllm.qwen3_vl import PrunedQwen3VLMultiModalProcessor, _PrunedQwen3


class PrunedQwen3_5ProcessingInfo(_PrunedInfo, Qwen3_5ProcessingInfo):
    pass


@MULTIMODAL_REGISTRY.register_processor(
    PrunedQwen3VLMultiModalProcessor, info=PrunedQwen3_5ProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VlmPruneQwen3_5ForConditionalGeneration(_PrunedQwen3, Qwen3_5ForConditionalGeneration):
    """vLLM's Qwen3.5 with a vlm_prune method (random, pool, divprune, cdpruner; video: uniform, dycoke)."""


class PrunedQwen3_5MoeProcessingInfo(_PrunedInfo, Qwen3_5MoeProcessingInfo):
    pass


@MULTIMODAL_REGISTRY.register_processor(
    PrunedQwen3VLMultiModalProcessor, info=PrunedQwen3_5MoeProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class VlmPruneQwen3_5MoeForConditionalGeneration(_PrunedQwen3, Qwen3_5MoeForConditionalGeneration):
    """vLLM's Qwen3.5-MoE with a vlm_prune method (as Qwen3.5; the experts route each kept token as it comes)."""


for _served, _own in ((VlmPruneQwen3_5ForConditionalGeneration, "Qwen3_5ForConditionalGeneration"),
                      (VlmPruneQwen3_5MoeForConditionalGeneration, "Qwen3_5MoeForConditionalGeneration")):
    MODELS_CONFIG_MAP.setdefault(_served.__name__, MODELS_CONFIG_MAP[_own])
