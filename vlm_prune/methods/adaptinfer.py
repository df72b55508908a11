"""AdaptInfer: text-guided visual token pruning at several decoder layers."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction
from vlm_prune.methods.fastv import keep_all_rows, keep_top_visual, keeps_every_visual
from vlm_prune.registry import register


@dataclass(frozen=True)
class Schedule:
    """A published schedule: prune after the 0-indexed layers ``after``.

    counts: target average tokens -> visual tokens kept at each stage (absolute counts, for
        ``reference_tokens`` visual tokens; scaled for other token counts).
    ratios: keep -> fraction of the CURRENT visual count kept at each stage (None = default).
    """

    after: tuple[int, ...]
    counts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ratios: dict[float | None, tuple[float, ...]] = field(default_factory=dict)
    reference_tokens: int = 576


#: From weiczh02/AdaptInfer-base (llava/model/language_model/score.py, qwen2_vl/pruning.py)
#: and the paper (arXiv 2508.06084).
SCHEDULES: dict[str, Schedule] = {
    "llava-1.5-7b": Schedule(
        after=(1, 10, 20),
        counts={128: (290, 72, 18), 64: (133, 27, 3), 48: (80, 24, 2), 32: (40, 12, 0)},
    ),
    "llava-1.5-13b": Schedule(after=(1, 10, 20), counts={128: (300, 94, 30), 64: (148, 40, 5)}),
    "qwen2-vl-2b": Schedule(
        after=(0, 9, 19),
        ratios={None: (0.17, 0.6, 0.3), 0.3: (0.5, 0.6, 0.3), 0.5: (0.7, 0.9, 0.3)},
    ),
}

#: Where the derived schedule prunes, as fractions of the depth (LLaVA-1.5-7B's 1, 10, 20 of 32).
AUTO_LAYER_FRACTIONS = (1 / 32, 10 / 32, 20 / 32)


def auto_layers(num_layers: int, fractions: tuple[float, ...] = AUTO_LAYER_FRACTIONS) -> list[int]:
    """Prune-after layers for a model of any depth: round(f * depth), distinct, <= depth - 2."""
    if num_layers < 2:
        raise ValueError(f"AdaptInfer needs at least 2 decoder layers to prune after one, got {num_layers}")
    return sorted({min(num_layers - 2, max(0, round(f * num_layers))) for f in fractions})


def derive_counts(
    n_visual: int, target: float, after: list[int], num_layers: int, stage_ratios: tuple[float, ...]
) -> list[int]:
    """Stage counts k_1..k_m whose depth average equals ``target`` visual tokens per layer.

    Uses the paper's accounting (which reproduces its published schedules): n_visual tokens in
    layers 0..l_1-1, k_i in layers l_i..l_{i+1}-1, k_m up to the last layer. Later stages keep
    fixed fractions of the previous one, k_{i+1} = c_i k_i (default c = 0.25, 0.25 as in the
    LLaVA-1.5-7B schedule for 128 tokens); k_1 is solved for and clamped to [0, n_visual]. With
    these defaults a 32-layer model, 576 tokens and target 128 give [287, 72, 18] (published:
    [290, 72, 18]). A shallow model whose depth merges some of the pruning layers uses the
    first len(after) - 1 ratios. A target of every visual token (keep=1.0) prunes nothing.
    """
    if len(stage_ratios) < len(after) - 1:
        raise ValueError(
            f"AdaptInfer needs {len(after) - 1} stage_ratios for {len(after)} pruning layers, got {len(stage_ratios)}"
        )
    if target >= n_visual:
        return [n_visual] * len(after)
    bounds = list(after) + [num_layers]
    weight, factor = 0.0, 1.0
    factors = []
    for i in range(len(after)):
        factor = factor * (stage_ratios[i - 1] if i else 1.0)
        factors.append(factor)
        weight += (bounds[i + 1] - bounds[i]) * factor
    k1 = (target * num_layers - after[0] * n_visual) / weight
    k1 = min(float(n_visual), max(0.0, k1))
    return [min(n_visual, round(k1 * f)) for f in factors]


def text_guided_scores(probs: torch.Tensor, text_cols: torch.Tensor, row_ok: torch.Tensor) -> torch.Tensor:
    """AdaptInfer visual scores from the text-query rows of one layer's attention.

    probs: [B, H, T, S] softmax attention of the T text query rows over all S keys (causal);
    text_cols: [B, T] the key index of each text row; row_ok: [B, T] False for padding rows.
    A_tt = probs[:, :, :, text_cols]; S = A_tt + A_tt^T - diag(A_tt);
    text_imp[h, j] = sum_i S[h, i, j]; score[s] = sum_h sum_j text_imp[h, j] * probs[h, j, s].
    Returns [B, S] float32 (only visual columns are meaningful).
    """
    b, h, t, _ = probs.shape
    ok = row_ok.float()
    probs = probs * ok[:, None, :, None]
    a_tt = torch.gather(probs, 3, text_cols[:, None, None, :].expand(b, h, t, t)) * ok[:, None, None, :]
    diag = torch.diagonal(a_tt, dim1=-2, dim2=-1)
    text_imp = a_tt.sum(-2) + a_tt.sum(-1) - diag  # [B, H, T]
    return torch.einsum("bht,bhts->bs", text_imp, probs)


def text_rows(text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [B, T], row_ok [B, T]): each sample's text rows packed to the front in sequence
    order (T = the most text rows of any sample, at least 1); row_ok is False for fillers."""
    n_text = max(1, int(text.sum(1).max()))
    order = torch.argsort(text.int(), dim=1, descending=True, stable=True)[:, :n_text]
    return order, torch.gather(text, 1, order)


def text_rows_attention(
    q_rows: torch.Tensor, k: torch.Tensor, order: torch.Tensor, row_ok: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-head causal attention of the text query rows only: O(B H T S), never S x S.

    q_rows: [B, H, T, d] the queries of the rows ``order`` [B, T] (:func:`text_rows`); k: [B, H, S, d].
    Returns probs [B, H, T, S] float32; rows with row_ok False have zero probabilities.
    """
    s = k.shape[2]
    logits = torch.einsum("bhtd,bhsd->bhts", q_rows.float(), k.float()) * scale
    ar = torch.arange(s, device=k.device)
    allowed = valid[:, None, :] & (ar[None, None, :] <= order[:, :, None])  # [B, T, S]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0) * row_ok[:, None, :, None].float()


@register
class AdaptInfer(LLMMethod):
    """AdaptInfer: text-guided multi-layer pruning (arXiv 2508.06084; weiczh02/AdaptInfer-base).

    After each layer l of a schedule, visual tokens are ranked by the attention the text queries
    pay them, each text token weighted by its importance inside the text: with A the layer's
    causal attention, A_tt its text-text block, S = A_tt + A_tt^T - diag(A_tt),
    text_imp = column sums of S, score[v] = sum_h sum_t text_imp[h, t] A[h, t, v]. The text rows
    of A are recomputed on the side from layer l's own q/k (exact, O(T S) per head), so the
    model keeps SDPA / FlashAttention. Pruning happens before layer l + 1; kept tokens keep their
    original position ids.

    ``schedule``:
    - "auto" (default): prune after round(depth * (1, 10, 20) / 32) (or ``layers``), stage
      counts from :func:`derive_counts` so that the depth-average visual count equals the
      target, given as keep (fraction of the sample's visual tokens) or budget (visual tokens
      of the sample, summed over its images). Required.
    - "llava-1.5-7b": budget in {128, 64, 48, 32} -> published counts after layers 1, 10, 20
      (for 576 tokens; scaled proportionally for other token counts).
    - "llava-1.5-13b": budget in {128, 64}.
    - "qwen2-vl-2b": after layers 0, 9, 19, fractions of the current count: (0.17, 0.6, 0.3) by
      default, keep=0.3 -> (0.5, 0.6, 0.3), keep=0.5 -> (0.7, 0.9, 0.3).
    The engine asks :meth:`n_keep_at` for each stage's count.
    """

    name = "adaptinfer"
    paper = "AdaptInfer, arXiv 2508.06084 (weiczh02/AdaptInfer-base)"
    own_schedule = True
    scores_from_previous_layer = True

    def __init__(
        self,
        schedule: str = "auto",
        layers: tuple[int, ...] | list[int] | None = None,
        stage_ratios: tuple[float, ...] = (0.25, 0.25),
        keep: float | None = None,
        budget: int | None = None,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if schedule != "auto" and schedule not in SCHEDULES:
            raise ValueError(
                f"unknown AdaptInfer schedule {schedule!r}; choose 'auto' or one of {', '.join(SCHEDULES)}"
            )
        if layers is not None and schedule != "auto":
            raise ValueError("AdaptInfer layers= only applies to schedule='auto'; published schedules fix their layers")
        if layers is not None and (not layers or list(layers) != sorted(set(layers)) or min(layers) < 0):
            raise ValueError(f"AdaptInfer layers must be distinct increasing layer indices >= 0, got {layers!r}")
        if any(not 0 < c <= 1 for c in stage_ratios):
            raise ValueError(f"AdaptInfer stage_ratios must lie in (0, 1], got {stage_ratios!r}")
        self.schedule = schedule
        self.layers = list(layers) if layers is not None else None
        self.stage_ratios = tuple(stage_ratios)
        self._after: list[int] | None = None
        self._num_layers: int | None = None

    def configure_budget(self, keep: float | None, budget: int | None) -> None:
        super().configure_budget(keep, budget)
        if self.schedule == "auto" and self.keep is None and self.budget is None:
            raise ValueError(
                "AdaptInfer with schedule='auto' needs a target: keep= (average fraction of visual tokens "
                "over the layers) or budget= (average visual tokens), or pick a published schedule"
            )
        published = SCHEDULES.get(self.schedule)
        if published is not None and published.counts and self.budget not in published.counts:
            raise ValueError(
                f"AdaptInfer schedule {self.schedule!r} is published for budget= "
                f"{', '.join(str(c) for c in published.counts)} (average visual tokens); got "
                f"keep={self.keep!r}, budget={self.budget!r}"
            )
        if published is not None and published.ratios and self.budget is not None:
            raise ValueError(f"AdaptInfer schedule {self.schedule!r} takes keep=, not budget=")
        if published is not None and published.ratios and self.keep not in published.ratios:
            raise ValueError(
                f"AdaptInfer schedule {self.schedule!r} is published for keep= "
                f"{', '.join(str(k) for k in published.ratios)}; got keep={self.keep!r}"
            )

    def prune_after(self, num_layers: int) -> list[int]:
        """0-indexed layers whose attention scores a pruning step (pruning happens after them)."""
        if self.schedule == "auto":
            after = self.layers if self.layers is not None else auto_layers(num_layers)
        else:
            after = list(SCHEDULES[self.schedule].after)
        if after[-1] > num_layers - 2:
            raise ValueError(
                f"AdaptInfer prunes after layers {after}, but the model has only {num_layers} decoder "
                f"layers (the last pruning layer must be <= {num_layers - 2})"
            )
        return after

    def prune_layers(self, num_layers: int) -> list[int]:
        self._after = self.prune_after(num_layers)
        self._num_layers = num_layers
        return [layer + 1 for layer in self._after]

    def n_keep_at(self, layer: int, n_visual_original: int, n_visual_now: int) -> int:
        """Visual tokens to keep before decoder ``layer`` (one of :meth:`prune_layers`)."""
        if self._after is None or self._num_layers is None:
            raise RuntimeError("AdaptInfer.n_keep_at called before prune_layers(num_layers)")
        if layer - 1 not in self._after:
            raise ValueError(f"AdaptInfer does not prune before layer {layer}; it prunes before {[a + 1 for a in self._after]}")
        stage = self._after.index(layer - 1)
        if self.schedule == "auto":
            target = self.keep * n_visual_original if self.keep is not None else min(self.budget, n_visual_original)
            counts = derive_counts(n_visual_original, target, self._after, self._num_layers, self.stage_ratios)
            return min(n_visual_now, counts[stage])
        published = SCHEDULES[self.schedule]
        if published.ratios:
            ratio = published.ratios[self.keep][stage]
            return max(1, min(int(ratio * n_visual_now), n_visual_now)) if n_visual_now else 0
        count = published.counts[self.budget][stage]
        scaled = round(count * n_visual_original / published.reference_tokens)
        return min(n_visual_now, scaled)

    def scores(self, ctx: LayerContext) -> torch.Tensor:
        """[B, S] text-guided scores from the attention of ``ctx.layer_module`` (the layer
        after which pruning happens), its text query rows computed on the side."""
        order, row_ok = text_rows(ctx.text)
        q, k = ctx.project_qk(ctx.hidden, ctx.positions, rope=True, q_rows=order)
        scale = getattr(ctx.layer_module.self_attn, "scaling", q.shape[-1] ** -0.5)
        return text_guided_scores(text_rows_attention(q, k, order, row_ok, ctx.valid, scale), order, row_ok)

    def select(self, ctx: LayerContext) -> list[Reduction]:
        if keeps_every_visual(ctx):
            return keep_all_rows(ctx)
        scores = self.scores(ctx)
        return [
            keep_top_visual(scores[b], ctx.visual[b], ctx.valid[b], int(ctx.n_keep[b]))
            for b in range(scores.shape[0])
        ]
