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


def format_prompt(sample: Sample) -> str:
    """Question, lettered options and the instruction, as one user turn's text."""
    if not sample.options:
        return f"{sample.question}\n{OPEN_INSTRUCTION}"
    lines = [sample.question] + [f"{LETTERS[i]}. {o}" for i, o in enumerate(sample.options)]
    return "\n".join(lines + [MC_INSTRUCTION])


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
