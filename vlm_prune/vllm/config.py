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

import functools
import json
import math
import types
import typing
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
    "Qwen3VLForConditionalGeneration": "VlmPruneQwen3VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "VlmPruneGemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "VlmPruneMistral3ForConditionalGeneration",
    "InternVLForConditionalGeneration": "VlmPruneInternVLForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "VlmPruneIdefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "VlmPruneSmolVLMForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "VlmPruneLlavaNextForConditionalGeneration",
    "LlavaNextVideoForConditionalGeneration": "VlmPruneLlavaNextVideoForConditionalGeneration",
    "Glm4vForConditionalGeneration": "VlmPruneGlm4vForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration": "VlmPruneQwen3_5ForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "VlmPruneQwen3VLMoeForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "VlmPruneQwen3_5MoeForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration": "VlmPruneGlm4vMoeForConditionalGeneration",
}
#: the plugin's model class -> its module in vlm_prune.vllm
MODULES = {
    "VlmPruneLlavaForConditionalGeneration": "llava",
    "VlmPruneQwen2VLForConditionalGeneration": "qwen2_vl",
    "VlmPruneQwen2_5_VLForConditionalGeneration": "qwen2_vl",
    "VlmPruneLlavaOnevisionForConditionalGeneration": "onevision",
    "VlmPruneQwen3VLForConditionalGeneration": "qwen3_vl",
    "VlmPruneGemma3ForConditionalGeneration": "gemma3",
    "VlmPruneMistral3ForConditionalGeneration": "mistral3",
    "VlmPruneInternVLForConditionalGeneration": "internvl",
    "VlmPruneIdefics3ForConditionalGeneration": "idefics3",
    "VlmPruneSmolVLMForConditionalGeneration": "idefics3",
    "VlmPruneLlavaNextForConditionalGeneration": "llava_next",
    "VlmPruneLlavaNextVideoForConditionalGeneration": "llava_next_video",
    "VlmPruneGlm4vForConditionalGeneration": "glm4v",
    "VlmPruneQwen3_5ForConditionalGeneration": "qwen3_5",
    "VlmPruneQwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "VlmPruneQwen3_5MoeForConditionalGeneration": "qwen3_5",
    "VlmPruneGlm4vMoeForConditionalGeneration": "glm4v",
}
#: checkpoints whose language model has M-RoPE of its own (no mrope_section override)
NATIVE_MROPE = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                "Glm4vForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                "Qwen3_5MoeForConditionalGeneration", "Glm4vMoeForConditionalGeneration")
#: checkpoints whose vision methods are those wrap()'s adapter allows (the registry's families): a method
#: wrap() refuses there is refused in vLLM with that reason
WRAP_FAMILIES = {"Gemma3ForConditionalGeneration": (
    "gemma3", "Gemma 3", "its SigLIP tower has no CLS token and vlm_prune does not tap its attention"),
    "Mistral3ForConditionalGeneration": (
        "mistral3", "Mistral 3", "its Pixtral tower has no CLS token and packs the images into one sequence")}
#: checkpoints whose rotary tables are read with transformers' config class (old checkpoints spell them
#: rope_scaling / rope_local_base_freq; Gemma 3 has one per layer type) and whose plugin runs the language
#: model on one position row with vLLM's own rotary embeddings
ROPE_FROM_CONFIG = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration")
#: Qwen3-VL: a timestamp and start / end tokens around every temporal slice of a video
QWEN3 = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
#: VisionZip (FasterVLM, VisPruner) on a LLaVA-OneVision image request (its video runs them)
ONEVISION_VISIONZIP_REFUSAL = (
    "{name} runs on LLaVA-OneVision video only, as in wrap(): OneVision's anyres image tiles have no per-token "
    "tower row; use divprune, cdpruner, pool or random for requests with images"
)
#: vision methods that read the tower's feature-layer attention (VisionContext.tower_attention)
TOWER_METHODS = ("visionzip", "fastervlm", "vispruner", "hired", "prumerge")
#: tower-attention methods that need the [CLS] token (LLaVA-1.5 / LLaVA-NeXT images only, as wrap())
CLS_METHODS = ("hired", "prumerge")
CLS_REFUSAL = (
    "{name} ranks an image's patches by the vision tower's [CLS] attention, which wrap() reads on {where} only; "
    "this model is not one of them: use divprune, cdpruner, pool or random"
)
#: PruMerge without keep / budget: its count follows from the tower's attention (IQR outliers)
PRUMERGE_ADAPTIVE_REFUSAL = (
    "prumerge without keep / budget keeps an adaptive count (the IQR outliers of the tower's [CLS] attention), "
    "known only once the tower has run, but vLLM fixes each image's placeholder slots in its processor, before "
    "the encoder: give keep or budget (exactly that many tokens, as wrap() with them), or run the official "
    "adaptive count with vlm_prune.wrap()"
)
TOWER_REFUSAL = (
    "{name} needs the vision tower's attention and keys (VisionContext.tower_attention), which this model's "
    "adapter does not provide for this input: {title} runs on LLaVA-1.5 images and LLaVA-OneVision videos "
    "(not OneVision's anyres image tiles, not Qwen2-VL's tower, which has no CLS token); use divprune, cdpruner, "
    "pool or random"
)
#: LLaVA-NeXT: anyres tiles, per-crop methods (vlm_prune/vllm/llava_next.py)
LLAVA_NEXT = ("LlavaNextForConditionalGeneration",)
NEXT_REFUSAL = (
    "{name} reads one tower row per image, but a LLaVA-NeXT image is a base image plus anyres tiles, each its own "
    "tower row; wrap() refuses it there too ({name} supports {families}). Use hired (per-tile [CLS] attention), "
    "divprune, cdpruner, pool or random"
)
#: HiRED without keep / budget on anyres images: each tile's share is floored and then cut by the unpadding
HIRED_OFFICIAL_REFUSAL = (
    "hired without keep / budget keeps the official count on LLaVA-NeXT: each tile's floored share of 20% of its "
    "patches, then cut by the model's unpadding, known only once the tower has run, but vLLM fixes each image's "
    "placeholder slots in its processor: give keep or budget (exactly that many of the image's visual tokens, as "
    "wrap() with them), or run the official count with vlm_prune.wrap()"
)
#: LLaVA-NeXT-Video: vLLM's class takes video only (vlm_prune/vllm/llava_next_video.py)
NEXT_VIDEO = ("LlavaNextVideoForConditionalGeneration",)
NEXT_VIDEO_REFUSAL = (
    "{name} is refused on LLaVA-NeXT-Video's video, as wrap() refuses it there ({why}); vLLM's "
    "LlavaNextVideoForConditionalGeneration takes video only: use random, pool, divprune, cdpruner or the frames "
    "methods uniform, keyscore, vidcom2, dycoke, quota (through vlm_prune.vllm.quota_request)"
)
#: method -> [(checkpoint classes that cannot run it, the reason)]
REFUSALS = {
    **{name: [(NATIVE_MROPE, TOWER_REFUSAL.format(name=name, title=title)),
              (LLAVA_NEXT, NEXT_REFUSAL.format(name=name, families="llava, llava_onevision")),
              (NEXT_VIDEO, NEXT_VIDEO_REFUSAL.format(name=name, why=f"{name} supports llava, llava_onevision"))]
       for name, title in zip(TOWER_METHODS[:3], ("VisionZip", "FasterVLM", "VisPruner"))},
    "hired": [(("LlavaOnevisionForConditionalGeneration",) + NATIVE_MROPE,
               CLS_REFUSAL.format(name="hired", where="LLaVA-NeXT and LLaVA-1.5 images")),
              (NEXT_VIDEO, NEXT_VIDEO_REFUSAL.format(name="hired", why="HiRED runs on its anyres images only; "
                                                                       "video frames have no partitions"))],
    "prumerge": [(("LlavaOnevisionForConditionalGeneration",) + NATIVE_MROPE,
                  CLS_REFUSAL.format(name="prumerge", where="LLaVA-1.5 images")),
                 (LLAVA_NEXT, NEXT_REFUSAL.format(name="prumerge", families="llava")),
                 (NEXT_VIDEO, NEXT_VIDEO_REFUSAL.format(name="prumerge", why="prumerge supports llava"))],
    **{name: [(QWEN3, (
        f"{name} ranks a video's tokens by the attention they receive in the vision tower, which vlm_prune reads on "
        "LLaVA-OneVision and Qwen2-VL / 2.5-VL only (Qwen3-VL's tower is not tapped; wrap() refuses it too); use "
        "vidcom2, uniform or a vision-stage method on this model")),
        (NEXT_VIDEO, NEXT_VIDEO_REFUSAL.format(name=name, why=f"{name} supports llava_onevision, qwen2_vl"))]
        for name in ("fastvid", "holitom")},
    "vidcom2": [(QWEN3, (
        "vidcom2 gives each slice of a video its own share of the budget from the tower's features, but on Qwen3-VL "
        "vLLM's processor has already written each slice's tokens between that slice's timestamp and start / end "
        "tokens; use uniform or a vision-stage method there, or vidcom2 with vlm_prune.wrap()"))],
    "keyscore": [(QWEN3, (
        "keyscore chooses a video's slices from the tower's features, but on Qwen3-VL vLLM's processor has already "
        "written each slice's tokens between that slice's timestamp and start / end tokens, so the count per slice "
        "is fixed before the choice; use uniform (its slices follow from the budget) or a vision-stage method, or "
        "keyscore with vlm_prune.wrap() on the Hugging Face model"))],
    "quota": [(QWEN3, (
        "quota is refused on Qwen3-VL, as wrap() refuses it: it packs resized frames into the video's first slots, "
        "which on Qwen3-VL lie behind other slices' timestamps; use uniform or a vision-stage method"))],
}
#: pixel-shuffle families (InternVL, Idefics3 / SmolVLM): no CLS attention to rank by, as wrap() refuses it
PIXEL_SHUFFLE = ("InternVLForConditionalGeneration", "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
for _name in TOWER_METHODS:
    REFUSALS[_name].append((PIXEL_SHUFFLE, (
        f"{_name} ranks an image's tokens by the vision tower's feature-layer attention, which vlm_prune reads on "
        "LLaVA-1.5 and LLaVA-OneVision only (wrap() refuses it on InternVL and Idefics3 / SmolVLM too: their tower's "
        "tokens are pixel-shuffled, 2 x 2 patches folded into one); use divprune, cdpruner, pool or random")))

#: other checkpoints whose processor writes each temporal slice of a video as its own run behind text (GLM-4.1V:
#: and GLM-4.5V: start / end tokens and its second; Qwen3.5: Qwen3-VL's): refused what Qwen3-VL refuses there, for the same reasons
SLICED_VIDEO = {"Glm4vForConditionalGeneration": "GLM-4.1V", "Qwen3_5ForConditionalGeneration": "Qwen3.5",
                "Qwen3_5MoeForConditionalGeneration": "Qwen3.5", "Glm4vMoeForConditionalGeneration": "GLM-4.5V"}
for _name in ("fastvid", "holitom", "vidcom2", "keyscore", "quota"):
    _reason = next(reason for archs, reason in REFUSALS[_name] if archs == QWEN3)
    REFUSALS[_name] += [((arch,), _reason.replace("Qwen3-VL", title)) for arch, title in SLICED_VIDEO.items()]
#: families whose vLLM support is not written yet, with what it needs
PLANNED: dict[str, str] = {}
#: methods that run in vLLM (vision stage, a fixed count per image)
SUPPORTED = ("random", "pool", "divprune", "cdpruner", "visionzip", "fastervlm", "vispruner", "hired", "prumerge")
#: frames methods that run in vLLM (video models; a count per video fixed by the budget): vllm/frames.py
FRAMES_SUPPORTED = ("uniform", "keyscore", "vidcom2", "fastvid", "holitom", "dycoke")
#: checkpoint classes that take video (the frames methods need one)
VIDEO_ARCHITECTURES = ("LlavaOnevisionForConditionalGeneration",) + NATIVE_MROPE + NEXT_VIDEO

IN_LLM_REFUSAL = (
    "method {name!r} prunes inside the language model (stage 'llm'): it changes the number of cached keys from "
    "one decoder layer to the next, which vLLM's paged KV cache (one block table per request, the same length in "
    "every layer) cannot hold. In vLLM use a vision-stage method ({supported}) at the same budget, or run {name!r} "
    "with vlm_prune.wrap() on the Hugging Face model; docs/vllm.md says what supporting it would take"
)

#: a frames method whose default adds an inner-LLM stage (HoliTom's merge), asked for with it
INNER_REFUSAL = (
    "{name} (inner=True, its default: the paper's full method) also merges a video's tokens inside the language "
    "model, which vLLM's paged KV cache (one block table per request, the same length in every layer) cannot hold; "
    "vlm_prune.vllm runs its outer stage alone, the paper's 'w/o M': pass inner=False (knobs {{\"inner\": false}}), "
    "which keeps the tokens wrap(model, HoliTom(inner=False)) keeps at the same budget, or run the full {name} with "
    "vlm_prune.wrap() on the Hugging Face model"
)


def method_spec(method: Any, keep: float | None = None, budget: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The JSON-able configuration of one method: {"method", "knobs", "keep", "budget", "seed"}.

    ``method`` is a registered name or a configured object (``vlm_prune.methods.DivPrune()``), as
    for ``wrap()``; keep / budget mean what they mean there (visual tokens of each image that reach
    the language model). Validates now, so a wrong name or budget fails before vLLM starts.
    """
    from vlm_prune.methods.base import validate_seed

    seed = validate_seed(seed)
    m = build_method({"method": method if isinstance(method, str) else method, "keep": keep, "budget": budget})
    knobs = {k: v for k, v in m.describe().items() if k not in ("method", "stage", "keep", "budget")}
    return {"method": m.name, "knobs": knobs, "keep": m.keep, "budget": m.budget, "seed": seed}


# ---- one validation of a spec, before any engine sees it ------------------------------------------
#: where a request carries its spec (what the server's 400s name)
SPEC_FIELD = "mm_processor_kwargs.vlm_prune"
#: the keys of a spec (``quota``: QuoTA's per-request data, vlm_prune.vllm.frames)
SPEC_KEYS = ("method", "knobs", "keep", "budget", "seed", "quota")
#: distinct specs whose validation / method object is kept (least recently used dropped first)
CACHE_SIZE = 256
SPEC_EXAMPLE = '{"method": "divprune", "keep": 0.25} (vlm_prune.vllm.request_kwargs("divprune", keep=0.25)["vlm_prune"])'


class SpecError(ValueError):
    """A spec that no engine may see: ``field`` (``mm_processor_kwargs.vlm_prune.seed``) and what it
    allows (vLLM's server answers a ValueError raised in its input processing with HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_spec(raw: Any, arch: str | None = None, *, field: str = SPEC_FIELD) -> dict[str, Any]:
    """THE check of one pruning spec (a request's ``mm_processor_kwargs["vlm_prune"]``, JSON text or a
    dict; an engine's ``hf_overrides``), for ``arch`` (the checkpoint's model class or the plugin's; None:
    any model). Returns the spec with its defaults filled in; raises :class:`SpecError` naming the field
    and what it allows: JSON text, the keys, the method (registered, a stage vLLM runs, allowed on this
    model), each knob's name and type, keep / budget, the seed (an integer), QuoTA's data.

    ``request_kwargs`` / ``engine_kwargs`` call it on what they build, and the plugin's processors in
    vLLM's front end (the API server process, or the offline ``LLM``'s) on every request's spec before
    the engine sees the request."""
    if isinstance(raw, str):
        return _validated_text(raw, arch, field)
    return _validated_text(_as_text(raw, field), arch, field)


def _as_text(raw: Any, field: str) -> str:
    if not isinstance(raw, dict):
        raise SpecError(field, f"a spec is a JSON object (or its text), e.g. {SPEC_EXAMPLE}; got {type(raw).__name__}")
    try:
        return json.dumps(raw, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise SpecError(field, f"a spec holds JSON values only (strings, numbers, lists, objects): {err}") from None


@functools.lru_cache(maxsize=CACHE_SIZE)
def _validated(text: str, arch: str | None, field: str) -> str:
    """The validated spec of ``text`` as canonical JSON text (cached: the processor asks per item)."""
    try:
        spec = json.loads(text)
    except ValueError as err:  # JSONDecodeError, or an integer of more digits than Python parses
        raise SpecError(field, f"not JSON text ({err}); send a JSON object, e.g. {SPEC_EXAMPLE}") from None
    if not isinstance(spec, dict):
        raise SpecError(field, f"a spec is a JSON object, e.g. {SPEC_EXAMPLE}; got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise SpecError(field, f"unknown key {', '.join(map(repr, unknown))}; a spec has the keys {', '.join(SPEC_KEYS)}")
    name = spec.get("method")
    if not isinstance(name, str):
        raise SpecError(f"{field}.method", f"a method name is required (a string), got {name!r}; vLLM runs "
                        f"{', '.join(SUPPORTED + FRAMES_SUPPORTED)} and quota (through vlm_prune.vllm.quota_request)")
    from vlm_prune.methods.base import validate_budget, validate_seed
    from vlm_prune.registry import method_class

    try:
        cls = method_class(name)
    except ValueError as err:
        raise SpecError(f"{field}.method", str(err)) from None
    name = cls.name
    knobs = _validated_knobs(cls, spec.get("knobs", {}), f"{field}.knobs")
    try:
        keep, budget = validate_budget(spec.get("keep"), spec.get("budget"), required=not cls.own_schedule, method=name)
    except ValueError as err:
        raise SpecError(field, str(err)) from None
    try:
        seed = validate_seed(spec.get("seed", 0))
    except ValueError as err:
        raise SpecError(f"{field}.seed", str(err)) from None
    out = {"method": name, "knobs": knobs, "keep": keep, "budget": budget, "seed": seed}
    if "quota" in spec:
        out["quota"] = _validated_quota(name, spec["quota"], f"{field}.quota")
    reason = _refusal(arch, name, out)
    if reason:
        raise SpecError(f"{field}.method", reason)
    try:
        method_of({k: v for k, v in out.items() if k != "quota"})
    except (ValueError, TypeError, ImportError) as err:  # its own checks (a knob's range, the stage, packages)
        raise SpecError(field, str(err)) from None
    return json.dumps(out, sort_keys=True)


def _validated_text(text: str, arch: str | None, field: str) -> dict[str, Any]:
    return json.loads(_validated(text, arch, field))


def _validated_knobs(cls: type[Method], knobs: Any, field: str) -> dict[str, Any]:
    from vlm_prune.registry import method_knobs

    if not isinstance(knobs, dict):
        raise SpecError(field, f"the knobs are a JSON object of name: value, got {type(knobs).__name__}")
    allowed = method_knobs(cls.name)
    hints = typing.get_type_hints(cls.__init__)
    for key, value in knobs.items():
        if key not in allowed:
            known = ", ".join(allowed) if allowed else "none"
            raise SpecError(field, f"unknown knob {key!r} of method {cls.name!r}; its knobs: {known}")
        want = hints.get(key)
        if want is not None and not _fits(value, want):
            raise SpecError(f"{field}.{key}", f"method {cls.name!r} takes {_type_name(want)}, got {value!r}")
    return dict(knobs)


def _fits(value: Any, want: Any) -> bool:
    """Whether a JSON value fits a knob's annotation (JSON lists stand for tuples)."""
    origin, args = typing.get_origin(want), typing.get_args(want)
    if want is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if want is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        if not isinstance(value, list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return all(_fits(v, args[0]) for v in value) if args else True
    if origin is typing.Literal:
        return value in args
    return False  # objects and callables (a custom scorer, encoder): nothing a request can send


def _type_name(want: Any) -> str:
    if want is type(None):
        return "null"
    origin, args = typing.get_origin(want), typing.get_args(want)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (tuple, list):
        return f"a list of {len(args)} ({', '.join(_type_name(a) for a in args)})" if origin is tuple else "a list"
    if want in (bool, int, float, str):
        return {bool: "true / false", int: "an integer", float: "a number", str: "a string"}[want]
    return f"an object ({getattr(want, '__name__', want)}), which a request cannot send"


def _validated_quota(name: str, quota: Any, field: str) -> dict[str, Any]:
    """QuoTA's per-request data: {"phase": "score", "grid": [rows, cols] or null} (its pass 1) or
    {"scores": [one score >= 0 per frame]} (pass 2)."""
    if name != "quota":
        raise SpecError(field, f"QuoTA's data in a spec of method {name!r}; only method 'quota' takes it")
    if not isinstance(quota, dict):
        raise SpecError(field, f"an object, {{\"phase\": \"score\", \"grid\": [r, c]}} or {{\"scores\": [...]}}")
    if set(quota) == {"scores"}:
        scores = quota["scores"]
        if (not isinstance(scores, list) or not scores
                or not all(isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) and p >= 0
                           for p in scores)):
            raise SpecError(f"{field}.scores", f"a non-empty list of finite scores >= 0 (one per frame), got {scores!r}")
        return {"scores": scores}
    if set(quota) <= {"phase", "grid"} and quota.get("phase") == "score":
        grid = quota.get("grid")
        if grid is not None and not (isinstance(grid, list) and len(grid) == 2 and all(
                isinstance(g, int) and not isinstance(g, bool) and 1 <= g <= 4096 for g in grid)):
            raise SpecError(f"{field}.grid", f"null or [rows, cols] of whole numbers in [1, 4096], got {grid!r}")
        return {"phase": "score", "grid": grid}
    raise SpecError(field, f"{{\"phase\": \"score\", \"grid\": [r, c] or null}} (pass 1) or {{\"scores\": [...]}} "
                    f"(pass 2) of vlm_prune.vllm.quota_request; got the keys {sorted(quota)}")


def _refusal(arch: str | None, name: str, spec: dict[str, Any]) -> str | None:
    """Why ``arch`` cannot serve this (validated) spec, or None; ``arch`` None: any supported model."""
    if arch is None:
        return None
    checkpoint = {v: k for k, v in ARCHITECTURES.items()}.get(arch, arch)
    if checkpoint not in ARCHITECTURES:
        return f"vlm_prune.vllm serves {', '.join(ARCHITECTURES)}; this model is {arch}"
    if name == "quota":
        if checkpoint not in VIDEO_ARCHITECTURES:
            return (f"frames method 'quota' chooses video frames; vlm_prune.vllm runs the frames methods on the video "
                    f"of {', '.join(VIDEO_ARCHITECTURES)}, not of {checkpoint} (use a vision-stage method there: "
                    f"{', '.join(SUPPORTED)})")
        if checkpoint in QWEN3 or checkpoint in SLICED_VIDEO:
            return refusal(checkpoint, name)
        if "quota" in spec or spec["keep"] == 1.0 or spec["budget"] is not None:
            return None  # a budget alone: the processor refuses it where the video has more tokens (no scores)
    reason = refusal(checkpoint, name)
    if reason is None and name == "prumerge" and spec["keep"] is None and spec["budget"] is None:
        return PRUMERGE_ADAPTIVE_REFUSAL
    if reason is None and name == "hired" and checkpoint in LLAVA_NEXT and spec["keep"] is None and spec["budget"] is None:
        return HIRED_OFFICIAL_REFUSAL
    return reason


def method_of(spec: dict[str, Any]) -> Method:
    """The configured method of a spec, built once per distinct spec and kept in a bounded cache
    (the :data:`CACHE_SIZE` most recently used: distinct per-request budgets do not grow memory)."""
    return _method_of(json.dumps(spec, sort_keys=True))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _method_of(key: str) -> Method:
    return build_method(json.loads(key))


def build_method(spec: dict[str, Any]) -> Method:
    """The configured vision-stage method of a spec, through the same pipeline builder as wrap()."""
    from vlm_prune.api import build_pipeline
    from vlm_prune.registry import make_method

    method = spec["method"]
    if isinstance(method, str):
        method = make_method(method, **spec.get("knobs", {}))
    methods = build_pipeline(method, keep=spec.get("keep"), budget=spec.get("budget"))
    stages = sorted(methods)
    if stages == ["frames", "llm"] and getattr(methods["frames"], "inner", False):
        raise ValueError(INNER_REFUSAL.format(name=methods["frames"].name))
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
    if m.name == "prumerge" and m.outliers == "batch":
        raise ValueError("prumerge outliers='batch' counts the outliers over every image of a batch, which vLLM's "
                         "requests do not share; use outliers='image' (each image's own count), or vlm_prune.wrap()")
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
    if checkpoint in WRAP_FAMILIES and method in SUPPORTED:
        from vlm_prune.registry import method_families

        family, title, why = WRAP_FAMILIES[checkpoint]
        families = method_families(method)
        if family not in families:
            return (f"method {method!r} runs on the {', '.join(families)} models, not on {title} (wrap() refuses it "
                    f"there too: {why}); "
                    f"use {', '.join(m for m in SUPPORTED if family in method_families(m))}")
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
    spec = validate_spec(spec, arch, field="the engine's spec (hf_overrides['vlm_prune'])")
    overrides = {"architectures": [ARCHITECTURES[arch]], "vlm_prune": spec}
    if arch in ROPE_FROM_CONFIG:  # transformers' reading of the rotary tables (old checkpoints: rope_scaling)
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(model).get_text_config()
        params = dict(text.rope_parameters or {})
        nested = bool(params) and all(isinstance(v, dict) for v in params.values())  # one table per layer type
        tables = params if nested else {None: params}
        rope = {kind: mrope_rope_parameters({**text.to_dict(), "rope_parameters": table}) for kind, table in tables.items()}
        overrides["text_config"] = {"rope_parameters": rope if nested else rope[None]}
    elif arch not in NATIVE_MROPE:  # one position row per token that the plugin can set
        text = cfg.get("text_config") or {}
        text.setdefault("hidden_size", 4096)
        text.setdefault("num_attention_heads", 32)
        overrides["text_config"] = {"rope_parameters": mrope_rope_parameters(text)}
    return overrides
