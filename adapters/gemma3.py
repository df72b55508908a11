"""Gemma 3 (``Gemma3ForConditionalGeneration``: SigLIP tower + Gemma 3 text model).

Quirks (transformers 5.25 ``models/gemma3``):

- An image is 256 tokens (``mm_tokens_per_image``: the tower's patch grid average-pooled to
  16 x 16) between ``<start_of_image>`` and ``<end_of_image>``.
- Inside the language model an image's tokens attend to each other both ways: the model turns
  ``token_type_ids`` (1 at image tokens) into one block id per image
  (``get_block_sequence_ids_for_mask``) and every layer's mask lets a row see its block's later
  rows. vlm_prune computes the same block ids from the call's ``token_type_ids`` and the engine
  follows them to the kept rows (``Pending.blocks``), so after a vision-stage or in-LLM removal
  the kept tokens of an image still see each other both ways, exactly as the unwrapped model fed
  the kept rows and their ``token_type_ids``. Without ``token_type_ids`` the model attends
  causally, and so does the engine.
- ``Gemma3Model.forward`` builds per-layer-type masks (a dict) for its text model; the wrapped
  text model is the pruned decoder, which takes the call's 2-D padding mask instead (handed
  through unbuilt).
- Two rotary tables (``sliding_attention``: local base, ``full_attention``: global base):
  each decoder layer gets its type's (``LMSpec.rotary`` / ``rotary_key``).
- Sliding-window layers (5 of every 6, window 1024 on released checkpoints): a row sees the keys
  less than ``sliding_window`` columns before it (block mates included), and their cache keeps the
  last window - 1 (``LMSpec.window``). The pruned decoder masks them so; after a removal the window
  counts the rows such a layer holds, as the unwrapped model fed only the kept rows would.

The SigLIP tower has no CLS token and VisionZip taps CLIP / OneVision towers only, so ViT-stage
methods and VisionZip are refused at wrap time; FlashAttention is refused by transformers itself
for Gemma 3 (it drops the bidirectional mask).
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from vlm_prune.adapters.generic import FamilyTable, TableAdapter
from vlm_prune.adapters.hf_vlm import Request
from vlm_prune.engine import LMSpec


_PREPARED = ("vlm_prune builds Gemma 3's attention masks itself from the 2-D padding mask; pass attention_mask as "
             "[batch, columns] (or unwrap the model to pass prepared masks)")


class _Unbuilt(dict):
    """The call's 2-D padding mask, passed through ``Gemma3Model.forward`` (which leaves a dict
    alone) to the pruned decoder, which builds its own masks."""

    def __init__(self, mask: torch.Tensor | None) -> None:
        super().__init__()
        self.mask = mask


class Gemma3Adapter(TableAdapter):
    table = FamilyTable(family="gemma3", model_classes=("Gemma3ForConditionalGeneration",))

    def check_language_model(self) -> None:
        cfg = self.language_model.config
        kinds = set(getattr(cfg, "layer_types", None) or [])
        if not kinds <= {"full_attention", "sliding_attention"}:
            super().check_language_model()
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("vlm_prune runs Gemma 3 with causal text attention; this text model attends "
                             "bidirectionally everywhere (use_bidirectional_attention): use it unwrapped")

    def lm_spec(self) -> LMSpec:
        spec = super().lm_spec()
        lm = self.language_model
        types = list(lm.config.layer_types)
        spec.rotary = lambda x, pos, key: lm.rotary_emb(x, pos, key)
        spec.rotary_key = lambda i: types[i]
        window = lm.config.sliding_window
        spec.window = lambda i: window if types[i] == "sliding_attention" else None
        return spec

    def attach(self) -> None:
        super().attach()
        lm = self.language_model
        decoder = self.decoder.forward
        unwrapped = self.patches.original(lm, "forward")

        @functools.wraps(decoder)
        def forward(*args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
            if isinstance(attention_mask, _Unbuilt):
                return decoder(*args, attention_mask=attention_mask.mask, **kwargs)
            if self.bypassed:  # an unpruned run with the model's own masks
                return unwrapped(*args, attention_mask=attention_mask, **kwargs)
            if isinstance(attention_mask, dict):
                raise ValueError(_PREPARED)
            return decoder(*args, attention_mask=attention_mask, **kwargs)

        self.patches.set(lm, "forward", forward)

    def new_request(self, args: tuple, kwargs: dict[str, Any]) -> Request | None:
        """Hand the 2-D mask through unbuilt, and the image blocks of ``token_type_ids`` to the engine."""
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            raise ValueError(_PREPARED)
        kwargs["attention_mask"] = _Unbuilt(mask)
        request = super().new_request(args, {**kwargs, "attention_mask": mask})
        types = kwargs.get("token_type_ids")
        if request is not None and types is not None:
            module = importlib.import_module(type(self.inner).__module__)
            s = request.input_ids.shape[1]
            request.pending.blocks = module.get_block_sequence_ids_for_mask(types[:, -s:], device=types.device)
        return request
