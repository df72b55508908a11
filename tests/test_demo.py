"""The Gradio demo: rendering helpers on hand-made inputs, the unpruned / pruned comparison on the
shipped synthetic models (its FLOPs and token figures against the eval metrics, one column per
method, failures as messages), and the launched app called through gradio_client."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vlm_prune
from vlm_prune.api import is_wrapped
from vlm_prune.demo import overlay
from vlm_prune.demo.session import (
    DemoError, Media, Session, answer, build_pipeline, encode, flops_text, load_synthetic, merged_into, model_box,
    normalise_question, parse_entries, placed_scores, read_media,
)
from vlm_prune.eval import metrics

gradio_client = pytest.importorskip("gradio_client")
from vlm_prune.demo.app import EXAMPLES_DIR, MAX_COLUMNS, build_app, launch, load_examples, media_kind, method_choices, thumbnail


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


def test_frames_kept_of_a_packed_plan_counts_each_frames_own_slots():
    """QuoTA resizes frames and packs their tokens into the first slots in frame order: slot s
    belongs to the frame whose share of the packed budget covers it, not to s // per_frame."""
    kept = np.zeros(9, dtype=bool)
    kept[:5] = True  # 2 frames x 4 slots + newline; frame 0 got 0 tokens, frame 1 got 5 (upsampled)
    assert overlay.frames_kept(kept, 2, packed=[0, 5]) == ([0, 5], 4)
    kept[4] = False  # a later stage dropped one of frame 1's tokens
    assert overlay.frames_kept(kept, 2, packed=[0, 5]) == ([0, 4], 4)
    assert overlay.frames_kept(kept, 2) == ([4, 0], 4)  # what the slots alone would say


def test_token_fate_follows_packed_merges_and_later_drops():
    slots = np.array([True, True, True, False, False, False])  # output rows in the first three slots
    # a packed merge (VisionZip's official layout): tokens 3, 5 alone into slots 1, 2; tokens 0, 1, 4 into slot 0
    into = np.array([0, 0, -1, 1, 0, 2])
    fate = overlay.token_fate(slots, into)
    assert fate.tolist() == [0, 0, -1, 1, 0, 2]
    kept, merged = overlay.fate_masks(fate)
    assert kept.tolist() == [False, False, False, True, False, True]
    assert merged.tolist() == [True, True, False, False, True, False]
    slots[2] = False  # a later stage dropped the row in slot 2: token 5 is gone too
    assert overlay.token_fate(slots, into).tolist() == [0, 0, -1, 1, 0, -1]
    assert overlay.token_fate(slots, None).tolist() == [0, 1, -1, -1, -1, -1]  # no merges: the slots themselves


def test_flops_text_is_a_share_not_a_speed_up():
    assert flops_text(0.35) == "0.35 of unpruned (2.9x fewer)"
    assert flops_text(1.0) == "1.00 of unpruned (no saving)"


def test_score_strip_ranks_over_the_video_and_darkens_unscored_cells():
    frames = [np.full((8, 8, 3), 128, dtype=np.uint8) for _ in range(3)]
    scores = np.array([0.1, 5.0, np.nan, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])  # 3 frames x (2 x 2)
    im = np.asarray(overlay.score_strip(frames, scores, (2, 2), ["x"], side=40, columns=3)).astype(float)
    colours = overlay.rank_colours(scores)
    assert np.allclose(colours[1], overlay.HEAT_STOPS[-1]) and np.allclose(colours[0], overlay.HEAT_STOPS[0])
    assert np.allclose(colours[2], overlay.DROPPED_TINT)  # NaN: not scored
    expected = 0.4 * 128 + 0.6 * colours[1]  # frame 0, top-right cell: the highest score
    assert np.abs(im[2 + 10, 2 + 30] - expected).max() <= 1
    with pytest.raises(ValueError, match="need 12 scores"):
        overlay.score_strip(frames, scores[:5], (2, 2), ["x"])


def test_placed_scores_by_position_after_an_earlier_drop():
    ids = torch.tensor([1, 5, 5, 5, 5, 2])  # placeholders at positions 1..4
    found = {"pact": (torch.tensor([0.5, 0.75]), torch.tensor([2, 4]))}  # it saw the tokens at positions 2 and 4
    name, values, partial = placed_scores(found, ids, 5, 4, {"stages": [{"stage": "vision"}]})
    assert name == "pact" and partial and np.isnan(values[[0, 2]]).all() and values[[1, 3]].tolist() == [0.5, 0.75]
    packed = {"stages": [{"stage": "vision", "merged_into": [[0, 0, 1, 1]]}]}  # positions no longer name placeholders
    assert placed_scores(found, ids, 5, 4, packed) is None
    assert placed_scores(found, ids, 5, 4, {"stages": []}, renumbered=True) is None  # positions renumbered before
    whole = {"cdpruner": (torch.arange(4.0), None)}
    assert placed_scores(whole, ids, 5, 4, {"stages": []})[1].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_display_size_keeps_the_uploads_resolution_within_bounds():
    assert overlay.display_size(1024, 768) == (1024, 768)
    assert overlay.display_size(4500, 3000) == (overlay.MAX_SIDE, round(overlay.MAX_SIDE * 3000 / 4500))
    assert overlay.display_size(64, 64) == (overlay.MIN_WIDTH, overlay.MIN_WIDTH)


def test_grid_overlay_darkens_dropped_cells_and_greys_what_the_model_never_saw():
    picture = np.full((600, 800, 3), 200, dtype=np.uint8)  # drawn at its own size
    box = (100, 0, 700, 600)  # the centre crop: a 2 x 2 grid of 300 px cells
    out = np.asarray(overlay.grid_overlay(picture, np.array([True, False, False, True]), (2, 2), ["x"], box=box))
    assert out.shape[1] == 800 and out.shape[0] > 600  # caption band below
    dropped = (1 - overlay.DROPPED_ALPHA) * 200 + overlay.DROPPED_ALPHA * np.array(overlay.DROPPED_TINT)
    outside = (1 - overlay.OUTSIDE_ALPHA) * 200 + overlay.OUTSIDE_ALPHA * np.array(overlay.OUTSIDE_TINT)
    assert np.abs(out[150, 550].astype(float) - dropped).max() <= 1  # row 0, col 1: dropped
    assert out[150, 250].tolist() == [200, 200, 200]  # row 0, col 0: kept, untouched inside
    assert out[0, 100].tolist() == list(overlay.KEPT_OUTLINE)  # ... and outlined
    assert np.abs(out[300, 50].astype(float) - outside).max() <= 1  # cropped away by the processor
    with pytest.raises(ValueError, match="needs 4 tokens, got 6"):
        overlay.grid_overlay(picture, np.ones(6, dtype=bool), (2, 2), ["x"])


def test_score_heatmap_colours_cells_by_rank():
    picture = np.zeros((448, 448, 3), dtype=np.uint8)
    out = np.asarray(overlay.score_heatmap(picture, np.array([0.0, 1.0, 2.0, 2.0]), (2, 2), ["x"]))
    low, high = out[100, 100].astype(float), out[100, 300].astype(float)
    assert np.abs(low - overlay.HEAT_ALPHA * np.array(overlay.HEAT_STOPS[0])).max() <= 1
    assert np.abs(high - overlay.HEAT_ALPHA * np.array(overlay.HEAT_STOPS[1])).max() <= 1  # the middle score
    assert np.abs(out[300, 300].astype(float) - overlay.HEAT_ALPHA * np.array(overlay.HEAT_STOPS[2])).max() <= 1


def test_merge_overlay_colours_each_group_and_darkens_dropped_cells():
    picture = np.zeros((448, 448, 3), dtype=np.uint8)
    into = np.array([0, 0, 2, -1])  # cells 0 and 1 merged into slot 0, cell 2 kept as it was, cell 3 dropped
    out = np.asarray(overlay.merge_overlay(picture, into, (2, 2), ["x"]))
    group = overlay.GROUP_ALPHA * np.array(overlay.GROUP_COLOURS[0])
    assert np.abs(out[60, 60] - group).max() <= 1 and np.abs(out[60, 380] - group).max() <= 1
    assert out[300, 60].max() == 0  # kept as it was: plain
    assert np.abs(out[380, 380] - overlay.DROPPED_ALPHA * np.array(overlay.DROPPED_TINT)).max() <= 1
    assert tuple(out[112, 112]) == overlay.GROUP_EDGE  # the dot on slot 0, where the merged token sits
    with pytest.raises(ValueError, match="needs 4 tokens"):
        overlay.merge_overlay(picture, into[:3], (2, 2), ["x"])
    many = np.repeat(np.arange(0, 64, 2), 2)  # 32 groups of two side by side: more than the palette
    colours = overlay.group_colours(many, (8, 8))
    cells = many.reshape(8, 8)
    assert all(colours[a] != colours[b] for a, b in zip(cells[:, 1:].ravel(), cells[:, :-1].ravel()) if a != b)


def test_merged_into_composes_the_stages():
    stats = {"stages": [{"stage": "vision", "merged_into": [[0, 0, 2, 3]]}, {"stage": "llm", "tokens_in": [4]},
                        {"stage": "llm", "merged_into": [[2, -1, 2, 3]]}]}
    assert merged_into(stats).tolist() == [2, 2, 2, 3]
    assert merged_into({"stages": [{"stage": "vision"}]}) is None


def test_model_box_is_the_processors_centre_crop(session):
    processor = session.models["image"].processor  # CLIP: short side to 64, then a 64 x 64 centre crop
    assert model_box(processor, {}, 800, 600) == (100, 0, 700, 600)
    assert model_box(processor, {}, 300, 500) == (0, 100, 300, 400)
    assert model_box(object(), {}, 300, 500) == (0, 0, 300, 500)


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
def test_parse_entries_makes_one_column_per_entry():
    assert parse_entries(["pact", " keyscore + pact ", "pact"]) == ["pact", "keyscore+pact"]
    assert parse_entries("fastv") == ["fastv"]
    with pytest.raises(DemoError, match="pick at least one method"):
        parse_entries([])


def test_build_pipeline_splits_stages_and_sets_the_llm_layer():
    frames, llm = build_pipeline(["keyscore+pact"], layer=1)
    assert (frames.name, frames.stage, llm.name, llm.layer) == ("keyscore", "frames", "pact", 1)
    assert build_pipeline("fastv", layer=0)[0].layer == type(build_pipeline("fastv", 0)[0])().layer
    with pytest.raises(DemoError, match="Did you mean 'pact'"):
        build_pipeline(["pakt"], layer=0)
    with pytest.raises(DemoError, match="pick at least one method"):
        build_pipeline([], layer=0)


def test_build_pipeline_reports_a_missing_extra(hide_module):
    hide_module("cv2")
    with pytest.raises(DemoError, match=r"opencv-python-headless: pip install 'vlm-prune\[video\]'"):
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
    assert {r["file"] for r in rows} == listed and all(Path(r["path"]).is_file() for r in rows)
    for r in rows:  # the gallery's thumbnails: videos marked with a white play triangle
        thumb = thumbnail(r["path"])
        assert 80 <= thumb.width <= 160 and thumb.mode == "RGB"
        assert (thumb.getpixel((12, 20)) == (255, 255, 255)) == r["file"].endswith(".mp4")
    assert {"astronaut.jpg", "coffee.jpg", "chelsea.jpg", "bikes.mp4"} <= listed


# ---- the comparison ----------------------------------------------------------------------------
def test_run_matches_the_model_and_the_eval_metrics(session):
    path = EXAMPLES_DIR / "synthetic_colour_0.png"
    question = "what colour is the shape ?"
    out = session.run(path, question, ["random", "fastv"], keep=0.25)
    loaded = session.models["image"]
    assert not is_wrapped(loaded.model)
    inputs = encode(loaded, Media("image", image=Image.open(path).convert("RGB")), question)
    assert out.answer_unpruned == answer(loaded, inputs, session.max_new_tokens)
    vlm_prune.wrap(loaded.model, "random", keep=0.25)
    try:
        assert out.columns[0].answer == answer(loaded, inputs, session.max_new_tokens)
    finally:
        vlm_prune.unwrap(loaded.model)
    random, fastv = out.columns
    assert [c.name for c in out.columns] == ["random", "fastv"] and not random.error and not fastv.error
    seq, layers = inputs["input_ids"].shape[1], loaded.depth
    assert random.stats["visual_tokens_in"] == [64] and random.stats["visual_tokens_out"] == [16]
    assert (random.cost.visual_in, random.cost.visual_out, random.cost.visual_layer_avg) == (64, 16, 16)
    expected = metrics.prefill_flops(loaded.model.config, metrics.rows_per_layer(layers, seq, random.stats))
    assert random.cost.flops_ratio == pytest.approx(expected / metrics.prefill_flops(loaded.model.config, [seq] * layers))
    k = fastv.stats["stages"][0]["layer"]  # FastV keeps all 64 before its layer, 16 from it on
    assert fastv.cost.visual_layer_avg == pytest.approx((64 * k + 16 * (layers - k)) / layers)
    assert fastv.cost.flops_ratio > random.cost.flops_ratio
    assert sum(random.stats["kept_grid"]) == 16 and len(random.stats["kept_grid"]) == 64
    assert len(random.timing.seconds) == session.timing_repeats and random.timing.median > 0
    assert fastv.heatmap is not None and random.heatmap is None and "no score heatmap" in random.heatmap_note
    assert random.picture.width == overlay.MIN_WIDTH  # the 64 x 64 upload, enlarged
    table = out.markdown()
    assert "| **visual tokens, final** | 64 | **16** (25%) | **16** (25%) |" in table
    assert f"**{flops_text(random.cost.flops_ratio)}**" in table and "median of 1" in table
    assert "share of unpruned" in table and "x0." not in table  # a FLOPs share, not a speed-up
    summary = out.summary()
    json.dumps(summary)
    assert [p["pipeline"] for p in summary["pruned"]] == ["random", "fastv"]


def test_merging_methods_show_which_tokens_merged_into_which(session):
    out = session.run(EXAMPLES_DIR / "synthetic_colour_0.png", "what colour is the shape ?",
                      ["pact", "tome", "visionzip", "divprune"], keep=0.25)
    for col in out.columns[:3]:
        assert col.error is None and col.merges is not None and not col.merge_note
        assert col.merges.width == col.picture.width  # drawn on the upload, like the kept overlay
        into = merged_into(col.stats)
        slots, sizes = np.unique(into[into >= 0], return_counts=True)
        assert into.size == 64 and (sizes > 1).any()
        assert slots.size == col.cost.visual_out - (col.name == "visionzip")  # VisionZip packs CLS first
    assert all(c.heatmap is not None for c in out.columns if c.name in ("pact", "visionzip"))
    divprune = out.columns[3]
    assert divprune.merges is None and "the method only keeps or drops tokens" in divprune.card()
    video = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["visionzip+pact", "uniform"],
                        keep=0.25)
    both, uniform = video.columns
    assert both.merges is not None and merged_into(both.stats).size == both.cost.visual_in
    assert [r["method"] for r in both.stats["stages"] if "merged_into" in r] == ["visionzip", "pact"]
    assert uniform.merges is None and "no merge picture" in uniform.merge_note


def test_visionzip_kept_picture_shows_the_tokens_it_kept(session):
    """VisionZip's official variant packs its 16 tokens into the first 16 slots: the kept picture
    shows the 13 dominant patches it kept as they were (CLS is the 14th dominant token), the rest as
    merged into its 2 contextual tokens - the groups the merge picture shows - not the top rows."""
    out = session.run(EXAMPLES_DIR / "synthetic_colour_0.png", "what colour is the shape ?", ["visionzip"], keep=0.25)
    col = out.columns[0]
    grid = np.array(col.stats["kept_grid"])
    into = merged_into(col.stats)
    slots, sizes = np.unique(into[into >= 0], return_counts=True)
    alone = np.isin(into, slots[sizes == 1])
    assert (grid == 1).tolist() == alone.tolist() and (grid == 2).tolist() == (~alone & (into >= 0)).tolist()
    assert (grid == 1).sum() == 13 and (grid == 2).sum() == 51 and (grid == 0).sum() == 0
    assert grid[:16].tolist() != [1] * 16
    # the dominant tokens are those of highest tower attention: the top 13 of the heatmap's scores
    scores = np.array(col.stats["token_scores"])
    assert col.heatmap is not None and set(np.argsort(-scores)[:13].tolist()) == set(np.flatnonzero(grid == 1).tolist())
    picture = np.asarray(col.picture).astype(int)
    cell = overlay.MIN_WIDTH // 8
    for t in (int(np.flatnonzero(grid == 1)[0]), int(np.flatnonzero(grid == 2)[0])):
        r, c = divmod(t, 8)
        edge = picture[r * cell + cell // 2, c * cell + 1]  # on the cell's left outline
        assert tuple(edge) == (overlay.KEPT_OUTLINE if grid[t] == 1 else overlay.MERGED_OUTLINE), t


def test_quota_budget_warning_is_shown_in_its_column(session):
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["quota", "uniform"], keep=0.25)
    quota, uniform = out.columns
    assert quota.warnings and "falls short of it" in quota.warnings[0]
    assert "**budget note:** quota allocates as the official QuoTA" in quota.card()
    assert not uniform.warnings and "budget note" not in uniform.card()


def test_videos_get_score_heatmaps_per_frame(session):
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?",
                      ["pact", "keyscore", "uniform", "keyscore+pact"], keep=0.25)
    pact, keyscore, uniform, both = out.columns
    assert pact.heatmap is not None and not pact.heatmap_note  # PACT's token scores, frame by frame
    assert keyscore.heatmap is not None and not keyscore.heatmap_note  # KeyScore's frame scores
    assert uniform.heatmap is None and "no score heatmap for uniform" in uniform.heatmap_note
    assert both.heatmap is not None  # PACT's scores of the frames KeyScore kept, the others dark
    for col in out.columns:  # four columns side by side: two frames per row, so the labels stay readable
        assert col.picture.width == overlay.strip_columns(4) * overlay.FRAME_SIDE == 2 * overlay.FRAME_SIDE
        if col.heatmap is not None:
            assert col.heatmap.width == 2 * (overlay.FRAME_SIDE + 4)


def test_quota_scores_the_example_video_in_the_toy_models_words(session):
    assert {"quota", "quota+pact"} <= set(session.offered("video", ("quota+pact",)))
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["quota"], keep=0.25)
    col = out.columns[0]
    assert col.error is None and col.answer == out.answer_unpruned
    plan = next(r for r in col.stats["stages"] if r["stage"] == "frames")["videos"][0]
    scores = np.array(plan["frame_scores"])
    # "is there a coloured shape ?" answered per frame: the frames showing the shape score high, the rest low
    assert scores.max() > 0.9 and np.median(scores) < 0.1
    assert set(plan["kept_frames"]) == set(np.flatnonzero(scores > 0.5).tolist())


def test_answers_stream_word_by_word():
    """answer_stream yields the answer as it grows (an untrained toy that never stops, six words)."""
    from vlm_prune.demo.session import LoadedModel, answer_stream
    from vlm_prune.eval.synthetic import build_model, build_processor

    torch.manual_seed(0)
    loaded = LoadedModel(build_model("image").eval(), build_processor("image"), "untrained")
    loaded.model.generation_config.eos_token_id = None
    inputs = encode(loaded, Media("image", image=Image.open(EXAMPLES_DIR / "synthetic_colour_0.png").convert("RGB")),
                    "what colour is the shape ?")
    texts = list(answer_stream(loaded, inputs, 6))
    assert len(set(texts)) >= 4 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == answer(loaded, inputs, 6) and len(texts[-1].split()) == 6


def test_vit_methods_render(session):
    out = session.run(EXAMPLES_DIR / "synthetic_colour_0.png", "what colour is the shape ?", ["tome", "asvit"], keep=0.25)
    for col in out.columns:
        assert col.error is None and col.answer and col.picture is not None
        assert col.cost.vit_flops_ratio < 1
    assert "vision tower FLOPs (ideal)" in out.markdown()


def test_a_failing_column_is_a_message_and_the_others_still_run(session):
    out = session.run(EXAMPLES_DIR / "coffee.jpg", "is there a coloured shape ?", ["quota", "random"], keep=0.5)
    quota, random = out.columns
    assert "cannot prune this model with quota" in quota.error and "frames" in quota.error
    assert quota.picture is None and "could not run" in quota.card()
    assert random.error is None and random.answer and "`quota`" not in out.markdown()
    assert not is_wrapped(session.models["image"].model)


def test_offered_methods_are_those_the_model_takes(session):
    image = session.offered("image", ("keyscore+pact",))
    video = session.offered("video", ("keyscore+pact",))
    assert {"tome", "asvit", "pact", "random", "fastervlm", "vispruner", "dart", "pdrop"} <= set(image) and not {"keyscore", "uniform", "quota", "keyscore+pact"} & set(image)
    assert {"keyscore", "uniform", "pact", "keyscore+pact", "quota", "prunevid"} <= set(video) and not {"tome", "asvit"} & set(video)
    assert "prunevid" not in image  # frames merge + llm selection: videos only
    labels = dict((v, label) for label, v in method_choices(session, "image"))
    assert labels["divprune"].startswith("divprune - ") and "diversity" in labels["divprune"]
    assert media_kind(str(EXAMPLES_DIR / "bikes.mp4")) == "video" and media_kind(str(EXAMPLES_DIR / "coffee.jpg")) == "image"


def test_prunevid_runs_on_the_video_at_the_budget(session):
    """PruneVid, one name in two stages, on the toy video: the merge's frames record, then the LLM's,
    at the toy's last layer (its default 11 is deeper than the toy); the video ends at the budget."""
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["prunevid"], keep=0.25)
    col = out.columns[-1]
    stages = [(r["stage"], r["method"]) for r in col.stats["stages"]]
    assert stages == [("frames", "prunevid"), ("llm", "prunevid")]
    assert col.stats["stages"][1]["layer"] == session.models["video"].depth - 1
    assert col.stats["visual_tokens_out"] == [col.stats["visual_tokens_in"][0] // 4]


def test_holitom_runs_both_stages_on_the_video_at_the_budget(session):
    """HoliTom, one name in two stages, on the toy video: its outer merge keeps twice the budget (r=0.5),
    its inner merge before the toy's last layer (its default 18 is deeper than the toy) lands on it and
    shows which tokens merged into which; offered for videos only."""
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["holitom"], keep=0.25)
    col = out.columns[-1]
    assert col.error is None
    frames, llm = col.stats["stages"]
    assert (frames["stage"], frames["method"], llm["stage"], llm["method"]) == ("frames", "holitom", "llm", "holitom")
    assert llm["layer"] == session.models["video"].depth - 1
    n = col.stats["visual_tokens_in"][0]
    assert frames["tokens_out"] == [n // 2] and col.stats["visual_tokens_out"] == [n // 4]
    assert col.merges is not None
    assert "holitom" in session.offered("video") and "holitom" not in session.offered("image")


def test_unknown_words_are_named_and_the_toy_says_what_it_is(session, tmp_path):
    photo = tmp_path / "photo.jpg"
    Image.open(EXAMPLES_DIR / "astronaut.jpg").resize((900, 600)).save(photo)
    out = session.run(photo, "What is the astronaut holding?", ["random"], keep=0.5)
    assert "'astronaut', 'holding' (read as `<unk>`)" in out.warning and "toy" in out.warning and "--model" in out.warning
    assert any("TOY" in n and "--model" in n for n in session.notes())
    col = out.columns[0]
    assert col.picture.width == 900  # drawn on the photo at its own resolution


def test_model_notes_name_no_folder_of_this_machine(session):
    """The notes (on the page and in docs/demo.png) say where the toy models ship inside the package,
    never the absolute path of an installation."""
    from vlm_prune.eval.synthetic import model_path

    notes = session.notes()
    assert "synthetic image model, shipped with vlm-prune (vlm_prune/eval/synthetic/models/image)" in notes
    assert not any(str(model_path(kind)) in note or str(model_path(kind).parent) in note
                   for note in notes for kind in ("image", "video"))


def test_default_layer_follows_the_models_depth(session, monkeypatch):
    assert session.default_layer() == 0  # the shipped 6-layer models take every method's own layer
    monkeypatch.setattr(type(session.models["video"]), "depth", property(lambda m: 4))
    assert session.default_layer() == 1  # too shallow for PACT's layer 4


def test_keep_everything_answers_like_the_unpruned_model(session):
    out = session.run(EXAMPLES_DIR / "synthetic_position_2.png", "is the coloured shape left or right ?",
                      ["random"], keep=1.0)
    assert out.columns[0].answer == out.answer_unpruned
    assert all(out.columns[0].stats["kept_grid"]) and out.columns[0].cost.flops_ratio == 1.0


def test_video_strip_reports_the_frames_plan(session):
    out = session.run(EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?", ["keyscore"], keep=0.25)
    col = out.columns[0]
    frames = next(r for r in col.stats["stages"] if r["stage"] == "frames")["videos"][0]
    assert col.stats["frames_kept_tokens"] == frames["tokens_per_frame"]  # no later stage: budgets are kept
    assert sum(col.stats["frames_kept_tokens"]) == col.stats["visual_tokens_out"][0]  # the newline is not a visual token
    assert col.cost.visual_in == out.cost_unpruned.visual_in == col.stats["visual_tokens_in"][0]
    assert col.picture.width == overlay.STRIP_COLUMNS * overlay.FRAME_SIDE


def test_requests_that_cannot_run_raise_messages(session):
    with pytest.raises(DemoError, match="type a question"):
        session.run(EXAMPLES_DIR / "coffee.jpg", "   ", ["random"], keep=0.5)
    with pytest.raises(DemoError, match="upload an image or a video"):
        session.run(None, "what ?", ["random"], keep=0.5)
    assert not is_wrapped(session.models["image"].model)


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

    args = build_parser("demo").parse_args(["demo", "--port", "1234", "--share", "no"])
    assert args.func is cli.run and args.port == 1234 and args.model == [] and args.share == "no"


# ---- the launched app, through gradio_client ---------------------------------------------------
def predict(client, session, path, question, methods, keep=0.25, layer=1):
    out = client.predict(session.name, gradio_client.handle_file(str(path)), question, methods, keep, layer,
                         api_name="/run")
    status, unpruned, summary, stats = out[:4]
    cards = [out[4 + 4 * i : 8 + 4 * i] for i in range(MAX_COLUMNS)]
    return status, unpruned, summary, stats, cards


def test_app_image_request_one_column_per_method(client, session):
    status, unpruned, summary, stats, cards = predict(
        client, session, EXAMPLES_DIR / "synthetic_colour_0.png", "What colour is the shape?", ["random", "tome"])
    assert unpruned == stats["unpruned"]["answer"] and "ran random, tome." in status
    assert [p["pipeline"] for p in stats["pruned"]] == ["random", "tome"]
    assert stats["pruned"][0]["visual_tokens_out"] == 16 and "LLM prefill FLOPs" in summary
    for (card, kept, _, merges), name in zip(cards[:2], ["random", "tome"]):
        assert f"### `{name}`" in card and "**answer:**" in card
        im = Image.open(kept)
        assert im.format == "PNG" and im.width == overlay.MIN_WIDTH
        assert merges["visible"] == (name == "tome")  # ToMe merges, random only drops
    assert "no merge picture for random" in cards[0][0] and cards[0][3]["value"] is None
    assert Image.open(cards[1][3]["value"]).width == overlay.MIN_WIDTH
    assert cards[2] == ("", None, None, None)


def test_app_video_pipeline_request(client, session):
    _, _, _, stats, cards = predict(client, session, EXAMPLES_DIR / "synthetic_clip.mp4", "what colour is the shape ?",
                                    ["keyscore+pact"])
    column = stats["pruned"][0]
    assert [r["method"] for r in column["last_stats"]["stages"]] == ["keyscore", "pact"]
    assert len(column["last_stats"]["frames_kept_tokens"]) == 16 and column["answer"]
    assert Image.open(cards[0][1]).width == overlay.STRIP_COLUMNS * overlay.FRAME_SIDE


def test_model_picker_lists_each_checkpoint_and_the_toy(tmp_path):
    """``vlm-prune demo --model PATH``: the picker lists the checkpoint (here the shipped video model's
    folder, loaded as any Hugging Face checkpoint) and the toy models; a request runs on the one picked."""
    from vlm_prune.demo.app import TOY, make_sessions
    from vlm_prune.eval.synthetic import model_path

    path = str(model_path("video"))
    sessions = make_sessions([path], max_new_tokens=3)
    assert list(sessions) == [path, TOY] and not sessions[path].models["video"].toy
    for s in sessions.values():
        s.timing_repeats = 1
    app = build_app(sessions)
    picker = next(c for c in app.config["components"] if c.get("props", {}).get("elem_id") == "model")
    assert [choice[1] for choice in picker["props"]["choices"]] == [path, TOY]
    port = free_port()
    launch(app, port=port, block=False)
    try:
        client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False, analytics_enabled=False)
        out = client.predict(path, gradio_client.handle_file(str(EXAMPLES_DIR / "synthetic_clip.mp4")),
                             "what colour is the shape ?", ["uniform"], 0.5, 0, api_name="/run")
        assert f"Done on `{path}`: ran uniform." in out[0] and out[3]["model"] == path
    finally:
        app.close()


def test_app_bad_requests_show_messages_and_clear_the_result(client, session, tmp_path):
    fake = tmp_path / "fake.png"
    fake.write_text("not a picture")
    cases = [
        (fake, "what ?", ["random"], "neither an image"),
        (EXAMPLES_DIR / "coffee.jpg", "", ["random"], "type a question"),
        (EXAMPLES_DIR / "coffee.jpg", "what ?", ["a", "b", "c", "d", "e"], f"at most {MAX_COLUMNS} methods"),
    ]
    for path, question, methods, message in cases:
        status, unpruned, summary, stats, cards = predict(client, session, path, question, methods)
        assert "Cannot run this request" in status and message in status
        assert (unpruned, summary, stats) == ("", "", {}) and all(c == ("", None, None, None) for c in cards)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(gradio_client.exceptions.AppError, match="Invalid file type"):
        predict(client, session, text, "what ?", ["random"])


def test_app_real_vit_tab_draws_one_picture_per_method(client):
    from vlm_prune.demo.real_patches import real_vit_available

    if not real_vit_available():
        pytest.skip('the Real ViT tab needs the real extra: pip install -e ".[real]"')
    gallery = client.predict(None, "coffee", 0.05, ["divprune", "prumerge"], api_name="/real_patches")
    assert [item["caption"] for item in gallery] == ["divprune", "prumerge"]
    assert all(Image.open(item["image"]).width > 100 for item in gallery)
