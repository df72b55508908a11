"""``vlm-prune methods``: the registered methods, one line each: stage, what it does, paper.

The one-line descriptions here are also what the demo shows beside each method.
"""
from __future__ import annotations

import argparse

#: what each built-in method does, in one line (a method class may set ``summary`` instead)
ONE_LINE = {
    "adaptinfer": "drops visual tokens at several LLM layers, scored by the text's attention to them",
    "asvit": "drops image patches inside the ViT, by class-token attention weighted per head",
    "cdpruner": "keeps a diverse, question-relevant subset of each image's tokens (conditional DPP)",
    "divprune": "keeps the most mutually different tokens of each image (max-min diversity)",
    "fastvid": "cuts the video into scenes, keeps each frame's most attended tokens and merges the rest into density peaks",
    "dycoke": "drops the tokens of every second frame (and every fourth) that repeat the frame before",
    "fastv": "drops the visual tokens that get the least attention at one early LLM layer",
    "holitom": "averages tokens that stay still over windows of frames, clusters them, keeps each frame's most attended others",
    "keyscore": "picks video frames by caption similarity, temporal spread and novelty (STACFP)",
    "pact": "drops unimportant visual tokens and merges similar ones inside the LLM (clustering)",
    "pool": "averages each image's token grid down to a coarser grid (baseline)",
    "quota": "scores each frame's relevance to the question with the model and shares tokens by score",
    "random": "keeps a seeded random subset of each image's tokens (baseline)",
    "tome": "merges similar patches inside the ViT, a few per block (token merging)",
    "uniform": "keeps evenly spaced frames at full resolution (baseline)",
    "vidcom2": "keeps each frame's most distinct tokens, more of them in frames unlike the rest of the video",
    "visionzip": "keeps the tokens the vision tower attends to most and merges the rest by similarity",
}


def summary(name: str) -> str:
    """One line saying what the method ``name`` does."""
    from vlm_prune.registry import method_class

    cls = method_class(name)
    return getattr(cls, "summary", None) or ONE_LINE.get(cls.name) or (cls.__doc__ or "").strip().split("\n")[0]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", description=(
        "List the registered pruning methods: name, stage (frames / vision / vit / llm), what each does in "
        "one line, its paper, its knobs and the model families wrap() accepts it on (the families are "
        "vlm_prune.adapters.FAMILY_STAGES). Use the names with vlm_prune.wrap(model, NAME, keep=...) or --methods."))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vlm_prune.registry import describe_methods

    for m in describe_methods():
        print(f"{m['name']:11s} {m['stage']:7s} {summary(m['name'])}")
        print(f"{'':19s} {m['paper']}")
        knobs = ", ".join(f"{k}={v!r}" for k, v in m["knobs"].items())
        models = ", ".join(f"{f} ({m['family_notes'][f]})" if f in m["family_notes"] else f for f in m["supported"])
        print(f"{'':19s} knobs: {knobs or '(none)'}")
        print(f"{'':19s} models: {models}")
        if m.get("budget_note"):
            print(f"{'':19s} budget: {m['budget_note']}")
    return 0
