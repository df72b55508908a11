"""Decode and sample video frames: decord first, OpenCV as the fallback.

    frames, timestamps = read_frames("clip.mp4", num_frames=32)        # uniform by count
    frames, timestamps = read_frames("clip.mp4", fps=1.0)              # uniform in time
    frames, timestamps = read_frames("clip.mp4", num_frames="quota")   # QuoTA's duration rule

Frames come back as uint8 RGB ``[T, H, W, 3]`` and timestamps in seconds (frame index / the
container's average frame rate). Decoding runs in a forked worker process with a time limit,
so a decoder that hangs on a broken file raises :class:`VideoTimeoutError` instead of hanging
the caller.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
from collections.abc import Callable

import numpy as np

BACKENDS = ("auto", "decord", "opencv")
DEFAULT_TIMEOUT_S = 300.0


class VideoError(RuntimeError):
    """Base class of every error read_frames raises."""


class VideoNotFoundError(VideoError, FileNotFoundError):
    """The path does not exist or is not a file."""


class VideoDecodeError(VideoError):
    """No backend could decode the file (unreadable, zero-length, no frame rate)."""


class VideoTimeoutError(VideoError, TimeoutError):
    """The decoder did not finish within the time limit."""


def quota_num_frames(duration_s: float, base: int = 96, extra_per_hour: int = 64) -> int:
    """QuoTA's (arXiv 2503.08689) frame count: T = base + int(extra_per_hour * duration_s / 3600)."""
    return base + int(extra_per_hour * duration_s / 3600)


def sample_indices(
    n_frames: int, native_fps: float, num_frames: int | str | None = None, fps: float | None = None
) -> np.ndarray:
    """Indices of the frames to keep out of ``n_frames`` decoded at ``native_fps``.

    num_frames=K: K indices spread uniformly over [0, n_frames - 1] (rounded; K is capped at
    n_frames). num_frames="quota": K from :func:`quota_num_frames` of the duration. fps=f: one
    frame every 1/f seconds starting at t=0. Neither: every frame.
    """
    _check_sampling(num_frames, fps)
    if num_frames == "quota":
        if native_fps <= 0:
            raise VideoDecodeError("the video reports no frame rate, so QuoTA's duration rule cannot apply")
        num_frames = quota_num_frames(n_frames / native_fps)
    if num_frames is not None:
        k = min(num_frames, n_frames)
        return np.round(np.linspace(0, n_frames - 1, k)).astype(np.int64)
    if fps is not None:
        if native_fps <= 0:
            raise VideoDecodeError("the video reports no frame rate, so fps= sampling cannot apply")
        times = np.arange(0.0, n_frames / native_fps, 1.0 / fps)
        idx = np.round(times * native_fps).astype(np.int64)
        return np.unique(np.clip(idx, 0, n_frames - 1))
    return np.arange(n_frames, dtype=np.int64)


def _check_sampling(num_frames: int | str | None, fps: float | None) -> None:
    if num_frames is not None and fps is not None:
        raise ValueError("give either num_frames= or fps= (or neither, for every frame), not both")
    if num_frames is not None and num_frames != "quota" and (
        isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1
    ):
        raise ValueError(f"num_frames must be a whole number >= 1 or 'quota', got {num_frames!r}")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"fps must be a number > 0, got {fps!r}")


Picker = Callable[[int, float], np.ndarray]


def _decode_decord(path: str, pick: Picker) -> tuple[np.ndarray, np.ndarray]:
    import decord

    vr = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1)
    n, native_fps = len(vr), float(vr.get_avg_fps())
    if n == 0:
        raise VideoDecodeError(f"{path} has no frames")
    idx = pick(n, native_fps)
    frames = vr.get_batch(idx.tolist()).asnumpy()
    return frames, _timestamps(idx, native_fps)


def _decode_opencv(path: str, pick: Picker) -> tuple[np.ndarray, np.ndarray]:
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
    if len(frames) < len(idx):  # the container's frame count was too high: sample again
        idx = pick(decoded, native_fps)
        frames, _ = _opencv_read(path, idx)
    if not frames:
        raise VideoDecodeError(f"{path} has no decodable frames")
    return np.stack(frames), _timestamps(idx[: len(frames)], native_fps)


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


_DECODERS: dict[str, Callable[[str, Picker], tuple[np.ndarray, np.ndarray]]] = {
    "decord": _decode_decord,
    "opencv": _decode_opencv,
}


def _has_decord() -> bool:
    try:
        import decord  # noqa: F401
    except ImportError:
        return False
    return True


def _worker(conn, backend: str, path: str, pick: Picker) -> None:
    try:
        conn.send(("ok", _DECODERS[backend](path, pick)))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


def _run_with_timeout(backend: str, path: str, pick: Picker, timeout: float | None):
    """Run one decoder, in a worker process when a timeout is set."""
    if timeout is None:
        try:
            return _DECODERS[backend](path, pick)
        except VideoError:
            raise
        except Exception as err:
            raise VideoDecodeError(f"{backend} failed on {path}: {type(err).__name__}: {err}") from err
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(send, backend, path, pick), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise VideoTimeoutError(
                f"{backend} did not decode {path} within {timeout:g} s; the file may be corrupt "
                "(raise timeout= for very long videos)"
            )
        try:
            status, payload = recv.recv()
        except EOFError:
            raise VideoDecodeError(f"the {backend} worker died while decoding {path}") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
    if status == "error":
        raise VideoDecodeError(f"{backend} failed on {path}: {payload}")
    return payload


def read_frames(
    path: str | os.PathLike,
    num_frames: int | str | None = None,
    fps: float | None = None,
    backend: str = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``path`` and sample frames uniformly.

    num_frames: K frames uniformly over the video, or "quota" for QuoTA's
        T = 96 + int(64 * duration_s / 3600). fps: frames per second of video instead.
        Give at most one; neither returns every frame.
    backend: "decord", "opencv", or "auto" (default): decord when installed, OpenCV when decord
        is missing or fails (including a timeout).
    timeout: seconds each backend may take (default 300); None decodes in this process.
    Returns (frames uint8 [T, H, W, 3] RGB, timestamps float64 [T] in seconds).
    Raises VideoNotFoundError, VideoDecodeError, VideoTimeoutError (all VideoError).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    _check_sampling(num_frames, fps)
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise VideoNotFoundError(f"no video file at {path!r}")
    if os.path.getsize(path) == 0:
        raise VideoDecodeError(f"{path} is empty (0 bytes)")
    if backend == "auto":
        order = ["decord", "opencv"] if _has_decord() else ["opencv"]
    else:
        order = [backend]

    pick = functools.partial(sample_indices, num_frames=num_frames, fps=fps)  # picklable for spawn
    failures: list[VideoError] = []
    for name in order:
        try:
            frames, times = _run_with_timeout(name, path, pick, timeout)
        except (VideoDecodeError, VideoTimeoutError) as err:
            failures.append(err)
            continue
        return np.ascontiguousarray(frames, dtype=np.uint8), np.asarray(times, dtype=np.float64)
    if len(failures) == 1:
        raise failures[0]
    kind = VideoTimeoutError if all(isinstance(f, VideoTimeoutError) for f in failures) else VideoDecodeError
    raise kind("; ".join(str(f) for f in failures))
