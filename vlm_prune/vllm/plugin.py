"""vLLM plugin entry point (``vllm.general_plugins``): registers the pruned model classes.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers), so the
``architectures`` that ``hf_overrides`` names resolve everywhere. The classes are registered as
objects, not import strings, which spares vLLM a subprocess that inspects them (minutes on a
loaded 2-core machine).
"""
from __future__ import annotations


def register() -> None:
    import importlib

    from vllm import ModelRegistry

    from vlm_prune.vllm.config import ARCHITECTURES, MODULES

    for name in ARCHITECTURES.values():
        if name not in ModelRegistry.get_supported_archs():
            module = importlib.import_module(f"vlm_prune.vllm.{MODULES[name]}")
            ModelRegistry.register_model(name, getattr(module, name))
