"""PruneVid: static / dynamic token merging of a video, then question-guided selection inside the
LLM (Huang, Zhou and Han, ACL 2025, "PruneVid: Visual Token Pruning for Efficient Video Large
Language Models"; official code Visual-AI/PruneVid@b12600c6176c606ee4b6b7d9e26f4aa46d0dfd42, the
PLLaVA release: ``models/pllava/modeling_pllava.py`` (``merge_frames_dynamic``, ``cluster_dpc_knn``,
``refine_clusters``, ``segment_lengths``, ``spatial_merge_tokens``), ``models/pllava/llama.py``
(``LlamaModelVTP``) and ``models/pllava/elastic_cache.py`` (``VTPWindowCache``); defaults from
``scripts/eval.sh``).

Two stages, one name: :class:`PruneVidMerge` (frames stage, on the projected and pooled frame
tokens) merges the video; :class:`PruneVid` (llm stage, the registered method) keeps, in every
group the merge made, the tokens the question attends to most. wrap() adds the merge when the
user names "prunevid" (``Method.companions``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from vlm_prune.frames.fastvid import density_scores
from vlm_prune.frames.uniform import whole_video
from vlm_prune.frames.vidcom2 import apportion
from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, LayerContext, LLMMethod, Method, Reduction
from vlm_prune.methods.fastv import keep_all_rows
from vlm_prune.registry import register

#: the official clusters a group of tokens only when it has more than this many (``> 14``)
MIN_CLUSTER_TOKENS = 14


# ---- the merge (frames stage) -------------------------------------------------------------------
def dpc_knn(x: torch.Tensor, n_clusters: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DPC-kNN clustering of rows [M, D] into ``n_clusters``: (centre rows [n] in descending score
    order, cluster of every row [M]). Score = density (exp of minus the mean squared distance to the
    k nearest, distances / sqrt(D)) times the distance to the nearest denser row; the n best are the
    centres; every row joins its nearest centre (the first in score order on a tie), a centre itself."""
    m = x.shape[0]
    centres = torch.topk(density_scores(x, min(k, m)), n_clusters).indices
    dist = torch.cdist(x.float()[None], x[centres].float()[None])[0]
    assign = dist.argmin(-1)
    assign[centres] = torch.arange(n_clusters, device=x.device)
    return centres, assign


def runs(labels: list[int]) -> list[tuple[int, int, int]]:
    """(label, first, last) of each run of equal consecutive labels."""
    out: list[tuple[int, int, int]] = []
    for i, lab in enumerate(labels):
        if out and out[-1][0] == lab:
            out[-1] = (lab, out[-1][1], i)
        else:
            out.append((lab, i, i))
    return out


def refine_labels(labels: list[int]) -> list[int]:
    """Make frame clusters contiguous in time (the official ``refine_clusters``): a cluster keeps its
    longest runs (every run of the longest length; none when that length is 1); the frames of every
    other run are re-labelled, run by run from the first frame, with the label of the longer
    neighbouring run (the left one on a tie, 0 with no neighbour)."""
    out = list(labels)
    longest: dict[int, int] = {}
    for lab, a, b in runs(labels):
        longest[lab] = max(longest.get(lab, 0), b - a + 1)
    for lab, a, b in runs(labels):
        if longest[lab] == 1 or b - a + 1 < longest[lab]:
            out[a:b + 1] = [-1] * (b - a + 1)
    while -1 in out:
        pieces = runs(out)
        j = next(i for i, r in enumerate(pieces) if r[0] == -1)
        _, a, b = pieces[j]
        left = pieces[j - 1] if j > 0 else None
        right = pieces[j + 1] if j + 1 < len(pieces) else None
        left_len = left[2] - left[1] + 1 if left else 0
        right_len = right[2] - right[1] + 1 if right else 0
        if right is not None and (right_len > left_len or left is None):
            new = right[0]
        else:
            new = left[0] if left is not None else 0
        out[a:b + 1] = [new] * (b - a + 1)
    return out


def temporal_segments(frames: torch.Tensor, ratio: float, k: int) -> list[int]:
    """Lengths of the scenes of frame tokens [T, N, D]: the frames' mean tokens clustered by DPC-kNN
    into int(T ratio) clusters (at least 1), made contiguous (:func:`refine_labels`), cut where the
    label changes."""
    t = frames.shape[0]
    _, assign = dpc_knn(frames.float().mean(1), max(1, int(t * ratio)), k)
    return [b - a + 1 for _, a, b in runs(refine_labels(assign.tolist()))]


def static_slots(window: torch.Tensor, tau: float) -> torch.Tensor:
    """[N] bool: the slots of a window of frames [W, N, D] whose tokens' mean cosine similarity over
    all pairs of different frames exceeds ``tau`` (none for a single frame)."""
    w = window.shape[0]
    if w < 2:
        return torch.zeros(window.shape[1], dtype=torch.bool, device=window.device)
    u = F.normalize(window.float(), dim=-1)
    total = u.sum(0)
    pairs = (total * total).sum(-1) - (u * u).sum(-1).sum(0)  # sum over ordered pairs i != j of u_i . u_j
    return pairs / (w * (w - 1)) > tau


@dataclass
class Group:
    """Tokens merged together and then selected from together: a window's static tokens (averaged
    over its frames, placed in its first frame) or one frame's dynamic tokens.

    frame: the frame whose slots the group's tokens take; slots: [m] those slots; features: [m, D];
    members: [m] lists of the video's flat slots (frame * N + slot) each token stands for."""

    frame: int
    slots: torch.Tensor
    features: torch.Tensor
    members: list[list[int]]


def video_groups(frames: torch.Tensor, segments: list[int], tau: float) -> list[Group]:
    """The groups of a video [T, N, D] cut into ``segments``: per window its static tokens (the slot's
    mean over the window), then each frame's dynamic tokens (official order)."""
    n = frames.shape[1]
    out, start = [], 0
    for length in segments:
        window = range(start, start + length)
        still = static_slots(frames[start:start + length], tau)
        slots = torch.nonzero(still).flatten()
        if slots.numel():
            out.append(Group(start, slots, frames[start:start + length, slots].float().mean(0).to(frames.dtype),
                             [[f * n + s for f in window] for s in slots.tolist()]))
        moving = torch.nonzero(~still).flatten()
        for f in window:
            if moving.numel():
                out.append(Group(f, moving, frames[f, moving], [[f * n + s] for s in moving.tolist()]))
        start += length
    return out


def merge_group(group: Group, count: int, k: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """``group`` merged into ``count`` tokens by DPC-kNN (every token as it is when count covers the
    group): (slots [count], features [count, D] = each cluster's plain mean, members of each)."""
    m = group.slots.numel()
    if count >= m:
        return group.slots, group.features, group.members
    centres, assign = dpc_knn(group.features, count, k)
    total = torch.zeros(count, group.features.shape[1], dtype=torch.float32, device=group.features.device)
    total.index_add_(0, assign, group.features.float())
    size = torch.bincount(assign, minlength=count).float()
    members: list[list[int]] = [[] for _ in range(count)]
    for j, c in enumerate(assign.tolist()):
        members[c].extend(group.members[j])
    return group.slots[centres], (total / size[:, None]).to(group.features.dtype), members


def official_counts(sizes: list[int], cluster_ratio: float) -> list[int]:
    """Tokens each group is merged into: int(m cluster_ratio) when it has more than 14, else all."""
    return [int(m * cluster_ratio) if m > MIN_CLUSTER_TOKENS else m for m in sizes]


def prunevid_plan(features: torch.Tensor, tau: float = 0.8, temporal_ratio: float = 0.25, cluster_ratio: float = 0.5,
                  alpha: float = 0.4, k: int = 7, target: int | None = None) -> FramesPlan:
    """PruneVid's merge of frame tokens [T, N, D], and what its llm stage keeps of each group.

    ``target`` None: the official counts (groups of more than 14 tokens merged into int(m
    cluster_ratio), then int(alpha m') of each kept in the LLM). ``target`` B (< T N): the visual
    tokens to reach the last layer. When the official merge leaves M >= B, the merge is the
    official one and the llm stage keeps B, shared over the groups in proportion to their tokens
    (:func:`apportion`, each within one token of the real share); when M < B, the groups are merged
    into B tokens in all (the same sharing over the tokens before clustering; without the static
    averaging when even that leaves fewer than B) and the llm stage keeps them all."""
    t, n, _ = features.shape
    groups = video_groups(features, temporal_segments(features, temporal_ratio, k), tau)
    sizes = [g.slots.numel() for g in groups]
    counts = official_counts(sizes, cluster_ratio)
    if target is None:
        keep = [int(c * alpha) for c in counts]
    elif sum(counts) >= target:
        keep = apportion([c * target / sum(counts) for c in counts], target, cap=counts, at_least_one=False)
    else:
        if sum(sizes) < target:  # the static averaging alone undercuts the target: no static tokens
            groups = video_groups(features, [1] * t, tau)
            sizes = [g.slots.numel() for g in groups]
        counts = apportion([m * target / sum(sizes) for m in sizes], target, cap=sizes, at_least_one=False)
        keep = list(counts)
    slots, feats, ids, into = [], [], [], torch.full((t * n,), -1, dtype=torch.long, device=features.device)
    for gid, (group, count) in enumerate(zip(groups, counts)):
        if count == 0:
            continue
        g_slots, g_feats, members = merge_group(group, count, k)
        flat = g_slots + group.frame * n
        slots.append(flat)
        feats.append(g_feats)
        ids.append(torch.full((flat.numel(),), gid, dtype=torch.long, device=features.device))
        for token, mem in zip(flat.tolist(), members):
            into[mem] = token
    flat, order = torch.sort(torch.cat(slots))
    per_frame = torch.bincount(flat // n, minlength=t).tolist()
    return FramesPlan(Reduction(flat, torch.cat(feats)[order], merged_into=into),
                      [i for i in range(t) if per_frame[i]], per_frame, groups=torch.cat(ids)[order], group_keep=keep)


class PruneVidMerge(FramesMethod):
    """PruneVid's frames stage (see :func:`prunevid_plan`); wrap() adds it for "prunevid", whose
    knobs and budget it reads."""

    name = "prunevid"
    paper = "PruneVid, ACL 2025 (arXiv 2412.16117)"
    own_schedule = True
    resizes_frames = True  # merged tokens: new features without a tower row of their own

    def __init__(self, owner: "PruneVid") -> None:
        super().__init__()
        self.owner = owner

    def describe(self) -> dict[str, Any]:
        return {**self.owner.describe(), "stage": self.stage}

    def n_keep(self, n_tokens: int, n_images: int = 1, n_original: int | None = None) -> int:
        return self.owner.target_count(n_tokens, n_images)  # the video's final target: the merge plans both stages

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        o = self.owner
        target = None
        if o.keep is not None or o.budget is not None:
            whole = whole_video(ctx)
            if whole is not None:  # a target covering the video: nothing merged, nothing grouped, nothing selected
                return whole
            target = ctx.n_total
        return prunevid_plan(ctx.features, o.tau, o.temporal_ratio, o.cluster_ratio, o.alpha, o.k, target)


# ---- the selection (llm stage) ------------------------------------------------------------------
def question_attention(ctx: LayerContext) -> torch.Tensor:
    """[B, S] the most attention any question row pays each row, over heads and question rows (the
    official max over heads, then over queries), in ``ctx.layer_module``, computed on the side one
    head at a time. Question rows: the valid rows after the last visual row (``ctx.text``)."""
    b, s = ctx.valid.shape
    n_text = max(1, int(ctx.text.sum(1).max()))
    order = torch.argsort(ctx.text.int(), dim=1, descending=True, stable=True)[:, :n_text]  # [B, Q]
    row_ok = torch.gather(ctx.text, 1, order)
    q, k = ctx.project_qk(ctx.hidden, ctx.positions, rope=True, q_rows=order)  # [B, H, Q, d], [B, H, S, d]
    scale = getattr(ctx.layer_module.self_attn, "scaling", None) or q.shape[-1] ** -0.5
    ar = torch.arange(s, device=q.device)
    allowed = ctx.valid[:, None, :] & (ar[None, None, :] <= order[:, :, None])  # causal, [B, Q, S]
    best = torch.zeros(b, s, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        logits = torch.einsum("bqd,bsd->bqs", q[:, h].float(), k[:, h].float()) * scale
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        best = torch.maximum(best, probs.masked_fill(~row_ok[:, :, None], 0.0).amax(1))
    return best


def keep_per_group(scores: torch.Tensor, groups: torch.Tensor, group_keep: list[int], valid: torch.Tensor) -> Reduction:
    """Every valid row outside the groups, plus the ``group_keep[g]`` best-scoring rows of each group g
    (one sample: scores, groups, valid [S])."""
    out = [torch.nonzero(valid & (groups < 0)).flatten()]
    for g in torch.unique(groups[valid & (groups >= 0)]).tolist():
        rows = torch.nonzero(valid & (groups == g)).flatten()
        out.append(rows[torch.topk(scores[rows], min(group_keep[g], rows.numel())).indices])
    return Reduction(torch.sort(torch.cat(out)).values)


@register
class PruneVid(LLMMethod):
    """PruneVid (ACL 2025; Visual-AI/PruneVid@b12600c): merge the video's redundant tokens before the
    LLM, then keep in it the tokens the question attends to.

    Merge (frames stage, :func:`prunevid_plan`): the frames' mean tokens are clustered (DPC-kNN,
    int(T temporal_ratio) clusters, k=7) and made contiguous in time into scenes; in each scene a
    slot whose tokens' mean pairwise cosine over the scene's frames exceeds tau is static, its tokens
    averaged into one; the scene's static tokens, and each frame's dynamic (other) tokens, are each
    clustered by DPC-kNN (k=7) into int(m cluster_ratio) tokens - the clusters' plain means - when
    there are more than 14 of them.
    Selection (llm stage): before decoder layer ``layer`` each group (a scene's static tokens, a
    frame's dynamic ones) keeps int(alpha m) of its tokens, those with the highest attention from
    the question (the rows after the video: max over heads and question rows of layer ``layer`` -
    1's attention, computed on the side so SDPA / FlashAttention stay). Kept tokens keep their
    position ids.

    Knobs (official defaults, scripts/eval.sh): tau=0.8, temporal_ratio=0.25
    (temporal_segment_ratio), cluster_ratio=0.5, alpha=0.4, layer=11 (the official prunes after
    selected_layer=10 with that layer's attention: here "before layer 11, scored in layer 10", as
    FastV's K), k=7, early_kv="keep".
    Budget: without keep / budget the official counts (data-dependent; about 16-17% of the tokens in
    the paper). With them, the video's tokens reaching the last layer are exactly the target:
    see :func:`prunevid_plan` (the llm stage's alpha becomes target / merged tokens).
    Differences from the official code: merged tokens take the slot (and position id) of their
    cluster's centre - a scene's static tokens in its first frame - instead of being packed
    scene by scene (static, then each frame's dynamic tokens) and renumbered; by default
    (early_kv="keep") the layers before ``layer`` keep the dropped tokens in their KV cache, so decode
    steps still see them there, as every in-LLM method here; early_kv="drop" removes them there too,
    as the official cache does (decode steps then see the kept tokens only, in every layer; decoding
    without a cache, use_cache=False, is refused then); DPC-kNN's 1e-6 random density noise is left
    out (ties go as torch.topk breaks them); a single-frame scene has no static tokens (the
    official divides 0 by 0 there, which also marks none); fewer than 4 frames make one cluster
    (the official asks for int(T / 4) = 0 and fails). Videos only: images pass unchanged; on
    Qwen2-VL / 2.5-VL (and the later M-RoPE families) a "frame" is a temporal slice of 2 frames, as
    the model encodes them. Runs alone (no other method in the pipeline: the selection counts per
    group of the merge).
    """

    name = "prunevid"
    paper = "PruneVid, ACL 2025 (arXiv 2412.16117)"
    summary = ("merges static tokens over each scene and clusters the rest (frames stage), then keeps the tokens "
               "the question attends to in the LLM")
    own_schedule = True
    scores_from_previous_layer = True
    budget_note = ("the video's tokens reaching the last layer; without keep / budget the official counts "
                   "(merge, then alpha=0.4 of each group in the LLM)")
    family_notes: ClassVar[dict[str, str]] = dict.fromkeys(
        ("llava_onevision", "qwen2_vl", "llava_next_video", "llava_onevision15", "qwen3_vl", "glm4v", "qwen3_5"),
        "video only")
    #: the two stages it runs in, both needed (``vlm-prune methods`` shows them)
    needs_stages: ClassVar[tuple[str, ...]] = ("frames", "llm")

    def __init__(self, keep: float | None = None, budget: int | None = None, tau: float = 0.8,
                 temporal_ratio: float = 0.25, cluster_ratio: float = 0.5, alpha: float = 0.4, layer: int = 11,
                 k: int = 7, early_kv: str = "keep") -> None:
        super().__init__(keep, budget)
        if early_kv not in ("keep", "drop"):
            raise ValueError(f"prunevid early_kv must be 'keep' (the layers before `layer` keep every token in their KV "
                             f"cache) or 'drop' (the official: they lose the dropped ones too), got {early_kv!r}")
        self.early_kv = early_kv
        for name, value in (("temporal_ratio", temporal_ratio), ("cluster_ratio", cluster_ratio), ("alpha", alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"prunevid {name} must be a fraction in (0, 1], got {value!r}")
        for name, value in (("layer", layer), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prunevid {name} must be a whole number >= 1 (layer: tokens leave before it, scored "
                                 f"in the layer before), got {value!r}")
        self.tau, self.temporal_ratio, self.cluster_ratio, self.alpha = tau, temporal_ratio, cluster_ratio, alpha
        self.layer, self.k = layer, k

    @classmethod
    def refusal(cls, family: str, stages: tuple[str, ...]) -> str | None:
        missing = [s for s in cls.needs_stages if s not in stages]
        if missing:
            return (f"method 'prunevid' merges a video's tokens in the frames stage and selects them in the llm stage; "
                    f"the {family} adapter does not offer {' and '.join(repr(s) for s in missing)} (it offers: "
                    f"{', '.join(stages)})")
        return None

    def companions(self, others: dict[str, Method]) -> list[Method]:
        if others:
            raise ValueError(
                f"prunevid runs in the frames and llm stages itself and groups the video's tokens for its selection; "
                f"it cannot be combined with {', '.join(repr(m.name) for m in others.values())}: wrap with 'prunevid' alone"
            )
        return [PruneVidMerge(self)]

    @property
    def drops_earlier_keys(self) -> bool:
        """True when the layers before ``layer`` lose the dropped tokens from their KV cache too (the
        engine hides them from later decode steps there: ``engine.earlier_keys_dropped``)."""
        return self.early_kv == "drop"

    def check_generate(self, kwargs: dict[str, Any], config: Any) -> None:
        """early_kv="drop": refuse generate(use_cache=False) at the call: re-running the generated tokens
        through the prompt's layers, they would see the dropped tokens in the layers before ``layer``."""
        if self.early_kv == "drop" and kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            raise ValueError("prunevid early_kv='drop' removes the dropped tokens from the earlier layers' KV cache, "
                             "which generate(use_cache=False) does not keep. Decode with the cache (the default), or "
                             "use early_kv='keep'")

    def prune_layers(self, num_layers: int) -> list[int]:
        if self.layer >= num_layers:
            raise ValueError(f"prunevid layer={self.layer} but the model has only {num_layers} decoder layers: "
                             f"give layer= in 1 .. {num_layers - 1}")
        return [self.layer]

    def select(self, ctx: LayerContext) -> list[Reduction]:
        groups, group_keep = ctx.extras.get("groups"), ctx.extras.get("group_keep")
        if groups is None:
            return keep_all_rows(ctx)
        rows = ctx.valid & (groups >= 0)
        size = torch.bincount(groups[rows], minlength=len(group_keep))
        if all(int(size[g]) <= group_keep[g] for g in torch.unique(groups[rows]).tolist()):
            return keep_all_rows(ctx)  # nothing to drop: no attention rows needed
        scores = question_attention(ctx)
        return [keep_per_group(scores[b], groups[b], group_keep, ctx.valid[b]) for b in range(scores.shape[0])]
