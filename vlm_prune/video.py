"""Decode and sample video frames: decord first, OpenCV as the fallback.

    frames, timestamps = read_frames("clip.mp4", num_frames=32)        # uniform by count
    frames, timestamps = read_frames("clip.mp4", fps=1.0)              # uniform in time
    frames, timestamps = read_frames("clip.mp4", num_frames="quota")   # QuoTA's duration rule
    frames, timestamps = read_frames("clip.mp4", num_frames=16, bound=(12.0, 16.0))  # a segment

Frames come back as uint8 RGB ``[T, H, W, 3]`` and timestamps in seconds (frame index / the
container's average frame rate). Decoding runs in this process; with a time limit it runs on a
watchdog thread, so a decoder that hangs on a broken file raises :class:`VideoTimeoutError`
instead of hanging the caller. No process is forked: a fork of a process that holds live FFmpeg
decoder threads can deadlock. A file that decodes fewer frames than it lists (truncated) is a
:class:`VideoWarning`, and :func:`decode` returns it in ``Decoded.warnings``.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

BACKENDS = ("auto", "decord", "opencv")
DEFAULT_TIMEOUT_S = 300.0
T = TypeVar("T")


class VideoError(RuntimeError):
    """Base class of every error read_frames raises."""


class VideoNotFoundError(VideoError, FileNotFoundError):
    """The path does not exist or is not a file."""


class VideoDecodeError(VideoError):
    """No backend could decode the file (unreadable, zero-length, no frame rate)."""


class VideoTimeoutError(VideoError, TimeoutError):
    """The decoder did not finish within the time limit."""


class VideoWarning(UserWarning):
    """The video was read, but not as expected: truncated, or only by the fallback backend."""


def quota_num_frames(duration_s: float, base: int = 96, extra_per_hour: int = 64) -> int:
    """QuoTA's (arXiv 2503.08689) frame count: T = base + int(extra_per_hour * duration_s / 3600)."""
    return base + int(extra_per_hour * duration_s / 3600)


def sample_indices(
    n_frames: int, native_fps: float, num_frames: int | str | None = None, fps: float | None = None,
    bound: tuple[float, float] | None = None,
) -> np.ndarray:
    """Indices of the frames to keep out of ``n_frames`` decoded at ``native_fps``.

    num_frames=K: K indices spread uniformly over [0, n_frames - 1] (rounded; K is capped at
    the number of frames). num_frames="quota": K from :func:`quota_num_frames` of the duration.
    fps=f: one frame every 1/f seconds starting at t=0. Neither: every frame.
    bound=(start_s, end_s): the same rules applied to frames round(start * fps) ..
    round(end * fps) only (clamped to the video); a bound that starts after the video is an error.
    """
    _check_sampling(num_frames, fps)
    _check_bound(bound)
    lo, hi = 0, n_frames - 1
    if bound is not None:
        if native_fps <= 0:
            raise VideoDecodeError("the video reports no frame rate, so a start/end bound cannot apply")
        if bound[0] * native_fps >= n_frames:
            raise VideoDecodeError(
                f"the bound {bound[0]:g}-{bound[1]:g} s lies outside the video ({n_frames / native_fps:.2f} s long)"
            )
        lo = min(round(bound[0] * native_fps), n_frames - 1)
        hi = min(round(bound[1] * native_fps), n_frames - 1)
    n = hi - lo + 1
    if num_frames == "quota":
        if native_fps <= 0:
            raise VideoDecodeError("the video reports no frame rate, so QuoTA's duration rule cannot apply")
        num_frames = quota_num_frames(n / native_fps)
    if num_frames is not None:
        k = min(num_frames, n)
        return lo + np.round(np.linspace(0, n - 1, k)).astype(np.int64)
    if fps is not None:
        if native_fps <= 0:
            raise VideoDecodeError("the video reports no frame rate, so fps= sampling cannot apply")
        times = np.arange(0.0, n / native_fps, 1.0 / fps)
        idx = lo + np.round(times * native_fps).astype(np.int64)
        return np.unique(np.clip(idx, lo, hi))
    return np.arange(lo, hi + 1, dtype=np.int64)


def _check_sampling(num_frames: int | str | None, fps: float | None) -> None:
    if num_frames is not None and fps is not None:
        raise ValueError("give either num_frames= or fps= (or neither, for every frame), not both")
    if num_frames is not None and num_frames != "quota" and (
        isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1
    ):
        raise ValueError(f"num_frames must be a whole number >= 1 or 'quota', got {num_frames!r}")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"fps must be a number > 0, got {fps!r}")


def _check_bound(bound: tuple[float, float] | None) -> None:
    if bound is None:
        return
    if len(bound) != 2 or not all(math.isfinite(float(b)) for b in bound) or not 0 <= bound[0] <= bound[1]:
        raise ValueError(f"bound must be (start_s, end_s) with 0 <= start <= end, got {bound!r}")


Picker = Callable[[int, float], np.ndarray]


class _Raw(NamedTuple):
    frames: np.ndarray
    times: np.ndarray
    native_fps: float
    listed: int  # frames the container lists
    decoded: int  # frames that decode (listed unless the file is truncated)


def _decode_decord(path: str, pick: Picker) -> _Raw:
    import decord

    vr = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1)
    n, native_fps = len(vr), float(vr.get_avg_fps())
    if n == 0:
        raise VideoDecodeError(f"{path} has no frames")
    idx = pick(n, native_fps)
    frames = vr.get_batch(idx.tolist()).asnumpy()
    return _Raw(frames, _timestamps(idx, native_fps), native_fps, n, n)


def _decode_opencv(path: str, pick: Picker) -> _Raw:
    import cv2

    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise VideoDecodeError(f"OpenCV cannot open {path}")
    native_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
    n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
    cap.release()
    if n <= 0:  # no count in the container: count by reading
        n = _opencv_count(path)
    if n == 0:
        raise VideoDecodeError(f"{path} has no frames")
    idx = pick(n, native_fps)
    frames, decoded = _opencv_read(path, idx)
    listed = n
    if len(frames) < len(idx):  # fewer frames decode than the container lists: sample again
        decoded = decoded if decoded < n else _opencv_count(path)
        if decoded == 0:
            raise VideoDecodeError(f"{path} has no decodable frames")
        idx = pick(decoded, native_fps)
        frames, _ = _opencv_read(path, idx)
    else:
        decoded = n
    if not frames:
        raise VideoDecodeError(f"{path} has no decodable frames")
    return _Raw(np.stack(frames), _timestamps(idx[: len(frames)], native_fps), native_fps, listed, decoded)


def _opencv_count(path: str) -> int:
    import cv2

    cap, n = cv2.VideoCapture(path), 0
    while cap.grab():
        n += 1
    cap.release()
    return n


def _opencv_read(path: str, idx: np.ndarray) -> tuple[list[np.ndarray], int]:
    """Read sequentially (seeking is unreliable in OpenCV); keep the frames at ``idx``."""
    import cv2

    want = set(idx.tolist())
    last = int(idx.max()) if len(idx) else -1
    cap, frames, i = cv2.VideoCapture(path), [], 0
    while i <= last and cap.grab():
        if i in want:
            ok, bgr = cap.retrieve()
            if not ok:
                break
            frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        i += 1
    cap.release()
    return frames, i


def _timestamps(idx: np.ndarray, native_fps: float) -> np.ndarray:
    if native_fps <= 0:
        return np.full(len(idx), np.nan)
    return idx.astype(np.float64) / native_fps


_DECODERS: dict[str, Callable[[str, Picker], _Raw]] = {
    "decord": _decode_decord,
    "opencv": _decode_opencv,
}


def _has_decord() -> bool:
    try:
        import decord  # noqa: F401
    except ImportError:
        return False
    return True


class _InFlight:
    """Counts decoder calls running on any thread. At exit (after Ctrl-C, say) it lets them
    finish, up to ``drain_s`` seconds, and starts no new one: native decoder code still running
    when the C++ runtime tears down aborts the process."""

    drain_s = 10.0

    def __init__(self) -> None:
        self.count, self.closing = 0, False
        self.cond = threading.Condition()

    def __enter__(self) -> None:
        with self.cond:
            if self.closing:
                raise VideoDecodeError("the process is exiting; no new video is decoded")
            self.count += 1

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.count -= 1
            self.cond.notify_all()

    def drain(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.wait_for(lambda: self.count == 0, timeout=self.drain_s)


_IN_FLIGHT = _InFlight()
atexit.register(_IN_FLIGHT.drain)


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send what is written to the process's stderr (file descriptor 2) to os.devnull for the block:
    the decoders' own logs (FFmpeg inside decord and OpenCV: "moov atom not found", decord's "ERROR
    opening"), which this module reports as :class:`VideoError` / :class:`VideoWarning` instead. The
    whole process's stderr is silenced meanwhile, so command-line tools use it around a decode."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _with_watchdog(fn: Callable[[], T], timeout: float | None, what: str) -> T:
    """Run ``fn`` in this process; with a timeout, on a daemon thread the caller stops waiting for.

    Decoding in-process avoids forking a process that holds live FFmpeg threads (a fork can
    deadlock on their locks) and costs no copy of the frames. A decoder that never returns is
    left behind on its daemon thread (it cannot be killed); the caller gets VideoTimeoutError
    and goes on, and Ctrl-C / SIGTERM stop the process as usual.
    """
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=run, name="vlm_prune-decode", daemon=True).start()
    if not done.wait(timeout):
        raise VideoTimeoutError(
            f"{what} did not finish within {timeout:g} s; the file may be corrupt (raise timeout= for very long videos)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _run_backend(backend: str, path: str, pick: Picker, timeout: float | None) -> _Raw:
    def run() -> _Raw:
        with _IN_FLIGHT:
            return _DECODERS[backend](path, pick)

    try:
        return _with_watchdog(run, timeout, f"{backend} decoding {path}")
    except VideoError:
        raise
    except Exception as err:
        raise VideoDecodeError(f"{backend} failed on {path}: {type(err).__name__}: {err}") from err


@dataclass
class Decoded:
    """What :func:`decode` read: frames uint8 [T,H,W,3] RGB, timestamps [T] in seconds, which
    backend read them, the frame count and rate the container reports, and warnings (e.g. a
    truncated file that decodes fewer frames than it lists)."""

    frames: np.ndarray
    times: np.ndarray
    backend: str
    n_frames: int
    native_fps: float
    warnings: list[str] = field(default_factory=list)
    #: frames that decode (fewer than ``n_frames`` in a truncated file; None: not counted)
    decoded: int | None = None

    @property
    def truncated(self) -> bool:
        return self.decoded is not None and self.decoded < self.n_frames


def decode(
    path: str | os.PathLike,
    num_frames: int | str | None = None,
    fps: float | None = None,
    backend: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
    bound: tuple[float, float] | None = None,
) -> Decoded:
    """:func:`read_frames` with its details: backend, container counts and warnings (not raised)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    _check_sampling(num_frames, fps)
    _check_bound(bound)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise VideoNotFoundError(f"no video file at {path!r}")
    if os.path.getsize(path) == 0:
        raise VideoDecodeError(f"{path} is empty (0 bytes)")
    if backend == "auto":
        order = ["decord", "opencv"] if _has_decord() else ["opencv"]
    else:
        order = [backend]
    pick = functools.partial(sample_indices, num_frames=num_frames, fps=fps, bound=bound)
    failures: list[VideoError] = []
    for name in order:
        try:
            raw = _run_backend(name, path, pick, timeout)
        except (VideoDecodeError, VideoTimeoutError) as err:
            failures.append(err)
            continue
        notes = [f"{name} read the file after: " + "; ".join(map(str, failures))] if failures else []
        if raw.decoded < raw.listed:
            notes.append(
                f"{path} lists {raw.listed} frames but only the first {raw.decoded} decode: the file is probably "
                f"truncated (an incomplete download?); frames were sampled from those {raw.decoded}"
            )
        return Decoded(np.ascontiguousarray(raw.frames, dtype=np.uint8), np.asarray(raw.times, dtype=np.float64),
                       name, raw.listed, raw.native_fps, notes, raw.decoded)
    if len(failures) == 1:
        raise failures[0]
    kind = VideoTimeoutError if all(isinstance(f, VideoTimeoutError) for f in failures) else VideoDecodeError
    raise kind("; ".join(str(f) for f in failures))


def read_frames(
    path: str | os.PathLike,
    num_frames: int | str | None = None,
    fps: float | None = None,
    backend: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
    bound: tuple[float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``path`` and sample frames uniformly.

    num_frames: K frames uniformly over the video, or "quota" for QuoTA's
        T = 96 + int(64 * duration_s / 3600). fps: frames per second of video instead.
        Give at most one; neither returns every frame.
    backend: "decord", "opencv", or "auto" (default): decord when installed, OpenCV when decord
        is missing or fails (including a timeout).
    timeout: seconds each backend may take (default 300); None waits for ever.
    bound: (start_s, end_s): sample inside that segment only (MVBench's clipped questions).
    Returns (frames uint8 [T, H, W, 3] RGB, timestamps float64 [T] in seconds). A truncated
    file, or a fallback to another backend, is a :class:`VideoWarning`.
    Raises VideoNotFoundError, VideoDecodeError, VideoTimeoutError (all VideoError).
    """
    out = decode(path, num_frames, fps, backend, timeout, bound)
    for note in out.warnings:
        warnings.warn(note, VideoWarning, stacklevel=2)
    return out.frames, out.times


#: clock of the frame indices in :func:`processor_video_kwargs`' metadata: 1 ms ticks
METADATA_TICKS = 1000.0


def processor_video_kwargs(processor: Any, times: list[Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``processor(videos=..., text=...)`` on frames sampled already.

    transformers' video processors of recent families sample frames again by default (Qwen3-VL and
    Qwen3.5 cut 32 given frames to a handful at their own rate; GLM-4.1V refuses frames without
    metadata), and the prompts of Qwen3-VL, GLM-4.1V and SmolVLM2 write each frame's time, which they
    read from ``video_metadata`` (24 fps assumed without it). ``do_sample_frames=False`` keeps the
    frames given; ``times`` (seconds of each video's frames, one sequence per video, None when
    unknown) become ``video_metadata`` with those times (frame indices on a 1 ms clock). Processors
    without a video processor get nothing."""
    if getattr(processor, "video_processor", None) is None:
        return {}
    kwargs: dict[str, Any] = {"do_sample_frames": False}
    if times and all(t is not None and len(t) for t in times):
        from transformers.video_utils import VideoMetadata

        metadata = []
        for t in times:
            idx = [int(round(float(s) * METADATA_TICKS)) for s in t]
            metadata.append(VideoMetadata(total_num_frames=idx[-1] + 1, fps=METADATA_TICKS, frames_indices=idx,
                                          duration=float(t[-1])))
        kwargs["video_metadata"] = metadata
    return kwargs
