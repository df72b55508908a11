"""Answer extraction and scoring."""
from __future__ import annotations

import pytest

from vlm_prune.eval.answers import MC_INSTRUCTION, extract_choice, format_prompt, score
from vlm_prune.eval.datasets import Sample

OPTIONS = ["red", "green", "dark red", "blue"]


@pytest.mark.parametrize("text, letter", [
    ("B", "B"), ("(B)", "B"), ("B.", "B"), ("B) green", "B"), ("b", "B"), ("**C**", "C"), ("[D]", "D"),
    ("The answer is B", "B"), ("Answer: (C)", "C"), ("Answer:B", "B"), ("The correct answer is A. red", "A"),
    ("option C is right", "C"), ("I think it is D.", "D"),
    ("green", "B"), ("The colour is green.", "B"), ("It is dark red", "C"), ("red", "A"),
    ("A", "A"), ("A man in a green coat", "B"),
    ("red and green", None), ("none of these", None), ("E", None), ("", None),
])
def test_extract_choice(text, letter):
    assert extract_choice(text, OPTIONS) == letter


def test_score_and_prompt():
    mc = Sample("1", ["v.mp4"], "video", "What colour?", ["red", "green"], "B")
    assert format_prompt(mc) == f"What colour?\nA. red\nB. green\n{MC_INSTRUCTION}"
    assert score(mc, "The answer is B.") == ("B", True)
    assert score(mc, "red") == ("A", False)
    assert score(mc, "no idea") == (None, False)
    open_q = Sample("2", ["i.png"], "image", "What colour?", [], "Dark red")
    assert score(open_q, "dark red.") == ("dark red", True)
    assert score(open_q, "the Dark Red") == ("dark red", True)
    assert score(open_q, "red") == ("red", False)
