"""Method base classes and the contexts methods receive.

A method never touches model code. It declares its ``stage`` and computes a reduction from
tensors handed to it in a context object that an adapter fills in:

- ``frames``: choose frames of a video and a token budget for each (QuoTA, KeyScore, uniform).
- ``vision``: reduce the tokens of one image / frame after the projector (random, pool,
  DivPrune, CDPruner, VisionZip, ...). Returns a :class:`Reduction` over that image's tokens.
- ``vit``: prune or merge inside a ViT (AS-ViT, ToMe); patched per block by the adapter.
- ``llm``: drop or merge hidden states before chosen decoder layers (FastV, PACT, AdaptInfer).
  Returns one :class:`Reduction` per sample over that sample's current rows.

Budgets, one language for every method and pipeline (:data:`BUDGET_DEFINITION`): ``keep`` is
the fraction, ``budget`` the count, of an image's visual tokens (a video's, for frames methods)
that reach the language model's LAST decoder layer. :meth:`Method.n_keep` turns either into the
count a stage keeps; in a pipeline the target is the final count and earlier stages take an
even share of the reduction (:meth:`Method.n_keep`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

STAGES = ("frames", "vision", "vit", "llm")
#: adapter families whose language model interleaves linear-attention (recurrent) layers with full attention
HYBRID_FAMILIES = ("qwen3_5",)
#: how an llm-stage method runs on those (``Method.note_on``; adapters/qwen3_5.py has the details)
HYBRID_NOTE = ("where it reads a Gated DeltaNet (linear-attention) layer's attention it reads the nearest "
               "full-attention layer before it or else the first (last_stats notes say which); later linear layers "
               "build their states from the kept rows and count a merged row once (its log-size bias acts in the "
               "full-attention layers)")

BUDGET_DEFINITION = (
    "keep / budget: the visual tokens of each image (of each video, for frames methods) that reach "
    "the language model's last layer, as a fraction (keep, in (0, 1]) or a count (budget). The same "
    "for every method and pipeline; keep=1.0 (or a budget at least the token count) changes nothing."
)


class BudgetWarning(UserWarning):
    """wrap() could not promise the requested visual-token target; the message gives the reachable value."""


@dataclass
class Reduction:
    """What a method keeps of a set of N rows (tokens of one image, or rows of one sample).

    indices: LongTensor [k], ascending, into the N rows. The kept rows stay at these slots, so
        they keep their original position ids.
    features: optional [k, D] replacement features (merged / pooled values); None keeps the
        original rows unchanged.
    sizes: optional [k] float number of original tokens each kept row stands for (merging);
        the engine adds log(size) to attention logits for that key (proportional attention).
    merged_into: optional [N] long, set by merging methods: for each of the N input rows, the
        row (one of ``indices``) whose output it was folded into - itself when kept as it was,
        -1 when dropped. Reported as ``merged_into`` in the stage's ``last_stats`` record.
    order: optional [k] long (llm stage only), the order of the kept rows in the new sequence as
        positions into ``indices`` (None: index order). A row keeps its slot's position id and
        origin wherever it goes; SparseVLM's official code appends its merged rows after the kept
        visual ones, which this reproduces.
    """

    indices: torch.Tensor
    features: torch.Tensor | None = None
    sizes: torch.Tensor | None = None
    merged_into: torch.Tensor | None = None
    order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.indices.dim() != 1:
            raise ValueError(f"Reduction.indices must be 1-D, got shape {tuple(self.indices.shape)}")
        if self.order is not None and (self.order.shape != self.indices.shape or not torch.equal(
                torch.sort(self.order.to(self.indices.device)).values, torch.arange(self.indices.numel(), device=self.indices.device))):
            raise ValueError("Reduction.order must be a permutation of the positions 0..k-1 of indices")
        if self.indices.numel() > 1 and not bool((self.indices[1:] > self.indices[:-1]).all()):
            order = torch.argsort(self.indices)
            self.indices = self.indices[order]
            if self.features is not None:
                self.features = self.features[order]
            if self.sizes is not None:
                self.sizes = self.sizes[order]
            if self.order is not None:  # the same rows, named by their new positions
                self.order = torch.argsort(order.to(self.order.device))[self.order]

    @staticmethod
    def keep_all(n: int, device: torch.device | str = "cpu") -> "Reduction":
        return Reduction(torch.arange(n, device=device))

    def membership(self, n: int) -> torch.Tensor:
        """[n] :attr:`merged_into`, or for a method that only keeps / drops: kept rows themselves, the rest -1."""
        if self.merged_into is not None:
            return self.merged_into
        out = torch.full((n,), -1, dtype=torch.long, device=self.indices.device)
        out[self.indices] = self.indices
        return out

    def then(self, after: "Reduction", n: int) -> "Reduction":
        """This reduction of N = ``n`` rows followed by ``after``, a reduction of this one's kept rows:
        one Reduction of the N rows. Each row ``after`` keeps stays at this reduction's slot for it;
        merged sizes and ``merged_into`` compose (a row's size sums the sizes folded into it)."""
        rows = self.indices
        kept = rows[after.indices.to(rows.device)]
        features = after.features
        if features is None and self.features is not None:
            features = self.features[after.indices.to(self.features.device)]
        sizes = after.sizes
        if self.sizes is not None:
            own = self.sizes.float()
            if after.merged_into is not None:
                into = after.merged_into.to(own.device)
                folded = torch.zeros_like(own).index_add_(0, into[into >= 0], own[into >= 0])
                sizes = folded[after.indices.to(own.device)]
            else:
                sizes = own[after.indices.to(own.device)] * (1 if after.sizes is None else after.sizes.float())
        merged_into = None
        if self.merged_into is not None or after.merged_into is not None:
            inner = after.membership(rows.numel()).to(rows.device)
            slot_of = torch.where(inner >= 0, rows[inner.clamp(min=0)], -1)  # this reduction's kept row -> final slot
            first = self.membership(n).to(rows.device)
            position = torch.full((n,), -1, dtype=torch.long, device=rows.device)
            position[rows] = torch.arange(rows.numel(), device=rows.device)
            via = position[first.clamp(min=0)]
            merged_into = torch.where(first >= 0, slot_of[via.clamp(min=0)], -1)
        return Reduction(kept, features, sizes, merged_into)

    @staticmethod
    def top_k(scores: torch.Tensor, k: int) -> "Reduction":
        """Keep the k highest scores (ties broken by lower index), returned in index order."""
        k = max(0, min(int(k), scores.numel()))
        idx = torch.topk(scores.float(), k, sorted=False).indices
        return Reduction(torch.sort(idx).values)


def apportion(total: int, sizes: list[int]) -> list[int]:
    """``total`` kept tokens shared over parts of ``sizes`` tokens in proportion to their sizes
    (largest remainder, ties to the earlier part): the shares sum to min(total, sum(sizes)), none
    exceeds its size, and every part keeps at least one when ``total`` allows."""
    total = max(0, min(int(total), sum(sizes)))
    floor_one = total >= len(sizes)
    base = [1 if floor_one else 0 for _ in sizes]
    room = [s - b for s, b in zip(sizes, base)]
    rest, capacity = total - sum(base), sum(room)
    if rest <= 0 or capacity <= 0:
        return base
    exact = [rest * r / capacity for r in room]
    shares = [math.floor(x) for x in exact]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: rest - sum(shares)]:
        shares[i] += 1
    return [b + s for b, s in zip(base, shares)]


def item_generator(seed: int, rank: int) -> torch.Generator:
    """The generator of one image / video: seeded ``seed * 1_000_003 + rank`` (rank: the item's index
    among its sample's items of that modality), taken modulo 2**64 - torch's seed range, which
    reads a negative seed in two's complement - so any integer seed works and the seeds that fit
    that range are unchanged."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(rank)) % 2**64)


@dataclass
class VisionContext:
    """One image (or frame) handed to a vision-stage method.

    features: [N, D] tokens after the projector, in the order they enter the LLM.
    grid: (rows, cols) when the N tokens form a rectangular grid in row-major order, else None.
    n_keep: how many tokens to keep for this image (already resolved from keep / budget).
    text_embeds: [T, D] input embeddings of the sample's text tokens (the instruction), when
        available, for query-aware methods (CDPruner).
    tower_attention: optional callable returning (cls_or_mean_attention [N], keys [N, d]) of
        the vision tower's feature layer, computed on the side (VisionZip).
    generator: seeded torch.Generator for methods that sample.
    tower_tiles: optional callable returning the tower's per-partition [CLS] attention of an anyres
        image (:class:`vlm_prune.methods.hired.TileAttention`; LLaVA-NeXT, for methods that select
        per crop and need the tower's attention: HiRED).
    batch_tower_attention: optional callable returning the ``tower_attention`` result of every image
        (frame) the vision tower ran on in this call, in order, this one included - for a rule the
        official code applies to the batch as a whole (PruMerge's ``outliers="batch"``).
    """

    features: torch.Tensor
    n_keep: int
    grid: tuple[int, int] | None = None
    text_embeds: torch.Tensor | None = None
    tower_attention: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    generator: torch.Generator | None = None
    image_index: int = 0
    tower_tiles: Callable[[], Any] | None = None
    batch_tower_attention: Callable[[], list[tuple[torch.Tensor, ...]]] | None = None


@dataclass
class LayerContext:
    """The batch entering decoder layer ``layer`` as seen by an llm-stage method.

    hidden: [B, S, D] hidden states entering the layer (rows left-padded when ragged).
    valid: [B, S] bool, False for padding rows.
    visual: [B, S] bool, True for visual tokens still present.
    text: [B, S] bool, True for valid text tokens after the last visual token (the question).
    positions: [B, S] (or [3, B, S] for M-RoPE) original position ids of the rows.
    sizes: [B, S] float, how many original tokens each row stands for (1 unless merged).
    n_keep: [B] long, visual tokens to keep per sample at this layer.
    layer_module: the decoder layer about to run (its input_layernorm, self_attn, ...); on a hybrid
        model where that layer is a linear-attention layer, the full-attention layer the engine reads
        in its place (``PrunedDecoder.attention_layer``), as for ``project_qk`` and
        "previous_project_qk".
    project_qk: callable(hidden, positions, rope=True, q_rows=None) -> (q [B, H, S, d], k [B, H, S, d]):
        the layer's own normalised query/key projections, GQA keys repeated to H heads,
        rotary embedding applied at ``positions`` when ``rope`` is True. ``q_rows`` [B, R]
        projects only those query rows (q [B, H, R, d]); ``rope="keys"`` returns
        (q, k, k_rope), q and k without RoPE and the keys with it, from one projection.
    extras: "family", "prune_before", "origin" (each row's input index), "images" (per sample),
        "final_norm" (the language model's last norm); "groups" [B, S] and "group_keep" when the
        frames stage grouped its tokens (:attr:`FramesPlan.groups`); "protected" [B, S] long when a
        ViT stage marked rows the method must keep (MustDrop's key set: each row's rank, -1 for the
        others); for a method with ``needs_previous_hidden``
        also "previous_hidden" (the same rows entering layer ``layer - 1``) and
        "previous_project_qk" (that layer's ``project_qk``); "prefill_memo", a dict the method may
        keep state in across the layers of one prefill (new for every prefill); "frame_slots" [B, S]
        long for a method with ``wants_frame_slots`` on video input: each video token's spatial slot
        id (the same in every frame of its video), -1 for other rows;
        for a method with ``needs_input_rows`` the rows entering layer 0: "input_hidden" [B, S0, D],
        "input_visual" / "input_text" [B, S0] bool and "input_origin" [B, S0] (each row's input index,
        as "origin" numbers the rows now).
    """

    layer: int
    hidden: torch.Tensor
    valid: torch.Tensor
    visual: torch.Tensor
    text: torch.Tensor
    positions: torch.Tensor
    sizes: torch.Tensor
    n_keep: torch.Tensor
    layer_module: torch.nn.Module
    project_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class FramesContext:
    """One video handed to a frames-stage method (after the vision tower and projector).

    features: [T, N, D] tokens of each sampled frame, as the model would feed them to the LLM.
    grid: (rows, cols) of each frame's tokens, rows * cols == N.
    n_total: visual-token budget for the whole video (resolved from keep / budget).
    query: the user's question text, when the adapter could recover it.
    score_frames: callable(prompts: list[str], tokens: list[str], grid: (rows, cols) | None)
        -> probs [T, len(tokens)]: the wrapped model, unpruned, answers one prompt per frame
        (prompts has length T or 1) with each frame's already computed tokens, resized to at most
        ``grid`` when given; softmax of the last position's logits at those tokens. None when
        no processor was given.
    generate_text: callable(prompt: str, done: callable(text) -> bool | None, max_new_tokens: int)
        -> str, greedy text-only generation with the unpruned model, stopping at end of sequence
        or once ``done(answer so far)`` (QuoTA's query decoupling). None when unavailable.
    pixels: [T, C, H, W] the frames as the model's processor prepared them, for custom scorers.
    timestamps: seconds of each sampled frame, when known.
    text_features: [L, D] input embeddings (the language model's embed_tokens) of the query's
        text tokens, in the same space as ``features``, for query-aware frame methods (KeyScore).
    unpooled: [T, M, D] each frame's projected map before the model's own spatial pooling, when
        the model pools and the method asked for it (``wants_unpooled``; LLaVA-OneVision: the
        27 x 27 map that becomes 14 x 14); None otherwise. unpooled_grid: its (rows, cols).
    tower_attention: callable(frame) -> (attention [N], keys [N, d]) of the vision tower's feature
        layer for that frame, pooled to its token grid, computed on the side, when the method asks
        for it (``wants_tower_attention``) and the adapter can (LLaVA-OneVision; Qwen2-VL / 2.5-VL:
        per temporal slice, FastVID's Qwen2.5-VL salience of each merged token); None otherwise.
    """

    features: torch.Tensor
    grid: tuple[int, int]
    n_total: int
    query: str | None = None
    score_frames: Callable[[list[str]], torch.Tensor] | None = None
    generate_text: Callable[[str], str] | None = None
    pixels: torch.Tensor | None = None
    timestamps: list[float] | None = None
    text_features: torch.Tensor | None = None
    unpooled: torch.Tensor | None = None
    unpooled_grid: tuple[int, int] | None = None
    tower_attention: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class FramesPlan:
    """A frames-stage result.

    reduction: over the T * N token slots of the video, in frame-major order. Kept frames'
        (possibly resized) tokens fill the video's slots in frame order; unused slots are dropped.
    kept_frames: indices of the frames that keep at least one token.
    tokens_per_frame: [T] tokens allotted to each frame (0 = dropped).
    frame_scores: [T] the scores the allocation came from (for stats and plots).
    token_coords: [K, 3] long (frame, row, col) of every kept token in its frame's (resized)
        grid, when the plan resizes frames; None when kept tokens stay at their own slots. Models
        with spatial position ids (Qwen2-VL's M-RoPE) place resized tokens by these coordinates.
    groups: [K] long, the group (0 ..) of every kept token, for a method whose llm stage keeps a
        count per group (PruneVid: a window's static tokens, a frame's dynamic ones); None otherwise.
        The engine hands them on as ``LayerContext.extras["groups"]``.
    group_keep: the tokens of each group that the llm stage keeps (``extras["group_keep"]``).
    """

    reduction: Reduction
    kept_frames: list[int]
    tokens_per_frame: list[int]
    frame_scores: torch.Tensor | None = None
    token_coords: torch.Tensor | None = None
    groups: torch.Tensor | None = None
    group_keep: list[int] | None = None


class Method:
    """Base class of every pruning method.

    Subclasses set ``name``, ``stage`` and ``paper`` and implement the stage's hook:
    ``reduce_image(ctx: VisionContext) -> Reduction`` for the vision stage,
    ``layers`` and ``select(ctx: LayerContext) -> list[Reduction]`` for the llm stage.
    """

    name: ClassVar[str] = ""
    stage: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: model families (adapter names) the method supports; None means all.
    supported: ClassVar[tuple[str, ...] | None] = None
    #: family -> what the method runs on within it, where that is less than the family's models
    #: (listed by ``vlm-prune methods``), e.g. {"llava_onevision": "video only"}
    family_notes: ClassVar[dict[str, str]] = {}
    #: True when the method sets its own budget schedule (keep / budget then optional).
    own_schedule: ClassVar[bool] = False

    def __init__(self, keep: float | None = None, budget: int | None = None) -> None:
        self.keep = keep
        self.budget = budget
        #: (i, m): this method is stage i of an m-stage pipeline (set by wrap on its own copy)
        self._share: tuple[int, int] = (1, 1)

    # ---- budgets -------------------------------------------------------------------------
    def configure_budget(self, keep: float | None, budget: int | None) -> None:
        """Validate and set keep / budget given to wrap(); values set on the object win.

        wrap() calls this on its own copy of the method: the object a user configured is never
        changed, so wrapping it again with another budget applies that budget."""
        keep = self.keep if self.keep is not None else keep
        budget = self.budget if self.budget is not None else budget
        self.keep, self.budget = validate_budget(keep, budget, required=not self.own_schedule, method=self.name)

    def target_count(self, n_tokens: int, n_images: int = 1) -> int:
        """Visual tokens that should reach the last layer out of ``n_tokens`` (over ``n_images``).

        keep: floor(keep * n), at least 1 when n > 0. budget: budget per image, capped at n.
        No target (a method with its own schedule and nothing set): n.
        """
        if n_tokens <= 0:
            return 0
        if self.budget is not None:
            return min(n_tokens, int(self.budget) * max(1, n_images))
        if self.keep is not None:
            return max(1, min(n_tokens, math.floor(float(self.keep) * n_tokens + 1e-9)))
        return n_tokens

    def n_keep(self, n_tokens: int, n_images: int = 1, n_original: int | None = None) -> int:
        """Tokens this stage keeps of the ``n_tokens`` it sees (``n_images`` images).

        ``n_original``: the visual tokens before any stage ran (default ``n_tokens``). Alone, or
        as the last stage of a pipeline, the method ends at :meth:`target_count` of the original
        tokens. Stage i of m leaves the even share n * (target / n) ** (i / m) of them (rounded),
        so the reduction is spread evenly over the stages and the last one lands on the target.
        """
        if n_tokens <= 0:
            return 0
        n = n_tokens if n_original is None else max(n_original, n_tokens)
        target = self.target_count(n, n_images)
        i, m = getattr(self, "_share", (1, 1))
        if i < m and 0 < target < n:
            target = round(n * (target / n) ** (i / m))
        return max(1, min(n_tokens, target))

    def budget_warning(self, adapter: Any) -> str | None:
        """Why the target cannot be reached on this model, with the reachable value; None if it can.

        wrap() emits it once as a :class:`BudgetWarning` and keeps it in ``last_stats``."""
        return None

    @classmethod
    def note_on(cls, family: str) -> str | None:
        """What the method runs on, or how, within adapter ``family`` where that needs saying
        (``family_notes``, and :data:`HYBRID_NOTE` for an llm-stage method on a hybrid family), or None."""
        notes = [cls.family_notes.get(family), HYBRID_NOTE if cls.stage == "llm" and family in HYBRID_FAMILIES else None]
        return "; ".join(n for n in notes if n) or None

    @classmethod
    def refusal(cls, family: str, stages: tuple[str, ...]) -> str | None:
        """Why wrap() refuses this method on every model of adapter ``family`` (whose adapter runs
        ``stages``), or None: the one rule behind wrap()'s check and the models column of
        ``vlm-prune methods`` (:func:`vlm_prune.registry.method_families`)."""
        if cls.stage not in stages:
            return (f"method {cls.name!r} works in the {cls.stage!r} stage, which the {family} adapter does not "
                    f"offer; it offers: {', '.join(stages)}")
        if cls.supported is not None and family not in cls.supported:
            return f"method '{cls.name}' supports {', '.join(cls.supported)} models; this model is handled by the '{family}' adapter"
        return None

    def check_model(self, adapter: Any) -> None:
        """Raise ValueError at wrap time when this model does not meet the method's further needs
        (its family has passed :meth:`refusal` already: ``Adapter.check_methods``)."""

    def skipped_on(self, family: str) -> str | None:
        """Why wrap() leaves this method out of the pipeline on a model of adapter ``family`` (a
        companion stage the family cannot host, while the method's other stages run), or None."""
        return None

    def companions(self, others: dict[str, "Method"]) -> list["Method"]:
        """The methods this one runs in other stages (one per stage), added to the pipeline by
        wrap(): a method whose algorithm spans stages (PruneVid: a frames-stage merge, then an
        llm-stage selection) is one name for the user. ``others``: the pipeline's other methods by
        stage; refuse (ValueError) combinations the method cannot run in. Default: none."""
        return []

    def describe(self) -> dict[str, Any]:
        """The configuration as plain values (for stats, results files and plots)."""
        out = {"method": self.name, "stage": self.stage}
        out.update({k: v for k, v in vars(self).items() if not k.startswith("_") and _plain(v)})
        return out

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k not in ("method", "stage"))
        return f"{type(self).__name__}({args})"


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, tuple, list))


def _plain_number(value: Any) -> Any:
    """A Python number for a one-element numpy / torch scalar (np.float32(0.5), torch.tensor(4))."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return value.item()
    return value


def validate_budget(keep: Any, budget: Any, *, required: bool, method: str = "") -> tuple[float | None, int | None]:
    """The rules every wrap() call obeys: exactly one of keep / budget, each in range.

    Returns (keep, budget) as plain Python numbers (numpy and torch scalars are accepted).
    """
    who = f" for method '{method}'" if method else ""
    keep, budget = _plain_number(keep), _plain_number(budget)
    if keep is not None and budget is not None:
        raise ValueError(f"give either keep= (a fraction) or budget= (tokens per image){who}, not both")
    if required and keep is None and budget is None:
        raise ValueError(
            f"missing budget{who}: pass keep= (fraction of visual tokens kept, e.g. keep=0.25) "
            "or budget= (visual tokens kept per image, e.g. budget=64)"
        )
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not (0 < float(keep) <= 1):
            raise ValueError(f"keep must be a fraction in (0, 1], got {keep!r}{who}")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget must be a whole number of tokens >= 1, got {budget!r}{who}")
    return keep, budget


def validate_seed(seed: Any, *, name: str = "seed") -> int:
    """A seed as a Python int (numpy / torch integer scalars accepted); anything else is refused."""
    seed = _plain_number(seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name} must be a whole number (an integer), got {seed!r}")
    return seed


def check_positions(name: str, positions: str | None) -> None:
    """Refuse a ``positions=`` value other than "renumber", "keep" or None (the method's official one)."""
    if positions not in ("renumber", "keep", None):
        raise ValueError(f"{name} positions must be 'renumber' or 'keep' (None: the official one), got {positions!r}")


class ShorterSequence:
    """Mixin for vision methods whose official LLaVA-codebase code feeds the LLM the shorter
    sequence numbered 0..n-1 (FasterVLM, VisPruner, DivPrune, CDPruner): ``positions`` "renumber"
    (that, the default) or "keep" (original position ids, gaps stay). Models with multi-axis
    positions (Qwen2-VL's M-RoPE) always keep theirs: None resolves to "keep" there at wrap time."""

    #: families whose positions are never renumbered (M-RoPE)
    KEEPS_POSITIONS: ClassVar[tuple[str, ...]] = ("qwen2_vl",)
    positions: str | None = None

    def check_model(self, adapter: Any) -> None:
        super().check_model(adapter)  # type: ignore[misc]
        if adapter.family in self.KEEPS_POSITIONS or getattr(adapter, "multi_axis_positions", False):
            if self.positions == "renumber":
                raise ValueError(f"{self.name} positions='renumber' is for 1-D positions; "  # type: ignore[attr-defined]
                                 f"{adapter.family}'s multi-axis positions (M-RoPE) keep their ids")
            self.positions = "keep"

    @property
    def renumber_positions(self) -> bool:
        """True when the rows after the removal are renumbered without gaps (the official default)."""
        return self.positions != "keep"


class FramesMethod(Method):
    """A method that chooses frames and their token budgets for a video (frames stage)."""

    stage: ClassVar[str] = "frames"
    #: True when kept frames come back resized or merged (new features without a tower row of their own)
    resizes_frames: ClassVar[bool] = False

    def allocate(self, ctx: FramesContext) -> FramesPlan:  # pragma: no cover - abstract
        raise NotImplementedError


class VisionMethod(Method):
    """A method that reduces the tokens of each image independently (vision stage)."""

    stage: ClassVar[str] = "vision"
    #: True when it reads the vision tower's attention to each token (VisionContext.tower_attention)
    needs_tower_attention: ClassVar[bool] = False

    def reduce_image(self, ctx: VisionContext) -> Reduction:  # pragma: no cover - abstract
        raise NotImplementedError


class LLMMethod(Method):
    """A method that drops or merges rows before some decoder layers (llm stage)."""

    stage: ClassVar[str] = "llm"

    def prune_layers(self, num_layers: int) -> list[int]:  # pragma: no cover - abstract
        """0-indexed decoder layers before which ``select`` is called."""
        raise NotImplementedError

    def select(self, ctx: LayerContext) -> list[Reduction] | None:  # pragma: no cover - abstract
        """One Reduction per sample over its rows (indices into dim 1 of ctx.hidden), or None when
        the method changes nothing before this layer (no stage record is written then).

        Text and padding rows must be kept; only visual rows may be dropped or merged.
        """
        raise NotImplementedError


@dataclass
class DecodeStepContext:
    """One decode step as a per-step decode-time KV pruning method sees it (docs/decode-kv.md).

    attention: [B, kv] float32, the head-averaged softmax attention the step's new row pays every
        cached key in decoder layer ``layer`` (the keys that layer attends to, the new row last),
        computed on the side from the cache; 0 on masked keys.
    visual: [B, kv] bool, the keys that are visual tokens. valid: [B, kv] bool, the keys the layer
        may attend to (padding and earlier drops False).
    state: the method's per-sample tensors (batch first), kept on the KV cache so beams and copies
        move them with their rows; empty at the first decode step after a prompt.
    """

    layer: int
    attention: torch.Tensor
    visual: torch.Tensor
    valid: torch.Tensor
    state: dict[str, torch.Tensor]


class DecodeKV:
    """Mixin: decode-time KV-cache pruning (docs/decode-kv.md). The engine asks the configured
    method that has ``decode_kv`` True (any stage) for either or both hooks:

    - :meth:`decode_final_rows_from`: a layer F; after the prompt, decode steps in layers >= F attend
      only to the prompt rows that reached the last decoder layer (MustDrop's output-aware cache).
    - :meth:`decode_step_layer` and :meth:`decode_step`: at every single-token decode step the new
      row's attention in layer L is handed to :meth:`decode_step`, which returns the keys layers > L
      attend to in this step (DyCoke's dynamic KV pruning).
    """

    #: True while the method prunes the KV cache during decoding (a knob may turn it off)
    decode_kv: bool = False

    def decode_final_rows_from(self, num_layers: int) -> int | None:
        return None

    def decode_step_layer(self, num_layers: int) -> int | None:
        return None

    def decode_step(self, ctx: DecodeStepContext) -> torch.Tensor | None:  # pragma: no cover - abstract
        """[B, kv] bool: the keys layers after ``ctx.layer`` attend to in this step (None: all valid)."""
        return None

    def check_generate(self, kwargs: dict[str, Any], config: Any) -> None:
        """Refuse, at the generate() call, the decoding paths this method's decode stage cannot follow."""
        return None
