"""Side computations on the HF vision towers (CLIP, SigLIP) that methods ask for."""
from __future__ import annotations

import torch

from vlm_prune.adapters.base import PerThread


class FeatureLayerTap:
    """Keeps the input of the tower's feature layer and recomputes its attention on the side.

    Feature encoders snapshot :attr:`input` onto their output (generate() encodes images and videos
    before the forward), and :meth:`attention_of` works on one row of it.

    The feature layer is the encoder layer whose output the projector reads
    (``vision_feature_layer``: -2 for LLaVA-1.5, i.e. the second-to-last layer). A forward
    pre-hook stores that layer's latest input; :meth:`attention` then recomputes, for one image,
    the rows that matter: the CLS query row when the tower has a CLS token (CLIP with the
    'default' strategy, which drops CLS from the features) - else the attention each token
    receives averaged over all queries (SigLIP). Keys are averaged over heads. Cost: one [1, N]
    attention row per image with CLS, one [N, N] attention without.
    """

    #: the calling thread's latest input of the feature layer
    input: torch.Tensor | None = PerThread()

    def __init__(self, tower: torch.nn.Module, feature_layer: int, has_cls: bool) -> None:
        if not isinstance(feature_layer, int):
            raise ValueError("a list of vision_feature_layer values has no single feature layer to tap")
        encoder = getattr(tower, "vision_model", tower).encoder
        n_layers = len(encoder.layers)
        idx = feature_layer % (n_layers + 1) - 1  # hidden_states[i] is the output of layer i - 1
        if idx < 0:
            raise ValueError(f"vision_feature_layer {feature_layer} reads the embeddings; no attention to tap")
        self.layer = encoder.layers[idx]
        #: the encoder layer after the tapped one (its input is :meth:`output_of`), None after the last
        self.next_layer = encoder.layers[idx + 1] if idx + 1 < n_layers else None
        self.has_cls = has_cls
        self.handle = self.layer.register_forward_pre_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: tuple) -> None:
        self.input = args[0].detach()

    def remove(self) -> None:
        self.handle.remove()
        self.input = None

    def attention_of(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention [N], keys [N, d]) of one tower row [T, D] of the feature layer's input."""
        with torch.no_grad():
            if self.has_cls:
                probs, k = cls_row_attention(self.layer, row[None])
                return probs[0, :, 1:].mean(0), k[0, :, 1:].mean(0)
            q, k, scale = _query_keys(self.layer, row[None])
            probs = torch.softmax((q @ k.transpose(-1, -2)).float() * scale, dim=-1)
            return probs[0].mean(0).mean(0), k[0].mean(0)


    def output_of(self, row: torch.Tensor) -> torch.Tensor:
        """The feature layer's output [T, D] for one tower row [T, D] of its input (the tower's
        ``hidden_states`` at the feature layer, recomputed on the side: one layer per image)."""
        with torch.no_grad():
            out = self.layer(row[None], None)
        return (out[0] if isinstance(out, tuple) else out)[0]


def _query_keys(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(q [B, H, N, d], k [B, H, N, d], scale) of a CLIP / SigLIP encoder layer on its input x [B, N, D]."""
    h = layer.layer_norm1(x)
    attn = layer.self_attn
    heads, d = attn.num_heads, attn.head_dim
    q = attn.q_proj(h).view(x.shape[0], -1, heads, d).transpose(1, 2)
    k = attn.k_proj(h).view(x.shape[0], -1, heads, d).transpose(1, 2)
    return q, k, getattr(attn, "scale", d**-0.5)


def cls_row_attention(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [B, H, N], keys [B, H, N, d]): the float32 softmax attention row of the [CLS] query
    (token 0) over all N tokens of x [B, N, D] in encoder ``layer``, per head; ``bias`` [B, N] is
    added to the logits (-inf masks padded keys)."""
    q, k, scale = _query_keys(layer, x)
    logits = (q[:, :, :1] @ k.transpose(-1, -2)).float() * scale
    if bias is not None:
        logits = logits + bias[:, None, None, :].float()
    return torch.softmax(logits, dim=-1)[:, :, 0], k


def pool_grid(values: torch.Tensor, grid: tuple[int, int], out: tuple[int, int]) -> torch.Tensor:
    """Bilinearly resize per-token values [N, C] (or [N]) on a grid to ``out``, as LLaVA-OneVision
    pools its video frames; returns [out_rows * out_cols, C] (or [...])."""
    flat = values.dim() == 1
    v = values[:, None] if flat else values
    img = v.t().reshape(1, v.shape[1], *grid).float()
    res = torch.nn.functional.interpolate(img, size=out, mode="bilinear")[0].reshape(v.shape[1], -1).t()
    return res[:, 0] if flat else res


def window_order(rows: int, cols: int, side: int | None) -> torch.Tensor:
    """Raster index of each merged token of a rows x cols slice in the order Qwen2.5-VL's tower
    holds them: windows of ``side`` x ``side`` merged tokens, row-major over the windows and within
    each (the edge windows cut short; ``get_window_index``). ``side`` None (Qwen2-VL): raster order."""
    index = torch.arange(rows * cols).reshape(rows, cols)
    if side is None:
        return index.flatten()
    return torch.cat([index[r : r + side, c : c + side].flatten()
                      for r in range(0, rows, side) for c in range(0, cols, side)])


class QwenTowerTap:
    """Keeps the input of the Qwen2-VL / Qwen2.5-VL vision tower's last block and recomputes, on
    the side, the salience FastVID's official Qwen2.5-VL version reads from it
    (LunarShen/FastVID@a40a109, ``fastvid_qwen25vl/.../qwenvlutils/modeling_qwen2_5_vl.py``,
    ``Qwen2_5_VLVisionFlashAttention2`` of the last block): per temporal slice and head, the slice's
    mean query (after the tower's 2-D RoPE) attends to the mean key of each merged (2 x 2) token,
    softmax over the slice's merged tokens, averaged over heads (in float32; the official averages
    in the model's dtype under FlashAttention-2, its only path). Cost: the last block's qkv
    projection again and one [heads, tokens] row per slice (0.77 s against 20.6 s for 4 of the 32
    blocks of a Qwen2.5-VL-7B-sized random tower on 8 frames at 448 px, one CPU thread: about 0.5% of
    the whole tower; 2026-12-04). The last block is a full-attention one in the released Qwen2.5-VL configs; the signal
    spans the whole slice either way, as the official computes it.

    A forward pre-hook stores the block's input (hidden states in the tower's order: Qwen2.5-VL
    permutes the merged tokens into attention windows) and its rotary (cos, sin); feature encoders
    snapshot :attr:`input` onto their output, and :meth:`slice_attention` maps the result back to the
    slice's raster order of merged tokens, the order of the features the LLM gets.
    """

    #: the calling thread's latest (hidden states [S, D], cos [S, d], sin [S, d]) of the last block
    input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = PerThread()

    def __init__(self, visual: torch.nn.Module) -> None:
        import sys

        self.block = visual.blocks[-1]
        self.merge = int(visual.spatial_merge_size)
        window = getattr(visual, "window_size", None)  # Qwen2.5-VL only
        self.window = None if window is None else window // self.merge // visual.patch_size
        self.rope = sys.modules[type(self.block.attn).__module__].apply_rotary_pos_emb_vision
        self.handle = self.block.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[2]
        self.input = (hidden.detach(), cos.detach(), sin.detach())

    def remove(self) -> None:
        self.handle.remove()
        self.input = None

    def slice_attention(self, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], start: int,
                        grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`qwen_slice_salience` of one temporal slice, whose h x w patches are rows ``start``
        .. ``start + h w`` of ``saved`` (a :attr:`input`)."""
        hidden, cos, sin = saved
        n = grid[0] * grid[1]
        with torch.no_grad():
            attn = self.block.attn
            x = self.block.norm1(hidden[start : start + n])
            q, k, _ = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            q, k = self.rope(q, k, cos[start : start + n], sin[start : start + n])
        return qwen_slice_salience(q, k, grid, self.merge, self.window)


def qwen_slice_salience(q: torch.Tensor, k: torch.Tensor, grid: tuple[int, int], merge: int,
                        window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FastVID's official Qwen2.5-VL salience of one temporal slice from its queries and keys
    [n, heads, d] (after the tower's RoPE, in the tower's order; n = h w patches of ``grid``):
    (salience [U], mean keys [U, d]) of its U = n / merge^2 merged tokens in raster order - the
    softmax over the merged tokens of the slice's mean query against each merged token's mean key,
    averaged over heads; keys averaged over heads. ``window``: the tower's attention-window side in
    merged tokens (Qwen2.5-VL; None: the tower keeps raster order)."""
    n, heads, _ = q.shape
    unit = merge**2
    with torch.no_grad():
        query = q.float().mean(0)  # [heads, d]: the slice's mean query
        keys = k.float().reshape(n // unit, unit, heads, -1).mean(1)  # [U, heads, d]
        probs = torch.softmax(torch.einsum("hd,uhd->hu", query, keys) * q.shape[-1] ** -0.5, dim=-1)
        order = window_order(grid[0] // merge, grid[1] // merge, window).to(q.device)
        salience = torch.empty(n // unit, device=q.device)
        salience[order] = probs.mean(0)
        mean_keys = torch.empty(n // unit, keys.shape[-1], device=q.device)
        mean_keys[order] = keys.mean(1)
    return salience, mean_keys
