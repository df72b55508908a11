"""CDPruner: query-conditioned determinantal point process over an image's visual tokens."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import Reduction, ShorterSequence, VisionContext, VisionMethod, check_positions
from vlm_prune.methods.divprune import DENSE_MAX
from vlm_prune.registry import register
from vlm_prune.relevance import IN_MODEL_NEGATED, instruction_relevance


def relevance(features: torch.Tensor, text_embeds: torch.Tensor, negate: bool = IN_MODEL_NEGATED) -> torch.Tensor:
    """Per-token relevance to the instruction, min-max normalised as the official code.

    r_i = :func:`~vlm_prune.relevance.instruction_relevance` (mean_t cos(features_i, text_t),
    negated when ``negate``: the project's one sign convention for in-model embeddings, the
    official code's ``-cos``), then r = (r - min r + 1e-6) / (max r - min r). Returns [N] float32.
    """
    r = instruction_relevance(features, text_embeds, negate)
    return (r - r.min() + 1e-6) / (r.max() - r.min()).clamp(min=1e-6)


def conditional_kernel(features: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """L = diag(r) S diag(r), S the cosine similarity of the rows of features [N, D] (dense,
    for reference; CDPruner itself reads rows through :class:`KernelRows`)."""
    xn = F.normalize(features.float(), dim=-1)
    return (xn @ xn.t()).mul_(rel[:, None]).mul_(rel[None, :])  # in place: (r_i s_ij) r_j


class KernelRows:
    """Rows of a PSD kernel [N, N] on demand: ``rows(j [1])`` -> [N], and ``diagonal`` [N].

    Either a dense kernel, or the conditional kernel L = diag(r) S diag(r) in factored form
    (normalised features and r), so a greedy pass needs O(N D) memory, not O(N^2).
    """

    def __init__(self, kernel: torch.Tensor | None = None, features: torch.Tensor | None = None,
                 rel: torch.Tensor | None = None, chunk: int = 1024) -> None:
        if (kernel is None) == (features is None):
            raise ValueError("KernelRows takes either a dense kernel or features (with relevance rel)")
        self.kernel = None if kernel is None else kernel.float()
        if features is not None:
            self.xn = F.normalize(features.float(), dim=-1)
            self.rel = torch.ones(features.shape[0], device=features.device) if rel is None else rel.float()
            # the diagonal from square blocks of the Gram matrix: the values (and so the
            # tie-breaking of the first pick) of the dense kernel, in O(chunk N) memory
            gram = torch.cat([torch.diagonal(b @ b.T) for b in self.xn.split(chunk)])
            self.diagonal = self.rel * gram * self.rel
        else:
            self.diagonal = torch.diagonal(self.kernel).clone()

    def rows(self, j: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.index_select(0, j)[0]
        return self.rel.index_select(0, j) * (self.xn @ self.xn.index_select(0, j)[0]) * self.rel

    def row(self, j: int) -> torch.Tensor:
        """Row ``j`` [N] for a host index (the values :meth:`rows` gives)."""
        if self.kernel is not None:
            return self.kernel[j]
        return self.rel[j : j + 1] * (self.xn @ self.xn[j]) * self.rel


def dpp_greedy_map(kernel: torch.Tensor | KernelRows, k: int, eps: float = 1e-10) -> torch.Tensor:
    """Greedy MAP inference of a DPP with PSD kernel [N, N] (a tensor or :class:`KernelRows`),
    by incremental Cholesky (Chen et al., NeurIPS 2018), as the official code: each step adds
    the item with the largest residual d_i^2 (the gain in log det), then updates every
    residual. Returns [k] indices in the order chosen. Once every residual is <= eps (k beyond
    the kernel's rank), the remaining picks go to the unchosen items of largest diagonal
    (relevance^2). The loop stays on the device: one host sync at the end, not one per step.
    """
    rows = kernel if isinstance(kernel, KernelRows) else KernelRows(kernel)
    diag = rows.diagonal
    n = diag.shape[0]
    k = max(0, min(int(k), n))
    if diag.device.type == "cpu":
        with torch.no_grad():  # indices only
            return _dpp_greedy_map_host(rows, k, eps)
    cis = torch.zeros(k, n, device=diag.device)
    di2 = diag.clone()
    chosen = torch.zeros(k, dtype=torch.long, device=diag.device)
    ok = torch.zeros(k, dtype=torch.bool, device=diag.device)
    for i in range(k):
        j = di2.argmax().view(1)
        best = di2.index_select(0, j)
        chosen[i], ok[i] = j[0], best[0] > eps
        # the square root in double precision, as the official code takes it from a Python float
        e = (rows.rows(j) - cis[:i].index_select(1, j)[:, 0] @ cis[:i]) / best.clamp(min=eps).double().sqrt().float()
        cis[i] = e
        di2 = di2 - e * e
        di2.index_fill_(0, j, float("-inf"))
    n_ok = int(ok.cumprod(0).sum())  # picks before the first residual <= eps
    if n_ok == k:
        return chosen
    rest = diag.clone()
    rest[chosen[:n_ok]] = float("-inf")
    return torch.cat([chosen[:n_ok], torch.topk(rest, k - n_ok).indices])


def _dpp_greedy_map_host(rows: KernelRows, k: int, eps: float) -> torch.Tensor:
    """:func:`dpp_greedy_map` on the CPU, indices on the host: the same arithmetic, fewer and
    cheaper operations per step, and it stops at the first residual <= eps."""
    diag = rows.diagonal
    n = diag.shape[0]
    eps32 = float(torch.tensor(eps, dtype=torch.float32))  # the threshold as the device loop compares it
    cis = torch.zeros(k, n)
    di2 = diag.clone()
    chosen: list[int] = []
    for i in range(k):
        j = int(di2.argmax())
        best = float(di2[j])
        if not best > eps32:
            break
        # the square root in double precision, divided in float32 (as the device loop)
        e = (rows.row(j) - cis[:i, j] @ cis[:i]) / math.sqrt(best)
        cis[i] = e
        di2 -= e * e
        di2[j] = float("-inf")
        chosen.append(j)
    if len(chosen) == k:
        return torch.tensor(chosen, dtype=torch.long)
    rest = diag.clone()
    rest[chosen] = float("-inf")
    return torch.cat([torch.tensor(chosen, dtype=torch.long), torch.topk(rest, k - len(chosen)).indices])


def crop_budgets(n_keep: int, sizes: list[int]) -> list[int]:
    """Split an image's ``n_keep`` tokens over crops of ``sizes`` tokens in proportion to their
    size (largest remainder, ties to the earlier crop): equal shares for equal crops, as the
    official per-crop budget, and exactly ``n_keep`` in total."""
    total = sum(sizes)
    if total == 0:
        return [0] * len(sizes)
    n_keep = min(n_keep, total)
    exact = [n_keep * s / total for s in sizes]
    out = [min(s, math.floor(e)) for s, e in zip(sizes, exact)]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: n_keep - sum(out)]:
        out[i] += 1
    return out


@register
class CDPruner(ShorterSequence, VisionMethod):
    """CDPruner (Zhang et al., 2025, "Beyond Attention or Similarity: Maximizing Conditional
    Diversity for Token Pruning in MLLMs"; Theia-4869/CDPruner@ed9c12d).

    Per image, keep the ``n_keep`` tokens of the greedy MAP of a conditional DPP with kernel
    L = diag(r) S diag(r) (:func:`conditional_kernel`, :func:`dpp_greedy_map`): S the cosine
    similarity of the projected visual features, r their relevance to the instruction
    (:func:`relevance` with ``ctx.text_embeds``, the LLM input embeddings of the question
    tokens). Defaults follow the official LLaVA code: r = min-max normalised NEGATED mean cosine
    (``negate_relevance=True``, the project's one sign convention for in-model embeddings, see
    vlm_prune.relevance: 61.3% vs 33.0% at 25% of the tokens on the shipped synthetic video models,
    no resolved difference on the image models), no
    exponential reweighting (``theta=None``; theta in (0, 1) applies
    r <- exp(theta / (2 (1 - theta)) r), the option the official code leaves commented out).
    The official code measures relevance between CLIP's patch embeddings and CLIP text
    embeddings; here the projected features and the LLM's text input embeddings share one space
    instead. Without text embeddings r = 1 and CDPruner is a plain DPP (pure diversity).

    LLaVA-NeXT (anyres): one selection per crop (the base image and every high-resolution
    tile), each with its own budget, as the official code (:meth:`reduce_crops`); the
    image_newline tokens are always kept and are not counted in the budget.
    ``positions``: "renumber" (default: the official code's shorter sequence numbered 0..n-1, as
    :class:`vlm_prune.methods.divprune.DivPrune`) or "keep" (original ids, gaps stay); Qwen2-VL keeps its
    M-RoPE positions.
    """

    name = "cdpruner"
    paper = "CDPruner, Zhang et al., 2025 (Theia-4869/CDPruner)"
    #: adapters with crops (LLaVA-NeXT) call :meth:`reduce_crops` instead of reduce_image
    per_crop = True

    def __init__(
        self,
        negate_relevance: bool = IN_MODEL_NEGATED,
        theta: float | None = None,
        positions: str | None = None,
        keep: float | None = None,
        budget: int | None = None,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if theta is not None and not 0 < theta < 1:
            raise ValueError(f"CDPruner theta must be in (0, 1) or None, got {theta!r}")
        check_positions("CDPruner", positions)
        self.positions = positions
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
        rel = self.relevance(ctx)
        # small images: the dense kernel is one matrix product (faster); large: rows on demand
        kernel = KernelRows(conditional_kernel(ctx.features, rel)) if n <= DENSE_MAX else KernelRows(features=ctx.features, rel=rel)
        return Reduction(torch.sort(dpp_greedy_map(kernel, ctx.n_keep)).values)

    def reduce_crops(self, ctx: VisionContext, crops: torch.Tensor) -> Reduction:
        """One selection per crop, as the official LLaVA-NeXT code.

        crops: [N] long, the crop of each of the image's tokens (0 = base image, 1.. = tiles) or
        -1 for tokens that are always kept (image_newline). ``ctx.n_keep`` counts the other
        tokens; :func:`crop_budgets` splits it over the crops by size (equal crops: equal
        budgets, the official ``visual_token_num`` per crop). Relevance is min-max normalised over
        all the image's crops together, as the official code normalises over the whole batch of
        crops; each crop then runs its own DPP on its own tokens.
        """
        crops = crops.to(ctx.features.device)
        kept = [torch.nonzero(crops < 0).squeeze(1)]
        visual = crops >= 0
        rel = torch.ones(crops.numel(), device=ctx.features.device)
        rel[visual] = self.relevance(VisionContext(ctx.features[visual], ctx.n_keep, text_embeds=ctx.text_embeds))
        ids = torch.unique(crops[visual]).tolist()
        members = [torch.nonzero(crops == c).squeeze(1) for c in ids]
        for idx, k in zip(members, crop_budgets(ctx.n_keep, [m.numel() for m in members])):
            if k >= idx.numel():
                kept.append(idx)
            elif k > 0:
                kept.append(idx[dpp_greedy_map(KernelRows(features=ctx.features[idx], rel=rel[idx]), k)])
        return Reduction(torch.sort(torch.cat(kept)).values)
