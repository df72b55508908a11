"""QuoTA: query-oriented frame-level token assignment (Luo et al., arXiv 2503.08689).

Checked against the official code: MAC-AutoML/QuoTA, read through its mirror fzm121516/QuoTA
(``core/llava_arch.py`` at ff208ec890f57759bd5826ef561ba7a2f97498ea: ``token_compress``,
``scale_weights``; ``quota_pipeline.py`` and ``tools/qwen2vl_batch.py`` at
00cbb09ceff84fa23decf5908e8d283116582b16: prompts, decoupling, scorer; ``core/merge.py`` at
fdc321a2a8f8b8473c8f6c2d878cb88370b20408: ToMe). The implementation is ours.

Pipeline: (1) chain-of-thought query decoupling into a list of physical objects (the
three-example prompt, answer lower-cased, Step 1 must say yes); (2) one yes/no prompt per frame,
p_t = P("A") from the scorer; (3) weights w_t = (100 p_t)^2, normalised; (4) n_t = int(N w_t)
tokens per frame (truncation, as the official), frames with n_t = 0 drop; (5) each kept frame's
map is resized to its budget:

- v1 bilinear interpolation to grid_for(n_t) (may upsample; uncapped)
- v2 adaptive average pooling, v3 n_t indices ``linspace(0, M-1, n_t)`` truncated (``.long()``),
  v5 ToMe along each row to the grid width, then along each column to its height
- v4 ToMe merging of the model's *pooled* map (official: 2x2 pooling first) to n_t tokens

v1, v2, v3, v5 work on the frame's UNPOOLED map where the model pools (LLaVA-OneVision / LLaVA-Video:
the 27 x 27 projected SigLIP tokens, not HF's 14 x 14), so a high-score frame gets real detail.
v2-v5 cap each frame at its map's size with the official one-pass redistribution
(:func:`cap_weights`), which can leave part of the budget unspent.

The pure functions here take tensors and strings; :class:`QuoTA` is the frames-stage Method.
"""
from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlm_prune.methods.base import FramesContext, FramesMethod, FramesPlan, Reduction
from vlm_prune.registry import register

VARIANTS = ("v1", "v2", "v3", "v4", "v5")
#: variants that resize the frame's unpooled map (official); v4 merges the pooled map
UNPOOLED_VARIANTS = ("v1", "v2", "v3", "v5")


# ---- 1. query decoupling --------------------------------------------------------------------
#: The official decoupling instructions, appended to the user's question (text only). The text
#: is a model input, so it is reproduced as published (typos and indentation included).
_DECOUPLE_LINES = (
    "",
    "To answer this question, please follow the following step to give an object list for object detection.",
    'Step 1: Do you think it is necessary to detect specific physical entities in the video? Please only answer "yes" or "no" in this step.',
    "Step 2: If 'yes' in previous step, then what object in the video do you think needs to be detected to answer this question? "
    "Please only output the name of all the objects need to detect in the form of a Python list without other information.",
    "Step 3: Filter the object list provided in step 2, make sure they are physical entities, not abstract concepts. "
    "Please only output the name of the filtered object in the form of a Python list without other information. "
    "If all the words being filtered, please only output null.",
    "# Example 1:",
    "Question: How many blue balloons are over the long table in the middle of the room at the end of this video? "
    "A. 1. B. 2. C. 3. D. 4.",
    "Your output should be:",
    "Step 1: yes",
    'Step 2: ["blue ballons", "long table", "video", "blue"]',
    'Step 3: ["blue ballons", "long table"]',
    "# Example 2:",
    "Question: In the lower left corner of the video, what color is the woman wearing on the right side of the man "
    "in black clothes? A. Blue. B. White. C. Red. D. Yellow.",
    "Your output should be:",
    "Step 1: yes",
    'Step 2: ["the man in black", "woman", "lower left corner"]',
    'Step 3: ["the man in black", "woman"]',
    "# Example 3:",
    "Question: In which country is the comedy featured in the video recognized worldwide? "
    "A. China. B. UK. C. Germany. D. United States.",
    "Your output should be:",
    "Step 1: no",
)
DECOUPLE_INSTRUCTIONS = _DECOUPLE_LINES[0] + "\n" + _DECOUPLE_LINES[1] + "".join("\n    " + s for s in _DECOUPLE_LINES[2:])
#: the official cap on the decoupling answer's length (generation also stops once it parses)
DECOUPLE_MAX_NEW_TOKENS = 4096


def decouple_prompt(query: str) -> str:
    """The official three-step chain-of-thought prompt (three examples) for ``query``."""
    return query + DECOUPLE_INSTRUCTIONS


_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})
_STEP = re.compile(r"step\s*([123])\s*[:.)\-\u2013]*", re.IGNORECASE)
_NULL = {"", "null", "none", "nil", "n/a", "nothing", "[]"}


def _steps(answer: str) -> dict[str, str]:
    text = (answer or "").lower().translate(_QUOTES).replace("`", "").replace("*", "")
    steps: dict[str, str] = {}
    marks = list(_STEP.finditer(text))
    for mark, nxt in zip(marks, marks[1:] + [None]):
        steps.setdefault(mark.group(1), text[mark.end(): nxt.start() if nxt else len(text)].strip())
    return steps


def parse_decoupled_objects(answer: str) -> list[str]:
    """The lower-cased objects of Step 3 of a decoupling answer; [] unless Step 1 says yes.

    As the official parser (``step 1: (yes|no)`` then the ``step 3: [...]`` list, on the
    lower-cased answer), and also tolerant of markdown (``**Step 3:**``), curly quotes, code
    fences, a bare comma-separated list and text around it. Duplicates are dropped.
    """
    steps = _steps(answer)
    if not re.match(r"yes\b", steps.get("1", "")):
        return []
    body = steps.get("3")
    if body is None:
        return []
    bracket = re.search(r"\[(.*?)\]", body, re.DOTALL)
    items = _list_items(bracket.group(0)) if bracket else (body.splitlines()[0] if body else "").split(",")
    out: list[str] = []
    for item in items:
        name = item.strip().strip("'\"").strip().rstrip(".").strip().lower()
        if name not in _NULL and name not in out:
            out.append(name)
    return out


def decoupling_finished(answer: str) -> bool:
    """True once a decoupling answer can no longer change what :func:`parse_decoupled_objects`
    returns: Step 1 said no, or Step 3 holds a closed list or null (generation may stop)."""
    steps = _steps(answer)
    first = steps.get("1", "")
    if re.match(r"no\b", first):
        return True
    third = steps.get("3")
    return third is not None and ("]" in third or third.startswith("null"))


def _list_items(literal: str) -> list[str]:
    try:  # the answer was lower-cased: a bare none / null is Python's None again
        value = ast.literal_eval(re.sub(r"(?<!['\"\w])(none|null)(?![\w'\"])", "None", literal))
    except (ValueError, SyntaxError):
        return literal[1:-1].split(",")
    if not isinstance(value, (list, tuple)):
        return []
    return [v for v in value if isinstance(v, str)]


# ---- 2. frame scoring prompt ----------------------------------------------------------------
@dataclass(frozen=True)
class FramePrompts:
    """The per-frame question and the answer tokens read from the scorer's next-token distribution.

    objects: template with ``{objects}`` (the decoupled objects joined by ", ").
    query: template with ``{query}`` (the user's question), used when there are no objects.
    answer: the token whose probability is the frame score (official: "A").
    versus: optional second token; then p = P(answer) / (P(answer) + P(versus)).
    Defaults: the official prompts, "A. yes, B. no", P("A").
    """

    objects: str = "Does the image contain any object of {objects}? A. yes, B. no\nAnswer with the option's letter directly."
    query: str = ("{query}\nDoes the image contain sufficient information to answer the given question? "
                  "A. yes, B. no\nAnswer with the option's letter directly.")
    answer: str = "A"
    versus: str | None = None

    @property
    def tokens(self) -> list[str]:
        return [self.answer] + ([self.versus] if self.versus is not None else [])

    def score(self, probs: torch.Tensor) -> torch.Tensor:
        """p [T] from the scorer's probabilities [T, len(tokens)] of :attr:`tokens`."""
        probs = probs.float()
        if self.versus is None:
            return probs[:, 0]
        return probs[:, 0] / (probs[:, 0] + probs[:, 1]).clamp(min=1e-30)


OFFICIAL_PROMPTS = FramePrompts()
#: a yes/no scorer prompt in plain words, for models whose vocabulary has no option letters
#: (the shipped synthetic video model): "is there a {objects} ?", P(yes) / (P(yes) + P(no))
PLAIN_PROMPTS = FramePrompts(objects="is there a {objects} ?", query="{query}", answer="yes", versus="no")


def frame_prompt(query: str | None, objects: list[str], prompts: FramePrompts = OFFICIAL_PROMPTS) -> str:
    """The per-frame question: about the objects when there are any, else about the query."""
    if objects:
        return prompts.objects.format(objects=", ".join(objects))
    text = prompts.query.format(query=query or "")
    return text.lstrip("\n") if not query else text


# ---- 3-4. weights and token allocation ------------------------------------------------------
def frame_weights(p: torch.Tensor, scale: float = 100.0, power: float = 2.0) -> np.ndarray:
    """w_t = (scale p_t)^power normalised to sum 1, in float64 as the official (numpy);
    all-zero scores give equal weights."""
    w = np.array([(scale * max(0.0, float(x))) ** power for x in p.detach().double().cpu().tolist()], dtype=np.float64)
    total = w.sum(axis=0)
    if not np.isfinite(total) or total <= 0:
        return np.full(w.shape, 1.0 / max(1, w.size))
    return w / total


def cap_weights(w: np.ndarray, cap: float) -> np.ndarray:
    """The official ``scale_weights``: one pass that caps every weight at ``cap``, then one pass
    in frame order that adds ``w_i / S * excess`` to each uncapped frame (S: the sum after
    capping, capped frames included), capping again and growing the excess as it goes.

    The shares add up to less than the excess, so a capped video under-spends its budget.
    """
    w = np.array(w, dtype=np.float64)
    excess = 0.0
    for i in range(w.size):
        if w[i] > cap:
            excess += w[i] - cap
            w[i] = cap
    if excess > 0:
        total = w.sum()
        for i in range(w.size):
            if w[i] < cap:
                w[i] += (w[i] / total) * excess
                if w[i] > cap:
                    excess += w[i] - cap
                    w[i] = cap
    return w


def allocate_tokens(w: np.ndarray, n_total: int) -> list[int]:
    """n_t = int(n_total w_t): truncation, as the official (float error can cost a token)."""
    return [int(n_total * float(x)) for x in w]


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
def tome_round(x: torch.Tensor, r: int) -> torch.Tensor:
    """One round of ToMe bipartite soft matching (Bolya et al., 2023) as QuoTA's v4 / v5 run it.

    x [N, D]: A = even rows, B = odd rows; each A row's best cosine match in B; the r (at most
    N // 2) best-matched A rows are averaged into their B rows with equal weights (sizes are not
    carried between rounds). Returns [unmerged A rows by descending match score, all B rows].
    """
    r = min(r, x.shape[0] // 2)
    if r <= 0:
        return x
    unit = x / x.norm(dim=-1, keepdim=True)
    best, match = (unit[0::2] @ unit[1::2].t()).max(dim=-1)
    order = torch.argsort(best, descending=True, stable=True)
    src, unmerged = order[:r], order[r:]
    a, b = x[0::2], x[1::2]
    total = b.index_add(0, match[src], a[src])
    count = torch.ones(b.shape[0], dtype=x.dtype, device=x.device).index_add(
        0, match[src], torch.ones(r, dtype=x.dtype, device=x.device))
    return torch.cat([a[unmerged], total / count[:, None]])


def tome_merge(x: torch.Tensor, n: int) -> torch.Tensor:
    """[N, D] merged down to n tokens by rounds of :func:`tome_round`."""
    while x.shape[0] > max(n, 1):
        x = tome_round(x, x.shape[0] - max(n, 1))
    return x


def resize_frame(tokens: torch.Tensor, grid: tuple[int, int], n: int, variant: str) -> torch.Tensor:
    """One frame's [rows*cols, D] row-major map reduced (v1: possibly enlarged) to <= n tokens.

    v1 bilinear (align_corners=False) / v2 adaptive average pooling to grid_for(n); v3 rows
    ``linspace(0, N-1, n).long()``; v4 ToMe to n tokens; v5 ToMe along rows to the grid width,
    then along columns to its height. v2 / v5 clamp the grid to the map (only non-square maps,
    e.g. Qwen2-VL, can need it).
    """
    rows, cols = grid
    d = tokens.shape[-1]
    if variant == "v3":
        return tokens[torch.linspace(0, tokens.shape[0] - 1, n).long().to(tokens.device)]
    if variant == "v4":
        return tome_merge(tokens.float(), n).to(tokens.dtype)
    h, w = out_grid(grid, n, variant)
    if variant == "v5":
        fmap = tokens.float().reshape(rows, cols, d)
        by_row = torch.stack([tome_merge(fmap[i], w) for i in range(rows)])  # [rows, w, D]
        out = torch.stack([tome_merge(by_row[:, j], h) for j in range(w)], dim=1)  # [h, w, D]
        return out.reshape(h * w, d).to(tokens.dtype)
    fmap = tokens.float().t().reshape(1, d, rows, cols)
    if variant == "v1":
        out = F.interpolate(fmap, size=(h, w), mode="bilinear", align_corners=False)
    elif variant == "v2":
        out = F.adaptive_avg_pool2d(fmap, (h, w))
    else:
        raise ValueError(f"QuoTA variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return out[0].reshape(d, h * w).t().to(tokens.dtype)


def out_grid(grid: tuple[int, int], n: int, variant: str) -> tuple[int, int]:
    """The (h, w) a frame of ``grid`` given n tokens is resized to (v1, v2, v5)."""
    h, w = grid_for(n)
    if variant == "v1":
        return h, w
    rows, cols = grid
    h = min(h, rows)
    return h, min(w, cols, n // h)


def frame_coords(frame: int, grid: tuple[int, int], n: int, count: int, variant: str) -> torch.Tensor:
    """(frame, row, col) of the ``count`` tokens :func:`resize_frame` returns for one frame.

    v1 / v2 / v5: the resized grid, row-major. v3: each subsampled token's place in the map.
    v4 (merged tokens have no place of their own): row-major over rows of width
    grid_for(n)[1] (our choice).
    """
    rows, cols = grid
    if variant == "v3":
        idx = torch.linspace(0, rows * cols - 1, n).long()
        return torch.stack([torch.full_like(idx, frame), idx // cols, idx % cols], 1)
    width = grid_for(n)[1] if variant == "v4" else out_grid(grid, n, variant)[1]
    k = torch.arange(count)
    return torch.stack([torch.full_like(k, frame), k // width, k % width], 1)


def quota_plan(
    features: torch.Tensor,
    grid: tuple[int, int],
    n_total: int,
    scores: torch.Tensor,
    variant: str = "v1",
    scale: float = 100.0,
    power: float = 2.0,
    slots: int | None = None,
) -> FramesPlan:
    """Allocate ``n_total`` tokens over the frame maps ``features`` [T, M, D] (grid rows x cols)
    from frame scores p [T], as the official ``token_compress``.

    v2-v5 cap every weight at M / n_total (:func:`cap_weights`); v1 may upsample a frame beyond
    M. When every frame floors to 0 tokens (n_total < T, flat scores) the best frame gets them
    all (the official would fail). The kept tokens fill the first of the video's ``slots``
    (default T * M) frame-major slots in frame order; n_total must not exceed ``slots``.
    """
    t, m, _ = features.shape
    slots = t * m if slots is None else slots
    if scores.numel() != t:
        raise ValueError(f"QuoTA needs one score per frame: got {scores.numel()} scores for {t} frames")
    if n_total > slots:
        raise ValueError(f"QuoTA's budget {n_total} exceeds the video's {slots} token slots")
    w = frame_weights(scores, scale, power)
    if variant != "v1":
        w = cap_weights(w, m / n_total)
    n = allocate_tokens(w, n_total)
    if sum(n) == 0:
        n[int(np.argmax(w))] = n_total if variant == "v1" else min(n_total, m)
    pieces, per_frame, coords = [], [0] * t, []
    for i, k in enumerate(n):
        if k <= 0:
            continue
        piece = resize_frame(features[i], grid, k, variant)
        pieces.append(piece)
        per_frame[i] = piece.shape[0]
        coords.append(frame_coords(i, grid, k, piece.shape[0], variant))
    kept = torch.cat(pieces)
    reduction = Reduction(torch.arange(kept.shape[0], device=features.device), features=kept)
    return FramesPlan(
        reduction=reduction,
        kept_frames=[i for i, k in enumerate(per_frame) if k > 0],
        tokens_per_frame=per_frame,
        frame_scores=scores.detach().float().cpu(),
        token_coords=torch.cat(coords),
    )


Scorer = Callable[[torch.Tensor, str], torch.Tensor]

#: adapter families whose videos give every temporal slice its own run of slots behind its own
#: timestamp text (Qwen3-VL, GLM-4.xV, Qwen3.5): QuoTA's packing cannot place resized frames there
SLICED_VIDEO_FAMILIES = ("qwen3_vl", "glm4v", "qwen3_5")


@register
class QuoTA(FramesMethod):
    """QuoTA (arXiv 2503.08689): query-oriented token assignment over a video's frames.

    Knobs (defaults from the official code, MAC-AutoML/QuoTA; commits in the module docstring):
      variant="v1": v1 bilinear (may upsample), v2 adaptive average pooling, v3 uniform
        subsampling, v4 ToMe on the pooled map, v5 ToMe along rows then columns. v1/v2/v3/v5
        resize the unpooled map where the model pools (LLaVA-OneVision: 27 x 27, not 14 x 14).
      decouple=True: first ask the model (text only, unpruned) the official decoupling prompt;
        generation stops as soon as the answer parses (cap: 4096 new tokens, as the official).
      scorer=None: who scores the frames. The OFFICIAL scorer is a separate Qwen2-VL-2B-Instruct
        that sees each raw frame as an image; get it with
        ``QuoTA(scorer=vlm_scorer(qwen2_vl_2b, qwen_processor))`` (vlm_prune.frames.vlm_scorer).
        The default (None) is cheaper: the wrapped model itself, unpruned, re-using the frame
        features it already computed (no second vision-tower pass), one frame per prompt, all
        frames in one batch, logits of the last position only. Any callable
        (pixels [T, C, H, W], prompt) -> p [T] in [0, 1] also works.
      score_grid=(7, 7): the default scorer sees each frame map resized (bilinear) to at most this
        grid, so scoring costs well under what pruning saves (LLaVA-OneVision-7B, 32 frames, vision
        tower counted: 0.35 of the unpruned prefill's FLOPs with (7, 7), 0.90 with None = the full
        14 x 14 map; decoupling adds about 0.06); see :func:`scorer_flops`.
      prompts=OFFICIAL_PROMPTS: the frame question and the answer token (P("A") after
        "A. yes, B. no"). ``PLAIN_PROMPTS`` asks "is there a {objects} ?" and reads P(yes) vs
        P(no), for vocabularies without option letters (the shipped synthetic video model).
      objects=None: a callable query -> list of objects replacing the generated decoupling.
      weight_scale=100, weight_power=2: w_t = (weight_scale p_t)^weight_power.
    Budget: keep / budget = visual tokens of the video reaching the language model; the official
    truncation, grid rule and cap can leave some unspent (wrap() warns; ``last_stats`` shows what
    was kept). keep=1.0 (a budget of the whole video) changes nothing and scores nothing; the
    paper's same-budget setting is a budget below the sampled tokens (64 x 196 tokens over 96
    frames: keep 0.667). Without a query every frame scores 1 (uniform allocation).
    """

    name = "quota"
    paper = "QuoTA, arXiv 2503.08689"
    resizes_frames = True

    def __init__(
        self,
        keep: float | None = None,
        budget: int | None = None,
        variant: str = "v1",
        decouple: bool = True,
        scorer: Scorer | None = None,
        score_grid: tuple[int, int] | None = (7, 7),
        prompts: FramePrompts = OFFICIAL_PROMPTS,
        objects: Callable[[str], list[str]] | None = None,
        weight_scale: float = 100.0,
        weight_power: float = 2.0,
    ) -> None:
        super().__init__(keep=keep, budget=budget)
        if variant not in VARIANTS:
            raise ValueError(f"QuoTA variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if scorer is not None and not callable(scorer):
            raise TypeError("QuoTA scorer must be a callable (pixels [T, C, H, W], prompt) -> p [T]")
        if objects is not None and not callable(objects):
            raise TypeError("QuoTA objects must be a callable query -> list of object names")
        if not isinstance(prompts, FramePrompts):
            raise TypeError("QuoTA prompts must be a vlm_prune.frames.quota.FramePrompts")
        if score_grid is not None and (len(score_grid) != 2 or min(score_grid) < 1):
            raise ValueError(f"QuoTA score_grid must be (rows, cols) >= 1 or None, got {score_grid!r}")
        self.variant = variant
        self.decouple = decouple
        self.score_grid = tuple(score_grid) if score_grid is not None else None
        self.weight_scale = weight_scale
        self.weight_power = weight_power
        self._scorer = scorer
        self._prompts = prompts
        self._objects = objects

    @classmethod
    def for_processor(cls, processor, **knobs) -> "QuoTA":
        """QuoTA whose default scorer speaks the model's vocabulary: the official prompts when the
        tokenizer has "A"; else :data:`PLAIN_PROMPTS` without decoupling (a model without option
        letters cannot follow the decoupling prompt either), e.g. the shipped synthetic video model.
        ``knobs`` go to the constructor and win. ValueError when neither vocabulary fits."""
        from vlm_prune.frames.scorers import vocab_id

        tokenizer = getattr(processor, "tokenizer", processor)
        for prompts, extra in ((OFFICIAL_PROMPTS, {}), (PLAIN_PROMPTS, {"decouple": False})):
            try:
                for token in prompts.tokens:
                    vocab_id(tokenizer, token)
            except ValueError:
                continue
            return cls(**{"prompts": prompts, **extra, **knobs})
        raise ValueError("the tokenizer has neither the answer letter 'A' nor the words 'yes' and 'no': give QuoTA "
                         "FramePrompts in its own words, or another scorer (scorer=vlm_scorer(other_model, processor))")

    @property
    def needs_processor(self) -> bool:
        """The default scorer (the wrapped model) builds its prompts with the processor."""
        return self._scorer is None

    @property
    def wants_unpooled(self) -> bool:
        """Whether the adapter should hand over the frames' unpooled maps (v1, v2, v3, v5)."""
        return self.variant in UNPOOLED_VARIANTS

    @classmethod
    def refusal(cls, family: str, stages: tuple[str, ...]) -> str | None:
        """The stage rule, and the families whose video QuoTA's packing cannot lay out."""
        reason = super().refusal(family, stages)
        if reason is None and family in SLICED_VIDEO_FAMILIES:
            reason = (
                f"method 'quota' supports videos laid out as one run of slots; the '{family}' adapter's model gives "
                "every temporal slice its own run behind its own timestamp text, and QuoTA resizes frames and packs "
                "their tokens into the video's first slots, which would sit behind other slices' timestamps. Use "
                "frames='uniform' or 'keyscore' (whole slices kept at their own slots), or a vision-stage method"
            )
        return reason

    def check_model(self, adapter) -> None:
        """At wrap time: the default scorer needs its answer token(s) in the model's vocabulary."""
        super().check_model(adapter)
        if self._scorer is not None:
            return
        from vlm_prune.frames.scorers import vocab_id

        for token in self._prompts.tokens:
            try:
                vocab_id(adapter.tokenizer(), token)
            except ValueError as err:
                raise ValueError(
                    f"QuoTA's default scorer reads P({token!r}) from the wrapped model, but {err}. Use prompts in "
                    "the model's words (QuoTA(prompts=PLAIN_PROMPTS) asks 'is there a ... ?' and reads yes/no, or "
                    "your own FramePrompts), or another scorer (QuoTA(scorer=vlm_scorer(other_model, processor)))"
                ) from None

    def objects_for(self, ctx: FramesContext) -> list[str]:
        """The objects to look for: ``objects(query)``, else the decoupling answer, else []."""
        if not ctx.query:
            return []
        if self._objects is not None:
            return [str(o).lower() for o in self._objects(ctx.query)]
        if self.decouple and ctx.generate_text is not None:
            answer = ctx.generate_text(decouple_prompt(ctx.query), decoupling_finished, DECOUPLE_MAX_NEW_TOKENS)
            return parse_decoupled_objects(answer)
        return []

    def scoring_prompt(self, ctx: FramesContext) -> str:
        """The frame prompt for this query, after decoupling when enabled and possible."""
        return frame_prompt(ctx.query, self.objects_for(ctx), self._prompts)

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
            p = self._prompts.score(ctx.score_frames([prompt], self._prompts.tokens, self.score_grid))
        else:
            raise ValueError(
                "QuoTA needs a frame scorer: wrap the model with its processor so it can score frames "
                "itself, or pass QuoTA(scorer=callable(pixels, prompt) -> p [T])"
            )
        p = torch.as_tensor(p).detach().float().flatten().cpu()
        if p.numel() != t:
            raise ValueError(f"QuoTA's scorer returned {p.numel()} scores for {t} frames")
        return p

    def budget_warning(self, adapter) -> str | None:
        """Why a video may end below keep / budget (official allocation; see the class docstring)."""
        if self.keep is not None and float(self.keep) >= 1.0:
            return None
        return ("quota allocates as the official QuoTA: each frame keeps int(budget * w_t) tokens shaped to an "
                "h x w grid (v2-v5: capped at the frame's map, the excess shared out once), so a video keeps at most "
                "the budget and falls short of it by an amount that depends on the frame scores (a few tokens per "
                "kept frame; more when a frame hits its cap); last_stats gives the count reached per video")

    def allocate(self, ctx: FramesContext) -> FramesPlan:
        t, n, _ = ctx.features.shape
        if ctx.n_total >= t * n:  # keep=1.0 or a budget of the whole video changes nothing (the library's rule)
            return FramesPlan(Reduction.keep_all(t * n, ctx.features.device), list(range(t)), [n] * t)
        scores = self.frame_scores(ctx)
        if self.wants_unpooled and ctx.unpooled is not None:
            feats, grid = ctx.unpooled, ctx.unpooled_grid
        else:
            feats, grid = ctx.features, ctx.grid
        return quota_plan(feats, grid, ctx.n_total, scores, self.variant, self.weight_scale,
                          self.weight_power, slots=t * n)


def scorer_flops(config, n_frames: int, rows_per_frame: int, decouple_rows: int = 0, decouple_new: int = 0) -> float:
    """Language-model FLOPs of QuoTA's default scorer, counted as ``eval.metrics`` counts a prefill.

    n_frames sequences of ``rows_per_frame`` tokens (frame tokens at ``score_grid`` + the
    newline where the model has one + the chat-templated frame prompt), each with the LM head on
    its last position only; plus, with decoupling, a text-only prefill of ``decouple_rows``
    tokens and ``decouple_new`` decode steps (each one row attending to the growing context).
    The vision tower is not run again (the frames' features are re-used).
    """
    from vlm_prune.eval.metrics import layer_flops, prefill_flops, text_config

    cfg = text_config(config)
    layers = cfg.num_hidden_layers
    total = n_frames * prefill_flops(config, [rows_per_frame] * layers)
    if decouple_rows:
        total += prefill_flops(config, [decouple_rows] * layers)
        head = 2 * cfg.hidden_size * cfg.vocab_size
        for step in range(decouple_new):  # one new row attending to c rows: layer_flops(c) - layer_flops(c - 1)
            c = decouple_rows + step + 1
            total += layers * (layer_flops(cfg, c) - layer_flops(cfg, c - 1)) + head
    return float(total)
