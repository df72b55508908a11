"""Serve vlm_prune's vision-stage methods inside vLLM (offline ``LLM`` and the OpenAI server).

    from vlm_prune.vllm import LLM
    llm = LLM("path/to/llava-1.5", method="divprune", budget=64)   # a vllm.LLM
    llm.generate({"prompt": ..., "multi_modal_data": {"image": image}}, sampling_params)

``method`` / ``keep`` / ``budget`` / ``seed`` mean exactly what they mean for ``vlm_prune.wrap()``
(visual tokens of each image that reach the language model). The plugin (entry point
``vllm.general_plugins``) registers the model classes in every vLLM process; the configuration
travels in ``hf_overrides`` (:func:`engine_kwargs`). See docs/vllm.md.
"""
from __future__ import annotations

import json
from typing import Any

from vlm_prune.vllm.config import SUPPORTED, hf_overrides, method_spec, validate_spec

__all__ = ["LLM", "engine_kwargs", "request_kwargs", "quota_request", "QuotaClient", "video_url", "SUPPORTED",
           "method_spec", "validate_spec"]

#: engine defaults the plugin needs: the processor cache off (the plugin adds per-prompt fields to
#: each image after vLLM's processor has run), eager mode on CPU
DEFAULTS: dict[str, Any] = {"mm_processor_cache_gb": 0}


def engine_kwargs(model: str, method: Any, *, keep: float | None = None, budget: int | None = None,
                  seed: int = 0, allow_mm_kwargs: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs`` that serve ``model`` pruned.

    ``allow_mm_kwargs``: the requests' ``mm_processor_kwargs`` keys allowed besides the spec (e.g.
    ``"min_pixels,max_pixels,fps"``; docs/serving-safety.md); every other key is refused.
    Extra ``kwargs`` pass through to vLLM; a given ``hf_overrides`` dict is merged under ours."""
    spec = method_spec(method, keep=keep, budget=budget, seed=seed)
    overrides = dict(kwargs.pop("hf_overrides", None) or {})
    overrides.update(hf_overrides(model, spec, allow_mm_kwargs))
    return {"model": str(model), **DEFAULTS, **kwargs, "hf_overrides": overrides}


def LLM(model: str, method: Any, *, keep: float | None = None, budget: int | None = None, seed: int = 0,
        **kwargs: Any) -> Any:
    """A ``vllm.LLM`` serving ``model`` with ``method`` at ``keep`` / ``budget`` (as ``wrap()``)."""
    import vllm

    from vlm_prune.vllm.plugin import register

    register()  # the entry point does this in vLLM's processes; here for an editable checkout without it
    return vllm.LLM(**engine_kwargs(model, method, keep=keep, budget=budget, seed=seed, **kwargs))


def request_kwargs(method: Any, *, keep: float | None = None, budget: int | None = None, seed: int = 0,
                   model: Any = None) -> dict[str, Any]:
    """``mm_processor_kwargs`` of one request that overrides the engine's method and budget:
    ``llm.generate({"prompt": ..., "multi_modal_data": ..., "mm_processor_kwargs": request_kwargs("pool", keep=0.25)})``
    (in the OpenAI server: the request body's ``mm_processor_kwargs``). Requests with different
    settings share the engine, its batches and its KV cache.

    Checked by the validation the server runs on every request (``validate_spec``); with ``model``
    (the checkpoint folder, or its model class name) also against that model, so a spec the server
    would refuse with HTTP 400 fails here."""
    spec = method_spec(method, keep=keep, budget=budget, seed=seed)
    arch = None
    if model is not None:
        from pathlib import Path

        from vlm_prune.vllm.config import ARCHITECTURES, read_config

        is_class = isinstance(model, str) and (model in ARCHITECTURES or model in ARCHITECTURES.values())
        arch = model if is_class else (read_config(Path(model)).get("architectures") or [""])[0]
    return {"vlm_prune": json.dumps(validate_spec(spec, arch), sort_keys=True)}


def quota_request(llm: Any, request: dict[str, Any], method: Any = "quota", *, keep: float | None = None,
                  budget: int | None = None, seed: int = 0, processor: Any = None) -> dict[str, Any]:
    """QuoTA's pass 1 through ``llm`` (frame scores from the served model); returns the request to
    generate (pass 2). ``llm``: an offline ``vllm.LLM`` (``request``: a prompt dict) or a
    :class:`QuotaClient` of a running server (``request``: a /v1/chat/completions body). See
    :func:`vlm_prune.vllm.frames.quota_request` and docs/vllm.md."""
    from vlm_prune.vllm.frames import quota_request as run

    return run(llm, request, method, keep=keep, budget=budget, seed=seed, processor=processor)


def __getattr__(name: str) -> Any:
    """QuotaClient / video_url (vlm_prune.vllm.quota_client) load on first use: they import torch."""
    if name in ("QuotaClient", "video_url"):
        from vlm_prune.vllm import quota_client

        return getattr(quota_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
