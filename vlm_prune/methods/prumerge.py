"""LLaVA-PruMerge: keep the [CLS]-attention outliers, merge their key neighbours into them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.methods.visionzip import tower_view
from vlm_prune.registry import register


def iqr_outliers(attention: torch.Tensor) -> int:
    """PruMerge's adaptive count of kept tokens: int(N * r), r the fraction of the N values above
    Q3 + 1.5 IQR (quartiles linearly interpolated, as numpy's ``percentile``; the official code's
    ratio, so its float rounding too)."""
    a = attention.double().flatten()
    q1, q3 = torch.quantile(a, 0.25), torch.quantile(a, 0.75)
    n = a.numel()
    return int(n * (int((a > q3 + 1.5 * (q3 - q1)).sum()) / n))


def prumerge_tokens(features: torch.Tensor, attention: torch.Tensor, keys: torch.Tensor, k: int,
                    neighbours: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """PruMerge on one image's N patches: ([k + 1, C] merged tokens, [k] kept patch indices).

    features: [N, C] the tower's feature-layer patch outputs; attention: [N] the [CLS] row over the
    patches; keys: [N, C] the keys that attention came from. The k patches of highest attention, in
    descending attention order, each add the attention-weighted sum (weights not normalised) of the
    features of their ``neighbours`` most key-similar (cosine) other patches, kept or not, with their
    original features; one more token is the attention-weighted sum of every patch not kept.
    ``neighbours`` is capped at N - 1 (the official topk needs N - 1 >= 32).
    """
    n = features.shape[0]
    order = torch.topk(attention.float(), k).indices
    rest = torch.ones(n, dtype=torch.bool, device=features.device)
    rest[order] = False
    feats, weights = features.float(), attention.float()
    kn = F.normalize(keys.float(), dim=-1)
    similarity = kn[order] @ kn.T  # [k, N]
    similarity[torch.arange(k, device=features.device), order] = -float("inf")  # never its own neighbour
    near = torch.topk(similarity, min(neighbours, n - 1), dim=1).indices  # [k, m]
    merged = feats[order] + (feats[near] * weights[near][..., None]).sum(1)
    extra = (feats[rest] * weights[rest][:, None]).sum(0, keepdim=True)
    return torch.cat([merged, extra]).to(features.dtype), order


@register
class PruMerge(ShorterSequence, VisionMethod):
    """LLaVA-PruMerge (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large
    Multimodal Models", arXiv 2403.15388, ICCV 2025; 42Shawn/LLaVA-PruMerge at 1ca8b2b,
    llava/model/multimodal_encoder/clip_encoder.py ``token_prune_merge_advanced``, the default of
    ``CLIPVisionTower.forward``, and ``outlier_dectection``).

    Chosen for issue 30 in place of TopV (Yang et al., CVPR 2025, arXiv 2503.18278): no official TopV
    code was found (the paper links none; no repository under that name in the searched index),
    so it cannot be checked side by side. PruMerge is the better-cited training-free alternative with
    official code, the baseline HiRED and later [CLS]-attention work compare against, and it adds
    what no method here does: an adaptive count and merging of the pruned tokens into the kept ones.

    Per LLaVA-1.5 image, from the tower's LAST layer (the official hard-coded layer 23 of 24, whose
    input is the feature layer's output; with ``vision_feature_layer=-1``, as the project's synthetic
    LLaVA, the feature layer's input), recomputed on the side: its q / k projections over all
    heads as one (the official single-head softmax(q k^T / sqrt(C)), C the hidden size), the [CLS]
    row over the patches. Kept: the patches of highest attention - by default their adaptive count
    int(N * outliers / N), outliers above Q3 + 1.5 IQR of that row (:func:`iqr_outliers`); each adds
    the attention-weighted features of its 32 most key-similar patches (``neighbours``), plus one
    token summing every pruned patch by attention (:func:`prumerge_tokens`). The merge runs on the
    feature layer's outputs before the projector; [kept in descending attention, extra] are projected
    and packed into the image's first slots; ``positions`` "renumber" (default: the official shorter
    sequence numbered 0..n-1) or "keep".
    Budget: without keep / budget the official adaptive count (+ 1); with keep / budget exactly that
    many tokens: the top n_keep - 1 patches and the extra token. PruMerge+ (spatially uniform extra
    patches) and the LoRA fine-tuned checkpoints are not part of this method: on a plain LLaVA it
    runs training-free, as the paper's training-free rows.
    """

    name = "prumerge"
    supported = ("llava",)  # the adapter hands the tower's last layer over (TowerFeatures.last_qk)
    needs_tower_attention = True
    own_schedule = True
    paper = "LLaVA-PruMerge, Shang et al., ICCV 2025 (42Shawn/LLaVA-PruMerge)"
    summary = "keeps the tower's [CLS]-attention outliers (adaptive count), merging their key neighbours into them"
    budget_note = ("without keep / budget: the official adaptive count (IQR outliers of the [CLS] attention) plus one "
                   "merged token; with them, exactly that many tokens")

    def __init__(self, neighbours: int = 32, positions: str | None = None, keep: float | None = None,
                 budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 1:
            raise ValueError(f"PruMerge neighbours must be a whole number >= 1, got {neighbours!r}")
        check_positions("PruMerge", positions)
        self.neighbours = neighbours
        self.positions = positions

    def check_model(self, adapter) -> None:
        super().check_model(adapter)
        if getattr(adapter.model.config, "vision_feature_select_strategy", "default") != "default":
            raise ValueError("prumerge ranks patches by the tower's [CLS] attention and needs "
                             "vision_feature_select_strategy='default' (CLS no visual token); this model uses "
                             f"{adapter.model.config.vision_feature_select_strategy!r}")
        tower = adapter.inner.vision_tower
        n = len(getattr(tower, "vision_model", tower).encoder.layers)
        layer = adapter.model.config.vision_feature_layer
        if not isinstance(layer, int) or layer % (n + 1) < n - 1:
            raise ValueError("prumerge reads the tower's last layer on the side from the feature layer, so it needs "
                             f"vision_feature_layer -2 (LLaVA-1.5's) or -1; this model uses {layer!r}")

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if (self.keep is not None or self.budget is not None) and ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        _, _, tower = tower_view(ctx, "prumerge", "PruMerge")
        if tower is None or tower.cls is None or tower.last_qk is None:
            raise ValueError("prumerge needs the tower's [CLS] token and last layer before the projector "
                             "(TowerFeatures.last_qk), which this model's adapter does not provide")
        q, k = tower.last_qk()
        scale = q.shape[-1] ** -0.5
        attention = torch.softmax((q[:1].float() @ k.float().T) * scale, dim=-1)[0, 1:]
        if self.keep is None and self.budget is None:
            count = iqr_outliers(attention)
        else:
            count = ctx.n_keep - 1
        merged, order = prumerge_tokens(tower.features, attention, k[1:], count, self.neighbours)
        into = torch.full((n,), count, dtype=torch.long, device=ctx.features.device)  # pruned: the extra token
        into[order.to(into.device)] = torch.arange(count, device=into.device)
        projected = tower.project(merged)
        return Reduction(torch.arange(count + 1, device=ctx.features.device), features=projected.to(ctx.features.device),
                         merged_into=into)
