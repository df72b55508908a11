"""HoliTom's inner-LLM merge (Shao et al., NeurIPS 2025, "HoliTom: Holistic Token Merging for Fast
Video Large Language Models"; official code cokeshao/HoliTom@e9b2972f6895c9e7d7fe74eb8c3a2ecaab8056e0,
``holitom/modeling_qwen2.py``, ``Qwen2Model_holitom.forward`` with HOLITOM_k / HOLITOM_r).

Stage: llm. The registered ``holitom`` is the frames stage (:mod:`vlm_prune.frames.holitom`); it adds
this stage with ``inner=True`` (its default, the paper's full method) and hands it, per video, the
tokens to keep (``FramesPlan.groups`` / ``group_keep``: one group per video).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction
from vlm_prune.methods.fastv import previous_layer_attention

if TYPE_CHECKING:
    from vlm_prune.frames.holitom import HoliTom


def fold_into_nearest(hidden: torch.Tensor, top: torch.Tensor, others: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The official merge of rows ``others`` into rows ``top`` (both ascending) of ``hidden`` [S, D]:
    each other row joins the top row it is most similar to (cosine, float32; the first top row on a
    tie), and, in row order, halves into it: the top row's state becomes (its state + the other's) / 2,
    in the hidden states' dtype, as the official loop updates them in place. Returns (the top rows'
    new states [k, D], the top row each other row joined [m])."""
    x = hidden[others].float()
    y = hidden[top].float()
    sim = (x @ y.T) / (x.norm(dim=-1, keepdim=True) * y.norm(dim=-1)[None])
    owner = sim.argmax(-1)  # [m] index into top
    out = hidden[top].clone()
    if others.numel():
        order = torch.argsort(owner, stable=True)  # others grouped by owner, in row order within one
        counts = torch.bincount(owner, minlength=top.numel())
        start = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(owner)
        rank[order] = torch.arange(owner.numel(), device=owner.device) - start[owner[order]]
        for step in range(int(counts.max())):  # every top row's step-th member at once: the same ops, in order
            now = rank == step
            out[owner[now]] = (out[owner[now]] + hidden[others[now]]) / 2
    return out, top[owner]


def merge_video(hidden: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, n_keep: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """HoliTom's inner merge of one video's rows ``rows`` (ascending) of ``hidden`` [S, D]: the
    ``n_keep`` rows with the highest ``scores`` [S] stay, every other one is folded into its nearest
    kept row (:func:`fold_into_nearest`). Returns (kept rows ascending, their states, merged rows,
    the kept row each merged row joined)."""
    top = torch.sort(rows[torch.topk(scores[rows].float(), n_keep).indices]).values
    rest = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
    rest[torch.searchsorted(rows, top)] = False
    others = rows[rest]
    states, into = fold_into_nearest(hidden, top, others)
    return top, states, others, into


class HoliTomMerge(LLMMethod):
    """HoliTom's inner-LLM merge (see :class:`vlm_prune.frames.holitom.HoliTom`, which adds it and whose
    knobs ``layer`` / ``r`` and budget it reads): before decoder layer ``layer`` (HOLITOM_k), each
    video keeps the tokens the last prompt row attends to most in layer ``layer`` - 1 (mean over
    heads; computed on the side, so SDPA / FlashAttention stay) - the count the frames stage planned
    (``group_keep``) - and every other token of the video is folded into the kept token whose hidden
    state it is most similar to. Kept tokens keep their position ids; no proportional attention (the
    official has none)."""

    name = "holitom"
    paper = "HoliTom, NeurIPS 2025 (arXiv 2505.21334)"
    own_schedule = True
    needs_previous_hidden = True  # layer K-1's attention on its own rows, layer K's input for the merge

    def __init__(self, owner: "HoliTom") -> None:
        super().__init__()
        self.owner = owner

    def describe(self) -> dict[str, Any]:
        return {**self.owner.describe(), "stage": self.stage}

    def prune_layers(self, num_layers: int) -> list[int]:
        layer = self.owner.layer
        if layer >= num_layers:
            raise ValueError(f"holitom layer={layer} but the model has only {num_layers} decoder layers: give layer= in "
                             f"1 .. {num_layers - 1} (the official HOLITOM_k=18 is for 28-layer Qwen2-7B), or inner=False "
                             "for the outer stage alone (the paper's 'w/o M')")
        return [layer]

    def select(self, ctx: LayerContext) -> list[Reduction] | None:
        groups, group_keep = ctx.extras.get("groups"), ctx.extras.get("group_keep")
        if groups is None:
            return None
        rows = ctx.valid & ctx.visual & (groups >= 0)
        size = torch.bincount(groups[rows], minlength=len(group_keep))
        if not any(int(size[g]) > group_keep[g] for g in torch.unique(groups[rows]).tolist()):
            return None  # every video within its count: nothing merged, no attention rows needed
        scores = previous_layer_attention(ctx)
        out = []
        for b in range(ctx.hidden.shape[0]):
            valid, hidden = ctx.valid[b], ctx.hidden[b]
            keep = valid.clone()
            into = torch.where(valid, torch.arange(valid.numel(), device=valid.device), -1)
            feats = hidden.clone()
            for g in torch.unique(groups[b][rows[b]]).tolist():
                video = torch.nonzero(rows[b] & (groups[b] == g)).flatten()
                if video.numel() <= group_keep[g]:
                    continue
                top, states, merged, joined = merge_video(hidden, scores[b], video, group_keep[g])
                feats[top] = states
                keep[merged] = False
                into[merged] = joined
            indices = torch.nonzero(keep).flatten()
            out.append(Reduction(indices, features=feats[indices], merged_into=into))
        return out
