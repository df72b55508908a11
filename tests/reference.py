"""Slow references for the invariants of DESIGN.md, built only from the model's own modules."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def capture_lm_inputs(model):
    """Record the kwargs the language model receives (inputs_embeds, position_ids, ...)."""
    seen: list[dict] = []
    lm = model.model.language_model
    handle = lm.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def positions_of(captured: dict, b: int, s: int) -> torch.Tensor:
    """[P, B, S] positions as the language model would use them for a prefill."""
    pos = captured.get("position_ids")
    if pos is None:
        return torch.arange(s).view(1, 1, s).expand(1, b, s)
    return pos[None] if pos.dim() == 2 else pos


def split_positions(model, pos: torch.Tensor):
    """(rotary positions, decoder-layer position_ids) for the model family."""
    if "Qwen2" in type(model).__name__:
        return (pos[1:] if pos.shape[0] == 4 else pos), (pos[0] if pos.shape[0] == 4 else None)
    return pos[0], pos[0]


def run_layers(model, embeds, pos, masks_for_layer, replace_at=None):
    """Run the decoder layers with an explicit 4-D float mask per layer; returns logits."""
    lm = model.model.language_model
    rope_pos, layer_pos = split_positions(model, pos)
    pe = lm.rotary_emb(embeds, rope_pos)
    h = embeds
    for idx, layer in enumerate(lm.layers):
        if replace_at is not None and idx == replace_at[0]:
            h = replace_at[1](h)
        out = layer(h, attention_mask=masks_for_layer(idx), position_embeddings=pe, position_ids=layer_pos)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(lm.norm(h))


def float_mask(allowed: torch.Tensor, dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, S, S] additive mask from a [B, S, S] boolean; bias [B, S] added to allowed keys."""
    m = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    if bias is not None:
        m = m + bias[:, None, :].to(dtype).masked_fill(~allowed, 0.0)
    return m[:, None]


def masked_llm_reference(model, inputs, layer: int, kept: torch.Tensor, merged=None, grad: bool = False):
    """Invariant 3: the full sequence with removed tokens masked as keys from ``layer`` on.

    kept: [B, S] bool rows that survive at ``layer``. merged: optional (centre [B, S] bool,
    features [B, S, D] merged hidden states at those centres, sizes [B, S]) - the centres'
    hidden states are replaced at ``layer`` and log(size) is added to their key logits.
    grad: keep the autograd graph of the decoder layers (the input embeddings are detached).
    """
    with torch.no_grad(), capture_lm_inputs(model) as seen:
        model(**inputs)
    cap = seen[0]
    embeds = cap["inputs_embeds"]
    b, s, _ = embeds.shape
    pos = positions_of(cap, b, s)
    valid = inputs["attention_mask"].bool()
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    before = causal & valid[:, None, :]
    after = before & kept[:, None, :]
    bias = None
    replace = None
    if merged is not None:
        centre, feats, sizes = merged
        bias = torch.log(sizes.float()).masked_fill(~kept, 0.0)
        replace = (layer, lambda h: torch.where(centre[..., None], feats.to(h.dtype), h))
    dtype = embeds.dtype
    m_before = float_mask(before, dtype)
    m_after = float_mask(after, dtype, bias)
    with torch.set_grad_enabled(grad):
        return run_layers(model, embeds.detach(), pos, lambda i: m_before if i < layer else m_after, replace)
