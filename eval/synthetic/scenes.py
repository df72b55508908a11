"""Procedural scenes and clips for the offline quality benchmark.

Images: one coloured shape (or a few, or none) among grey clutter on a noisy background.
Clips: 16 frames of drifting grey clutter; the coloured shape the question is about shows up
in only 2-3 consecutive frames (or, for half the existence questions, never), so dropping
frames blindly loses the answer. Every sample is a pure
function of (kind, split, index, seed): train/val/test use disjoint seed streams, and a
hidden ``seed`` regenerates a private test set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (30, 185, 60),
    "blue": (40, 70, 235),
    "yellow": (235, 215, 30),
    "purple": (150, 50, 205),
    "orange": (245, 135, 20),
}
KINDS = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three")
IMAGE_QTYPES = ("colour", "exist", "position", "count", "kind")
VIDEO_QTYPES = ("colour", "exist", "position")
SPLITS = {"train": 0, "val": 1, "test": 2}
IMAGE_SIZE = 64
FRAME_SIZE = 32
NUM_FRAMES = 16
DEFAULT_SEED = 20240611

Kind = Literal["image", "video"]


@dataclass
class Sample:
    """One benchmark item.

    ``colour_map`` is the rendering ground truth: 0 for background and grey clutter, k for a
    shape of colour ``list(COLOURS)[k - 1]`` ([H, W] for images, [T, H, W] for clips).
    ``answer_frames`` lists the frames of a clip where the answer is visible.
    """

    question: str
    answer: str
    options: list[str]
    qtype: str
    colour_map: np.ndarray
    image: Image.Image | None = None
    frames: np.ndarray | None = None
    answer_frames: list[int] = field(default_factory=list)


@dataclass
class _Shape:
    kind: str
    x: float  # centre
    y: float
    size: float  # bounding-box side
    fill: tuple[int, int, int]
    label: int  # value written into the colour map (0 = grey)


def _polygon(shape: _Shape) -> list[tuple[float, float]]:
    h = shape.size / 2
    x, y = shape.x, shape.y
    if shape.kind == "square":
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if shape.kind == "triangle":
        return [(x, y - h), (x + h, y + h), (x - h, y + h)]
    raise ValueError(f"no polygon for kind {shape.kind!r}")


def _draw(draw: ImageDraw.ImageDraw, labels: ImageDraw.ImageDraw, shape: _Shape) -> None:
    h = shape.size / 2
    box = [shape.x - h, shape.y - h, shape.x + h, shape.y + h]
    if shape.kind == "circle":
        draw.ellipse(box, fill=shape.fill)
        labels.ellipse(box, fill=shape.label)
    else:
        draw.polygon(_polygon(shape), fill=shape.fill)
        labels.polygon(_polygon(shape), fill=shape.label)


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """Low-frequency grey blotches plus pixel noise, uint8 [size, size, 3]."""
    coarse = rng.uniform(70, 170, size=(6, 6)).astype(np.float32)
    smooth = np.asarray(Image.fromarray(coarse, mode="F").resize((size, size), Image.BILINEAR))
    tint = rng.uniform(-8, 8, size=3).astype(np.float32)
    noise = rng.normal(0, 10, size=(size, size, 3)).astype(np.float32)
    return np.clip(smooth[..., None] + tint + noise, 0, 255).astype(np.uint8)


def _grey_shape(rng: np.random.Generator, size: int, lo: float, hi: float) -> _Shape:
    s = rng.uniform(lo, hi)
    g = int(rng.uniform(40, 215))
    return _Shape(str(rng.choice(KINDS)), rng.uniform(0, size), rng.uniform(0, size), s, (g, g, g), 0)


def _coloured(rng: np.random.Generator, colour: str, x: float, y: float, size: float, kind: str | None = None) -> _Shape:
    label = list(COLOURS).index(colour) + 1
    return _Shape(kind or str(rng.choice(KINDS)), x, y, size, COLOURS[colour], label)


def _place(rng: np.random.Generator, n: int, size: int, obj: float, x_range: tuple[float, float] | None = None) -> list[tuple[float, float]]:
    """n non-overlapping centres for objects of side ``obj`` inside a ``size`` canvas."""
    margin = obj / 2 + 1
    lo_x, hi_x = x_range or (margin, size - margin)
    for _ in range(1000):
        pts = [(rng.uniform(lo_x, hi_x), rng.uniform(margin, size - margin)) for _ in range(n)]
        if all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) > obj + 2 for i, a in enumerate(pts) for b in pts[:i]):
            return pts
    raise RuntimeError(f"could not place {n} objects of size {obj} on a {size}px canvas")


def _render(rng: np.random.Generator, background: np.ndarray, clutter: list[_Shape], shapes: list[_Shape]) -> tuple[np.ndarray, np.ndarray]:
    size = background.shape[0]
    img = Image.fromarray(background)
    lab = Image.new("L", (size, size), 0)
    draw, labels = ImageDraw.Draw(img), ImageDraw.Draw(lab)
    for s in clutter + shapes:
        _draw(draw, labels, s)
    pixels = np.asarray(img).astype(np.int16) + rng.integers(-6, 7, size=(size, size, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8), np.asarray(lab)


def _question(qtype: str, colour: str, x: float, size: int, present: bool) -> tuple[str, str, list[str]]:
    """Question, answer and options about the one coloured shape (colour, x) or its absence."""
    if qtype == "colour":
        return "what colour is the shape ?", colour, list(COLOURS)
    if qtype == "exist":
        return "is there a coloured shape ?", "yes" if present else "no", ["yes", "no"]
    if qtype == "position":
        return "is the coloured shape left or right ?", "left" if x < size / 2 else "right", ["left", "right"]
    raise ValueError(f"unknown question type {qtype!r}")


def _image_sample(rng: np.random.Generator, qtype: str) -> Sample:
    size = IMAGE_SIZE
    clutter = [_grey_shape(rng, size, 6, 12) for _ in range(int(rng.integers(3, 7)))]
    names = list(COLOURS)
    if qtype == "count":
        n = int(rng.integers(1, 4))
        obj = rng.uniform(9, 12)
        shapes = [_coloured(rng, str(rng.choice(names)), x, y, obj) for x, y in _place(rng, n, size, obj)]
        question, answer, options = "how many coloured shapes are there ?", COUNTS[n - 1], list(COUNTS)
    elif qtype == "kind":
        obj = rng.uniform(16, 22)
        ((x, y),) = _place(rng, 1, size, obj)
        kind = str(rng.choice(KINDS))
        shapes = [_coloured(rng, str(rng.choice(names)), x, y, obj, kind)]
        question, answer, options = "what kind is the coloured shape ?", kind, list(KINDS)
    else:
        obj = rng.uniform(10, 14)
        side = (obj / 2 + 1, size * 0.4) if rng.random() < 0.5 else (size * 0.6, size - obj / 2 - 1)
        ((x, y),) = _place(rng, 1, size, obj, side if qtype == "position" else None)
        colour = str(rng.choice(names))
        present = qtype != "exist" or rng.random() < 0.5
        shapes = [_coloured(rng, colour, x, y, obj)] if present else []
        question, answer, options = _question(qtype, colour, x, size, present)
    pixels, labels = _render(rng, _background(rng, size), clutter, shapes)
    return Sample(question, answer, options, qtype, labels, image=Image.fromarray(pixels))


def _video_sample(rng: np.random.Generator, qtype: str) -> Sample:
    size, t = FRAME_SIZE, NUM_FRAMES
    span = int(rng.integers(2, 4))
    start = int(rng.integers(0, t - span + 1))
    present = qtype != "exist" or rng.random() < 0.5
    shown = list(range(start, start + span)) if present else []
    colour = str(rng.choice(list(COLOURS)))
    obj = rng.uniform(9, 12)
    side = (obj / 2 + 1, size * 0.4) if rng.random() < 0.5 else (size * 0.6, size - obj / 2 - 1)
    ((x, y),) = _place(rng, 1, size, obj, side)
    target = _coloured(rng, colour, x, y, obj)
    clutter = [_grey_shape(rng, size, 5, 9) for _ in range(int(rng.integers(2, 4)))]
    velocity = rng.uniform(-1.0, 1.0, size=(len(clutter), 2))
    background = _background(rng, size)
    frames, maps = [], []
    for f in range(t):
        moved = [_Shape(c.kind, c.x + f * v[0], c.y + f * v[1], c.size, c.fill, 0) for c, v in zip(clutter, velocity)]
        pixels, labels = _render(rng, background, moved, [target] if f in shown else [])
        frames.append(pixels)
        maps.append(labels)
    question, answer, options = _question(qtype, colour, x, size, present)
    return Sample(question, answer, options, qtype, np.stack(maps), frames=np.stack(frames), answer_frames=shown)


def make_sample(kind: Kind, split: str, index: int, seed: int | None = None, qtypes: tuple[str, ...] | None = None) -> Sample:
    """The ``index``-th sample of a split; question types cycle through ``qtypes``."""
    if kind not in ("image", "video"):
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    allowed = IMAGE_QTYPES if kind == "image" else VIDEO_QTYPES
    qtypes = qtypes or DEFAULT_QTYPES[kind]
    if unknown := set(qtypes) - set(allowed):
        raise ValueError(f"unknown {kind} question types {sorted(unknown)}; choose from {allowed}")
    base = DEFAULT_SEED if seed is None else seed
    rng = np.random.default_rng([base, 0 if kind == "image" else 1, SPLITS[split], index])
    qtype = qtypes[index % len(qtypes)]
    return _image_sample(rng, qtype) if kind == "image" else _video_sample(rng, qtype)


def make_dataset(kind: Kind, split: str, n: int, seed: int | None = None, qtypes: tuple[str, ...] | None = None) -> list[Sample]:
    """``n`` deterministic samples of ``kind`` ("image" | "video") from ``split`` (train/val/test).

    ``seed`` replaces the published base seed (a hidden test set); ``qtypes`` defaults to the
    question types the shipped models were trained on (``DEFAULT_QTYPES``).
    """
    return [make_sample(kind, split, i, seed, qtypes) for i in range(n)]


# What the shipped models answer. The video model is trained on position too but does not learn it
# within the training budget, so the default video mix leaves it out.
DEFAULT_QTYPES: dict[str, tuple[str, ...]] = {
    "image": ("colour", "exist", "position"),
    "video": ("colour", "exist"),
}
