"""Frames stage: which frames of a video to keep, and how many tokens each.

Importing registers the frames-stage methods "quota" (QuoTA), "keyscore" (KeyScore + STACFP)
and "uniform"; :func:`select_frames` chooses keyframes outside any model. The video token-reduction
records on the same stage ("vidcom2", "fastvid", "holitom", "dycoke": vlm_prune.frames.vidcom2 ...)
register when the registry loads the built-in methods.
"""
from vlm_prune.frames.keyscore import HFImageTextEncoder, KeyScore, load_encoder
from vlm_prune.frames.quota import QuoTA
from vlm_prune.frames.scorers import vlm_scorer
from vlm_prune.frames.select import FrameSelection, select_frames
from vlm_prune.frames.uniform import Uniform

__all__ = [
    "FrameSelection",
    "HFImageTextEncoder",
    "KeyScore",
    "QuoTA",
    "vlm_scorer",
    "Uniform",
    "load_encoder",
    "select_frames",
]
