"""Standalone keyframe selection: ``vlm_prune.select_frames(video, text, ...)``.

    enc = load_encoder("path/to/clip-vit-base-patch32")
    sel = vlm_prune.select_frames("clip.mp4", "a dog catches a frisbee", budget=8, encoder=enc)
    sel.indices, sel.scores, sel.timestamps
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vlm_prune.frames.keyscore import DEFAULT_WEIGHTS, Encoder, keyscore, load_encoder, top_k_in_order
from vlm_prune.frames.stacfp import stacfp_proposals
from vlm_prune.frames.uniform import uniform_indices
from vlm_prune.video import read_frames

METHODS = ("keyscore", "uniform")


@dataclass
class FrameSelection:
    """indices: chosen frames, ascending, into the frames considered (the array given, or the
    frames decoded from the path). scores: their KeyScores (None for uniform). candidates /
    candidate_scores: the STACFP proposals (or all frames) and their KeyScores. timestamps:
    seconds of the chosen frames when the video was a path."""

    indices: np.ndarray
    scores: np.ndarray | None
    candidates: np.ndarray
    candidate_scores: np.ndarray | None = None
    timestamps: np.ndarray | None = None


def select_frames(
    video: str | os.PathLike | np.ndarray,
    text: str | Sequence[str] = "",
    method: str = "keyscore",
    budget: int = 8,
    encoder: Encoder | str | None = None,
    proposals: str = "stacfp",
    num_frames: int | str | None = None,
    fps: float | None = 1.0,
    weights: tuple[float, float, float] = DEFAULT_WEIGHTS,
    k_max: int = 16,
    gamma_time: float = 0.5,
    seed: int = 0,
) -> FrameSelection:
    """Choose ``budget`` keyframes of a video for a caption / query.

    video: a path (decoded with :func:`vlm_prune.video.read_frames` at ``fps`` frames a second,
        default 1, or ``num_frames`` frames) or uint8 RGB frames [T, H, W, 3].
    method: "keyscore" (STACFP proposals with k in (max(2, budget), max(budget, k_max)), then
        the top ``budget`` by KeyScore; proposals="all" scores every frame) or "uniform".
    encoder: a callable (frames, texts) -> (frame_emb, text_emb), e.g. :func:`load_encoder`'s
        CLIP / SigLIP wrapper, or a checkpoint path / id to load; required for "keyscore".
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a whole number of frames >= 1, got {budget!r}")
    if proposals not in ("stacfp", "all"):
        raise ValueError(f"proposals must be 'stacfp' or 'all', got {proposals!r}")
    timestamps = None
    if isinstance(video, np.ndarray):
        frames = video
    else:
        frames, timestamps = read_frames(video, num_frames=num_frames, fps=None if num_frames else fps)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames must be uint8 [T, H, W, 3] RGB with T >= 1, got {frames.dtype} {frames.shape}")
    t = len(frames)

    def stamp(idx: np.ndarray) -> np.ndarray | None:
        return None if timestamps is None else timestamps[idx]

    if method == "uniform":
        idx = np.asarray(uniform_indices(t, budget), dtype=np.int64)
        return FrameSelection(idx, None, np.arange(t), None, stamp(idx))
    if encoder is None:
        raise ValueError(
            "method='keyscore' needs an image-text encoder: pass encoder='path/to/clip-or-siglip' "
            "(loaded with from_pretrained) or a callable (frames, texts) -> (frame_emb, text_emb)"
        )
    if isinstance(encoder, (str, os.PathLike)):
        encoder = load_encoder(os.fspath(encoder))
    if proposals == "all" or t <= budget:
        cand = np.arange(t, dtype=np.int64)
    else:
        k_lo = max(2, budget)
        cand = stacfp_proposals(frames, (k_lo, max(k_lo, k_max)), gamma_time, seed=seed).indices
    texts = [text] if isinstance(text, str) else list(text)
    frame_emb, text_emb = encoder(frames[cand], texts)
    has_text = any(s.strip() for s in texts)
    scores = keyscore(frame_emb, text_emb if has_text else None, weights).score.numpy()
    pos = top_k_in_order(scores, budget)
    idx = cand[pos]
    return FrameSelection(idx, scores[pos], cand, scores, stamp(idx))
