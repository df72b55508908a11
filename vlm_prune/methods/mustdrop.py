"""MustDrop: multi-stage vision token dropping, its prefill and decoding stages."""
from __future__ import annotations

import math
from typing import Any

import torch

from vlm_prune.methods.adaptinfer import final_counts, staged_positions
from vlm_prune.methods.base import DecodeKV, LayerContext, LLMMethod, Reduction, check_positions
from vlm_prune.methods.fastv import attention_received, keep_all_rows, keeps_every_visual
from vlm_prune.registry import register

#: the official scoring layers of LLaVA-1.5-7B's 32 (``pruning_layers``): rows drop after each
OFFICIAL_LAYERS = (2, 6, 10, 14)
OFFICIAL_DEPTH = 32


def text_to_visual_attention(ctx: LayerContext) -> torch.Tensor:
    """[B, T, S] head-averaged causal softmax attention of each sample's text rows after its last
    visual row (``ctx.text``, left-aligned, zero rows past a sample's count) over all rows, in the
    layer of ``ctx`` on the rows entering it; only those query rows are projected."""
    s = ctx.valid.shape[1]
    n_text = int(ctx.text.sum(1).max())
    order = torch.argsort(ctx.text.int(), dim=1, descending=True, stable=True)[:, :n_text]
    q, k = ctx.project_qk(ctx.hidden, ctx.positions, rope=True, q_rows=order)
    ar = torch.arange(s, device=q.device)
    key_mask = ctx.valid[:, None, :] & (ar[None, None, :] <= order[:, :, None])
    scale = getattr(ctx.layer_module.self_attn, "scaling", None) or q.shape[-1] ** -0.5
    probs = attention_received(q, k, key_mask, scale)
    return probs * torch.gather(ctx.text, 1, order).float()[:, :, None]


def dual_attention_keep(attn: torch.Tensor, global_thr: float, individual_thr: float) -> torch.Tensor:
    """[V] bool: the visual tokens MustDrop's dual-attention filter keeps, from ``attn`` [T, V] (text
    rows x visual columns): dropped when the global attention (summed over the text rows) is below
    ``global_thr`` times the total AND the largest single attention is below ``individual_thr``."""
    total = attn.sum(0)
    peak = attn.max(0).values if attn.shape[0] else torch.zeros_like(total)
    return ~((total < total.sum() * global_thr) & (peak < individual_thr))


def dual_attention_scores(attn: torch.Tensor, global_thr: float, individual_thr: float) -> torch.Tensor:
    """[V] :func:`dual_attention_keep` as a score over one sample's visual tokens: the larger of the
    two ratios (global attention / its threshold, peak / its threshold), so the rule keeps exactly
    the tokens scoring >= 1 (up to rounding), and top-k by score generalises it to a count."""
    total = attn.sum(0)
    peak = attn.max(0).values if attn.shape[0] else torch.zeros_like(total)
    inf = torch.full_like(total, math.inf)
    g = total / (total.sum() * global_thr) if global_thr > 0 else inf
    i = peak / individual_thr if individual_thr > 0 else inf
    return torch.maximum(torch.nan_to_num(g, nan=0.0), torch.nan_to_num(i, nan=0.0))


@register
class MustDrop(DecodeKV, LLMMethod):
    """MustDrop (Liu et al., "Multi-Stage Vision Token Dropping: Towards Efficient Multimodal Large
    Language Model", arXiv 2411.10803; official code liuting20/MustDrop at 909afa53,
    llava/model/language_model/modelling_sparse_llama.py ``LlamaDynamicvitModel.forward`` /
    ``dual_attention_filter``, llava/model/multimodal_encoder/clip_encoder.py and local_merge.py).

    Prefill stage: after each scoring layer l of ``layers`` (official 2, 6, 10, 14 of LLaVA-1.5's 32;
    ``None`` scales them with depth, round(l * depth / 32)), the head-averaged attention A that the
    text rows after the image pay the visual rows in layer l (full causal softmax rows, computed on the
    side for those queries only) decides: a visual token is dropped when sum_t A[t, v] < global_thr *
    sum_v sum_t A[t, v] and max_t A[t, v] < individual_thr (the dual-attention filter); the rest go on
    to layer l + 1. Defaults: global_thr = individual_thr = 0.001, the README's first (192-token)
    setting; the evaluation script's argparse defaults (1.0, 0.0) drop nothing.
    With keep / budget (visual tokens per image reaching the last layer) each stage keeps the same
    fraction (:func:`vlm_prune.methods.adaptinfer.final_counts`) by top-k of the filter's score
    (:func:`dual_attention_scores`: the rule keeps exactly the tokens scoring >= 1).
    Decoding stage (``decode=True``, the official output-aware cache): from the first scoring layer on,
    decode steps attend only to the prompt rows that reached the last layer (the official trims those
    layers' KV caches to the final rows; here their keys are masked, docs/decode-kv.md).
    ``positions``: "renumber" (the official LLaVA code numbers the kept rows 0..n-1 after each stage,
    and each layer's decode positions continue from its own cache length) or "keep"; default
    "renumber" on LLaVA-1.5 / LLaVA-NeXT, "keep" elsewhere.

    Differences from the official code: its vision-encoding stage (3x3 windows of the CLIP tower
    whose mean pairwise cosine is >= 0.8 merged after the tower's first layer, and a key set of the
    top 8% patches by the last layer's [CLS] attention that the prefill stage never drops) is not
    implemented (it needs a method spanning the ViT and LLM stages); so no token is protected. The
    official code scores batch row 0 only; here every sample scores its own rows. Text rows are those
    after a sample's last visual row (one image block in the official code).
    """

    name = "mustdrop"
    paper = "MustDrop, Liu et al., arXiv 2411.10803 (liuting20/MustDrop)"
    summary = "drops visual tokens by a dual text-attention filter at four LLM layers; decoding attends to the final set"
    budget_note = ("keep / budget = visual tokens reaching the last layer, an even share per stage; without them "
                   "the README's dual-attention thresholds (0.001, 0.001) decide the counts")
    own_schedule = True
    scores_from_previous_layer = True

    def __init__(self, layers: tuple[int, ...] | list[int] | None = None, global_thr: float = 0.001,
                 individual_thr: float = 0.001, decode: bool = True, positions: str | None = None,
                 keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        if layers is not None and (not layers or list(layers) != sorted(set(layers)) or min(layers) < 0):
            raise ValueError(f"MustDrop layers must be distinct increasing layer indices >= 0, got {layers!r}")
        for knob, value in (("global_thr", global_thr), ("individual_thr", individual_thr)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"MustDrop {knob} must be a number >= 0, got {value!r}")
        if not isinstance(decode, bool):
            raise ValueError(f"MustDrop decode must be True or False, got {decode!r}")
        check_positions("MustDrop", positions)
        self.layers = list(layers) if layers is not None else None
        self.global_thr = float(global_thr)
        self.individual_thr = float(individual_thr)
        self.decode = decode
        self.positions = positions
        self._layers: list[int] | None = None

    @property
    def decode_kv(self) -> bool:  # type: ignore[override]
        return self.decode

    def check_model(self, adapter: Any) -> None:
        super().check_model(adapter)
        self.positions = staged_positions("MustDrop", self.positions, adapter)

    @property
    def renumber_positions(self) -> bool:
        """Renumber the kept rows after each stage (the official LLaVA code's shorter sequence)."""
        return self.positions == "renumber"

    def scoring_layers(self, num_layers: int) -> list[int]:
        """The layers whose attention decides (rows drop after each)."""
        if num_layers < 2:
            raise ValueError(f"MustDrop needs at least 2 decoder layers to drop after one, got {num_layers}")
        layers = self.layers if self.layers is not None else \
            sorted({min(num_layers - 2, round(l * num_layers / OFFICIAL_DEPTH)) for l in OFFICIAL_LAYERS})
        if layers[-1] > num_layers - 2:
            raise ValueError(f"MustDrop scores at layers {layers} and drops after each, but the model has only "
                             f"{num_layers} decoder layers")
        return list(layers)

    def prune_layers(self, num_layers: int) -> list[int]:
        self._layers = [l + 1 for l in self.scoring_layers(num_layers)]
        return self._layers

    def decode_final_rows_from(self, num_layers: int) -> int | None:
        return self.scoring_layers(num_layers)[0]

    def n_keep_at(self, layer: int, n_visual_original: int, n_visual_now: int, n_images: int = 1) -> int:
        """Visual tokens kept before decoder ``layer`` (one of :meth:`prune_layers`): the budget's share,
        or every token (the thresholds decide) without keep / budget."""
        if self._layers is None or layer not in self._layers:
            raise ValueError(f"MustDrop does not drop before layer {layer}; it drops before {self._layers}")
        if self.keep is None and self.budget is None:
            return n_visual_now
        n = n_visual_original
        return min(n_visual_now, final_counts(n, self.target_count(n, n_images), len(self._layers))[self._layers.index(layer)])

    def select(self, ctx: LayerContext) -> list[Reduction]:
        budgeted = self.keep is not None or self.budget is not None
        if budgeted and keeps_every_visual(ctx):
            return keep_all_rows(ctx)
        probs = text_to_visual_attention(ctx)
        n_text = ctx.text.sum(1)
        out = []
        for b in range(probs.shape[0]):
            vis = torch.nonzero(ctx.visual[b]).squeeze(1)
            other = torch.nonzero(ctx.valid[b] & ~ctx.visual[b]).squeeze(1)
            if budgeted:
                score = dual_attention_scores(probs[b, : int(n_text[b])][:, vis], self.global_thr, self.individual_thr)
                k = max(0, min(int(ctx.n_keep[b]), vis.numel()))
                kept = vis[torch.topk(score, k, sorted=False).indices]
            else:
                kept = vis[dual_attention_keep(probs[b, : int(n_text[b])][:, vis], self.global_thr, self.individual_thr)]
            out.append(Reduction(torch.sort(torch.cat([other, kept])).values))
        return out
