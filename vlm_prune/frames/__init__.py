"""Frames stage: which frames of a video to keep, and how many tokens each.

The frames-stage methods "quota" (QuoTA), "keyscore" (KeyScore + STACFP) and "uniform", and the
video token-reduction records on the same stage ("vidcom2", "fastvid", "holitom", "dycoke":
vlm_prune.frames.vidcom2 ...; "prunevid", whose merge runs here and its selection in the LLM),
register when their modules are imported (the registry does that);
:func:`select_frames` chooses keyframes outside any model. The names below are imported on first
use, so that ``vlm-prune keyframes --help`` (this package's ``cli``) does not import torch.
"""
from __future__ import annotations

from typing import Any

from vlm_prune import lazy_attribute

_EXPORTS = {
    "FrameSelection": "vlm_prune.frames.select",
    "HFImageTextEncoder": "vlm_prune.frames.keyscore",
    "KeyScore": "vlm_prune.frames.keyscore",
    "QuoTA": "vlm_prune.frames.quota",
    "vlm_scorer": "vlm_prune.frames.scorers",
    "Uniform": "vlm_prune.frames.uniform",
    "load_encoder": "vlm_prune.frames.keyscore",
    "select_frames": "vlm_prune.frames.select",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
