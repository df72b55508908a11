"""VisionZip: keep the tokens the vision tower's CLS attends to, merge the rest into a few."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, VisionContext, VisionMethod
from vlm_prune.registry import register


def split_budget(n_keep: int, dominant_ratio: float) -> tuple[int, int]:
    """(dominant, contextual) counts: round(n_keep * ratio) dominant, the rest contextual."""
    dominant = min(n_keep, max(0, round(n_keep * dominant_ratio)))
    return dominant, n_keep - dominant


def visionzip_reduce(
    features: torch.Tensor, attention: torch.Tensor, keys: torch.Tensor, n_dominant: int, n_contextual: int
) -> Reduction:
    """VisionZip on one image.

    features: [N, D] tokens to keep / merge; attention: [N] attention each token receives from
    the CLS token (or the adapter's substitute); keys: [N, d] the tower's keys (similarity).
    Dominant: the ``n_dominant`` tokens of highest attention, unchanged. Contextual: of the
    remaining R tokens, every (R // n_contextual)-th (the first n_contextual of them) is a
    target; each other remaining token joins the target of highest key cosine similarity; a
    contextual token is target + mean(joined tokens) (the official formula: the target is added
    to, not averaged with, the mean; no joined token -> the target itself). Each kept token
    stays at its own slot.
    """
    n = features.shape[0]
    dominant = torch.topk(attention.float(), n_dominant, sorted=False).indices
    is_rest = torch.ones(n, dtype=torch.bool, device=features.device)
    is_rest[dominant] = False
    rest = torch.nonzero(is_rest).squeeze(1)
    n_contextual = min(n_contextual, rest.numel())
    if n_contextual == 0:
        return Reduction(torch.sort(dominant).values)
    step = max(1, rest.numel() // n_contextual)
    is_target = torch.zeros(rest.numel(), dtype=torch.bool, device=features.device)
    is_target[torch.arange(0, rest.numel(), step, device=features.device)[:n_contextual]] = True
    targets, others = rest[is_target], rest[~is_target]
    kn = F.normalize(keys.float(), dim=-1)
    assign = (kn[others] @ kn[targets].t()).argmax(dim=1)  # [R - C] index into targets
    sums = torch.zeros(n_contextual, features.shape[1], device=features.device)
    sums.index_add_(0, assign, features[others].float())
    counts = torch.zeros(n_contextual, device=features.device).index_add_(0, assign, torch.ones_like(assign, dtype=torch.float))
    contextual = features[targets].float() + sums / counts.clamp(min=1)[:, None]
    return Reduction(
        torch.cat([dominant, targets]),
        features=torch.cat([features[dominant], contextual.to(features.dtype)]),
    )


@register
class VisionZip(VisionMethod):
    """VisionZip (Yang et al., CVPR 2025, "VisionZip: Longer is Better but Not Necessary in
    Vision Language Models"; dvlab-research/VisionZip).

    Per image: dominant tokens = top-k by the attention the CLS token pays them in the tower's
    feature layer (summed over heads); the rest are merged into contextual tokens by key
    similarity to uniformly spaced targets (:func:`visionzip_reduce`). Defaults: 54 dominant of
    every 64 kept (``dominant_ratio`` = 54/64, the official 54 + 10 split, scaled to the
    budget). The adapter supplies ``ctx.tower_attention()`` -> (attention [N], keys [N, d]):
    CLS attention averaged over heads (the official code sums them: same ranking) and the feature
    layer's keys averaged over heads. Towers without a CLS token (SigLIP in LLaVA-OneVision) give
    the mean attention each token receives instead, bilinearly pooled to each video frame's token
    grid as the model pools its features; OneVision's anyres image tiles and Qwen2-VL's windowed
    tower have no per-token tower row, so VisionZip runs on LLaVA-1.5 images and OneVision video. Difference from the official code: tokens are merged after the
    projector (the vision stage sees projected features), the official code merges tower
    outputs and projects the merged tokens.
    """

    name = "visionzip"
    supported = ("llava", "llava_onevision")  # adapters that tap the tower feature layer (OneVision: video frames)
    paper = "VisionZip, Yang et al., CVPR 2025 (dvlab-research/VisionZip)"

    def __init__(self, dominant_ratio: float = 54 / 64, keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if not 0 <= dominant_ratio <= 1:
            raise ValueError(f"VisionZip dominant_ratio must be in [0, 1], got {dominant_ratio!r}")
        self.dominant_ratio = dominant_ratio

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        if ctx.tower_attention is None:
            raise ValueError(
                "visionzip needs the vision tower's attention and keys (VisionContext.tower_attention), which "
                "this model's adapter does not provide for this input: VisionZip runs on LLaVA-1.5 images and "
                "LLaVA-OneVision videos (not OneVision's anyres image tiles); use divprune, cdpruner, pool or random"
            )
        attention, keys = ctx.tower_attention()
        if attention.shape[0] != n or keys.shape[0] != n:
            raise ValueError(
                f"visionzip: tower_attention gave {attention.shape[0]} scores and {keys.shape[0]} keys "
                f"for {n} image tokens; the adapter must return one per token"
            )
        dominant, contextual = split_budget(ctx.n_keep, self.dominant_ratio)
        return visionzip_reduce(ctx.features, attention, keys, dominant, contextual)
