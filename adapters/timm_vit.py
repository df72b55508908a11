"""Adapter for timm VisionTransformer models (ViT, DeiT) with a CLS token.

Every block's ``forward`` is replaced, on this instance only, by the ViT-stage method's
``block_forward`` (AS-ViT, ToMe). :class:`TimmBlockOps` reproduces timm's ``Block`` and
``Attention`` forward step by step (same operations in the same order, so the fused
``scaled_dot_product_attention`` path stays and results are bit-identical when nothing is
pruned) and exposes the pieces the methods need: q/k/v, per-head outputs, an additive
logit bias (ToMe's proportional attention) and key weights (AS-ViT calibration).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.vision_transformer import Block

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.base import Adapter, PerThread
from vlm_prune.vit_blocks import AttentionResult, ViTRun, weighted_softmax


class TimmBlockOps:
    """The sub-computations of one timm ``Block`` (see vlm_prune.vit_blocks.BlockOps)."""

    def __init__(self, block: Block, index: int, depth: int, forward: Callable[..., torch.Tensor]):
        attn = block.attn
        self.block = block
        self.index = index
        self.depth = depth
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scale
        self.attn_dim = getattr(attn, "attn_dim", attn.num_heads * attn.head_dim)
        self.dim = block.norm1.normalized_shape[0]
        fc1 = getattr(block.mlp, "fc1", None)
        self.mlp_hidden = fc1.out_features if isinstance(fc1, torch.nn.Linear) else 4 * self.dim
        self._forward = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def attention(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, key_weights: torch.Tensor | None = None
    ) -> AttentionResult:
        blk, attn = self.block, self.block.attn
        h = blk.norm1(x)
        b, n, _ = h.shape
        gate_layer = getattr(attn, "gate", None)
        gate = gate_layer(h).sigmoid() if gate_layer is not None else None
        qkv = attn.qkv(h).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        probs = None
        if key_weights is not None:
            logits = (q * self.scale) @ k.transpose(-2, -1)
            if bias is not None:
                logits = logits + bias
            probs = attn.attn_drop(weighted_softmax(logits, key_weights))
            heads = probs @ v
        elif attn.fused_attn:
            heads = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=attn.attn_drop.p if attn.training else 0.0
            )
        else:
            logits = (q * self.scale) @ k.transpose(-2, -1)
            if bias is not None:
                logits = logits + bias
            heads = attn.attn_drop(logits.softmax(dim=-1)) @ v
        out = heads.transpose(1, 2).reshape(b, n, self.attn_dim)
        out = getattr(attn, "norm", torch.nn.Identity())(out)
        if gate is not None:
            out = out * gate
        out = attn.proj_drop(attn.proj(out))
        return AttentionResult(blk.drop_path1(blk.ls1(out)), q, k, v, heads, probs)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        blk = self.block
        return blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))


class TimmViTAdapter(Adapter):
    """timm ``VisionTransformer`` (ViT, DeiT, ...) with a CLS token and standard blocks.

    Runs ViT-stage methods only. After each forward, ``model.vlm_prune.last_stats["vit"]``
    holds ``patches_out`` (the patch tokens leaving the last block: what keep / budget count),
    the tokens entering each block and the blocks' FLOPs ratio to the unpruned model.
    """

    family = "timm_vit"
    model_classes = ("VisionTransformer",)
    stages = FAMILY_STAGES[family]
    #: the calling thread's latest forward pass through the blocks
    run: ViTRun | None = PerThread()

    def __init__(self, model: torch.nn.Module, state: Any) -> None:
        super().__init__(model, state)
        name = type(model).__name__
        if getattr(model, "cls_token", None) is None:
            raise ValueError(
                f"this {name} has no CLS token (built with class_token=False); ViT token pruning "
                "scores tokens by the CLS row and keeps it as the classifier input. Use a model "
                "with a CLS token, e.g. timm.create_model('deit_small_patch16_224')."
            )
        for i, blk in enumerate(model.blocks):
            if not isinstance(blk, Block) or not isinstance(blk.attn, Attention):
                raise ValueError(
                    f"block {i} of this {name} is a {type(blk).__name__} with "
                    f"{type(getattr(blk, 'attn', None)).__name__} attention; vlm_prune's timm adapter "
                    "handles the standard timm Block with Attention (ViT, DeiT) only"
                )
        self.depth = len(model.blocks)
        self.n_prefix = int(model.num_prefix_tokens)

    def vit_tokens(self) -> tuple[int, int]:
        """(prefix tokens, patch tokens) entering block 0 at the model's image size."""
        return self.n_prefix, int(self.model.patch_embed.num_patches)

    def attach(self) -> None:
        method = self.state.methods["vit"]
        for i, blk in enumerate(self.model.blocks):
            ops = TimmBlockOps(blk, i, self.depth, self.patches.original(blk, "forward"))
            self.patches.set(blk, "forward", self._block_forward(ops, method))

    def _block_forward(self, ops: TimmBlockOps, method: Any) -> Callable[..., torch.Tensor]:
        def forward(x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
            if attn_mask is not None or is_causal:
                raise ValueError(
                    "a ViT wrapped by vlm_prune takes no attn_mask / is_causal: pruning changes the "
                    "token count inside the model; unwrap it to run with a mask"
                )
            if ops.index == 0 or self.run is None:
                self.run = ViTRun(n_prefix=self.n_prefix, n_tokens=x.shape[1])
            out = method.block_forward(ops, x, self.run)
            if ops.index == self.depth - 1:
                stats: dict[str, Any] = {"vit": self.run.summary(out.shape[1])}
                if self.state.budget_notes:  # a target this model cannot reach (wrap() warned)
                    stats["budget_notes"] = list(self.state.budget_notes)
                self.state.last_stats = stats
            return out

        return forward
