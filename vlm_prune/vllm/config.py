"""The pruning configuration vLLM carries to every process: a plain dict on the model's config.

vLLM builds the processor (which fixes each image's placeholder count) and the model (which
chooses the tokens that fill those slots) from the model's ``hf_config``, in the front end and in
every worker. So the configuration travels as ``hf_overrides``: ``architectures`` names the plugin's
model class, ``vlm_prune`` holds the method, its knobs and the budget, and the language model's
``rope_parameters`` gain an ``mrope_section`` so that vLLM keeps one position per token that the
plugin can set (kept tokens keep their original positions, as ``wrap()`` keeps them). Nothing here
imports vLLM.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: `vlm-prune serve --help` stays free of torch)
    from vlm_prune.methods.base import Method

#: model class of the checkpoint -> the plugin's class that serves it pruned
ARCHITECTURES = {
    "LlavaForConditionalGeneration": "VlmPruneLlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "VlmPruneQwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "VlmPruneQwen2_5_VLForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration": "VlmPruneLlavaOnevisionForConditionalGeneration",
}
#: the plugin's model class -> its module in vlm_prune.vllm
MODULES = {
    "VlmPruneLlavaForConditionalGeneration": "llava",
    "VlmPruneQwen2VLForConditionalGeneration": "qwen2_vl",
    "VlmPruneQwen2_5_VLForConditionalGeneration": "qwen2_vl",
    "VlmPruneLlavaOnevisionForConditionalGeneration": "onevision",
}
#: checkpoints whose language model has M-RoPE of its own (no mrope_section override)
NATIVE_MROPE = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
#: VisionZip on a LLaVA-OneVision image request (its video runs VisionZip)
ONEVISION_VISIONZIP_REFUSAL = (
    "visionzip runs on LLaVA-OneVision video only, as in wrap(): OneVision's anyres image tiles have no per-token "
    "tower row; use divprune, cdpruner, pool or random for requests with images"
)
#: method -> [(checkpoint classes that cannot run it, the reason)]
REFUSALS = {
    "visionzip": [(NATIVE_MROPE, (
        "visionzip needs the vision tower's attention and keys (VisionContext.tower_attention), which this model's "
        "adapter does not provide for this input: VisionZip runs on LLaVA-1.5 images and LLaVA-OneVision videos "
        "(not OneVision's anyres image tiles, not Qwen2-VL's tower, which has no CLS token); use divprune, cdpruner, "
        "pool or random"))],
}
#: families whose vLLM support is not written yet, with what it needs
PLANNED: dict[str, str] = {}
#: methods that run in vLLM (vision stage, a fixed count per image)
SUPPORTED = ("random", "pool", "divprune", "cdpruner", "visionzip")
#: frames methods that run in vLLM (video models; a count per video fixed by the budget): vllm/frames.py
FRAMES_SUPPORTED = ("uniform", "keyscore")
#: checkpoint classes that take video (the frames methods need one)
VIDEO_ARCHITECTURES = ("LlavaOnevisionForConditionalGeneration",) + NATIVE_MROPE

IN_LLM_REFUSAL = (
    "method {name!r} prunes inside the language model (stage 'llm'): it changes the number of cached keys from "
    "one decoder layer to the next, which vLLM's paged KV cache (one block table per request, the same length in "
    "every layer) cannot hold. In vLLM use a vision-stage method ({supported}) at the same budget, or run {name!r} "
    "with vlm_prune.wrap() on the Hugging Face model; docs/vllm.md says what supporting it would take"
)


def method_spec(method: Any, keep: float | None = None, budget: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The JSON-able configuration of one method: {"method", "knobs", "keep", "budget", "seed"}.

    ``method`` is a registered name or a configured object (``vlm_prune.methods.DivPrune()``), as
    for ``wrap()``; keep / budget mean what they mean there (visual tokens of each image that reach
    the language model). Validates now, so a wrong name or budget fails before vLLM starts.
    """
    m = build_method({"method": method if isinstance(method, str) else method, "keep": keep, "budget": budget})
    knobs = {k: v for k, v in m.describe().items() if k not in ("method", "stage", "keep", "budget")}
    return {"method": m.name, "knobs": knobs, "keep": m.keep, "budget": m.budget, "seed": int(seed)}


def build_method(spec: dict[str, Any]) -> Method:
    """The configured vision-stage method of a spec, through the same pipeline builder as wrap()."""
    from vlm_prune.api import build_pipeline
    from vlm_prune.registry import make_method

    method = spec["method"]
    if isinstance(method, str):
        method = make_method(method, **spec.get("knobs", {}))
    methods = build_pipeline(method, keep=spec.get("keep"), budget=spec.get("budget"))
    stages = sorted(methods)
    if stages == ["frames"]:
        from vlm_prune.vllm.frames import check_frames_method

        check_frames_method(methods["frames"])
        return methods["frames"]
    if stages != ["vision"]:
        m = next(iter(methods.values()))
        if m.stage == "llm":
            raise ValueError(IN_LLM_REFUSAL.format(name=m.name, supported=", ".join(SUPPORTED)))
        raise ValueError(
            f"method {m.name!r} acts in the {m.stage!r} stage; vlm_prune.vllm runs the vision-stage methods "
            f"{', '.join(SUPPORTED)} and the frames methods {', '.join(FRAMES_SUPPORTED)} (ViT-stage methods and "
            "pipelines of several stages are not wired into vLLM yet)"
        )
    m = methods["vision"]
    if m.name not in SUPPORTED:
        raise ValueError(f"method {m.name!r} is not wired into vLLM yet; supported: {', '.join(SUPPORTED)}")
    return m


def refusal(arch: str, method: str) -> str | None:
    """Why checkpoint class ``arch`` (or the plugin's class serving it) cannot run ``method``, or None."""
    for archs, reason in REFUSALS.get(method, []):
        if arch in archs or arch in {ARCHITECTURES[a] for a in archs}:
            return reason
    if method == "quota":  # per request only, after its pass 1 (vlm_prune.vllm.quota_request)
        from vlm_prune.vllm.frames import QUOTA_REFUSAL

        return QUOTA_REFUSAL
    checkpoint = {v: k for k, v in ARCHITECTURES.items()}.get(arch, arch)
    if method in FRAMES_SUPPORTED and checkpoint in ARCHITECTURES and checkpoint not in VIDEO_ARCHITECTURES:
        return (f"frames method {method!r} chooses video frames; vlm_prune.vllm runs the frames methods on the video "
                f"of {', '.join(VIDEO_ARCHITECTURES)}, not of {arch} (use a vision-stage method there)")
    return None


def read_config(model: str | Path) -> dict[str, Any]:
    path = Path(model) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: vlm_prune.vllm needs a local checkpoint folder (save_pretrained output) to read its "
            "model class and rotary settings"
        )
    return json.loads(path.read_text())


def mrope_rope_parameters(text_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's rope_parameters with an ``mrope_section`` covering the rotary half-dim:
    three identical position rows then give exactly the model's 1-D RoPE."""
    params = dict(text_config.get("rope_parameters") or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": float(text_config.get("rope_theta", 10000.0))}
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    half = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
    a = half // 3
    params["mrope_section"] = [half - 2 * a, a, a]
    return params


def hf_overrides(model: str | Path, spec: dict[str, Any]) -> dict[str, Any]:
    """``hf_overrides`` for vLLM that serve checkpoint ``model`` with the pruning ``spec``."""
    cfg = read_config(model)
    arch = (cfg.get("architectures") or [""])[0]
    if arch in PLANNED:
        raise ValueError(f"{PLANNED[arch]} is not served by vlm_prune.vllm yet; supported: {', '.join(ARCHITECTURES)}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"vlm_prune.vllm serves {', '.join(ARCHITECTURES)} checkpoints; {model} is {arch or 'unknown'}")
    reason = refusal(arch, spec["method"])
    if reason:
        raise ValueError(reason)
    overrides = {"architectures": [ARCHITECTURES[arch]], "vlm_prune": spec}
    if arch not in NATIVE_MROPE:  # one position row per token that the plugin can set
        text = cfg.get("text_config") or {}
        text.setdefault("hidden_size", 4096)
        text.setdefault("num_attention_heads", 32)
        overrides["text_config"] = {"rope_parameters": mrope_rope_parameters(text)}
    return overrides
