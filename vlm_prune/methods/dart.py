"""DART: keep the visual tokens least duplicated by a few pivot tokens, inside the LLM."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import LayerContext, LLMMethod, Reduction
from vlm_prune.methods.fastv import keep_all_rows, keeps_every_visual
from vlm_prune.registry import register


def per_pivot_counts(n_pivots: int, n_image_pivots: int, target: int) -> tuple[int, list[int]]:
    """(image pivots kept, tokens each pivot picks) so that image pivots + picks = ``target``:
    the picks split evenly, the first (target - image pivots) % n_pivots pivots one more."""
    kept_pivots = min(n_image_pivots, target)
    rest = max(0, target - kept_pivots)
    base, extra = divmod(rest, max(1, n_pivots))
    return kept_pivots, [base + (1 if i < extra else 0) for i in range(n_pivots)]


def dart_select(keys: torch.Tensor, feats: torch.Tensor, image: torch.Tensor, text: torch.Tensor,
                n_image_pivots: int, n_text_pivots: int, target: int | None, per_pivot: int) -> torch.Tensor:
    """DART's kept image rows (ascending) of one sample.

    keys: [S, H*d] layer K-1's keys (RoPE applied, heads flattened); feats: [S, D] the rows entering
    layer K after the model's final norm; image / text: [S] bool rows (text: every row after the
    image). Pivots: the ``n_image_pivots`` image rows and ``n_text_pivots`` text rows of largest key
    L1 norm. Visiting the pivots in the order of a Python set of their indices (the official loop),
    each takes, among the image rows not yet taken and not an image pivot, the ones of LOWEST cosine
    similarity to itself: ``per_pivot`` each (official), or with a ``target`` the counts of
    :func:`per_pivot_counts`. Kept: image pivots + every row taken (text pivots never are).
    Indices are the sample's row indices; the caller maps them.
    """
    img_idx = torch.nonzero(image).squeeze(1)
    txt_idx = torch.nonzero(text).squeeze(1)
    l1 = keys.float().abs().sum(-1)
    p_img = img_idx[torch.topk(l1[img_idx], min(n_image_pivots, img_idx.numel())).indices].tolist()
    p_txt = txt_idx[torch.topk(l1[txt_idx], min(n_text_pivots, txt_idx.numel())).indices].tolist()
    pivots = list(set(p_img + p_txt))  # the official iteration order
    if target is None:
        kept_pivots, counts = len(p_img), [per_pivot] * len(pivots)
    else:
        kept_pivots, counts = per_pivot_counts(len(pivots), len(p_img), target)
        if kept_pivots < len(p_img):  # a target below the image pivots: the strongest of them only
            return torch.sort(torch.tensor(p_img[:kept_pivots], dtype=torch.long)).values
    free = image.clone()
    free[p_img] = False
    fn = F.normalize(feats.float(), dim=-1)
    taken = []
    for p, c in zip(pivots, counts):
        cand = torch.nonzero(free).squeeze(1)
        c = min(c, cand.numel())
        if c == 0:
            continue
        pick = cand[torch.topk(-(fn[cand] @ fn[p]), c).indices]
        free[pick] = False
        taken.append(pick)
    out = torch.cat([torch.tensor(p_img, dtype=torch.long, device=keys.device)] + taken)
    return torch.sort(out).values


def from_first_row(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Positions ([B, S] or [P, B, S]) shifted so that each sample's first valid row is at 0, as the
    official batch-1 code numbers them: the L1 norm of a rotated key depends on its absolute position,
    so a caller's left-padding offset must not change the pivots."""
    first = valid.long().argmax(dim=1)  # [B]
    pos = positions if positions.dim() == 3 else positions[None]
    start = torch.gather(pos, 2, first[None, :, None].expand(pos.shape[0], -1, 1))
    out = pos - start
    return out if positions.dim() == 3 else out[0]


@register
class DART(LLMMethod):
    """DART (Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models:
    Duplication Matters More", arXiv 2502.11494; ZichenWen1/DART, read at Zichen Wen's last commit
    9fee9fa1 of llava/model/language_model/modeling_llama_self.py (``DART.forward`` and
    ``get_retained_image_token``) in its mirror xqy1111111/DART, and scripts/v1_5/eval/*.sh).

    Before decoder layer ``layer`` (K, default 2): pivots are the ``pivot_image`` (4) image tokens
    and ``pivot_text`` (4) tokens after the image with the largest L1 norm of layer K-1's keys (RoPE
    applied, all heads); each pivot, in the official loop's order, keeps the image tokens LEAST
    similar (cosine of the rows entering layer K after the model's final norm, as the official code)
    to it among those not yet kept (:func:`dart_select`). Kept tokens keep their original position
    ids (the official code's ``position_ids = keep_indexs``); decode continues from the unpruned
    length. Keys come from layer K-1's own projections on its input, computed on the side, so the
    model keeps SDPA / FlashAttention, rotated at positions counted from each sample's first row
    (the official batch-1 numbering; :func:`from_first_row`).
    Budget: with keep / budget, image pivots + picks = the target exactly (picks split evenly over
    the pivots, :func:`per_pivot_counts`). Without: the official scripts' ``max_num_trunction`` 128,
    i.e. 128 // 8 = 16 picks per pivot plus the 4 image pivots (132 of LLaVA-1.5's 576 tokens).
    """

    name = "dart"
    paper = "DART, Wen et al., arXiv 2502.11494 (ZichenWen1/DART)"
    summary = "keeps the visual tokens least similar to a few pivot tokens (duplication-aware), inside the LLM"
    budget_note = ("keep / budget = image pivots + picks, exactly; without them the official max_num_trunction "
                   "128: 16 picks per pivot + 4 image pivots (132 of 576)")
    own_schedule = True
    needs_previous_hidden = True

    def __init__(self, layer: int = 2, pivot_image: int = 4, pivot_text: int = 4, max_num_trunction: int = 128,
                 keep: float | None = None, budget: int | None = None) -> None:
        super().__init__(keep=keep, budget=budget)
        if not isinstance(layer, int) or layer < 1:
            raise ValueError(f"DART layer K must be an integer >= 1 (keys come from layer K-1), got {layer!r}")
        for knob, value in (("pivot_image", pivot_image), ("pivot_text", pivot_text)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"DART {knob} must be a whole number >= 0, got {value!r}")
        if pivot_image + pivot_text < 1:
            raise ValueError("DART needs at least one pivot (pivot_image + pivot_text >= 1)")
        if not isinstance(max_num_trunction, int) or max_num_trunction < 0:
            raise ValueError(f"DART max_num_trunction must be a whole number >= 0, got {max_num_trunction!r}")
        self.layer = layer
        self.pivot_image = pivot_image
        self.pivot_text = pivot_text
        self.max_num_trunction = max_num_trunction

    def prune_layers(self, num_layers: int) -> list[int]:
        if self.layer >= num_layers:
            raise ValueError(f"DART layer K={self.layer} but the model has only {num_layers} decoder layers; "
                             f"pass layer= below {num_layers}")
        return [self.layer]

    def select(self, ctx: LayerContext) -> list[Reduction]:
        has_target = self.keep is not None or self.budget is not None
        if has_target and keeps_every_visual(ctx):
            return keep_all_rows(ctx)
        previous, project = ctx.extras.get("previous_hidden"), ctx.extras.get("previous_project_qk")
        norm = ctx.extras.get("final_norm")
        if previous is None or project is None or norm is None:
            raise ValueError("DART needs the rows entering layer K-1 and the final norm (an engine built with "
                             "needs_previous_hidden); run it through vlm_prune.wrap")
        b, s = ctx.valid.shape
        _, _, k = project(previous, from_first_row(ctx.positions, ctx.valid), rope="keys",
                          q_rows=torch.zeros(b, 1, dtype=torch.long, device=ctx.valid.device))
        keys = k.transpose(1, 2).reshape(b, s, -1)
        with torch.no_grad():
            feats = norm(ctx.hidden)
        per_pivot = self.max_num_trunction // (self.pivot_image + self.pivot_text)
        out = []
        for i in range(b):
            valid = torch.nonzero(ctx.valid[i]).squeeze(1)
            image, text = ctx.visual[i][valid], ctx.text[i][valid]
            target = int(ctx.n_keep[i]) if has_target else None
            kept = valid[dart_select(keys[i, valid], feats[i, valid], image, text, self.pivot_image,
                                     self.pivot_text, target, per_pivot).to(valid.device)]
            other = valid[~image]
            out.append(Reduction(torch.sort(torch.cat([other, kept])).values))
        return out
