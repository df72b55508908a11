"""Side computations on the HF vision towers (CLIP, SigLIP) that methods ask for."""
from __future__ import annotations

from typing import Any, Callable

import torch


def tower_feature_attention(
    tower: torch.nn.Module, out: Any, feature_layer: Any, strategy: str | None
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None:
    """A callable image_index -> (attention [N], keys [N, d]) for the tower's feature layer.

    The feature layer is the encoder layer whose output the projector reads
    (``vision_feature_layer``, -2 for LLaVA). Its self-attention is recomputed on the side from
    its input hidden state for the rows that matter: the CLS query row when the tower has a CLS
    token (CLIP; 'default' strategy drops it from the features) - else the attention each token
    receives averaged over all queries (SigLIP). Keys are averaged over heads. Costs one
    [N, N] attention per image for towers without CLS, one row otherwise.
    """
    hidden = getattr(out, "hidden_states", None)
    if hidden is None or not isinstance(feature_layer, int):
        return None
    encoder = getattr(getattr(tower, "vision_model", tower), "encoder", None)
    if encoder is None:
        return None
    n_layers = len(encoder.layers)
    layer_idx = feature_layer % (n_layers + 1) - 1  # hidden_states[i] is the output of layer i-1
    if layer_idx < 0:
        return None
    layer = encoder.layers[layer_idx]
    x_all = hidden[layer_idx]
    has_cls = strategy == "default"

    def attention(image_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            x = layer.layer_norm1(x_all[image_index : image_index + 1])
            attn = layer.self_attn
            h = attn.num_heads
            d = attn.head_dim
            q = attn.q_proj(x).view(1, -1, h, d).transpose(1, 2)
            k = attn.k_proj(x).view(1, -1, h, d).transpose(1, 2)
            scale = getattr(attn, "scale", d**-0.5)
            if has_cls:
                probs = torch.softmax((q[:, :, :1] @ k.transpose(-1, -2)).float() * scale, dim=-1)
                received = probs[0, :, 0, 1:].mean(0)
                keys = k[0, :, 1:].mean(0)
            else:
                probs = torch.softmax((q @ k.transpose(-1, -2)).float() * scale, dim=-1)
                received = probs[0].mean(0).mean(0)
                keys = k[0].mean(0)
        return received, keys

    return attention
