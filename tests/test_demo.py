"""The Gradio demo: rendering helpers on hand-made inputs, the unpruned/pruned comparison on the
shipped synthetic models, and the launched app called through gradio_client."""
from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch
from PIL import Image

import vlm_prune
from vlm_prune.api import is_wrapped
from vlm_prune.demo import overlay
from vlm_prune.demo.session import (
    DemoError, Media, Session, answer, build_pipeline, encode, load_synthetic, normalise_question, read_media,
)

gradio_client = pytest.importorskip("gradio_client")
from vlm_prune.demo.app import EXAMPLES_DIR, build_app, launch, load_examples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def session() -> Session:
    return Session(load_synthetic("image"), load_synthetic("video"), max_new_tokens=4, timing_repeats=1)


@pytest.fixture(scope="module")
def client(session):
    app = build_app(session)
    port = free_port()
    launch(app, port=port, block=False)
    yield gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False, analytics_enabled=False)
    app.close()


# ---- rendering helpers -------------------------------------------------------------------------
def test_kept_placeholders_marks_returned_positions():
    ids = torch.tensor([1, 5, 5, 5, 5, 2])  # image placeholders (id 5) at positions 1..4
    rows = torch.tensor([-1, 0, 2, 4, 5])
    assert overlay.kept_placeholders(ids, rows, 5).tolist() == [False, True, False, True]


def test_frames_kept_counts_per_frame_and_ignores_the_trailing_newline():
    kept = np.array([1, 1, 0, 0, 0, 0, 1, 0, 1], dtype=bool)  # 2 frames x 4 tokens + newline
    assert overlay.frames_kept(kept, 2) == ([2, 1], 4)
    with pytest.raises(ValueError, match="cannot cover"):
        overlay.frames_kept(np.ones(3, dtype=bool), 4)


def test_model_view_undoes_the_normalisation():
    x = torch.rand(3, 4, 5)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    pixels = (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    expected = (x * 255).round().byte().permute(1, 2, 0).numpy()
    assert np.abs(overlay.model_view(pixels, mean, std).astype(int) - expected).max() <= 1


def test_grid_overlay_darkens_dropped_cells_and_keeps_kept_ones():
    picture = np.full((4, 4, 3), 200, dtype=np.uint8)
    out = np.asarray(overlay.grid_overlay(picture, np.array([True, False, False, True]), (2, 2), ["x"], side=40))
    assert out.shape[1] == 40 and out.shape[0] > 40  # caption band below the 40 x 40 picture
    dropped = (1 - overlay.DROPPED_ALPHA) * 200 + overlay.DROPPED_ALPHA * np.array(overlay.DROPPED_TINT)
    assert np.abs(out[10, 30].astype(float) - dropped).max() <= 1  # row 0, col 1: dropped
    assert out[10, 10].tolist() == [200, 200, 200]  # row 0, col 0: kept, untouched inside
    assert out[0, 0].tolist() == list(overlay.KEPT_OUTLINE)  # ... and outlined
    with pytest.raises(ValueError, match="needs 4 tokens, got 6"):
        overlay.grid_overlay(picture, np.ones(6, dtype=bool), (2, 2), ["x"])
    wide = np.asarray(overlay.grid_overlay(picture, np.array([False, True, False, False, False, False]), (2, 3), ["x"], side=60))
    assert wide[10, 30].tolist() == [200, 200, 200] and wide[10, 10].tolist() != [200, 200, 200]


def test_image_grid_square_or_from_grid_thw():
    from types import SimpleNamespace

    from vlm_prune.demo.session import image_grid

    qwen = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    assert image_grid(qwen, {"image_grid_thw": torch.tensor([[1, 8, 12]])}, 24) == (4, 6)
    assert image_grid(qwen, {}, 64) == (8, 8)
    assert image_grid(qwen, {}, 2928) is None  # LLaVA-NeXT tiles + newlines: no single grid


def test_frame_strip_greys_frames_without_tokens():
    red = np.zeros((8, 8, 3), dtype=np.uint8)
    red[..., 0] = 255
    frames = [overlay.FrameInfo(red, 4, 4, 0.9, 4), overlay.FrameInfo(red, 0, 4, 0.1, 0)]
    out = np.asarray(overlay.frame_strip(frames, ["x"], side=40, columns=2))
    kept, dropped = out[20, 20], out[20, 60]
    assert kept.tolist() == [255, 0, 0]
    assert abs(int(dropped[0]) - int(dropped[1])) < 40  # grey, not red


# ---- request parsing -----------------------------------------------------------------------------
def test_build_pipeline_splits_stages_and_sets_the_llm_layer():
    frames, llm = build_pipeline(["keyscore+pact"], layer=1)
    assert (frames.name, frames.stage, llm.name, llm.layer) == ("keyscore", "frames", "pact", 1)
    assert build_pipeline("fastv", layer=0)[0].layer == type(build_pipeline("fastv", 0)[0])().layer
    with pytest.raises(DemoError, match="Did you mean 'pact'"):
        build_pipeline(["pakt"], layer=0)
    with pytest.raises(DemoError, match="pick at least one method"):
        build_pipeline([], layer=0)


def test_build_pipeline_reports_a_missing_extra(hide_module):
    hide_module("sklearn")
    with pytest.raises(DemoError, match=r"scikit-learn: pip install 'vlm-prune\[video\]'"):
        build_pipeline(["keyscore"], layer=0)


def test_normalise_question_for_the_word_level_vocabulary():
    assert normalise_question("What colour is the Shape?") == "what colour is the shape ?"


def test_read_media_images_videos_and_bad_files(tmp_path):
    img = read_media(EXAMPLES_DIR / "coffee.jpg", num_frames=8)
    assert img.kind == "image" and img.image.mode == "RGB"
    vid = read_media(EXAMPLES_DIR / "bikes.mp4", num_frames=8)
    assert vid.kind == "video" and vid.frames.shape[0] == 8 and vid.frames.dtype == np.uint8
    fake = tmp_path / "fake.png"
    fake.write_text("not a picture")
    with pytest.raises(DemoError, match="neither an image nor a readable video"):
        read_media(fake, num_frames=8)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(DemoError, match="empty"):
        read_media(empty, num_frames=8)


def test_examples_are_small_and_listed():
    rows = load_examples()
    files = [EXAMPLES_DIR / p.name for p in EXAMPLES_DIR.iterdir()]
    assert sum(f.stat().st_size for f in files) < 2_000_000
    listed = {json_row["file"] for json_row in json.loads((EXAMPLES_DIR / "examples.json").read_text())}
    assert {r[0].rsplit("/", 1)[1] for r in rows} == listed
    assert {"astronaut.jpg", "coffee.jpg", "chelsea.jpg", "bikes.mp4"} <= listed


# ---- the comparison ----------------------------------------------------------------------------
def test_run_matches_the_model_and_unwraps(session):
    path = EXAMPLES_DIR / "synthetic_colour_0.png"
    out = session.run(path, "what colour is the shape ?", ["random"], keep=0.25)
    loaded = session.models["image"]
    assert not is_wrapped(loaded.model)
    inputs = encode(loaded, Media("image", image=Image.open(path).convert("RGB")), "what colour is the shape ?")
    assert out.answer_unpruned == answer(loaded, inputs, session.max_new_tokens)
    vlm_prune.wrap(loaded.model, "random", keep=0.25)
    try:
        assert out.answer_pruned == answer(loaded, inputs, session.max_new_tokens)
    finally:
        vlm_prune.unwrap(loaded.model)
    assert out.stats["visual_tokens_in"] == [64] and out.stats["visual_tokens_out"] == [16]
    assert sum(out.stats["kept_grid"]) == 16 and len(out.stats["kept_grid"]) == 64
    assert out.ttft_unpruned > 0 and out.ttft_pruned > 0
    assert out.speedup == pytest.approx(out.ttft_unpruned / out.ttft_pruned)
    assert "| visual tokens | 64 | 16 (25%) |" in out.markdown()


def test_default_layer_follows_the_models_depth(session, monkeypatch):
    assert session.default_layer() == 0  # the shipped 6-layer models take every method's own layer
    monkeypatch.setattr(type(session.models["video"]), "depth", property(lambda m: 4))
    assert session.default_layer() == 1  # too shallow for PACT's layer 4


def test_keep_everything_answers_like_the_unpruned_model(session):
    out = session.run(EXAMPLES_DIR / "synthetic_position_2.png", "is the coloured shape left or right ?",
                      ["random"], keep=1.0)
    assert out.answer_pruned == out.answer_unpruned
    assert all(out.stats["kept_grid"])


def test_video_strip_reports_the_frames_plan(session):
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["keyscore"], keep=0.25)
    frames = next(r for r in out.stats["stages"] if r["stage"] == "frames")["videos"][0]
    assert out.stats["frames_kept_tokens"] == frames["tokens_per_frame"]  # no later stage: budgets are kept
    assert sum(out.stats["frames_kept_tokens"]) == out.stats["visual_tokens_out"][0]  # the newline is not a visual token
    assert out.picture.width == overlay.STRIP_COLUMNS * overlay.FRAME_SIDE


def test_errors_are_messages_and_leave_the_model_unwrapped(session):
    with pytest.raises(DemoError, match="cannot prune this model with quota.*frames"):
        session.run(EXAMPLES_DIR / "coffee.jpg", "is there a coloured shape ?", ["quota"], keep=0.5)
    assert not is_wrapped(session.models["image"].model)
    with pytest.raises(DemoError, match="type a question"):
        session.run(EXAMPLES_DIR / "coffee.jpg", "   ", ["random"], keep=0.5)
    with pytest.raises(DemoError, match="upload an image or a video"):
        session.run(None, "what ?", ["random"], keep=0.5)


def test_untrained_fallback_says_so(monkeypatch):
    from vlm_prune.eval import synthetic

    def missing(kind):
        raise FileNotFoundError(kind)

    monkeypatch.setattr(synthetic, "load", missing)
    loaded = load_synthetic("image")
    assert "UNTRAINED" in loaded.notes[0] and loaded.takes("image")


def test_cli_registers_the_demo_subcommand():
    from vlm_prune.cli import build_parser
    from vlm_prune.demo import cli

    args = build_parser().parse_args(["demo", "--port", "1234", "--share", "no"])
    assert args.func is cli.run and args.port == 1234 and args.model is None and args.share == "no"


# ---- the launched app, through gradio_client ---------------------------------------------------
def test_app_image_request(client):
    unpruned, pruned, summary, picture, stats = client.predict(
        gradio_client.handle_file(str(EXAMPLES_DIR / "synthetic_colour_0.png")), "What colour is the shape?",
        ["random"], 0.25, 1, api_name="/run")
    assert unpruned and pruned and unpruned == stats["answer_unpruned"] and pruned == stats["answer_pruned"]
    assert stats["visual_tokens_out"] == [16] and "speed-up" in summary
    im = Image.open(picture)
    assert im.format == "PNG" and im.width == overlay.IMAGE_SIDE


def test_app_video_pipeline_request(client):
    _, pruned, _, picture, stats = client.predict(
        gradio_client.handle_file(str(EXAMPLES_DIR / "synthetic_clip.mp4")), "what colour is the shape ?",
        ["keyscore", "pact"], 0.25, 1, api_name="/run")
    assert [r["method"] for r in stats["stages"]] == ["keyscore", "pact"]
    assert len(stats["frames_kept_tokens"]) == 16 and pruned
    assert Image.open(picture).width == overlay.STRIP_COLUMNS * overlay.FRAME_SIDE


def test_app_bad_requests_show_messages(client, tmp_path):
    fake = tmp_path / "fake.png"
    fake.write_text("not a picture")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    cases = [
        (fake, "what ?", "neither an image"),
        (text, "what ?", "Invalid file type"),
        (EXAMPLES_DIR / "coffee.jpg", "", "type a question"),
    ]
    for path, question, message in cases:
        with pytest.raises(gradio_client.exceptions.AppError, match=message) as err:
            client.predict(gradio_client.handle_file(str(path)), question, ["random"], 0.25, 1, api_name="/run")
        assert "Traceback" not in str(err.value)
