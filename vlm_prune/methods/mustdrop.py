"""MustDrop: multi-stage vision token dropping - its vision-encoding (CLIP tower), prefill and decoding stages."""
from __future__ import annotations

import math
from typing import Any

import torch

from vlm_prune.methods.adaptinfer import final_counts, staged_positions
from vlm_prune.methods.base import DecodeKV, LayerContext, LLMMethod, Method, Reduction, check_positions
from vlm_prune.methods.fastv import attention_received, keep_all_rows, keeps_every_visual
from vlm_prune.registry import register
from vlm_prune.vit_blocks import BlockOps, ViTMethod, ViTRun

#: the official scoring layers of LLaVA-1.5-7B's 32 (``pruning_layers``): rows drop after each
OFFICIAL_LAYERS = (2, 6, 10, 14)
OFFICIAL_DEPTH = 32
#: the families whose adapter hosts the vision-encoding stage (one CLIP tower row per image)
TOWER_FAMILIES = ("llava",)
#: the families where MustDrop runs its prefill and decoding stages only (they offer an llm stage)
LLM_ONLY_FAMILIES = ("llava_next", "llava_onevision", "qwen2_vl", "mistral3", "gemma3", "internvl", "llava_next_video",
                     "llava_onevision15", "qwen3_vl", "glm4v", "qwen3_5", "smolvlm", "videollama3")


# ---- the vision-encoding stage (in the CLIP tower) ------------------------------------------------

def window_members(grid: tuple[int, int], window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[G, window**2] long: the patch indices (row-major on ``grid``) of each window x window tile of
    the grid, tiles in row-major order and patches row-major within a tile (the official
    ``unfold`` layout). A grid side that ``window`` does not divide leaves its last rows / columns
    outside every tile (the official code asserts divisibility)."""
    rows, cols = grid
    ids = torch.arange(rows * cols, device=device).reshape(rows, cols)[: rows // window * window, : cols // window * window]
    tiles = ids.unfold(0, window, window).unfold(1, window, window)  # [gh, gw, w, w]
    return tiles.reshape(-1, window * window)


def window_similarity(patches: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """[G] the mean pairwise cosine similarity of the patches [N, D] in each window (``members``
    [G, m]), self-pairs excluded: the sum over the m * (m - 1) ordered pairs, over that count."""
    x = torch.nn.functional.normalize(patches.float(), dim=-1, eps=1e-8)[members]  # [G, m, D]
    sims = x @ x.transpose(-1, -2)
    m = members.shape[1]
    off = 1.0 - torch.eye(m, device=sims.device)
    return (sims * off).sum((-1, -2)) / (m * (m - 1))


def window_merge(patches: torch.Tensor, grid: tuple[int, int], window: int, threshold: float,
                 max_windows: int | None = None) -> tuple[torch.Tensor, int]:
    """MustDrop's spatial merge of one image's patch tokens [N, D] (official ``conditional_pooling``):
    the windows whose mean pairwise cosine is >= ``threshold`` (at most ``max_windows`` of them, the
    most similar) each become one token, the mean of its patches. Returns (into [N] long, K): the
    output token of every patch in the official order - the merged windows first, most similar
    first, then the unmerged patches in index order - and the output count K."""
    n = patches.shape[0]
    members = window_members(grid, window, patches.device)
    into = torch.full((n,), -1, dtype=torch.long, device=patches.device)
    r = 0
    if members.shape[0] and window > 1:
        sim = window_similarity(patches, members)
        r = int((sim >= threshold).sum())
        if max_windows is not None:
            r = max(0, min(r, int(max_windows)))
        if r:
            top = torch.topk(sim, r).indices  # sorted, most similar first (the official topk)
            into[members[top]] = torch.arange(r, device=patches.device)[:, None]
    rest = torch.nonzero(into < 0).squeeze(1)
    into[rest] = torch.arange(r, r + rest.numel(), device=patches.device)
    return into, r + rest.numel()


def key_ranks(cls_attention: torch.Tensor, ratio: float) -> torch.Tensor:
    """[K] long: MustDrop's key set of one image's K tokens by the [CLS] attention they receive: the
    top ceil(ratio * K) ranked 0, 1, ... (most attended first), -1 for the others."""
    k = cls_attention.shape[0]
    left = min(k, math.ceil(ratio * k - 1e-9)) if ratio > 0 else 0
    ranks = torch.full((k,), -1, dtype=torch.long, device=cls_attention.device)
    top = torch.topk(cls_attention.float(), left).indices
    ranks[top] = torch.arange(left, device=cls_attention.device)
    return ranks


class MustDropTower(ViTMethod):
    """MustDrop's vision-encoding stage inside the CLIP tower (wrap() adds it for "mustdrop", whose
    knobs and budget it reads; see :class:`MustDrop`): after encoder layer ``merge_layer`` (official 0)
    the windows of ``window`` x ``window`` patches whose mean pairwise cosine is >= ``merge_thr``
    become their mean; the [CLS] attention of the tower's last layer over the tokens entering it
    (LLaVA's feature layer -2: the feature layer's output) ranks the key set, its top ``key_ratio``."""

    name = "mustdrop"
    paper = "MustDrop, Liu et al., arXiv 2411.10803 (liuting20/MustDrop)"
    own_schedule = True

    def __init__(self, owner: "MustDrop") -> None:
        super().__init__()
        self.owner = owner

    def describe(self) -> dict[str, Any]:
        return {**self.owner.describe(), "stage": self.stage}

    def skipped_on(self, family: str) -> str | None:
        if family in TOWER_FAMILIES:
            return None
        return (f"MustDrop's vision-encoding stage merges in a CLIP tower with one row per image (LLaVA-1.5); "
                f"on {family} only its prefill and decoding stages run")

    @property
    def renumber_positions(self) -> bool:
        """Pack the tower's tokens in the official order and renumber the LLM's rows (owner's "renumber")."""
        return self.owner.positions == "renumber"

    def max_windows(self, n_patches: int, window: int) -> int | None:
        """Windows the merge may fold with keep / budget: never below the target (None: the threshold decides)."""
        o = self.owner
        if o.keep is None and o.budget is None:
            return None
        return max(0, (n_patches - o.target_count(n_patches, 1)) // (window * window - 1))

    def run_block(self, ops: BlockOps, x: torch.Tensor, run: ViTRun) -> torch.Tensor:
        o = self.owner
        bias = None
        if run.pad is not None:
            bias = torch.zeros(run.pad.shape, dtype=x.dtype, device=x.device).masked_fill(~run.pad, -math.inf)
        last = ops.index == ops.depth - 1
        merges_here = ops.index == o.merge_layer
        if last and ops.following is None and not merges_here:  # the feature layer is the tower's last:
            self._key_set(run, ops.cls_attention(x, bias), x)  # its [CLS] attention over its input
        if bias is None:
            x = ops.forward(x)
        else:
            x = x + ops.attention(x, bias=bias[:, None, None, :]).out
            x = x + ops.mlp(x)
        if ops.index == o.merge_layer:
            x = self._merge(x, run)
            if run.pad is not None:
                bias = torch.zeros(run.pad.shape, dtype=x.dtype, device=x.device).masked_fill(~run.pad, -math.inf)
        if last and (ops.following is not None or merges_here):  # the next layer's [CLS] attention over its input
            # (a one-layer tower: the merging layer's own, over the merged tokens)
            self._key_set(run, ops.cls_attention(x, bias, following=ops.following is not None), x)
        return x

    def _merge(self, x: torch.Tensor, run: ViTRun) -> torch.Tensor:
        """Merge every row's windows (each row its own count; rows padded to the longest, ``run.pad``)."""
        o = self.owner
        n_patches = x.shape[1] - 1
        side = math.isqrt(n_patches)
        if side * side != n_patches:
            raise ValueError(f"MustDrop merges windows of a square patch grid; this tower row has {n_patches} patches. "
                             "Wrap with MustDrop(vision=False) to run its prefill and decoding stages only")
        cap = self.max_windows(n_patches, o.window)
        plans = [window_merge(row[1:], (side, side), o.window, o.merge_thr, cap) for row in x]
        width = 1 + max(k for _, k in plans)
        if all(k == n_patches for _, k in plans):
            return x
        b, dev = x.shape[0], x.device
        out = x.new_zeros(b, width, x.shape[-1])
        pad = torch.zeros(b, width, dtype=torch.bool, device=dev)
        members = torch.zeros(b, 1 + n_patches, dtype=torch.long, device=dev)
        slots = torch.zeros(b, width, dtype=torch.long, device=dev)
        for i, (into, k) in enumerate(plans):
            count = torch.zeros(k, device=dev).index_add_(0, into, torch.ones(n_patches, device=dev))
            merged = torch.zeros(k, x.shape[-1], dtype=torch.float32, device=dev).index_add_(0, into, x[i, 1:].float())
            out[i, 0] = x[i, 0]
            out[i, 1: 1 + k] = (merged / count[:, None]).to(x.dtype)
            pad[i, : 1 + k] = True
            members[i, 1:] = into + 1
            if self.renumber_positions:  # the official order, packed into the image's first slots
                slots[i, : 1 + k] = torch.arange(1 + k, device=dev)
            else:  # each token at its own patch's slot (a merged window: its last patch, the official dst)
                own = torch.zeros(k, dtype=torch.long, device=dev).scatter_reduce(
                    0, into, torch.arange(1, 1 + n_patches, device=dev), reduce="amax")
                slots[i, 1: 1 + k] = own
        run.slots, run.members = slots, members
        run.pad = None if bool(pad.all()) else pad
        return out

    def _key_set(self, run: ViTRun, attention: torch.Tensor, x: torch.Tensor) -> None:
        """Rank each row's key set from the [CLS] attention [B, N - 1] over its tokens."""
        protected = torch.full(x.shape[:2], -1, dtype=torch.long, device=x.device)
        for i in range(x.shape[0]):
            k = int(run.pad[i].sum()) - 1 if run.pad is not None else x.shape[1] - 1
            protected[i, 1: 1 + k] = key_ranks(attention[i, :k], self.owner.key_ratio)
        run.protected = protected


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

    Vision-encoding stage (``vision=True``, official clip_encoder.py ``CLIPVisionModelAcc.custom_forward``
    and local_merge.py ``conditional_pooling`` / ``merge_wavg``; :class:`MustDropTower`, run by wrap()
    as the "vit" stage of the same name): after the CLIP tower's first encoder layer (idx 0) the patch
    grid is cut into ``window`` x ``window`` tiles (3 x 3: 64 of LLaVA-1.5's 24 x 24); every tile whose
    mean pairwise cosine similarity (self-pairs excluded) is >= ``merge_thr`` (0.8) becomes one token,
    the mean of its patches; the tower's remaining layers run on the merged tokens, which reach the LLM
    in the official order (merged tiles first, most similar first, then the unmerged patches in
    order). The [CLS] attention of the tower's last layer (idx 23, whose input is LLaVA's feature
    layer -2 output), averaged over heads, ranks the key set: the top ceil(``key_ratio`` (0.08) * K)
    of the K tokens, which the prefill stage never drops (official: ``torch.unique`` of the kept and
    key indices at every scoring layer).
    With keep / budget the vision stage merges at most (N - target) // (window**2 - 1) tiles (the most
    similar above the threshold), so the target stays reachable; the official budgeted settings
    (192 / 128 / 64 tokens) keep the vision stage as it is and change only the prefill thresholds, so
    the LLM stages take the rest of the reduction, in even shares of the image's original count down to
    the target, each stage keeping the key tokens first (by [CLS] rank, when it keeps fewer than the
    key set) and then the best by the filter's score.
    The vision stage runs on LLaVA-1.5 (one CLIP tower row per image, with [CLS]); elsewhere (other
    families, or ``vision=False``, or combined with another image method) MustDrop runs its prefill
    and decoding stages only (``vlm-prune methods``). On LLaVA-1.5 a tower without [CLS] or with
    several feature layers is refused (``vision=False`` runs the other stages).

    Differences from the official code: the official merge count r is the minimum over the tower
    batch (one image at the official batch size 1) and every image here merges its own tiles (rows
    padded and masked in the tower when their counts differ); a grid side the window does not divide
    leaves its last rows / columns unmerged (the official asserts divisibility). The official code
    scores batch row 0 only; here every sample scores its own rows. Text rows are those after a
    sample's last visual row (one image block in the official code). ``positions="keep"`` places each
    tower token at its own patch's slot (a merged tile at its last patch, the official merge target)
    with original position ids instead of the official order.
    """

    name = "mustdrop"
    paper = "MustDrop, Liu et al., arXiv 2411.10803 (liuting20/MustDrop)"
    summary = ("merges similar 3x3 patch windows in the CLIP tower, drops visual tokens by a dual text-attention "
               "filter at four LLM layers (a [CLS]-attended key set kept); decoding attends to the final set")
    budget_note = ("keep / budget = visual tokens reaching the last layer: the tower merge never below the target, "
                   "then an even share per LLM stage; without them the official thresholds (merge 0.8, key set 8%, "
                   "dual-attention 0.001, 0.001) decide the counts")
    family_notes = {f: "prefill and decoding stages only (the vision-encoding stage runs in LLaVA-1.5's CLIP tower)"
                    + ("; decoding trims the full-attention layers' keys only: a recurrent state cannot drop a past row"
                       if f == "qwen3_5" else "") for f in LLM_ONLY_FAMILIES}
    own_schedule = True
    scores_from_previous_layer = True
    #: the tower layer after which the windows merge (official idx 0)
    merge_layer = 0

    def __init__(self, layers: tuple[int, ...] | list[int] | None = None, global_thr: float = 0.001,
                 individual_thr: float = 0.001, decode: bool = True, positions: str | None = None,
                 vision: bool = True, merge_thr: float = 0.8, window: int = 3, key_ratio: float = 0.08,
                 keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        if not isinstance(vision, bool):
            raise ValueError(f"MustDrop vision must be True or False, got {vision!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"MustDrop window is the side of the merged tiles, an integer >= 2, got {window!r}")
        if isinstance(merge_thr, bool) or not isinstance(merge_thr, (int, float)):
            raise ValueError(f"MustDrop merge_thr must be a number (a cosine similarity), got {merge_thr!r}")
        if isinstance(key_ratio, bool) or not isinstance(key_ratio, (int, float)) or not 0 <= key_ratio <= 1:
            raise ValueError(f"MustDrop key_ratio must be a fraction in [0, 1], got {key_ratio!r}")
        self.vision = vision
        self.merge_thr = float(merge_thr)
        self.window = window
        self.key_ratio = float(key_ratio)
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

    def companions(self, others: dict[str, Method]) -> list[Method]:
        """The vision-encoding stage in the tower, unless turned off or another image method is given."""
        if not self.vision or "vision" in others or "vit" in others:
            return []
        return [MustDropTower(self)]

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
        protected = ctx.extras.get("protected")
        for b in range(probs.shape[0]):
            vis = torch.nonzero(ctx.visual[b]).squeeze(1)
            other = torch.nonzero(ctx.valid[b] & ~ctx.visual[b]).squeeze(1)
            rank = protected[b, vis].to(vis.device) if protected is not None else torch.full_like(vis, -1)
            if budgeted:
                score = dual_attention_scores(probs[b, : int(n_text[b])][:, vis], self.global_thr, self.individual_thr)
                k = max(0, min(int(ctx.n_keep[b]), vis.numel()))
                kept = vis[protected_first(score, rank, k)]
            else:
                keep = dual_attention_keep(probs[b, : int(n_text[b])][:, vis], self.global_thr, self.individual_thr)
                kept = vis[keep | (rank >= 0)]  # the key set is never dropped
            out.append(Reduction(torch.sort(torch.cat([other, kept])).values))
        return out


def protected_first(score: torch.Tensor, rank: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` tokens kept: the protected ones (``rank`` >= 0) by rank first, then the
    others by ``score`` (highest first)."""
    keys = torch.nonzero(rank >= 0).squeeze(1)
    keys = keys[torch.argsort(rank[keys], stable=True)][:k]
    free = torch.nonzero(rank < 0).squeeze(1)
    top = free[torch.topk(score[free], max(0, min(k - keys.numel(), free.numel())), sorted=False).indices]
    return torch.cat([keys, top])
