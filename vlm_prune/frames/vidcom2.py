"""VidCom2: frame-uniqueness-adaptive token compression of a video (Liu et al., EMNLP 2025,
"Video Compression Commander: Plug-and-Play Inference Acceleration for Video Large Language
Models"; official code xuyang-liu16/VidCom2@944a17d14f4848ad080a65eab2b0711a760fa154,
``token_compressor/vidcom2/vidcom2.py``).

Stage: frames, on the video's projected (and, on LLaVA-OneVision, pooled) frame tokens, before
the language model; kept tokens keep their own slots and so their original position ids.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vlm_prune.frames.uniform import whole_video
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register

#: the official multi-scale Gaussian kernel widths: 2^k for k in -3 .. 1
ALPHAS = tuple(2.0 ** k for k in range(-3, 2))


def low_variance_channels(x: torch.Tensor, ratio: float = 0.5) -> torch.Tensor:
    """[M, D] -> [M, int(D * ratio)]: the channels of lowest variance over all M tokens (official
    ``select_low_var_channels``: population variance, ties as torch.topk breaks them)."""
    k = int(x.shape[-1] * ratio)
    idx = torch.topk(x.var(dim=0, unbiased=False), k=k, largest=False).indices
    return x[:, idx]


def gaussian_similarity(x: torch.Tensor, centre: torch.Tensor, alphas: tuple[float, ...] = ALPHAS) -> torch.Tensor:
    """sum_a exp(-||x - centre||^2 / (2 a)) over the last dimension (broadcast)."""
    d2 = ((x - centre) ** 2).sum(-1)
    return sum(torch.exp(-d2 / (2 * a)) for a in alphas)


def vidcom2_scores(features: torch.Tensor, ratio: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(token scores [T, N], frame uniqueness [T]) of a video's frame tokens [T, N, D].

    Tokens are L2-normalised on the low-variance channels; a token's score is its Gaussian
    similarity to the video's mean token plus that to its frame's mean token (low = distinct, kept);
    a frame's uniqueness is minus its tokens' mean similarity to the video's mean token."""
    t, n, d = features.shape
    x = low_variance_channels(features.reshape(t * n, d).float(), ratio).view(t, n, -1)
    x = F.normalize(x, dim=-1)
    video = gaussian_similarity(x, x.mean(dim=(0, 1), keepdim=True))
    frame = gaussian_similarity(x, x.mean(dim=1, keepdim=True))
    return video + frame, -video.mean(dim=-1)


def frame_shares(uniqueness: torch.Tensor, base: float, temperature: float = 0.01) -> torch.Tensor:
    """[T] retention rate of each frame (official ``compute_scales``): base * (1 + p - mean(p)),
    p = softmax((u - max u) / temperature), capped at 1."""
    p = torch.softmax((uniqueness - uniqueness.max()) / temperature, dim=0)
    return (base * (1 + p - p.mean())).clamp(max=1.0)


def apportion(shares: list[float], n_total: int, cap: int | list[int], at_least_one: bool = True) -> list[int]:
    """Whole counts, each at most ``cap`` (one for all, or one per share), adding up to exactly
    min(n_total, sum of the caps), close to the real ``shares``: floors, then the largest remainders
    (ties to the earlier frame), then whatever caps left over to the frames with room, largest share
    first. ``at_least_one``: every frame keeps a token when n_total allows it (the official
    clamp(min=1))."""
    t = len(shares)
    caps = [cap] * t if isinstance(cap, int) else list(cap)
    n_total = min(int(n_total), sum(caps))
    out = [min(c, max(0, math.floor(s))) for c, s in zip(caps, shares)]
    order = sorted(range(t), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    by_share = sorted(range(t), key=lambda i: (-shares[i], i))
    for i in order:  # the largest remainders
        if sum(out) >= n_total:
            break
        out[i] += out[i] < caps[i]
    while sum(out) < n_total:  # what the caps left over: the frames with room, largest share first
        for i in by_share:
            if out[i] < caps[i] and sum(out) < n_total:
                out[i] += 1
    while sum(out) > n_total:  # floors of shares above the total (never with consistent shares)
        i = max(range(t), key=lambda j: (out[j], -j))
        out[i] -= 1
    if at_least_one and n_total >= t:
        for i in range(t):
            if out[i] == 0:
                out[max(range(t), key=lambda j: (out[j], -j))] -= 1
                out[i] = 1
    return out


@register
class VidCom2(FramesMethod):
    """VidCom2 (EMNLP 2025; xuyang-liu16/VidCom2@944a17d): keep each frame's most distinct tokens,
    with more tokens for frames that differ more from the rest of the video.

    On the video's frame tokens [T, N, D] (:func:`vidcom2_scores`): keep the half of the channels
    with the lowest variance over the video, L2-normalise; a token's score is its multi-scale
    Gaussian similarity (widths 2^-3 .. 2) to the video's mean token plus that to its frame's mean
    token; a frame's uniqueness is minus its mean similarity to the video's mean. Frame t keeps
    rate base * (1 + p_t - mean p) of its tokens (:func:`frame_shares`, p = softmax of uniqueness
    / 0.01, capped at 1), the tokens with the LOWEST scores. Kept tokens stay at their own slots
    (original position ids); nothing is merged.

    Knobs (official defaults): channel_ratio=0.5, temperature=0.01.
    Budget: base = budget / (T N), the official ``R_RATIO`` (0.25 in the paper's headline). The
    official code rounds each frame's count on its own (the video total can drift from base T N by
    up to T / 2, and a frame capped at 1.0 gives its surplus away); here the counts are apportioned
    so the video keeps exactly the budget (:func:`apportion`: each frame within one token of the
    official real-valued share, surplus of capped frames to the frames with the largest shares).
    Scores are computed in float32 (the official runs in the model's dtype). Works on any model
    whose frames stage exposes [T, N, D] frame maps (LLaVA-OneVision, Qwen2-VL / 2.5-VL, where a
    "frame" is a temporal slice of 2 frames); batch > 1 compresses each video on its own.
    """

    name = "vidcom2"
    paper = "VidCom2, EMNLP 2025 (arXiv 2505.14454)"

    def __init__(self, keep: float | None = None, budget: int | None = None, channel_ratio: float = 0.5,
                 temperature: float = 0.01) -> None:
        super().__init__(keep, budget)
        if not 0 < channel_ratio <= 1:
            raise ValueError(f"channel_ratio must be in (0, 1], got {channel_ratio!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.channel_ratio = channel_ratio
        self.temperature = temperature

    def counts(self, uniqueness: torch.Tensor, n: int, n_total: int) -> list[int]:
        """Tokens each frame keeps: the official shares, apportioned to exactly ``n_total``."""
        base = n_total / (uniqueness.numel() * n)
        shares = frame_shares(uniqueness, base, self.temperature) * n
        return apportion(shares.tolist(), n_total, n)

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        whole = whole_video(ctx)
        if whole is not None:
            return whole
        n = ctx.features.shape[1]
        device = ctx.features.device
        scores, uniqueness = vidcom2_scores(ctx.features, self.channel_ratio)
        counts = self.counts(uniqueness, n, ctx.n_total)
        kept = [torch.topk(scores[i], k, largest=False).indices + i * n for i, k in enumerate(counts) if k]
        indices = torch.sort(torch.cat(kept)).values.to(device)
        return FramesPlan(Reduction(indices), [i for i, k in enumerate(counts) if k], counts, frame_scores=uniqueness)
