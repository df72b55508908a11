"""ToMe: token merging inside a ViT (Bolya et al., ICLR 2023, "Token Merging: Your ViT but
Faster"; facebookresearch/ToMe).

In every block, between the attention and the MLP branch, the patch tokens are split
alternately into sets A and B; each A token is matched to its most similar B token (cosine
similarity of the block's keys averaged over heads), and the r best-matched A tokens are
merged into their B partners by a size-weighted average. Sizes (how many patches a token
stands for) travel with the tokens, and attention is proportional: log(size) of each key is
added to the attention logits, as an additive bias so the fused attention kernel is kept.
The CLS token (and any other prefix token) is never merged. The functions are pure so any
ViT adapter can reuse them.
"""
from __future__ import annotations

import torch

from vlm_prune.methods.base import validate_budget
from vlm_prune.registry import register
from vlm_prune.vit_blocks import BlockOps, ViTMethod, ViTRun, gather_tokens


def bipartite_matching(metric: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bipartite soft matching of tokens metric [B, N, C] (set A = even rows, B = odd rows).

    Returns (unmerged A rows [B, na - r], merged A rows [B, r], their B partners [B, r]),
    indices into A and B respectively; unmerged rows ascending. r <= N // 2.
    """
    m = metric / metric.norm(dim=-1, keepdim=True)
    a, b = m[:, ::2], m[:, 1::2]
    best, partner = (a @ b.transpose(-1, -2)).max(dim=-1)
    order = best.argsort(dim=-1, descending=True)
    unmerged = order[:, r:].sort(dim=-1).values
    src = order[:, :r]
    return unmerged, src, partner.gather(1, src)


def merge_tokens(
    x: torch.Tensor, sizes: torch.Tensor, metric: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge r tokens of x [B, N, D] (sizes [B, N]) by bipartite matching on metric [B, N, C].

    Merged tokens are size-weighted averages; sizes add up. Output order: the unmerged A
    tokens, then all B tokens. sum(x * sizes) and sum(sizes) are preserved.
    """
    return merge_matched(x, sizes, *bipartite_matching(metric, r))


def merge_matched(
    x: torch.Tensor, sizes: torch.Tensor, unmerged: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_tokens` for a given matching (the output of :func:`bipartite_matching`)."""
    sizes = sizes.float()
    xs = torch.cat([x.float() * sizes[..., None], sizes[..., None]], dim=-1)
    a, b = xs[:, ::2], xs[:, 1::2]
    b = b.scatter_reduce(1, dst[..., None].expand(-1, -1, b.shape[-1]), gather_tokens(a, src), reduce="sum")
    out = torch.cat([gather_tokens(a, unmerged), b], dim=1)
    new_sizes = out[..., -1]
    return (out[..., :-1] / new_sizes[..., None]).to(x.dtype), new_sizes


def merged_order(t: torch.Tensor, unmerged: torch.Tensor) -> torch.Tensor:
    """Per-token values t [B, N, ...] (e.g. slots) in the order :func:`merge_matched` leaves
    the tokens: the unmerged A tokens, then the B tokens (a merged token keeps its B value)."""
    return torch.cat([gather_tokens(t[:, ::2], unmerged), t[:, 1::2]], dim=1)


def proportional_bias(sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log(size) of each key as an additive attention bias [B, 1, 1, N]."""
    return sizes.log().to(dtype)[:, None, None, :]


@register
class ToMe(ViTMethod):
    """ToMe (Bolya et al., ICLR 2023, arXiv 2210.09461; facebookresearch/ToMe): merge r
    tokens per block by bipartite soft matching on keys, with size-weighted averages and
    proportional attention (``prop_attn``, default True). Give one of:
      - ``r``: tokens merged in every block (the paper's knob; r=0 is the unchanged model),
      - ``keep``: fraction of patch tokens left after the last block,
      - ``budget``: patch tokens left after the last block.
    keep / budget spread the N - target merges evenly over the blocks (earlier blocks take
    the remainder). A block merges at most half of its patch tokens, as in the paper, so a
    very small target may not be reached; ``last_stats["vit"]`` shows the real counts.
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

    def merges(self, block: int, depth: int, n_patches: int) -> int:
        """Tokens to merge in ``block`` before the half-of-the-tokens cap."""
        if self.r is not None:
            return self.r
        target = self.budget if self.budget is not None else int(self.keep * n_patches + 1e-6)
        total = max(0, n_patches - max(1, min(n_patches, target)))
        return total // depth + (1 if block < total % depth else 0)

    def run_block(self, ops: BlockOps, x: torch.Tensor, run: ViTRun) -> torch.Tensor:
        p = run.n_prefix
        r = min(self.merges(ops.index, ops.depth, run.n_patches), (x.shape[1] - p) // 2)
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
            match = bipartite_matching(a.k.mean(dim=1)[:, p:], r)
            merged, new_sizes = merge_matched(x[:, p:], sizes[:, p:], *match)
            slots = run.token_slots(x.shape[0], x.device)
            run.slots = torch.cat([slots[:, :p], merged_order(slots[:, p:], match[0])], dim=1)
            x = torch.cat([x[:, :p], merged], dim=1)
            run.sizes = torch.cat([sizes[:, :p], new_sizes], dim=1)
        return x + ops.mlp(x)
