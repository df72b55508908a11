"""LLaVA-PruMerge: keep the [CLS]-attention outliers, merge their key neighbours into them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.methods.visionzip import tower_view
from vlm_prune.registry import register


def iqr_ratio(attention: torch.Tensor) -> float:
    """PruMerge's outlier ratio (the official ``outlier_dectection``): the share of the values above
    Q3 + 1.5 IQR, over every value given (one image's [CLS] row, or a batch's rows together), the
    quartiles linearly interpolated as numpy's ``percentile``."""
    a = attention.double().flatten()
    q1, q3 = torch.quantile(a, 0.25), torch.quantile(a, 0.75)
    return int((a > q3 + 1.5 * (q3 - q1)).sum()) / a.numel()


def iqr_outliers(attention: torch.Tensor) -> int:
    """PruMerge's adaptive count of kept tokens of one image's N values: int(N * r), r = :func:`iqr_ratio`
    (the official code's ratio, so its float rounding too)."""
    return int(attention.numel() * iqr_ratio(attention))


def plus_supplement(top: torch.Tensor, n: int, ratio: float) -> torch.Tensor:
    """PruMerge+'s spatially uniform patches added to the ``top`` ones (official
    ``token_prune_merge_advanced_plus``): every s-th position from 0 below n - 1 (the official's 575
    for 576 patches), s = int(int(1 / ratio) / 3), that is not in ``top``, ascending. Where the
    official fails - ratio 0 (a division by zero) or s = 0 (ratio above 1/3) - none are added, or
    every position (s = 1)."""
    if ratio == 0:
        return top.new_zeros(0)
    grid = torch.arange(0, n - 1, max(1, int(int(1 / ratio) / 3)), device=top.device)
    return grid[~torch.isin(grid, top)]


def spread(top: torch.Tensor, n: int, count: int) -> torch.Tensor:
    """``count`` positions of the n not in ``top``, evenly spaced over them in position order (PruMerge+
    under keep / budget)."""
    rest = torch.ones(n, dtype=torch.bool, device=top.device)
    rest[top] = False
    rest = torch.nonzero(rest).squeeze(1)
    return rest[(torch.arange(count, device=top.device) * rest.numel()) // max(count, 1)]


def prumerge_tokens(features: torch.Tensor, attention: torch.Tensor, keys: torch.Tensor, kept: torch.Tensor,
                    neighbours: int = 32) -> torch.Tensor:
    """PruMerge on one image's N patches: [k + 1, C] merged tokens of the k ``kept`` patch indices.

    features: [N, C] the tower's feature-layer patch outputs; attention: [N] the [CLS] row over the
    patches; keys: [N, C] the keys that attention came from. Each kept patch, in the order given,
    adds the attention-weighted sum (weights not normalised) of the features of its ``neighbours``
    most key-similar (cosine) other patches, kept or not, with their original features; one more
    token is the attention-weighted sum of every patch not kept. ``neighbours`` is capped at N - 1
    (the official topk needs N - 1 >= 32).
    """
    n, k = features.shape[0], kept.numel()
    rest = torch.ones(n, dtype=torch.bool, device=features.device)
    rest[kept] = False
    feats, weights = features.float(), attention.float()
    kn = F.normalize(keys.float(), dim=-1)
    similarity = kn[kept] @ kn.T  # [k, N]
    similarity[torch.arange(k, device=features.device), kept] = -float("inf")  # never its own neighbour
    near = torch.topk(similarity, min(neighbours, n - 1), dim=1).indices  # [k, m]
    merged = feats[kept] + (feats[near] * weights[near][..., None]).sum(1)
    extra = (feats[rest] * weights[rest][:, None]).sum(0, keepdim=True)
    return torch.cat([merged, extra]).to(features.dtype)


def cls_attention(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The [CLS] row over the patches of the tower's last layer from its q / k [T, C]: the official
    single-head softmax(q k^T / sqrt(C))."""
    return torch.softmax((q[:1].float() @ k.float().T) * q.shape[-1] ** -0.5, dim=-1)[0, 1:]


@register
class PruMerge(ShorterSequence, VisionMethod):
    """LLaVA-PruMerge (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large
    Multimodal Models", arXiv 2403.15388, ICCV 2025; 42Shawn/LLaVA-PruMerge,
    llava/model/multimodal_encoder/clip_encoder.py ``token_prune_merge_advanced`` - the default of
    ``CLIPVisionTower.forward`` at 1ca8b2b - and ``outlier_dectection``; ``plus=True``:
    ``token_prune_merge_advanced_plus``, PruMerge+, the default of ``forward`` from 5632f5a on).

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
    int(N * r), r the share of that row above Q3 + 1.5 IQR (:func:`iqr_ratio`); each adds the
    attention-weighted features of its 32 most key-similar patches (``neighbours``), plus one token
    summing every pruned patch by attention (:func:`prumerge_tokens`). The merge runs on the feature
    layer's outputs before the projector; [kept in descending attention, extra] are projected and
    packed into the image's first slots; ``positions`` "renumber" (default: the official shorter
    sequence numbered 0..n-1) or "keep".
    ``plus`` (default False): PruMerge+ also keeps, after the top patches, every s-th patch
    (s = int(int(1 / r) / 3), about three times as many) not among them, in position order, and merges
    into them too (:func:`plus_supplement`); the official runs it on batch 1 only (its concatenation
    fails for more images).
    ``outliers`` (default "image"): r from each image's own row; "batch" is the official rule, which
    pools the quartiles and the count over every image the tower ran on together (the batch of the
    call) and applies that r to each image, so an image's count then depends on its batch companions
    (a sample no longer equals itself alone; the vLLM plugin, which has no such batch, refuses it).
    Budget: without keep / budget the official adaptive count (+ 1); with keep / budget exactly that
    many tokens: the top n_keep - 1 patches and the extra token (``plus``: the adaptive top count, at
    most n_keep - 1, and the rest evenly spread over the other patches in position order: :func:`spread`).
    The LoRA fine-tuned checkpoints are not part of this method: on a plain LLaVA it runs
    training-free, as the paper's training-free rows.
    """

    name = "prumerge"
    supported = ("llava",)  # the adapter hands the tower's last layer over (TowerFeatures.last_qk)
    needs_tower_attention = True
    own_schedule = True
    paper = "LLaVA-PruMerge, Shang et al., ICCV 2025 (42Shawn/LLaVA-PruMerge)"
    summary = "keeps the tower's [CLS]-attention outliers (adaptive count), merging their key neighbours into them"
    budget_note = ("without keep / budget: the official adaptive count (IQR outliers of the [CLS] attention) plus one "
                   "merged token; with them, exactly that many tokens")

    def __init__(self, neighbours: int = 32, positions: str | None = None, plus: bool = False,
                 outliers: str = "image", keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 1:
            raise ValueError(f"PruMerge neighbours must be a whole number >= 1, got {neighbours!r}")
        check_positions("PruMerge", positions)
        if not isinstance(plus, bool):
            raise ValueError(f"PruMerge plus must be True (PruMerge+) or False, got {plus!r}")
        if outliers not in ("image", "batch"):
            raise ValueError(f"PruMerge outliers must be 'image' (each image's own count) or 'batch' (the official "
                             f"count over the whole batch), got {outliers!r}")
        self.neighbours = neighbours
        self.positions = positions
        self.plus = plus
        self.outliers = outliers

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
        attention = cls_attention(q, k)
        targeted = self.keep is not None or self.budget is not None
        if targeted and not self.plus:
            kept = torch.topk(attention.float(), ctx.n_keep - 1).indices
        else:
            ratio = iqr_ratio(attention) if self.outliers == "image" else self._batch_ratio(ctx)
            count = int(n * ratio)  # the official adaptive count
            if not targeted:
                top = torch.topk(attention.float(), count).indices
                kept = torch.cat([top, plus_supplement(top, n, ratio)]) if self.plus else top
            else:
                top = torch.topk(attention.float(), min(count, ctx.n_keep - 1)).indices
                kept = torch.cat([top, spread(top, n, ctx.n_keep - 1 - top.numel())])
        merged = prumerge_tokens(tower.features, attention, k[1:], kept, self.neighbours)
        into = torch.full((n,), kept.numel(), dtype=torch.long, device=ctx.features.device)  # pruned: the extra token
        into[kept.to(into.device)] = torch.arange(kept.numel(), device=into.device)
        projected = tower.project(merged)
        return Reduction(torch.arange(kept.numel() + 1, device=ctx.features.device),
                         features=projected.to(ctx.features.device), merged_into=into)

    def _batch_ratio(self, ctx: VisionContext) -> float:
        """The official outlier ratio over every image of the batch (their [CLS] rows together)."""
        if ctx.batch_tower_attention is None:
            raise ValueError("prumerge outliers='batch' pools the [CLS] attention of every image the tower ran on "
                             "together, which this call does not provide; use outliers='image'")
        rows = []
        for _, _, tower in ctx.batch_tower_attention():
            rows.append(cls_attention(*tower.last_qk()))
        return iqr_ratio(torch.cat(rows))
