"""Tiny copies of the benchmarks in their distributed layouts (and lmms-eval's), with real encoded
videos: official aggregates computed by hand, each benchmark's prompt against lmms-eval's own
task code, bounded MVBench sampling, relocated clips, TVQA frame folders, Video-MME subtitles."""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os

import cv2
import numpy as np
import pytest
import torch

from eval_tiny import save_tiny_checkpoint, write_video
from vlm_prune.eval.answers import format_prompt
from vlm_prune.eval.datasets import load_samples, read_srt, subtitles_at
from vlm_prune.eval.runner import EvalConfig, load_visuals, run_eval


def dump(path, data) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_ov")))


def pinned_to_a(ckpt: str):
    """The tiny model whose every answer starts with "A"."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, processor = AutoModelForImageTextToText.from_pretrained(ckpt).eval(), AutoProcessor.from_pretrained(ckpt)
    a = processor.tokenizer.convert_tokens_to_ids("A")
    model.lm_head.register_forward_hook(lambda m, i, out: out + 1e4 * torch.nn.functional.one_hot(
        torch.tensor(a), out.shape[-1]).to(out.dtype))
    return model, processor


def test_mlvu_official_score_is_the_mean_over_tasks(ckpt, tmp_path):
    # always "A": plotQA 3 of 4, needle 0 of 1, count 1 of 2 (answers stored as numbers: 2 is the
    # option "2", not index 2) -> overall 4 / 7, M-Avg (0.75 + 0 + 0.5) / 3
    root = tmp_path / "MLVU"
    tasks = {"1_plotQA": [("x", "x"), ("x", "x"), ("x", "x"), ("y", "z")], "2_needle": [("p", "q")],
             "4_count": [(2, 2), (2, 3)]}
    for task, qs in tasks.items():
        rows = []
        for n, (first, answer) in enumerate(qs):
            video = f"{task}_{n}.mp4"
            write_video(str(root / "video" / task / video), n_frames=6, seed=n)
            rest = [3, 4] if isinstance(first, int) else ["z", "w"]
            cands = [first, answer if answer != first else rest[0], *rest[1:]]
            rows.append({"video": video, "question": "what is the answer ?", "candidates": cands, "answer": answer,
                         "question_type": task.split("_", 1)[1]})
        dump(root / "json" / f"{task}.json", rows)
    model, processor = pinned_to_a(ckpt)
    cfg = EvalConfig(model=ckpt, data=tmp_path, dataset="mlvu", out=tmp_path / "out", frames=2, max_new_tokens=1)
    [row] = run_eval(cfg, model, processor)
    assert row["evaluated"] == 7 and math.isclose(row["accuracy"], 4 / 7)
    # lmms-eval divides by its 7 task types, the harness's lenient reading by the 3 present
    assert row["official_name"] == "lmms-eval M-Avg (7 task types)" and math.isclose(row["official"], 1.25 / 7)
    assert math.isclose(row["lenient"], 1.25 / 3) and row["read_differently"] == 0
    md = open(tmp_path / "out" / "summary.md").read()
    assert md.index("| official |") < md.index("| lenient |") < md.index("| accuracy |")
    assert "| none | 0.179 | 0.417 | 0 | 0.571 | 7 | 0 | 0 |" in md
    merged = [json.loads(line) for line in open(tmp_path / "out" / "none" / "results.jsonl")]
    assert [(r["leaderboard_pred"], r["leaderboard_correct"]) for r in merged[:2]] == [("A", True), ("A", True)]


def write_ramp(path: str, n: int, fps: float) -> str:
    """An MJPG clip whose frame i is the flat grey 2 * i: a frame's value tells its index."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), fps, (32, 24))
    for i in range(n):
        writer.write(np.full((24, 32, 3), 2 * i, dtype=np.uint8))
    writer.release()
    return path


def make_mvbench(root, lmms_layout: bool = False) -> None:
    video = root if lmms_layout else root / "video"
    dump(root / "json" / "action_sequence.json", [
        {"video": "long.avi", "question": "What happened?", "candidates": ["sat", "ran"], "answer": "ran",
         "start": 20.0, "end": 24.0},
        {"video": "long.avi", "question": "And then?", "candidates": ["sat", "ran"], "answer": "sat",
         "start": 80.0, "end": 90.0}])  # a bound after the video's end
    write_ramp(str(video / "star" / "Charades_v1_480" / "long.avi"), n=120, fps=2.0)  # 60 s
    dump(root / "json" / "object_existence.json", [
        {"video": "moved.mp4", "question": "Is there a cube?", "candidates": ["yes", "no"], "answer": "no"}])
    write_video(str(video / "data0613" / "clevrer" / "video_validation" / "moved.mp4"), n_frames=6)
    dump(root / "json" / "episodic_reasoning.json", [
        {"video": "s01e01_seg", "question": "Why?", "candidates": ["a", "b"], "answer": "a", "start": 1.0, "end": 2.0}])
    frames = video / "tvqa" / "frames_fps3_hq" / "s01e01_seg"
    os.makedirs(frames)
    for m in range(1, 13):  # 00001.jpg .. 00012.jpg: 4 s at 3 fps, file m at m / 3 s
        cv2.imwrite(str(frames / f"{m:05d}.jpg"), np.full((24, 32, 3), 20 * m, dtype=np.uint8))


@pytest.mark.parametrize("lmms_layout", [False, True])
def test_mvbench_bounds_relocated_clips_and_frame_folders(tmp_path, lmms_layout):
    make_mvbench(tmp_path, lmms_layout)
    samples = {s.id: s for s in load_samples("mvbench", str(tmp_path))}
    assert samples["object_existence/0"].media[0].endswith("data0613/clevrer/video_validation/moved.mp4")
    # a 4 s bound of a 60 s clip: all 8 frames inside it (frames 40..48 at 2 fps), none outside
    bounded = load_visuals(samples["action_sequence/0"], 8)
    assert np.all((bounded.times >= 20.0) & (bounded.times <= 24.0)) and len(bounded.times) == 8
    values = bounded.items[0].reshape(8, -1).mean(1) / 2
    np.testing.assert_allclose(values, bounded.times * 2, atol=2)  # the frames really are those frames
    with pytest.raises(Exception, match="outside the video"):
        load_visuals(samples["action_sequence/1"], 8)  # not silently the whole video
    tvqa = load_visuals(samples["episodic_reasoning/0"], 16)  # 1-2 s: files 3..6 (m / 3 s)
    np.testing.assert_allclose(tvqa.times, [1.0, 4 / 3, 5 / 3, 2.0])
    np.testing.assert_allclose(tvqa.items[0].reshape(4, -1).mean(1), [60, 80, 100, 120], atol=1)


def test_mvbench_run_records_the_bound_failure_and_goes_on(ckpt, tmp_path):
    make_mvbench(tmp_path)
    model, processor = pinned_to_a(ckpt)
    cfg = EvalConfig(model=ckpt, data=tmp_path, dataset="mvbench", out=tmp_path / "out", frames=4, max_new_tokens=1)
    [row] = run_eval(cfg, model, processor)
    # answers B, A (failed: bound after the end), B, A -> evaluated 3, correct 1 (tvqa)
    assert (row["evaluated"], row["failed"], row["correct"]) == (3, 1, 1)
    assert row["official_name"] == "lmms-eval mean over tasks" and math.isclose(row["official"], (0 + 0 + 1) / 3)
    assert math.isclose(row["lenient"], (0 + 0 + 1) / 3)


SRT = """1
00:00:00,000 --> 00:00:02,000
<font color="white" size=".72c">hello there</font>

2
00:00:02,000 --> 00:00:04,500
<font color="white" size=".72c">second line</font>

3
00:00:08,000 --> 00:00:09,000
plain cue
"""


def test_videomme_subtitles_follow_the_sampled_frames(ckpt, tmp_path, monkeypatch):
    srt = tmp_path / "subtitle" / "vid1.srt"
    os.makedirs(srt.parent)
    srt.write_text(SRT)
    cues = read_srt(str(srt))
    assert cues == {(0.0, 2.0): '<font color="white" size=".72c">hello there</font>',
                    (2.0, 4.5): '<font color="white" size=".72c">second line</font>', (8.0, 9.0): "plain cue "}
    # 20 frames at 2 fps: cues on frames 0-3, 4-8, 16-17; 3 frames: 0, 9, 19 (truncated, as lmms-eval)
    assert subtitles_at(cues, 20, 2.0, 3) == "hello there"
    assert subtitles_at(cues, 20, 2.0, 4) == "hello there\nsecond line"  # frames 0, 6, 12, 19
    assert subtitles_at(cues, 20, 2.0, 20) == "hello there\nsecond line"  # the plain cue has no <font> text
    assert subtitles_at(cues, 20, 2.0, 1) == "hello there"
    assert subtitles_at({(5.0, 6.0): cues[(0.0, 2.0)]}, 20, 2.0, 3) == ""  # frames 10-11 only: none sampled
    late = {(8.0, 9.0): cues[(0.0, 2.0)]}  # frames 16-17; 7 frames: 15.83 truncates to 15 (rounding: 16)
    assert subtitles_at(late, 20, 2.0, 7) == "" and subtitles_at(late, 20, 2.0, 20) == "hello there"
    dump(tmp_path / "videomme.json", [
        {"videoID": "vid1", "question_id": "001-1", "duration": "short", "domain": "Knowledge", "question": "How many?",
         "options": ["A. 1.", "B. 2.", "C. 3.", "D. 4."], "answer": "A"},
        {"videoID": "vid2", "question_id": "002-1", "duration": "short", "domain": "Sports", "question": "Who?",
         "options": ["A. me", "B. you", "C. them", "D. us"], "answer": "B"}])
    write_ramp(str(tmp_path / "data" / "vid1.avi"), n=20, fps=2.0)  # 10 s
    write_video(str(tmp_path / "data" / "vid2.mp4"), n_frames=6)
    model, processor = pinned_to_a(ckpt)
    from vlm_prune.eval import runner

    seen = []

    def spy(sample, subtitles=None):
        seen.append((sample.id, subtitles))
        return format_prompt(sample, subtitles)

    monkeypatch.setattr(runner, "format_prompt", spy)
    cfg = EvalConfig(model=ckpt, data=tmp_path, dataset="videomme", out=tmp_path / "out", frames=3,
                     max_new_tokens=1, subtitles="both")
    rows = run_eval(cfg, model, processor)
    assert [r["name"] for r in rows] == ["none", "none_subs"]
    assert all(r["evaluated"] == 2 and r["accuracy"] == 0.5 for r in rows)
    samples = load_samples("videomme", str(tmp_path))
    assert samples[0].subtitles == str(srt) and samples[1].subtitles is None
    # 3 frames of the 10 s clip (frames 0, 9, 19): only the first cue is on screen then; vid2 has no .srt
    assert sorted(seen, key=str) == sorted([("001-1", None), ("001-1", "hello there"), ("002-1", None),
                                            ("002-1", "No subtitles available")], key=str)
    assert format_prompt(samples[0], "hello there").startswith(
        "This video's subtitles are listed below: \nhello there\nSelect the best answer")
    assert format_prompt(samples[0], "").startswith(  # an .srt, but no cue on screen: an empty line
        "This video's subtitles are listed below: \n\nSelect the best answer")


@pytest.fixture
def lmms_tasks(monkeypatch, tmp_path):
    if importlib.util.find_spec("lmms_eval") is None:
        pytest.skip("lmms-eval is not installed")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return lambda name: importlib.import_module(f"lmms_eval.tasks.{name}.utils")


def test_prompts_are_lmms_eval_task_prompts(lmms_tasks, tmp_path):
    from vlm_prune.eval.datasets import Sample

    opts = ["one", "two", "three", "four"]
    vmme = Sample("1", [], "video", "How many?", opts, "A", benchmark="videomme")
    ref = lmms_tasks("videomme").videomme_doc_to_text(
        {"question": "How many?", "options": [f"{k}. {o}" for k, o in zip("ABCD", opts)]},
        {"pre_prompt": "", "post_prompt": "\nAnswer with the option's letter from the given choices directly."})
    assert format_prompt(vmme) == ref
    mvb = Sample("2", [], "video", "What?", opts[:3], "A", benchmark="mvbench")
    assert format_prompt(mvb) == lmms_tasks("mvbench").mvbench_doc_to_text(
        {"question": "What?", "candidates": opts[:3]}, {"post_prompt": "Only give the best option.\n"})
    nq = Sample("3", [], "video", "Why? ", opts + ["five"], "A", benchmark="nextqa")
    assert format_prompt(nq) == lmms_tasks("nextqa").nextqa_doc_to_text_mc(
        {"question": "Why? ", **{f"a{i}": o for i, o in enumerate(opts + ["five"])}}, {})
    ego = Sample("4", [], "video", "What did c do?", opts + ["five"], "A", benchmark="egoschema")
    assert format_prompt(ego) == lmms_tasks("egoschema").egoschema_doc_to_text(
        {"question": "What did c do?", "option": [f"{k}. {o}" for k, o in zip("ABCDE", opts + ["five"])]},
        {"pre_prompt": "", "post_prompt": ""})


def test_lmms_eval_copies_of_nextqa_and_egoschema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    nq = tmp_path / "nextqa"
    os.makedirs(nq / "MC")
    rows = [{"video": 4010069381, "frame_count": 6, "width": 56, "height": 40, "question": "why ?", "answer": 2,
             "qid": 7, "type": t, **{f"a{i}": f"opt{i}" for i in range(5)}} for t in ("TP", "CW")]
    rows[1]["video"] = 4010069382
    pq.write_table(pa.Table.from_pylist(rows), nq / "MC" / "test-00000-of-00001.parquet")
    for r in rows:
        write_video(str(nq / "NExTVideo" / f"{r['video']}.mp4"), n_frames=6)
    s = load_samples("nextqa", str(nq), split="test")
    assert [(x.id, x.answer, x.categories) for x in s] == [
        ("4010069381_7", "C", {"type": "TN", "group": "temporal"}),  # TP merged into TN
        ("4010069382_7", "C", {"type": "CW", "group": "causal"})]
    assert s[0].media == [str(nq / "NExTVideo" / "4010069381.mp4")]

    ego = tmp_path / "egoschema"
    os.makedirs(ego / "Subset")
    pq.write_table(pa.Table.from_pylist([{"q_uid": "u1", "video_idx": "vid1", "question": "what ?", "answer": "3",
                                          "option": [f"{k}. o{k}" for k in "ABCDE"]}]),
                   ego / "Subset" / "test-00000-of-00001.parquet")
    write_video(str(ego / "videos" / "vid1.mp4"), n_frames=6)
    [e] = load_samples("egoschema", str(ego))
    assert (e.id, e.options, e.answer, e.media) == ("u1", [f"o{k}" for k in "ABCDE"], "D", [str(ego / "videos" / "vid1.mp4")])
