"""PACT: prune unimportant visual tokens and cluster the rest inside the LLM (attention-free)."""
from __future__ import annotations

import math

import torch

from vlm_prune.kernels import cosine_distance, euti_scores, scatter_mean
from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction
from vlm_prune.methods.dbdpc import Clustering, DensityPeaks, dbdpc
from vlm_prune.methods.fastv import last_valid_index
from vlm_prune.registry import register

#: (rho, d_c) per adapter family. llava_onevision and qwen2_vl come from the official
#: scripts (configs/pact.json, scripts/pact_qwenvl2.0_7b.sh); the official code has no
#: LLaVA-1.5 / LLaVA-NeXT setting, so those use the OneVision values (unverified choice).
FAMILY_DEFAULTS: dict[str, tuple[float, float]] = {
    "llava_onevision": (0.55, 0.21),
    "qwen2_vl": (0.8, 0.1),
    "llava": (0.55, 0.21),
    "llava_next": (0.55, 0.21),
    "qwen3_vl": (0.8, 0.1),  # no official setting: Qwen2-VL's (unverified choice)
}
FALLBACK_DEFAULTS = FAMILY_DEFAULTS["llava_onevision"]

#: Bisection steps on the cutoff when PACT meets a keep / budget target.
CUTOFF_SEARCH_STEPS = 20


def distinct_kv_heads(k: torch.Tensor, layer_module: torch.nn.Module) -> torch.Tensor:
    """Drop GQA repeats: keys [B, H, S, d] repeated by repeat_kv -> [B, H_kv, S, d]."""
    groups = int(getattr(getattr(layer_module, "self_attn", None), "num_key_value_groups", 1) or 1)
    return k[:, ::groups]


@register
class PACT(LLMMethod):
    """PACT (Dhouib et al., CVPR 2025, "PACT: Pruning and Clustering-Based Token Reduction for
    Faster Visual Language Models"; orailix/PACT).

    Before decoder layer ``layer`` (L, default 4), from the hidden states entering it:
    1. EUTI pruning: s_j = (1/H) sum_h softmax_{j in N}(qbar_h . k_jh / sqrt(d)) * ||x_j||
       (:func:`vlm_prune.kernels.euti_scores`), with layer L's own norm and q/k projections
       without RoPE, N = rows up to the last visual token, qbar_h the mean query of N; keep
       the top floor(rho * |V|) visual tokens. No attention matrix is formed.
    2. DBDPC (:mod:`vlm_prune.methods.dbdpc`) on the kept tokens' layer-L keys after RoPE at
       their original positions, the distinct KV heads flattened (GQA repeats dropped, as the
       official code clusters ``k_proj`` outputs), cosine distance, cutoff ``cutoff`` (d_c).
       Pruned tokens within 1.5 d_c of a centre join its cluster, the others are dropped.
    3. Each cluster becomes one row at its centre's slot (the centre's original position id):
       the mean of its members' hidden states, weighted by their current sizes (all 1 unless
       an earlier step merged them, then it is the plain mean of the official code). Its size
       is the number of original tokens it stands for; the engine adds log(size) to the
       attention logits of that key in every later layer (proportional attention). Under
       FlashAttention the engine cannot add that bias, so a merged key counts as one token
       there (the official code's ``no_proportional_attention`` setting), which costs some
       accuracy; use SDPA or eager attention for PACT as published.

    Defaults per model family (``ctx.extras["family"]``): rho 0.55 / d_c 0.21 for
    llava_onevision, 0.8 / 0.1 for qwen2_vl (orailix/PACT: configs/pact.json at commit 423c799f,
    scripts/pact_qwenvl2.0_7b.sh at f18acc1f); llava and llava_next use the
    OneVision values (unverified); qwen3_vl uses the Qwen2-VL values (unverified). Without keep / budget, PACT is the official algorithm (with
    ``rho`` / ``cutoff`` if given) and the final count follows from the clustering.

    With ``keep`` / ``budget`` (the visual tokens reaching the last layer) PACT meets the target
    T exactly: the pruning step keeps max(T, floor(rho |V|)) tokens (the pruning share grows when
    rho alone keeps fewer than T), and the cutoff d_c is bisected over [0, 2] until DBDPC yields
    T clusters (:func:`cluster_to_count`); if no cutoff gives exactly T, the clustering with the
    fewest clusters above T keeps its T centres of highest EUTI score and the members of the
    others are re-attached like pruned tokens (nearest kept centre within 1.5 d_c, else
    dropped). ``rho`` / ``cutoff`` given with a target are where this starts (the least pruning
    share, the first cutoff tried). keep=1.0 leaves the tokens untouched. LLaVA-OneVision's newline tokens are not
    visual tokens: they are never pruned or merged (the engine does not mark them visual).
    """

    name = "pact"
    paper = "PACT, Dhouib et al., CVPR 2025 (orailix/PACT)"
    own_schedule = True
    scores_from_previous_layer = False

    def __init__(
        self,
        layer: int = 4,
        rho: float | None = None,
        cutoff: float | None = None,
        reattach_factor: float = 1.5,
        keep: float | None = None,
        budget: int | None = None,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if not isinstance(layer, int) or layer < 0:
            raise ValueError(f"PACT layer L must be an integer >= 0, got {layer!r}")
        if rho is not None and not (0 < rho <= 1):
            raise ValueError(f"PACT rho (fraction of visual tokens kept by pruning) must be in (0, 1], got {rho!r}")
        if cutoff is not None and cutoff < 0:
            raise ValueError(f"PACT cutoff d_c must be >= 0, got {cutoff!r}")
        if reattach_factor < 0:
            raise ValueError(f"PACT reattach_factor must be >= 0, got {reattach_factor!r}")
        self.layer = layer
        self.rho = rho
        self.cutoff = cutoff
        self.reattach_factor = reattach_factor


    @property
    def targeted(self) -> bool:
        """True when PACT meets a keep / budget target instead of running the official knobs."""
        return self.keep is not None or self.budget is not None

    def prune_layers(self, num_layers: int) -> list[int]:
        if self.layer >= num_layers:
            raise ValueError(f"PACT layer L={self.layer} but the model has only {num_layers} decoder layers; "
                             f"pass layer= below {num_layers}")
        return [self.layer]

    def settings(self, family: str | None) -> tuple[float, float]:
        """(rho, d_c) for a model family, with this object's overrides applied."""
        rho, d_c = FAMILY_DEFAULTS.get(family or "", FALLBACK_DEFAULTS)
        return (self.rho if self.rho is not None else rho, self.cutoff if self.cutoff is not None else d_c)

    def pruning_count(self, ctx: LayerContext, b: int, n_visual: int, rho: float) -> int:
        """Visual tokens the EUTI step keeps in sample b: floor(rho |V|), and at least the target."""
        official = min(n_visual, max(1, math.floor(rho * n_visual + 1e-9))) if n_visual else 0
        if self.targeted:
            return min(n_visual, max(official, int(ctx.n_keep[b])))
        return official

    def scores(self, ctx: LayerContext) -> torch.Tensor:
        """[B, S] EUTI scores (0 past the last visual token)."""
        return self._scores_and_keys(ctx)[0]

    def _scores_and_keys(self, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """EUTI scores [B, S] and the keys after RoPE [B, H, N, d] of the rows up to the last
        visual token, from one projection of layer L."""
        last = last_valid_index(ctx.visual & ctx.valid)
        n_rows = int(last.max()) + 1
        q, k, k_rope = ctx.project_qk(ctx.hidden[:, :n_rows], ctx.positions[..., :n_rows], rope="keys")
        ar = torch.arange(n_rows, device=ctx.hidden.device)
        n_mask = ctx.valid[:, :n_rows] & (ar[None, :] <= last[:, None])
        hidden_norm = ctx.hidden[:, :n_rows].float().norm(dim=-1)
        out = torch.zeros(ctx.hidden.shape[:2], device=ctx.hidden.device)
        out[:, :n_rows] = euti_scores(q, k, hidden_norm, n_mask, q.shape[-1] ** -0.5)
        return out, k_rope

    def select(self, ctx: LayerContext) -> list[Reduction]:
        rho, d_c = self.settings(ctx.extras.get("family"))
        vis_mask = ctx.visual & ctx.valid
        if not bool(vis_mask.any()):
            return [Reduction(torch.nonzero(v).squeeze(1)) for v in ctx.valid]
        scores, k_rope = self._scores_and_keys(ctx)
        k_rope = distinct_kv_heads(k_rope, ctx.layer_module)
        out = []
        for b in range(ctx.hidden.shape[0]):
            vis = torch.nonzero(vis_mask[b]).squeeze(1)
            if self.targeted and int(ctx.n_keep[b]) >= vis.numel():
                out.append(Reduction(torch.nonzero(ctx.valid[b]).squeeze(1)))  # the target keeps everything
                continue
            n_prune_keep = self.pruning_count(ctx, b, vis.numel(), rho)
            out.append(self._reduce_sample(ctx, b, vis, scores[b], k_rope[b], n_prune_keep, d_c))
        return out

    def _reduce_sample(
        self, ctx: LayerContext, b: int, vis: torch.Tensor, scores: torch.Tensor,
        keys: torch.Tensor, n_keep: int, d_c: float,
    ) -> Reduction:
        other = torch.nonzero(ctx.valid[b] & ~ctx.visual[b]).squeeze(1)
        top_mask = torch.zeros(vis.numel(), dtype=torch.bool, device=vis.device)
        top_mask[torch.topk(scores[vis], n_keep, sorted=False).indices] = True
        kept, pruned = vis[top_mask], vis[~top_mask]
        flat = keys.permute(1, 0, 2).flatten(1)  # [rows, H_kv * d]
        if self.targeted:
            cl = cluster_to_count(flat[kept], flat[pruned], int(ctx.n_keep[b]), d_c, self.reattach_factor,
                                  scores[kept])
        else:
            cl = dbdpc(flat[kept], d_c, extra=flat[pruned], extra_factor=self.reattach_factor)
        rows = torch.cat([kept, pruned])
        labels = torch.cat([cl.labels, cl.extra_labels])
        merged, sizes = scatter_mean(ctx.hidden[b, rows], labels, cl.centres.numel(), ctx.sizes[b, rows].float())
        hidden = ctx.hidden[b]
        centres = kept[cl.centres]
        into = torch.full((hidden.shape[0],), -1, dtype=torch.long, device=vis.device)  # dropped: -1
        into[other] = other
        into[rows] = torch.where(labels >= 0, centres[labels.clamp(min=0)], -1)
        return Reduction(
            torch.cat([other, centres]),
            features=torch.cat([hidden[other], merged]),
            sizes=torch.cat([ctx.sizes[b, other].float(), sizes]),
            merged_into=into,
        )


def cluster_to_count(
    points: torch.Tensor, extra: torch.Tensor, target: int, d_c: float, extra_factor: float,
    importance: torch.Tensor,
) -> Clustering:
    """DBDPC of ``points`` with exactly ``target`` clusters (fewer only if fewer distinct points).

    Bisects the cutoff over [0, 2] (cosine distances), starting from ``d_c``: a larger cutoff
    gives fewer clusters. The density ranks, the first DBDPC round and (up to
    :data:`~vlm_prune.methods.dbdpc.DENSE_MAX` points) the distances are computed once
    (:class:`~vlm_prune.methods.dbdpc.DensityPeaks`); each step runs only the cutoff-dependent
    rounds, and only the clustering returned assigns members and pruned tokens. When no cutoff
    gives exactly ``target``, the clustering with the fewest clusters above it keeps the
    ``target`` centres of highest ``importance`` (EUTI); members of the other clusters join the
    nearest kept centre within ``extra_factor`` times the cutoff, like pruned tokens, or are
    dropped.
    """
    peaks = DensityPeaks(points)  # density ranks, first round and distances: shared by every cutoff tried
    lo, hi, cut = 0.0, 2.0, d_c
    above: tuple[torch.Tensor, float] | None = None
    for _ in range(CUTOFF_SEARCH_STEPS):
        centres = peaks.centres(cut)
        n = centres.numel()
        if n == target:
            return peaks.assign(centres, cut, extra, extra_factor)
        if n > target:
            lo = cut
            if above is None or n < above[0].numel():
                above = (centres, cut)
        else:
            hi = cut
        cut = (lo + hi) / 2
    if above is None:  # even a zero cutoff merges duplicates below the target: keep them all
        return peaks.cluster(0.0, extra, extra_factor)
    cl = peaks.assign(above[0], above[1], extra, extra_factor)
    cut = above[1]
    keep = torch.topk(importance[cl.centres].float(), target).indices.sort().values
    centres = cl.centres[keep]
    relabel = torch.full((cl.centres.numel() + 1,), -1, dtype=torch.long, device=points.device)
    relabel[keep] = torch.arange(target, device=points.device)
    labels = relabel[cl.labels]
    extra_labels = relabel[cl.extra_labels]  # -1 stays -1 (the last slot)
    loose_pts = labels < 0
    loose_extra = (cl.extra_labels >= 0) & (extra_labels < 0)
    for loose, pts, lab in ((loose_pts, points, labels), (loose_extra, extra, extra_labels)):
        if bool(loose.any()):
            best, nearest = cosine_distance(pts[loose], points[centres]).min(dim=1)
            lab[loose] = torch.where(best <= extra_factor * cut, nearest, torch.full_like(nearest, -1))
    return Clustering(centres, labels, extra_labels)
