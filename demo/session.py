"""One demo request: the unpruned model and one or more pruned variants on the same input.

``Session.stream`` answers a question about an image or a video unwrapped, then wrapped with
each chosen pipeline in turn (``vlm_prune.wrap`` ... ``vlm_prune.unwrap``, under a lock so that
concurrent requests never interleave), and yields the growing :class:`Comparison` as answers
stream in. Each pipeline gets one :class:`Column`: its answer, its ideal prefill FLOPs and
visual tokens (final and averaged over the LLM layers), the median of repeated prefill timings
with their range, the KV cache it leaves, CUDA peak memory, what it kept drawn over the
upload, a heatmap of its token scores when the method scores tokens, and for merging methods
(PACT, ToMe, VisionZip) which tokens merged into which. A failing pipeline fills its column with
a message; the others still run.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

import vlm_prune
from vlm_prune.cli_methods import summary
from vlm_prune.demo import overlay
from vlm_prune.eval import metrics
from vlm_prune.methods.base import BudgetWarning
from vlm_prune.registry import available_methods, method_class
from vlm_prune.video import VideoError, processor_video_kwargs, read_frames

MediaKind = Literal["image", "video"]
log = logging.getLogger(__name__)
TIMING_REPEATS = 5  # timed prefill passes per model (after one warm-up); the median is reported
VIDEO_TIMEOUT_S = 60.0
Progress = Callable[[float, str], None]


class DemoError(ValueError):
    """A request the demo cannot serve; the message says what to change."""


@dataclass
class Media:
    """An uploaded image (PIL, RGB) or video (uint8 frames [T, H, W, 3])."""

    kind: MediaKind
    image: Image.Image | None = None
    frames: np.ndarray | None = None
    #: seconds of each video frame (the prompts of Qwen3-VL, GLM-4.1V and SmolVLM2 write them)
    times: np.ndarray | None = None


def read_media(path: str | Path, num_frames: int) -> Media:
    """Open ``path`` as an image, else as a video (``num_frames`` sampled uniformly)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        raise DemoError(f"the upload {path.name!r} is empty or missing; upload an image or a video file")
    try:
        with Image.open(path) as im:
            im.load()
            return Media("image", image=im.convert("RGB"))
    except (UnidentifiedImageError, OSError):
        pass
    try:
        frames, times = read_frames(path, num_frames=num_frames, timeout=VIDEO_TIMEOUT_S)
    except VideoError as err:
        log.info("%s is not a readable video: %s", path, err)
        raise DemoError(
            f"{path.name!r} is neither an image nor a readable video; upload a PNG/JPEG image or an MP4/AVI/WebM video"
        ) from None
    if frames.shape[0] == 0:
        raise DemoError(f"the video {path.name!r} has no frames; upload a longer clip")
    return Media("video", frames=frames, times=times)


@dataclass
class LoadedModel:
    """A model ready for requests, with what the user should know about it."""

    model: torch.nn.Module
    processor: Any
    name: str
    notes: list[str] = field(default_factory=list)
    #: the shipped toy model: word-level vocabulary (lower-case the question, split off "?"),
    #: trained only on pictures of coloured shapes
    toy: bool = False

    @property
    def depth(self) -> int:
        return int(self.model.config.get_text_config().num_hidden_layers)

    def takes(self, kind: MediaKind) -> bool:
        """Whether the processor takes this medium (models without a video input of their own, SmolVLM2
        and InternVL, get a video's frames from their processor as images)."""
        if kind == "image":
            return getattr(self.processor, "image_processor", None) is not None
        return getattr(self.processor, "video_processor", None) is not None


TOY_NOTE = (
    "the synthetic models are TOYS ({layers} decoder layers) trained only on pictures of coloured shapes: "
    "they answer questions such as 'what colour is the shape ?' and talk nonsense about real photos. "
    "Its timings are mostly fixed overhead; the FLOPs figures are what pruning saves on a model of real size. "
    "For a real model: `vlm-prune demo --model llava-hf/llava-onevision-qwen2-0.5b-ov-hf` (a hub id or a local folder)."
)


def load_synthetic(kind: MediaKind) -> LoadedModel:
    """The shipped tiny synthetic model of ``kind``; an untrained one (with a note) when its
    weights are not there."""
    from vlm_prune.eval.synthetic import build_model, build_processor, load, model_path

    name = f"synthetic {kind} model"
    where = shipped_location(model_path(kind))
    try:
        model, processor = load(kind)
        notes = [f"{name}, shipped with vlm-prune ({where})"]
    except FileNotFoundError:
        model, processor = build_model(kind).eval(), build_processor(kind)
        notes = [(
            f"no trained weights at {where}: the {name} is UNTRAINED, its answers are noise "
            f"(train it with `python -m vlm_prune.eval.synthetic.train --kind {kind}`)"
        )]
    notes.append(TOY_NOTE.format(layers=model.config.get_text_config().num_hidden_layers))
    return LoadedModel(model, processor, name, notes, toy=True)


def shipped_location(path: Path) -> str:
    """A shipped file's place inside the package (``vlm_prune/eval/synthetic/models/image``), not
    the absolute path of this installation (which would name the user's folders on the page)."""
    import vlm_prune.eval

    root = Path(vlm_prune.eval.__file__).resolve().parent
    try:
        return "vlm_prune/eval/" + Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return Path(path).name


def load_checkpoint(model_id: str) -> LoadedModel:
    """Any supported Hugging Face checkpoint (path or hub ID): AutoProcessor +
    AutoModelForImageTextToText, bfloat16 on CUDA, float32 on CPU."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cuda = torch.cuda.is_available()
    try:
        processor = AutoProcessor.from_pretrained(model_id)
        model = AutoModelForImageTextToText.from_pretrained(
            model_id, dtype=torch.bfloat16 if cuda else torch.float32
        )
    except (OSError, ValueError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, ImportError):  # e.g. SmolVLM's processor without num2words
            raise DemoError(f"could not load {model_id!r}: it needs a package that is not installed ({first})") from None
        raise DemoError(f"could not load {model_id!r} as an image-text-to-text model ({first}); give a local "
                        "checkpoint folder or a Hugging Face hub id of a supported VLM") from None
    model = model.to("cuda" if cuda else "cpu").eval()
    return LoadedModel(model, processor, model_id, [f"{model_id} ({model.dtype}, {model.device})"])


def make_method(cls: type, layer: int | None, loaded: LoadedModel | None) -> Any:
    """One configured method: ``layer`` (when > 0) for in-LLM methods that take one (else the
    method's default, moved to the model's last layer when the model is shallower); QuoTA with
    its frame scorer's prompt in the loaded model's own words (``QuoTA.for_processor``), and on the
    toy models the objects their questions name (``eval.bench.query_objects``) in place of the
    decoupling prompt the toy cannot follow."""
    if cls.name == "quota" and loaded is not None:
        knobs: dict[str, Any] = {}
        if loaded.toy:
            from vlm_prune.eval.bench import query_objects

            knobs["objects"] = query_objects
        return cls.for_processor(loaded.processor, **knobs)
    if layer and "layer" in inspect.signature(cls.__init__).parameters:
        return cls(layer=int(layer))
    method = cls()
    depth = loaded.depth if loaded is not None else None
    if depth and isinstance(getattr(method, "layer", None), int) and method.layer >= depth:
        return cls(layer=depth - 1)  # a default deeper than the model (PruneVid's 11): its last layer
    return method


def build_pipeline(methods: list[str] | str, layer: int | None, loaded: LoadedModel | None = None) -> list[Any]:
    """Method objects for the chosen names; "a+b" entries are split into stages. ``layer``
    (when > 0) replaces the default prune layer of in-LLM methods that take one; ``loaded``: the
    model they will run on (see :func:`make_method`)."""
    names = [methods] if isinstance(methods, str) else list(methods or [])
    names = [n.strip() for entry in names for n in str(entry).split("+") if n.strip()]
    if not names:
        raise DemoError("pick at least one method (e.g. 'random', 'pact' or 'keyscore+pact')")
    pipeline = []
    for name in names:
        try:
            cls = method_class(name)
        except ValueError as err:
            raise DemoError(str(err)) from None
        try:
            pipeline.append(make_method(cls, layer, loaded))
        except ImportError as err:  # an optional dependency of the method (e.g. KeyScore's STACFP)
            raise DemoError(str(err)) from None
        except ValueError as err:  # e.g. QuoTA on a vocabulary with neither "A" nor yes / no
            raise DemoError(f"{name}: {err}") from None
    return pipeline


def parse_entries(methods: list[str] | str | None) -> list[str]:
    """The comparison's columns: one pipeline per entry ("pact", "keyscore+pact"), in order, without repeats."""
    names = [methods] if isinstance(methods, str) else list(methods or [])
    out = []
    for entry in names:
        entry = "+".join(n.strip() for n in str(entry).split("+") if n.strip())
        if entry and entry not in out:
            out.append(entry)
    if not out:
        raise DemoError("pick at least one method (e.g. 'random', 'pact' or 'keyscore+pact')")
    return out


def normalise_question(question: str) -> str:
    """Lower case, with "?" and "," as separate words (a word-level vocabulary needs both)."""
    return " ".join(re.findall(r"[\w']+|[?,]", question.lower()))


def encode(loaded: LoadedModel, media: Media, question: str) -> dict[str, torch.Tensor]:
    """Chat-template prompt and pixels of one request, on the model's device and dtype."""
    processor = loaded.processor
    conversation = [{"role": "user", "content": [{"type": media.kind}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    if media.kind == "image":
        inputs = processor(images=[media.image], text=[text], return_tensors="pt")
    else:
        times = None if media.times is None else [media.times]
        inputs = processor(videos=[media.frames], text=[text], return_tensors="pt",
                           **processor_video_kwargs(processor, times))
    model = loaded.model
    return {
        k: v.to(model.device, model.dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds of repeated prefill passes: the median is the figure, the range its noise."""

    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def text(self) -> str:
        lo, hi = min(self.seconds), max(self.seconds)
        return f"{self.median * 1e3:.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})"


@torch.no_grad()
def time_prefill(model: torch.nn.Module, inputs: dict[str, Any], repeats: int = TIMING_REPEATS) -> Timing:
    """Seconds of ``repeats`` prefill forward passes (time to first token) after a warm-up."""
    model(**inputs)
    times = []
    for _ in range(repeats):
        _sync(model.device)
        t0 = time.perf_counter()
        model(**inputs)
        _sync(model.device)
        times.append(time.perf_counter() - t0)
    return Timing(times)


def answer_stream(loaded: LoadedModel, inputs: dict[str, Any], max_new_tokens: int) -> Iterator[str]:
    """The greedy answer as it grows (generate() runs in a thread, text comes through a streamer)."""
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(loaded.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
        except BaseException as err:  # handed to the caller below
            failure.append(err)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    text = ""
    for piece in streamer:
        text += piece
        yield text.strip()
    thread.join()
    if failure:
        raise failure[0]


def answer(loaded: LoadedModel, inputs: dict[str, Any], max_new_tokens: int) -> str:
    """The whole greedy answer."""
    text = ""
    for text in answer_stream(loaded, inputs, max_new_tokens):
        pass
    return text


@dataclass
class Cost:
    """What one prefill costs, from the model's config and last_stats (None: unpruned)."""

    visual_in: int
    visual_out: int
    visual_layer_avg: float  # visual tokens each LLM layer processes, averaged over the layers
    flops: float  # ideal LLM prefill FLOPs
    flops_full: float
    kv_bytes: float  # KV cache the prefill leaves (every layer's keys and values)
    vit_flops_ratio: float | None = None  # vision-tower FLOPs ratio of ViT-stage methods

    @property
    def flops_ratio(self) -> float:
        return self.flops / self.flops_full


def prefill_cost(config: Any, seq_len: int, visual_in: int, stats: dict[str, Any] | None,
                 dtype: torch.dtype) -> Cost:
    """Ideal figures of one request: ``rows_per_layer`` of the prompt and of its visual tokens."""
    cfg = metrics.text_config(config)
    n_layers = cfg.num_hidden_layers
    rows = metrics.rows_per_layer(n_layers, seq_len, stats)
    visual = metrics.rows_per_layer(n_layers, visual_in, stats)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_dim = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    vit = [r["flops_ratio"] for r in (stats or {}).get("stages", []) if r["stage"] == "vit" and "flops_ratio" in r]
    return Cost(
        visual_in=visual_in, visual_out=visual[-1], visual_layer_avg=sum(visual) / n_layers,
        flops=metrics.prefill_flops(config, rows), flops_full=metrics.prefill_flops(config, [seq_len] * n_layers),
        kv_bytes=float(sum(rows) * 2 * kv_dim * elem), vit_flops_ratio=math.prod(vit) if vit else None,
    )


def _peak_cuda(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class ScoreSpy:
    """Records the token scores a method computes (``scores(ctx)`` of FastV / AdaptInfer and
    PACT's ``_scores_and_keys(ctx)`` over the rows entering their layer, ``relevance(ctx)`` of
    CDPruner and VisionZip's tower attention over one image or video frame's tokens) by shadowing
    that bound method on the instance; ``close`` removes it.

    ``found[name]``: the scores of the first LLM-stage call (the first sample's visual rows), or
    every vision-stage call of the request's first image / video in order (one per frame; a
    timed prefill repeats them: :meth:`scores` takes the first ``n``). ``positions[name]``: the
    position ids of the LLM-stage rows scored (1-D position ids only), to place them on the upload.
    """

    ATTRS = ("scores", "_scores_and_keys", "relevance")

    def __init__(self, methods: list[Any]) -> None:
        self.found: dict[str, list[torch.Tensor]] = {}
        self.positions: dict[str, torch.Tensor | None] = {}
        #: an earlier stage renumbers the positions (DivPrune, CDPruner, VisionZip's official shorter sequence)
        self.renumbered = any(m.stage != "llm" and getattr(m, "renumber_positions", False) for m in methods)
        self.patched: list[tuple[Any, str]] = []
        for m in methods:
            if inspect.ismethod(getattr(m, "reduce_image", None)):  # VisionZip: the tower's CLS attention
                m.reduce_image = self._spy_tower(m.name, m.reduce_image)
                self.patched.append((m, "reduce_image"))
            for attr in self.ATTRS:
                fn = getattr(m, attr, None)
                if inspect.ismethod(fn):
                    setattr(m, attr, self._spy(m.name, fn))
                    self.patched.append((m, attr))

    def _keep(self, name: str, ctx: Any, scores: torch.Tensor) -> None:
        visual = getattr(ctx, "visual", None)  # llm stage: [B, S] rows -> the first sample's visual rows
        if visual is not None:
            if name not in self.found:
                mask = visual[0] & ctx.valid[0]
                self.found[name] = [scores[0][mask].detach().float().cpu()]
                pos = getattr(ctx, "positions", None)
                self.positions[name] = pos[0][mask].detach().cpu() if pos is not None and pos.dim() == 2 else None
        elif getattr(ctx, "image_index", 0) == 0:  # vision stage: each frame of the first image / video
            self.found.setdefault(name, []).append(scores.detach().float().cpu())
            self.positions.setdefault(name, None)

    def _spy(self, name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def spy(ctx: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = fn(ctx, *args, **kwargs)
            self._keep(name, ctx, out[0] if isinstance(out, tuple) else out)  # PACT's (scores, keys)
            return out
        return spy

    def _spy_tower(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """reduce_image(ctx) whose ``ctx.tower_attention()`` (attention each token gets, keys, ...)
        records the attention of each frame of the first image / video it is asked for."""
        def spy(ctx: Any) -> Any:
            tower = ctx.tower_attention
            if tower is None:
                return fn(ctx)

            def recorded() -> Any:
                out = tower()
                self._keep(name, ctx, out[0])
                return out
            return fn(dataclasses.replace(ctx, tower_attention=recorded))
        return spy

    def scores(self, n_calls: int = 1) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """(scores, positions or None) per method: the LLM-stage call, or the first ``n_calls``
        vision-stage calls (one image, or the frames of one video) concatenated."""
        return {name: (torch.cat(calls[: 1 if self.positions[name] is not None else n_calls]), self.positions[name])
                for name, calls in self.found.items()}

    def close(self) -> None:
        for m, attr in self.patched:
            vars(m).pop(attr, None)


@dataclass
class Column:
    """One pruned variant of the request: a pipeline name and what it gave (or why it failed)."""

    name: str
    description: str = ""
    answer: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    cost: Cost | None = None
    timing: Timing | None = None
    peak_bytes: int | None = None
    picture: Image.Image | None = None
    heatmap: Image.Image | None = None
    heatmap_note: str = ""
    merges: Image.Image | None = None
    merge_note: str = ""
    #: what wrap() warned (BudgetWarning: e.g. QuoTA's allocation can leave part of the budget unspent)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    done: bool = False

    def card(self) -> str:
        """Markdown of the column's head: name, what it does, its answer or its error."""
        lines = [f"### `{self.name}`", f"*{escape(self.description)}*" if self.description else ""]
        if self.error:
            lines.append(f"**could not run:** {escape(self.error)}")
        elif self.cost is not None:
            lines += [f"**answer:** {escape(self.answer) or '(empty)'}",
                      f"{self.cost.visual_out} of {self.cost.visual_in} visual tokens; LLM prefill FLOPs (ideal): "
                      f"{flops_text(self.cost.flops_ratio)}"]
            lines += [f"**budget note:** {escape(w)}" for w in self.warnings]
            for note in (self.heatmap_note, self.merge_note):
                if note:
                    lines.append(f"<small>{escape(note)}</small>")
        elif not self.done:
            lines.append(f"running ... {escape(self.answer)}")
        return "\n\n".join(line for line in lines if line)


@dataclass
class Comparison:
    """Everything one request shows: the unpruned run and one column per pipeline."""

    kind: MediaKind
    question: str
    columns: list[Column]
    model: str = ""
    answer_unpruned: str = ""
    cost_unpruned: Cost | None = None
    timing_unpruned: Timing | None = None
    peak_unpruned: int | None = None
    notes: list[str] = field(default_factory=list)
    warning: str = ""

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures of the unpruned run and of every column."""
        def figures(cost: Cost | None, timing: Timing | None, peak: int | None) -> dict[str, Any]:
            out: dict[str, Any] = {}
            if cost is not None:
                out.update(visual_tokens_in=cost.visual_in, visual_tokens_out=cost.visual_out,
                           visual_tokens_layer_avg=cost.visual_layer_avg, flops_ratio=cost.flops_ratio,
                           prefill_flops=cost.flops, kv_cache_bytes=cost.kv_bytes, vit_flops_ratio=cost.vit_flops_ratio)
            if timing is not None:
                out.update(prefill_s_median=timing.median, prefill_s=timing.seconds)
            return {**out, "peak_cuda_bytes": peak}

        return {
            "model": self.model, "media": self.kind, "question": self.question,
            "unpruned": {"answer": self.answer_unpruned,
                         **figures(self.cost_unpruned, self.timing_unpruned, self.peak_unpruned)},
            "pruned": [{"pipeline": c.name, "answer": c.answer, "error": c.error,
                        **figures(c.cost, c.timing, c.peak_bytes), "last_stats": c.stats} for c in self.columns],
        }

    def markdown(self) -> str:
        """The headline table: one column for the unpruned model, one per pipeline."""
        cols = [c for c in self.columns if c.error is None and c.cost is not None]
        if self.cost_unpruned is None:
            return ""
        base = self.cost_unpruned
        head = "| | unpruned | " + " | ".join(f"`{c.name}`" for c in cols) + " |"
        rows = [head, "|---" * (2 + len(cols)) + "|"]

        def row(label: str, first: str, cell: Callable[[Column], str]) -> None:
            rows.append(f"| {label} | {first} | " + " | ".join(cell(c) for c in cols) + " |")

        row("answer", escape(self.answer_unpruned) or "(empty)", lambda c: escape(c.answer) or "(empty)")
        row("**LLM prefill FLOPs (ideal), share of unpruned**", "1.00",
            lambda c: f"**{flops_text(c.cost.flops_ratio)}**")
        row("**visual tokens, final**", str(base.visual_in),
            lambda c: f"**{c.cost.visual_out}** ({c.cost.visual_out / max(base.visual_in, 1):.0%})")
        row("visual tokens, mean over LLM layers", f"{base.visual_layer_avg:.0f}",
            lambda c: f"{c.cost.visual_layer_avg:.1f} ({c.cost.visual_layer_avg / max(base.visual_in, 1):.0%})")
        if any(c.cost.vit_flops_ratio is not None for c in cols):
            row("vision tower FLOPs (ideal), share of unpruned", "1.00",
                lambda c: "1.00" if c.cost.vit_flops_ratio is None else flops_text(c.cost.vit_flops_ratio))
        row("KV cache after prefill", _mib(base.kv_bytes), lambda c: _mib(c.cost.kv_bytes))
        if self.timing_unpruned is not None:
            n = len(self.timing_unpruned.seconds)
            row(f"prefill time, median of {n} (range)", self.timing_unpruned.text(),
                lambda c: c.timing.text() if c.timing else "")
        if self.peak_unpruned is not None:
            row("peak CUDA memory", _mib(self.peak_unpruned), lambda c: _mib(c.peak_bytes or 0))
        rows += ["", "FLOPs and tokens are exact counts for this request; measured times vary from run to run "
                 "(the range shows by how much), and on a small model they are mostly fixed overhead."]
        if self.peak_unpruned is None:
            rows[-1] += " Peak memory is measured on CUDA only."
        return "\n".join(rows)


def flops_text(ratio: float) -> str:
    """A FLOPs ratio said as a share of the unpruned model's, not a speed-up: "0.35 of unpruned (2.9x fewer)"."""
    if ratio >= 0.995:
        return f"{ratio:.2f} of unpruned (no saving)"
    return f"{ratio:.2f} of unpruned ({1 / ratio:.1f}x fewer)"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def escape(text: str) -> str:
    """Text shown inside Markdown: no HTML tags, no table breaks."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|").replace("\n", " ")


def unknown_words(loaded: LoadedModel, question: str) -> list[str]:
    """Words of ``question`` that the tokenizer reads as its unknown token."""
    tok = loaded.processor.tokenizer
    unk = getattr(tok, "unk_token_id", None)
    if unk is None:
        return []
    return [w for w in dict.fromkeys(question.split()) if unk in tok(w, add_special_tokens=False)["input_ids"]]


class Session:
    """Serves requests on one image model and one video model (possibly the same object)."""

    def __init__(self, image_model: LoadedModel | None, video_model: LoadedModel | None,
                 num_frames: int = 16, max_new_tokens: int = 16, timing_repeats: int = TIMING_REPEATS) -> None:
        if image_model is None and video_model is None:
            raise ValueError("a demo session needs an image model, a video model or both")
        self.models: dict[MediaKind, LoadedModel | None] = {"image": image_model, "video": video_model}
        self.num_frames = num_frames
        self.max_new_tokens = max_new_tokens
        self.timing_repeats = timing_repeats
        self.lock = threading.Lock()
        self._offered: dict[tuple[MediaKind, tuple[str, ...]], list[str]] = {}

    @property
    def name(self) -> str:
        names = dict.fromkeys(m.name for m in self.models.values() if m is not None)
        return " / ".join(names)

    def notes(self) -> list[str]:
        lines = []
        for kind, loaded in self.models.items():
            lines += [f"{kind}s: not supported by this model"] if loaded is None else loaded.notes
        return list(dict.fromkeys(lines))

    def default_layer(self) -> int:
        """The prune layer the UI proposes: 0 = each method's own default, or 1 on a model too
        shallow for those defaults (PACT prunes before layer 4, so fewer than 5 decoder layers)."""
        depths = [m.depth for m in self.models.values() if m is not None]
        return 1 if min(depths) < 5 else 0

    def offered(self, kind: MediaKind, pipelines: tuple[str, ...] = ()) -> list[str]:
        """Methods (and the given "a+b" pipelines) the model of ``kind`` accepts at wrap time;
        frames-stage methods only for videos. Checked once per kind and list of pipelines."""
        key = (kind, tuple(pipelines))
        if key not in self._offered:
            loaded = self.models[kind]
            ok = []
            if loaded is not None:
                for entry in [*available_methods(), *pipelines]:
                    try:
                        pipeline = build_pipeline(entry, None, loaded)
                    except DemoError:
                        continue
                    if kind == "image" and any("frames" in (getattr(m, "needs_stages", None) or (m.stage,))
                                               for m in pipeline):  # frames methods (and PruneVid) act on videos
                        continue
                    with self.lock:
                        try:
                            vlm_prune.wrap(loaded.model, pipeline, keep=0.5, processor=loaded.processor)
                        except Exception as err:  # noqa: BLE001 - any refusal means "not offered"
                            log.info("not offering %s for %ss: %s", entry, kind, err)
                            continue
                        finally:
                            if vlm_prune.api.is_wrapped(loaded.model):
                                vlm_prune.unwrap(loaded.model)
                    ok.append(entry)
            self._offered[key] = ok
        return list(self._offered[key])

    def run(self, path: str | Path | None, question: str, methods: list[str] | str, keep: float,
            layer: int | None = None, progress: Progress | None = None) -> Comparison:
        """The finished comparison of :meth:`stream`."""
        result = None
        for result in self.stream(path, question, methods, keep, layer, progress):
            pass
        assert result is not None
        return result

    def stream(self, path: str | Path | None, question: str, methods: list[str] | str, keep: float,
               layer: int | None = None, progress: Progress | None = None) -> Iterator[Comparison]:
        """Answer ``question`` about the file at ``path`` unpruned, then with each pipeline of
        ``methods`` (one column each); yields the comparison as it fills. Raises DemoError for
        a request that cannot run at all; a pipeline that fails gets its message in its column."""
        step = progress or (lambda frac, desc: None)
        if not path:
            raise DemoError("upload an image or a video first (or click one of the examples)")
        if not question or not question.strip():
            raise DemoError("type a question about the image or video")
        if not 0 < float(keep) <= 1:
            raise DemoError(f"keep must be in (0, 1], got {keep}")
        entries = parse_entries(methods)
        step(0.02, "reading the upload")
        media = read_media(path, self.num_frames)
        loaded = self.models[media.kind]
        if loaded is None or not loaded.takes(media.kind):
            raise DemoError(f"this model does not take {media.kind}s; upload an "
                            f"{'image' if media.kind == 'video' else 'video'} instead, or pick another model")
        if loaded.toy:
            question = normalise_question(question)
        comp = Comparison(media.kind, question, [Column(e, describe(e)) for e in entries], model=loaded.name)
        unknown = unknown_words(loaded, question)
        if unknown:
            words = ", ".join(f"'{w}'" for w in unknown)
            comp.warning = f"{loaded.name} does not know the words {words} (read as `<unk>`)."
            if loaded.toy:
                comp.warning += (" It is a toy trained only on pictures of coloured shapes, so expect nonsense about "
                                 "anything else; ask e.g. 'what colour is the shape ?', or start the demo with "
                                 "`--model` and a real checkpoint.")
        inputs = encode(loaded, media, question)
        n_visual = int(torch.isin(inputs["input_ids"][0].cpu(), torch.tensor(_visual_ids(loaded.model.config))).sum())
        with self.lock:
            model = loaded.model
            step(0.05, "unpruned model: answer")
            for comp.answer_unpruned in answer_stream(loaded, inputs, self.max_new_tokens):
                yield comp
            step(0.1, "unpruned model: time to first token")
            _reset_peak(model.device)
            comp.timing_unpruned = time_prefill(model, inputs, self.timing_repeats)
            comp.peak_unpruned = _peak_cuda(model.device)
            comp.cost_unpruned = prefill_cost(model.config, inputs["input_ids"].shape[1], n_visual, None, model.dtype)
            yield comp
            for i, col in enumerate(comp.columns):
                base = 0.15 + 0.85 * i / len(comp.columns)
                step(base, f"{col.name}: wrapping")
                try:
                    yield from self._fill(col, loaded, media, inputs, keep, layer, comp)
                except DemoError as err:
                    col.error = str(err)
                except Exception as err:  # noqa: BLE001 - the page shows a message, the console the traceback
                    log.exception("demo pipeline %s failed", col.name)
                    col.error = f"{type(err).__name__}: {err}"
                finally:
                    if vlm_prune.api.is_wrapped(model):
                        vlm_prune.unwrap(model)
                col.done = True
                yield comp

    def _fill(self, col: Column, loaded: LoadedModel, media: Media, inputs: dict[str, Any], keep: float,
              layer: int | None, comp: Comparison) -> Iterator[Comparison]:
        model = loaded.model
        pipeline = build_pipeline(col.name, layer, loaded)
        spy = ScoreSpy(pipeline)
        try:
            self._wrap(loaded, pipeline, keep, col)
            _reset_peak(model.device)
            col.timing = time_prefill(model, inputs, self.timing_repeats)
            col.peak_bytes = _peak_cuda(model.device)
        finally:
            spy.close()
        col.stats = dict(model.vlm_prune.last_stats)
        rows = model.vlm_prune.last_rows[0].cpu()
        # the library's count of visual tokens (a OneVision video's trailing newline is not one)
        n_visual = sum(col.stats["visual_tokens_in"])
        col.cost = prefill_cost(model.config, inputs["input_ids"].shape[1], n_visual, col.stats, model.dtype)
        if comp.cost_unpruned is not None and comp.cost_unpruned.visual_in != n_visual:
            comp.cost_unpruned = prefill_cost(model.config, inputs["input_ids"].shape[1], n_visual, None, model.dtype)
        for col.answer in answer_stream(loaded, inputs, self.max_new_tokens):
            yield comp
        vlm_prune.unwrap(model)
        if media.kind == "image":
            self._draw_image(col, loaded, media, inputs, rows, spy)
        else:
            self._draw_video(col, loaded, media, inputs, rows, spy, overlay.strip_columns(len(comp.columns)))

    @staticmethod
    def _wrap(loaded: LoadedModel, pipeline: list[Any], keep: float, col: Column | None = None) -> None:
        """Wrap the model; what wrap() warns (BudgetWarning) goes to ``col.warnings`` for the page."""
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", BudgetWarning)
                vlm_prune.wrap(loaded.model, pipeline, keep=keep, processor=loaded.processor)
        except (ValueError, TypeError, RuntimeError) as err:
            raise DemoError(f"cannot prune this model with {'+'.join(m.name for m in pipeline)}: {err}") from None
        for w in caught:
            if issubclass(w.category, BudgetWarning) and col is not None:
                col.warnings.append(str(w.message))
                log.info("%s: %s", col.name, w.message)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _draw_image(self, col: Column, loaded: LoadedModel, media: Media, inputs: dict[str, Any],
                    rows: torch.Tensor, spy: ScoreSpy) -> None:
        ids = inputs["input_ids"][0].cpu()
        token_id = loaded.model.config.image_token_id
        slots = overlay.kept_placeholders(ids, rows, token_id).numpy()
        into = merged_into(col.stats)
        fate = overlay.token_fate(slots, into if into is not None and into.size == slots.size else None)
        kept, merged = overlay.fate_masks(fate)
        picture = np.asarray(media.image)
        box = model_box(loaded.processor, inputs, picture.shape[1], picture.shape[0])
        n = fate.size
        counts = f"{int(kept.sum())} of {n} image tokens kept as they were"
        if merged.any():
            counts += f", {int(merged.sum())} merged into {np.unique(fate[merged]).size} tokens"
        counts += f", {int((fate < 0).sum())} dropped"
        caption = [f"{col.name}: {counts}",
                   "green outline: kept as it was" + ("   amber outline: merged with others into one token (see the "
                                                      "merge picture)" if merged.any() else "") + "   dark: dropped"]
        if box != (0, 0, picture.shape[1], picture.shape[0]):
            caption.append("shaded grey outside the box: cropped away by the model's processor, never seen")
        col.stats["kept_grid"] = np.where(kept, 1, np.where(merged, 2, 0)).tolist()  # 1 kept, 2 merged, 0 dropped
        grid = image_grid(loaded.model.config, inputs, n)
        if grid is None:
            caption[1] = "this model's image tokens form no single grid (tiles, newlines): kept/dropped not drawn"
            col.picture = overlay.plain_view(picture, caption)
            if into is not None:
                col.merge_note = f"merges of {col.name} not drawn: this model's image tokens form no single grid"
            return
        col.picture = overlay.grid_overlay(picture, kept, grid, caption, box=box, merged=merged)
        into = self._merges(col, n)
        if into is not None:
            col.merges = overlay.merge_overlay(picture, into, grid, merge_caption(col.name, into), box=box)
        found = placed_scores(spy.scores(1), ids, token_id, n, col.stats, spy.renumbered)
        if found is not None:
            name, values, partial = found
            col.stats["token_scores"] = [None if np.isnan(v) else float(v) for v in values]
            col.heatmap = overlay.score_heatmap(picture, values, grid, [
                f"{name}: its token scores (yellow = high), before it chose what to keep"
                + ("; dark: not scored (dropped by an earlier stage)" if partial else "")], box=box)
        else:
            col.heatmap_note = NO_HEATMAP.format(name=col.name)

    def _draw_video(self, col: Column, loaded: LoadedModel, media: Media, inputs: dict[str, Any],
                    rows: torch.Tensor, spy: ScoreSpy, columns: int = overlay.STRIP_COLUMNS) -> None:
        ids = inputs["input_ids"][0].cpu()
        token_id = video_placeholder(loaded.model.config, ids)
        kept = overlay.kept_placeholders(ids, rows, token_id).numpy()
        thw = inputs.get("video_grid_thw")
        # token groups in time: one per frame, or one per temporal patch (Qwen2-VL merges 2 frames)
        n_groups = int(thw[0, 0]) if thw is not None else media.frames.shape[0]
        record = next((r for r in col.stats["stages"] if r["stage"] == "frames" and r.get("videos")), None)
        plan = record["videos"][0] if record else {}
        per_group_kept, per_group = overlay.frames_kept(kept, n_groups, plan["tokens_per_frame"] if plan.get("packed") else None)
        frame_scores = plan.get("frame_scores") or [None] * n_groups
        budgets = plan.get("tokens_per_frame") or [None] * n_groups
        stride = media.frames.shape[0] / n_groups
        frames = [overlay.FrameInfo(media.frames[int(t * stride)], per_group_kept[t], per_group, frame_scores[t], budgets[t])
                  for t in range(n_groups)]
        shown = sum(k > 0 for k in per_group_kept)
        caption = [f"{col.name}: {shown} of {n_groups} frames keep tokens, {sum(per_group_kept)} of "
                   f"{n_groups * per_group} video tokens",
                   "s = frame score of the frames-stage method, b = its token budget; grey frames are dropped"]
        if plan.get("packed"):
            caption.append("the frames-stage method resized the kept frames: their tokens are new ones, counted per frame")
        col.stats.update(frames_kept_tokens=per_group_kept, tokens_per_frame=per_group)
        col.picture = overlay.frame_strip(frames, caption, columns=columns)
        pictures = [f.picture for f in frames]
        into = self._merges(col, n_groups * per_group)
        side = math.isqrt(per_group)
        if into is not None and side * side == per_group:
            col.merges = overlay.merge_strip(pictures, into, (side, side),
                                             merge_caption(col.name, into, per_frame=per_group), columns=columns)
        elif into is not None:
            col.merge_note = f"merges of {col.name} not drawn: a frame's {per_group} tokens form no square grid"
        found = placed_scores(spy.scores(n_groups), ids, token_id, n_groups * per_group, col.stats, spy.renumbered)
        if found is not None and side * side == per_group:
            name, values, partial = found
            col.stats["token_scores"] = [None if np.isnan(v) else float(v) for v in values]
            col.heatmap = overlay.score_strip(pictures, values, (side, side), [
                f"{name}: its token scores in each frame (yellow = high, ranked over the whole video), before it "
                "chose what to keep" + ("; dark: not scored (dropped by an earlier stage)" if partial else "")],
                columns=columns)
        elif record is not None and plan.get("frame_scores"):
            col.heatmap = overlay.score_strip(pictures, np.array(plan["frame_scores"], dtype=np.float64), (1, 1), [
                f"{record['method']}: its frame scores (yellow = high, ranked over the video; s on the kept-frames "
                "picture), before it chose the frames"], columns=columns)
        elif found is not None:
            col.heatmap_note = f"no score heatmap for {col.name}: a frame's {per_group} tokens form no square grid"
        else:
            col.heatmap_note = NO_HEATMAP.format(name=col.name)

    @staticmethod
    def _merges(col: Column, n_tokens: int) -> np.ndarray | None:
        """The request's composed ``merged_into`` (:func:`merged_into`) when it covers ``n_tokens``
        tokens; else None, with the column's note saying why no merge picture is drawn."""
        into = merged_into(col.stats)
        if into is None:
            col.merge_note = (f"no merge picture for {col.name}: no stage recorded which token merged into which "
                              "(the method only keeps or drops tokens; FastVID folds a token into several anchors, "
                              "HoliTom(inner=False)'s merges are not recorded)")
        elif into.size != n_tokens:
            col.merge_note = f"merges of {col.name} not drawn: they cover {into.size} tokens, the picture {n_tokens}"
            return None
        return into


NO_HEATMAP = ("no score heatmap for {name}: the demo draws the token scores of methods that rank by one score "
              "before choosing (FastV, PACT, AdaptInfer, CDPruner, VisionZip) and the frame scores of KeyScore and QuoTA")


def placed_scores(found: dict[str, tuple[torch.Tensor, torch.Tensor | None]], ids: torch.Tensor, token_id: int,
                  n: int, stats: dict[str, Any], renumbered: bool = False) -> tuple[str, np.ndarray, bool] | None:
    """(method, scores [n] of the first ``n`` placeholders of ``token_id`` in ``ids`` - NaN where
    unscored -, whether some are unscored) from :meth:`ScoreSpy.scores`; None when none fits.

    Scores of all ``n`` tokens are taken in order. An LLM-stage method that saw fewer (an earlier
    stage dropped some) is placed by its rows' position ids, unless an earlier stage merged, packed
    or ``renumbered`` them (then a position no longer names the placeholder the token came from)."""
    moved = any(r["stage"] != "llm" and ("merged_into" in r or any(v.get("packed") for v in r.get("videos") or []))
                for r in stats.get("stages", []))
    places = torch.nonzero(ids == token_id).squeeze(1)
    for name, (values, positions) in found.items():
        out = np.full(n, np.nan)
        if values.numel() == n:
            out[:] = values.numpy()
            return name, out, False
        if positions is not None and not moved and not renumbered and values.numel() < n:
            at = torch.searchsorted(places, positions.to(places.dtype)).clamp(max=places.numel() - 1)
            ok = (places[at] == positions) & (at < n)
            out[at[ok].numpy()] = values[ok].numpy()
            return name, out, True
    return None


def merged_into(stats: dict[str, Any]) -> np.ndarray | None:
    """For each visual token of the request's one image / video, the slot of the token it ended
    in after every merging stage (the stage records' ``merged_into``, composed in stage order:
    e.g. VisionZip's groups merged again by PACT); -1 = dropped. None when no stage merged."""
    into = None
    for record in stats.get("stages", []):
        if "merged_into" not in record:
            continue
        step = np.asarray(record["merged_into"][0], dtype=np.int64)
        into = step if into is None else np.where(into >= 0, step[into.clip(0)], -1)
    return into


def merge_caption(name: str, into: np.ndarray, per_frame: int | None = None) -> list[str]:
    """What a merge picture shows, with its counts."""
    slots, sizes = np.unique(into[into >= 0], return_counts=True)
    merged = int(sizes[sizes > 1].sum())
    where = " (across frames too)" if per_frame and bool(((into >= 0) & (into // per_frame != np.arange(into.size) // per_frame)).any()) else ""
    return [f"{name}: {into.size} tokens -> {slots.size}; {merged} of them merged into {int((sizes > 1).sum())} tokens{where}",
            "one colour per merged token (dot: the slot it sits at), plain: kept as it was, dark: dropped"]


def describe(entry: str) -> str:
    try:
        return " then ".join(summary(n) for n in entry.split("+"))
    except ValueError:
        return ""


def _visual_ids(config: Any) -> list[int]:
    return [int(getattr(config, a)) for a in ("image_token_id", "video_token_id") if getattr(config, a, None) is not None]


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def model_box(processor: Any, inputs: dict[str, Any], width: int, height: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of the part of a width x height upload the model sees: the centre crop
    of processors that resize the short side then crop (CLIP / LLaVA), else the whole picture."""
    ip = getattr(processor, "image_processor", None)
    size, crop = getattr(ip, "size", None) or {}, getattr(ip, "crop_size", None) or {}
    if not (getattr(ip, "do_center_crop", False) and "shortest_edge" in size and crop.get("height")):
        return (0, 0, width, height)
    scale = size["shortest_edge"] / min(width, height)
    cw, ch = min(width, crop["width"] / scale), min(height, crop["height"] / scale)
    x0, y0 = (width - cw) / 2, (height - ch) / 2
    return (round(x0), round(y0), round(x0 + cw), round(y0 + ch))


def video_placeholder(config: Any, ids: torch.Tensor) -> int:
    """The placeholder id of a video's rows in ``ids``: ``video_token_id``, or ``image_token_id`` where
    the processor writes the frames as images (GLM-4.1V, SmolVLM2, InternVL)."""
    video = getattr(config, "video_token_id", None)
    if video is not None and bool((ids == video).any()):
        return int(video)
    return int(config.image_token_id)


def image_grid(config: Any, inputs: dict[str, Any], n_tokens: int) -> tuple[int, int] | None:
    """(rows, cols) of one image's tokens: from ``image_grid_thw`` and the spatial merge
    (Qwen2-VL), else a square grid; None when the tokens form no single grid."""
    thw = inputs.get("image_grid_thw")
    if thw is not None:
        merge = getattr(config.vision_config, "spatial_merge_size", 1)
        grid = (int(thw[0, 1]) // merge, int(thw[0, 2]) // merge)
    else:
        side = math.isqrt(n_tokens)
        grid = (side, side)
    return grid if grid[0] * grid[1] == n_tokens else None
