"""Vision-stage selectors on a real pretrained ViT's tokens (part of ``vlm-prune bench --kinds vit-real``).

The methods that choose a VLM's visual tokens from the vision tower's [CLS] attention, keys or the
tokens themselves (VisionZip, FasterVLM, VisPruner, HiRED, PruMerge, DivPrune, CDPruner without an
instruction, i.e. its diversity part; random as the baseline) run here on the DINOv2 ViT-S/14
backbone of :mod:`vlm_prune.eval.real_vit`, unchanged, through the same :class:`VisionContext` a VLM
adapter builds: ``features`` = the 256 final-norm patch tokens (the "projector" is the identity),
``tower_attention`` = the last block's [CLS] attention row (mean over heads) and keys (mean over
heads) computed on that block's input, with :class:`TowerFeatures` (final tokens, the CLS token, the
last block's query / key projections) for the methods that merge or recompute attention there.
Each image's kept rows (merged rows where a method merges) are averaged and classified by a linear
probe, at 25 / 11 / 5% of the tokens: one fitted on the mean of ALL patch tokens of unpruned train
images (does the selection keep the image's average token? a random subset is an unbiased estimate
of it, so this probe favours random selections), and one refitted on each selection's own train
means (does the selection keep what tells the classes apart?).
"""
from __future__ import annotations

from typing import Any

import torch

from vlm_prune.methods.base import Reduction, VisionContext
from vlm_prune.methods.visionzip import TowerFeatures
from vlm_prune.registry import method_class

#: pool is left out: the mean of average-pooled tokens is the mean of all tokens, whatever the budget
SELECTORS = ("visionzip", "fastervlm", "vispruner", "hired", "prumerge", "divprune", "cdpruner", "random")
FRACTIONS = (0.25, 0.11, 0.05)


class LastBlockTap:
    """Keeps the input of a timm ViT's last block from the latest forward (a forward pre-hook)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.block = model.blocks[-1]
        self.input: torch.Tensor | None = None
        self.handle = self.block.register_forward_pre_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.input = args[0].detach()

    def remove(self) -> None:
        self.handle.remove()

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(CLS attention [B, N] mean over heads, keys [B, N, d] mean over heads, q [B, T, C],
        k [B, T, C]) of the last block on its kept input (patches only for the first two)."""
        attn, x = self.block.attn, self.input
        b, t, c = x.shape
        qkv = attn.qkv(self.block.norm1(x))
        q_all, k_all = qkv[..., :c], qkv[..., c : 2 * c]
        q = q_all.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = k_all.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        probs = (torch.einsum("bhd,bhnd->bhn", q[:, :, 0], k) * attn.scale).softmax(-1)
        return probs[:, :, 1:].mean(1), k[:, :, 1:].mean(1), q_all, k_all


def reduce_patches(name: str, fraction: float, tokens: torch.Tensor, views: tuple[torch.Tensor, ...],
                   seed: int) -> Reduction:
    """Selector ``name`` at ``fraction`` of one image's patch tokens: ``tokens`` [1 + N, C] (CLS first, the
    final-norm output), ``views`` that image's (CLS attention [N], keys [N, d], q [T, C], k [T, C]) from
    :meth:`LastBlockTap.views`; ``seed`` seeds the sampling methods."""
    attention, keys, q, k = views
    feats = tokens[1:]
    n = feats.shape[0]
    side = int(round(n ** 0.5))
    tower = TowerFeatures(feats, tokens[0], lambda m: m, lambda: (q, k))
    ctx = VisionContext(features=feats, n_keep=max(1, round(n * fraction)), grid=(side, side),
                        tower_attention=lambda: (attention, keys, tower), generator=torch.Generator().manual_seed(seed))
    return method_class(name)(keep=fraction).reduce_image(ctx)


def reduced_means(tokens: torch.Tensor, tap: LastBlockTap, names: tuple[str, ...], fractions: tuple[float, ...],
                  seed: int) -> dict[str, torch.Tensor]:
    """'name@fraction' -> [B, C] mean of the rows each selector keeps of each image's patch tokens
    (tokens [B, 1 + N, C]: the final-norm output of the unpruned forward that filled ``tap``)."""
    views = tap.views()
    out: dict[str, list[torch.Tensor]] = {}
    for i in range(tokens.shape[0]):
        feats = tokens[i, 1:]
        for name in names:
            for frac in fractions:
                red = reduce_patches(name, frac, tokens[i], tuple(v[i] for v in views), seed + i)
                kept = red.features if red.features is not None else feats[red.indices]
                out.setdefault(f"{name}@{frac}", []).append(kept.mean(0))
    return {k: torch.stack(v) for k, v in out.items()}
