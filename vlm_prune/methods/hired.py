"""HiRED: share an anyres image's token budget over its partitions by the tower's [CLS] attention."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.methods.visionzip import tower_view
from vlm_prune.registry import register


@dataclass
class TileAttention:
    """The vision tower's view of one anyres image (LLaVA-NeXT) that an adapter hands HiRED
    (``VisionContext.tower_tiles()``).

    early: [T, n] the attention the [CLS] token pays each of the n patches of every tower row (T
        rows: the base image, then the high-resolution tiles in the processor's order) in the
        early layer, mean over heads.
    late: [T, n] the same in the feature layer (the layer the projector reads).
    crop: [N] the tower row of each of the image's N packed tokens, -1 for image_newline tokens.
    local: [N] the patch (0..n-1) of each packed token within its tower row, -1 for newlines.
    Packed tokens are what reaches the LLM after the model's unpadding, so a tile's patches that
    the unpadding cropped have no packed token.
    """

    early: torch.Tensor
    late: torch.Tensor
    crop: torch.Tensor
    local: torch.Tensor


def band_counts(early_base: torch.Tensor, n_top: int, n_tiles: int) -> torch.Tensor:
    """[n_tiles] HiRED's visual-content score of each high-resolution tile: how many of the base
    image's ``n_top`` patches of highest early-layer [CLS] attention fall in the tile's part of
    the base image. As the official code, the base image's patch list (row-major) is cut into
    ``n_tiles`` contiguous runs in tile order (its ``reshape(h, w, -1)``: horizontal bands, not 2-D
    blocks); the official reshape needs n divisible by the tile count, here the runs differ by
    one patch at most where it is not."""
    top = torch.zeros(early_base.numel(), dtype=torch.long, device=early_base.device)
    if n_top > 0:
        top[torch.topk(early_base.float(), n_top).indices] = 1
    return torch.stack([part.sum() for part in torch.tensor_split(top, n_tiles)])


def official_masks(tiles: TileAttention, rate: float, alpha: float) -> torch.Tensor:
    """[T, n] bool: the patches HiRED's official code keeps (hasanar1f/HiRED at 42be984,
    ``HiRED_token_selection`` / ``HiRED_sub_img_budgets``), before the model's unpadding.

    Budget B = int(T n rate); the base image keeps its min(int(B alpha), n) patches of highest
    feature-layer attention; the tiles share min(B - that, (T-1) n) in proportion to
    :func:`band_counts` of the base image's int(n (1 - alpha)) patches of highest early-layer
    attention, each share floored (int) and capped at n, and keep their share of highest
    feature-layer attention. A zero total count (alpha = 1) gives the tiles nothing (the official
    code divides by zero there)."""
    t, n = tiles.late.shape
    mask = torch.zeros(t, n, dtype=torch.bool, device=tiles.late.device)
    total = int(t * n * rate)
    base = min(int(total * alpha), n)
    mask[0, torch.topk(tiles.late[0].float(), base).indices] = True
    rest = min(total - base, (t - 1) * n)
    if rest > 0:
        counts = band_counts(tiles.early[0], int(n * (1 - alpha)), t - 1)
        if int(counts.sum()) > 0:
            shares = (counts.float() / counts.sum() * rest).int().clamp(max=n)
            for i, k in enumerate(shares.tolist()):
                mask[i + 1, torch.topk(tiles.late[i + 1].float(), k).indices] = True
    return mask


def weighted_shares(total: int, weights: list[float], caps: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder, ties to the earlier part),
    no part above its cap; what a capped part cannot take goes to the others in proportion to
    their weights (by capacity where no uncapped part has weight). Sums to min(total, sum(caps))."""
    shares = [0] * len(caps)
    left = min(int(total), sum(caps))
    while left > 0:
        open_ = [i for i in range(len(caps)) if shares[i] < caps[i]]
        w = {i: float(weights[i]) for i in open_}
        if sum(w.values()) <= 0:
            w = {i: float(caps[i] - shares[i]) for i in open_}
        norm = sum(w.values())
        exact = {i: left * w[i] / norm for i in open_}
        add = {i: min(math.floor(exact[i]), caps[i] - shares[i]) for i in open_}
        if all(math.floor(exact[i]) < caps[i] - shares[i] for i in open_):  # no cap hit: remainders now
            spare = left - sum(add.values())
            for i in sorted(open_, key=lambda i: (-(exact[i] - math.floor(exact[i])), i))[:spare]:
                add[i] += 1
        for i, a in add.items():
            shares[i] += a
        left -= sum(add.values())
    return shares


@register
class HiRED(ShorterSequence, VisionMethod):
    """HiRED (Arif et al., AAAI 2025, "HiRED: Attention-Guided Token Dropping for Efficient Inference
    of High-Resolution Vision-Language Models", arXiv 2408.10945; hasanar1f/HiRED at 42be984,
    transformers/src/transformers/models/llava_next/modeling_llava_next.py ``HiRED_token_selection``,
    ``HiRED_sub_img_budgets``, ``pack_HiRED_image_features``).

    Per LLaVA-NeXT image (the base image plus its anyres tiles, one tower row each), from the
    attention the tower's [CLS] token pays the patches (computed on the side from tapped layer
    inputs, mean over heads - the official sum over heads ranks alike):
      1. budget allocation: the base image keeps int(B ``alpha``) tokens; the rest of the budget is
         shared over the tiles in proportion to how many of the base image's int(n (1 - alpha))
         patches of highest attention in the EARLY layer (``early_layer``, official 0) fall in each
         tile's part of the base image (:func:`band_counts`);
      2. selection: every partition keeps its share of highest attention in the feature layer (the
         one the projector reads; the official code's layer 22 of 24 is LLaVA-NeXT's -2).
    Defaults (the official scripts): ``rate`` 0.2 (B = int(T n rate) over the T tower rows of n
    patches), ``alpha`` 0.5.

    Budget: without keep / budget the official arithmetic runs as is (:func:`official_masks`): each
    share is floored and the model's unpadding then drops the kept patches of a tile's padded rows,
    so fewer than B tokens reach the LLM. With keep / budget, B is the README's count of the image's
    visual tokens after unpadding and is met exactly: the base image keeps min(int(B alpha), its
    tokens), the tiles share the rest by the same counts with largest remainders, capped at the
    tokens each tile keeps after unpadding (:func:`weighted_shares`), and each tile ranks only
    those tokens.
    Differences from the official code: LLaVA-NeXT's image_newline tokens stay (the official
    packing leaves them out; here they are the model's layout, not visual tokens, never counted);
    the base image's band split tolerates tile counts that do not divide n. ``positions``:
    "renumber" (default: the official code merges the kept tokens into a shorter sequence numbered
    0..n-1) or "keep" (original ids, gaps stay). Runs on LLaVA-NeXT images with the 'default'
    feature strategy (the CLS token is no visual token), and on LLaVA-1.5 as the official single-partition
    version (transformers/.../llava/modeling_llava.py ``HiRED_token_selection``): the image's
    min(n, int(n rate)) patches of highest feature-layer attention (with keep / budget: that count),
    i.e. :class:`vlm_prune.methods.fastervlm.FasterVLM` at the official budget.
    """

    name = "hired"
    supported = ("llava", "llava_next", "llava_next_video")  # adapters that hand the tower's attention over
    family_notes = {"llava": "one partition (the official LLaVA-1.5 version: top int(n rate))",
                    "llava_next_video": "images only: its video frames have no anyres partitions"}
    needs_tower_attention = True
    #: adapters with crops (LLaVA-NeXT) call :meth:`reduce_crops` instead of reduce_image
    per_crop = True
    own_schedule = True
    paper = "HiRED, Arif et al., AAAI 2025 (hasanar1f/HiRED)"
    summary = "shares the budget over anyres partitions by early-layer [CLS] attention, keeps each one's top tokens"
    budget_note = ("without keep / budget: the official 20% of every tower row's patches, floored per tile and "
                   "cut by the unpadding; with them, exactly that many of the image's visual tokens")

    def __init__(self, rate: float = 0.2, alpha: float = 0.5, early_layer: int = 0, positions: str | None = None,
                 keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if not 0 < rate <= 1:
            raise ValueError(f"HiRED rate (the official token_budget_rate) must be in (0, 1], got {rate!r}")
        if not 0 <= alpha <= 1:
            raise ValueError(f"HiRED alpha (the base image's share of the budget) must be in [0, 1], got {alpha!r}")
        if isinstance(early_layer, bool) or not isinstance(early_layer, int) or early_layer < 0:
            raise ValueError(f"HiRED early_layer must be a tower encoder layer index >= 0, got {early_layer!r}")
        check_positions("HiRED", positions)
        self.rate = rate
        self.alpha = alpha
        self.early_layer = early_layer
        self.positions = positions

    def check_model(self, adapter) -> None:
        super().check_model(adapter)
        cfg = adapter.model.config
        if getattr(cfg, "vision_feature_select_strategy", "default") != "default":
            raise ValueError("hired ranks patches by the tower's [CLS] attention and needs "
                             "vision_feature_select_strategy='default' (CLS no visual token); this model uses "
                             f"{cfg.vision_feature_select_strategy!r}")
        tower = adapter.inner.vision_tower
        layers = len(getattr(tower, "vision_model", tower).encoder.layers)
        if self.early_layer >= layers:
            raise ValueError(f"hired early_layer={self.early_layer} is beyond the tower's {layers} layers")

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        """One partition (LLaVA-1.5): the official single-partition selection."""
        n = ctx.features.shape[0]
        official = self.keep is None and self.budget is None
        if not official and ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        if ctx.tower_attention is not None:
            attention, _, _ = tower_view(ctx, "hired", "HiRED")
            return Reduction.top_k(attention, min(n, int(n * self.rate)) if official else ctx.n_keep)
        raise ValueError("hired ranks an image's tokens by the tower's [CLS] attention and runs on LLaVA-NeXT and "
                         "LLaVA-1.5 images; this input (a video frame) has none - use divprune or pool for it")

    def reduce_crops(self, ctx: VisionContext, crops: torch.Tensor) -> Reduction:
        """The image's kept tokens (its newline tokens, crop -1, always among them)."""
        device = ctx.features.device
        crops = crops.to(device)
        visual = crops >= 0
        if ctx.tower_tiles is None:
            raise ValueError("hired needs the tower's per-tile [CLS] attention (VisionContext.tower_tiles), which "
                             "this model's adapter does not provide")
        if (self.keep is not None or self.budget is not None) and ctx.n_keep >= int(visual.sum()):
            return Reduction.keep_all(crops.numel(), device)
        tiles = ctx.tower_tiles()
        crop, local = tiles.crop.to(device), tiles.local.to(device)
        if not torch.equal(crop, crops):
            raise ValueError("hired: the adapter's tile map does not match the image's crops")
        if self.keep is None and self.budget is None:
            mask = official_masks(tiles, self.rate, self.alpha).to(device)
            chosen = mask[crop.clamp(min=0), local.clamp(min=0)] & visual
        else:
            chosen = self.budget_masks(tiles, crop, local, ctx.n_keep)
        return Reduction(torch.nonzero(chosen | ~visual).squeeze(1))

    def budget_masks(self, tiles: TileAttention, crop: torch.Tensor, local: torch.Tensor, n_keep: int) -> torch.Tensor:
        """[N] bool: exactly ``n_keep`` of the image's visual tokens (see the class docstring)."""
        t = tiles.late.shape[0]
        members = [torch.nonzero(crop == c).squeeze(1) for c in range(t)]
        sizes = [m.numel() for m in members]
        base = min(int(n_keep * self.alpha), sizes[0])
        rest = min(n_keep - base, sum(sizes[1:]))
        base = n_keep - rest  # what the tiles cannot take stays with the base image
        counts = band_counts(tiles.early[0], int(tiles.early.shape[1] * (1 - self.alpha)), t - 1) if t > 1 else None
        shares = [base] + (weighted_shares(rest, counts.tolist(), sizes[1:]) if t > 1 else [])
        chosen = torch.zeros(crop.numel(), dtype=torch.bool, device=crop.device)
        for c, (idx, k) in enumerate(zip(members, shares)):
            if k > 0:
                scores = tiles.late[c].to(crop.device).float()[local[idx]]
                chosen[idx[torch.topk(scores, k).indices]] = True
        return chosen
