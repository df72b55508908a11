"""ToMe: token merging inside a ViT (Bolya et al., ICLR 2023, "Token Merging: Your ViT but
Faster"; facebookresearch/ToMe@049a705, tome/patch/timm.py and tome/merge.py).

In every block, between the attention and the MLP branch, the WHOLE sequence (prefix tokens
included, as the official code) is split alternately into sets A (even positions) and B (odd
positions); each A token is matched to its most similar B token (cosine similarity of the
block's keys averaged over heads), and the r best-matched A tokens are merged into their B
partners by a size-weighted average. Prefix tokens (CLS, distillation token) are protected:
they are never merged and never receive a merge (the official code's -inf scores). The output
keeps the prefix first, then the unmerged A tokens in order, then the B tokens (the official
order for a CLS token, and for CLS + distillation token). Sizes (how many patches a token
stands for) travel with the tokens, and attention is proportional: log(size) of each key is
added to the attention logits, as an additive bias so the fused attention kernel is kept. The
functions are pure so any ViT adapter can reuse them.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from vlm_prune.methods.base import validate_budget
from vlm_prune.registry import register
from vlm_prune.vit_blocks import BlockOps, ViTMethod, ViTRun, gather_tokens


def max_merges(n_tokens: int, n_prefix: int = 0) -> int:
    """Most tokens one block can merge out of ``n_tokens`` (``n_prefix`` of them protected):
    the official cap (n_tokens - n_prefix) // 2, and no more than the unprotected A tokens."""
    a_free = (n_tokens + 1) // 2 - (n_prefix + 1) // 2
    return max(0, min((n_tokens - n_prefix) // 2, a_free))


def bipartite_matching(
    metric: torch.Tensor, r: int, n_prefix: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bipartite soft matching of tokens metric [B, N, C] (set A = even rows, B = odd rows; the
    first ``n_prefix`` rows are protected).

    Returns (unmerged A rows [B, na - r], merged A rows [B, r], their B partners [B, r]),
    indices into A and B respectively; unmerged rows ascending (the protected A rows first).
    r <= :func:`max_merges`.
    """
    m = metric / metric.norm(dim=-1, keepdim=True)
    a, b = m[:, ::2], m[:, 1::2]
    scores = a @ b.transpose(-1, -2)
    scores[:, : (n_prefix + 1) // 2, :] = -math.inf  # protected A rows merge into nothing
    scores[:, :, : n_prefix // 2] = -math.inf  # protected B rows receive nothing
    best, partner = scores.max(dim=-1)
    order = best.argsort(dim=-1, descending=True, stable=True)
    unmerged = order[:, r:].sort(dim=-1).values
    src = order[:, :r]
    return unmerged, src, partner.gather(1, src)


def merge_tokens(
    x: torch.Tensor, sizes: torch.Tensor, metric: torch.Tensor, r: int, n_prefix: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge r tokens of x [B, N, D] (sizes [B, N]) by bipartite matching on metric [B, N, C],
    the first ``n_prefix`` tokens protected.

    Merged tokens are size-weighted averages; sizes add up. Output order: the prefix, the
    unmerged A tokens, then the B tokens. sum(x * sizes) and sum(sizes) are preserved.
    """
    return merge_matched(x, sizes, *bipartite_matching(metric, r, n_prefix), n_prefix=n_prefix)


def merge_matched(
    x: torch.Tensor, sizes: torch.Tensor, unmerged: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
    n_prefix: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_tokens` for a given matching (the output of :func:`bipartite_matching`)."""
    sizes = sizes.float()
    xs = torch.cat([x.float() * sizes[..., None], sizes[..., None]], dim=-1)
    a, b = xs[:, ::2], xs[:, 1::2]
    b = b.scatter_reduce(1, dst[..., None].expand(-1, -1, b.shape[-1]), gather_tokens(a, src), reduce="sum")
    out = merged_order(xs, unmerged, n_prefix, b_rows=b)
    new_sizes = out[..., -1]
    return (out[..., :-1] / new_sizes[..., None]).to(x.dtype), new_sizes


def merged_order(t: torch.Tensor, unmerged: torch.Tensor, n_prefix: int = 0, b_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token values t [B, N, ...] (e.g. slots) in the order :func:`merge_matched` leaves
    the tokens: the prefix, the unmerged A tokens, then the B tokens (a merged token keeps its
    B value). ``b_rows`` replaces t's B rows (the merged sums)."""
    pa, pb = (n_prefix + 1) // 2, n_prefix // 2
    b = t[:, 1::2] if b_rows is None else b_rows
    return torch.cat([t[:, :n_prefix], gather_tokens(t[:, ::2], unmerged[:, pa:]), b[:, pb:]], dim=1)


def merged_positions(n: int, unmerged: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, n_prefix: int = 0) -> torch.Tensor:
    """[B, n] where each of n tokens lands in :func:`merge_matched`'s output for a matching
    (a merged A token: where its B partner lands)."""
    ids = torch.arange(n, device=src.device).expand(src.shape[0], n)
    order = merged_order(ids, unmerged, n_prefix)  # the token at each output place
    dest = torch.empty_like(ids).scatter_(1, order, torch.arange(order.shape[1], device=src.device).expand_as(order))
    return dest.scatter_(1, 2 * src, dest.gather(1, 2 * dst + 1))


@functools.lru_cache(maxsize=64)
def merge_schedule(n_patches: int, n_prefix: int, depth: int, target: int) -> tuple[int, ...]:
    """Tokens to merge in each of ``depth`` blocks so that ``n_patches`` patch tokens end at
    ``target``: an even share of the remaining merges per block (earlier blocks take the
    remainder), raised where the later blocks' half-per-block cap would otherwise leave the
    target out of reach, and capped by :func:`max_merges`. Ends above the target only when
    even the maximum merges cannot reach it (see :func:`reachable_tokens`)."""
    out, cur = [], n_patches
    for blk in range(depth):
        left = depth - blk
        cap = max_merges(n_prefix + cur, n_prefix)
        r = min(cap, max(0, -(-(cur - target) // left)))
        while r < cap and reachable_tokens(cur - r, n_prefix, left - 1) > target:
            r += 1
        out.append(r)
        cur -= r
    return tuple(out)


def reachable_tokens(n_patches: int, n_prefix: int, depth: int) -> int:
    """Fewest patch tokens ``depth`` blocks of ToMe can leave of ``n_patches`` (each block
    merges at most :func:`max_merges`)."""
    for _ in range(depth):
        n_patches -= max_merges(n_prefix + n_patches, n_prefix)
    return n_patches


def proportional_bias(sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log(size) of each key as an additive attention bias [B, 1, 1, N]."""
    return sizes.log().to(dtype)[:, None, None, :]


@register
class ToMe(ViTMethod):
    """ToMe (Bolya et al., ICLR 2023, arXiv 2210.09461; facebookresearch/ToMe@049a705): merge r
    tokens per block by bipartite soft matching on keys over the whole sequence (CLS protected,
    the official split), with size-weighted averages and proportional attention (``prop_attn``,
    default True). Give one of:
      - ``r``: tokens merged in every block (the paper's knob, reproduces the official code;
        r=0 is the unchanged model),
      - ``keep`` / ``budget``: the patch tokens left after the last block (per image: the tokens
        that reach the tower's output), the same meaning as for every other method. The merges
        are spread over the blocks by :func:`merge_schedule`.
    A block merges at most half of its tokens (the official cap), so d blocks cannot go below
    about N / 2**d tokens: a smaller target is warned once by ``wrap()`` with the reachable value
    (:meth:`budget_warning`), and the model then ends at that value.
    """

    name = "tome"
    paper = "ToMe, Bolya et al., ICLR 2023 (arXiv 2210.09461)"
    own_schedule = True

    def __init__(self, r: int | None = None, keep: float | None = None, budget: int | None = None, prop_attn: bool = True):
        super().__init__(keep=keep, budget=budget)
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ValueError(f"ToMe r is the number of tokens merged per block, an integer >= 0; got {r!r}")
        self.r = r
        self.prop_attn = prop_attn

    def configure_budget(self, keep: float | None, budget: int | None) -> None:
        keep = self.keep if self.keep is not None else keep
        budget = self.budget if self.budget is not None else budget
        if self.r is not None and (keep is not None or budget is not None):
            raise ValueError("ToMe takes either r= (tokens merged per block) or keep= / budget=, not both")
        self.keep, self.budget = validate_budget(keep, budget, required=self.r is None, method=self.name)

    def merges(self, block: int, depth: int, n_patches: int, n_prefix: int = 1, target: int | None = None) -> int:
        """Tokens to merge in ``block`` (before the per-block cap for a given ``r``); ``target``:
        the patch tokens to end with (default keep / budget of ``n_patches``)."""
        if self.r is not None:
            return self.r
        target = self.n_keep(n_patches, 1) if target is None else target
        return merge_schedule(n_patches, n_prefix, depth, target)[block]

    def budget_warning(self, adapter: Any) -> str | None:
        """The reachable patch count when keep / budget asks for fewer than ``adapter.depth``
        blocks can leave (each merges at most half its tokens); None when the target is reachable."""
        if self.r is not None:
            return None
        n_prefix, n_patches = adapter.vit_tokens()
        target = self.n_keep(n_patches, 1)
        floor = reachable_tokens(n_patches, n_prefix, adapter.depth)
        tiles = super().budget_warning(adapter)
        if target >= floor:
            return tiles
        note = (
            f"tome: {adapter.depth} blocks merge at most half of their tokens each, so {n_patches} patch tokens "
            f"cannot go below {floor} per image; asked for {target}, the model keeps {floor}"
        )
        return note if tiles is None else f"{note} (per tile); {tiles}"

    def run_block(self, ops: BlockOps, x: torch.Tensor, run: ViTRun) -> torch.Tensor:
        p = run.n_prefix
        target = None if self.r is not None else self.patch_target(run)
        r = min(self.merges(ops.index, ops.depth, run.n_patches, p, target), max_merges(x.shape[1], p))
        if run.sizes is not None and run.sizes.shape[1] != x.shape[1]:
            raise RuntimeError(
                f"ToMe: block {ops.index} got {x.shape[1]} tokens but the previous block left "
                f"{run.sizes.shape[1]}; run the wrapped ViT's blocks in order, from block 0"
            )
        if r == 0 and run.sizes is None:
            return ops.forward(x)
        bias = proportional_bias(run.sizes, x.dtype) if self.prop_attn and run.sizes is not None else None
        a = ops.attention(x, bias=bias)
        x = x + a.out
        if r > 0:
            sizes = run.sizes if run.sizes is not None else torch.ones(x.shape[:2], device=x.device)
            match = bipartite_matching(a.k.mean(dim=1), r, p)
            x, run.sizes = merge_matched(x, sizes, *match, n_prefix=p)
            run.slots = merged_order(run.token_slots(x.shape[0], x.device), match[0], p)
            n = sizes.shape[1]  # which tokens merged into which, composed over the blocks (last_stats)
            members = run.members if run.members is not None else torch.arange(n, device=x.device).expand(x.shape[0], n)
            run.members = merged_positions(n, *match, p).gather(1, members)
        return x + ops.mlp(x)
