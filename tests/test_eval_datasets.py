"""Dataset loaders: each published layout, built tiny on disk, and the errors of broken ones."""
from __future__ import annotations

import csv
import importlib.util
import json
import os

import pytest

from vlm_prune.eval.datasets import DatasetLayoutError, load_samples


def touch(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\0")
    return path


def dump(path: str, data) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


VMME = [
    {"video_id": "001", "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
     "url": "u", "videoID": "fFjv93ACGo8", "question_id": "001-1", "task_type": "Counting Problem",
     "question": "How many?", "options": ["A. 1.", "B. 2.", "C. 3.", "D. 4."], "answer": "C"},
    {"video_id": "002", "duration": "long", "domain": "Sports", "sub_category": "Football",
     "url": "u", "videoID": "zzz", "question_id": "002-1", "task_type": "Object Reasoning",
     "question": "Who?", "options": ["A. me", "B. you", "C. them", "D. us"], "answer": "A"},
]


def make_videomme(root: str, parquet: bool) -> None:
    touch(f"{root}/data/fFjv93ACGo8.mp4")
    touch(f"{root}/data/zzz.mkv")
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        os.makedirs(f"{root}/videomme")
        pq.write_table(pa.Table.from_pylist(VMME), f"{root}/videomme/test-00000-of-00001.parquet")
    else:
        dump(f"{root}/videomme.json", VMME)


@pytest.mark.parametrize("parquet", [False, True])
def test_videomme(tmp_path, parquet):
    if parquet and importlib.util.find_spec("pyarrow") is None:
        pytest.skip("pyarrow is not installed (the eval extra brings it)")
    make_videomme(str(tmp_path), parquet)
    s = load_samples("videomme", str(tmp_path))
    assert [x.id for x in s] == ["001-1", "002-1"]
    assert s[0].options == ["1.", "2.", "3.", "4."] and s[0].answer == "C"
    assert s[0].categories == {"duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
                               "task_type": "Counting Problem"}
    assert s[0].media == [f"{tmp_path}/data/fFjv93ACGo8.mp4"] and s[1].media == [f"{tmp_path}/data/zzz.mkv"]


def test_videomme_missing_field_and_video(tmp_path):
    make_videomme(str(tmp_path), parquet=False)
    os.remove(f"{tmp_path}/data/zzz.mkv")
    with pytest.raises(DatasetLayoutError, match=r"1 of 2 samples have missing media, first .*zzz\.mp4.*--skip-missing"):
        load_samples("videomme", str(tmp_path))
    assert [x.id for x in load_samples("videomme", str(tmp_path), skip_missing=True)] == ["001-1"]
    dump(f"{tmp_path}/videomme.json", [{k: v for k, v in VMME[0].items() if k != "options"}])
    with pytest.raises(DatasetLayoutError, match=r"videomme\.json record 0: missing field\(s\) options"):
        load_samples("videomme", str(tmp_path))


def test_videomme_empty_folder(tmp_path):
    with pytest.raises(DatasetLayoutError, match=r"test-00000-of-00001\.parquet"):
        load_samples("videomme", str(tmp_path))


def test_mlvu(tmp_path):
    root = f"{tmp_path}/MLVU"
    dump(f"{root}/json/1_plotQA.json", [
        {"video": "movie_1.mp4", "duration": 300, "question": "Q?", "candidates": ["x", "y", "z", "w"],
         "answer": "z", "question_type": "plotQA"}])
    dump(f"{root}/json/4_count.json", [
        {"video": "c.mp4", "duration": 30, "question": "How many?", "candidates": ["1", "2"], "answer": "2",
         "question_type": "count"}])
    dump(f"{root}/json/9_summary.json", [{"video": "s.mp4", "question": "Summarise", "answer": "..."}])
    touch(f"{root}/video/1_plotQA/movie_1.mp4")
    touch(f"{root}/video/4_count/c.mp4")
    s = load_samples("mlvu", str(tmp_path))  # the folder above MLVU/ works too
    assert [(x.id, x.answer, x.categories["task"]) for x in s] == [("1_plotQA/0", "C", "plotQA"), ("4_count/0", "B", "count")]
    assert s[0].media == [f"{root}/video/1_plotQA/movie_1.mp4"]


def test_mlvu_answer_not_an_option(tmp_path):
    dump(f"{tmp_path}/json/2_needle.json", [{"video": "n.mp4", "question": "Q", "candidates": ["a", "b"], "answer": "c"}])
    with pytest.raises(DatasetLayoutError, match=r"2_needle\.json record 0: answer 'c' is not the text of any option"):
        load_samples("mlvu", str(tmp_path))


def test_mvbench(tmp_path):
    dump(f"{tmp_path}/json/action_sequence.json", [
        {"video": "ABC.mp4", "question": "What happened?", "candidates": ["sat", "ran", "ate"], "answer": "ran",
         "start": 1.5, "end": 4.0}])
    dump(f"{tmp_path}/json/episodic_reasoning.json", [
        {"video": "s01e01_seg", "question": "Why?", "candidates": ["a", "b"], "answer": "a", "start": 0, "end": 2}])
    touch(f"{tmp_path}/video/star/Charades_v1_480/ABC.mp4")
    touch(f"{tmp_path}/video/tvqa/frames_fps3_hq/s01e01_seg/00001.jpg")
    s = load_samples("mvbench", str(tmp_path))
    assert [(x.id, x.answer, x.clip, x.frames_fps) for x in s] == [
        ("action_sequence/0", "B", (1.5, 4.0), None), ("episodic_reasoning/0", "A", (0.0, 2.0), 3.0)]
    dump(f"{tmp_path}/json/action_sequence.json", [{"video": "ABC.mp4", "question": "Q", "candidates": ["a"], "answer": "a"}])
    with pytest.raises(DatasetLayoutError, match=r"action_sequence\.json record 0: missing field\(s\) start, end"):
        load_samples("mvbench", str(tmp_path))


def test_nextqa(tmp_path):
    cols = ["video", "frame_count", "width", "height", "question", "answer", "qid", "type", "a0", "a1", "a2", "a3", "a4"]
    with open(f"{tmp_path}/val.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerow(["4010069381", 100, 640, 480, "why did the boy run", 3, 6, "CW", "a", "b", "c", "d", "e"])
        w.writerow(["4010069381", 100, 640, 480, "what is after", 0, 7, "TN", "a", "b", "c", "d", "e"])
    dump(f"{tmp_path}/map_vid_vidorID.json", {"4010069381": "1006/4010069381"})
    touch(f"{tmp_path}/NExTVideo/1006/4010069381.mp4")
    s = load_samples("nextqa", str(tmp_path))
    assert [(x.id, x.answer, x.categories) for x in s] == [
        ("4010069381_6", "D", {"type": "CW", "group": "causal"}), ("4010069381_7", "A", {"type": "TN", "group": "temporal"})]
    with pytest.raises(DatasetLayoutError, match=r"missing .*test\.csv"):
        load_samples("nextqa", str(tmp_path), split="test")


def test_egoschema(tmp_path):
    q = [{"q_uid": f"u{i}", "google_drive_id": "g", "question": f"Q{i}?",
          **{f"option {j}": f"o{j}" for j in range(5)}} for i in range(3)]
    dump(f"{tmp_path}/questions.json", q)
    for i in range(3):
        touch(f"{tmp_path}/videos/u{i}.mp4")
    with pytest.raises(DatasetLayoutError, match=r"missing .*subset_answers\.json"):
        load_samples("egoschema", str(tmp_path))
    dump(f"{tmp_path}/subset_answers.json", {"u2": 4, "u0": 1})
    s = load_samples("egoschema", str(tmp_path))
    assert [(x.id, x.answer, x.options[4]) for x in s] == [("u2", "E", "o4"), ("u0", "B", "o4")]


def test_generic_jsonl_and_csv(tmp_path):
    touch(f"{tmp_path}/clips/a.mp4")
    rows = [{"id": "x", "video": "clips/a.mp4", "question": "Q", "options": ["A. cat", "B. dog"], "answer": "dog",
             "category": "pets"},
            {"video": "clips/a.mp4", "question": "Q2", "options": ["cat", "dog"], "answer": 0}]
    with open(f"{tmp_path}/qa.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    s = load_samples("jsonl", str(tmp_path))
    assert [(x.id, x.options, x.answer, x.categories) for x in s] == [
        ("x", ["cat", "dog"], "B", {"category": "pets"}), ("1", ["cat", "dog"], "A", {})]
    os.remove(f"{tmp_path}/qa.jsonl")
    with open(f"{tmp_path}/qa.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["video", "question", "options", "answer"])
        w.writerow(["clips/a.mp4", "Q", "cat|dog|cow", "C"])
    s = load_samples("jsonl", str(tmp_path / "qa.csv"))
    assert (s[0].options, s[0].answer, s[0].media) == (["cat", "dog", "cow"], "C", [f"{tmp_path}/clips/a.mp4"])


def test_generic_errors(tmp_path):
    with pytest.raises(DatasetLayoutError, match="found no .jsonl/.csv files"):
        load_samples("jsonl", str(tmp_path))
    with open(f"{tmp_path}/qa.jsonl", "w") as f:
        f.write(json.dumps({"video": "a.mp4", "question": "Q", "answer": "A"}) + "\n{broken\n")
    with pytest.raises(DatasetLayoutError, match=r"qa\.jsonl line 2 is not valid JSON"):
        load_samples("jsonl", str(tmp_path))
    with open(f"{tmp_path}/qa.jsonl", "w") as f:
        f.write(json.dumps({"video": "a.mp4", "question": "Q", "answer": "A"}) + "\n")
    with pytest.raises(DatasetLayoutError, match=r"record 0: missing field\(s\) options; expected fields video, question, answer, options"):
        load_samples("jsonl", str(tmp_path))
    with pytest.raises(ValueError, match="unknown dataset 'vmme'"):
        load_samples("vmme", str(tmp_path))


def test_image_vqa(tmp_path):
    touch(f"{tmp_path}/img/1.png")
    with open(f"{tmp_path}/vqa.jsonl", "w") as f:
        f.write(json.dumps({"image": "img/1.png", "question": "Colour?", "answer": "Red"}) + "\n")
        f.write(json.dumps({"image": "img/1.png", "question": "Which?", "options": ["x", "y"], "answer": "y", "id": "m"}) + "\n")
    s = load_samples("image", str(tmp_path))
    assert [(x.id, x.media_type, x.options, x.answer) for x in s] == [("0", "image", [], "Red"), ("m", "image", ["x", "y"], "B")]


def test_hf_save_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional datasets package is not installed")
    touch(f"{tmp_path}/v.mp4")
    ds = datasets.Dataset.from_list([{"video": f"{tmp_path}/v.mp4", "question": "Q", "options": ["p", "q"], "answer": "q"}])
    ds.save_to_disk(f"{tmp_path}/hf")
    s = load_samples("hf", f"{tmp_path}/hf")
    assert [(x.media, x.answer) for x in s] == [([f"{tmp_path}/v.mp4"], "B")]
    with pytest.raises(DatasetLayoutError, match="not a datasets.save_to_disk folder"):
        load_samples("hf", str(tmp_path))
