"""Qwen3.5 (and Qwen3.5-MoE): Qwen3-VL's tower and per-slice timestamp video, without DeepStack, on a
language model that alternates Gated DeltaNet (linear attention) and full-attention layers.

A linear-attention layer keeps no keys: it folds every earlier row into a recurrent state, through
a short causal convolution over the rows before it. So:

- vision and frames stages work exactly: the rows they drop never reach layer 0, and the pruned
  model equals the unwrapped model fed the kept rows (the linear layers get the 2-D padding mask
  of the rows they see, as transformers' ``create_recurrent_attention_mask`` gives them, so the
  left padding of a ragged batch stays out of their states);
- in-LLM methods (FastV, PACT, AdaptInfer) are refused at wrap time: a row dropped before layer L
  would have to leave the recurrent state and the convolution window of every later linear layer,
  which no key mask expresses, so the removal has no exact counterpart in the unwrapped model (the
  DESIGN invariant 3 cannot hold), and merged rows have no log-size bias to carry there.

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

IN_LLM_REFUSAL = (
    "method {name!r} works in the 'llm' stage, which the qwen3_5 adapter does not offer: it removes rows inside "
    "the language model, but {model}'s Gated DeltaNet (linear-attention) layers "
    "keep no keys to mask: every earlier row is folded into a recurrent state through a causal convolution, so "
    "a row removed before layer L cannot leave the later linear layers' states the way it leaves the attention "
    "layers' keys, and the removal has no exact counterpart in the unwrapped model. Use a vision-stage method "
    "(random, pool, divprune, cdpruner) or a frames method (uniform, keyscore) at the same budget"
)


class Qwen3_5Adapter(Qwen3VLAdapter):
    family = "qwen3_5"
    model_classes = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
    stages: ClassVar[tuple[str, ...]] = FAMILY_STAGES[family]

    def check_methods(self) -> None:
        llm = self.state.methods.get("llm")
        if llm is not None:
            raise ValueError(IN_LLM_REFUSAL.format(name=llm.name, model=type(self.model).__name__))
        super().check_methods()

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
