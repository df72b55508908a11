"""Attention rows computed on the side (reference implementation)."""
from __future__ import annotations

import torch


def attention_to_keys(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Head-averaged softmax probabilities of selected query rows over all keys.

    q: [B, H, Q, d]; k: [B, H, S, d] (GQA keys already repeated); key_mask: [B, Q, S] or
    [B, 1, S] bool, True where the row may attend to the key. Returns [B, Q, S] float32.
    Memory O(B H Q S): the S x S matrix is never formed.
    """
    logits = torch.einsum("bhqd,bhsd->bhqs", q.float(), k.float()) * scale
    logits = logits.masked_fill(~key_mask[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.mean(1)
