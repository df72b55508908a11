"""Prompts and answer extraction for multiple-choice and open-ended questions.

``extract_choice`` reads the option a model picked from free text, in this order:
an explicit phrase ("The answer is B", "Answer: (B)", "option B"), a leading letter
("B", "(B)", "B.", "B) text"), the text of exactly one option, and finally a single
standalone capital letter among the valid ones. Anything else is unanswered (None).
"""
from __future__ import annotations

import re
import string

from vlm_prune.eval.datasets import LETTERS, Sample

MC_INSTRUCTION = "Answer with the option's letter from the given choices directly."
OPEN_INSTRUCTION = "Answer the question using a single word or phrase."
VIDEOMME_INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video and the subtitles. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
SUBTITLES_HEADER = "This video's subtitles are listed below: \n"


def _lettered(sample: Sample, style: str) -> list[str]:
    if style == "paren":
        return [f"({LETTERS[i]}) {o}" for i, o in enumerate(sample.options)]
    return [f"{LETTERS[i]}. {o}" for i, o in enumerate(sample.options)]


def _videomme(sample: Sample, subtitles: str | None) -> str:
    body = "\n".join([VIDEOMME_INSTRUCTION, sample.question, *_lettered(sample, "dot")])
    if subtitles is None:
        return body + "\n\n" + MC_INSTRUCTION
    return SUBTITLES_HEADER + subtitles + "\n" + body + "\nThe best answer is:"


def _mlvu(sample: Sample, subtitles: str | None) -> str:
    if sample.prompt_text is not None:  # lmms-eval's copy: the question with its options, verbatim
        return sample.prompt_text + "\nOnly give the best option.\nBest option: ("
    lines = [f"Question: {sample.question}", "Options:", *_lettered(sample, "paren")]
    return "\n".join(lines) + "\nOnly give the best option.\nBest option: ("


def _mvbench(sample: Sample, subtitles: str | None) -> str:
    return f"Question:{sample.question}\nOption:\n" + "".join(o + "\n" for o in _lettered(sample, "paren")) + \
        "Only give the best option.\n"


def _nextqa(sample: Sample, subtitles: str | None) -> str:
    return "\n".join([sample.question.strip(), *(f"{LETTERS[i]}. {o.strip()}" for i, o in enumerate(sample.options))])


def _egoschema(sample: Sample, subtitles: str | None) -> str:
    options = sample.raw_options if sample.raw_options is not None else _lettered(sample, "dot")
    return "\n".join([sample.question, *options, MC_INSTRUCTION])


def _generic(sample: Sample, subtitles: str | None) -> str:
    if not sample.options:
        return f"{sample.question}\n{OPEN_INSTRUCTION}"
    return "\n".join([sample.question, *_lettered(sample, "dot"), MC_INSTRUCTION])


# Each benchmark's prompt as lmms-eval 0.7's task of that name builds it ("default" kwargs).
PROMPTS = {"videomme": _videomme, "mlvu": _mlvu, "mvbench": _mvbench, "nextqa": _nextqa,
           "egoschema": _egoschema}
PROMPT_VERSION = "lmms-eval-0.7.3"  # 0.7.3: Video-MME subtitles as lmms-eval 0.7.3 writes them


def prompt_style(dataset: str) -> str:
    """The name of the prompt a dataset gets (stored with a run, so a change is not resumed over)."""
    return f"{dataset}:{PROMPT_VERSION}" if dataset in PROMPTS else "generic"


def format_prompt(sample: Sample, subtitles: str | None = None) -> str:
    """The user turn's text for ``sample``: its benchmark's prompt (lmms-eval's task prompts:
    Video-MME, MLVU, MVBench, NExT-QA, EgoSchema), else the question, lettered options and
    "Answer with the option's letter ..." (or a one-phrase instruction without options).
    subtitles: Video-MME's "w/ subs" setting; the subtitle text shown with the frames, verbatim
    ("" when no cue is on screen; the runner passes "No subtitles available" without an .srt)."""
    return PROMPTS.get(sample.benchmark, _generic)(sample, subtitles)


def _letters(n: int) -> str:
    return LETTERS[:n]


def extract_choice(text: str, options: list[str]) -> str | None:
    """The letter of the option chosen in ``text``, or None when no single choice is readable."""
    valid = _letters(len(options))
    if not valid:
        return None
    s = text.strip()
    cls = f"[{valid}]"
    explicit = re.search(rf"(?i:answer\s*(?:is|:)?|option|choice)\s*[:\-]?\s*\(?({cls})(?![A-Za-z'])", s)
    if explicit:
        return explicit.group(1)
    # a leading letter, but not the article in "A man ..."
    lead = re.match(rf"^[\s\"'*\[(]*({cls})(?:[.):\]\"'*,]|\s*$|\s+(?![a-z]))", s)
    if lead:
        return lead.group(1)
    bare = s.strip(" .()[]*\"'")
    if len(bare) == 1 and bare.upper() in valid:  # "b"
        return bare.upper()
    lowered = _norm(s)
    norms = [_norm(o) for o in options]
    hits = [i for i, o in enumerate(norms) if o and o in lowered]
    # an option inside a longer matched option ("red" in "dark red") is not a separate hit
    hits = [i for i in hits if not any(j != i and norms[i] in norms[j] for j in hits)]
    if len(hits) == 1:
        return valid[hits[0]]
    loose = set(re.findall(rf"(?<![A-Za-z])({cls})(?![A-Za-z])(?!\s+[a-z])", s))
    if len(loose) == 1:
        return loose.pop()
    return None


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def _norm(text: str) -> str:
    """Lower case, no punctuation, no articles (unless nothing else is left), single spaces."""
    plain = " ".join(text.lower().translate(_PUNCT).split())
    return " ".join(_ARTICLES.sub(" ", plain).split()) or plain


def score(sample: Sample, output: str) -> tuple[str | None, bool]:
    """(extracted prediction, correct) for a model's raw ``output`` on ``sample``.

    Multiple choice: the extracted letter against the answer letter. Open-ended: the normalised
    output (lower case, no punctuation or articles) equals the normalised reference.
    """
    if sample.options:
        pred = extract_choice(output, sample.options)
        return pred, pred == sample.answer
    pred = _norm(output)
    return pred, pred == _norm(sample.answer)
