"""Pictures of what a pruned model kept: a grid overlay for images, a frame strip for videos.

Both work from what every wrapped model reports: ``model.vlm_prune.last_rows`` (the input
position of each row the last prefill returned) and the positions of the visual placeholder
tokens in ``input_ids``. Pictures are drawn on the upload at its own resolution, the part the
model's processor crops away greyed out. In the kept / dropped overlay a token merged into
another is drawn as dropped; merging methods (PACT, ToMe, VisionZip) also get a picture of their
groups from ``last_stats`` (``merged_into``): one colour per merged token. Methods that rank
tokens by a score get a heatmap of those scores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

KEPT_OUTLINE = (34, 197, 94)  # green
MERGED_OUTLINE = (245, 158, 11)  # amber: merged with others into one token
DROPPED_TINT = (40, 40, 48)
DROPPED_ALPHA = 0.65  # how far a dropped cell is pulled towards the tint
CAPTION_BG = (24, 24, 32)
CAPTION_FG = (240, 240, 240)
MAX_SIDE = 1600  # an upload is drawn at its own resolution, shrunk to this long side at most
MIN_WIDTH = 448  # ... and tiny pictures are enlarged to this width
OUTSIDE_TINT = (128, 128, 128)  # what the model's processor crops away
OUTSIDE_ALPHA = 0.75
HEAT_STOPS = ((48, 18, 59), (33, 145, 140), (253, 231, 37))  # dark blue -> teal -> yellow
HEAT_ALPHA = 0.6
# merged groups: a colour-blind-safe qualitative palette (Okabe-Ito, then Paul Tol's bright and light
# sets); neighbouring groups get different colours (greedy colouring of the grid's adjacency)
GROUP_COLOURS = (
    (230, 159, 0), (86, 180, 233), (0, 158, 115), (240, 228, 66), (0, 114, 178), (213, 94, 0), (204, 121, 167),
    (68, 119, 170), (102, 204, 238), (34, 136, 51), (204, 187, 68), (238, 102, 119), (170, 51, 119),
    (153, 221, 255), (68, 187, 153), (187, 204, 51), (238, 136, 102), (255, 170, 187),
)
GROUP_ALPHA = 0.6
GROUP_EDGE = (255, 255, 255)
FRAME_SIDE = 112  # width of one frame in the strip
STRIP_COLUMNS = 8
LABEL_SIZE = 14  # frame labels in the strip (pixels at the strip's own size)
#: frames per strip row for 1, 2, 3, 4 method columns side by side: the page shrinks a column's
#: picture to the column, so fewer frames per row keep the labels readable (about 12 px or more)
STRIP_COLUMNS_FOR = {1: 8, 2: 4, 3: 3, 4: 2}


def strip_columns(n_methods: int) -> int:
    """Frames per strip row when ``n_methods`` columns are shown side by side."""
    return STRIP_COLUMNS_FOR.get(max(1, n_methods), 2)


def token_fate(slots_kept: np.ndarray, into: np.ndarray | None) -> np.ndarray:
    """Where each visual token of an image / video ended: int [N], the placeholder slot whose
    output row holds it (itself when kept in place), -1 when dropped.

    ``slots_kept`` bool [N]: the placeholder slots holding an output row of the last prefill
    (:func:`kept_placeholders`). ``into``: the composed ``merged_into`` of the merging stages (the
    slot each token was folded into; packed methods such as VisionZip's official variant put
    their tokens in the first slots), None when no stage merged. A token survives when its slot is
    still held at the end (a later stage may drop it)."""
    own = np.arange(slots_kept.size)
    if into is None:
        return np.where(slots_kept, own, -1)
    into = np.asarray(into)
    held = np.zeros(into.size, dtype=bool)
    ok = into >= 0
    held[ok] = slots_kept[into[ok]]
    return np.where(held, into, -1)


def fate_masks(fate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept as it was, merged with others into one token) bool masks from :func:`token_fate`."""
    alive = fate >= 0
    groups, sizes = np.unique(fate[alive], return_counts=True)
    size = np.zeros(fate.size, dtype=np.int64)
    size[alive] = sizes[np.searchsorted(groups, fate[alive])]
    return alive & (size == 1), alive & (size > 1)


def kept_placeholders(input_ids: torch.Tensor, rows: torch.Tensor, token_id: int) -> torch.Tensor:
    """bool [N]: for each visual placeholder of ``token_id`` in ``input_ids`` [S] (in order),
    whether its position is among the returned ``rows`` [S_out] (-1 = padding)."""
    positions = torch.nonzero(input_ids == token_id).squeeze(1)
    returned = rows[rows >= 0].to(positions.device)
    return torch.isin(positions, returned)


def _font(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _wrap(draw: ImageDraw.ImageDraw, line: str, font: ImageFont.ImageFont, width: float) -> list[str]:
    """``line`` broken at spaces into pieces no wider than ``width`` pixels."""
    out: list[str] = []
    for word in line.split(" "):
        if out and draw.textlength(f"{out[-1]} {word}", font=font) <= width:
            out[-1] = f"{out[-1]} {word}"
        else:
            out.append(word)
    return out


def with_caption(picture: Image.Image, lines: list[str], size: int = 15) -> Image.Image:
    """``picture`` with a dark caption band of ``lines`` (wrapped to its width) below it."""
    pad, step, font = 8, size + 5, _font(size)
    measure = ImageDraw.Draw(picture)
    lines = [piece for line in lines for piece in _wrap(measure, line, font, picture.width - 2 * pad)]
    out = Image.new("RGB", (picture.width, picture.height + 2 * pad + step * len(lines)), CAPTION_BG)
    out.paste(picture, (0, 0))
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(lines):
        draw.text((pad, picture.height + pad + i * step), line, fill=CAPTION_FG, font=font)
    return out


def display_size(width: int, height: int) -> tuple[int, int]:
    """Size an upload is drawn at: its own, shrunk to at most MAX_SIDE on the long side, or
    enlarged to MIN_WIDTH wide when it is tiny (the 64 x 64 synthetic pictures)."""
    scale = min(MAX_SIDE / max(width, height), 1.0)
    if width * scale < MIN_WIDTH:
        scale = MIN_WIDTH / width
    return max(1, round(width * scale)), max(1, round(height * scale))


def _base(picture: np.ndarray, box: tuple[int, int, int, int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The picture at display size (float RGB) with what lies outside ``box`` (the region the
    model sees, in picture pixels) greyed out, and the box's x and y edges at display size."""
    h, w = picture.shape[:2]
    dw, dh = display_size(w, h)
    resample = Image.NEAREST if dw >= 2 * w else Image.BICUBIC
    base = np.asarray(Image.fromarray(picture).resize((dw, dh), resample)).astype(np.float32)
    x0, y0, x1, y1 = box or (0, 0, w, h)
    sx, sy = dw / w, dh / h
    edges_x = np.array([round(x0 * sx), round(x1 * sx)])
    edges_y = np.array([round(y0 * sy), round(y1 * sy)])
    outside = np.ones((dh, dw), dtype=bool)
    outside[edges_y[0] : edges_y[1], edges_x[0] : edges_x[1]] = False
    base[outside] = (1 - OUTSIDE_ALPHA) * base[outside] + OUTSIDE_ALPHA * np.array(OUTSIDE_TINT, dtype=np.float32)
    return base, edges_x, edges_y


def _cell_edges(edges_x: np.ndarray, edges_y: np.ndarray, grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    xs = np.linspace(edges_x[0], edges_x[1], grid[1] + 1).round().astype(int)
    ys = np.linspace(edges_y[0], edges_y[1], grid[0] + 1).round().astype(int)
    return xs, ys


def plain_view(picture: np.ndarray, caption: list[str]) -> Image.Image:
    """The picture at display size with a caption; for layouts without one token grid."""
    base, _, _ = _base(picture, None)
    return with_caption(Image.fromarray(base.round().astype(np.uint8)), caption)


def grid_overlay(picture: np.ndarray, kept: np.ndarray, grid: tuple[int, int], caption: list[str],
                 box: tuple[int, int, int, int] | None = None, merged: np.ndarray | None = None) -> Image.Image:
    """The upload (at display size) with its rows x cols token grid drawn over ``box`` (the part
    the model sees, default all of it): kept cells outlined green, ``merged`` cells (merged with
    others into one token) outlined amber, the other cells darkened (dropped), what lies outside
    ``box`` greyed. ``kept`` / ``merged`` are bool [rows * cols] in row-major grid order."""
    n_rows, n_cols = grid
    if n_rows * n_cols != kept.size:
        raise ValueError(f"a {n_rows} x {n_cols} token grid needs {n_rows * n_cols} tokens, got {kept.size}")
    base, ex, ey = _base(picture, box)
    xs, ys = _cell_edges(ex, ey, grid)
    cells = kept.reshape(n_rows, n_cols)
    joined = np.zeros_like(cells) if merged is None else merged.reshape(n_rows, n_cols) & ~cells
    tint = np.array(DROPPED_TINT, dtype=np.float32)
    for r in range(n_rows):
        for c in range(n_cols):
            if not cells[r, c] and not joined[r, c]:
                block = base[ys[r] : ys[r + 1], xs[c] : xs[c + 1]]
                block[:] = (1 - DROPPED_ALPHA) * block + DROPPED_ALPHA * tint
    out = Image.fromarray(base.round().astype(np.uint8))
    draw = ImageDraw.Draw(out)
    width = max(1, int(ex[1] - ex[0]) // (max(grid) * 12))
    for r in range(n_rows):
        for c in range(n_cols):
            if cells[r, c] or joined[r, c]:
                draw.rectangle([xs[c], ys[r], xs[c + 1] - 1, ys[r + 1] - 1],
                               outline=KEPT_OUTLINE if cells[r, c] else MERGED_OUTLINE, width=width)
    return with_caption(out, caption)


def group_colours(into: np.ndarray, grid: tuple[int, int], frames: int = 1) -> dict[int, int]:
    """Palette index of every merged group (value of ``into`` shared by 2+ tokens): one colour
    each while the palette lasts, else greedy, so no two groups touching in a frame's rows x cols
    grid share a colour."""
    cells = into.reshape(frames, *grid)
    sizes = dict(zip(*np.unique(into[into >= 0], return_counts=True)))
    merged = [int(g) for g, n in sizes.items() if n > 1]
    if len(merged) <= len(GROUP_COLOURS):
        return {g: i for i, g in enumerate(merged)}
    touch: dict[int, set[int]] = {g: set() for g in merged}
    for a, b in ((cells[:, 1:, :], cells[:, :-1, :]), (cells[:, :, 1:], cells[:, :, :-1])):
        for x, y in zip(a.ravel().tolist(), b.ravel().tolist()):
            if x != y and x in touch and y in touch:
                touch[x].add(y)
                touch[y].add(x)
    out: dict[int, int] = {}
    for g in sorted(merged, key=lambda g: (-len(touch[g]), g)):
        used = {out[h] for h in touch[g] if h in out}
        out[g] = next((c for c in range(len(GROUP_COLOURS)) if c not in used), g % len(GROUP_COLOURS))
    return out


def _draw_groups(base: np.ndarray, cells: np.ndarray, grid: tuple[int, int], xs: np.ndarray, ys: np.ndarray,
                 colours: dict[int, int], dots: list[int]) -> Image.Image:
    """``base`` with the cells of one rows x cols grid tinted by their group (``cells``: a group
    id per cell, -1 = dropped, darkened; groups without a colour - tokens kept as they were - left
    plain), white lines between groups and a dot on the cells in ``dots`` (where a merged token sits)."""
    n_rows, n_cols = grid
    cells = cells.reshape(n_rows, n_cols)
    tint = np.array(DROPPED_TINT, dtype=np.float32)
    for r in range(n_rows):
        for c in range(n_cols):
            block = base[ys[r] : ys[r + 1], xs[c] : xs[c + 1]]
            g = int(cells[r, c])
            if g < 0:
                block[:] = (1 - DROPPED_ALPHA) * block + DROPPED_ALPHA * tint
            elif g in colours:
                block[:] = (1 - GROUP_ALPHA) * block + GROUP_ALPHA * np.array(GROUP_COLOURS[colours[g]], dtype=np.float32)
    out = Image.fromarray(base.round().astype(np.uint8))
    draw = ImageDraw.Draw(out)
    width = max(1, int(xs[-1] - xs[0]) // (max(grid) * 16))
    for r in range(n_rows):
        for c in range(n_cols):
            if c + 1 < n_cols and cells[r, c] != cells[r, c + 1]:
                draw.line([(xs[c + 1], ys[r]), (xs[c + 1], ys[r + 1])], fill=GROUP_EDGE, width=width)
            if r + 1 < n_rows and cells[r, c] != cells[r + 1, c]:
                draw.line([(xs[c], ys[r + 1]), (xs[c + 1], ys[r + 1])], fill=GROUP_EDGE, width=width)
    for cell in dots:
        r, c = divmod(cell, n_cols)
        cx, cy, rad = (xs[c] + xs[c + 1]) / 2, (ys[r] + ys[r + 1]) / 2, max(2.0, (xs[c + 1] - xs[c]) / 7)
        draw.ellipse([cx - rad, cy - rad, cx + rad, cy + rad], fill=GROUP_EDGE, outline=(0, 0, 0))
    return out


def merge_overlay(picture: np.ndarray, into: np.ndarray, grid: tuple[int, int], caption: list[str],
                  box: tuple[int, int, int, int] | None = None) -> Image.Image:
    """The upload (at display size) with each token cell of ``box`` coloured by the token it was
    merged into: ``into`` int [rows * cols], row-major, the slot of that token (-1: dropped);
    a dot marks the slot of each merged token that sits on one of its own cells."""
    n_rows, n_cols = grid
    if n_rows * n_cols != into.size:
        raise ValueError(f"a {n_rows} x {n_cols} token grid needs {n_rows * n_cols} tokens, got {into.size}")
    base, ex, ey = _base(picture, box)
    xs, ys = _cell_edges(ex, ey, grid)
    colours = group_colours(into, grid)
    dots = [g for g in colours if into[g] == g]
    return with_caption(_draw_groups(base, into, grid, xs, ys, colours, dots), caption)


def merge_strip(frames: list[np.ndarray], into: np.ndarray, grid: tuple[int, int], caption: list[str],
                side: int = FRAME_SIDE, columns: int = STRIP_COLUMNS) -> Image.Image:
    """Video frames in rows of ``columns``, each token cell coloured by its merged group as in
    :func:`merge_overlay`; ``into`` covers the frames' tokens frame after frame (one colour per
    group across frames: a token of one frame can merge into another frame's)."""
    per_frame = grid[0] * grid[1]
    if into.size != per_frame * len(frames):
        raise ValueError(f"{len(frames)} frames of {per_frame} tokens need {per_frame * len(frames)} entries, got {into.size}")
    colours = group_colours(into, grid, len(frames))
    h0, w0 = frames[0].shape[:2]
    pic_h = max(1, round(side * h0 / w0))
    n_rows = math.ceil(len(frames) / columns)
    sheet = Image.new("RGB", (columns * (side + 4), n_rows * (pic_h + 4)), CAPTION_BG)
    for i, frame in enumerate(frames):
        resample = Image.NEAREST if max(frame.shape[:2]) < side / 2 else Image.BICUBIC
        base = np.asarray(Image.fromarray(frame).resize((side, pic_h), resample)).astype(np.float32)
        xs, ys = _cell_edges(np.array([0, side]), np.array([0, pic_h]), grid)
        first = i * per_frame
        dots = [g - first for g in colours if first <= g < first + per_frame and into[g] == g]
        pic = _draw_groups(base, into[first : first + per_frame], grid, xs, ys, colours, dots)
        sheet.paste(pic, ((i % columns) * (side + 4) + 2, (i // columns) * (pic_h + 4) + 2))
    return with_caption(sheet, caption)


def colour_map(values: np.ndarray) -> np.ndarray:
    """float [..., 3] RGB in 0..255 of ``values`` in [0, 1] on the dark-blue -> yellow ramp."""
    v = np.clip(values, 0, 1)[..., None]
    stops = np.array(HEAT_STOPS, dtype=np.float32)
    pos = v * (len(stops) - 1)
    lo = np.floor(pos).astype(int).clip(0, len(stops) - 2)
    frac = pos - lo
    return stops[lo[..., 0]] * (1 - frac) + stops[lo[..., 0] + 1] * frac


def rank_colours(scores: np.ndarray) -> np.ndarray:
    """float [N, 3] heat colours of ``scores`` [N] by rank among their distinct finite values
    (ranks are what methods use; one outlier does not flatten the rest); NaN (not scored) gets
    the dropped tint."""
    finite = np.isfinite(scores)
    distinct, rank = np.unique(scores[finite], return_inverse=True)
    norm = np.full(scores.shape, 0.5)
    if distinct.size > 1:
        norm[finite] = rank / (distinct.size - 1)
    out = colour_map(norm)
    out[~finite] = np.array(DROPPED_TINT, dtype=np.float32)
    return out


def _tint_cells(base: np.ndarray, colours: np.ndarray, xs: np.ndarray, ys: np.ndarray, grid: tuple[int, int]) -> None:
    n_rows, n_cols = grid
    colours = colours.reshape(n_rows, n_cols, 3)
    for r in range(n_rows):
        for c in range(n_cols):
            block = base[ys[r] : ys[r + 1], xs[c] : xs[c + 1]]
            block[:] = (1 - HEAT_ALPHA) * block + HEAT_ALPHA * colours[r, c]


def score_heatmap(picture: np.ndarray, scores: np.ndarray, grid: tuple[int, int], caption: list[str],
                  box: tuple[int, int, int, int] | None = None) -> Image.Image:
    """The upload with each token cell of ``box`` tinted by the rank of its score among the
    image's distinct scores (:func:`rank_colours`), dark blue = lowest, yellow = highest; NaN
    cells (not scored: dropped by an earlier stage) dark."""
    n_rows, n_cols = grid
    if n_rows * n_cols != scores.size:
        raise ValueError(f"a {n_rows} x {n_cols} token grid needs {n_rows * n_cols} scores, got {scores.size}")
    base, ex, ey = _base(picture, box)
    xs, ys = _cell_edges(ex, ey, grid)
    _tint_cells(base, rank_colours(np.asarray(scores, dtype=np.float64).ravel()), xs, ys, grid)
    return with_caption(Image.fromarray(base.round().astype(np.uint8)), caption)


def score_strip(frames: list[np.ndarray], scores: np.ndarray, grid: tuple[int, int], caption: list[str],
                side: int = FRAME_SIDE, columns: int = STRIP_COLUMNS) -> Image.Image:
    """Video frames in rows of ``columns``, each token cell tinted by its score's rank over the
    whole video (:func:`rank_colours`); ``scores`` covers the frames' rows x cols tokens frame
    after frame (a grid of (1, 1): one score per frame, e.g. a frames-stage method's)."""
    per_frame = grid[0] * grid[1]
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if scores.size != per_frame * len(frames):
        raise ValueError(f"{len(frames)} frames of {per_frame} tokens need {per_frame * len(frames)} scores, got {scores.size}")
    colours = rank_colours(scores)
    h0, w0 = frames[0].shape[:2]
    pic_h = max(1, round(side * h0 / w0))
    n_rows = math.ceil(len(frames) / columns)
    sheet = Image.new("RGB", (columns * (side + 4), n_rows * (pic_h + LABEL_SIZE + 10)), CAPTION_BG)
    draw = ImageDraw.Draw(sheet)
    for i, frame in enumerate(frames):
        resample = Image.NEAREST if max(frame.shape[:2]) < side / 2 else Image.BICUBIC
        base = np.asarray(Image.fromarray(frame).resize((side, pic_h), resample)).astype(np.float32)
        xs, ys = _cell_edges(np.array([0, side]), np.array([0, pic_h]), grid)
        _tint_cells(base, colours[i * per_frame : (i + 1) * per_frame], xs, ys, grid)
        x, y = (i % columns) * (side + 4) + 2, (i // columns) * (pic_h + LABEL_SIZE + 10) + 2
        sheet.paste(Image.fromarray(base.round().astype(np.uint8)), (x, y))
        draw.text((x + 2, y + pic_h + 3), f"#{i}", fill=CAPTION_FG, font=_font(LABEL_SIZE))
    return with_caption(sheet, caption)


@dataclass
class FrameInfo:
    """One sampled frame of a video as the strip shows it."""

    picture: np.ndarray  # uint8 [H, W, 3]
    tokens_kept: int
    tokens_total: int
    score: float | None = None
    budget: int | None = None  # the frames-stage method's token budget for this frame


def frames_kept(kept: np.ndarray, n_frames: int, packed: list[int] | None = None) -> tuple[list[int], int]:
    """Kept tokens per frame and tokens per frame, from ``kept`` bool [N] over a video's
    placeholders: N = n_frames * per_frame + extra trailing tokens (e.g. one newline).

    Slot s holds a token of frame s // per_frame, unless ``packed`` (the tokens per frame of a
    frames plan that resized the frames, e.g. QuoTA's) says the kept frames' tokens fill the
    first slots in frame order: packed[0] slots of frame 0, then packed[1] of frame 1, ..."""
    per_frame = kept.size // n_frames
    if per_frame == 0:
        raise ValueError(f"{kept.size} video tokens cannot cover {n_frames} frames")
    body = kept[: n_frames * per_frame]
    if packed is None:
        return [int(k) for k in body.reshape(n_frames, per_frame).sum(1)], per_frame
    owner = np.repeat(np.arange(len(packed)), packed)[: body.size]
    return [int(k) for k in np.bincount(owner[body[: owner.size]], minlength=n_frames)[:n_frames]], per_frame


def frame_strip(frames: list[FrameInfo], caption: list[str], side: int = FRAME_SIDE, columns: int = STRIP_COLUMNS) -> Image.Image:
    """Frames in rows of ``columns``, each labelled with its score and kept tokens; frames
    without any kept token are greyed out."""
    label = LABEL_SIZE
    h0, w0 = frames[0].picture.shape[:2]
    pic_h = min(side - 4, round((side - 4) * h0 / w0))
    cell_h = pic_h + 4 + 2 * (label + 4)
    n_rows = math.ceil(len(frames) / columns)
    sheet = Image.new("RGB", (columns * side, n_rows * cell_h), CAPTION_BG)
    draw = ImageDraw.Draw(sheet)
    for i, f in enumerate(frames):
        x, y = (i % columns) * side, (i // columns) * cell_h
        resample = Image.NEAREST if max(f.picture.shape[:2]) < side / 2 else Image.BICUBIC
        pic = Image.fromarray(f.picture).resize((side - 4, pic_h), resample)
        if f.tokens_kept == 0:
            grey = np.asarray(pic.convert("L").convert("RGB")).astype(np.float32)
            pic = Image.fromarray((0.35 * grey + 0.65 * np.array(DROPPED_TINT)).astype(np.uint8))
        sheet.paste(pic, (x + 2, y + 2))
        if f.tokens_kept:
            draw.rectangle([x + 1, y + 1, x + side - 2, y + pic_h + 2], outline=KEPT_OUTLINE, width=2)
        score = "" if f.score is None else f"  s={f.score:.2f}"
        colour = CAPTION_FG if f.tokens_kept else (140, 140, 140)
        text_y = y + pic_h + 6
        draw.text((x + 4, text_y), f"#{i}{score}", fill=colour, font=_font(label))
        budget = "" if f.budget is None else f" (b {f.budget})"
        draw.text((x + 4, text_y + label + 4), f"{f.tokens_kept}/{f.tokens_total} tok{budget}", fill=colour, font=_font(label))
    return with_caption(sheet, caption)
