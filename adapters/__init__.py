"""Model adapters: each knows one model family's layout and patches the instance.

``find_adapter(model)`` picks the adapter for a model object or raises a TypeError that names
every supported class. Adapter modules are imported only when a model of theirs is wrapped,
so optional dependencies (timm) stay optional and cheap.
"""
from __future__ import annotations

if __name__ != "vlm_prune.adapters":  # imported as the bare `adapters` from the checkout root: see vlm_prune/_bare_names.py
    from vlm_prune._bare_names import hand_over

    hand_over(__name__, __file__)

import importlib
from typing import Any

# model class name -> (adapter module, adapter class, its family)
SUPPORTED = {
    "LlavaForConditionalGeneration": ("vlm_prune.adapters.llava", "LlavaAdapter", "llava"),
    "LlavaNextForConditionalGeneration": ("vlm_prune.adapters.llava_next", "LlavaNextAdapter", "llava_next"),
    "LlavaOnevisionForConditionalGeneration": ("vlm_prune.adapters.llava_onevision", "LlavaOnevisionAdapter",
                                               "llava_onevision"),
    "Qwen2VLForConditionalGeneration": ("vlm_prune.adapters.qwen2_vl", "Qwen2VLAdapter", "qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": ("vlm_prune.adapters.qwen2_vl", "Qwen2VLAdapter", "qwen2_vl"),
    "Mistral3ForConditionalGeneration": ("vlm_prune.adapters.mistral3", "Mistral3Adapter", "mistral3"),
    "Gemma3ForConditionalGeneration": ("vlm_prune.adapters.gemma3", "Gemma3Adapter", "gemma3"),
    "InternVLForConditionalGeneration": ("vlm_prune.adapters.internvl", "InternVLAdapter", "internvl"),
    "LlavaNextVideoForConditionalGeneration": ("vlm_prune.adapters.llava_next_video", "LlavaNextVideoAdapter",
                                               "llava_next_video"),
    "LlavaOnevision15ForConditionalGeneration": ("vlm_prune.adapters.llava_onevision15", "LlavaOnevision15Adapter",
                                                 "llava_onevision15"),
    "Qwen3VLForConditionalGeneration": ("vlm_prune.adapters.qwen3_vl", "Qwen3VLAdapter", "qwen3_vl"),
    "Qwen3VLMoeForConditionalGeneration": ("vlm_prune.adapters.qwen3_vl", "Qwen3VLAdapter", "qwen3_vl"),
    "Qwen3_5ForConditionalGeneration": ("vlm_prune.adapters.qwen3_5", "Qwen3_5Adapter", "qwen3_5"),
    "Qwen3_5MoeForConditionalGeneration": ("vlm_prune.adapters.qwen3_5", "Qwen3_5Adapter", "qwen3_5"),
    "Glm4vForConditionalGeneration": ("vlm_prune.adapters.glm4v", "Glm4vAdapter", "glm4v"),
    "Glm4vMoeForConditionalGeneration": ("vlm_prune.adapters.glm4v", "Glm4vAdapter", "glm4v"),
    "Glm46VForConditionalGeneration": ("vlm_prune.adapters.glm4v", "Glm4vAdapter", "glm4v"),
    "SmolVLMForConditionalGeneration": ("vlm_prune.adapters.smolvlm", "SmolVLMAdapter", "smolvlm"),
    "Idefics3ForConditionalGeneration": ("vlm_prune.adapters.smolvlm", "SmolVLMAdapter", "smolvlm"),
    "VideoLlama3ForConditionalGeneration": ("vlm_prune.adapters.videollama3", "VideoLlama3Adapter", "videollama3"),
    "VisionTransformer": ("vlm_prune.adapters.timm_vit", "TimmViTAdapter", "timm_vit"),
}

#: adapter family -> the method stages its adapter runs. The adapter classes take their ``stages``
#: from here, so that ``vlm-prune methods`` lists the families each method runs on (with
#: ``Method.refusal``, the rule wrap() applies) without importing the adapters.
FAMILY_STAGES: dict[str, tuple[str, ...]] = {
    "llava": ("vision", "vit", "llm"),
    "llava_next": ("vision", "vit", "llm"),
    "llava_onevision": ("frames", "vision", "llm"),
    "qwen2_vl": ("frames", "vision", "llm"),
    "mistral3": ("vision", "llm"),
    "gemma3": ("vision", "llm"),
    "internvl": ("vision", "llm"),
    "llava_next_video": ("frames", "vision", "vit", "llm"),
    "llava_onevision15": ("frames", "vision", "llm"),
    "qwen3_vl": ("frames", "vision", "llm"),
    "glm4v": ("frames", "vision", "llm"),
    "qwen3_5": ("frames", "vision", "llm"),
    "smolvlm": ("vision", "llm"),
    "videollama3": ("vision", "llm"),
    "timm_vit": ("vit",),
}


def supported_model_classes() -> list[str]:
    return list(SUPPORTED)


def family_of(model_class: str) -> str | None:
    """The adapter family of a model class name (a checkpoint's config ``architectures``), or None
    when no adapter handles it; nothing is imported."""
    entry = SUPPORTED.get(model_class)
    return entry[2] if entry else None


def find_adapter(model: Any) -> type:
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED:
            module, name, _ = SUPPORTED[cls.__name__]
            return getattr(importlib.import_module(module), name)
    raise TypeError(
        f"vlm_prune does not support {type(model).__name__}. Supported model classes: "
        f"{', '.join(SUPPORTED)}."
    )
