"""lmms-eval 0.7.3's downloads, built tiny as lmms-eval leaves them ($HF_HOME/<cache_dir> with the
videos, the tables in the hub cache beside it), load as they are: every benchmark's media path and
prompt against lmms-eval's own doc_to_visual / doc_to_text when it is installed, the values written
out otherwise; MVBench's already-cut clips (all 20 tasks) are not cut again; Video-MME's subtitles
are lmms-eval's text for the same number of frames."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os

import numpy as np
import pytest

from eval_tiny import write_video
from vlm_prune.eval.answers import format_prompt
from vlm_prune.eval.datasets import MVBENCH_TASKS, load_samples
from vlm_prune.eval.runner import _subtitles, load_visuals

pa = pytest.importorskip("pyarrow", reason="lmms-eval's tables are parquet files (pip install pyarrow)")
import pyarrow.parquet as pq  # noqa: E402


def hub_table(hf, repo: str, relpath: str, rows: list[dict]) -> None:
    org, name = repo.split("/")
    path = hf / "hub" / f"datasets--{org}--{name}" / "snapshots" / "0123abc" / relpath
    os.makedirs(path.parent, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def lmms(monkeypatch, tmp_path):
    """lmms-eval's task module of a benchmark, its cache folders pointed at tmp_path/hf, or None."""
    if importlib.util.find_spec("lmms_eval") is None:
        return None
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hf = str(tmp_path / "hf")

    def get(name):
        u = importlib.import_module(f"lmms_eval.tasks.{name}.utils")
        for attr, value in {"base_cache_dir": hf, "cache_dir_dev": os.path.join(hf, "mlvu"),
                            "cache_dir": os.path.join(hf, {"nextqa": "nextqa/NExTVideo", "egoschema": "egoschema/videos"}
                                                      .get(name, name))}.items():
            if hasattr(u, attr):
                monkeypatch.setattr(u, attr, value)
        return u
    return get


# -------------------------------------------------------------------------------- Video-MME
def font(text: str) -> str:
    return f'<font color="white" size=".72c">{text}</font>'


SRT = "\n\n".join([
    f"1\n00:00:00,000 --> 00:00:01,300\n{font('one')}",
    f"2\n00:00:01,300 --> 00:00:03,900\n{font('two')}",
    f"3\n00:00:05,000 --> 00:00:05,100\n{font('three')}",
    "4\n00:00:06,000 --> 00:00:09,000\nplain cue without the font tag",
    f"5\n00:00:09,000 --> 00:00:14,900\n{font('five')} and more",
    f"6\n00:00:00,000 --> 00:00:01,300\n{font('uno')}",  # the same span again: lmms-eval keeps this text
]) + "\n"
GAP_SRT = f"1\n00:00:05,000 --> 00:00:05,500\n{font('only at 5 s')}\n"  # frames 20-21
# subtitle text at N frames of the 60-frame 4 fps clip (cue frames [0,5) [5,15) [20,20) [24,36) [36,59))
VMME_SUBS = {3: "uno", 8: "uno\ntwo\nfive", 16: "uno\ntwo\nfive"}


def test_videomme_download_and_subtitles(tmp_path, lmms):
    hf = tmp_path / "hf"
    rows = [{"video_id": f"00{i}", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
             "url": "u", "videoID": f"vid{i}", "question_id": f"00{i}-1", "task_type": "Counting Problem",
             "question": "How many?", "options": ["A. 1.", "B. 2.", "C. 3.", "D. 4."], "answer": "C"} for i in (1, 2, 3)]
    hub_table(hf, "lmms-lab/Video-MME", "videomme/test-00000-of-00001.parquet", rows)
    for i in (1, 2, 3):
        write_video(str(hf / "videomme" / "data" / f"vid{i}.mp4"), n_frames=60, fps=4.0, size=(24, 32))
    os.makedirs(hf / "videomme" / "subtitle")
    (hf / "videomme" / "subtitle" / "vid1.srt").write_text(SRT)
    (hf / "videomme" / "subtitle" / "vid2.srt").write_text(GAP_SRT)
    samples = load_samples("videomme", str(hf / "videomme"))  # the table found in the hub cache
    assert [s.id for s in samples] == ["001-1", "002-1", "003-1"] and samples[2].subtitles is None
    u = lmms("videomme") if lmms else None
    for n, want in VMME_SUBS.items():
        got = [_subtitles(s, load_visuals(s, n)) for s in samples]
        assert got == [want, "", "No subtitles available"]  # vid2: an .srt, nothing on screen
        for s, row, subs in zip(samples, rows, got):
            prompt = format_prompt(s, subs)
            assert prompt.startswith(f"This video's subtitles are listed below: \n{subs}\nSelect the best answer")
            if u is not None:
                assert s.media == u.videomme_doc_to_visual(row)
                assert prompt == u.videomme_doc_to_text_subtitle(row, {"frame_num": n, "pre_prompt": "", "post_prompt": ""})


# ---------------------------------------------------------------------------------- MVBench
LMMS_FOLDERS = {  # lmms_eval/tasks/mvbench/utils.py DATA_LIST, written out
    "object_interaction": "star/Charades_segment", "action_sequence": "star/Charades_segment",
    "action_prediction": "star/Charades_segment", "action_localization": "sta/sta_video_segment",
    "moving_count": "clevrer/video_validation", "fine_grained_pose": "nturgbd_convert",
    "character_order": "perception/videos", "object_shuffle": "perception/videos", "egocentric_navigation": "vlnqa",
    "moving_direction": "clevrer/video_validation", "episodic_reasoning": "tvqa/video_fps3_hq_segment",
    "fine_grained_action": "Moments_in_Time_Raw/videos", "scene_transition": "scene_qa/video",
    "state_change": "perception/videos", "moving_attribute": "clevrer/video_validation",
    "action_antonym": "ssv2_video_mp4", "unexpected_action": "FunQA_test/test",
    "counterfactual_inference": "clevrer/video_validation", "object_existence": "clevrer/video_validation",
    "action_count": "perception/videos",
}


@pytest.mark.parametrize("json_in_hub", [False, True])
def test_mvbench_download_loads_all_20_tasks_with_cut_clips_cut_once(tmp_path, lmms, json_in_hub):
    hf = tmp_path / "hf"
    root = hf / "mvbench_video"
    for task in MVBENCH_TASKS:
        bounded = MVBENCH_TASKS[task][1]
        row = {"video": f"{task}.mp4", "question": f"{task}?", "candidates": ["yes", "no"], "answer": "no",
               **({"start": 20.0, "end": 24.0} if bounded else {})}  # times in the uncut source video
        where = hf / "hub" / "datasets--OpenGVLab--MVBench" / "snapshots" / "0123abc" if json_in_hub else root
        os.makedirs(where / "json", exist_ok=True)
        (where / "json" / f"{task}.json").write_text(json.dumps([row]))
        write_video(str(root / LMMS_FOLDERS[task] / f"{task}.mp4"), n_frames=20, fps=2.0, size=(24, 32))
    samples = {s.categories["task"]: s for s in load_samples("mvbench", str(root))}
    assert sorted(samples) == sorted(LMMS_FOLDERS)
    for task, s in samples.items():
        assert s.media == [str(root / LMMS_FOLDERS[task] / f"{task}.mp4")] and s.answer == "B"
        assert s.clip is None and s.frames_fps is None  # already cut: start / end not applied again
    seen = load_visuals(samples["action_sequence"], 4)  # the whole 10 s segment, not 20-24 s of it
    np.testing.assert_allclose(seen.times, [0.0, 3.0, 6.5, 9.5])
    if lmms:
        u = lmms("mvbench")
        for task, s in samples.items():
            row = {"video": f"{task}.mp4"}
            assert s.media == u.mvbench_doc_to_visual(row, {"sub_task": task})
            assert format_prompt(s) == u.mvbench_doc_to_text({"question": f"{task}?", "candidates": ["yes", "no"]},
                                                             {"post_prompt": "Only give the best option.\n"})


def test_mvbench_cut_clip_missing_is_reported_at_lmms_evals_path(tmp_path):
    root = tmp_path / "mvbench_video"
    os.makedirs(root / "json")
    (root / "json" / "action_sequence.json").write_text(json.dumps(
        [{"video": "gone.mp4", "question": "Q", "candidates": ["a", "b"], "answer": "a"}]))
    with pytest.raises(Exception, match=r"1 of 1 samples have missing media, first .*star/Charades_segment/gone\.mp4"):
        load_samples("mvbench", str(root))


# ------------------------------------------------------------------------------------- MLVU
def test_mlvu_dev_download(tmp_path, lmms):
    hf = tmp_path / "hf"
    rows = [{"video_name": f"{t}_{i}.mp4", "duration": 100.0, "question": f"What {t}?\n(A) x\n(B) y\n(C) z\n(D) w",
             "candidates": ["x", "y", "z", "w"], "answer": "B", "task_type": t}
            for i, t in enumerate(["plotQA", "needle", "count"])]
    hub_table(hf, "sy1998/MLVU_dev", "mlvu/test-00000-of-00001.parquet", rows)
    for r in rows:
        write_video(str(hf / "mlvu" / r["video_name"]), n_frames=6)
    samples = load_samples("mlvu", str(hf / "mlvu"))
    assert [(s.id, s.question, s.answer, s.categories) for s in samples] == [
        ("plotQA/0", "What plotQA?", "B", {"task": "plotQA"}), ("needle/1", "What needle?", "B", {"task": "needle"}),
        ("count/2", "What count?", "B", {"task": "count"})]
    assert format_prompt(samples[0]) == rows[0]["question"] + "\nOnly give the best option.\nBest option: ("
    if lmms:
        u = lmms("mlvu")
        for s, r in zip(samples, rows):
            assert s.media == u.mlvu_doc_to_visual_dev(r)
            assert format_prompt(s) == u.mlvu_doc_to_text(r, {"pre_prompt": "", "post_prompt": "\nOnly give the best option.\nBest option: ("})


# ---------------------------------------------------------------------------- NExT-QA, EgoSchema
def test_nextqa_and_egoschema_downloads(tmp_path, lmms):
    hf = tmp_path / "hf"
    nq = [{"video": 4010069381 + i, "frame_count": 6, "width": 56, "height": 40, "question": " why ? ", "answer": 2,
           "qid": 7, "type": "CW", **{f"a{k}": f" opt{k}" for k in range(5)}} for i in range(2)]
    hub_table(hf, "lmms-lab/NExTQA", "MC/test-00000-of-00001.parquet", nq)
    for r in nq:
        write_video(str(hf / "nextqa" / "NExTVideo" / f"{r['video']}.mp4"), n_frames=6)
    ego = [{"q_uid": "u1", "video_idx": "vid1", "question": "what did c do ?", "answer": "3",
            "option": [f"{k}. o{k}" for k in "ABCDE"]}]
    hub_table(hf, "lmms-lab/egoschema", "Subset/test-00000-of-00001.parquet", ego)
    write_video(str(hf / "egoschema" / "videos" / "vid1.mp4"), n_frames=6)
    nqs = load_samples("nextqa", str(hf / "nextqa"), split="test")
    assert [(s.id, s.answer) for s in nqs] == [("4010069381_7", "C"), ("4010069382_7", "C")]
    [e] = load_samples("egoschema", str(hf / "egoschema"))
    assert (e.id, e.answer, e.raw_options) == ("u1", "D", ego[0]["option"])
    assert format_prompt(e) == "what did c do ?\nA. oA\nB. oB\nC. oC\nD. oD\nE. oE\n" \
                               "Answer with the option's letter from the given choices directly."
    if lmms:
        u = lmms("nextqa")
        for s, r in zip(nqs, nq):
            assert s.media == u.nextqa_doc_to_visual(r) and format_prompt(s) == u.nextqa_doc_to_text_mc(r, {})
        u = lmms("egoschema")
        assert e.media == u.egoschema_doc_to_visual(ego[0])
        assert format_prompt(e) == u.egoschema_doc_to_text(ego[0], {"pre_prompt": "", "post_prompt": ""})
