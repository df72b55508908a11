"""QuoTA: query-oriented frame-level token assignment (Luo et al., arXiv 2503.08689;
official code MAC-AutoML/QuoTA).

Pipeline: (1) optional chain-of-thought query decoupling into a list of physical objects;
(2) one yes/no prompt per frame, p_t = P("A") from the scorer; (3) weights w_t = (100 p_t)^2,
normalised; (4) n_t = floor(N w_t) tokens per frame, frames with n_t = 0 drop; (5) each kept
frame's token map is resized to its budget (v1 bilinear, v2 adaptive average pooling, v3 uniform
subsampling, v4 token merging).

The functions here are pure (tensors and strings in, tensors and strings out); :class:`QuoTA`
is the frames-stage Method that strings them together on a :class:`FramesContext`.
"""
from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register

VARIANTS = ("v1", "v2", "v3", "v4")
_ANSWER_SUFFIX = "A. yes B. no\nAnswer with the option's letter directly."


# ---- 1. query decoupling --------------------------------------------------------------------
def decouple_prompt(query: str) -> str:
    """The three-step chain-of-thought prompt that turns a question into objects to look for."""
    return (
        f"{query}\n"
        "Before answering, work out which objects would have to be found in the video, in three steps.\n"
        'Step 1: Does answering need specific physical objects to be detected? Reply only "yes" or "no".\n'
        "Step 2: If yes, list every object that should be detected, as a Python list of strings.\n"
        "Step 3: From the Step 2 list keep only physical entities (no colours, places, actions or "
        "abstract ideas) and output them as a Python list of strings; if nothing is left, output null.\n"
        "Answer in exactly this format, for example:\n"
        "Step 1: yes\n"
        'Step 2: ["red kite", "beach", "windy"]\n'
        'Step 3: ["red kite"]\n'
        "If Step 1 is no, write only:\n"
        "Step 1: no"
    )


_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})
_STEP = re.compile(r"step\s*([123])\s*[:.)\-\u2013]*", re.IGNORECASE)
_NULL = {"", "null", "none", "nil", "n/a", "nothing", "[]"}


def parse_decoupled_objects(answer: str) -> list[str]:
    """The objects of Step 3 of a decoupling answer; [] when Step 1 says no or nothing parses.

    Tolerates markdown (``**Step 3:**``), curly quotes, code fences, a bare comma-separated
    list instead of a Python list, and text around the list. Duplicates are dropped.
    """
    text = (answer or "").translate(_QUOTES).replace("`", "").replace("*", "")
    steps: dict[str, str] = {}
    marks = list(_STEP.finditer(text))
    for mark, nxt in zip(marks, marks[1:] + [None]):
        steps.setdefault(mark.group(1), text[mark.end(): nxt.start() if nxt else len(text)].strip())
    first = steps.get("1", "").lower()
    if re.match(r"no\b", first):
        return []
    body = steps.get("3")
    if body is None:
        return []
    bracket = re.search(r"\[(.*?)\]", body, re.DOTALL)
    if bracket:
        items = _list_items(bracket.group(0))
    else:
        line = body.splitlines()[0] if body else ""
        items = line.split(",")
    out: list[str] = []
    for item in items:
        name = item.strip().strip("'\"").strip().rstrip(".").strip()
        if name.lower() not in _NULL and name not in out:
            out.append(name)
    return out


def _list_items(literal: str) -> list[str]:
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return literal[1:-1].split(",")
    if not isinstance(value, (list, tuple)):
        return []
    return [v for v in value if isinstance(v, str)]


# ---- 2. frame scoring prompt ----------------------------------------------------------------
def frame_prompt(query: str | None, objects: list[str]) -> str:
    """The per-frame yes/no question: about the objects when there are any, else the query."""
    if objects:
        return f"Does the image contain any object of {', '.join(objects)}? {_ANSWER_SUFFIX}"
    question = f"{query}\n" if query else ""
    return f"{question}Does the image contain sufficient information to answer the given question? {_ANSWER_SUFFIX}"


# ---- 3-4. weights and token allocation ------------------------------------------------------
def frame_weights(p: torch.Tensor, scale: float = 100.0, power: float = 2.0) -> torch.Tensor:
    """w_t = (scale * p_t)^power normalised to sum 1 (float64); all-zero scores give equal weights."""
    w = (scale * p.detach().double().clamp(min=0)) ** power
    total = w.sum()
    if not torch.isfinite(total) or total <= 0:
        return torch.full_like(w, 1.0 / max(1, w.numel()))
    return w / total


def cap_weights(w: torch.Tensor, cap: float) -> torch.Tensor:
    """Cap every weight at ``cap`` and hand the excess to the uncapped frames in proportion to
    their weights (equally when they all weigh 0), repeating until none exceeds the cap."""
    w = w.double().clone()
    if cap * w.numel() <= 1.0:
        return torch.full_like(w, cap)
    for _ in range(w.numel()):
        over = w > cap + 1e-15
        if not bool(over.any()):
            break
        excess = float((w[over] - cap).sum())
        w[over] = cap
        free = w < cap - 1e-15
        share = w[free]
        w[free] = share + excess * (share / share.sum() if share.sum() > 0 else 1.0 / share.numel())
    return w


def allocate_tokens(w: torch.Tensor, n_total: int, cap: int | None = None) -> torch.Tensor:
    """n_t = floor(n_total * w_t) (LongTensor); with ``cap``, at most cap tokens per frame.

    sum(n_t) <= n_total whenever sum(w) <= 1.
    """
    n = torch.floor(n_total * w.double() + 1e-9).long()
    return n.clamp(max=cap) if cap is not None else n


def grid_for(n: int) -> tuple[int, int]:
    """QuoTA's grid for n tokens: h = w = floor(sqrt(n)), then h + 1 if it fits, else w + 1 if it fits."""
    h = w = math.isqrt(n)
    if h * w < n:
        if (h + 1) * w <= n:
            h += 1
        elif h * (w + 1) <= n:
            w += 1
    return h, w


# ---- 5. per-frame resize --------------------------------------------------------------------
def merge_tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """ToMe bipartite soft matching (Bolya et al., 2023) of [N, D] tokens down to n tokens.

    Each round splits the tokens alternately into A (even) and B (odd), matches every A token to
    its most cosine-similar B token, and merges the r most similar A tokens into their matches by
    size-weighted averaging (r <= |A|, so several rounds may be needed). Survivors keep the
    original token order.
    """
    x = x.float()
    size = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    while x.shape[0] > max(n, 1):
        a, b, sa, sb = x[0::2], x[1::2], size[0::2], size[1::2]
        r = min(x.shape[0] - max(n, 1), a.shape[0])
        sim = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).t()
        best, match = sim.max(dim=-1)
        order = torch.argsort(best, descending=True, stable=True)
        src, keep = order[:r], order[r:]
        total_b = (b * sb[:, None]).index_add(0, match[src], a[src] * sa[src, None])
        sb = sb.index_add(0, match[src], sa[src])
        b = total_b / sb[:, None]
        pos = torch.cat([2 * keep, 2 * torch.arange(b.shape[0], device=x.device) + 1])
        order = torch.argsort(pos)
        x, size = torch.cat([a[keep], b])[order], torch.cat([sa[keep], sb])[order]
    return x


def resize_frame(tokens: torch.Tensor, grid: tuple[int, int], n: int, variant: str) -> torch.Tensor:
    """One frame's [rows*cols, D] token map reduced (or, for v1, possibly enlarged) to <= n tokens.

    v1: bilinear interpolation to grid_for(n) (align_corners=False). v2: adaptive average
    pooling to grid_for(n), clamped to the native grid. v3: n tokens evenly spaced over the
    row-major sequence. v4: ToMe merging to n tokens. Output rows are in row-major order.
    """
    rows, cols = grid
    d = tokens.shape[-1]
    if variant in ("v1", "v2"):
        h, w = grid_for(n)
        if variant == "v2":
            h, w = min(h, rows), _v2_width(grid, n)
        fmap = tokens.float().t().reshape(1, d, rows, cols)
        if variant == "v1":
            out = F.interpolate(fmap, size=(h, w), mode="bilinear", align_corners=False)
        else:
            out = F.adaptive_avg_pool2d(fmap, (h, w))
        return out[0].reshape(d, h * w).t().to(tokens.dtype)
    if variant == "v3":
        idx = torch.linspace(0, tokens.shape[0] - 1, n, device=tokens.device).round().long()
        return tokens[idx]
    if variant == "v4":
        return merge_tokens(tokens, n).to(tokens.dtype)
    raise ValueError(f"QuoTA variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


def quota_plan(
    features: torch.Tensor,
    grid: tuple[int, int],
    n_total: int,
    scores: torch.Tensor,
    variant: str = "v1",
    scale: float = 100.0,
    power: float = 2.0,
) -> FramesPlan:
    """Allocate ``n_total`` tokens over the [T, N, D] frame features from frame scores p [T].

    v2-v4 cannot add tokens to a frame, so their weights are capped at N / n_total and the excess
    is redistributed (:func:`cap_weights`); v1 (bilinear) may upsample a frame beyond N. When the
    floors leave every frame at 0 tokens (n_total < T with flat scores), the best frame gets
    them all. The result fills the first slots of the T * N frame-major slots in frame order.
    """
    t, n_native, _ = features.shape
    if scores.numel() != t:
        raise ValueError(f"QuoTA needs one score per frame: got {scores.numel()} scores for {t} frames")
    w = frame_weights(scores, scale, power)
    cap = None
    if variant != "v1":
        w = cap_weights(w, n_native / n_total)
        cap = n_native
    n = allocate_tokens(w, n_total, cap)
    if int(n.sum()) == 0:
        n[int(torch.argmax(w))] = min(n_total, n_native) if cap else n_total
    pieces, per_frame, coords = [], [0] * t, []
    for i in torch.nonzero(n).flatten().tolist():
        piece = resize_frame(features[i], grid, int(n[i]), variant)
        pieces.append(piece)
        per_frame[i] = piece.shape[0]
        coords.append(frame_coords(i, grid, int(n[i]), piece.shape[0], variant))
    kept = torch.cat(pieces)
    reduction = Reduction(torch.arange(kept.shape[0], device=features.device), features=kept)
    return FramesPlan(
        reduction=reduction,
        kept_frames=[i for i, k in enumerate(per_frame) if k > 0],
        tokens_per_frame=per_frame,
        frame_scores=scores.detach().float().cpu(),
        token_coords=torch.cat(coords),
    )


def frame_coords(frame: int, grid: tuple[int, int], n: int, count: int, variant: str) -> torch.Tensor:
    """(frame, row, col) of the ``count`` tokens :func:`resize_frame` returns for one frame.

    v1 / v2: the resized grid, row-major. v3: each subsampled token's own place in the native
    grid. v4 (merged tokens have no place of their own): row-major over rows of width
    grid_for(n)[1] (our choice).
    """
    rows, cols = grid
    if variant in ("v1", "v2"):
        width = grid_for(n)[1] if variant == "v1" else _v2_width(grid, n)
        k = torch.arange(count)
        return torch.stack([torch.full_like(k, frame), k // width, k % width], 1)
    if variant == "v3":
        idx = torch.linspace(0, rows * cols - 1, n).round().long()
        return torch.stack([torch.full_like(idx, frame), idx // cols, idx % cols], 1)
    width = grid_for(n)[1]
    k = torch.arange(count)
    return torch.stack([torch.full_like(k, frame), k // width, k % width], 1)


def _v2_width(grid: tuple[int, int], n: int) -> int:
    """The width :func:`resize_frame` pools to in v2 (grid_for(n) clamped to the native grid)."""
    rows, cols = grid
    h, w = grid_for(n)
    h = min(h, rows)
    return min(w, cols, n // h)


Scorer = Callable[[torch.Tensor, str], torch.Tensor]


@register
class QuoTA(FramesMethod):
    """QuoTA (arXiv 2503.08689): query-oriented token assignment over a video's frames.

    Knobs (defaults from the paper / official code):
      variant="v1": how a frame map is resized - v1 bilinear (may upsample), v2 adaptive
        average pooling, v3 uniform subsampling, v4 ToMe merging (v4 skips the official 2x2
        pre-pooling).
      decouple=True: ask ``ctx.generate_text`` the chain-of-thought decoupling prompt first
        (skipped when the context has no generator).
      scorer=None: p_t from ``ctx.score_frames`` (the wrapped model, P("A") of the yes/no
        prompt); or a callable (pixels [T, C, H, W], prompt: str) -> p [T] in [0, 1], given
        the frame-scoring prompt text (e.g. an image-text encoder's cosine mapped to [0, 1]).
      weight_scale=100, weight_power=2: w_t = (weight_scale p_t)^weight_power.
    Budget: ctx.n_total, i.e. floor(keep * T * N) or ``budget`` tokens per video. Without a
    query every frame scores 1 (uniform allocation).
    """

    name = "quota"
    paper = "QuoTA, arXiv 2503.08689"

    def __init__(
        self,
        keep: float | None = None,
        budget: int | None = None,
        variant: str = "v1",
        decouple: bool = True,
        scorer: Scorer | None = None,
        weight_scale: float = 100.0,
        weight_power: float = 2.0,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if variant not in VARIANTS:
            raise ValueError(f"QuoTA variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if scorer is not None and not callable(scorer):
            raise TypeError("QuoTA scorer must be a callable (pixels [T, C, H, W], prompt) -> p [T]")
        self.variant = variant
        self.decouple = decouple
        self.weight_scale = weight_scale
        self.weight_power = weight_power
        self._scorer = scorer

    def scoring_prompt(self, ctx: FramesContext) -> str:
        """The frame prompt for this query, after decoupling when enabled and possible."""
        objects: list[str] = []
        if self.decouple and ctx.generate_text is not None and ctx.query:
            objects = parse_decoupled_objects(ctx.generate_text(decouple_prompt(ctx.query)))
        return frame_prompt(ctx.query, objects)

    @property
    def needs_processor(self) -> bool:
        """The default scorer (the wrapped model) builds its prompts with the processor."""
        return self._scorer is None

    def frame_scores(self, ctx: FramesContext) -> torch.Tensor:
        """p [T] in [0, 1] for the frames of ``ctx``."""
        t = ctx.features.shape[0]
        if not ctx.query and self._scorer is None:
            return torch.ones(t)
        prompt = self.scoring_prompt(ctx)
        if self._scorer is not None:
            if ctx.pixels is None:
                raise ValueError("QuoTA's custom scorer needs the frames' pixels, but the context has none")
            p = self._scorer(ctx.pixels, prompt)
        elif ctx.score_frames is not None:
            p = ctx.score_frames([prompt])
        else:
            raise ValueError(
                "QuoTA needs a frame scorer: wrap the model with its processor so it can score frames "
                "itself, or pass QuoTA(scorer=callable(pixels, prompt) -> p [T])"
            )
        p = torch.as_tensor(p).detach().float().flatten().cpu()
        if p.numel() != t:
            raise ValueError(f"QuoTA's scorer returned {p.numel()} scores for {t} frames")
        return p

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        return quota_plan(
            ctx.features, ctx.grid, ctx.n_total, self.frame_scores(ctx),
            self.variant, self.weight_scale, self.weight_power,
        )
