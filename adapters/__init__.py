"""Model adapters: each knows one model family's layout and patches the instance.

``find_adapter(model)`` picks the adapter for a model object or raises a TypeError that names
every supported class.
"""
from __future__ import annotations

import importlib
from typing import Any

# adapter module -> class name; modules import lazily so optional deps (timm) stay optional
_ADAPTERS = {
    "vlm_prune.adapters.llava": "LlavaAdapter",
    "vlm_prune.adapters.llava_next": "LlavaNextAdapter",
    "vlm_prune.adapters.llava_onevision": "LlavaOnevisionAdapter",
    "vlm_prune.adapters.qwen2_vl": "Qwen2VLAdapter",
    "vlm_prune.adapters.timm_vit": "TimmViTAdapter",
}


def adapter_classes() -> list[type]:
    out = []
    for module, name in _ADAPTERS.items():
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return out


def supported_model_classes() -> list[str]:
    return [c for a in adapter_classes() for c in a.model_classes]


def find_adapter(model: Any) -> type:
    names = {k.__name__ for k in type(model).__mro__}
    for adapter in adapter_classes():
        if names & set(adapter.model_classes):
            return adapter
    raise TypeError(
        f"vlm_prune does not support {type(model).__name__}. Supported model classes: "
        f"{', '.join(supported_model_classes())}."
    )
