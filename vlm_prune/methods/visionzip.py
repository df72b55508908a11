"""VisionZip: keep the tokens the vision tower's CLS attends to, merge the rest into a few."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, VisionContext, VisionMethod, check_positions
from vlm_prune.registry import register

VARIANTS = ("official", "slots")


@dataclass
class TowerFeatures:
    """The pre-projector view of one image that an adapter hands VisionZip (third item of
    ``VisionContext.tower_attention()``), so it can merge where the official code merges.

    features: [N, C] the feature layer's outputs of the image's N tokens (what the projector
        reads), in the order of ``VisionContext.features``.
    cls: [C] the feature layer's CLS output when the model's features leave CLS out (LLaVA's
        'default' strategy); None otherwise.
    project: the model's projector, [M, C] -> [M, D].
    last_qk: optional callable () -> (q [T, C], k [T, C]): the tower's last encoder layer's query and
        key projections (all heads as one) of the image's T tower tokens (CLS first), when the
        feature layer is that layer or the one before (PruMerge's attention); None otherwise.
    """

    features: torch.Tensor
    cls: torch.Tensor | None
    project: Callable[[torch.Tensor], torch.Tensor]
    last_qk: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


def split_budget(n_keep: int, dominant_ratio: float) -> tuple[int, int]:
    """(dominant, contextual) counts: round(n_keep * ratio) dominant, the rest contextual."""
    dominant = min(n_keep, max(0, round(n_keep * dominant_ratio)))
    return dominant, n_keep - dominant


def contextual_groups(keys: torch.Tensor, rest: torch.Tensor, n_contextual: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(targets, others, assign) of VisionZip's contextual merge over the ``rest`` tokens (in
    order): every (R // n_contextual)-th of them (the first n_contextual) is a target; every other
    joins the target of highest key cosine similarity (``assign`` indexes ``targets``)."""
    step = max(1, rest.numel() // n_contextual)
    is_target = torch.zeros(rest.numel(), dtype=torch.bool, device=rest.device)
    is_target[torch.arange(0, rest.numel(), step, device=rest.device)[:n_contextual]] = True
    targets, others = rest[is_target], rest[~is_target]
    kn = F.normalize(keys.float(), dim=-1)
    return targets, others, (kn[others] @ kn[targets].t()).argmax(dim=1)


def merge_contextual(features: torch.Tensor, targets: torch.Tensor, others: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """Contextual tokens [C, D]: target + mean(joined tokens) (the official formula: the target is
    added to, not averaged with, the mean; no joined token -> the target itself)."""
    n = targets.numel()
    sums = torch.zeros(n, features.shape[1], device=features.device)
    sums.index_add_(0, assign, features[others].float())
    counts = torch.zeros(n, device=features.device).index_add_(0, assign, torch.ones_like(assign, dtype=torch.float))
    return (features[targets].float() + sums / counts.clamp(min=1)[:, None]).to(features.dtype)


def visionzip_reduce(
    features: torch.Tensor, attention: torch.Tensor, keys: torch.Tensor, n_dominant: int, n_contextual: int
) -> Reduction:
    """VisionZip on one image's projected tokens, each kept token at its own slot (``variant="slots"``).

    features: [N, D] tokens to keep / merge; attention: [N] attention each token receives from
    the CLS token (or the adapter's substitute); keys: [N, d] the tower's keys (similarity).
    Dominant: the ``n_dominant`` tokens of highest attention, unchanged. Contextual: the rest
    merged by :func:`contextual_groups` / :func:`merge_contextual`, each at its target's slot.
    """
    dominant = torch.topk(attention.float(), n_dominant, sorted=False).indices
    rest = remaining(features.shape[0], dominant)
    n_contextual = min(n_contextual, rest.numel())
    into = torch.full((features.shape[0],), -1, dtype=torch.long, device=features.device)
    into[dominant] = dominant
    if n_contextual == 0:
        return Reduction(torch.sort(dominant).values, merged_into=into)
    targets, others, assign = contextual_groups(keys, rest, n_contextual)
    into[targets] = targets
    into[others] = targets[assign]
    return Reduction(
        torch.cat([dominant, targets]),
        features=torch.cat([features[dominant], merge_contextual(features, targets, others, assign)]),
        merged_into=into,
    )


def visionzip_official(
    tower: TowerFeatures, attention: torch.Tensor, keys: torch.Tensor, n_dominant: int, n_contextual: int
) -> Reduction:
    """VisionZip as the official LLaVA code (``variant="official"``) on one image.

    The dominant tokens include CLS when the tower has one the features leave out: CLS plus the
    n_dominant - 1 patches of highest CLS attention (the official ``visionzip(model, dominant=54)``
    keeps CLS + 53 patches). The rest merge into contextual tokens on the tower's features, BEFORE
    the projector; [CLS, dominant patches in patch order, contextual tokens in target order] are
    projected together and packed contiguously into the image's first n_dominant + n_contextual
    slots.
    """
    n = tower.features.shape[0]
    n_patches = n_dominant - (1 if tower.cls is not None and n_dominant > 0 else 0)
    dominant = torch.sort(torch.topk(attention.float(), n_patches, sorted=False).indices).values
    rest = remaining(n, dominant)
    n_contextual = min(n_contextual, rest.numel())
    parts = [] if tower.cls is None or n_dominant == 0 else [tower.cls[None]]
    parts.append(tower.features[dominant])
    # the packed slot each image token ends in (CLS, when packed, is slot 0 and no image token)
    into = torch.full((n,), -1, dtype=torch.long, device=dominant.device)
    into[dominant] = torch.arange(dominant.numel(), device=dominant.device) + len(parts) - 1
    if n_contextual:
        targets, others, assign = contextual_groups(keys, rest, n_contextual)
        parts.append(merge_contextual(tower.features, targets, others, assign))
        first = len(parts) - 2 + dominant.numel()
        into[targets] = torch.arange(n_contextual, device=dominant.device) + first
        into[others] = assign + first
    packed = torch.cat(parts)
    return Reduction(torch.arange(packed.shape[0], device=packed.device), features=tower.project(packed),
                     merged_into=into)


def tower_view(ctx: VisionContext, name: str, title: str) -> tuple[torch.Tensor, torch.Tensor, TowerFeatures | None]:
    """(attention [N], keys [N, d], TowerFeatures or None) of the image in ``ctx``, from the adapter's
    tap on the vision tower's feature layer, for the methods that rank by the tower's CLS attention
    (VisionZip, FasterVLM, VisPruner); a clear error where the adapter has no per-token tower row."""
    n = ctx.features.shape[0]
    if ctx.tower_attention is None:
        raise ValueError(
            f"{name} needs the vision tower's attention and keys (VisionContext.tower_attention), which "
            f"this model's adapter does not provide for this input: {title} runs on LLaVA-1.5 images and "
            "LLaVA-OneVision videos (not OneVision's anyres image tiles); use divprune, cdpruner, pool or random"
        )
    attention, keys, *extra = ctx.tower_attention()
    if attention.shape[0] != n or keys.shape[0] != n:
        raise ValueError(
            f"{name}: tower_attention gave {attention.shape[0]} scores and {keys.shape[0]} keys "
            f"for {n} image tokens; the adapter must return one per token"
        )
    return attention, keys, (extra[0] if extra else None)


def remaining(n: int, dominant: torch.Tensor) -> torch.Tensor:
    """The indices 0..n-1 not in ``dominant``, ascending."""
    is_rest = torch.ones(n, dtype=torch.bool, device=dominant.device)
    is_rest[dominant] = False
    return torch.nonzero(is_rest).squeeze(1)


@register
class VisionZip(VisionMethod):
    """VisionZip (Yang et al., CVPR 2025, "VisionZip: Longer is Better but Not Necessary in
    Vision Language Models"; dvlab-research/VisionZip, visionzip/ main.py, utils.py and
    clip_encoder.py, read at ccb20fe and in its mirrors BloomBerry/VisionZip@bedde85 and
    Fanziyang-v/VisionZip@0247897).

    Per image: dominant tokens = top-k by the attention the CLS token pays them in the tower's
    feature layer (summed over heads); the rest are merged into contextual tokens by key
    similarity (keys averaged over heads) to uniformly spaced targets. Defaults: 54 dominant of
    every 64 kept (``dominant_ratio`` = 54/64, the official 54 + 10 split, scaled to the budget),
    ``variant="official"``:
      - "official" (LLaVA-1.5, whose adapter hands the tower's features and projector over as a
        :class:`TowerFeatures`): the official code exactly - the 54 dominant tokens are CLS + 53
        patches (its ``apply_info(dominant - 1)``), the contextual merge runs on the feature layer's
        outputs before the projector, and [CLS, dominant, contextual] are packed contiguously, here
        into the image's first k placeholder slots (:func:`visionzip_official`).
      - "slots" (the variant the project used before, kept as an option): no CLS, the merge on the
        projected features, each dominant token at its own slot and each contextual token at its
        target's slot (:func:`visionzip_reduce`), so spatial positions survive.
    ``positions``: "renumber" (the official code - llava/model/llava_arch.py at ccb20fe,
    ``prepare_inputs_labels_for_multimodal``, concatenates the k image tokens between the text
    pieces and numbers the result 0..n-1 - gives the LLM the shorter sequence, so every row
    after the removal is renumbered without gaps - the k image tokens follow the text before them
    and the text after the image follows the k tokens - and decode steps continue from that
    count) or "keep" (original position ids, gaps stay; the "slots" variant's point). Default:
    "renumber" with ``variant="official"``, "keep" with ``variant="slots"``.
    Towers without a CLS token (SigLIP in LLaVA-OneVision) give the mean attention each token
    receives instead, bilinearly pooled to each video frame's token grid as the model pools its
    features; the model projects before it pools, so OneVision video always runs the "slots"
    reduction (with ``variant="official"`` its rows are still renumbered, as the official code's
    shorter sequence). OneVision's anyres image tiles and Qwen2-VL's windowed tower have no
    per-token tower row, so VisionZip runs on LLaVA-1.5 images and OneVision video.
    """

    name = "visionzip"
    supported = ("llava", "llava_onevision")  # adapters that tap the tower feature layer (OneVision: video frames)
    needs_tower_attention = True
    family_notes = {"llava_onevision": "video only: its anyres image tiles have no per-token tower row"}
    paper = "VisionZip, Yang et al., CVPR 2025 (dvlab-research/VisionZip)"

    def __init__(self, dominant_ratio: float = 54 / 64, variant: str = "official", positions: str | None = None,
                 keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if not 0 <= dominant_ratio <= 1:
            raise ValueError(f"VisionZip dominant_ratio must be in [0, 1], got {dominant_ratio!r}")
        if variant not in VARIANTS:
            raise ValueError(f"VisionZip variant must be one of {VARIANTS}, got {variant!r}")
        check_positions("VisionZip", positions)
        self.dominant_ratio = dominant_ratio
        self.variant = variant
        self.positions = positions

    @property
    def renumber_positions(self) -> bool:
        """True when the rows after the removal are renumbered without gaps (official)."""
        if self.positions is not None:
            return self.positions == "renumber"
        return self.variant == "official"

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        attention, keys, tower = tower_view(ctx, "visionzip", "VisionZip")
        dominant, contextual = split_budget(ctx.n_keep, self.dominant_ratio)
        if self.variant == "official" and tower is not None:
            return visionzip_official(tower, attention, keys, dominant, contextual)
        return visionzip_reduce(ctx.features, attention, keys, dominant, contextual)
