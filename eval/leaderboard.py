"""The leaderboard figure of each benchmark, scored by lmms-eval 0.7.3's own rules.

Re-implemented from lmms-eval 0.7.3 (EvolvingLMMs-Lab/lmms-eval, the release on PyPI;
``lmms_eval/tasks/<task>/utils.py`` and ``lmms_eval/tasks/_task_utils/mcq_extract.py``), quirks
included, so the same outputs give the same figure without importing lmms-eval:

- Video-MME (``videomme``): ``extract_mcq_answer`` over A-D (case-sensitive: "b" reads nothing,
  "A man is walking. C" reads A); accuracy over every question.
- MLVU dev (``mlvu_dev``): the same extraction; M-Avg = the mean of the accuracies of its 7 fixed
  task types (plotQA, needle, ego, count, order, anomaly_reco, topic_reasoning), a type with no
  question counting 0.
- MVBench (``mvbench_<task>``): ``mcq_acc`` (the first standalone a-e letter of the lower-cased,
  punctuation-stripped output, else the text itself, against the answer letter); each task's
  accuracy leaves the outputs that are exactly "" out of its denominator. lmms-eval reports
  the 20 tasks separately; the leaderboard figure is their mean (here: over the tasks present).
- NExT-QA (``nextqa_mc_test``): MMMU's ``parse_multi_choice_response`` over A-E ("(B)", then
  "B ", then "B.", then the option text in outputs of more than 5 words; among several the last
  in the text), and where it reads nothing a letter drawn by Python's ``random.choice``.
- EgoSchema (``egoschema_subset``): its own variant of that parser (every form at once, the
  candidate whose last occurrence comes first; the option text as "A. ..."), the same random draw.

The random draws come from ``random.Random(seed)`` (seed 0: lmms-eval's default ``--seed``), one
per unreadable output in dataset order: what lmms-eval draws on one process when nothing else
has drawn from Python's generator since it seeded it. Every figure is a fraction in [0, 1]
(lmms-eval prints Video-MME, MLVU and MVBench as percentages).
"""
from __future__ import annotations

import random
import re
from collections import defaultdict
from typing import Any, Callable, Sequence

from vlm_prune.eval.datasets import MLVU_TASK_TYPES

LETTERS = "ABCDE"
SEED = 0
NAMES = {
    "videomme": "lmms-eval accuracy",
    "mlvu": "lmms-eval M-Avg (7 task types)",
    "mvbench": "lmms-eval mean over tasks",
    "nextqa": "lmms-eval accuracy",
    "egoschema": "lmms-eval accuracy",
}

# ------------------------------------------------------------------ Video-MME, MLVU: mcq_extract
_PHRASES = (
    "the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
    "best answer is", "the correct option is", "correct option is", "the best option is", "best option is",
    "the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select",
    "i pick", "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选", "答えは",
)
# (rank, how the letter is written); a higher rank wins, then the later position
_FORMS = ((6, "({})"), (5, "{}."), (4, "{}:"), (3, "{})"), (2, "{} "))
_PHRASE_RANK, _START_RANK, _END_RANK = 7, 10, 9


def mcq_extract(response: str, choices: str = "ABCD") -> str:
    """The letter lmms-eval's ``extract_mcq_answer`` reads from ``response``, or ""."""
    if not response or not response.strip():
        return ""
    text = response.strip()
    for char in ",.!?;:'\"":
        text = text.strip(char)
    text = f" {text} "
    found: list[tuple[int, int, str]] = []  # (rank, position, letter)
    for rank, form in _FORMS:
        found += [(rank, text.rfind(form.format(c)), c) for c in choices if form.format(c) in text]
    lower = text.lower()
    for phrase in _PHRASES:
        at = lower.find(phrase)
        if at != -1:
            found += [(_PHRASE_RANK, text.find(c, at + len(phrase)), c) for c in choices
                      if text.find(c, at + len(phrase)) != -1]
    bare = text.strip()
    found += [(_START_RANK, 0, c) for c in choices if bare.startswith(c) and (len(bare) == 1 or not bare[1].isalpha())]
    found += [(_END_RANK, len(text) - 1, c) for c in choices
              if bare.endswith(c) and (len(bare) == 1 or not bare[-2].isalpha())]
    if not found:
        found = [(0, text.rfind(c), c) for c in choices if c in text]
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else ""


# ----------------------------------------------------------------------------- MVBench: mcq_acc
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")
_DIGIT_COMMA = re.compile(r"(\d)(\,)(\d)")
_PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")
_OPTION_LINE = re.compile(r"^([A-E])\.\s*(.+)$", re.IGNORECASE)
_LONE_LETTER = re.compile(r"\b([A-E])\b", re.IGNORECASE)


def _drop_punctuation(text: str) -> str:
    out = text
    for p in _PUNCT:  # removed where spaced or where digits carry commas, else made a space
        spaced = p + " " in text or " " + p in text or _DIGIT_COMMA.search(text) is not None
        out = out.replace(p, "" if spaced else " ")
    return _PERIOD.sub("", out, count=32)  # lmms-eval passes re.UNICODE (32) where the count goes


def mvbench_reading(text: str) -> str:
    """What lmms-eval's MVBench ``mcq_acc`` compares: an upper-case letter A-E, else the
    normalised text."""
    line = _OPTION_LINE.match(text.strip())
    if line:
        return line.group(1).upper()
    plain = _drop_punctuation(text.replace("\n", " ").replace("\t", " ").strip())
    plain = plain.strip("'").strip('"').strip(")").strip("(").strip().lower()
    letter = _LONE_LETTER.search(plain)
    return letter.group(1).upper() if letter else plain


# ------------------------------------------------------------ NExT-QA and EgoSchema: MMMU parsers
def _trimmed(response: str) -> str:
    for char in ",.!?;:'":
        response = response.strip(char)
    return f" {response} "


def _candidates(response: str, options: Sequence[str], written: Callable[[str], list[str]]
                ) -> tuple[str, dict[str, str], list[str], bool]:
    """MMMU's parser's first steps: (padded text, letter -> option, candidates, found by option
    text): the letters ``written`` finds, else (outputs of more than 5 words) the options whose
    text the output holds."""
    text = _trimmed(response)
    answers = {c: str(o).strip() for c, o in zip(LETTERS, options)}
    found = written(text)
    if found or len(text.split()) <= 5:
        return text, answers, found, False
    found = [c for c in LETTERS if answers[c].lower() in text.lower()]
    return text, answers, found, bool(found)


def _nextqa_written(text: str) -> list[str]:
    """"(B)" forms, else "B " forms, else "B." forms."""
    return ([c for c in LETTERS if f"({c})" in text] or [c for c in LETTERS if f"{c} " in text]
            or [c for c in LETTERS if f"{c}." in text])


def nextqa_parse(response: str, options: Sequence[str], rng: random.Random) -> tuple[str, bool]:
    """(letter, drawn at random) as lmms-eval's NExT-QA ``parse_multi_choice_response``."""
    text, answers, found, by_text = _candidates(response, options, _nextqa_written)
    if not found:
        return rng.choice(list(LETTERS)), True
    if by_text:
        where = [text.lower().rfind(answers[c].lower()) for c in found]
    elif f"({found[0]})" in text:
        where = [text.rfind(f"({c})") for c in found]
    else:
        where = [text.rfind(f" {c} ") for c in found]
    return found[where.index(max(where))], False


def _egoschema_written(text: str) -> list[str]:
    """Every "(B)", then every "B ", then every "B." form present."""
    return [f for form in ("({})", "{} ", "{}.") for f in (form.format(c) for c in LETTERS) if f in text]


def egoschema_parse(response: str, raw_options: Sequence[str], rng: random.Random) -> tuple[str, bool]:
    """(letter, drawn at random) as lmms-eval's EgoSchema ``parse_multi_choice_response``
    (``raw_options``: the options as its copy writes them, "A. ...")."""
    text, answers, found, by_text = _candidates(response, raw_options, _egoschema_written)
    if not found:
        return rng.choice(list(LETTERS)), True
    where = [text.lower().rfind(answers[f].lower()) if by_text else text.rfind(f) for f in found]
    first = found[where.index(min(where))]
    return first.replace("(", "").replace(")", "").replace(".", "").strip(), False


# ------------------------------------------------------------------------------------ the run
def read(dataset: str, output: str, answer: str, options: Sequence[str], raw_options: Sequence[str] | None,
         rng: random.Random) -> dict[str, Any]:
    """lmms-eval's reading of one ``output``: ``leaderboard_pred`` (the letter it scores with,
    None when it reads none), ``leaderboard_correct`` (None where the question is left out of
    the denominator: MVBench's "" outputs) and ``leaderboard_random`` (a drawn letter)."""
    drawn = False
    if dataset in ("videomme", "mlvu"):
        pred: str | None = mcq_extract(output) or None
        correct: bool | None = pred == answer
    elif dataset == "mvbench":
        reading = mvbench_reading(output)
        pred = reading if len(reading) == 1 and reading in LETTERS else None
        correct = None if output == "" else reading == mvbench_reading(answer)
    elif dataset == "nextqa":
        pred, drawn = nextqa_parse(output, options, rng)
        correct = pred == answer
    elif dataset == "egoschema":
        raw = raw_options or [f"{c}. {o}" for c, o in zip(LETTERS, options)]
        parsed, drawn = egoschema_parse(output, raw, rng)
        pred = parsed if len(parsed) == 1 and parsed in LETTERS[: len(options)] else None
        correct = pred == answer
    else:
        raise ValueError(f"no lmms-eval rule for dataset {dataset!r}; those with one: {', '.join(NAMES)}")
    return {"leaderboard_pred": pred, "leaderboard_correct": correct, "leaderboard_random": drawn}


def annotate(dataset: str, records: list[dict[str, Any]], samples: dict[str, Any], seed: int = SEED) -> None:
    """Add lmms-eval's reading (:func:`read`) to every answered record, in the given (dataset)
    order, drawing random letters from ``random.Random(seed)``. ``samples``: id -> Sample."""
    if dataset not in NAMES:
        return
    rng = random.Random(seed)
    for rec in records:
        if rec.get("status", "ok") == "ok" and "output" in rec:
            s = samples[rec["id"]]
            rec.update(read(dataset, rec["output"], s.answer, s.options, s.raw_options, rng))


def _rate(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def figure(dataset: str, records: list[dict[str, Any]]) -> float | None:
    """The leaderboard figure over annotated answered ``records`` (None: nothing to score)."""
    rows = [r for r in records if "leaderboard_correct" in r]
    if dataset not in NAMES or not rows:
        return None
    by_task: dict[str, list[bool]] = defaultdict(list)
    if dataset == "mlvu":
        for r in rows:
            by_task[r.get("categories", {}).get("task", "")].append(bool(r["leaderboard_correct"]))
        unknown = sorted(set(by_task) - set(MLVU_TASK_TYPES))
        if unknown:
            raise ValueError(f"mlvu: task type(s) {unknown} are not among lmms-eval's {MLVU_TASK_TYPES}")
        return sum(_rate(by_task[t]) for t in MLVU_TASK_TYPES) / len(MLVU_TASK_TYPES)
    if dataset == "mvbench":
        for r in rows:
            flags = by_task[r.get("categories", {}).get("task", "")]
            if r["leaderboard_correct"] is not None:
                flags.append(bool(r["leaderboard_correct"]))
        return sum(_rate(f) for f in by_task.values()) / len(by_task)
    return _rate([bool(r["leaderboard_correct"]) for r in rows])


def read_differently(records: list[dict[str, Any]]) -> int:
    """Answered records whose letter under lmms-eval's rules differs from the harness's reading
    (unread on both sides counts as the same; a random draw against no reading differs)."""
    return sum(1 for r in records if "leaderboard_pred" in r and r["leaderboard_pred"] != r.get("pred"))
