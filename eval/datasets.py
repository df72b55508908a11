"""Video-QA and image-VQA datasets read from local files in their published layouts.

Every loader returns a list of :class:`Sample` records with the same fields, so the runner
never sees a dataset's own format. Supported layouts (``root`` is the ``--data`` folder):

- ``videomme``  Video-MME: ``videomme/test-00000-of-00001.parquet`` (or any ``*.parquet`` /
  ``*.json`` / ``*.jsonl`` export of it) with ``videoID, question_id, duration, domain,
  sub_category, task_type, question, options ["A. ...", ...], answer "A"``; videos in
  ``data/<videoID>.mp4`` (also ``.MP4`` / ``.mkv`` / ``.webm``).
- ``mlvu``      MLVU dev: ``json/<n>_<task>.json`` (entries ``video, question, candidates,
  answer`` text, ``question_type``), videos in ``video/<n>_<task>/<video>``. A folder that
  holds ``MLVU/`` works too. Open-ended tasks (``8_sub_scene``, ``9_summary``) are skipped.
- ``mvbench``   MVBench: ``json/<task>.json`` (``video, question, candidates, answer`` text,
  ``start``/``end`` for clipped tasks), videos under ``video/<source folder>/`` (see
  ``MVBENCH_TASKS``) or their relocated copies under ``video/data0613/<source folder>/``;
  ``tvqa`` frame folders are read as images at 3 fps (file number m at m / 3 s).
- ``nextqa``    NExT-QA multiple choice: ``val.csv`` / ``test.csv`` (``video, question, answer``
  index, ``qid, type, a0..a4``), ``map_vid_vidorID.json``, videos ``NExTVideo/<dir>/<id>.mp4``;
  or lmms-eval's copy ``MC/test-*.parquet`` with ``NExTVideo/<video>.mp4``.
- ``egoschema`` EgoSchema subset: ``questions.json`` (``q_uid, question, option 0..4``),
  ``subset_answers.json`` ({q_uid: index}), videos ``videos/<q_uid>.mp4``; or lmms-eval's copy
  ``Subset/test-*.parquet`` with ``videos/<video_idx>.mp4``.

lmms-eval's downloads load as they are: ``--data $HF_HOME/<cache_dir>`` (the videos it unzipped),
the tables there or in the hub cache beside it (:func:`hub_snapshots`); MLVU dev's
``mlvu/test-*.parquet`` (``video_name, question, candidates, answer, task_type``) and MVBench's
already-cut clip folders (:data:`MVBENCH_LMMS_FOLDERS`) included.
- ``jsonl``     generic: one ``*.jsonl`` or ``*.csv`` file (or ``--data`` pointing at it) with
  ``video, question, options, answer`` and optional ``id``, ``category``.
- ``image``     image VQA: ``*.jsonl`` with ``image, question, answer`` and optional ``options``.
- ``hf``        a ``datasets.save_to_disk`` folder (needs the optional ``datasets`` package)
  whose columns follow the generic format.

A wrong or incomplete layout raises :class:`DatasetLayoutError` naming the missing file or
field and what was expected.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

LETTERS = string.ascii_uppercase
VIDEO_EXTS = (".mp4", ".MP4", ".mkv", ".webm", ".avi", ".mov")


class DatasetLayoutError(ValueError):
    """The files under ``--data`` do not match the layout of the chosen ``--dataset``."""


@dataclass
class Sample:
    """One question, in the same shape for every dataset.

    media: absolute paths of the video (one) or image(s); a folder means a folder of frames.
    options: option texts without their letter; empty for open-ended questions.
    answer: the correct letter ("A", ...) when there are options, else the reference text.
    categories: breakdown fields, e.g. {"duration": "short", "domain": "Knowledge"}.
    clip: (start_s, end_s) of the video segment the question is about, or None for all of it.
    frames_fps: frame rate of a frame folder (None for video files and images).
    benchmark: which benchmark's prompt and official score apply ("videomme", "mlvu", ...;
        "generic" for the generic layouts).
    subtitles: path of the video's .srt subtitles (Video-MME), or None.
    raw_options: the options as lmms-eval's copy of the benchmark writes them (EgoSchema:
        "A. ..."), which its answer parser matches; None: "<letter>. <option>".
    prompt_text: the question as lmms-eval's copy stores it with its options (MLVU dev), used
        verbatim in the prompt; None: built from question and options.
    """

    id: str
    media: list[str]
    media_type: str  # "video" | "image"
    question: str
    options: list[str]
    answer: str
    categories: dict[str, str] = field(default_factory=dict)
    clip: tuple[float, float] | None = None
    frames_fps: float | None = None
    benchmark: str = "generic"
    subtitles: str | None = None
    raw_options: list[str] | None = None
    prompt_text: str | None = None


def _fail(msg: str) -> DatasetLayoutError:
    return DatasetLayoutError(msg)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise _fail(f"missing file {path}") from None
    except json.JSONDecodeError as err:
        raise _fail(f"{path} is not valid JSON ({err})") from None


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise _fail(f"{path} line {n} is not valid JSON ({err})") from None
    return rows


def _read_csv(path: str) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def _read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _fail(
            f"{path} is a parquet file; reading it needs pyarrow (pip install 'vlm-prune[eval]' or "
            "pip install pyarrow), or export it to JSON first"
        ) from None
    return pq.read_table(path).to_pylist()


def _read_table(path: str) -> list[dict[str, Any]]:
    """Rows of a .json (list), .jsonl, .csv or .parquet file."""
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".csv"):
        return _read_csv(path)
    data = _read_json(path)
    if not isinstance(data, list):
        raise _fail(f"{path} should hold a JSON list of question records, found {type(data).__name__}")
    return data


def _need(row: dict[str, Any], keys: Iterable[str], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise _fail(
            f"{where}: missing field(s) {', '.join(missing)}; expected fields {', '.join(keys)} "
            f"(found {', '.join(sorted(map(str, row))) or 'none'})"
        )


def _strip_letter(option: str, i: int) -> str:
    """'A. text' / '(A) text' / 'A) text' -> 'text' when the letter matches position i."""
    m = re.match(rf"^\s*\(?{LETTERS[i]}[.):]\s*", option)
    return option[m.end():].strip() if m else option.strip()


def _letter_of(answer: Any, options: list[str], where: str, text_answer: bool = False) -> str:
    """The answer letter from a letter, an index or an option's text.

    text_answer: the layout stores the option's text (MLVU, MVBench), so a number such as 3 is
    the option reading "3", never an index.
    """
    if isinstance(answer, bool):
        raise _fail(f"{where}: answer {answer!r} is neither a letter, an index nor an option text")
    text = str(answer).strip()
    if isinstance(answer, str) or text_answer:  # option text first: MLVU's count answers are "2", "3", ...
        for i, opt in enumerate(options):
            if text == opt.strip() or _strip_letter(text, i) == opt.strip():
                return LETTERS[i]
        if text_answer:
            raise _fail(f"{where}: answer {text!r} is not the text of any option (options: {options})")
        letter = text.strip("().").upper()
        if len(letter) == 1 and letter in LETTERS[: len(options)]:
            return letter
    if isinstance(answer, int) or text.isdigit():
        if 0 <= int(text) < len(options):
            return LETTERS[int(text)]
        raise _fail(f"{where}: answer index {text} is out of range for {len(options)} options")
    raise _fail(f"{where}: answer {text!r} matches no option (options: {options})")


def _find_video(folder: str, stem: str) -> str:
    """folder/stem with the first video extension that exists (folder/stem.mp4 if none does)."""
    for ext in VIDEO_EXTS:
        path = os.path.join(folder, stem + ext)
        if os.path.exists(path):
            return path
    return os.path.join(folder, stem + ".mp4")


def split_missing(samples: list[Sample]) -> tuple[list[Sample], list[tuple[Sample, str]]]:
    """(samples whose media all exist, [(sample, "missing <path>")] for the others)."""
    present, missing = [], []
    for s in samples:
        gone = next((p for p in s.media if not os.path.exists(p)), None)
        if gone is None:
            present.append(s)
        else:
            missing.append((s, f"missing {gone}"))
    return present, missing


def missing_media_error(dataset: str, n_total: int, missing: list[tuple[Sample, str]]) -> DatasetLayoutError:
    first = missing[0][1].removeprefix("missing ")
    return _fail(
        f"{dataset}: {len(missing)} of {n_total} samples have missing media, first {first}; "
        "download the videos into the expected folder, or pass --skip-missing to evaluate the rest "
        "(they are then counted as skipped)"
    )


def _existing(path: str) -> str | None:
    return path if os.path.exists(path) else None


# lmms-eval's downloads: the videos unzipped into $HF_HOME/<cache_dir> (the folder given as --data),
# the annotation tables in the Hugging Face hub cache beside it, $HF_HOME/hub/datasets--<org>--<name>.
LMMS_REPOS = {"videomme": "lmms-lab/Video-MME", "mlvu": "sy1998/MLVU_dev", "mvbench": "OpenGVLab/MVBench",
              "nextqa": "lmms-lab/NExTQA", "egoschema": "lmms-lab/egoschema"}


def hub_snapshots(root: str, dataset: str) -> list[str]:
    """Snapshot folders of ``dataset``'s lmms-eval repository in the hub cache beside ``root``
    ($HF_HOME/hub/datasets--<org>--<name>/snapshots/*), newest first."""
    org, name = LMMS_REPOS[dataset].split("/")
    pattern = os.path.join(os.path.dirname(os.path.abspath(root)), "hub", f"datasets--{org}--{name}", "snapshots", "*")
    return sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True)


def _tables(root: str, dataset: str, pattern: str) -> list[str]:
    """Files matching ``pattern`` under ``root``, else under the newest hub snapshot holding any."""
    for folder in [root, *hub_snapshots(root, dataset)]:
        found = sorted(glob.glob(os.path.join(folder, pattern)))
        if found:
            return found
    return []


# ---------------------------------------------------------------------------------- Video-MME
def load_videomme(root: str) -> list[Sample]:
    """Video-MME (Fu et al., 2024) in the lmms-lab/Video-MME layout; subtitles (for the "w/ subs"
    score) are read from subtitle/<videoID>.srt when present. lmms-eval's download works as it is:
    --data $HF_HOME/videomme (data/, subtitle/) with the table in the hub cache beside it."""
    tables = _tables(root, "videomme", os.path.join("videomme", "*.parquet")) or sorted(
        p for ext in ("parquet", "json", "jsonl") for p in glob.glob(os.path.join(root, f"*.{ext}"))
    )
    if not tables:
        raise _fail(
            f"videomme: no annotation table in {root}; expected videomme/test-00000-of-00001.parquet "
            "(or a .parquet / .json / .jsonl export of it) and videos in data/<videoID>.mp4"
        )
    video_dir = os.path.join(root, "data")
    keys = ("videoID", "question_id", "duration", "domain", "question", "options", "answer")
    samples = []
    for table in tables:
        for n, row in enumerate(_read_table(table)):
            where = f"{table} record {n}"
            _need(row, keys, where)
            options = [_strip_letter(o, i) for i, o in enumerate(row["options"])]
            samples.append(Sample(
                id=str(row["question_id"]),
                media=[_find_video(video_dir, str(row["videoID"]))],
                subtitles=_existing(os.path.join(root, "subtitle", f"{row['videoID']}.srt")),
                media_type="video",
                benchmark="videomme",
                question=str(row["question"]),
                options=options,
                answer=_letter_of(row["answer"], options, where),
                categories={k: str(row[k]) for k in ("duration", "domain", "sub_category", "task_type") if k in row},
            ))
    return samples


_VIDEOMME_FONT = re.compile(r'<font color="white" size=".72c">(.*?)</font>')
NO_SUBTITLES = "No subtitles available"


def _srt_seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.split(":")
    seconds, millis = rest.split(",")
    return int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(millis) / 1000


def read_srt(path: str) -> dict[tuple[float, float], str]:
    """{(start_s, end_s): text} of an .srt file as lmms-eval 0.7.3's Video-MME task reads it
    (``load_subtitles`` in lmms_eval/tasks/videomme/utils.py): blocks split at blank lines, a
    block's lines after the time line joined by spaces, a repeated time range keeping its first
    place and its last text."""
    with open(path, encoding="utf-8") as f:
        blocks = f.read().split("\n\n")
    cues: dict[tuple[float, float], str] = {}
    for block in blocks:
        lines = block.split("\n")
        if block.strip() and len(lines) >= 3:
            start, end = lines[1].split(" --> ")
            cues[(_srt_seconds(start), _srt_seconds(end))] = " ".join(lines[2:])
    return cues


def subtitles_at(cues: dict[tuple[float, float], str], n_frames: int, fps: float, frame_num: int) -> str:
    """Video-MME's subtitles for ``frame_num`` frames of a video of ``n_frames`` frames at ``fps``,
    as lmms-eval 0.7.3 writes them (``videomme_doc_to_text_subtitle``): frames
    ``linspace(0, n_frames - 1, frame_num)`` truncated to integers, a cue from frame int(start * fps)
    up to (not including) int(end * fps), each cue on screen at any of those frames once (in the
    order of a Python set of their indices), its text inside Video-MME's ``<font>`` tag (cues
    without it left out), one a line; "" when no cue is on screen."""
    spans = [(int(start * fps), int(end * fps), text) for (start, end), text in cues.items()]
    frames = np.linspace(0, n_frames - 1, frame_num, dtype=int).tolist()
    shown = [i for f in frames for i, (lo, hi, _) in enumerate(spans) if lo <= f < hi]
    texts = [_VIDEOMME_FONT.findall(spans[i][2]) for i in list(set(shown))]
    return "\n".join(found[0] for found in texts if found)


# --------------------------------------------------------------------------------------- MLVU
MLVU_OPEN_ENDED = ("8_sub_scene", "9_summary")
MLVU_TASK_TYPES = ("anomaly_reco", "count", "ego", "needle", "order", "plotQA", "topic_reasoning")  # lmms-eval's


def _mlvu_task(stem: str) -> str:
    """"2_needle" -> "needle": the task type lmms-eval's MLVU dev scores by (its 7 fixed types)."""
    return stem.split("_", 1)[1] if re.match(r"^\d+_", stem) else stem


def load_mlvu(root: str) -> list[Sample]:
    """MLVU dev (Zhou et al., 2024): json/<n>_<task>.json + video/<n>_<task>/<video>; the task is
    the file's name without its number (lmms-eval's task types: plotQA, needle, ego, ...).

    lmms-eval's download (sy1998/MLVU_dev) works as it is: --data $HF_HOME/mlvu (the unzipped
    videos, at ``video_name``) with mlvu/test-*.parquet there or in the hub cache beside it.
    """
    if not os.path.isdir(os.path.join(root, "json")) and os.path.isdir(os.path.join(root, "MLVU", "json")):
        root = os.path.join(root, "MLVU")
    files = sorted(glob.glob(os.path.join(root, "json", "*.json")))
    if not files:
        lmms = _tables(root, "mlvu", os.path.join("mlvu", "test-*.parquet"))
        if lmms:
            return [_mlvu_lmms_row(row, n, root, f"{path} row {n}") for path in lmms
                    for n, row in enumerate(_read_table(path))]
        raise _fail(
            f"mlvu: no json/*.json in {root}; expected json/1_plotQA.json ... 7_topic_reasoning.json "
            "and videos in video/<same name>/<video> (or lmms-eval's mlvu/test-*.parquet)"
        )
    samples = []
    for path in files:
        task = os.path.splitext(os.path.basename(path))[0]
        if task in MLVU_OPEN_ENDED:
            continue
        if _mlvu_task(task) not in MLVU_TASK_TYPES:
            raise _fail(f"mlvu: {path} is not one of MLVU dev's multiple-choice tasks "
                        f"({', '.join(MLVU_TASK_TYPES)}, as json/<n>_<task>.json), whose 7 types M-Avg averages")
        rows = _read_json(path)
        if not isinstance(rows, list):
            raise _fail(f"{path} should hold a JSON list of questions")
        for n, row in enumerate(rows):
            where = f"{path} record {n}"
            _need(row, ("video", "question", "candidates", "answer"), where)
            options = [str(c) for c in row["candidates"]]
            samples.append(Sample(
                id=f"{task}/{n}",
                media=[os.path.join(root, "video", task, row["video"])],
                media_type="video",
                benchmark="mlvu",
                question=str(row["question"]),
                options=options,
                answer=_letter_of(row["answer"], options, where, text_answer=True),
                categories={"task": _mlvu_task(task)},
            ))
    return samples


def _mlvu_lmms_row(row: dict[str, Any], n: int, root: str, where: str) -> Sample:
    _need(row, ("video_name", "question", "candidates", "answer", "task_type"), where)
    if row["task_type"] not in MLVU_TASK_TYPES:
        raise _fail(f"{where}: task_type {row['task_type']!r} is not one of MLVU dev's {', '.join(MLVU_TASK_TYPES)}")
    options = [str(c) for c in row["candidates"]]
    question = str(row["question"])
    return Sample(
        id=f"{row['task_type']}/{n}",
        media=[os.path.join(root, str(row["video_name"]))],
        media_type="video",
        benchmark="mlvu",
        question=question.split("\n", 1)[0],
        options=options,
        answer=_letter_of(row["answer"], options, where),
        categories={"task": str(row["task_type"])},
        prompt_text=question,
    )


# ------------------------------------------------------------------------------------ MVBench
# task json -> (folder under video/, has start/end, is a folder of frames)
MVBENCH_TASKS: dict[str, tuple[str, bool, bool]] = {
    "action_sequence": ("star/Charades_v1_480", True, False),
    "action_prediction": ("star/Charades_v1_480", True, False),
    "action_antonym": ("ssv2_video", False, False),
    "fine_grained_action": ("Moments_in_Time_Raw/videos", False, False),
    "unexpected_action": ("FunQA_test/test", False, False),
    "object_existence": ("clevrer/video_validation", False, False),
    "object_interaction": ("star/Charades_v1_480", True, False),
    "object_shuffle": ("perception/videos", False, False),
    "moving_direction": ("clevrer/video_validation", False, False),
    "action_localization": ("sta/sta_video", True, False),
    "scene_transition": ("scene_qa/video", False, False),
    "action_count": ("perception/videos", False, False),
    "moving_count": ("clevrer/video_validation", False, False),
    "moving_attribute": ("clevrer/video_validation", False, False),
    "state_change": ("perception/videos", False, False),
    "fine_grained_pose": ("nturgbd", False, False),
    "character_order": ("perception/videos", False, False),
    "egocentric_navigation": ("vlnqa", False, False),
    "episodic_reasoning": ("tvqa/frames_fps3_hq", True, True),
    "counterfactual_inference": ("clevrer/video_validation", False, False),
}
TVQA_FPS = 3.0


MVBENCH_RELOCATED = "data0613"  # the downloadable MVBench keeps some clevrer / star clips under video/data0613/

# lmms-eval's download (OpenGVLab/MVBench, revision "video"; lmms_eval/tasks/mvbench/utils.py DATA_LIST):
# the bounded clips already cut to their segment (star/Charades_segment, sta/sta_video_segment, TVQA
# as mp4 segments), ssv2 and NTU RGB+D converted to mp4; their start / end are not applied again.
MVBENCH_LMMS_FOLDERS: dict[str, str] = {
    "action_sequence": "star/Charades_segment",
    "action_prediction": "star/Charades_segment",
    "action_antonym": "ssv2_video_mp4",
    "object_interaction": "star/Charades_segment",
    "action_localization": "sta/sta_video_segment",
    "fine_grained_pose": "nturgbd_convert",
    "episodic_reasoning": "tvqa/video_fps3_hq_segment",
}


def _first_existing(paths: list[str]) -> str | None:
    return next((p for p in paths if os.path.exists(p)), None)


def _mvbench_sample(task: str, n: int, row: dict[str, Any], root: str, base: str, where: str) -> Sample:
    """One MVBench question: its clip in the original layout (bounds and TVQA frame folders
    applied), else lmms-eval's already-cut copy (no bounds, every clip a video file)."""
    folder, bounded, is_frames = MVBENCH_TASKS[task]
    _need(row, ("video", "question", "candidates", "answer"), where)
    name = str(row["video"])
    original = _first_existing([os.path.join(base, folder, name), os.path.join(base, MVBENCH_RELOCATED, folder, name)])
    cut_folder = MVBENCH_LMMS_FOLDERS.get(task)
    cut = None
    if original is None and cut_folder is not None:
        candidates = [os.path.join(d, cut_folder, name) for d in dict.fromkeys((root, base))]
        unbounded = bounded and not ("start" in row and "end" in row)  # lmms-eval's json of cut clips
        cut = _first_existing(candidates) or (
            candidates[0] if unbounded or os.path.isdir(os.path.join(root, cut_folder)) else None)
    if cut is None:
        if bounded:
            _need(row, ("start", "end"), where)
        media = original or os.path.join(base, folder, name)
    options = [str(c) for c in row["candidates"]]
    return Sample(
        id=f"{task}/{n}",
        media=[cut or media],
        media_type="video",
        benchmark="mvbench",
        question=str(row["question"]),
        options=options,
        answer=_letter_of(row["answer"], options, where, text_answer=True),
        categories={"task": task},
        clip=(float(row["start"]), float(row["end"])) if bounded and cut is None else None,
        frames_fps=TVQA_FPS if is_frames and cut is None else None,
    )


def load_mvbench(root: str) -> list[Sample]:
    """MVBench (Li et al., 2024): json/<task>.json + video/<source>/...; tasks present are loaded.

    Clips moved to video/data0613/<source>/ are found there. lmms-eval's download works as it
    is: --data $HF_HOME/mvbench_video (the sources at the top, no video/ folder; json/ there or
    in the hub snapshot beside it), its already-cut folders (``MVBENCH_LMMS_FOLDERS``) included.
    """
    json_dirs = [os.path.join(d, "json") for d in [root, *hub_snapshots(root, "mvbench")]]
    tables = {t: _first_existing([os.path.join(d, f"{t}.json") for d in json_dirs]) for t in MVBENCH_TASKS}
    present = [t for t, path in tables.items() if path is not None]
    if not present:
        raise _fail(
            f"mvbench: no task file in {os.path.join(root, 'json')}; expected one or more of "
            f"{', '.join(t + '.json' for t in MVBENCH_TASKS)} and videos under video/"
        )
    base = os.path.join(root, "video") if os.path.isdir(os.path.join(root, "video")) else root
    samples = []
    for task in present:
        path = tables[task]
        samples += [_mvbench_sample(task, n, row, root, base, f"{path} record {n}")
                    for n, row in enumerate(_read_json(path))]
    return samples


# ------------------------------------------------------------------------------------ NExT-QA
NEXTQA_GROUPS = {"C": "causal", "T": "temporal", "D": "descriptive"}


def _nextqa_table(root: str, split: str) -> str:
    """<split>.csv of the official release, else lmms-eval's MC/<split>-*.parquet."""
    table = os.path.join(root, f"{split}.csv")
    found = _tables(root, "nextqa", os.path.join("MC", f"{split}-*.parquet"))
    if os.path.exists(table) or not found:
        return table
    return found[0]


def load_nextqa(root: str, split: str = "val") -> list[Sample]:
    """NExT-QA multiple choice (Xiao et al., 2021): <split>.csv, map_vid_vidorID.json, NExTVideo/.

    lmms-eval's copy works too: MC/<split>-*.parquet (``--split test``) and NExTVideo/<video>.mp4
    without a map. Question type TP counts as TN, as the official evaluation merges them.
    """
    table = _nextqa_table(root, split)
    if not os.path.exists(table):
        raise _fail(f"nextqa: missing {table}; expected the multiple-choice {split}.csv (--split val|test), "
                    f"or lmms-eval's MC/{split}-*.parquet")
    map_path = os.path.join(root, "map_vid_vidorID.json")
    mapping = _read_json(map_path) if os.path.exists(map_path) or table.endswith(".csv") else None
    keys = ("video", "question", "answer", "qid", "type", "a0", "a1", "a2", "a3", "a4")
    samples = []
    for n, row in enumerate(_read_table(table)):
        where = f"{table} row {n + 2}"
        _need(row, keys, where)
        vid = str(row["video"])
        if mapping is not None and vid not in mapping:
            raise _fail(f"{where}: video {vid} is not in map_vid_vidorID.json")
        options = [str(row[f"a{i}"]) for i in range(5)]
        qtype = "TN" if str(row["type"]) == "TP" else str(row["type"])
        samples.append(Sample(
            id=f"{vid}_{row['qid']}",
            media=[_find_video(os.path.join(root, "NExTVideo"), mapping[vid] if mapping is not None else vid)],
            media_type="video",
            benchmark="nextqa",
            question=str(row["question"]),
            options=options,
            answer=_letter_of(int(row["answer"]), options, where),
            categories={"type": qtype, "group": NEXTQA_GROUPS.get(qtype[:1], qtype[:1])},
        ))
    return samples


# ---------------------------------------------------------------------------------- EgoSchema
def load_egoschema(root: str) -> list[Sample]:
    """EgoSchema subset (Mangalam et al., 2023): questions.json + subset_answers.json + videos/;
    or lmms-eval's copy: Subset/test-*.parquet (``question``, ``option`` ["A. ...", ...],
    ``answer`` index, ``video_idx``, ``q_uid``) + videos/<video_idx>.mp4."""
    video_dir = os.path.join(root, "videos") if os.path.isdir(os.path.join(root, "videos")) else root
    lmms_tables = _tables(root, "egoschema", os.path.join("Subset", "test-*.parquet"))
    if not os.path.exists(os.path.join(root, "questions.json")) and lmms_tables:
        return [_egoschema_lmms_row(row, video_dir, f"{path} row {n}")
                for path in lmms_tables for n, row in enumerate(_read_table(path))]
    questions = _read_json(os.path.join(root, "questions.json"))
    answers_path = os.path.join(root, "subset_answers.json")
    if not os.path.exists(answers_path):
        raise _fail(
            f"egoschema: missing {answers_path}; only the 500-question subset has public answers "
            "({q_uid: answer index})"
        )
    answers = _read_json(answers_path)
    by_uid = {}
    for n, row in enumerate(questions):
        _need(row, ("q_uid", "question") + tuple(f"option {i}" for i in range(5)), f"questions.json record {n}")
        by_uid[row["q_uid"]] = row
    samples = []
    for uid, idx in answers.items():
        if uid not in by_uid:
            raise _fail(f"egoschema: subset_answers.json names {uid}, which questions.json lacks")
        row = by_uid[uid]
        options = [str(row[f"option {i}"]) for i in range(5)]
        samples.append(_egoschema_sample(uid, video_dir, uid, row["question"], options,
                                         _letter_of(int(idx), options, f"subset_answers.json[{uid}]")))
    return samples


def _egoschema_sample(uid: str, video_dir: str, video: str, question: str, options: list[str], answer: str) -> Sample:
    return Sample(id=uid, media=[_find_video(video_dir, video)], media_type="video", benchmark="egoschema",
                  question=str(question), options=options, answer=answer)


def _egoschema_lmms_row(row: dict[str, Any], video_dir: str, where: str) -> Sample:
    _need(row, ("q_uid", "video_idx", "question", "option", "answer"), where)
    options = [_strip_letter(str(o), i) for i, o in enumerate(row["option"])]
    sample = _egoschema_sample(str(row["q_uid"]), video_dir, str(row["video_idx"]), row["question"], options,
                               _letter_of(int(row["answer"]), options, where))
    sample.raw_options = [str(o) for o in row["option"]]
    return sample


# ------------------------------------------------------------------------- generic and images
def _generic_sample(row: dict[str, Any], n: int, base: str, media_key: str, where: str) -> Sample:
    need = (media_key, "question", "answer") + (("options",) if media_key == "video" else ())
    _need(row, need, where)
    media = row[media_key] if isinstance(row[media_key], list) else [row[media_key]]
    options = row.get("options") or []
    if isinstance(options, str):  # CSV: a JSON list, or options separated by "|"
        options = json.loads(options) if options.strip().startswith("[") else options.split("|")
    options = [_strip_letter(str(o), i) for i, o in enumerate(options)]
    cats = row.get("categories") or {}
    if not isinstance(cats, dict):
        raise _fail(f"{where}: 'categories' should be an object of name -> value")
    if row.get("category") not in (None, ""):
        cats = {"category": row["category"], **cats}
    return Sample(
        id=str(row.get("id", n)),
        media=[p if os.path.isabs(p) else os.path.join(base, p) for p in map(str, media)],
        media_type="video" if media_key == "video" else "image",
        question=str(row["question"]),
        options=options,
        answer=_letter_of(row["answer"], options, where) if options else str(row["answer"]),
        categories={str(k): str(v) for k, v in cats.items()},
    )


def _single_table(root: str, exts: tuple[str, ...], dataset: str, expected: str) -> str:
    if os.path.isfile(root):
        return root
    found = sorted(p for ext in exts for p in glob.glob(os.path.join(root, f"*{ext}")))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(map(os.path.basename, found))})"
        raise _fail(f"{dataset}: found {what} {'/'.join(exts)} files in {root}; expected exactly one, {expected}")
    return found[0]


def load_generic(root: str) -> list[Sample]:
    """Generic video QA: one JSONL or CSV with video, question, options, answer [, id, category]."""
    path = _single_table(root, (".jsonl", ".csv"), "jsonl", "with fields video, question, options, answer")
    base = os.path.dirname(os.path.abspath(path))
    return [_generic_sample(r, n, base, "video", f"{path} record {n}") for n, r in enumerate(_read_table(path))]


def load_image_vqa(root: str) -> list[Sample]:
    """Image VQA: one JSONL with image, question, answer [, options, id, category]."""
    path = _single_table(root, (".jsonl",), "image", "with fields image, question, answer [, options]")
    base = os.path.dirname(os.path.abspath(path))
    return [_generic_sample(r, n, base, "image", f"{path} record {n}") for n, r in enumerate(_read_jsonl(path))]


def load_hf(root: str) -> list[Sample]:
    """A ``datasets.save_to_disk`` folder with generic columns (video or image, question, ...)."""
    try:
        import datasets
    except ImportError:
        raise _fail("hf: reading a Hugging Face datasets folder needs the datasets package (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(root)
    except FileNotFoundError as err:
        raise _fail(f"hf: {root} is not a datasets.save_to_disk folder ({err})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise _fail(f"hf: {root} holds splits {list(ds)}; point --data at one split's folder")
    key = "video" if "video" in ds.column_names else "image"
    return [_generic_sample(r, n, root, key, f"{root} row {n}") for n, r in enumerate(ds)]


LOADERS: dict[str, Callable[[str], list[Sample]]] = {
    "videomme": load_videomme,
    "mlvu": load_mlvu,
    "mvbench": load_mvbench,
    "nextqa": load_nextqa,
    "egoschema": load_egoschema,
    "jsonl": load_generic,
    "image": load_image_vqa,
    "hf": load_hf,
}


def read_samples(dataset: str, root: str, *, split: str | None = None) -> list[Sample]:
    """Every question of ``dataset`` (a key of LOADERS) under ``root``, media present or not."""
    if dataset not in LOADERS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(LOADERS)}")
    if not os.path.exists(root):
        raise _fail(f"--data {root} does not exist")
    samples = load_nextqa(root, split) if dataset == "nextqa" and split else LOADERS[dataset](root)
    if not samples:
        raise _fail(f"{dataset}: {root} holds no questions")
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise _fail(f"{dataset}: sample id {dup!r} occurs more than once; ids must be unique")
    return samples


def load_samples(dataset: str, root: str, *, split: str | None = None, skip_missing: bool = False) -> list[Sample]:
    """:func:`read_samples`, checking that every media file exists (or dropping, with skip_missing)."""
    samples = read_samples(dataset, root, split=split)
    present, missing = split_missing(samples)
    if missing and not skip_missing:
        raise missing_media_error(dataset, len(samples), missing)
    return present
