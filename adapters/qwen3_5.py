"""Qwen3.5 (and Qwen3.5-MoE): Qwen3-VL's tower and per-slice timestamp video, without DeepStack, on a
language model that alternates Gated DeltaNet (linear attention) and full-attention layers.

A linear-attention layer keeps no keys: it folds every earlier row into a recurrent state, through
a short causal convolution over the rows before it. So a removal cannot be a key mask here; the
engine removes rows physically on every family, and on this one that is the whole story:

- vision and frames stages: the rows they drop never reach layer 0, and the pruned model equals the
  unwrapped model fed the kept rows;
- in-LLM methods (FastV, PACT, PDrop, SparseVLM, AdaptInfer, DART, MustDrop, FrameFusion, PruneVid's
  selection): rows removed or merged before layer L leave every later layer's input. Each later
  Gated DeltaNet layer builds its recurrent state and convolution window from the kept rows only, and
  its decode-time conv / recurrent caches continue from those; each later full-attention layer sees
  the kept rows at their original M-RoPE positions, with the log-size bias of merged rows as on every
  other family. In a linear layer a merged row is one row (no bias: it has no attention logits).
  The exact reference (``tests/test_hybrid.py``): the pruned model equals the unwrapped
  model's layers 0..L-1 on the full sequence followed by layers L..end on the kept rows with fresh
  caches, in prefill and through ``generate()``.
- ragged batches: the engine left-pads each sample's kept rows; the linear layers get the 2-D padding
  mask of the rows they see (transformers' ``create_recurrent_attention_mask``), which zeroes the
  padding rows' inputs, so they add nothing to the states (they start at zero and only decay).
- methods read attention at a layer: where that layer is a linear-attention layer they read the
  nearest full-attention layer before it (the first when none precedes) on the same rows
  (``PrunedDecoder.attention_layer``), reported as ``attention_layers`` in the stage record and in
  ``last_stats["notes"]``.
- decode-time KV pruning (MustDrop's decoding stage, DyCoke's) restricts the keys of full-attention
  layers only: a recurrent state cannot drop a past row, so the linear layers keep every prompt row
  they folded in.

Read side by side with transformers 5.25 ``models/qwen3_5/modeling_qwen3_5.py``
(``Qwen3_5TextModel.forward``, ``Qwen3_5GatedDeltaNet.forward``) and ``masking_utils.py``.
"""
from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch

from vlm_prune.adapters import FAMILY_STAGES
from vlm_prune.adapters.qwen3_vl import Qwen3VLAdapter
from vlm_prune.engine import LMSpec


class Qwen3_5Adapter(Qwen3VLAdapter):
    family = "qwen3_5"
    model_classes = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]

    def check_language_model(self) -> None:
        types = set(getattr(self.language_model.config, "layer_types", None) or [])
        if not types <= {"full_attention", "linear_attention"}:
            raise ValueError(f"vlm_prune runs Qwen3.5's full- and linear-attention layers; this language model also "
                             f"has {', '.join(sorted(types - {'full_attention', 'linear_attention'}))} layers")

    def apply_rope(self) -> Any:
        """The rotary function of the language model's own module (its first layers have no self_attn)."""
        return importlib.import_module(type(self.language_model).__module__).apply_rotary_pos_emb

    def lm_spec(self) -> LMSpec:
        spec = super().lm_spec()
        types = self.language_model.config.layer_types

        def layer_mask(idx: int, mask: Any, q_valid: torch.Tensor | None) -> Any:
            if types[idx] != "linear_attention":
                return mask
            # transformers' create_recurrent_attention_mask: None for one row or no padding, else the 2-D mask
            if q_valid is None or q_valid.shape[1] == 1 or bool(q_valid.all()):
                return None
            return q_valid.long()

        spec.layer_mask = layer_mask
        return spec
