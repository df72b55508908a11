"""AdaptInfer: text-guided visual token pruning at several decoder layers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


#: From weiczh02/AdaptInfer-base (llava/model/language_model/score.py and
#: modelling_sparse_llama.py at commit 91b1784a; qwen2_vl/pruning.py at 8f5ae0c0) and the paper
#: (arXiv 2508.06084). Keys: the paper's target, the depth-average visual tokens (LLaVA: tokens per
#: image; Qwen2-VL: fraction of the visual tokens, None = the official default).
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

#: The language-model shape (adapter family, decoder layers, hidden size) of each published model:
#: a wrapped model of that shape gets the published schedule automatically.
PUBLISHED_SHAPES: dict[str, tuple[str, int, int]] = {
    "llava-1.5-7b": ("llava", 32, 4096),
    "llava-1.5-13b": ("llava", 40, 5120),
    "qwen2-vl-2b": ("qwen2_vl", 28, 1536),
}

#: Position ids after a pruning step, per family, as the official code does: its LLaVA code
#: renumbers the kept rows 0..n-1 (``position_ids[:, :kept]``) and each later decode step takes
#: its layer's cache length as position; elsewhere the kept rows keep their original ids.
OFFICIAL_POSITIONS: dict[str, str] = {"llava": "renumber", "llava_next": "renumber"}


def resolve_positions(title: str, positions: str | None, adapter: Any) -> str:
    """``positions`` for ``adapter``: the family's official handling (:data:`OFFICIAL_POSITIONS`) when
    None; "renumber" refused on multi-axis (M-RoPE) positions."""
    positions = positions if positions is not None else OFFICIAL_POSITIONS.get(adapter.family, "keep")
    if positions == "renumber" and getattr(adapter, "multi_axis_positions", False):
        raise ValueError(f"{title} positions='renumber' is for 1-D positions; {type(adapter.model).__name__}'s "
                         "M-RoPE keeps its positions")
    return positions

#: Where the derived schedule prunes, as fractions of the depth (LLaVA-1.5-7B's 1, 10, 20 of 32).
AUTO_LAYER_FRACTIONS = (1 / 32, 10 / 32, 20 / 32)


def published_for(family: str, num_layers: int, hidden: int) -> str | None:
    """The published schedule whose model has this language-model shape, if any."""
    for name, shape in PUBLISHED_SHAPES.items():
        if shape == (family, num_layers, hidden):
            return name
    return None


def auto_layers(num_layers: int, fractions: tuple[float, ...] = AUTO_LAYER_FRACTIONS) -> list[int]:
    """Prune-after layers for a model of any depth: round(f * depth), distinct, <= depth - 2."""
    if num_layers < 2:
        raise ValueError(f"AdaptInfer needs at least 2 decoder layers to prune after one, got {num_layers}")
    return sorted({min(num_layers - 2, max(0, round(f * num_layers))) for f in fractions})


def final_counts(n_visual: int, target: int, n_stages: int) -> list[int]:
    """Stage counts ending at ``target``: each stage keeps the same fraction of the tokens,
    stage i leaves round(n * (target / n) ** (i / m)) and the last exactly ``target``."""
    if target >= n_visual:
        return [n_visual] * n_stages
    ratio = target / n_visual
    counts = [round(n_visual * ratio ** (i / n_stages)) for i in range(1, n_stages)] + [target]
    return [max(c, target) for c in counts]


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
    """AdaptInfer: text-guided multi-layer pruning (arXiv 2508.06084; weiczh02/AdaptInfer-base,
    LLaVA code at commit 91b1784a, Qwen2-VL code at 8f5ae0c0).

    After each layer l of a schedule, visual tokens are ranked by the attention the text queries
    pay them, each text token weighted by its importance inside the text: with A the layer's
    causal attention, A_tt its text-text block, S = A_tt + A_tt^T - diag(A_tt),
    text_imp = column sums of S, score[v] = sum_h sum_t text_imp[h, t] A[h, t, v]. The text rows
    of A are recomputed on the side from layer l's own q/k (exact, O(T S) per head), so the
    model keeps SDPA / FlashAttention. Pruning happens before layer l + 1.

    Where it prunes: after the published layers when the wrapped model has a published shape
    (LLaVA-1.5-7B / 13B: 1, 10, 20; Qwen2-VL-2B: 0, 9, 19), else after ``layers`` or
    round(depth * (1, 10, 20) / 32). ``schedule`` names a published schedule to force it.

    How many it keeps, from one of:
    - ``keep`` / ``budget`` (the library's target, given to wrap()): the visual tokens that reach
      the last layer. Each stage keeps the same fraction and the last lands on the target
      (:func:`final_counts`); keep=1.0 prunes nothing.
    - ``average`` (the paper's target): the depth-average visual tokens (an int: per image; a
      float: fraction). On a published shape with a published average this is the official
      schedule exactly (LLaVA-1.5-7B, average=64: 133, 27, 3 of 576 tokens, scaled for other
      counts; Qwen2-VL-2B, average=0.3: 0.5, 0.6, 0.3 of the current count); otherwise
      :func:`derive_counts` solves for it. No keep / budget needed.
    - nothing, on a Qwen2-VL-2B shape: the official default ratios (0.17, 0.6, 0.3).
    The two targets differ by design: ``budget=64`` means what it means for every other method,
    64 visual tokens reach the last layer (LLaVA-1.5-7B: 277, 133, 64 after layers 1, 10, 20),
    while the paper's "64 tokens" setting is a depth average, ``AdaptInfer(average=64)``
    (133, 27, 3). Compare methods with keep / budget; quote the paper with ``average=``.

    ``positions``: "renumber" (kept rows renumbered 0..n-1 after each step, each decode step at
    its layer's row count, as the official LLaVA code) or "keep" (original position ids, gaps
    stay). Default: the official code's handling of the family ("renumber" on LLaVA-1.5 and
    LLaVA-NeXT, "keep" elsewhere; M-RoPE models only "keep").
    """

    name = "adaptinfer"
    paper = "AdaptInfer, arXiv 2508.06084 (weiczh02/AdaptInfer-base)"
    budget_note = ("keep / budget = visual tokens reaching the last layer (budget=64 on LLaVA-1.5-7B: 277, 133, "
                   "64); the paper's depth-average setting is average=64 (133, 27, 3)")
    own_schedule = True
    scores_from_previous_layer = True

    def __init__(
        self,
        schedule: str = "auto",
        average: int | float | None = None,
        layers: tuple[int, ...] | list[int] | None = None,
        stage_ratios: tuple[float, ...] = (0.25, 0.25),
        positions: str | None = None,
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
        if average is not None and (isinstance(average, bool) or not isinstance(average, (int, float)) or average <= 0
                                    or (isinstance(average, float) and average > 1)):
            raise ValueError(
                f"AdaptInfer average is the depth-average visual tokens: a count >= 1 (per image) or a "
                f"fraction in (0, 1], got {average!r}"
            )
        if positions not in (None, "renumber", "keep"):
            raise ValueError(f"AdaptInfer positions must be 'renumber' or 'keep' (None: the official one), got {positions!r}")
        self.schedule = schedule
        self.average = average
        self.layers = list(layers) if layers is not None else None
        self.stage_ratios = tuple(stage_ratios)
        self.positions = positions
        self._published: str | None = schedule if schedule != "auto" else None
        self._after: list[int] | None = None
        self._num_layers: int | None = None

    def configure_budget(self, keep: float | None, budget: int | None) -> None:
        if self.average is not None and (keep is not None or budget is not None or self.keep is not None
                                         or self.budget is not None):
            raise ValueError(
                "AdaptInfer takes either the paper's average= (depth-average visual tokens) or keep= / budget= "
                "(visual tokens reaching the last layer), not both"
            )
        super().configure_budget(keep, budget)

    def check_model(self, adapter: Any) -> None:
        """Pick the published schedule of the model's shape, the family's official position
        handling, and check that a target is set."""
        super().check_model(adapter)
        cfg = adapter.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if self.schedule == "auto":
            self._published = published_for(adapter.family, text.num_hidden_layers, text.hidden_size)
        if self.positions is None:
            self.positions = OFFICIAL_POSITIONS.get(adapter.family, "keep")
        if self.positions == "renumber" and getattr(adapter, "multi_axis_positions", False):
            raise ValueError(f"AdaptInfer positions='renumber' is for 1-D positions; {type(adapter.model).__name__}'s "
                             "M-RoPE keeps its positions")
        published = SCHEDULES.get(self._published or "")
        has_target = self.keep is not None or self.budget is not None or self.average is not None
        if not has_target and not (published is not None and None in published.ratios):
            raise ValueError(
                "AdaptInfer needs a target: keep= / budget= (visual tokens reaching the last layer) or "
                "average= (the paper's depth-average visual tokens)"
            )
        if self.schedule != "auto" and self.average is not None and not self._published_average(published):
            keys = published.counts or published.ratios
            raise ValueError(
                f"AdaptInfer schedule {self.schedule!r} is published for average= "
                f"{', '.join(str(k) for k in keys if k is not None)}; got {self.average!r}"
            )

    def _published_average(self, published: Schedule | None) -> bool:
        """True when the average (or no target) is one the published schedule lists."""
        if published is None or self.keep is not None or self.budget is not None:
            return False
        return self.average in (published.counts or published.ratios)

    @property
    def renumber_positions(self) -> bool:
        return self.positions == "renumber"

    def prune_after(self, num_layers: int) -> list[int]:
        """0-indexed layers whose attention scores a pruning step (pruning happens after them)."""
        if self._published is not None:
            after = list(SCHEDULES[self._published].after)
        else:
            after = self.layers if self.layers is not None else auto_layers(num_layers)
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

    def n_keep_at(self, layer: int, n_visual_original: int, n_visual_now: int, n_images: int = 1) -> int:
        """Visual tokens to keep before decoder ``layer`` (one of :meth:`prune_layers`)."""
        if self._after is None or self._num_layers is None:
            raise RuntimeError("AdaptInfer.n_keep_at called before prune_layers(num_layers)")
        if layer - 1 not in self._after:
            raise ValueError(f"AdaptInfer does not prune before layer {layer}; it prunes before {[a + 1 for a in self._after]}")
        stage = self._after.index(layer - 1)
        n, images = n_visual_original, max(1, n_images)
        if self.keep is not None or self.budget is not None:
            counts = final_counts(n, self.target_count(n, images), len(self._after))
            return min(n_visual_now, counts[stage])
        published = SCHEDULES.get(self._published or "")
        if self._published_average(published):
            if published.ratios:
                ratio = published.ratios[self.average][stage]
                return max(1, min(int(ratio * n_visual_now), n_visual_now)) if n_visual_now else 0
            count = published.counts[self.average][stage]
            return min(n_visual_now, round(count * n / published.reference_tokens))
        average = self.average * n if isinstance(self.average, float) else min(self.average * images, n)
        counts = derive_counts(n, average, self._after, self._num_layers, self.stage_ratios)
        return min(n_visual_now, counts[stage])

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
