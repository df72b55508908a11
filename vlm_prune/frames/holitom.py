"""HoliTom, outside the LLM: global temporal segmentation + spatio-temporal merging (Shao et al.,
NeurIPS 2025, "HoliTom: Holistic Token Merging for Fast Video Large Language Models"; official
code cokeshao/HoliTom@e9b2972f6895c9e7d7fe74eb8c3a2ecaab8056e0, ``holitom/llava_arch.py``:
select_static_windows, get_static_dynamic_features, merge_tokens_by_attention_density /
by_density / by_clustering, cluster_dpc_knn). Its inner-LLM merge (``holitom/modeling_qwen2.py``, HOLITOM_k /
HOLITOM_r) is :mod:`vlm_prune.methods.holitom_llm`, added by ``inner=True`` (the default); the paper's
"w/o M" variant is this stage alone (``inner=False``).

Stage: frames, on the projected, pooled frame tokens of LLaVA-OneVision (and llm, for the inner merge).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

import torch

from vlm_prune.frames.fastvid import density_scores, tower_salience
from vlm_prune.frames.uniform import whole_video
from vlm_prune.frames.vidcom2 import apportion
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Method, Reduction
from vlm_prune.registry import register


def static_counts(sim: torch.Tensor, tau: float) -> torch.Tensor:
    """[T, T] tokens a window of frames s..e saves by averaging its static tokens: the token
    positions whose consecutive-frame cosine ``sim`` [T - 1, N] exceeds tau all through the window,
    times (e - s); 0 for e <= s."""
    t = sim.shape[0] + 1
    out = torch.zeros(t, t)
    for s in range(t - 1):
        still = torch.cumprod((sim[s:] > tau).long(), dim=0).sum(-1)  # static positions of s..s+1+j
        out[s, s + 1:] = still.float() * torch.arange(1, t - s)
    return out


def static_windows(sim: torch.Tensor, tau: float, max_window: int) -> tuple[list[tuple[int, int]], float]:
    """The partition of the frames into windows (first, last) that saves the most tokens (dynamic
    programming over window ends; a longer window only where it saves strictly more), and the
    tokens it saves."""
    t = sim.shape[0] + 1
    saved = static_counts(sim, tau)
    best = [0.0] * t
    start = [0] * t
    for i in range(t):
        value, first = (best[i - 1] if i else 0.0), i
        for size in range(2, min(i + 1, max_window) + 1):
            j = i - size
            cand = (best[j] if j >= 0 else 0.0) + float(saved[j + 1, i])
            if cand > value:
                value, first = cand, j + 1
        best[i], start[i] = value, first
    windows, i = [], t - 1
    while i >= 0:
        windows.append((start[i], i))
        i = start[i] - 1
    return windows[::-1], best[-1]


def merge_to_centres(x: torch.Tensor, n_centres: int, k: int, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN merge of tokens [M, D] into ``n_centres``: (centre rows, ascending; merged features).
    Centres are the top density-peak scores (k = min(k, n_centres) neighbours); every other token
    joins its nearest centre (Euclidean); a centre with members becomes beta centre + (1 - beta)
    mean(members)."""
    centres = torch.sort(torch.topk(density_scores(x, min(k, n_centres)), n_centres).indices).values
    others = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    others[centres] = False
    rest = torch.nonzero(others).flatten()
    out = x[centres].clone()
    if rest.numel():
        dist = torch.cdist(x[rest].float()[None], x[centres].float()[None])[0]
        owner = dist.argmin(-1)
        for c in range(n_centres):
            members = x[rest[owner == c]]
            if members.shape[0]:
                out[c] = beta * x[centres[c]] + (1 - beta) * members.mean(0)
    return centres, out


def holitom_plan(features: torch.Tensor, attention: torch.Tensor, n_total: int, tau: float = 0.8, d: float = 0.0,
                 beta: float = 0.6, k: int = 7, max_window: int = 1024) -> FramesPlan:
    """HoliTom's outer stage on frame tokens [T, N, D] with per-token salience [T, N]."""
    t, n, dim = features.shape
    x = torch.nn.functional.normalize(features.float(), dim=-1)
    sim = (x[:-1] * x[1:]).sum(-1)  # [T - 1, N] cosine of each token with the same slot in the next frame
    windows, saved = static_windows(sim, tau, max_window) if t > 1 else ([(0, 0)], 0.0)
    if t * n - saved < n_total:  # the static merge alone would undercut the budget: no windows
        windows, saved = [(i, i) for i in range(t)], 0.0
    groups = []  # (kind, frame, slots [m] within the frame, features [m, D], salience [m] | None)
    for first, last in windows:
        static = torch.zeros(n, dtype=torch.bool, device=features.device)
        if last > first:
            static = (sim[first:last] > tau).all(0)
            slots = torch.nonzero(static).flatten()
            if slots.numel():
                groups.append(("static", first, slots, features[first:last + 1, slots].mean(0), None))
        for f in range(first, last + 1):
            slots = torch.nonzero(~static).flatten()
            groups.append(("dynamic", f, slots, features[f, slots], attention[f, slots]))
    rate = n_total / (t * n - saved)
    sizes = [g[2].numel() for g in groups]
    counts = apportion([m * rate for m in sizes], n_total, cap=sizes, at_least_one=False)
    keep, feats = [], []
    for (kind, f, slots, x_g, sal), c in zip(groups, counts):
        if c == 0:
            continue
        if kind == "static":
            rows, merged = merge_to_centres(x_g, c, k, beta)
        else:
            dominant = round(c * (1 - d))
            top = torch.topk(sal.float(), dominant).indices
            rows, merged = top, x_g[top]
            if c > dominant:
                rest = torch.ones(slots.numel(), dtype=torch.bool, device=features.device)
                rest[top] = False
                rest = torch.nonzero(rest).flatten()
                centres, ctx = merge_to_centres(x_g[rest], c - dominant, k, beta)
                rows, merged = torch.cat([rows, rest[centres]]), torch.cat([merged, ctx])
        keep.append(slots[rows] + f * n)
        feats.append(merged.to(features.dtype))
    indices, order = torch.sort(torch.cat(keep))
    per_frame = [int(((indices >= i * n) & (indices < (i + 1) * n)).sum()) for i in range(t)]
    return FramesPlan(Reduction(indices, torch.cat(feats)[order]), [i for i in range(t) if per_frame[i]], per_frame)


@register
class HoliTom(FramesMethod):
    """HoliTom (NeurIPS 2025; cokeshao/HoliTom@e9b2972): outside the LLM, split the video into
    windows of frames that maximise the tokens saved by averaging each window's static tokens (a
    slot whose cosine to the same slot of the next frame stays above tau through the window) into
    one (global temporal segmentation by dynamic programming); then merge each window's static
    tokens by DPC-kNN clustering and keep each frame's most attended dynamic tokens (spatio-temporal
    merging). See :func:`holitom_plan`. Inside the LLM (``inner=True``, the paper's full method;
    :class:`vlm_prune.methods.holitom_llm.HoliTomMerge`): before decoder layer ``layer`` each video
    keeps the tokens the last prompt token attends to most in the layer before and folds every other
    one into its most similar kept token. ``inner=False`` is the paper's "w/o M" (the outer stage
    alone, a frames method that combines with vision methods and runs in vLLM).

    Knobs (official defaults): tau=0.8 (T: the code's default and its scripts' at RETAIN_RATIO 0.15 -
    0.25; their RETAIN_RATIO=0.10 runs set T=0.65, so ``tau=0.65`` reproduces those), d=0.0 (D: share
    of a frame's dynamic tokens merged as DPC-kNN contextual tokens instead of kept by attention),
    beta=0.6 (BETA: the centre's weight in its merged token; the official's NO_BETA switch, a plain
    mean, is not offered), k=7 (K, capped at the number of centres, as the official),
    max_window=1024; inner=True, layer=18 (HOLITOM_k), r=0.5 (HOLITOM_r: the share of a video's
    tokens merged inside the LLM) - the values of the official README and of its 7B scripts (the code's
    fallback k=3 is never reached: its merge runs only when both are set; the 72B script sets neither,
    so its runs are the outer stage alone, ``inner=False``; one of them sets FASTV_k=60 / FASTV_r=0.5,
    which HoliTom's code does not read); retain=0.1 (RETAIN_RATIO: the share of a video's tokens the
    outer stage keeps without keep / budget).
    Salience: the attention each token receives in the vision tower's last layer, averaged over
    queries and heads and bilinearly pooled to the frame grid - the official's signal - on
    LLaVA-OneVision; on Qwen2-VL / 2.5-VL video (no official version) a frame is a temporal slice and
    the salience is FastVID's official Qwen2.5-VL signal from the tower's last block (the slice's mean
    query against each merged token's mean key; :class:`~vlm_prune.adapters.vision_towers.QwenTowerTap`).
    wrap() refuses other models. Positions: each kept token keeps its own
    slot and position id; a window's static token sits at its slot in the window's first frame (the
    official "grid" layout; its "one_token" layout packs the tokens without gaps).
    Budget: keep / budget is the video's visual tokens reaching the last layer. With the inner merge
    the outer stage keeps min(T N, round(target / (1 - r))) and the merge lands on the target (the
    official budgeted runs fix HOLITOM_r=0.5 and set the outer RETAIN_RATIO: keep=0.075 is their
    RETAIN_RATIO=0.15); without it the outer stage keeps the target. Without keep / budget: the
    outer stage keeps floor(retain T N), the merge round(L (1 - r)) of the L that enter the LLM (the
    official's count). Within the outer stage: the official retain ratio r = budget / (T N), raised
    to budget / (tokens left after the static averaging); the official rounds each group's count
    (round for static, ceil for dynamic frames), here the counts are apportioned so the video keeps
    exactly the stage's count. When averaging alone would leave fewer tokens than that, no windows
    are formed. The official density adds 1e-6 random noise to break ties; exact ties go to the
    lower index here. The official inner merge spans the video's placeholder rows, its newline
    included, and runs on batch 1 (sample 0's attention for all); here it spans each video's visual
    tokens (the newline is never merged) and every sample, and every video of a sample, on its own.
    """

    name = "holitom"
    paper = "HoliTom, NeurIPS 2025 (arXiv 2505.21334)"
    budget_note = ("the video's tokens reaching the last layer: the outer stage keeps round(target / (1 - r)), the "
                   "inner merge lands on the target (inner=False: the outer stage keeps it); without keep / budget "
                   "the official retain=0.1 outside, then r=0.5 merged before layer 18")
    supported = ("llava_onevision", "qwen2_vl")
    family_notes = {"qwen2_vl": "a frame is a temporal slice; no official Qwen version: FastVID's Qwen2.5-VL salience"}
    own_schedule = True
    wants_tower_attention = True
    resizes_frames = True  # merged tokens: new features without a tower row of their own
    #: the stages it runs in (``vlm-prune methods``); inner=False runs in the frames stage alone
    needs_stages: ClassVar[tuple[str, ...]] = ("frames", "llm")

    def __init__(self, keep: float | None = None, budget: int | None = None, tau: float = 0.8, d: float = 0.0,
                 beta: float = 0.6, k: int = 7, max_window: int = 1024, inner: bool = True, layer: int = 18,
                 r: float = 0.5, retain: float = 0.1) -> None:
        super().__init__(keep, budget)
        if not 0 <= d < 1:
            raise ValueError(f"d (contextual share) must be in [0, 1), got {d!r}")
        if not 0 <= beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        for name, value, low in (("k", k, 1), ("max_window", max_window, 1), ("layer", layer, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
        if not isinstance(inner, bool):
            raise ValueError(f"holitom inner must be True (the inner-LLM merge, the full method) or False (the outer "
                             f"stage alone, the paper's 'w/o M'), got {inner!r}")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ValueError(f"holitom r (HOLITOM_r, the share merged inside the LLM) must be in [0, 1), got {r!r}")
        if isinstance(retain, bool) or not isinstance(retain, (int, float)) or not 0 < retain <= 1:
            raise ValueError(f"holitom retain (RETAIN_RATIO, the share the outer stage keeps without keep / budget) "
                             f"must be in (0, 1], got {retain!r}")
        self.tau, self.d, self.beta, self.k, self.max_window = tau, d, beta, k, max_window
        self.inner, self.layer, self.r, self.retain = inner, layer, float(r), float(retain)

    @property
    def targeted(self) -> bool:
        """True when keep / budget set the video's final count (else the official retain / r)."""
        return self.keep is not None or self.budget is not None

    def companions(self, others: dict[str, Method]) -> list[Method]:
        if not self.inner:
            return []
        if others:
            raise ValueError(
                f"holitom (inner=True) merges in the frames and llm stages itself and hands its llm stage each "
                f"video's count; it cannot be combined with {', '.join(repr(m.name) for m in others.values())}: wrap "
                "with 'holitom' alone, or pass inner=False (its outer stage alone, the paper's 'w/o M')")
        from vlm_prune.methods.holitom_llm import HoliTomMerge

        return [HoliTomMerge(self)]

    def n_keep(self, n_tokens: int, n_images: int = 1, n_original: int | None = None) -> int:
        """Tokens the outer stage keeps of a video's ``n_tokens`` (see the class's Budget)."""
        if n_tokens <= 0:
            return 0
        if not self.targeted:
            return max(1, min(n_tokens, math.floor(self.retain * n_tokens + 1e-9)))
        if not self.inner:
            return super().n_keep(n_tokens, n_images, n_original)
        return min(n_tokens, round(self.target_count(n_tokens, n_images) / (1 - self.r)))

    def inner_count(self, entering: int, n_tokens: int) -> int:
        """Tokens the inner merge keeps of the ``entering`` ones of a video of ``n_tokens``."""
        if not self.targeted:  # (at least one: the official would fold every token into none)
            return min(entering, max(1, round(entering * (1 - self.r))))
        return min(entering, self.target_count(n_tokens, 1))

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        plan = whole_video(ctx)
        if plan is None:
            plan = holitom_plan(ctx.features, tower_salience(ctx, self.name), ctx.n_total, self.tau, self.d, self.beta,
                                self.k, self.max_window)
        if not self.inner:
            return plan
        t, n, _ = ctx.features.shape
        kept = int(plan.reduction.indices.numel())
        groups = torch.zeros(kept, dtype=torch.long, device=ctx.features.device)  # the video is one group
        return replace(plan, groups=groups, group_keep=[self.inner_count(kept, t * n)])
