"""FastV: drop visual tokens inside the LLM by the attention they receive."""
from __future__ import annotations

from dataclasses import replace

import torch

from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction
from vlm_prune.registry import register


def last_valid_index(valid: torch.Tensor) -> torch.Tensor:
    """[B] index of the last True of each row of a [B, S] mask."""
    s = valid.shape[1]
    ar = torch.arange(s, device=valid.device).expand_as(valid)
    return torch.where(valid, ar, -1).max(dim=1).values


def attention_received(
    q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Head-averaged softmax probabilities of query rows over keys, computed on the side.

    q: [B, H, Q, d] the query rows; k: [B, H, S, d]; key_mask: [B, Q, S] bool (keys each row
    may attend to). Returns [B, Q, S] float32; memory O(B H Q S), never S x S.
    """
    from vlm_prune.kernels import attention_to_keys

    return attention_to_keys(q, k, key_mask, scale)


@register
class FastV(LLMMethod):
    """FastV (Chen et al., ECCV 2024, "An Image is Worth 1/2 Tokens After Layer 2";
    pkunlp-icler/FastV).

    Before decoder layer ``layer`` (K, default 2) drop visual tokens, ranked by the attention
    they receive in layer K-1, averaged over heads. ``query="last"`` uses the last query token
    (as the official KV-cache implementation does: pkunlp-icler/FastV,
    src/FastV/lmms-eval-with-kvcache/fastv_kvcache.py at commit 49dfad77, which keeps
    floor(ratio * tokens) and the kept tokens' original position ids; that file hard-codes K=3,
    the paper's default is K=2); ``query="text"`` averages over all text queries.
    Budget: FastV prunes once, so the tokens it keeps are the ones that reach the last layer:
    ``keep`` / ``budget`` is exactly that count (floor(keep * n)); without either, the paper's
    R=50% (keep=0.5). In a pipeline it ends at the pipeline's target.
    The needed attention rows are computed on the side from layer K-1's own q/k projections, so
    the model keeps SDPA / FlashAttention. Kept tokens keep their original position ids.
    """

    name = "fastv"
    paper = "FastV, Chen et al., ECCV 2024 (arXiv 2403.06764)"
    own_schedule = True
    scores_from_previous_layer = True

    def __init__(self, layer: int = 2, query: str = "last", keep: float | None = None, budget: int | None = None):
        super().__init__(keep=keep, budget=budget)
        if not isinstance(layer, int) or layer < 1:
            raise ValueError(f"FastV layer K must be an integer >= 1 (scores come from layer K-1), got {layer!r}")
        if query not in ("last", "text"):
            raise ValueError(f"FastV query must be 'last' or 'text', got {query!r}")
        self.layer = layer
        self.query = query

    def configure_budget(self, keep: float | None, budget: int | None) -> None:
        super().configure_budget(keep, budget)
        if self.keep is None and self.budget is None:
            self.keep = 0.5

    def prune_layers(self, num_layers: int) -> list[int]:
        if self.layer >= num_layers:
            raise ValueError(f"FastV layer K={self.layer} but the model has only {num_layers} decoder layers; "
                             f"pass layer= below {num_layers}")
        return [self.layer]

    def scores(self, ctx: LayerContext) -> torch.Tensor:
        """[B, S] attention received by every row (only visual rows are used); only the query
        rows used are projected."""
        b, s = ctx.valid.shape
        scale = getattr(ctx.layer_module.self_attn, "scaling", None)
        if self.query == "last":
            return last_query_attention(ctx)
        text_mask = ctx.text
        n_text = int(text_mask.sum(1).max())
        order = torch.argsort(text_mask.int(), dim=1, descending=True, stable=True)[:, :n_text]
        q, k = ctx.project_qk(ctx.hidden, ctx.positions, rope=True, q_rows=order)  # q [B, H, T, d]
        ar = torch.arange(s, device=q.device)
        key_mask = ctx.valid[:, None, :] & (ar[None, None, :] <= order[:, :, None])
        probs = attention_received(q, k, key_mask, scale or q.shape[-1] ** -0.5)  # [B, T, S]
        row_ok = torch.gather(text_mask, 1, order).float()
        return (probs * row_ok[:, :, None]).sum(1) / row_ok.sum(1).clamp(min=1)[:, None]

    def select(self, ctx: LayerContext) -> list[Reduction]:
        if keeps_every_visual(ctx):
            return keep_all_rows(ctx)
        scores = self.scores(ctx)
        out = []
        for b in range(scores.shape[0]):
            out.append(keep_top_visual(scores[b], ctx.visual[b], ctx.valid[b], int(ctx.n_keep[b])))
        return out


def last_query_attention(ctx: LayerContext) -> torch.Tensor:
    """[B, S] head-averaged attention the last valid row pays every row in ``ctx.layer_module``
    (FastV's and PyramidDrop's score); only that query row is projected."""
    rows = last_valid_index(ctx.valid)[:, None]
    q, k = ctx.project_qk(ctx.hidden, ctx.positions, rope=True, q_rows=rows)  # q [B, H, 1, d]
    scale = getattr(ctx.layer_module.self_attn, "scaling", None) or q.shape[-1] ** -0.5
    return attention_received(q, k, ctx.valid.unsqueeze(1), scale)[:, 0]  # the last row sees every valid key


def previous_layer_attention(ctx: LayerContext) -> torch.Tensor:
    """[B, S] :func:`last_query_attention` in the layer before ``ctx.layer``, on the rows that entered
    it (``extras["previous_hidden"]`` of a method with ``needs_previous_hidden``: the same rows as
    now, when nothing was removed in between) - the attention a layer-K method reads from layer K-1
    while it changes the hidden states entering layer K (FrameFusion's pruning, HoliTom's merge)."""
    prev = replace(ctx, layer=ctx.layer - 1, hidden=ctx.extras["previous_hidden"],
                   project_qk=ctx.extras["previous_project_qk"])
    return last_query_attention(prev)


def keeps_every_visual(ctx: LayerContext) -> bool:
    """True when every sample's budget covers all its visual rows: a pure drop has nothing to
    score then (FastV and AdaptInfer at keep=1.0 skip their attention rows)."""
    return bool((ctx.n_keep >= (ctx.visual & ctx.valid).sum(1)).all())


def keep_all_rows(ctx: LayerContext) -> list[Reduction]:
    """Every valid row of every sample, unchanged."""
    return [Reduction(torch.nonzero(v).squeeze(1)) for v in ctx.valid]


def keep_top_visual(scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, n_keep: int) -> Reduction:
    """Keep every valid non-visual row plus the ``n_keep`` best-scoring visual rows."""
    vis_idx = torch.nonzero(visual & valid).squeeze(1)
    other = torch.nonzero(valid & ~visual).squeeze(1)
    n_keep = max(0, min(n_keep, vis_idx.numel()))
    top = vis_idx[torch.topk(scores[vis_idx].float(), n_keep, sorted=False).indices]
    return Reduction(torch.sort(torch.cat([other, top])).values)
