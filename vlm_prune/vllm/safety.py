"""What a request may send to a served model, and the dry run that keeps the engine alive (docs/serving-safety.md).

Design notes. vLLM's engine core dies on any exception raised while it encodes or schedules a request, and
every request shares it, so nothing the engine computes from a request may raise. The front end (the API
server process, or the offline ``LLM``'s) runs the plugin's processor on every request before the engine
sees it; a ``ValueError`` raised there is that request's HTTP 400. So:

- **The spec** (``mm_processor_kwargs.vlm_prune``) is checked by ``config.validate_spec`` (keys, types,
  ranges), at most :data:`config.MAX_SPEC_BYTES` of JSON text; every float knob must lie within the normal
  range of bfloat16 / float32 (:func:`engine_float`), the dtypes the engine computes in, so that no value
  the user chose becomes 0 or infinity there.
- **The dry run** (:func:`dry_run_video`, :func:`dry_run_image`): the method's own count and allocation
  code (``frames_slots`` + ``frames_plan``, ``image_slots`` + ``reduce_image``, or ``reduce_crops`` on an
  anyres image's tile map) runs on synthetic features of the item's real shape in the engine's dtype
  (Gaussian and all-zero maps, the tower's attention and keys, the question's embeddings), in the
  processor, before the engine sees the request. Validation runs it once on a small canonical shape
  (``config.validate_spec``), the processors of every served family again on each item's real shape
  (count, grid, the language model's width, the engine's dtype), as the encoder then meets it, and the
  slots the dry run returns are the item's placeholder count (``llava.dry_run_slots``): every image
  (LLaVA-1.5 on its grid; Gemma 3 on its soft tokens' grid; Mistral 3 on its rows x cols; InternVL and
  Idefics3 / SmolVLM on all their tiles' tokens, a grid for one tile; LLaVA-NeXT and LLaVA-OneVision on their
  visual tokens without the newlines, NeXT's per-crop methods on the image's own tile map; Qwen2-VL / 2.5-VL,
  Qwen3-VL, Qwen3.5 and GLM-4.xV on their merged grid), every video (LLaVA-OneVision, LLaVA-NeXT-Video and
  Qwen2-VL / 2.5-VL on their frames; InternVL per frame; Qwen3-VL, Qwen3.5 and GLM-4.xV per temporal slice
  for a vision method, on all slices for a frames method). A failure is a 400 naming the knob whose removal
  makes it pass (else the spec). Results are cached per (spec, shape) for :data:`DRY_RUN_CACHE` entries, so
  a repeated request costs a dictionary look-up.
- **Other processor settings** (``mm_processor_kwargs`` keys besides ``vlm_prune``) change the processor's
  output shape in ways vLLM's own models do not survive (LLaVA-1.5 ``crop_size: 64``, Qwen2-VL
  ``patch_size: 8``), so they are refused unless the operator names them (``vlm-prune serve
  --allow-mm-kwargs min_pixels,max_pixels,fps``); only the keys of :data:`CHECKED_KWARGS` can be named,
  each on the models whose processor takes it (another name fails at start-up: geometry keys such as
  ``patch_size`` or ``crop_size`` cannot be checked against every encoder), and each value is checked
  (:func:`check_mm_kwargs`). The list travels to every process in ``hf_overrides`` (:data:`ALLOW_KEY`).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from typing import Any

from vlm_prune.vllm.config import SPEC_FIELD, SpecError, method_of

#: the smallest normal and the largest finite value of bfloat16 (float32's normal range, rounded to bfloat16):
#: a float knob outside them is 0, a subnormal or infinity in one of the dtypes the engine computes in
FLOAT_TINY, FLOAT_MAX = 1.1754943508222875e-38, 3.3895313892515355e38
#: (spec, shape) dry runs remembered (each entry: the spec's text, at most config.MAX_SPEC_BYTES)
DRY_RUN_CACHE = 256
#: the hf_overrides key that carries the operator's allowed mm_processor_kwargs keys
ALLOW_KEY = "vlm_prune_allow_mm_kwargs"
#: the largest fps a request may ask for (frames per second sampled from a video)
FPS_MAX = 60
#: the other mm_processor_kwargs keys an operator may allow, with what each value must be
CHECKED_KWARGS = {
    "min_pixels": "a whole number of pixels in [one merged patch, 16384 merged patches], at most max_pixels",
    "max_pixels": "a whole number of pixels in [one merged patch, 16384 merged patches], at least min_pixels",
    "fps": f"a number of frames per second in (0, {FPS_MAX}]",
    "do_image_splitting": "true / false",
}
#: the models whose processors take each allowable key
KWARGS_MODELS = {"min_pixels": "pixel-budget", "max_pixels": "pixel-budget", "fps": "video",
                 "do_image_splitting": "image-splitting"}
#: keys that set the processor's geometry: never allowed (vLLM's own models die on some of their values)
NEVER_KWARGS = ("patch_size", "merge_size", "temporal_patch_size", "crop_size", "size", "do_resize",
                "image_grid_pinpoints", "vision_feature_select_strategy", "num_frames")


def engine_float(value: float) -> str | None:
    """Why a float knob is no value the engine can compute with, or None."""
    if value != 0 and not FLOAT_TINY <= abs(value) <= FLOAT_MAX:
        return (f"{value!r} is outside the range the engine computes in (bfloat16 / float32: 0 or a magnitude "
                f"in [{FLOAT_TINY:.4g}, {FLOAT_MAX:.4g}]); it would become 0, a subnormal or infinity there")
    return None


# ---- the dry run -------------------------------------------------------------------------------------
def _features(shape: tuple[int, ...], dtype: Any, fill: int | None) -> Any:
    """Zeros (``fill`` None) or Gaussian values of seed ``fill``."""
    import torch

    if fill is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(fill)).to(dtype)


def _video_once(method: Any, spec: dict[str, Any], frames: int, per_frame: int, grid: tuple[int, int],
                unpooled_grid: tuple[int, int] | None, dim: int, dtype: Any, fill: int | None) -> int:
    import torch

    from vlm_prune.vllm.frames import frames_plan, frames_slots, quota_phase

    slots = frames_slots(method, frames, per_frame, spec, unpooled_grid, grid)
    if method.name == "quota" and quota_phase(spec) != "plan":
        return slots  # pass 1 (or nothing to score): the video runs unpruned
    unpooled = None
    if unpooled_grid is not None:
        unpooled = _features((frames, unpooled_grid[0] * unpooled_grid[1], dim), dtype, fill)

    def tower(frame: int) -> tuple[torch.Tensor, torch.Tensor]:
        attention = torch.softmax(_features((per_frame,), torch.float32, fill), dim=0)
        return attention.to(dtype), _features((per_frame, 8), dtype, fill)

    frames_plan(method, _features((frames, per_frame, dim), dtype, fill), grid, spec=spec, unpooled=unpooled,
                unpooled_grid=unpooled_grid, text_features=_features((3, dim), dtype, fill), tower_attention=tower,
                pixels=_features((frames, 3, 16, 16), torch.float32, fill))
    return slots


def image_slots(method: Any, n: int) -> int:
    """Placeholder slots of an image of ``n`` visual tokens: the count ``wrap()`` keeps, known before the
    encoder runs (HiRED's official single-partition count without keep / budget: int(n rate))."""
    if method.name == "hired" and method.keep is None and method.budget is None:
        return min(n, int(n * method.rate))
    return method.n_keep(n, 1)


def _image_once(method: Any, spec: dict[str, Any], n: int, grid: tuple[int, int] | None, dim: int, dtype: Any,
                fill: int | None, crops: tuple[bytes, bytes] | None = None) -> int:
    import torch

    from vlm_prune.methods.base import VisionContext, item_generator
    from vlm_prune.methods.visionzip import TowerFeatures

    if crops is not None and getattr(method, "per_crop", False):
        return _crops_once(method, spec, n, dim, crops, dtype, fill)
    features = _features((n, dim), dtype, fill)
    attention = torch.softmax(_features((n,), torch.float32, fill), dim=0).to(dtype)
    tower = TowerFeatures(features, _features((dim,), dtype, fill), lambda x: x,
                          lambda: (_features((n + 1, dim), dtype, fill), _features((n + 1, dim), dtype, fill)))
    slots = image_slots(method, n)
    ctx = VisionContext(features=features, n_keep=slots, grid=grid, text_embeds=_features((3, dim), dtype, fill),
                        tower_attention=lambda: (attention, _features((n, 8), dtype, fill), tower),
                        generator=item_generator(int(spec.get("seed", 0)), 0))
    with torch.no_grad():
        red = method.reduce_image(ctx)
    if red.indices.numel() != slots:
        raise RuntimeError(f"{method.name} kept {red.indices.numel()} tokens of the image, its slots are {slots}")
    if red.sizes is not None:
        raise ValueError(f"method {method.name!r} merges tokens with sizes, which vLLM's attention cannot weight")
    return slots


def _crops_once(method: Any, spec: dict[str, Any], n: int, dim: int, crops: tuple[bytes, bytes], dtype: Any,
                fill: int | None) -> int:
    """:func:`_image_once` of an anyres image whose method selects per crop (``reduce_crops``, LLaVA-NeXT): its
    ``n`` visual tokens among the packed rows of the tile map ``crops`` (each row's tower row and patch, -1 for
    a newline, as int16 bytes), with synthetic [CLS] attention per tower row (HiRED's ``TileAttention``)."""
    import torch

    from vlm_prune.methods.base import VisionContext, item_generator
    from vlm_prune.methods.hired import TileAttention

    crop, local = (torch.frombuffer(bytearray(b), dtype=torch.int16).long() for b in crops)
    rows, patches = int(crop.max()) + 1, int(local.max()) + 1
    newlines = int((crop < 0).sum())
    if crop.numel() - newlines != n:
        raise RuntimeError(f"the tile map holds {crop.numel() - newlines} visual tokens, the image {n}")

    def attention() -> torch.Tensor:
        return torch.softmax(_features((rows, patches), torch.float32, fill), dim=-1)

    slots = image_slots(method, n)
    ctx = VisionContext(features=_features((crop.numel(), dim), dtype, fill), n_keep=slots,
                        text_embeds=_features((3, dim), dtype, fill), generator=item_generator(int(spec.get("seed", 0)), 0),
                        tower_tiles=lambda: TileAttention(early=attention(), late=attention(), crop=crop, local=local))
    with torch.no_grad():
        red = method.reduce_crops(ctx, crop)
    if red.indices.numel() != slots + newlines:
        raise RuntimeError(f"{method.name} kept {red.indices.numel() - newlines} tokens of the image, its slots are {slots}")
    return slots


def run_synthetic(kind: str, spec: dict[str, Any], shape: tuple[Any, ...], dtype: Any, fill: int | None) -> int:
    """The slots of one image / video (``kind``) of ``shape`` ((frames, per_frame, grid, unpooled_grid, dim) /
    (n, grid, dim) or (n, grid, dim, crops)) after the spec's method ran on synthetic maps of ``dtype``: zeros
    (``fill`` None) or Gaussian of seed ``fill``; it raises what the engine would raise."""
    method = method_of({k: v for k, v in spec.items() if k != "quota"})
    if kind == "video":
        return _video_once(method, spec, *shape, dtype, fill)
    n, grid, dim, *crops = shape
    return _image_once(method, spec, n, grid, dim, dtype, fill, *crops)


def _run(kind: str, spec: dict[str, Any], shape: tuple[Any, ...], dtype: Any) -> int:
    return [run_synthetic(kind, spec, shape, dtype, fill) for fill in (0, None)][0]


@functools.lru_cache(maxsize=DRY_RUN_CACHE)
def _dry_run(kind: str, text: str, shape: tuple[Any, ...], dtype_name: str, field: str) -> int:
    import torch

    dtype = getattr(torch, dtype_name)
    spec = json.loads(text)
    try:
        return _run(kind, spec, shape, dtype)
    except SpecError:
        raise
    except Exception as err:  # noqa: BLE001 - anything the engine would raise on this spec is the request's 400
        raise SpecError(_culprit(kind, spec, shape, dtype, field), f"this spec fails on this {kind} "
                        f"({_shape_text(kind, shape)}, {dtype_name}): {type(err).__name__}: {err}") from None


def _culprit(kind: str, spec: dict[str, Any], shape: tuple[Any, ...], dtype: Any, field: str) -> str:
    """The field to blame: the knob whose removal makes the dry run pass, else the spec."""
    for key in spec.get("knobs", {}):
        trial = {**spec, "knobs": {k: v for k, v in spec["knobs"].items() if k != key}}
        try:
            _run(kind, trial, shape, dtype)
        except Exception:  # noqa: BLE001 - still failing: not this knob
            continue
        return f"{field}.knobs.{key}"
    return field


def _shape_text(kind: str, shape: tuple[Any, ...]) -> str:
    if kind == "video":
        frames, per_frame, grid = shape[:3]
        return f"{frames} frames of {per_frame} tokens, grid {grid[0]} x {grid[1]}"
    return f"{shape[0]} tokens"


def dry_run_video(spec: dict[str, Any], frames: int, per_frame: int, grid: tuple[int, int], *,
                  unpooled_grid: tuple[int, int] | None = None, dim: int = 16, dtype: Any = None,
                  field: str = SPEC_FIELD) -> int:
    """The video's slot count (``frames_slots``) after the method's allocation ran on synthetic [frames,
    per_frame, dim] maps of ``dtype`` (a torch dtype or its name; Gaussian, then zeros); a failure is a :class:`SpecError`."""
    return _dry_run("video", json.dumps(spec, sort_keys=True), (int(frames), int(per_frame), tuple(grid),
                    tuple(unpooled_grid) if unpooled_grid else None, int(dim)), _dtype_name(dtype), field)


def dry_run_image(spec: dict[str, Any], n: int, grid: tuple[int, int] | None = None, *, dim: int = 16,
                  crops: tuple[Any, Any] | None = None, dtype: Any = None, field: str = SPEC_FIELD) -> int:
    """:func:`dry_run_video` for one image of ``n`` visual tokens: its slots after ``reduce_image`` ran (or, given
    ``crops``, the (crop [N], patch [N]) tile map of an anyres image's N packed rows, -1 for its newlines, and a
    method that selects per crop: ``reduce_crops`` on it)."""
    import torch

    tiles = None if crops is None else tuple(m.to(torch.int16).numpy().tobytes() for m in crops)
    return _dry_run("image", json.dumps(spec, sort_keys=True), (int(n), tuple(grid) if grid else None, int(dim), tiles),
                    _dtype_name(dtype), field)


def _dtype_name(dtype: Any) -> str:
    """"float32" of None, "float32" or torch.float32."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def engine_dims(info: Any) -> dict[str, Any]:
    """``dim`` (the language model's width: the features' D) and ``dtype`` of a vLLM processing info's model."""
    text = info.get_hf_config().get_text_config()
    return {"dim": int(text.hidden_size), "dtype": info.ctx.model_config.dtype}


# ---- other mm_processor_kwargs keys ----------------------------------------------------------------
def allowed_mm_kwargs(keys: Any, arch: str) -> list[str]:
    """The operator's ``--allow-mm-kwargs`` list for checkpoint class ``arch``, checked (a one-line reason for
    a key that cannot be allowed)."""
    from vlm_prune.vllm.config import NATIVE_MROPE, PIXEL_SHUFFLE, VIDEO_ARCHITECTURES

    names = [k.strip() for k in (keys.split(",") if isinstance(keys, str) else keys or []) if k.strip()]
    takes = {"pixel-budget": NATIVE_MROPE, "video": VIDEO_ARCHITECTURES, "image-splitting": PIXEL_SHUFFLE[1:]}
    for key in names:
        if key in NEVER_KWARGS:
            raise ValueError(f"--allow-mm-kwargs {key}: it sets the processor's geometry, which the model's encoder "
                             f"cannot follow for every value; allowable: {', '.join(CHECKED_KWARGS)}")
        if key not in CHECKED_KWARGS:
            raise ValueError(f"--allow-mm-kwargs {key}: vlm_prune checks only {', '.join(CHECKED_KWARGS)} (a request's "
                             "other processor settings are refused)")
        if arch not in takes[KWARGS_MODELS[key]]:
            raise ValueError(f"--allow-mm-kwargs {key}: {arch}'s processor does not take it (models that do: "
                             f"{', '.join(takes[KWARGS_MODELS[key]])})")
    return names


def pixel_limits(hf_config: Any) -> tuple[int, int]:
    """[one merged patch, 16384 merged patches] in pixels (Qwen2-VL's processor's own default ceiling)."""
    vision = getattr(hf_config, "vision_config", None)
    side = getattr(vision, "patch_size", 14) * getattr(vision, "spatial_merge_size", 2)
    return side * side, 16384 * side * side


def check_mm_kwargs(mm_kwargs: Mapping[str, object], hf_config: Any) -> None:
    """Refuse (a :class:`SpecError`, HTTP 400 naming the key) every ``mm_processor_kwargs`` key but the spec and
    the operator's allowed ones (``hf_config.vlm_prune_allow_mm_kwargs``), and allowed values outside
    :data:`CHECKED_KWARGS`."""
    allowed = list(getattr(hf_config, ALLOW_KEY, None) or [])
    for key, value in mm_kwargs.items():
        field = f"mm_processor_kwargs.{key}"
        if key == "vlm_prune":
            continue
        if key not in allowed:
            more = f"; this server also allows {', '.join(allowed)}" if allowed else ""
            raise SpecError(field, f"not accepted: a request's mm_processor_kwargs may carry the pruning spec "
                            f"(vlm_prune){more}; the operator allows others with vlm-prune serve --allow-mm-kwargs "
                            f"(of {', '.join(CHECKED_KWARGS)})")
        if key == "fps":
            ok = not isinstance(value, bool) and finite_number(value) and 0 < value <= FPS_MAX
        elif key == "do_image_splitting":
            ok = isinstance(value, bool)
        else:
            lo, hi = pixel_limits(hf_config)
            ok = not isinstance(value, bool) and isinstance(value, int) and lo <= value <= hi
        if not ok:
            raise SpecError(field, f"{CHECKED_KWARGS[key]}, got {_short(value)}")
    low, high = mm_kwargs.get("min_pixels"), mm_kwargs.get("max_pixels")
    if low is not None and high is not None and low > high:
        raise SpecError("mm_processor_kwargs.min_pixels", f"min_pixels {low} is above max_pixels {high}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def finite_number(value: Any) -> bool:
    """A JSON number a float knob can take (an int of any size Python parses counts only when it fits a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
