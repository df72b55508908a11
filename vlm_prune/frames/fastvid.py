"""FastVID: dynamic temporal segmentation + density-based spatio-temporal pruning (Shen et al.,
NeurIPS 2025, "FastVID: Dynamic Density Pruning for Fast Video Large Language Models"; official code
LunarShen/FastVID@a40a109cb8df20e8c2c17c6850f8269717369990, the LLaVA-OneVision version
``fastvid_llavaonevision/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py`` (DySeg,
STPrune = ATS + density-based DTM) and ``llava_arch.py`` (the frame signals)).

Stage: frames, on the projected, pooled frame tokens; salient tokens stay at their own slots, each
context token (anchor) keeps its slot with its merged feature, so every kept token keeps its
original position id, as the official code (it keeps the positions of the kept rows).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from vlm_prune.frames.uniform import whole_video
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register


def dynamic_segments(global_features: torch.Tensor, c: int, tau: float) -> list[int]:
    """DySeg: segment lengths of T frames from their global features [T, D]: cut after the c - 1
    least similar consecutive pairs (cosine) and after every pair less similar than ``tau``."""
    t = global_features.shape[0]
    if t == 1:
        return [1]
    g = F.normalize(global_features.float(), dim=-1)
    sim = (g[:-1] * g[1:]).sum(-1)
    cuts = set(torch.topk(sim, min(c - 1, t - 1), largest=False).indices.tolist())
    cuts |= set(torch.nonzero(sim < tau).flatten().tolist())
    bounds = [-1, *sorted(cuts), t - 1]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def density_scores(x: torch.Tensor, k: int = 4) -> torch.Tensor:
    """Density-peak score of tokens [M, D]: local density exp(-mean squared distance to the k
    nearest, itself included; distances / sqrt(D)) times the distance to the nearest denser token
    (the largest distance of the set for the densest)."""
    m, d = x.shape
    dist = torch.cdist(x.float()[None], x.float()[None])[0] / math.sqrt(d)
    near = torch.topk(dist, min(k, m), dim=-1, largest=False).values
    density = torch.exp(-(near**2).mean(-1))
    denser = density[None, :] > density[:, None]
    parent = torch.where(denser, dist, dist.max()).min(dim=-1).values
    return parent * density


def merge_into_anchors(tokens: torch.Tensor, anchors: torch.Tensor, beta: float) -> torch.Tensor:
    """DTM: every token [M, D] joins its most cosine-similar anchor [K, D]; an anchor becomes
    w anchor + (1 - w) mean(its members), w = max(beta, 1 / (members + 1))."""
    sim = F.normalize(tokens.float(), dim=-1) @ F.normalize(anchors.float(), dim=-1).t()
    onehot = F.one_hot(sim.argmax(-1), anchors.shape[0]).to(tokens.dtype)  # [M, K]
    count = onehot.sum(0)[:, None]
    mean = (onehot.t() @ tokens) / count.clamp(min=1)
    w = (1 / (count + 1)).clamp(min=beta)
    return w * anchors + (1 - w) * mean


def frame_counts(sizes: list[int], n: int, n_total: int, d: float, p: int,
                 top_up: bool = True) -> tuple[list[int], list[int]]:
    """(salient, context) tokens of each frame. Each frame retains r = n_total // T: r - int(r d)
    salient tokens; the context share int(r d) of a segment of L frames (L int(r d)) goes to its
    anchor frames - the last frame and every p-th one before it - as L int(r d) // ceil(L / p)
    each. ``top_up``: whatever the floors leave of n_total goes to salient tokens, one per frame
    from the first, within each frame's tokens (False: the official counts, a few tokens short)."""
    t = sum(sizes)
    retain = n_total // t
    context = int(retain * d)
    salient = [retain - context] * t
    ctx = [0] * t
    start = 0
    for length in sizes:
        anchors = math.ceil(length / p)
        for j in range(length):
            if (length - 1 - j) % p == 0:
                ctx[start + j] = min(context * length // anchors, n - salient[start + j])
        start += length
    if top_up:
        _top_up(salient, ctx, n, n_total - sum(salient) - sum(ctx), range(t))
    return salient, ctx


def _top_up(salient: list[int], ctx: list[int], n: int, left: int, frames: Iterable[int]) -> int:
    """Give ``left`` more salient tokens, one per frame of ``frames`` in turn while a frame has
    room (``n`` tokens); returns how many found no room."""
    while left > 0:
        grew = False
        for i in frames:
            if left and salient[i] + ctx[i] < n:
                salient[i] += 1
                left -= 1
                grew = True
        if not grew:
            break
    return left


def _even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` whole shares, the remainder one each to the first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def qwen_frame_counts(sizes: list[int], sim: torch.Tensor, n: int, n_total: int, d: float, p: int,
                      ignore: float, top_up: bool = True) -> tuple[list[int], list[int]]:
    """(salient, context) tokens of each frame as the official Qwen2.5-VL version allocates them.
    Each segment of L frames retains L r (r = n_total // T): context max(int(L r d), 1) (0 when
    r = 0), the rest salient. A one-frame segment keeps both. A longer one splits into runs of
    frames whose consecutive cosine ``sim`` [T - 1] stays >= ``ignore``; only a run's last frame
    keeps tokens:
    the runs share the salient tokens evenly (the remainder from the first run), and the context
    goes evenly to every p-th run counted from the segment's last, each capped at half a frame (the
    run's salient tokens then at the frame's other tokens). ``top_up``: whatever the floors and caps
    leave of n_total goes to salient tokens, one per frame from the first, first to the frames that
    keep tokens (each run's last), then to the others (False: the official counts, which end short:
    a run keeps at most one frame's tokens however many frames it stands for)."""
    t = sum(sizes)
    retain = n_total // t
    salient, ctx = [0] * t, [0] * t
    keeping = [False] * t  # a segment's frame that keeps tokens: one alone, or the last of its run
    start = 0
    for length in sizes:
        context = min(max(int(retain * length * d), 1), retain * length)  # none below a token per frame
        share = retain * length - context
        if length == 1:
            salient[start], ctx[start] = share, context
            keeping[start] = True
        else:
            cuts = [j for j in range(length - 1) if float(sim[start + j]) < ignore]
            bounds = [-1, *cuts, length - 1]
            runs = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            sal = _even(share, len(runs))
            anchored = _even(context, math.ceil(len(runs) / p))
            run_ctx = [min(anchored[i // p], n // 2) if i % p == 0 else 0 for i in range(len(runs))][::-1]
            last = start - 1
            for run, s_run, c_run in zip(runs, sal, run_ctx):
                last += run
                keeping[last] = True
                ctx[last] = c_run
                salient[last] = min(s_run, n - c_run)
        start += length
    if top_up:
        left = _top_up(salient, ctx, n, n_total - sum(salient) - sum(ctx), [i for i in range(t) if keeping[i]])
        _top_up(salient, ctx, n, left, [i for i in range(t) if not keeping[i]])
    return salient, ctx


def tower_salience(ctx: FramesContext, method: str) -> torch.Tensor:
    """[T, N] attention each frame token receives in the vision tower (FramesContext.tower_attention)."""
    if ctx.tower_attention is None:
        raise ValueError(f"{method} needs the vision tower's attention for each frame (FramesContext.tower_attention), "
                         "which the LLaVA-OneVision and Qwen2-VL / 2.5-VL adapters compute for video; this model's "
                         "adapter gave none")
    device = ctx.features.device
    return torch.stack([ctx.tower_attention(i)[0].to(device) for i in range(ctx.features.shape[0])])


def fastvid_plan(features: torch.Tensor, attention: torch.Tensor, n_total: int, c: int = 8, tau: float = 0.9,
                 d: float = 0.4, p: int = 4, beta: float = 0.6, ignore: float | None = None,
                 top_up: bool = True) -> FramesPlan:
    """FastVID on frame tokens [T, N, D] with per-token salience [T, N] (the tower's attention).
    ``ignore`` None: the official OneVision version; a float: the official Qwen2.5-VL version
    (:func:`qwen_frame_counts`, and an anchor frame's own anchors stay out of the tokens merged
    into them). ``top_up`` False: the official counts, short of n_total (:func:`frame_counts`)."""
    t, n, dim = features.shape
    g = F.normalize(features.mean(1).float(), dim=-1)
    sizes = dynamic_segments(features.mean(1), c, tau)
    if ignore is None:
        salient, ctx = frame_counts(sizes, n, n_total, d, p, top_up)
    else:
        salient, ctx = qwen_frame_counts(sizes, (g[:-1] * g[1:]).sum(-1), n, n_total, d, p, ignore, top_up)
    keep, feats = [], []
    rest_idx, rest_score = [], []
    for i in range(t):
        top = torch.topk(attention[i].float(), salient[i]).indices
        mask = torch.ones(n, dtype=torch.bool, device=features.device)
        mask[top] = False
        rest = torch.nonzero(mask).flatten()
        keep.append(top + i * n)
        feats.append(features[i, top])
        rest_idx.append(rest)
        rest_score.append(density_scores(features[i, rest]) if rest.numel() else rest.float())
    start = 0
    for length in sizes:
        seg = range(start, start + length)
        pool = torch.cat([features[j, rest_idx[j]] for j in seg])  # the segment's non-salient tokens
        offsets = [0, *torch.tensor([rest_idx[j].numel() for j in seg]).cumsum(0).tolist()]
        for k, j in enumerate(seg):
            if ctx[j] == 0:
                continue
            pick = torch.topk(rest_score[j], min(ctx[j], rest_idx[j].numel())).indices
            keep.append(rest_idx[j][pick] + j * n)
            members = pool
            if ignore is not None:  # Qwen2.5-VL version: the frame's own anchors are not merged into them
                own = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
                own[pick + offsets[k]] = False
                members = pool[own]
            feats.append(merge_into_anchors(members, features[j, rest_idx[j][pick]], beta).to(features.dtype))
        start += length
    indices, order = torch.sort(torch.cat(keep))
    counts = [int(((indices >= i * n) & (indices < (i + 1) * n)).sum()) for i in range(t)]
    return FramesPlan(Reduction(indices, torch.cat(feats)[order]), [i for i in range(t) if counts[i]], counts)


@register
class FastVID(FramesMethod):
    """FastVID (NeurIPS 2025; LunarShen/FastVID@a40a109): segment the video where consecutive frames
    change (DySeg), then per frame keep the most attended tokens (ATS) and a few density-peak
    anchors into which the other tokens of the frame - of the whole segment, at its anchor frames -
    are merged (density-based DTM). See :func:`fastvid_plan`.

    Knobs (official LLaVA-OneVision defaults): segments c=8 (DySeg_c), tau=0.9 (DySeg_tau),
    context d=0.4 (STPrune_d, the context share of each frame's tokens), anchor_stride p=4 (DTM_p),
    beta=0.6 (DTM_beta, the least weight an anchor keeps of itself), ignore=None (DySeg_ignore; below).
    Signals: a frame's global feature is the mean of its tokens (as the official Qwen2.5-VL
    version; the OneVision version uses SigLIP's pooling-head output, which Hugging Face's
    LLaVA-OneVision does not compute), and a token's salience is the attention it receives in the
    vision tower's feature layer averaged over queries and heads, bilinearly pooled to the frame
    grid as the model pools the features (the official OneVision version: the pooling head's probe
    attention, pooled the same way). On Qwen2-VL / Qwen2.5-VL video a frame is a temporal slice and
    the salience is the official Qwen2.5-VL version's: in the tower's last block, the softmax of the
    slice's mean query against each merged (2 x 2) token's mean key, averaged over heads
    (:class:`~vlm_prune.adapters.vision_towers.QwenTowerTap`; Qwen2-VL, which the official does not
    cover, gets the same). ``ignore`` (DySeg_ignore, default None: the OneVision version's allocation)
    switches to the official Qwen2.5-VL version's (:func:`qwen_frame_counts`: within a segment only
    the last of a run of frames at least ``ignore`` similar to the next keeps tokens, each segment's
    context at least 1 token and at most half a frame per anchor; an anchor frame's own anchors are
    not merged into them): ``FastVID(tau=0.84, ignore=0.95)`` is the official Qwen2.5-VL setting
    (its retention 0.27 is the budget's business: keep=0.27). Needs that tower attention:
    LLaVA-OneVision and Qwen2-VL / 2.5-VL video (wrap() refuses other models).
    Budget: retention ratio = budget / (T N), the official ``retention_ratio`` (0.10 at the paper's
    headline). ``top_up`` (default True): the tokens the official floors and caps leave unspent go to
    salient tokens, so the video keeps exactly the budget; ``top_up=False`` keeps the official counts
    (wrap() only: the vLLM plugin fixes a video's slots before its content is known).
    On OneVision those end a few tokens short (the floors); on Qwen2.5-VL (``ignore``) a run of alike
    frames keeps at most one frame's tokens however many frames it stands for, so near-duplicate
    videos end far short, more so the more frames a segment holds: 16 slices of 416 tokens at keep
    0.25 keep as few as 1,144 of 1,664 (31% short), 32 slices of 256 at keep 0.27 as few as 926 of
    2,211 (58%) (the official script notes 24.1% of tokens kept at its 27% on Video-MME). Merged anchors carry no proportional-attention size (the official
    code has none). The official density adds 1e-6 random noise to break ties; here exact ties go
    to the lower index.
    """

    name = "fastvid"
    paper = "FastVID, NeurIPS 2025 (arXiv 2503.11187)"
    supported = ("llava_onevision", "qwen2_vl")
    family_notes = {"qwen2_vl": "a frame is a temporal slice, salience the official Qwen2.5-VL signal; the official "
                                "Qwen2.5-VL allocation with ignore=0.95 (its setting: tau=0.84, ignore=0.95)"}
    wants_tower_attention = True
    resizes_frames = True  # merged tokens: new features without a tower row of their own

    def __init__(self, keep: float | None = None, budget: int | None = None, c: int = 8, tau: float = 0.9,
                 d: float = 0.4, p: int = 4, beta: float = 0.6, ignore: float | None = None,
                 top_up: bool = True) -> None:
        super().__init__(keep, budget)
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"c (DySeg segments) must be a whole number >= 1, got {c!r}")
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"p (DTM anchor stride) must be a whole number >= 1, got {p!r}")
        if not 0 <= d < 1:
            raise ValueError(f"d (context share) must be in [0, 1), got {d!r}")
        if not 0 <= beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, (int, float))):
            raise ValueError(f"ignore (DySeg_ignore, a cosine threshold) must be a number or None, got {ignore!r}")
        if not isinstance(top_up, bool):
            raise ValueError(f"top_up must be True (spend the budget) or False (the official counts), got {top_up!r}")
        self.c, self.tau, self.d, self.p, self.beta, self.ignore = c, tau, d, p, beta, ignore
        self.top_up = top_up

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        whole = whole_video(ctx)
        if whole is not None:
            return whole
        return fastvid_plan(ctx.features, tower_salience(ctx, self.name), ctx.n_total, self.c, self.tau, self.d,
                            self.p, self.beta, self.ignore, self.top_up)
