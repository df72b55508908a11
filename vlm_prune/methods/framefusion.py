"""FrameFusion: merge video tokens that repeat the previous frame, then prune by importance, in the first LLM layers."""
from __future__ import annotations

from dataclasses import dataclass, field
import torch

from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction
from vlm_prune.methods.fastv import keep_top_visual, previous_layer_attention
from vlm_prune.registry import register

#: the decoder depth the official cost formula assumes (hard-coded: Qwen2-7B's 28 layers, the LLM of
#: LLaVA-Video-7B and Qwen2-VL-7B)
OFFICIAL_COST_LAYERS = 28

#: the video families whose adapters hand the llm stage each video token's frame slot
VIDEO_FAMILIES = ("llava_onevision", "qwen2_vl", "llava_next_video", "llava_onevision15", "qwen3_vl", "qwen3_5")


def cost_sparsity(history: list[float], cost: float, layers: int) -> float:
    """The share of the current visual tokens the next layer must drop so that the average visual
    token count over ``layers`` layers is ``cost`` of the original, after layers that each kept
    ``1 - r`` of theirs (``history``). 0 when the budget needs no more dropping; ValueError when the
    layers so far already spent more than ``cost`` (the official "The cost is too small")."""
    kept, spent = 1.0, 0.0
    for r in history:
        kept *= 1 - r
        spent += kept
    remaining = layers * cost - spent
    left = (layers - len(history)) * kept
    if remaining < 0 or left <= 0:
        raise ValueError(
            f"framefusion: cost={cost} is too small: its first {len(history)} layers already spent {spent:.3g} of the "
            f"{layers * cost:.3g} layer-equivalents the cost allows over {layers} layers. Raise cost, or give keep= / "
            "budget= (visual tokens reaching the last layer) instead"
        )
    return max(0.0, 1 - remaining / left)


def previous_in_slot(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, prev): the rows with a slot (``slots`` [S] >= 0) ordered by (slot, row), and for each
    the row before it with the same slot (the same spatial slot in the previous remaining frame),
    -1 for the first of its slot."""
    rows = torch.nonzero(slots >= 0).squeeze(1)
    order = torch.argsort(slots[rows], stable=True)  # rows ascending within a slot
    rows = rows[order]
    prev = torch.full_like(rows, -1)
    if rows.numel() > 1:
        same = slots[rows[1:]] == slots[rows[:-1]]
        prev[1:] = torch.where(same, rows[:-1], -1)
    return rows, prev


def slot_similarity(hidden: torch.Tensor, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """[len(rows)] cosine similarity (float32) of each row's hidden state with its ``prev`` row's; -2 where
    there is none (the official IGNORE value, below every threshold)."""
    x = hidden[rows].float()
    y = hidden[prev.clamp(min=0)].float()
    sim = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))
    return torch.where(prev >= 0, sim, torch.full_like(sim, -2.0))


def merge_into_previous(hidden: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor, merge: torch.Tensor) -> Reduction:
    """Fold every row ``rows[merge]`` into the nearest earlier row of its slot that is not merged
    (``rows`` ordered by (slot, row), the first of each slot never merged): the kept row's hidden state
    becomes the plain mean of itself and the rows folded into it (as the official code averages,
    whatever those rows already stand for). The kept rows keep their slots (positions)."""
    s = hidden.shape[0]
    ar = torch.arange(rows.numel(), device=rows.device)
    root = rows[torch.where(merge, -1, ar).cummax(0).values.clamp(min=0)]  # nearest unmerged predecessor
    into = torch.where(valid, torch.arange(s, device=rows.device), -1)
    into[rows] = root
    keep = valid.clone()
    keep[rows[merge]] = False
    indices = torch.nonzero(keep).squeeze(1)
    members = torch.nonzero(into >= 0).squeeze(1)
    sums = torch.zeros(s, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, into[members], hidden[members].float())
    count = torch.zeros(s, dtype=torch.float32, device=hidden.device).index_add_(0, into[members], torch.ones(members.numel(), device=hidden.device))
    feats = (sums[indices] / count[indices, None]).to(hidden.dtype)
    plain = count[indices] == 1
    feats[plain] = hidden[indices[plain]]  # rows nothing folded into stay bit-identical
    return Reduction(indices, features=feats, merged_into=into)


@dataclass
class SampleState:
    """Where one sample of a prefill stands: merging ("merge"), pruning before the next layer
    ("prune"), or finished ("done"); the share of visual tokens each merging layer dropped."""

    phase: str = "merge"
    history: list[float] = field(default_factory=list)


@register
class FrameFusion(LLMMethod):
    """FrameFusion (Fu et al., ICCV 2025, "FrameFusion: Combining Similarity and Importance for Video
    Token Reduction on Large Vision Language Models"; thu-nics/FrameFusion at
    fbec1d2e6bd383361c2c87ca13e73f80a8c1a9e9, framefusion/main.py ``FrameFusion.forward``,
    ``compute_similarity_and_token_index_by_patch``, ``merge_tokens_and_get_mask``,
    ``_compute_pruning_ratio``; framefusion/models/qwen2/modeling_qwen2.py for where it runs).

    Similarity merging, layer after layer from layer 0: each video token is compared (cosine of the
    hidden states entering the layer) with the token of the same spatial slot in the previous
    remaining frame; every token at or above ``similarity`` (S_th, default 0.6) is folded into that
    earlier token (runs of such tokens fold into the first token before the run; plain mean of hidden
    states, no proportional attention, the kept token keeps its position id). Let r be the share of
    the visual tokens so merged and u the share the budget allows now: r >= u merges only the int(u n)
    most similar (exactly n - target with a target) and ends (no pruning); else r is recorded, and r < ``ratio_lower_bound`` (0.1) ends the
    merging, after which importance pruning runs once, before the next layer: the visual tokens are
    ranked by the attention the last token pays them in the layer after the last merge (mean over
    heads; computed on the side, as FastV, so SDPA / FlashAttention stay), and the top ones stay.

    Budget without keep / budget (the official): ``cost`` (0.3) is the average share of visual tokens
    over ``cost_layers`` layers (28, the official hard-coded depth; give the model's depth to make it
    exact there): u = 1 - (cost_layers * cost - spent) / ((cost_layers - m) * kept) after m merging
    layers (:func:`cost_sparsity`), the pruning keeps round((1 - u) n) of the n tokens left, and a
    cost the merging layers already overspent is refused, as the official raises. With keep / budget
    (visual tokens per video reaching the last layer, exact): u = (n - target) / n, the pruning keeps
    exactly the target, and merging ends by layer L - 2 at the latest so that the pruning runs before
    the last layer.

    Where this differs from the official code (which runs one video, batch 1): the official merges
    before layer 0's attention and then after each layer's attention, before its MLP, and prunes after
    the attention of the layer after the last merge; the engine reduces between layers, so merge m
    (m >= 1) runs on the hidden states entering layer m (after layer m - 1's MLP) and the pruning
    before layer k + 1 when merging ended before layer k, with layer k's attention - the same number
    of merging steps, the same cost arithmetic. The official's topk over the similarity and pruning
    span counts every token between the first and the last video token; here only the visual tokens
    (LLaVA-OneVision's newline is not one). Similarities are computed in float32. Each sample of a
    batch, and each video of a sample (its own slot ids), is handled on its own. Images in the prompt
    count as visual tokens (pruned, never merged). Frames resized by a frames stage before it (QuoTA)
    lose their slot correspondence.
    """

    name = "framefusion"
    paper = "FrameFusion, Fu et al., ICCV 2025 (thu-nics/FrameFusion)"
    summary = "merges video tokens that repeat the previous frame in the first LLM layers, then prunes by attention"
    budget_note = ("keep / budget = visual tokens per video reaching the last layer (merging stops there or "
                   "pruning lands on it); without them the official cost=0.3 (average share over 28 layers)")
    supported = VIDEO_FAMILIES
    own_schedule = True
    needs_previous_hidden = True
    wants_frame_slots = True

    def __init__(self, cost: float = 0.3, similarity: float = 0.6, ratio_lower_bound: float = 0.1,
                 cost_layers: int = OFFICIAL_COST_LAYERS, keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 < cost <= 1:
            raise ValueError(f"framefusion cost (average share of visual tokens over the layers) must lie in (0, 1], got {cost!r}")
        if isinstance(similarity, bool) or not isinstance(similarity, (int, float)) or not -1 <= similarity <= 1:
            raise ValueError(f"framefusion similarity (S_th, the cosine threshold for merging) must lie in [-1, 1], got {similarity!r}")
        if isinstance(ratio_lower_bound, bool) or not isinstance(ratio_lower_bound, (int, float)) or not 0 <= ratio_lower_bound <= 1:
            raise ValueError(f"framefusion ratio_lower_bound must lie in [0, 1], got {ratio_lower_bound!r}")
        if isinstance(cost_layers, bool) or not isinstance(cost_layers, int) or cost_layers < 2:
            raise ValueError(f"framefusion cost_layers must be a whole number >= 2, got {cost_layers!r}")
        self.cost = float(cost)
        self.similarity = float(similarity)
        self.ratio_lower_bound = float(ratio_lower_bound)
        self.cost_layers = cost_layers
        self._num_layers = 0

    @property
    def targeted(self) -> bool:
        """True when a keep / budget target replaces the official cost."""
        return self.keep is not None or self.budget is not None

    def prune_layers(self, num_layers: int) -> list[int]:
        if num_layers < 2:
            raise ValueError(f"framefusion prunes before the layer after its last merge: it needs at least 2 decoder layers, got {num_layers}")
        self._num_layers = num_layers
        return list(range(num_layers))

    def select(self, ctx: LayerContext) -> list[Reduction] | None:
        b = ctx.hidden.shape[0]
        memo = ctx.extras["prefill_memo"]
        states: list[SampleState] = memo.setdefault(self.name, [SampleState() for _ in range(b)])
        n_vis = (ctx.visual & ctx.valid).sum(1)
        if ctx.layer == 0 and self.targeted:
            for i in range(b):  # a target at or above the token count: nothing to do
                if int(ctx.n_keep[i]) >= int(n_vis[i]):
                    states[i].phase = "done"
        if all(st.phase == "done" for st in states):
            return None
        slots = ctx.extras.get("frame_slots")
        pruning = [i for i in range(b) if states[i].phase == "prune"]
        scores = self._importance(ctx) if pruning else None
        out: list[Reduction] = []
        changed = False
        for i, st in enumerate(states):
            valid = ctx.valid[i]
            if st.phase == "prune":
                red = self._prune(ctx, i, scores[i], int(n_vis[i]), st)
                st.phase = "done"
            elif st.phase == "merge" and int(n_vis[i]) > 0:
                red = self._merge(ctx, i, None if slots is None else slots[i], int(n_vis[i]), st)
            else:
                red = None
            changed = changed or red is not None
            out.append(red if red is not None else Reduction(torch.nonzero(valid).squeeze(1)))
        return out if changed else None

    # ---- the two steps -------------------------------------------------------------------------
    def _merge(self, ctx: LayerContext, i: int, slots: torch.Tensor | None, n_vis: int, st: SampleState) -> Reduction | None:
        """One similarity-merging step of sample i (updates its state)."""
        valid, visual = ctx.valid[i], ctx.visual[i] & ctx.valid[i]
        if slots is None:
            slots = torch.full_like(valid, -1, dtype=torch.long)
        rows, prev = previous_in_slot(torch.where(visual, slots.to(valid.device), -1))
        sim = slot_similarity(ctx.hidden[i], rows, prev)
        above = sim >= self.similarity
        ratio = int(above.sum()) / n_vis
        if self.targeted:
            allowed = n_vis - int(ctx.n_keep[i])
            bound = allowed / n_vis
        else:
            bound = cost_sparsity(st.history, self.cost, self.cost_layers)
            allowed = int(bound * n_vis)
        if ratio < bound:
            st.history.append(ratio)
            last_chance = self.targeted and ctx.layer >= self._num_layers - 2
            if ratio < self.ratio_lower_bound or last_chance or ctx.layer >= self._num_layers - 1:
                st.phase = "prune" if ctx.layer < self._num_layers - 1 else "done"
            merge = above
        else:
            merge = torch.zeros_like(above)
            merge[torch.topk(sim, allowed).indices] = True
            st.phase = "done"
        if not bool(merge.any()):
            return None
        return merge_into_previous(ctx.hidden[i], valid, rows, merge)

    def _importance(self, ctx: LayerContext) -> torch.Tensor:
        """[B, S] head-averaged attention the last row pays each row in the layer before this one, on
        the rows that entered it (the same rows as now: nothing changes between a merge and the pruning)."""
        return previous_layer_attention(ctx)

    def _prune(self, ctx: LayerContext, i: int, scores: torch.Tensor, n_vis: int, st: SampleState) -> Reduction | None:
        """Importance pruning of sample i to the target (or the official cost's count)."""
        if self.targeted:
            n_keep = int(ctx.n_keep[i])
        else:
            n_keep = round(n_vis * (1 - cost_sparsity(st.history, self.cost, self.cost_layers)))
        if n_keep >= n_vis:
            return None
        return keep_top_visual(scores, ctx.visual[i], ctx.valid[i], n_keep)
