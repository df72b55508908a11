"""Leaderboard figures by lmms-eval 0.7.3's rules (vlm_prune.eval.leaderboard) on 22 canned output
styles: lmms-eval's readings written out (checked without lmms-eval), and, when lmms-eval is
installed, the same outputs through its own task functions (extraction, random fallback under
random.seed(0), aggregation) compared with ours."""
from __future__ import annotations

import importlib
import importlib.util
import math
import random

import pytest

from vlm_prune.eval import leaderboard, metrics
from vlm_prune.eval.answers import score
from vlm_prune.eval.datasets import Sample

OUTPUTS = [
    "B", "(B)", "B.", "The answer is B.", "green", "b", "A man is walking. C", "C or B", "",
    "Answer: (C)", "B) green", "**C**", "I think it is D.", "The colour is green.",
    "The man in the video wears a green coat", "none of these", "E", "[D]", "Option A", "A",
    "It is dark red", "d.",
]
OPTIONS = ["red", "green", "dark red", "blue", "yellow"]
N_OPTIONS = {"videomme": 4, "mlvu": 4, "mvbench": 4, "nextqa": 5, "egoschema": 5}
TASKS = {"mlvu": ("plotQA", "needle", "count"), "mvbench": ("action_sequence", "object_shuffle")}


def letters(text: str) -> list[str | None]:
    return [None if c == "-" else c for c in text.split()]


# lmms-eval 0.7.3's letter for each of OUTPUTS (answer B; "-": reads none), which of them it drew
# at random (random.seed(0), in this order), and the harness's own (lenient) letters
LMMS = {
    "videomme": ("B B B B - - A C - C B C D - - - - D A A - -", []),
    "mlvu": ("B B B B - - A C - C B C D - - - - D A A - -", []),
    "mvbench": ("B B B B - B A C - C B C D - A - E D A A - D", []),
    "nextqa": ("B B B B D D C B A C C E D D B D E C A A D C", [4, 5, 8, 10, 11, 13, 15, 17, 20, 21]),
    "egoschema": ("B B B B D D A C A C C E D D D C E D A A C E", [4, 5, 8, 10, 11, 13, 14, 15, 17, 20, 21]),
}
HARNESS = {4: "B B B B B B C B - C B C D B B - - D A A C D", 5: "B B B B B B C B - C B C D B B - E D A A C D"}
# (lmms-eval's figure, the harness's lenient figure, outputs read differently) on the run below
FIGURES = {  # tasks: MLVU's by i % 3 (8, 7, 7 questions), MVBench's by i % 2 (11, 11; output 8 is "")
    "videomme": (5 / 22, 10 / 22, 8),
    "mlvu": ((2 / 8 + 2 / 7 + 1 / 7 + 0 + 0 + 0 + 0) / 7, (2 / 8 + 5 / 7 + 3 / 7) / 3, 8),
    "mvbench": ((3 / 10 + 3 / 11) / 2, (5 / 11 + 5 / 11) / 2, 7),
    "nextqa": (6 / 22, 10 / 22, 10),
    "egoschema": (4 / 22, 10 / 22, 11),
}


def samples(dataset: str) -> list[Sample]:
    out = []
    for i in range(len(OUTPUTS)):
        cats = {"task": TASKS[dataset][i % len(TASKS[dataset])]} if dataset in TASKS else {}
        out.append(Sample(str(i), [], "video", "What colour?", OPTIONS[: N_OPTIONS[dataset]], "B",
                          categories=cats, benchmark=dataset))
    return out


def run_records(dataset: str) -> list[dict]:
    """The answered records of a run whose outputs are OUTPUTS, annotated as merge_setting does."""
    qs = samples(dataset)
    recs = []
    for s, out in zip(qs, OUTPUTS):
        pred, correct = score(s, out)
        recs.append({"id": s.id, "status": "ok", "categories": s.categories, "answer": s.answer, "output": out,
                     "pred": pred, "correct": correct})
    leaderboard.annotate(dataset, recs, {s.id: s for s in qs})
    return recs


@pytest.mark.parametrize("dataset", list(LMMS))
def test_readings_written_out(dataset):
    recs = run_records(dataset)
    want, drawn = LMMS[dataset]
    assert [r["leaderboard_pred"] for r in recs] == letters(want)
    assert [i for i, r in enumerate(recs) if r["leaderboard_random"]] == drawn
    assert [r["pred"] for r in recs] == letters(HARNESS[N_OPTIONS[dataset]])
    correct = [r["leaderboard_correct"] for r in recs]
    if dataset == "mvbench":  # "" is left out of the denominator; its mcq_acc matches letters only
        assert correct[8] is None and correct[:8] == [True, True, True, True, False, True, False, False]
    else:
        assert correct == [p == "B" for p in letters(want)]


@pytest.mark.parametrize("dataset", list(LMMS))
def test_figures_written_out(dataset):
    s = metrics.summarize(run_records(dataset), dataset)
    official, lenient, differ = FIGURES[dataset]
    assert s["official_name"] == leaderboard.NAMES[dataset]
    assert math.isclose(s["official"], official) and math.isclose(s["lenient"], lenient)
    assert s["read_differently"] == differ and s["random_draws"] == len(LMMS[dataset][1])


def test_mlvu_divides_by_its_seven_task_types_and_refuses_others():
    recs = [r for r in run_records("mlvu") if r["categories"]["task"] == "needle"]
    s = metrics.summarize(recs, "mlvu")
    assert math.isclose(s["official"], (2 / 7) / 7) and math.isclose(s["lenient"], 5 / 7)
    recs[0]["categories"] = {"task": "findNeedle"}
    with pytest.raises(ValueError, match=r"'findNeedle'.* not among lmms-eval's"):
        metrics.summarize(recs, "mlvu")


def test_generic_datasets_have_no_second_reading():
    recs = run_records("videomme")
    for r in recs:
        r.pop("leaderboard_pred"), r.pop("leaderboard_correct"), r.pop("leaderboard_random")
    s = metrics.summarize(recs, "jsonl")
    assert s["official"] == s["lenient"] == s["accuracy"] == 10 / 22 and s["read_differently"] is None
    assert math.isnan(metrics.summarize(recs, "videomme")["official"])  # not annotated: no figure claimed


# ------------------------------------------------------------------- against lmms-eval itself
@pytest.fixture(scope="module")
def lmms(tmp_path_factory):
    if importlib.util.find_spec("lmms_eval") is None:
        pytest.skip("lmms-eval is not installed (the written-out values above still check the rules)")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf")))  # the task modules read HF_HOME on import
    yield lambda name: importlib.import_module(f"lmms_eval.tasks.{name}.utils")
    mp.undo()


def lmms_figure(lmms, dataset: str) -> tuple[list, float]:
    """(lmms-eval's per-output reading, its aggregate as a fraction) on OUTPUTS, by its own functions."""
    u = lmms(dataset)
    qs = samples(dataset)
    if dataset == "videomme":
        docs = [{"question_id": s.id, "duration": "short", "domain": "Knowledge", "sub_category": "Humanity & History",
                 "task_type": "Counting Problem", "answer": "B", "videoID": "v"} for s in qs]
        res = [u.videomme_process_results(d, [o])["videomme_perception_score"] for d, o in zip(docs, OUTPUTS)]
        return [r["pred_answer"] or None for r in res], u.videomme_aggregate_results(res) / 100
    if dataset == "mlvu":
        res = [u.mlvu_process_results({"question": "Q", "task_type": s.categories["task"], "answer": "B"}, [o])
               ["mlvu_percetion_score"] for s, o in zip(qs, OUTPUTS)]
        return [r["pred_answer"] or None for r in res], u.mlvu_aggregate_results_dev(res) / 100
    if dataset == "mvbench":
        doc = {"candidates": OPTIONS[:4], "answer": "green"}
        res = [(s.categories["task"], u.mvbench_process_results(doc, [o])["mvbench_accuracy"]) for s, o in zip(qs, OUTPUTS)]
        per_task = [u.mvbench_aggregate_results([r for t, r in res if t == task]) / 100 for task in TASKS["mvbench"]]
        return [r["score"] for _, r in res], sum(per_task) / len(per_task)
    random.seed(0)
    if dataset == "nextqa":
        doc = {**{f"a{i}": o for i, o in enumerate(OPTIONS)}, "answer": 1}
        index2ans, choices = u.get_multi_choice_info(doc)
        read = [u.parse_multi_choice_response(o, choices, index2ans) for o in OUTPUTS]
        random.seed(0)
        res = [u.nextqa_mc_process_results(doc, [o])["exact_match"] for o in OUTPUTS]
        return read, sum(res) / len(res)
    doc = {"option": [f"{c}. {o}" for c, o in zip("ABCDE", OPTIONS)], "answer": "1", "video_idx": "v"}
    index2ans, choices = u.get_multi_choice_info(doc)
    read = [u.parse_multi_choice_response(o, choices, index2ans)[0] for o in OUTPUTS]
    random.seed(0)
    res = [u.egoschema_process_results_generation(doc, [o])["score"] for o in OUTPUTS]
    return read, u.egoschema_aggregate_score(res, None)


@pytest.mark.parametrize("dataset", list(LMMS))
def test_equal_to_lmms_eval_task_code(lmms, dataset):
    read, figure = lmms_figure(lmms, dataset)
    recs = run_records(dataset)
    if dataset == "mvbench":  # lmms-eval keeps only the 0/1 score per output
        assert [int(bool(r["leaderboard_correct"])) for r in recs] == read
    else:
        assert [r["leaderboard_pred"] for r in recs] == read == letters(LMMS[dataset][0])
    assert math.isclose(metrics.summarize(recs, dataset)["official"], figure)
    assert math.isclose(figure, FIGURES[dataset][0])


def test_mcq_extract_and_mcq_acc_on_more_styles(lmms):
    from lmms_eval.tasks._task_utils.mcq_extract import extract_mcq_answer

    mv = lmms("mvbench")
    more = ["The correct answer is (D) blue", "答案是C", "I choose B, not A", "A: red", "(a)", "Best option: (C",
            "1,000 people. B", "\"B\"", "C. dark red", "a. red\nb. green", "The best answer is:", "e", "None"]
    for text in OUTPUTS + more:
        assert leaderboard.mcq_extract(text) == extract_mcq_answer(text, choices=["A", "B", "C", "D"]), text
        for gt in "ABCDE":
            assert (leaderboard.mvbench_reading(text) == leaderboard.mvbench_reading(gt)) == bool(mv.mcq_acc(gt, text))


def test_console_and_table_show_both_columns():
    from vlm_prune.eval.cli import summary_line
    from vlm_prune.eval.plots import markdown_table

    row = {"name": "none", "method": "none", **metrics.summarize(run_records("mlvu"), "mlvu")}
    assert summary_line(row).startswith("none                         lmms-eval M-Avg (7 task types) 0.097  "
                                        "harness M-Avg (mean over tasks) 0.464 (read differently: 8)  accuracy 0.455")
    md = markdown_table([row], "t")
    assert "| setting | official | lenient | read differently | accuracy |" in md and "| none | 0.097 | 0.464 | 8 | 0.455 |" in md
    assert "lenient: harness M-Avg (mean over tasks) (the harness's own answer reading)" in md


def test_random_outputs_read_as_lmms_eval_reads_them(lmms):
    """Fuzz: strings of letters, punctuation, option words and answer phrases give lmms-eval's
    reading under all five rules (the random fallbacks from the same seeded generator)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from lmms_eval.tasks._task_utils.mcq_extract import extract_mcq_answer

    mv, nq, eg = lmms("mvbench"), lmms("nextqa"), lmms("egoschema")
    nq_index, choices = nq.get_multi_choice_info({f"a{i}": o for i, o in enumerate(OPTIONS)})
    raw = [f"{c}. {o}" for c, o in zip("ABCDE", OPTIONS)]
    eg_index, _ = eg.get_multi_choice_info({"option": raw})
    pieces = st.sampled_from(list("ABCDEabcde ().:,!?;'\"\n-/1") + OPTIONS + ["the answer is ", "A. red", "1,000",
                                                                              "I choose ", "答案是", "Option "])

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(pieces, max_size=12).map("".join), st.integers(0, 2**16))
    def check(text, seed):
        assert leaderboard.mcq_extract(text) == extract_mcq_answer(text, choices=["A", "B", "C", "D"])
        for gt in "ABCDE":
            assert (leaderboard.mvbench_reading(text) == leaderboard.mvbench_reading(gt)) == bool(mv.mcq_acc(gt, text))
        random.seed(seed)
        want = nq.parse_multi_choice_response(text, choices, nq_index)
        assert leaderboard.nextqa_parse(text, OPTIONS, random.Random(seed))[0] == want
        random.seed(seed)
        want = eg.parse_multi_choice_response(text, choices, eg_index)[0]
        assert leaderboard.egoschema_parse(text, raw, random.Random(seed))[0] == want

    check()
