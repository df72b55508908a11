"""VisPruner: important tokens by the tower's [CLS] attention, then diverse ones among the rest."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.methods.visionzip import tower_view
from vlm_prune.registry import register


def drop_duplicates(features: torch.Tensor, residual: torch.Tensor, n_keep: int, step: int = 8) -> torch.Tensor:
    """VisPruner's iterative duplicate removal: the ``n_keep`` tokens left of ``residual`` (indices
    into ``features`` [N, C], in the order given: descending [CLS] attention).

    Each round splits the current residual list into its even (a) and odd (b) positions, scores every
    a-token by its highest cosine similarity to any b-token, and drops the r = min(step, R - n_keep)
    most similar a-tokens; the next list is [remaining a-tokens in descending score order, then every
    b-token]. Stops when n_keep remain. (The official code indexes with R // 2 rows and so needs an
    even count; an odd count simply has one more a-token here.)
    """
    residual = residual.clone()
    if n_keep <= 0:
        return residual[:0]
    xn = F.normalize(features.float(), dim=-1)
    while residual.numel() > n_keep:
        r = min(step, residual.numel() - n_keep)
        a, b = residual[0::2], residual[1::2]
        scores = (xn[a] @ xn[b].T).max(dim=-1).values if b.numel() else torch.zeros(a.numel())
        distinct = a[torch.argsort(scores, descending=True)[r:]]
        residual = torch.cat([distinct, b])
    return residual


def vispruner_select(attention: torch.Tensor, features: torch.Tensor, n_keep: int, important_ratio: float) -> torch.Tensor:
    """[n_keep] kept token indices, ascending: int(n_keep * important_ratio) of highest attention,
    the rest by :func:`drop_duplicates` over the others (in descending attention order)."""
    n_important = int(n_keep * important_ratio)
    order = torch.argsort(attention.float(), descending=True)
    diverse = drop_duplicates(features, order[n_important:], n_keep - n_important)
    return torch.sort(torch.cat([order[:n_important], diverse])).values


@register
class VisPruner(ShorterSequence, VisionMethod):
    """VisPruner (Zhang et al., ICCV 2025, "Beyond Text-Visual Attention: Exploiting Visual Cues for
    Effective Token Pruning in VLMs", arXiv 2412.01818v2; Theia-4869/VisPruner at aefa01ad,
    llava/model/llava_arch.py ``encode_images`` and multimodal_encoder/clip_encoder.py).

    Per image, of the ``n_keep`` tokens: int(n_keep * ``important_ratio``) important ones by the
    attention the tower's [CLS] pays them in the feature layer (mean over heads, computed on the side
    from the tapped layer input); the rest are diverse ones, left after removing duplicates from the
    other tokens by cosine similarity of the feature layer's outputs (before the projector), 8 per
    round (:func:`drop_duplicates`). Kept tokens stay in their original order. Default
    ``important_ratio`` 0.5 (the official scripts' default). On LLaVA-OneVision video (SigLIP, no
    CLS) the mean attention each token receives ranks instead and the similarity uses the projected
    frame tokens (the tower features are pooled by the model after projection).
    ``positions``: "renumber" (default, the official code's shorter sequence numbered 0..n-1) or
    "keep" (original position ids, gaps stay).
    Budget: keep / budget required (the official ``visual_token_num`` defaults to all 576 tokens,
    i.e. no pruning; its scripts pass the count).
    """

    name = "vispruner"
    supported = ("llava", "llava_onevision")  # adapters that tap the tower feature layer (OneVision: video frames)
    needs_tower_attention = True
    paper = "VisPruner, Zhang et al., ICCV 2025 (Theia-4869/VisPruner)"
    summary = "keeps the tokens the tower's [CLS] attends to most, plus diverse ones after removing duplicates"

    def __init__(self, important_ratio: float = 0.5, positions: str | None = None,
                 keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if not 0 <= important_ratio <= 1:
            raise ValueError(f"VisPruner important_ratio must be in [0, 1], got {important_ratio!r}")
        check_positions("VisPruner", positions)
        self.important_ratio = important_ratio
        self.positions = positions

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        attention, _, tower = tower_view(ctx, "vispruner", "VisPruner")
        feats = tower.features if tower is not None else ctx.features
        return Reduction(vispruner_select(attention, feats, ctx.n_keep, self.important_ratio).to(ctx.features.device))
