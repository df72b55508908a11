"""Procedural scenes and clips for the offline quality benchmark.

Images (64 x 64) hold coloured shapes and 3 x 5-pixel digits among grey clutter on a noisy
background; clips are 16 frames of 32 x 32 with drifting clutter where the objects a question is
about show up in only a few frames. Each question type ("family") mirrors what the literature
finds hard for token pruning:

image  count     how many instances of one colour (all of them must survive)
       binding   several coloured shapes, "what colour is the triangle ?" (query-dependent)
       relation  "is the red shape left of the blue shape ?" (two objects)
       global    "what colour is the background ?" (every background token holds the answer)
       digit     "which digit is coloured ?" (a 3 x 5 font scaled up: an OCR stand-in)
video  order     "which colour came first ?" (two objects, temporal order)
       times     "how many times does the red shape appear ?" (every appearance must survive)
       glimpse   "what colour is the shape ?", shown in one frame only
       small     "is there a red shape ?", small shapes among clutter and other colours
The first benchmark's single-object families (colour, exist, position, kind) stay available.

``Difficulty`` holds the public knobs (clutter, object size, colour saturation, frames showing
the answer). Every sample is a pure function of (kind, split, index, seed, difficulty):
train/val/test use disjoint seed streams, and a hidden ``seed`` regenerates a private test set.
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
DIGITS = tuple(str(d) for d in range(10))
#: object kinds written into ``Sample.kind_map`` (value = index + 1)
OBJECT_KINDS = KINDS + tuple(f"digit {d}" for d in DIGITS)
COUNTS = ("one", "two", "three", "four")
BACKGROUND_TINTS = ("red", "green", "blue", "yellow")
IMAGE_QTYPES = ("count", "binding", "relation", "global", "digit", "colour", "exist", "position", "kind")
VIDEO_QTYPES = ("order", "times", "glimpse", "small", "colour", "exist", "position")
SPLITS = {"train": 0, "val": 1, "test": 2}
IMAGE_SIZE = 64
FRAME_SIZE = 32
NUM_FRAMES = 16
DEFAULT_SEED = 20240611

# 3 x 5 pixel font, rows top to bottom
FONT = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
}

Kind = Literal["image", "video"]


@dataclass(frozen=True)
class Difficulty:
    """The generator's difficulty knobs (defaults: the shipped models' training distribution).

    clutter: (min, max) grey clutter shapes per image or clip (default 3-6 per image, 2-4 per
    clip); size: multiplier of every object's
    size (shapes and digits); saturation: colour saturation of the objects (1 = pure colour,
    0 = grey); clutter_saturation: tint of the clutter in a random colour (0 = grey);
    answer_frames: (min, max) frames of a clip that show the answer (families other than glimpse,
    which always shows it in one frame, and order / times, which fix their own runs).
    """

    clutter: tuple[int, int] | None = None
    size: float = 1.0
    saturation: float = 1.0
    clutter_saturation: float = 0.0
    answer_frames: tuple[int, int] = (2, 3)

    def __post_init__(self) -> None:
        if self.clutter is not None and not 0 <= self.clutter[0] <= self.clutter[1]:
            raise ValueError(f"clutter must be (min, max) with 0 <= min <= max, got {self.clutter}")
        if not 0.5 <= self.size <= 2.0:
            raise ValueError(f"size must lie in [0.5, 2.0], got {self.size}")
        if not (0 <= self.saturation <= 1 and 0 <= self.clutter_saturation <= 1):
            raise ValueError("saturation and clutter_saturation must lie in [0, 1]")
        if not 1 <= self.answer_frames[0] <= self.answer_frames[1] <= NUM_FRAMES // 2:
            raise ValueError(f"answer_frames must be (min, max) within 1..{NUM_FRAMES // 2}, got {self.answer_frames}")


@dataclass
class Sample:
    """One benchmark item.

    ``colour_map`` is the rendering ground truth: 0 for background and grey clutter, k for an
    object of colour ``list(COLOURS)[k - 1]`` ([H, W] for images, [T, H, W] for clips);
    ``kind_map`` the same for the object's kind (``OBJECT_KINDS[k - 1]``).
    ``answer_frames`` lists the frames of a clip where an object the question is about is visible.
    """

    question: str
    answer: str
    options: list[str]
    qtype: str
    colour_map: np.ndarray
    kind_map: np.ndarray
    image: Image.Image | None = None
    frames: np.ndarray | None = None
    answer_frames: list[int] = field(default_factory=list)


@dataclass
class _Shape:
    kind: str  # a KINDS entry or a digit "0".."9"
    x: float  # centre
    y: float
    size: float  # bounding-box side (height for digits)
    fill: tuple[int, int, int]
    label: int  # colour index + 1 written into the colour map (0 = clutter)


def _polygon(shape: _Shape) -> list[tuple[float, float]]:
    h = shape.size / 2
    x, y = shape.x, shape.y
    if shape.kind == "square":
        return [(x - h, y - h), (x + h, y - h), (x + h, y + h), (x - h, y + h)]
    if shape.kind == "triangle":
        return [(x, y - h), (x + h, y + h), (x - h, y + h)]
    raise ValueError(f"no polygon for kind {shape.kind!r}")


def _digit_cells(shape: _Shape) -> list[list[float]]:
    """Rectangles of the lit font cells of a digit whose height is ``shape.size``."""
    cell = max(1, round(shape.size / 5))
    left, top = round(shape.x - 1.5 * cell), round(shape.y - 2.5 * cell)
    return [[left + c * cell, top + r * cell, left + (c + 1) * cell - 1, top + (r + 1) * cell - 1]
            for r, row in enumerate(FONT[shape.kind]) for c, lit in enumerate(row) if lit == "1"]


def _draw(draws: tuple[ImageDraw.ImageDraw, ImageDraw.ImageDraw, ImageDraw.ImageDraw], shape: _Shape) -> None:
    kind_label = OBJECT_KINDS.index(shape.kind if shape.kind in KINDS else f"digit {shape.kind}") + 1 if shape.label else 0
    for draw, fill in zip(draws, (shape.fill, shape.label, kind_label)):
        if shape.kind in FONT:
            for box in _digit_cells(shape):
                draw.rectangle(box, fill=fill)
            continue
        h = shape.size / 2
        box = [shape.x - h, shape.y - h, shape.x + h, shape.y + h]
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon(_polygon(shape), fill=fill)


def _background(rng: np.random.Generator, size: int, tint: tuple[int, int, int] | None = None, strength: float = 0.0) -> np.ndarray:
    """Low-frequency grey blotches plus pixel noise, optionally tinted, uint8 [size, size, 3]."""
    coarse = rng.uniform(70, 170, size=(6, 6)).astype(np.float32)
    smooth = np.asarray(Image.fromarray(coarse, mode="F").resize((size, size), Image.BILINEAR))
    shift = rng.uniform(-8, 8, size=3).astype(np.float32)
    if tint is not None:
        shift = shift + strength * (np.asarray(tint, np.float32) - 128)
    noise = rng.normal(0, 10, size=(size, size, 3)).astype(np.float32)
    return np.clip(smooth[..., None] + shift + noise, 0, 255).astype(np.uint8)


def _fill(colour: str, saturation: float) -> tuple[int, int, int]:
    rgb = np.asarray(COLOURS[colour], np.float32)
    grey = rgb.mean()
    return tuple(int(round(v)) for v in grey + saturation * (rgb - grey))


def _clutter(rng: np.random.Generator, size: int, lo: float, hi: float, d: Difficulty, default: tuple[int, int],
             digits: bool = False) -> list[_Shape]:
    out = []
    low, high = d.clutter or default
    for _ in range(int(rng.integers(low, high + 1))):
        g = float(rng.uniform(40, 215))
        rgb = np.asarray(COLOURS[str(rng.choice(list(COLOURS)))], np.float32)
        fill = tuple(int(np.clip(g + d.clutter_saturation * (v - rgb.mean()), 0, 255)) for v in rgb)
        kind = str(rng.choice(DIGITS)) if digits and rng.random() < 0.5 else str(rng.choice(KINDS))
        out.append(_Shape(kind, rng.uniform(0, size), rng.uniform(0, size), rng.uniform(lo, hi), fill, 0))
    return out


def _object(colour: str, x: float, y: float, size: float, kind: str, d: Difficulty) -> _Shape:
    return _Shape(kind, x, y, size, _fill(colour, d.saturation), list(COLOURS).index(colour) + 1)


def _place(rng: np.random.Generator, n: int, size: int, obj: float, x_range: tuple[float, float] | None = None,
           min_dx: float = 0.0) -> list[tuple[float, float]]:
    """n non-overlapping centres for objects of side ``obj`` inside a ``size`` canvas."""
    margin = obj / 2 + 1
    lo_x, hi_x = x_range or (margin, size - margin)
    for _ in range(2000):
        pts = [(rng.uniform(lo_x, hi_x), rng.uniform(margin, size - margin)) for _ in range(n)]
        if all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) > obj + 2 and abs(a[0] - b[0]) >= min_dx
               for i, a in enumerate(pts) for b in pts[:i]):
            return pts
    raise RuntimeError(f"could not place {n} objects of size {obj:.1f} on a {size}px canvas; lower Difficulty.size")


def _render(rng: np.random.Generator, background: np.ndarray, clutter: list[_Shape], shapes: list[_Shape]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    size = background.shape[0]
    img = Image.fromarray(background)
    colours, kinds = Image.new("L", (size, size), 0), Image.new("L", (size, size), 0)
    draws = (ImageDraw.Draw(img), ImageDraw.Draw(colours), ImageDraw.Draw(kinds))
    for s in clutter + shapes:
        _draw(draws, s)
    pixels = np.asarray(img).astype(np.int16) + rng.integers(-6, 7, size=(size, size, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8), np.asarray(colours), np.asarray(kinds)


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str], n: int) -> list[str]:
    return [str(c) for c in rng.choice(list(options), size=n, replace=False)]


# ---- image families -------------------------------------------------------------------------------
def _single(rng: np.random.Generator, qtype: str, d: Difficulty) -> tuple[list[_Shape], str, str, list[str]]:
    """The first benchmark's families about one coloured shape: colour, exist, position, kind."""
    size, names = IMAGE_SIZE, list(COLOURS)
    colour = str(rng.choice(names))
    if qtype == "kind":
        obj = rng.uniform(16, 22) * d.size
        ((x, y),) = _place(rng, 1, size, obj)
        kind = str(rng.choice(KINDS))
        return [_object(colour, x, y, obj, kind, d)], "what kind is the coloured shape ?", kind, list(KINDS)
    obj = rng.uniform(10, 14) * d.size
    side = (obj / 2 + 1, size * 0.4) if rng.random() < 0.5 else (size * 0.6, size - obj / 2 - 1)
    ((x, y),) = _place(rng, 1, size, obj, side if qtype == "position" else None)
    present = qtype != "exist" or rng.random() < 0.5
    shapes = [_object(colour, x, y, obj, str(rng.choice(KINDS)), d)] if present else []
    return (shapes, *_single_question(qtype, colour, x, size, present))


def _single_question(qtype: str, colour: str, x: float, size: int, present: bool) -> tuple[str, str, list[str]]:
    if qtype == "colour":
        return "what colour is the shape ?", colour, list(COLOURS)
    if qtype == "exist":
        return "is there a coloured shape ?", "yes" if present else "no", ["yes", "no"]
    if qtype == "position":
        return "is the coloured shape left or right ?", "left" if x < size / 2 else "right", ["left", "right"]
    raise ValueError(f"unknown question type {qtype!r}")


def _image_sample(rng: np.random.Generator, qtype: str, d: Difficulty) -> Sample:
    size, names = IMAGE_SIZE, list(COLOURS)
    tint = None
    if qtype == "count":
        colour, *others = _pick(rng, names, 3)
        n, extra = int(rng.integers(1, 5)), int(rng.integers(0, 3))
        obj = rng.uniform(8, 11) * d.size
        spots = _place(rng, n + extra, size, obj)
        paint = [colour] * n + [str(rng.choice(others)) for _ in range(extra)]
        shapes = [_object(c, x, y, obj, str(rng.choice(KINDS)), d) for c, (x, y) in zip(paint, spots)]
        question, answer, options = f"how many {colour} shapes are there ?", COUNTS[n - 1], list(COUNTS)
    elif qtype == "binding":
        colours, kinds = _pick(rng, names, 3), _pick(rng, KINDS, 3)
        obj = rng.uniform(13, 17) * d.size
        shapes = [_object(c, x, y, obj, k, d) for c, k, (x, y) in zip(colours, kinds, _place(rng, 3, size, obj))]
        asked = int(rng.integers(0, 3))
        question, answer, options = f"what colour is the {kinds[asked]} ?", colours[asked], names
    elif qtype == "relation":
        a, b = _pick(rng, names, 2)
        obj = rng.uniform(10, 13) * d.size
        (xa, ya), (xb, yb) = _place(rng, 2, size, obj, min_dx=obj + 4)
        shapes = [_object(a, xa, ya, obj, str(rng.choice(KINDS)), d), _object(b, xb, yb, obj, str(rng.choice(KINDS)), d)]
        question, answer, options = f"is the {a} shape left of the {b} shape ?", "yes" if xa < xb else "no", ["yes", "no"]
    elif qtype == "global":
        tint = str(rng.choice(BACKGROUND_TINTS))
        obj = rng.uniform(9, 13) * d.size
        decoys = _pick(rng, names, int(rng.integers(1, 3)))
        shapes = [_object(c, x, y, obj, str(rng.choice(KINDS)), d) for c, (x, y) in zip(decoys, _place(rng, len(decoys), size, obj))]
        question, answer, options = "what colour is the background ?", tint, list(BACKGROUND_TINTS)
    elif qtype == "digit":
        digit = str(rng.choice(DIGITS))
        height = 15 * d.size
        ((x, y),) = _place(rng, 1, size, height)
        shapes = [_object(str(rng.choice(names)), x, y, height, digit, d)]
        question, answer, options = "which digit is coloured ?", digit, list(DIGITS)
    else:
        shapes, question, answer, options = _single(rng, qtype, d)
    clutter = _clutter(rng, size, 6 * d.size, 12 * d.size, d, (3, 6), digits=qtype == "digit")
    background = _background(rng, size, COLOURS[tint] if tint else None, 0.45 * d.saturation)
    pixels, colours, kinds = _render(rng, background, clutter, shapes)
    return Sample(question, answer, options, qtype, colours, kinds, image=Image.fromarray(pixels))


# ---- video families -------------------------------------------------------------------------------
def _runs(rng: np.random.Generator, lengths: list[int], gap: int, t: int = NUM_FRAMES) -> list[list[int]]:
    """Disjoint runs of consecutive frames with the given lengths, in time order, >= ``gap`` apart."""
    slack = t - sum(lengths) - gap * (len(lengths) - 1)
    if slack < 0:
        raise ValueError(f"runs {lengths} with gap {gap} do not fit in {t} frames")
    shifts = np.sort(rng.integers(0, slack + 1, size=len(lengths)))
    starts = [int(shifts[i]) + sum(lengths[:i]) + gap * i for i in range(len(lengths))]
    return [list(range(s, s + n)) for s, n in zip(starts, lengths)]


def _video_sample(rng: np.random.Generator, qtype: str, d: Difficulty) -> Sample:
    size, t, names = FRAME_SIZE, NUM_FRAMES, list(COLOURS)
    obj = rng.uniform(9, 12) * d.size
    lo, hi = d.answer_frames
    shown: dict[int, list[_Shape]] = {}  # frame -> objects on it

    def show(frames: list[int], shape: _Shape) -> None:
        for f in frames:
            shown.setdefault(f, []).append(shape)

    def anywhere(colour: str, o: float = obj) -> _Shape:
        ((x, y),) = _place(rng, 1, size, o)
        return _object(colour, x, y, o, str(rng.choice(KINDS)), d)

    answer_frames: list[int] = []
    if qtype == "order":
        a, b = _pick(rng, names, 2)
        first, second = _runs(rng, [int(rng.integers(1, 3)), int(rng.integers(1, 3))], gap=1)
        show(first, anywhere(a))
        show(second, anywhere(b))
        answer_frames = first + second
        question, answer, options = "which colour came first ?", a, names
    elif qtype == "times":
        colour, other = _pick(rng, names, 2)
        k = int(rng.integers(1, 5))
        runs = _runs(rng, [int(rng.integers(1, 3)) for _ in range(k)], gap=2)
        for run in runs:
            show(run, anywhere(colour))
        answer_frames = [f for run in runs for f in run]
        free = [f for f in range(t) if f not in answer_frames]
        decoy = sorted(rng.choice(free, size=int(rng.integers(0, 3)), replace=False).tolist())
        show(decoy, anywhere(other))
        question, answer, options = f"how many times does the {colour} shape appear ?", COUNTS[k - 1], list(COUNTS)
    elif qtype == "small":
        colour, *others = _pick(rng, names, 3)
        small = rng.uniform(4, 6) * d.size
        present = rng.random() < 0.5
        if present:
            (answer_frames,) = _runs(rng, [int(rng.integers(lo, hi + 1))], gap=0)
            show(answer_frames, anywhere(colour, small))
        for other in others[: int(rng.integers(1, 3))]:
            (run,) = _runs(rng, [int(rng.integers(lo, hi + 1))], gap=0)
            show(run, anywhere(other, small))
        question, answer, options = f"is there a {colour} shape ?", "yes" if present else "no", ["yes", "no"]
    elif qtype in ("glimpse", "colour", "exist", "position"):
        span = 1 if qtype == "glimpse" else int(rng.integers(lo, hi + 1))
        present = qtype != "exist" or rng.random() < 0.5
        colour = str(rng.choice(names))
        side = (obj / 2 + 1, size * 0.4) if rng.random() < 0.5 else (size * 0.6, size - obj / 2 - 1)
        ((x, y),) = _place(rng, 1, size, obj, side)
        if present:
            (answer_frames,) = _runs(rng, [span], gap=0)
            show(answer_frames, _object(colour, x, y, obj, str(rng.choice(KINDS)), d))
        question, answer, options = _single_question("colour" if qtype == "glimpse" else qtype, colour, x, size, present)
    else:
        raise ValueError(f"unknown video question type {qtype!r}")
    clutter = _clutter(rng, size, 5 * d.size, 9 * d.size, d, (2, 4))
    velocity = rng.uniform(-1.0, 1.0, size=(len(clutter), 2))
    background = _background(rng, size)
    frames, colours, kinds = [], [], []
    for f in range(t):
        moved = [_Shape(c.kind, c.x + f * v[0], c.y + f * v[1], c.size, c.fill, 0) for c, v in zip(clutter, velocity)]
        pixels, colour_map, kind_map = _render(rng, background, moved, shown.get(f, []))
        frames.append(pixels)
        colours.append(colour_map)
        kinds.append(kind_map)
    return Sample(question, answer, options, qtype, np.stack(colours), np.stack(kinds), frames=np.stack(frames),
                  answer_frames=sorted(answer_frames))


def make_sample(kind: Kind, split: str, index: int, seed: int | None = None, qtypes: tuple[str, ...] | None = None,
                difficulty: Difficulty | None = None) -> Sample:
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
    d = difficulty or Difficulty()
    return _image_sample(rng, qtype, d) if kind == "image" else _video_sample(rng, qtype, d)


def make_dataset(kind: Kind, split: str, n: int, seed: int | None = None, qtypes: tuple[str, ...] | None = None,
                 difficulty: Difficulty | None = None) -> list[Sample]:
    """``n`` deterministic samples of ``kind`` ("image" | "video") from ``split`` (train/val/test).

    ``seed`` replaces the published base seed (a hidden test set); ``qtypes`` defaults to the
    families the shipped models answer (``DEFAULT_QTYPES``); ``difficulty`` to ``Difficulty()``.
    """
    return [make_sample(kind, split, i, seed, qtypes, difficulty) for i in range(n)]


#: the families the shipped models are trained on and the bench asks
DEFAULT_QTYPES: dict[str, tuple[str, ...]] = {
    "image": ("count", "binding", "relation", "global", "digit"),
    "video": ("order", "times", "glimpse", "small"),
}
