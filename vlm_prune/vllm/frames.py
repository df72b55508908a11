"""Frames-stage methods (``uniform``, ``keyscore``) inside vLLM, for any video model of the plugin.

vLLM fixes a video's placeholder count when it processes the prompt, before the tower runs. The
frames methods that choose WHICH frames to keep from the video's features, but keep a count fixed
by the budget alone, fit that as the vision methods do (docs/vllm.md, "Frames methods"):

- :func:`frames_slots` (processor): the visual tokens the method keeps of a T x N video, the
  same number ``wrap()`` keeps: ``n_total = method.n_keep(T * N)``, whole frames
  ``min(T, n_total // N)`` of N tokens each, or, below one frame, ``n_total`` tokens of one frame.
- :func:`frames_reduction` (encoder): the method object's own ``allocate`` on the video's
  [T, N, D] frame maps (the model's features, as ``wrap()`` hands them), checked against the slots.
- :func:`uniform_frames` (processor): uniform needs no features, so the plugin decodes only the
  kept frames (the tower never sees the others); :func:`uniform_frames` names them.

QuoTA's count depends on its frame scores (truncated per-frame shares, capped maps), which the
unpruned model computes from the video: it cannot be fixed before the encoder, and is refused
(:data:`QUOTA_REFUSAL`).
"""
from __future__ import annotations

from typing import Any

import torch

from vlm_prune.methods.base import FramesContext, Method, Reduction

#: frames methods whose kept count is fixed by the budget (the plugin serves them)
FRAMES_SUPPORTED = ("uniform", "keyscore")

QUOTA_REFUSAL = (
    "frames method 'quota' is not served by vlm_prune.vllm: QuoTA's token count per video follows its frame "
    "scores (each frame's share of the budget truncated, maps capped), which the unpruned model computes from the "
    "video itself, while vLLM fixes the video's placeholder count before the encoder runs. Use 'uniform' or "
    "'keyscore' (same budget), or run QuoTA with vlm_prune.wrap() on the Hugging Face model; docs/vllm.md says "
    "what serving it would take"
)


def check_frames_method(method: Method) -> None:
    """Refuse frames methods whose kept count is not known before the encoder."""
    if method.name == "quota":
        raise ValueError(QUOTA_REFUSAL)
    if method.name not in FRAMES_SUPPORTED:
        raise ValueError(f"frames method {method.name!r} is not wired into vLLM; supported: {', '.join(FRAMES_SUPPORTED)}")
    if method.name == "keyscore" and getattr(method, "_encoder", None) is not None:
        raise ValueError("keyscore with a custom encoder is not served by vlm_prune.vllm (the encoder object cannot "
                         "travel to vLLM's processes); use its default in-model embeddings (encoder=None)")


def frames_slots(method: Method, frames: int, per_frame: int) -> int:
    """Visual tokens a frames method keeps of a ``frames`` x ``per_frame`` video (what wrap() keeps)."""
    check_frames_method(method)
    n_total = method.n_keep(frames * per_frame, 1)
    whole = min(frames, n_total // per_frame)
    return whole * per_frame if whole >= 1 else n_total


def uniform_frames(method: Method, frames: int, per_frame: int) -> list[int] | None:
    """The frames uniform keeps whole (ascending), or None when it keeps part of one frame
    (a budget below one frame: the tower then runs on every frame and the plan picks the tokens)."""
    from vlm_prune.frames.uniform import uniform_indices

    n_total = method.n_keep(frames * per_frame, 1)
    n_frames = n_total // per_frame
    return uniform_indices(frames, n_frames) if n_frames >= 1 else None


def frames_reduction(method: Method, features: torch.Tensor, grid: tuple[int, int], *,
                     text_features: torch.Tensor | None = None, pixels: torch.Tensor | None = None) -> Reduction:
    """The method's reduction of one video's [T, N, D] frame maps (indices into its T * N rows),
    from the same FramesContext wrap() builds (features, grid, the video budget, the question's
    input embeddings, the processor's pixels); its size must equal :func:`frames_slots`."""
    t, n, _ = features.shape
    ctx = FramesContext(features=features, grid=grid, n_total=method.n_keep(t * n, 1), text_features=text_features,
                        pixels=pixels)
    with torch.no_grad():
        plan = method.allocate(ctx)
    red = plan.reduction
    want = frames_slots(method, t, n)
    if red.indices.numel() != want:
        raise RuntimeError(f"vlm_prune: {method.name} kept {red.indices.numel()} tokens of the video, its slots are {want}")
    if red.sizes is not None:
        raise ValueError(f"frames method {method.name!r} merges tokens with sizes, which vLLM's attention cannot weight")
    return red


def is_frames(method: Any) -> bool:
    return getattr(method, "stage", None) == "frames"
