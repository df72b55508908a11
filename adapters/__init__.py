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

# model class name -> (adapter module, adapter class)
SUPPORTED = {
    "LlavaForConditionalGeneration": ("vlm_prune.adapters.llava", "LlavaAdapter"),
    "LlavaNextForConditionalGeneration": ("vlm_prune.adapters.llava_next", "LlavaNextAdapter"),
    "LlavaOnevisionForConditionalGeneration": ("vlm_prune.adapters.llava_onevision", "LlavaOnevisionAdapter"),
    "Qwen2VLForConditionalGeneration": ("vlm_prune.adapters.qwen2_vl", "Qwen2VLAdapter"),
    "Qwen2_5_VLForConditionalGeneration": ("vlm_prune.adapters.qwen2_vl", "Qwen2VLAdapter"),
    "Mistral3ForConditionalGeneration": ("vlm_prune.adapters.mistral3", "Mistral3Adapter"),
    "Gemma3ForConditionalGeneration": ("vlm_prune.adapters.gemma3", "Gemma3Adapter"),
    "InternVLForConditionalGeneration": ("vlm_prune.adapters.internvl", "InternVLAdapter"),
    "LlavaNextVideoForConditionalGeneration": ("vlm_prune.adapters.llava_next_video", "LlavaNextVideoAdapter"),
    "LlavaOnevision15ForConditionalGeneration": ("vlm_prune.adapters.llava_onevision15", "LlavaOnevision15Adapter"),
    "VisionTransformer": ("vlm_prune.adapters.timm_vit", "TimmViTAdapter"),
}


def supported_model_classes() -> list[str]:
    return list(SUPPORTED)


def find_adapter(model: Any) -> type:
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED:
            module, name = SUPPORTED[cls.__name__]
            return getattr(importlib.import_module(module), name)
    raise TypeError(
        f"vlm_prune does not support {type(model).__name__}. Supported model classes: "
        f"{', '.join(SUPPORTED)}."
    )
