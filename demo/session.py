"""One demo request: the unpruned and the pruned model on the same input, side by side.

``Session.run`` answers a question about an image or a video twice - unwrapped, then wrapped
with the chosen methods (``vlm_prune.wrap`` ... ``vlm_prune.unwrap``, under a lock so that
concurrent requests never interleave) - times one prefill forward pass of each
(time-to-first-token) and draws what the pruned model kept.
"""
from __future__ import annotations

import inspect
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

import vlm_prune
from vlm_prune.demo import overlay
from vlm_prune.registry import method_class
from vlm_prune.video import VideoError, read_frames

MediaKind = Literal["image", "video"]
log = logging.getLogger(__name__)
TIMING_REPEATS = 3  # timed prefill passes per model (after one warm-up); the fastest is reported
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
        frames, _ = read_frames(path, num_frames=num_frames, timeout=VIDEO_TIMEOUT_S)
    except VideoError as err:
        log.info("%s is not a readable video: %s", path, err)
        raise DemoError(
            f"{path.name!r} is neither an image nor a readable video; upload a PNG/JPEG image or an MP4/AVI/WebM video"
        ) from None
    if frames.shape[0] == 0:
        raise DemoError(f"the video {path.name!r} has no frames; upload a longer clip")
    return Media("video", frames=frames)


@dataclass
class LoadedModel:
    """A model ready for requests, with what the user should know about it."""

    model: torch.nn.Module
    processor: Any
    name: str
    notes: list[str] = field(default_factory=list)
    #: lower-case the question and split off "?" (the synthetic models' word-level vocabulary)
    word_level: bool = False

    @property
    def depth(self) -> int:
        return int(self.model.config.get_text_config().num_hidden_layers)

    def takes(self, kind: MediaKind) -> bool:
        if kind == "image":
            return getattr(self.processor, "image_processor", None) is not None
        return getattr(self.processor, "video_processor", None) is not None and hasattr(self.model.config, "video_token_id")


def load_synthetic(kind: MediaKind) -> LoadedModel:
    """The shipped tiny synthetic model of ``kind``; an untrained one (with a note) when its
    weights are not there."""
    from vlm_prune.eval.synthetic import build_model, build_processor, load, model_path

    name = f"synthetic {kind} model"
    try:
        model, processor = load(kind)
        notes = [f"{name} from {model_path(kind)}"]
    except FileNotFoundError:
        model, processor = build_model(kind).eval(), build_processor(kind)
        notes = [(
            f"no trained weights at {model_path(kind)}: the {name} is UNTRAINED, its answers are noise "
            f"(train it with `python -m vlm_prune.eval.synthetic.train --kind {kind}`)"
        )]
    notes.append(f"the {name} is a toy of {model.config.get_text_config().num_hidden_layers} decoder layers: its "
                 "timings are mostly fixed overhead; pruning speeds up models of real size")
    return LoadedModel(model, processor, name, notes, word_level=True)


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
    except (OSError, ValueError) as err:
        raise DemoError(f"could not load {model_id!r} as an image-text-to-text model: {err}") from err
    model = model.to("cuda" if cuda else "cpu").eval()
    return LoadedModel(model, processor, model_id, [f"{model_id} ({model.dtype}, {model.device})"])


def build_pipeline(methods: list[str] | str, layer: int | None) -> list[Any]:
    """Method objects for the chosen names; "a+b" entries are split into stages. ``layer``
    (when > 0) replaces the default prune layer of in-LLM methods that take one."""
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
            pipeline.append(cls(layer=int(layer)) if layer and "layer" in inspect.signature(cls.__init__).parameters
                            else cls())
        except ImportError as err:  # an optional dependency of the method (e.g. KeyScore's STACFP)
            raise DemoError(str(err)) from None
    return pipeline


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
        inputs = processor(videos=[media.frames], text=[text], return_tensors="pt")
    model = loaded.model
    return {
        k: v.to(model.device, model.dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor) else v
        for k, v in inputs.items()
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_prefill(model: torch.nn.Module, inputs: dict[str, Any], repeats: int = TIMING_REPEATS) -> float:
    """Seconds of one prefill forward pass (time to first token): the best of ``repeats``
    after a warm-up, the least disturbed by other work on the machine."""
    model(**inputs)
    times = []
    for _ in range(repeats):
        _sync(model.device)
        t0 = time.perf_counter()
        model(**inputs)
        _sync(model.device)
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def answer(loaded: LoadedModel, inputs: dict[str, Any], max_new_tokens: int) -> str:
    out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    return loaded.processor.tokenizer.decode(new, skip_special_tokens=True).strip()


@dataclass
class Outcome:
    """Everything one request shows."""

    answer_unpruned: str
    answer_pruned: str
    ttft_unpruned: float
    ttft_pruned: float
    stats: dict[str, Any]
    picture: Image.Image
    notes: list[str]
    pipeline: str

    @property
    def speedup(self) -> float:
        return self.ttft_unpruned / self.ttft_pruned if self.ttft_pruned > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        """JSON-ready stats: the wrapped model's last_stats plus the timings."""
        return {
            "pipeline": self.pipeline,
            "answer_unpruned": self.answer_unpruned,
            "answer_pruned": self.answer_pruned,
            "ttft_unpruned_s": self.ttft_unpruned,
            "ttft_pruned_s": self.ttft_pruned,
            "speedup": self.speedup,
            **self.stats,
        }

    def markdown(self) -> str:
        tin = sum(self.stats["visual_tokens_in"])
        tout = sum(self.stats["visual_tokens_out"])
        lines = [
            f"| | unpruned | pruned: `{self.pipeline}` |",
            "|---|---|---|",
            f"| answer | {self.answer_unpruned or '(empty)'} | {self.answer_pruned or '(empty)'} |",
            f"| visual tokens | {tin} | {tout} ({tout / max(tin, 1):.0%}) |",
            f"| time to first token | {self.ttft_unpruned * 1e3:.1f} ms | {self.ttft_pruned * 1e3:.1f} ms |",
            "",
            f"**speed-up of the first token: x{self.speedup:.2f}**",
            "",
            "| stage | method | tokens in -> out | seconds |",
            "|---|---|---|---|",
        ]
        for r in self.stats["stages"]:
            where = f"llm (layer {r['layer']})" if "layer" in r else r["stage"]
            lines.append(f"| {where} | {r['method']} | {sum(r['tokens_in'])} -> {sum(r['tokens_out'])} | {r['seconds']:.4f} |")
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)


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

    def default_layer(self) -> int:
        """The prune layer the UI proposes: 0 = each method's own default, or 1 on a model too
        shallow for those defaults (PACT prunes before layer 4, so fewer than 5 decoder layers)."""
        depths = [m.depth for m in self.models.values() if m is not None]
        return 1 if min(depths) < 5 else 0

    def run(self, path: str | Path | None, question: str, methods: list[str] | str, keep: float,
            layer: int | None = None, progress: Progress | None = None) -> Outcome:
        """Answer ``question`` about the file at ``path`` unpruned and pruned; see the module doc."""
        step = progress or (lambda frac, desc: None)
        if not path:
            raise DemoError("upload an image or a video first (or click one of the examples)")
        if not question or not question.strip():
            raise DemoError("type a question about the image or video")
        if not 0 < float(keep) <= 1:
            raise DemoError(f"keep must be in (0, 1], got {keep}")
        pipeline = build_pipeline(methods, layer)
        step(0.05, "reading the upload")
        media = read_media(path, self.num_frames)
        loaded = self.models[media.kind]
        if loaded is None or not loaded.takes(media.kind):
            raise DemoError(f"this demo's model does not take {media.kind}s; upload an "
                            f"{'image' if media.kind == 'video' else 'video'} instead")
        notes = list(loaded.notes)
        if loaded.word_level:
            question = normalise_question(question)
        inputs = encode(loaded, media, question)
        unk = getattr(loaded.processor.tokenizer, "unk_token_id", None)
        if unk is not None and bool((inputs["input_ids"] == unk).any()):
            notes.append("some words of the question are not in this model's vocabulary (read as <unk>)")
        with self.lock:
            return self._compare(loaded, media, inputs, pipeline, float(keep), notes, step)

    def _compare(self, loaded: LoadedModel, media: Media, inputs: dict[str, Any], pipeline: list[Any],
                 keep: float, notes: list[str], step: Progress) -> Outcome:
        model = loaded.model
        self._wrap(loaded, pipeline, keep)  # fail fast on a pipeline the model does not take
        vlm_prune.unwrap(model)
        step(0.15, "unpruned model: answer")
        answer_full = answer(loaded, inputs, self.max_new_tokens)
        step(0.3, "unpruned model: time to first token")
        ttft_full = time_prefill(model, inputs, self.timing_repeats)
        step(0.45, "wrapping")
        self._wrap(loaded, pipeline, keep)
        try:
            step(0.55, "pruned model: time to first token")
            ttft_pruned = time_prefill(model, inputs, self.timing_repeats)
            stats = dict(model.vlm_prune.last_stats)
            rows = model.vlm_prune.last_rows[0].cpu()
            step(0.75, "pruned model: answer")
            answer_pruned = answer(loaded, inputs, self.max_new_tokens)
        finally:
            vlm_prune.unwrap(model)
        step(0.9, "drawing what was kept")
        name = "+".join(m.name for m in pipeline)
        draw = self._draw_image if media.kind == "image" else self._draw_video
        picture, extra = draw(loaded, media, inputs, rows, stats, name)
        return Outcome(answer_full, answer_pruned, ttft_full, ttft_pruned, {**stats, **extra}, picture, notes, name)

    @staticmethod
    def _wrap(loaded: LoadedModel, pipeline: list[Any], keep: float) -> None:
        try:
            vlm_prune.wrap(loaded.model, pipeline, keep=keep, processor=loaded.processor)
        except (ValueError, TypeError, RuntimeError) as err:
            raise DemoError(f"cannot prune this model with {'+'.join(m.name for m in pipeline)}: {err}") from None

    def _draw_image(self, loaded: LoadedModel, media: Media, inputs: dict[str, Any], rows: torch.Tensor,
                    stats: dict[str, Any], name: str) -> tuple[Image.Image, dict[str, Any]]:
        ids = inputs["input_ids"][0].cpu()
        kept = overlay.kept_placeholders(ids, rows, loaded.model.config.image_token_id).numpy()
        pixels = inputs["pixel_values"]
        if pixels.dim() == 4:  # one [3, H, W] picture per image: show it as the tower saw it (crop included)
            ip = loaded.processor.image_processor
            picture = overlay.model_view(pixels[0], getattr(ip, "image_mean", None), getattr(ip, "image_std", None))
        else:  # patch sequences (Qwen2-VL) or tiles (LLaVA-NeXT): the upload itself
            picture = np.asarray(media.image)
        caption = [f"{name}: kept {int(kept.sum())} of {kept.size} image tokens ({kept.mean():.0%})",
                   "bright, outlined: kept   dark: dropped (or merged into a kept token)"]
        extra = {"kept_grid": kept.astype(int).tolist()}
        grid = image_grid(loaded.model.config, inputs, kept.size)
        if grid is None:
            caption[1] = "this model's image tokens form no single grid (tiles, newlines): kept/dropped not drawn"
            return overlay.plain_view(picture, caption), extra
        return overlay.grid_overlay(picture, kept, grid, caption), extra

    def _draw_video(self, loaded: LoadedModel, media: Media, inputs: dict[str, Any], rows: torch.Tensor,
                    stats: dict[str, Any], name: str) -> tuple[Image.Image, dict[str, Any]]:
        ids = inputs["input_ids"][0].cpu()
        kept = overlay.kept_placeholders(ids, rows, loaded.model.config.video_token_id).numpy()
        thw = inputs.get("video_grid_thw")
        # token groups in time: one per frame, or one per temporal patch (Qwen2-VL merges 2 frames)
        n_groups = int(thw[0, 0]) if thw is not None else media.frames.shape[0]
        per_group_kept, per_group = overlay.frames_kept(kept, n_groups)
        record = next((r for r in stats["stages"] if r["stage"] == "frames" and r.get("videos")), None)
        plan = record["videos"][0] if record else {}
        scores = plan.get("frame_scores") or [None] * n_groups
        budgets = plan.get("tokens_per_frame") or [None] * n_groups
        stride = media.frames.shape[0] / n_groups
        frames = [overlay.FrameInfo(media.frames[int(t * stride)], per_group_kept[t], per_group, scores[t], budgets[t])
                  for t in range(n_groups)]
        shown = sum(k > 0 for k in per_group_kept)
        caption = [f"{name}: {shown} of {n_groups} frames keep tokens, {int(kept.sum())} of {kept.size} video tokens",
                   "s = frame score of the frames-stage method, b = its token budget; grey frames are dropped"]
        extra = {"frames_kept_tokens": per_group_kept, "tokens_per_frame": per_group}
        return overlay.frame_strip(frames, caption), extra


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
