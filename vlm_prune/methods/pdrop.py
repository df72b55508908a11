"""PyramidDrop: drop visual tokens in stages, at several decoder layers, by the last token's attention."""
from __future__ import annotations

from typing import Any

from vlm_prune.methods.adaptinfer import final_counts, staged_positions
from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction, check_positions
from vlm_prune.methods.fastv import keep_all_rows, keep_top_visual, keeps_every_visual, last_query_attention
from vlm_prune.registry import register

#: the official LLaVA-1.5 schedule: before layers 8, 16, 24 of 32 (scaled with depth elsewhere)
OFFICIAL_LAYERS = (8, 16, 24)
OFFICIAL_DEPTH = 32


def scaled_layers(num_layers: int, layers: tuple[int, ...] = OFFICIAL_LAYERS, depth: int = OFFICIAL_DEPTH) -> list[int]:
    """``layers`` of a ``depth``-layer model moved to a ``num_layers`` one: round(l * num_layers / depth),
    distinct, within 1 .. num_layers - 1."""
    if num_layers < 2:
        raise ValueError(f"PyramidDrop needs at least 2 decoder layers to drop before one, got {num_layers}")
    return sorted({min(num_layers - 1, max(1, round(l * num_layers / depth))) for l in layers})


@register
class PyramidDrop(LLMMethod):
    """PyramidDrop (Xing et al., CVPR 2025, "PyramidDrop: Accelerating Your Large Vision-Language
    Models via Pyramid Visual Redundancy Reduction"; Cooperx521/PyramidDrop at 6444f304,
    llava/model/modeling_llama_pdrop.py ``pdrop_forward`` / ``pdrop_rank_drop`` and
    scripts/v1_5/pdrop_eval/*.sh).

    Before each layer l of ``layers`` the visual tokens are ranked by the attention the last
    instruction token pays them in layer l itself (its input_layernorm, q / k projections and RoPE
    on the rows entering l; softmax over all keys, mean over heads), and the top ones stay. The
    official schedule: layers 8, 16, 24 of LLaVA-1.5's 32 (``layers=None`` scales them with depth:
    round(l * depth / 32)), keeping int(n * ``ratio`` ** s) of the n original visual tokens after
    stage s (``ratio`` = lambda = 0.5: 50%, 25%, 12.5%) - that is the default without keep / budget.
    With keep / budget (visual tokens reaching the last layer) every stage keeps the same fraction
    and the last lands on the target (:func:`vlm_prune.methods.adaptinfer.final_counts`; 1/8 of the
    tokens gives the official 50 / 25 / 12.5%).
    The attention row is computed on the side (only the last query), so the model keeps SDPA /
    FlashAttention. ``positions``: "renumber" (the official LLaVA code renumbers the kept rows 0..n-1
    after each stage and shifts later decode positions by the dropped count, i.e. each layer
    continues from its own rows) or "keep" (original ids, gaps stay). Default: "renumber" on LLaVA-1.5
    / LLaVA-NeXT (the official code's families), "keep" elsewhere (M-RoPE models only "keep").
    """

    name = "pdrop"
    paper = "PyramidDrop, Xing et al., CVPR 2025 (Cooperx521/PyramidDrop)"
    summary = "drops visual tokens in stages at several LLM layers, by the last instruction token's attention"
    budget_note = ("keep / budget = visual tokens reaching the last layer, an even share per stage; without them "
                   "the paper's lambda = 0.5 schedule (50%, 25%, 12.5% after the three stages)")
    own_schedule = True

    def __init__(self, layers: tuple[int, ...] | list[int] | None = None, ratio: float = 0.5,
                 positions: str | None = None, keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        if layers is not None and (not layers or list(layers) != sorted(set(layers)) or min(layers) < 1):
            raise ValueError(f"PyramidDrop layers must be distinct increasing layer indices >= 1, got {layers!r}")
        if not 0 < ratio <= 1:
            raise ValueError(f"PyramidDrop ratio (lambda) must lie in (0, 1], got {ratio!r}")
        check_positions("PyramidDrop", positions)
        self.layers = list(layers) if layers is not None else None
        self.ratio = ratio
        self.positions = positions
        self._layers: list[int] | None = None

    def check_model(self, adapter: Any) -> None:
        super().check_model(adapter)
        self.positions = staged_positions("PyramidDrop", self.positions, adapter)

    @property
    def renumber_positions(self) -> bool:
        return self.positions == "renumber"

    def prune_layers(self, num_layers: int) -> list[int]:
        layers = self.layers if self.layers is not None else scaled_layers(num_layers)
        if layers[-1] > num_layers - 1:
            raise ValueError(f"PyramidDrop drops before layers {layers}, but the model has only {num_layers} decoder "
                             f"layers; pass layers= below {num_layers}")
        self._layers = list(layers)
        return self._layers

    def n_keep_at(self, layer: int, n_visual_original: int, n_visual_now: int, n_images: int = 1) -> int:
        """Visual tokens kept before decoder ``layer`` (one of :meth:`prune_layers`)."""
        if self._layers is None or layer not in self._layers:
            raise ValueError(f"PyramidDrop does not drop before layer {layer}; it drops before {self._layers}")
        stage, n = self._layers.index(layer), n_visual_original
        if self.keep is not None or self.budget is not None:
            return min(n_visual_now, final_counts(n, self.target_count(n, n_images), len(self._layers))[stage])
        return min(n_visual_now, int(n * self.ratio ** (stage + 1)))

    def select(self, ctx: LayerContext) -> list[Reduction]:
        if keeps_every_visual(ctx):
            return keep_all_rows(ctx)
        scores = last_query_attention(ctx)
        return [keep_top_visual(scores[b], ctx.visual[b], ctx.valid[b], int(ctx.n_keep[b])) for b in range(scores.shape[0])]
