"""DyCoke's first stage, temporal token merging (TTM) (Tao et al., CVPR 2025, "DyCoke: Dynamic
Compression of Tokens for Fast Video Large Language Models"; official code
KD-TAO/DyCoke@dd7463498203479d0ff6f2d29c4e72928c0af244, ``llava/model/llava_arch.py`` ``dycole_ttm``).

Its second stage, dynamic KV-cache pruning during decoding (``llava/model/language_model/
modeling_qwen2.py`` ``PrunableDynamicCache.dycoke_pruning`` / ``update_cache`` and the decoder loop of
``Qwen2Model.forward``), runs on the engine's decode-time KV pruning (docs/decode-kv.md) with
``decode_pruning=True``: see :func:`dycoke_step`.

Stage: frames, on the projected (and pooled) frame tokens; kept tokens stay at their slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_prune.frames.uniform import whole_video
from vlm_prune.frames.vidcom2 import apportion
from vlm_prune.methods.base import DecodeKV, DecodeStepContext, FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register


def ttm_references(t: int) -> list[int | None]:
    """The frame each frame is compared with (None: kept whole), as the official TTM: in each pair
    (i, i + 1), i even, frame i + 1 against frame i; then in each group of four starting at i
    (i < t - 4), frame i + 2 against frame i. An odd last frame, which the official drops, is
    compared with the frame before it here."""
    ref: list[int | None] = [None] * t
    for i in range(0, t - 1, 2):
        ref[i + 1] = i
    for i in range(0, t - 4, 4):
        ref[i + 2] = i
    if t % 2 and t > 1:
        ref[t - 1] = t - 2
    return ref


def ttm_plan(features: torch.Tensor, n_total: int) -> FramesPlan:
    """TTM on frame tokens [T, N, D]: pivot frames (no reference) keep every token; each other frame
    keeps the tokens least similar (cosine, same slot) to its reference frame, the counts
    apportioned so the video keeps n_total (at least the pivot frames' tokens)."""
    t, n, _ = features.shape
    ref = ttm_references(t)
    reduced = [i for i in range(t) if ref[i] is not None]
    pivots = t - len(reduced)
    share = max(0, n_total - pivots * n)
    counts = apportion([share / max(1, len(reduced))] * len(reduced), share, cap=n, at_least_one=False)
    per_frame = [n] * t
    keep = []
    for i in range(t):
        if ref[i] is None:
            keep.append(torch.arange(n, device=features.device) + i * n)
            continue
        k = counts[reduced.index(i)]
        per_frame[i] = k
        if k:
            sim = F.cosine_similarity(F.normalize(features[i].float(), dim=-1),
                                      F.normalize(features[ref[i]].float(), dim=-1), dim=-1)
            keep.append(torch.topk(sim, k, largest=False).indices.sort().values + i * n)
    return FramesPlan(Reduction(torch.cat(keep)), [i for i in range(t) if per_frame[i]], per_frame)


def dycoke_step(attention: torch.Tensor, visual: torch.Tensor, previous: torch.Tensor | None, p: float,
                threshold: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of DyCoke's dynamic KV pruning for a batch: (keep [B, kv] bool, the visual
    attention to remember [B, kv]).

    ``attention`` [B, kv]: the new token's head-averaged attention in layer L - 1 over its keys;
    ``visual`` [B, kv]: the visual keys; ``previous`` [B, k <= kv]: the last step's remembered visual
    attention (None at the first step). As the official code, which sets its visual span to the TTM
    output less its last token (``image_token_length = image_feature.size()[0] - 1``): each sample's
    last visual key is never pruned and the other n - 1 are scored; a sample whose attention over them
    has a cosine similarity below ``threshold`` (0.9) to the last step's (the first step counts as 0)
    keeps only its top int((n - 1) (1 - p)) of them in layers L.. for this step; otherwise this step
    attends to the whole cache. The remembered attention is always the current one."""
    last = visual.long().cumsum(1) == visual.sum(1, keepdim=True)
    visual = visual & ~last  # the last visual key of each sample stays, outside the scored span
    current = torch.where(visual, attention.float(), 0.0)
    b, kv = current.shape
    if previous is None:
        similarity = torch.zeros(b, device=current.device)
    else:
        past = torch.zeros_like(current)
        past[:, : previous.shape[1]] = previous.to(current.device)
        similarity = F.cosine_similarity(current, past, dim=1)
    keep = torch.ones(b, kv, dtype=torch.bool, device=current.device)
    for i in torch.nonzero(similarity < threshold).squeeze(1).tolist():
        cols = torch.nonzero(visual[i]).squeeze(1)
        n_keep = int(cols.numel() * (1 - p))
        keep[i, cols] = False
        keep[i, cols[torch.topk(current[i, cols], n_keep, sorted=False).indices]] = True
    return keep, current


@register
class DyCoke(DecodeKV, FramesMethod):
    """DyCoke's temporal token merging (CVPR 2025; KD-TAO/DyCoke@dd74634): in every pair of frames
    the second keeps only the tokens that differ most (lowest cosine, slot by slot) from the first,
    and in every group of four the third likewise against the first; the other frames (pivots) keep
    every token. Tokens stay at their slots, in slot order, with their original position ids (the
    official concatenates a compared frame's tokens in score order and numbers them anew); nothing is
    averaged (the official "merging" drops the similar tokens). See :func:`ttm_plan`.

    Decode stage (``decode_pruning=True``; off by default so that the budget alone decides what the
    LLM sees): at every single-token decode step the new token's head-averaged attention in layer
    ``layer`` - 1 (L = 3, the official ``dycoke_l``) over the cached keys is compared with the last
    step's (cosine over the visual keys but the last); when it changed (similarity < 0.9, and at the
    first step) the layers from L on attend, in this step only, to the last visual key and the top
    int((n - 1) (1 - ``p``)) of the other n - 1 by that attention (the official's visual span ends one
    token early; its last token is the last its TTM emits, here the last kept slot; ``p`` = 0.8, the official ``dycoke_p`` default; its README's example uses 0.7); in
    a step whose attention did not change they attend to the whole cache (the official code clears its
    selection at every step and sets it only when the attention changed). The cache keeps every entry,
    so a later step may choose others (:func:`dycoke_step`). Unlike the official code (batch row 0, one
    remembered attention shared by every request), each sample scores and remembers its own, and a new
    prompt on the cache starts afresh. generate() with an assistant model, prompt lookup or
    use_cache=False is refused (they verify or recompute several tokens per step). Runs on every video
    family (LLaVA-OneVision, Qwen2-VL / 2.5-VL, Qwen3-VL, GLM-4.1V, Qwen3.5, whose L - 1 must be a
    full-attention layer); tested against the official rule (tests/test_dycoke_decode.py) and in the
    generate() matrix.
    Budget: the official k follows from the budget: the pivots keep N tokens each and the compared
    frames share the rest (within a token of each other). The official evaluation (its lmms-eval
    model and README) runs ``dycoke_k=0.7``: a compared frame keeps int(0.3 N) tokens, so at 32 frames
    of 196 tokens (9 pivots, 23 compared) the video keeps 9 x 196 + 23 x 58 = 3,098 tokens:
    ``budget=3098`` (or ``keep=0.494``) reproduces that run's counts (``load_pretrained_model``'s
    default k = 0.3 keeps int(0.7 N) = 137 per compared frame: ``budget=4915``).
    Pivots are about T / 4 + 1 of T frames, so a budget below their tokens cannot be met by
    TTM alone (the official reaches lower only through the decode-time pruning): the video then
    keeps the pivots whole (wrap() warns; last_stats has the count). An odd last frame, which the
    official drops, is compared with its predecessor.
    """

    name = "dycoke"
    paper = "DyCoke, CVPR 2025 (arXiv 2411.15024)"

    def __init__(self, keep: float | None = None, budget: int | None = None, decode_pruning: bool = False,
                 layer: int = 3, p: float = 0.8, threshold: float = 0.9) -> None:
        super().__init__(keep, budget)
        if not isinstance(decode_pruning, bool):
            raise ValueError(f"dycoke decode_pruning must be True or False, got {decode_pruning!r}")
        if not isinstance(layer, int) or layer < 1:
            raise ValueError(f"dycoke layer L must be an integer >= 1 (it reads layer L - 1's attention), got {layer!r}")
        if not 0 <= p < 1:
            raise ValueError(f"dycoke p (the share of visual KV entries pruned per step) must lie in [0, 1), got {p!r}")
        self.decode_pruning = decode_pruning
        self.layer = layer
        self.p = float(p)
        self.threshold = float(threshold)

    @property
    def decode_kv(self) -> bool:  # type: ignore[override]
        return self.decode_pruning

    def decode_step_layer(self, num_layers: int) -> int | None:
        if self.layer >= num_layers:
            raise ValueError(f"dycoke prunes the KV cache from layer L={self.layer}, but the model has only {num_layers} "
                             "decoder layers; pass a smaller layer")
        return self.layer - 1

    def decode_step(self, ctx: DecodeStepContext) -> torch.Tensor | None:
        keep, ctx.state["attention"] = dycoke_step(ctx.attention, ctx.visual & ctx.valid, ctx.state.get("attention"),
                                                   self.p, self.threshold)
        return keep

    def check_generate(self, kwargs: dict, config) -> None:
        if not self.decode_pruning:
            return
        for knob in ("assistant_model", "prompt_lookup_num_tokens"):
            if kwargs.get(knob, getattr(config, knob, None)) is not None:
                raise ValueError(f"dycoke decode_pruning=True chooses the KV entries one generated token at a time, which "
                                 f"generate({knob}=...) skips by verifying several tokens per step. Generate without "
                                 f"{knob}, or wrap with decode_pruning=False")
        if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
            raise ValueError("dycoke decode_pruning=True prunes the KV cache, which generate(use_cache=False) does not keep. "
                             "Generate with the cache (the default), or wrap with decode_pruning=False")

    def budget_warning(self, adapter) -> str | None:
        if self.keep is not None and float(self.keep) >= 1.0:
            return None
        return ("dycoke keeps its pivot frames (about T / 4 + 1 of T frames) whole, as the official TTM; a video whose "
                "budget is below their tokens keeps them all and ends above the budget (the official goes lower only "
                "through decode-time KV pruning, decode_pruning=True, which the budget does not count); last_stats "
                "gives the count reached per video")

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        whole = whole_video(ctx)
        return whole if whole is not None else ttm_plan(ctx.features, ctx.n_total)
