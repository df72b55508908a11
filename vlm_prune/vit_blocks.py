"""Shared pieces of ViT-stage methods (AS-ViT, ToMe) and of the adapters that run them.

A ViT-stage method replaces the forward of every transformer block of one model instance.
For each block the adapter hands it a :class:`BlockOps` - the block's own sub-computations
(the attention branch with an optional additive bias or key weights, the MLP branch, the
original forward) - and a :class:`ViTRun` that carries state from block to block within one
forward pass (merged-token sizes, the soft keep mask while calibrating, token counts). The
scoring maths lives in the methods; adapters only know where a model keeps its modules, so
the same method runs in any pre-norm ViT (timm blocks today, a CLIP vision tower later).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vlm_prune.methods.base import Method


@dataclass
class AttentionResult:
    """One block's attention branch on tokens x [B, N, D].

    out: [B, N, D] the residual update (after projection, layer scale and drop path).
    q, k, v: [B, H, N, d] the heads' queries (unscaled), keys and values.
    heads: [B, H, N, d] per-head outputs A_h V_h before the output projection.
    probs: [B, H, N, N] attention probabilities, only when they were computed explicitly
        (the key-weights path used while calibrating); None on the fused path.
    """

    out: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: torch.Tensor
    probs: torch.Tensor | None = None


class BlockOps(Protocol):
    """What an adapter exposes of one pre-norm transformer block (x + attn(x), x + mlp(x))."""

    index: int  # 0-indexed position of the block
    depth: int  # number of blocks in the model
    num_heads: int
    scale: float  # the attention logit scale (head_dim ** -0.5 in timm and CLIP)
    dim: int  # width of the residual stream
    mlp_hidden: int  # hidden width of the MLP (for FLOP counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's original forward, untouched."""
        ...

    def attention(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, key_weights: torch.Tensor | None = None
    ) -> AttentionResult:
        """The attention branch on x. ``bias`` [B, 1, 1, N] is added to the logits (fused
        path kept); ``key_weights`` [B, N] in [0, 1] scale each key's exp-logit (explicit
        path, see :func:`weighted_softmax`). With neither, bit-identical to the block's own."""
        ...

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual update of the MLP branch."""
        ...


def block_flops(n_tokens: torch.Tensor | float, dim: int, mlp_hidden: int) -> torch.Tensor | float:
    """Multiply-accumulates of one transformer block on n tokens, as AS-ViT / DynamicViT count
    them: qkv + output projections 4 D^2 n, attention logits and A V 2 D n^2, MLP 2 D M n."""
    n = n_tokens
    return 4 * dim * dim * n + 2 * dim * n * n + 2 * dim * mlp_hidden * n


def weighted_softmax(logits: torch.Tensor, key_weights: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Softmax over keys where key j's exp-logit is multiplied by key_weights[b, j].

    logits: [B, H, N, N]; key_weights: [B, N] (a 0/1 keep mask, differentiable when it comes
    from a straight-through estimator). Every token still attends to itself, so rows of
    dropped tokens stay well defined; eps keeps fully masked rows finite. This is the
    "softmax with policy" of DynamicViT and AS-ViT: with a hard 0/1 mask it equals attention
    over the kept keys only (plus the token itself), up to eps.
    """
    n = logits.shape[-1]
    w = key_weights[:, None, None, :].to(torch.float32)
    eye = torch.eye(n, dtype=w.dtype, device=w.device)[None, None]
    w = w + (1.0 - w) * eye
    e = (logits.float() - logits.float().amax(-1, keepdim=True)).exp() * w
    return ((e + eps / n) / (e.sum(-1, keepdim=True) + eps)).to(logits.dtype)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` [B, k] of x [B, N, ...]."""
    shape = index.shape + x.shape[2:]
    return x.gather(1, index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape))


@dataclass
class ViTRun:
    """State of one forward pass through the blocks (created by the adapter at block 0).

    n_prefix: leading tokens that are never pruned or merged (CLS, distillation, registers).
    n_tokens: tokens entering block 0 (prefix + patches).
    sizes: [B, N] how many original patches each token stands for (ToMe); None = all 1.
    slots: [B, N] index in the block-0 input of each token (a merged token: that of the token
        it was merged into), so adapters can map survivors back to patches; None = 0 .. N-1.
    members: [B, N0] for each block-0 input token, the index among the current tokens of the
        token it is now part of (ToMe's merges composed over the blocks); None = not merged.
    policy: [B, N] soft keep mask while calibrating AS-ViT; None = all kept.
    pad: [B, N] bool, False for padding rows when the rows of a batch hold different token counts
        (MustDrop's per-image window merge); None = no padding. Blocks mask padded keys.
    protected: [B, N] long, for each current token its rank among the tokens a later stage must
        keep (MustDrop's key set by the tower's [CLS] attention, 0 = most attended), -1 for the
        others; None = none protected.
    target: patch tokens each row should end with, set by the adapter when a row is not a whole
        image (LLaVA-NeXT's anyres tiles share an image's budget); None = the method's
        ``n_keep(n_patches)`` (keep / budget per row).
    tokens: tokens entering each block (the tensor length; per image after pruning).
    flops: each block's FLOPs, as floats or (while calibrating) [B] tensors.
    """

    n_prefix: int
    n_tokens: int
    sizes: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    members: torch.Tensor | None = None
    policy: torch.Tensor | None = None
    pad: torch.Tensor | None = None
    protected: torch.Tensor | None = None
    target: int | None = None
    tokens: list[int] = field(default_factory=list)
    flops: list[torch.Tensor | float] = field(default_factory=list)
    full_flops: float = 0.0

    @property
    def n_patches(self) -> int:
        return self.n_tokens - self.n_prefix

    def token_slots(self, batch: int, device: torch.device | str) -> torch.Tensor:
        """[B, N] slots of the current tokens (see ``slots``)."""
        if self.slots is not None:
            return self.slots
        return torch.arange(self.n_tokens, device=device).expand(batch, -1)

    def record(self, ops: BlockOps, x: torch.Tensor) -> None:
        n = x.shape[1]
        self.tokens.append(n)
        live = self.policy.sum(1) if self.policy is not None else float(n)
        self.flops.append(block_flops(live, ops.dim, ops.mlp_hidden))
        self.full_flops += float(block_flops(float(self.n_tokens), ops.dim, ops.mlp_hidden))

    def flops_ratio(self) -> torch.Tensor | float:
        """FLOPs of the blocks run so far over the same blocks unpruned ([B] while calibrating)."""
        return sum(self.flops) / self.full_flops

    def summary(self, tokens_out: int | None = None) -> dict[str, object]:
        """Stats of the run: tokens entering each block, the blocks' FLOPs ratio and, given the
        last block's output length ``tokens_out``, the patch tokens left (``patches_out``: prefix
        excluded, after a merge inside the last block too)."""
        ratio = self.flops_ratio()
        if isinstance(ratio, torch.Tensor):
            ratio = float(ratio.detach().float().mean())
        out: dict[str, object] = {"tokens_per_block": list(self.tokens), "flops_ratio": float(ratio)}
        if tokens_out is not None:
            out["patches_out"] = tokens_out - self.n_prefix
        return out


class ViTMethod(Method):
    """A method that prunes or merges tokens inside a ViT (stage "vit"), block by block.

    Subclasses implement :meth:`run_block`; the adapter calls :meth:`block_forward` in
    place of every block's forward.
    """

    stage = "vit"

    def __init__(self, keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        self._active = True
        self._last_run: ViTRun | None = None

    @property
    def last_run(self) -> ViTRun | None:
        """The state of the latest forward pass (token counts, FLOPs, merged sizes)."""
        return self._last_run

    def block_forward(self, ops: BlockOps, x: torch.Tensor, run: ViTRun) -> torch.Tensor:
        self._last_run = run
        run.record(ops, x)
        if not self._active:
            return ops.forward(x)
        return self.run_block(ops, x, run)

    def run_block(self, ops: BlockOps, x: torch.Tensor, run: ViTRun) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def patch_target(self, run: ViTRun) -> int:
        """Patch tokens a row of ``run`` ends with: the adapter's per-row share of an image's
        target when it set one (``run.target``), else keep / budget of the row's patches."""
        if run.target is not None:
            return max(1, min(run.n_patches, run.target))
        return self.n_keep(run.n_patches, 1)

    def budget_warning(self, adapter: Any) -> str | None:
        """The adapter's note when its tower rows are not whole images (LLaVA-NeXT's tiles)."""
        note = getattr(adapter, "vit_budget_note", None)
        return note(self) if note is not None else None
