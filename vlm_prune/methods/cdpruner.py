"""CDPruner: query-conditioned determinantal point process over an image's visual tokens."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, VisionContext, VisionMethod
from vlm_prune.registry import register


def relevance(features: torch.Tensor, text_embeds: torch.Tensor, negate: bool = True) -> torch.Tensor:
    """Per-token relevance to the instruction, min-max normalised as the official code.

    r_i = mean_t cos(features_i, text_t), negated when ``negate`` (the official LLaVA code ranks
    by -cos), then r = (r - min r + 1e-6) / (max r - min r). Returns [N] float32.
    """
    sim = F.normalize(features.float(), dim=-1) @ F.normalize(text_embeds.float(), dim=-1).t()
    r = sim.mean(dim=-1)
    if negate:
        r = -r
    return (r - r.min() + 1e-6) / (r.max() - r.min()).clamp(min=1e-6)


def conditional_kernel(features: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """L = diag(r) S diag(r), S the cosine similarity of the rows of features [N, D]."""
    xn = F.normalize(features.float(), dim=-1)
    return rel[:, None] * (xn @ xn.t()) * rel[None, :]


def dpp_greedy_map(kernel: torch.Tensor, k: int, eps: float = 1e-10) -> torch.Tensor:
    """Greedy MAP inference of a DPP with PSD kernel [N, N], by incremental Cholesky
    (Chen et al., NeurIPS 2018), as the official code: each step adds the item with the largest
    residual d_i^2 (the gain in log det), then updates every residual. Returns [k] indices in
    the order chosen. Once every residual is <= eps (k beyond the kernel's rank), the remaining
    picks go to the unchosen items of largest diagonal (relevance^2).
    """
    n = kernel.shape[0]
    k = max(0, min(int(k), n))
    kernel = kernel.float()
    cis = torch.zeros(k, n, device=kernel.device)
    di2 = torch.diagonal(kernel).clone()
    chosen: list[int] = []
    for i in range(k):
        j = int(di2.argmax())
        if float(di2[j]) <= eps:
            break
        chosen.append(j)
        e = (kernel[j] - cis[:i, j] @ cis[:i]) / math.sqrt(float(di2[j]))
        cis[i] = e
        di2 = di2 - e * e
        di2[j] = float("-inf")
    if len(chosen) < k:
        rest = torch.diagonal(kernel).clone()
        rest[torch.tensor(chosen, dtype=torch.long, device=kernel.device)] = float("-inf")
        chosen += torch.topk(rest, k - len(chosen)).indices.tolist()
    return torch.tensor(chosen, dtype=torch.long, device=kernel.device)


@register
class CDPruner(VisionMethod):
    """CDPruner (2025, "Beyond Attention or Similarity: Maximizing Conditional
    Diversity for Token Pruning in MLLMs"; Theia-4869/CDPruner).

    Per image, keep the ``n_keep`` tokens of the greedy MAP of a conditional DPP with kernel
    L = diag(r) S diag(r) (:func:`conditional_kernel`, :func:`dpp_greedy_map`): S the cosine
    similarity of the projected visual features, r their relevance to the instruction
    (:func:`relevance` with ``ctx.text_embeds``, the LLM input embeddings of the question
    tokens). Defaults follow the official LLaVA code: r = min-max normalised NEGATED mean cosine
    (``negate_relevance=True``), no exponential reweighting (``theta=None``; theta in (0, 1)
    applies r <- exp(theta / (2 (1 - theta)) r), the option the official code leaves commented
    out). The official code measures relevance in CLIP's joint image-text space; here features
    and text embeddings share the LLM's input space instead (the sign of that relation is not
    verified; flip it with ``negate_relevance=False``). Without text embeddings r = 1 and
    CDPruner is a plain DPP (pure diversity).
    """

    name = "cdpruner"
    paper = "CDPruner, 2025 (Theia-4869/CDPruner)"

    def __init__(
        self,
        negate_relevance: bool = True,
        theta: float | None = None,
        keep: float | None = None,
        budget: int | None = None,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if theta is not None and not 0 < theta < 1:
            raise ValueError(f"CDPruner theta must be in (0, 1) or None, got {theta!r}")
        self.negate_relevance = negate_relevance
        self.theta = theta

    def relevance(self, ctx: VisionContext) -> torch.Tensor:
        """[N] relevance weights r of the image's tokens (ones without text embeddings)."""
        feats = ctx.features
        if ctx.text_embeds is None or ctx.text_embeds.shape[0] == 0:
            return torch.ones(feats.shape[0], device=feats.device)
        r = relevance(feats, ctx.text_embeds.to(feats.device), self.negate_relevance)
        if self.theta is not None:
            r = torch.exp(self.theta / (2 * (1 - self.theta)) * r)
        return r

    def reduce_image(self, ctx: VisionContext) -> Reduction:
        n = ctx.features.shape[0]
        if ctx.n_keep >= n:
            return Reduction.keep_all(n, ctx.features.device)
        kernel = conditional_kernel(ctx.features, self.relevance(ctx))
        return Reduction(torch.sort(dpp_greedy_map(kernel, ctx.n_keep)).values)
