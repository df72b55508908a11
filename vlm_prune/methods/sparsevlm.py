"""SparseVLM: text-guided visual token sparsification at several decoder layers, pruned tokens recycled."""
from __future__ import annotations

from typing import Any

import torch

from vlm_prune.methods.adaptinfer import final_counts, staged_positions
from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction, check_positions
from vlm_prune.methods.fastv import attention_received
from vlm_prune.registry import register

#: v1.5 (the ICML 2025 code): keep counts at the three pruning layers of LLaVA-1.5 (576 visual
#: tokens), by the ``retained`` setting (the depth-average visual tokens the paper quotes)
SCHEDULE_COUNTS: dict[int, tuple[int, int, int]] = {192: (300, 200, 110), 128: (303, 110, 36), 64: (66, 30, 17)}
#: v1.5 pruning layers (attention of these 0-indexed layers scores; the drop follows them), of 32
SCHEDULE_LAYERS = (2, 6, 15)
#: v1 (arXiv v1): rank-adaptive counts int(rank * scale + bias) after layers 2, 6, 15, 19 of 32,
#: (scale, bias) by setting, from that version's README / scripts
RANK_LAYERS = (2, 6, 15, 19)
RANK_SETTINGS: dict[int, tuple[float, float]] = {192: (13.5, 0.0), 128: (9.0, 6.0), 64: (0.8, 0.0)}
OFFICIAL_DEPTH = 32
REFERENCE_TOKENS = 576


def scaled_after(num_layers: int, layers: tuple[int, ...]) -> list[int]:
    """Official pruning layers of a 32-layer model moved to ``num_layers``: round(l * depth / 32),
    distinct, within 0 .. num_layers - 2 (the drop happens before the next layer)."""
    if num_layers < 2:
        raise ValueError(f"SparseVLM needs at least 2 decoder layers to prune after one, got {num_layers}")
    return sorted({min(num_layers - 2, max(0, round(l * num_layers / OFFICIAL_DEPTH))) for l in layers})


def text_raters(visual: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """[T] bool: SparseVLM's raters among the text rows (Sec. 3.2): with the input embeddings of the
    visual [V, D] and text [T, D] rows, each visual row's softmax over the text rows of their dot
    products, averaged over the visual rows; raters are the text rows above that average's mean."""
    relevance = torch.softmax(visual.float() @ text.float().T, dim=1).mean(0)
    return relevance > relevance.mean()


def recycled_counts(n_dropped: int, ratio: float = 0.3, cluster_size: int = 10) -> tuple[int, int]:
    """(tokens recycled, clusters) for ``n_dropped`` deleted tokens, as the official code: the top
    int(ratio * n) + 1 of them by score are recycled into int(that / cluster_size) + 1 clusters
    (ratio 0: none, recycling off)."""
    if n_dropped <= 0 or ratio <= 0:
        return 0, 0
    m = min(n_dropped, int(n_dropped * ratio) + 1)
    return m, m // cluster_size + 1


def kept_for_total(n: int, total: int, ratio: float = 0.3, cluster_size: int = 10) -> tuple[int, int]:
    """(tokens kept by score, clusters) so that kept + clusters = ``total`` < ``n`` visual rows: the
    largest kept count whose recycled clusters still fit (kept + clusters rises by 0 or 1 per kept
    token, so the sum is met exactly); below the clusters of dropping all, every token is dropped
    and ``total`` clusters made."""
    best = 0
    for k in range(n - 1, -1, -1):
        if k + recycled_counts(n - k, ratio, cluster_size)[1] <= total:
            best = k
            break
    return best, min(recycled_counts(n - best, ratio, cluster_size)[1], total - best)


def density_peak_merge(x: torch.Tensor, n_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseVLM's recycling (Sec. 3.3): DPC-kNN on rows x [m, C], merged by averaging.

    Distances d_ij = ||x_i - x_j|| / sqrt(C); density rho_i = exp(-mean of d^2 to its n_clusters
    nearest rows, itself included); delta_i = distance to the nearest denser row (the largest
    distance for the densest); the n_clusters rows of highest rho * delta are the centres (in that
    order); every row joins its nearest centre, a centre its own cluster.
    Returns (cluster of each row [m] long, in centre order, merged rows [n_clusters, C] float32:
    each cluster's mean)."""
    m, c = x.shape
    xf = x.float()
    dist = torch.cdist(xf, xf, compute_mode="donot_use_mm_for_euclid_dist") / c**0.5
    near = torch.topk(dist, n_clusters, dim=-1, largest=False).values
    density = torch.exp(-(near**2).mean(-1))
    denser = density[None, :] > density[:, None]
    delta = torch.where(denser, dist, dist.max()).min(-1).values
    centres = torch.topk(delta * density, n_clusters).indices
    cluster = dist[centres].argmin(0)
    cluster[centres] = torch.arange(n_clusters, device=x.device)
    counts = torch.bincount(cluster, minlength=n_clusters).float()
    merged = torch.zeros(n_clusters, c, device=x.device).index_add_(0, cluster, xf) / counts[:, None]
    return cluster, merged


@register
class SparseVLM(LLMMethod):
    """SparseVLM (Zhang et al., ICML 2025, "SparseVLM: Visual Token Sparsification for Efficient
    Vision-Language Model Inference"; Gumpest/SparseVLMs, branch v1.5 at b9619e61 - the code of the
    ICML version - llava/model/language_model/modelling_sparse_llama.py ``LlamaDynamicvitModel.forward``,
    score.py ``attn_postprocess_topk``, utils.py ``cluster_and_merge``; the rank rule of the first
    version at b72c5d65, score.py ``attn_postprocess_rank``). The repository's main branch now holds
    SparseVLM+ (v2.0, Dec 2025), a later method with another text-visual attention pattern: not this.

    Raters: from the input embeddings, each visual token's softmax over the text tokens after the
    image (question + chat suffix) is averaged over the visual tokens; the text tokens above the
    mean rate (:func:`text_raters`, once per prompt). After each pruning layer l the visual tokens
    are scored by the attention the raters pay them in layer l (causal softmax of l's own q / k on
    its input rows, mean over heads, then over raters), the top k stay, and of the deleted ones the
    int(0.3 d) + 1 best-scored are recycled: DPC-kNN clusters them into int(that / 10) + 1 tokens,
    each its cluster's mean of the layer-l outputs (:func:`density_peak_merge`), which stay as
    visual tokens for the later layers (``recycle`` = 0.3 and ``cluster_size`` = 10; recycle=0 turns
    recycling off). No proportional attention (the official code has none).

    Counts k, official defaults (no keep / budget): v1.5's ``retained`` setting (192 default, 128,
    64) after layers 2, 6, 15 of 32 (``layers=None`` scales them with depth), k = 300 / 200 / 110
    (192), 303 / 110 / 36 (128), 66 / 30 / 17 (64) of 576 tokens (scaled for other counts), at most
    n - 1; with the recycled tokens 192 leaves 309 / 204 / 113 visual rows (depth average 206.5 on a
    32-layer LLaVA-1.5, 113 reaching the last layer), 128 leaves 312 / 117 / 39, 64 leaves 82 / 32 / 18. ``rank=True`` is the paper's adaptive rule (first version): after layers 2, 6, 15, 19,
    k = int(rank(P) * scale + bias), P the [raters, visual] head-averaged attention (none deleted
    when P has full column rank), (scale, bias) = (13.5, 0) / (9, 6) / (0.8, 0) for 192 / 128 / 64.
    With keep / budget (visual tokens, recycled ones included, reaching the last layer), each stage's
    kept + recycled tokens is the even share of :func:`vlm_prune.methods.adaptinfer.final_counts`
    and the last is the target exactly (:func:`kept_for_total`); with ``rank=True`` the stages before
    the last keep their rank-adaptive count unless it falls below the target.

    As in the official code the recycled tokens follow the kept visual tokens (before the text); each
    holds the slot of one of the last deleted visual rows (its origin and, with positions="keep", its
    position id; :attr:`Reduction.order` moves it after the kept ones, :func:`appended_order`); every
    later layer, its KV cache and so every generate() path (beams, sampling, a continued cache, prompt
    lookup, an assistant model) see the rows in that order (tests/test_generate_matrix.py, recycling on).
    Differences from the official code, by design: the attention rows are computed on the side
    (only the raters' rows), so the model keeps SDPA / FlashAttention; the density ties the
    official code breaks with 1e-6 random noise break by index here, and clusters average exactly
    (official: sum / (count + 1e-6)).
    ``positions``: "renumber" (official LLaVA code: rows renumbered 0..n-1 after each stage, each
    decode step at its layer's own row count) or "keep"; default "renumber" on LLaVA-1.5 / NeXT.
    """

    name = "sparsevlm"
    paper = "SparseVLM, Zhang et al., ICML 2025 (Gumpest/SparseVLMs)"
    summary = "text raters' attention prunes visual tokens at several LLM layers; deleted ones recycled into a few merged tokens"
    budget_note = ("keep / budget = visual tokens reaching the last layer, recycled ones included, exactly; without "
                   "them the official retained=192 schedule (kept 300 / 200 / 110 of 576 after layers 2, 6, 15)")
    own_schedule = True
    needs_previous_hidden = True
    needs_input_rows = True

    def __init__(self, retained: int = 192, rank: bool = False, layers: tuple[int, ...] | list[int] | None = None,
                 scale: float | None = None, bias: float | None = None, recycle: float = 0.3, cluster_size: int = 10,
                 positions: str | None = None, keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        settings = RANK_SETTINGS if rank else SCHEDULE_COUNTS
        if retained not in settings:
            raise ValueError(f"SparseVLM retained must be one of the official settings {sorted(settings)}, got {retained!r}")
        if layers is not None and (not layers or list(layers) != sorted(set(layers)) or min(layers) < 0):
            raise ValueError(f"SparseVLM layers must be distinct increasing layer indices >= 0, got {layers!r}")
        if (scale is not None or bias is not None) and not rank:
            raise ValueError("SparseVLM scale / bias set the rank rule's counts; pass rank=True with them")
        if not 0 <= recycle <= 1:
            raise ValueError(f"SparseVLM recycle (fraction of deleted tokens recycled) must lie in [0, 1], got {recycle!r}")
        if not isinstance(cluster_size, int) or cluster_size < 1:
            raise ValueError(f"SparseVLM cluster_size must be a whole number >= 1, got {cluster_size!r}")
        check_positions("SparseVLM", positions)
        self.retained = retained
        self.rank = rank
        self.layers = list(layers) if layers is not None else None
        default_scale, default_bias = RANK_SETTINGS.get(retained, (None, None))
        self.scale = (scale if scale is not None else default_scale) if rank else None
        self.bias = (bias if bias is not None else default_bias) if rank else None
        self.recycle = recycle
        self.cluster_size = cluster_size
        self.positions = positions
        self._after: list[int] | None = None

    # ---- configuration -----------------------------------------------------------------------
    def check_model(self, adapter: Any) -> None:
        super().check_model(adapter)
        self.positions = staged_positions("SparseVLM", self.positions, adapter)
        cfg = adapter.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.prune_after(text.num_hidden_layers)  # refuse a schedule the model cannot hold at wrap time

    @property
    def renumber_positions(self) -> bool:
        return self.positions == "renumber"

    @property
    def has_target(self) -> bool:
        return self.keep is not None or self.budget is not None

    def prune_after(self, num_layers: int) -> list[int]:
        """0-indexed layers whose attention scores a stage (the drop happens after each)."""
        after = self.layers if self.layers is not None else scaled_after(num_layers, RANK_LAYERS if self.rank else SCHEDULE_LAYERS)
        if after[-1] > num_layers - 2:
            raise ValueError(f"SparseVLM prunes after layers {after}, but the model has only {num_layers} decoder "
                             f"layers (the last pruning layer must be <= {num_layers - 2})")
        if not self.rank and not self.has_target and len(after) != len(SCHEDULE_LAYERS):
            raise ValueError(f"SparseVLM's v1.5 schedule has {len(SCHEDULE_LAYERS)} stages, but it prunes after layers "
                             f"{after} of this {num_layers}-layer model: give {len(SCHEDULE_LAYERS)} layers=, or keep= / "
                             "budget=, or rank=True")
        self._after = list(after)
        return self._after

    def prune_layers(self, num_layers: int) -> list[int]:
        return [layer + 1 for layer in self.prune_after(num_layers)]

    def _stage(self, layer: int) -> int:
        if self._after is None or layer - 1 not in self._after:
            raise ValueError(f"SparseVLM does not prune before layer {layer}; it prunes before "
                             f"{[a + 1 for a in self._after or []]}")
        return self._after.index(layer - 1)

    def n_keep_at(self, layer: int, n_visual_original: int, n_visual_now: int, n_images: int = 1) -> int:
        """Before decoder ``layer``: with keep / budget, the visual rows the stage leaves (kept +
        recycled; with ``rank=True`` the final target, a floor); without, v1.5's kept count (scaled
        to the image's tokens; recycled tokens come on top), or, with ``rank=True``, the rows now
        (the count comes from the attention's rank)."""
        stage, n = self._stage(layer), n_visual_original
        if self.has_target:
            target = self.target_count(n, n_images)
            if self.rank:
                return min(n_visual_now, target)
            return min(n_visual_now, final_counts(n, target, len(self._after))[stage])
        if self.rank:
            return n_visual_now
        count = SCHEDULE_COUNTS[self.retained][stage]
        return min(n_visual_now, round(count * n / REFERENCE_TOKENS))

    # ---- selection ---------------------------------------------------------------------------
    def select(self, ctx: LayerContext) -> list[Reduction]:
        extras = ctx.extras
        previous, project = extras.get("previous_hidden"), extras.get("previous_project_qk")
        if previous is None or project is None or "input_hidden" not in extras:
            raise ValueError("SparseVLM needs the rows entering the scoring layer and layer 0 (an engine built with "
                             "needs_previous_hidden / needs_input_rows); run it through vlm_prune.wrap")
        last = self._after is not None and extras.get("prune_before") == self._after[-1] + 1
        raters = self.rater_rows(ctx)  # [B, S] bool
        n_r = max(1, int(raters.sum(1).max()))
        order = torch.argsort(raters.int(), dim=1, descending=True, stable=True)[:, :n_r]  # raters first, in order
        q, k = project(previous, ctx.positions, rope=True, q_rows=order)
        scale = getattr(ctx.layer_module.self_attn, "scaling", None) or q.shape[-1] ** -0.5
        ar = torch.arange(ctx.valid.shape[1], device=q.device)
        mask = ctx.valid[:, None, :] & (ar[None, None, :] <= order[:, :, None])
        probs = attention_received(q, k, mask, scale)  # [B, R, S], heads averaged
        out = []
        for b in range(ctx.valid.shape[0]):
            valid = torch.nonzero(ctx.valid[b]).squeeze(1)
            vis = torch.nonzero(ctx.visual[b]).squeeze(1)
            n_rows = int(raters[b].sum())
            counts = None
            if vis.numel() and n_rows:
                rel = probs[b, :n_rows][:, vis]  # [raters, visual]
                counts = self.counts(rel, vis.numel(), int(ctx.n_keep[b]), last)
            out.append(Reduction(valid) if counts is None else self.reduce(ctx.hidden[b], valid, vis, rel.mean(0), *counts))
        return out

    def rater_rows(self, ctx: LayerContext) -> torch.Tensor:
        """[B, S] bool: the rows of ``ctx`` that are raters, chosen from the rows entering layer 0."""
        ex = ctx.extras
        hidden, vis_in, text_in, origin_in = ex["input_hidden"], ex["input_visual"], ex["input_text"], ex["input_origin"]
        out = torch.zeros_like(ctx.valid)
        for b in range(ctx.valid.shape[0]):
            if not vis_in[b].any() or not text_in[b].any():
                continue
            chosen = text_raters(hidden[b, vis_in[b]], hidden[b, text_in[b]])
            picked = origin_in[b, text_in[b]][chosen]
            out[b] = ctx.text[b] & torch.isin(ex["origin"][b], picked)
        return out

    def counts(self, probs: torch.Tensor, n: int, n_keep: int, last: bool) -> tuple[int, int] | None:
        """(kept by score, recycled clusters) for one sample with ``n`` visual rows, or None to keep all."""
        ratio, size = self.recycle, self.cluster_size
        if self.rank:
            r = int(torch.linalg.matrix_rank(probs.float()))
            adaptive = None if r == n else min(int(r * self.scale + self.bias), n - 1)
            if not self.has_target:
                return None if adaptive is None else (adaptive, self._clusters(n - adaptive))
            if n_keep >= n or (adaptive is None and not last):  # full rank: nothing deleted before the last stage
                return None
            if adaptive is not None and not last and adaptive + self._clusters(n - adaptive) > n_keep:
                return adaptive, self._clusters(n - adaptive)
            return kept_for_total(n, n_keep, ratio, size)
        if self.has_target:
            return None if n_keep >= n else kept_for_total(n, n_keep, ratio, size)
        k = min(n_keep, n - 1)
        return k, self._clusters(n - k)

    def _clusters(self, n_dropped: int) -> int:
        return recycled_counts(n_dropped, self.recycle, self.cluster_size)[1]

    def reduce(self, hidden: torch.Tensor, valid: torch.Tensor, vis: torch.Tensor, score: torch.Tensor,
               k: int, n_clusters: int) -> Reduction:
        """Keep the top ``k`` visual rows ``vis`` by ``score``, recycle the best-scored deleted ones
        into ``n_clusters`` merged rows at the slots of the last deleted rows; other rows stay."""
        n = vis.numel()
        top = torch.topk(score, k).indices if k else score.new_zeros(0, dtype=torch.long)
        kept = torch.zeros(n, dtype=torch.bool, device=vis.device)
        kept[top] = True
        dropped = torch.nonzero(~kept).squeeze(1)  # ascending, as the official torch.where
        into = torch.full((hidden.shape[0],), -1, dtype=torch.long, device=vis.device)
        others = valid[~torch.isin(valid, vis)]
        into[others] = others
        into[vis[kept]] = vis[kept]
        features = hidden.clone()
        slots = vis.new_zeros(0)
        if n_clusters > 0 and dropped.numel():
            n_recycled = recycled_counts(dropped.numel(), self.recycle, self.cluster_size)[0]
            n_clusters = min(n_clusters, n_recycled)
            members = dropped[torch.topk(score[dropped], n_recycled).indices]  # best first, as the official topk
            cluster, merged = density_peak_merge(hidden[vis[members]], n_clusters)
            slots = vis[dropped[-n_clusters:]]  # the last deleted rows, ascending; cluster j -> slots[j]
            features[slots] = merged.to(hidden.dtype)
            into[vis[members]] = slots[cluster]
        indices = torch.sort(torch.cat([others, vis[kept], slots])).values
        if not slots.numel():  # nothing recycled: a plain keep
            return Reduction(indices)
        return Reduction(indices, features[indices], merged_into=into, order=appended_order(indices, slots, vis[kept], vis))


def appended_order(indices: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """The official row order (:attr:`Reduction.order`): the recycled rows ``slots`` (ascending =
    cluster order) right after the last kept visual row (where the image began when none is kept),
    every other row in index order."""
    key = indices.double()
    if slots.numel():
        anchor = float(kept.max()) if kept.numel() else float(visual.min()) - 1
        rank = torch.searchsorted(indices, slots)
        key[rank] = anchor + torch.arange(1, slots.numel() + 1, dtype=torch.float64, device=key.device) / (slots.numel() + 1)
    return torch.argsort(key)
