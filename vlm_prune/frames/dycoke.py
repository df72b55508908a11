"""DyCoke's first stage, temporal token merging (TTM) (Tao et al., CVPR 2025, "DyCoke: Dynamic
Compression of Tokens for Fast Video Large Language Models"; official code
KD-TAO/DyCoke@dd7463498203479d0ff6f2d29c4e72928c0af244, ``llava/model/llava_arch.py`` ``dycole_ttm``).

Its second stage, dynamic KV-cache pruning during decoding (``modeling_qwen2.py``
``PrunableDynamicCache.dycoke_pruning``: from layer L=3 on, each decode step attends to the
top (1 - p) of the visual KV entries by the previous step's attention, re-chosen when that
attention changes), is a decode-time engine capability vlm-prune does not have yet; asking for it
(``decode_pruning=True``) is refused.

Stage: frames, on the projected (and pooled) frame tokens; kept tokens stay at their slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.frames.uniform import whole_video
from vlm_prune.frames.vidcom2 import apportion
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register


def ttm_references(t: int) -> list[int | None]:
    """The frame each frame is compared with (None: kept whole), as the official TTM: in each pair
    (i, i + 1), i even, frame i + 1 against frame i; then in each group of four starting at i
    (i < t - 4), frame i + 2 against frame i. An odd last frame, which the official drops, is
    compared with the frame before it here."""
    ref: list[int | None] = [None] * t
    for i in range(0, t - 1, 2):
        ref[i + 1] = i
    for i in range(0, t - 4, 4):
        ref[i + 2] = i
    if t % 2 and t > 1:
        ref[t - 1] = t - 2
    return ref


def ttm_plan(features: torch.Tensor, n_total: int) -> FramesPlan:
    """TTM on frame tokens [T, N, D]: pivot frames (no reference) keep every token; each other frame
    keeps the tokens least similar (cosine, same slot) to its reference frame, the counts
    apportioned so the video keeps n_total (at least the pivot frames' tokens)."""
    t, n, _ = features.shape
    ref = ttm_references(t)
    reduced = [i for i in range(t) if ref[i] is not None]
    pivots = t - len(reduced)
    share = max(0, n_total - pivots * n)
    counts = apportion([share / max(1, len(reduced))] * len(reduced), share, cap=n, at_least_one=False)
    per_frame = [n] * t
    keep = []
    for i in range(t):
        if ref[i] is None:
            keep.append(torch.arange(n, device=features.device) + i * n)
            continue
        k = counts[reduced.index(i)]
        per_frame[i] = k
        if k:
            sim = F.cosine_similarity(F.normalize(features[i].float(), dim=-1),
                                      F.normalize(features[ref[i]].float(), dim=-1), dim=-1)
            keep.append(torch.topk(sim, k, largest=False).indices.sort().values + i * n)
    return FramesPlan(Reduction(torch.cat(keep)), [i for i in range(t) if per_frame[i]], per_frame)


@register
class DyCoke(FramesMethod):
    """DyCoke's temporal token merging (CVPR 2025; KD-TAO/DyCoke@dd74634): in every pair of frames
    the second keeps only the tokens that differ most (lowest cosine, slot by slot) from the first,
    and in every group of four the third likewise against the first; the other frames (pivots) keep
    every token. Tokens stay at their slots, in slot order, with their original position ids (the
    official concatenates a compared frame's tokens in score order and numbers them anew); nothing is
    averaged (the official "merging" drops the similar tokens). See :func:`ttm_plan`.

    Knobs: decode_pruning=False. The official second stage, dynamic KV pruning during decoding
    (layer L=3, keep 1 - p of the visual KV entries by the last token's attention), is not
    implemented: True is refused with the reason.
    Budget: the official k (0.3: a compared frame keeps int(0.7 N) tokens) follows from the budget:
    the pivots keep N tokens each and the compared frames share the rest (within a token of each
    other). Pivots are about T / 4 + 1 of T frames, so a budget below their tokens cannot be met by
    TTM alone (the official reaches lower only through the decode-time pruning): the video then
    keeps the pivots whole (wrap() warns; last_stats has the count). An odd last frame, which the
    official drops, is compared with its predecessor.
    """

    name = "dycoke"
    paper = "DyCoke, CVPR 2025 (arXiv 2411.15024)"

    def __init__(self, keep: float | None = None, budget: int | None = None, decode_pruning: bool = False) -> None:
        super().__init__(keep, budget)
        if decode_pruning:
            raise ValueError(
                "dycoke: decode_pruning=True (DyCoke's dynamic KV-cache pruning during decoding) is not implemented: "
                "vlm-prune's engine cannot yet drop KV entries between decode steps while keeping the cache consistent "
                "with generate(), beams and cache reuse. Use decode_pruning=False (temporal token merging only)"
            )
        self.decode_pruning = decode_pruning

    def budget_warning(self, adapter) -> str | None:
        if self.keep is not None and float(self.keep) >= 1.0:
            return None
        return ("dycoke keeps its pivot frames (about T / 4 + 1 of T frames) whole, as the official TTM; a video whose "
                "budget is below their tokens keeps them all and ends above the budget (the official goes lower only "
                "through decode-time KV pruning, not implemented); last_stats gives the count reached per video")

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        whole = whole_video(ctx)
        return whole if whole is not None else ttm_plan(ctx.features, ctx.n_total)
