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
    "holitom": ("averages tokens that stay still over windows of frames, clusters them, keeps each frame's most attended "
                "others; then merges half into their most similar kept token inside the LLM (inner=False: outside only)"),
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


def works_with_table() -> str:
    """Markdown: every registered method x every adapter family, from the one rule wrap() applies
    (``Method.refusal`` on ``FAMILY_STAGES``): "yes" where wrap() accepts the method ("yes*": with a
    limit inside the family, listed below the table), else a footnote whose text is wrap()'s message
    (method and family written as METHOD and FAMILY, the stages a family offers as "...")."""
    import re

    from vlm_prune.adapters import FAMILY_STAGES
    from vlm_prune.registry import available_methods, method_class

    families = list(FAMILY_STAGES)
    reasons: dict[str, str] = {}
    limits: list[str] = []
    rows = ["| method | " + " | ".join(f"`{f}`" for f in families) + " |", "|---|" + "---|" * len(families)]
    for name in available_methods():
        cls = method_class(name)
        cells = []
        for family in families:
            why = cls.refusal(family, FAMILY_STAGES[family])
            if why is None:
                note = cls.note_on(family)
                cells.append("yes*" if note else "yes")
                if note:
                    limits.append(f"- `{name}` on `{family}`: {note}")
                continue
            template = why.replace(f"the {family} adapter", "the FAMILY adapter").replace(f"'{family}' adapter", "'FAMILY' adapter")
            template = re.sub(r"it offers: [^)]*", "it offers: ...", template.replace(f"'{name}'", "'METHOD'"))
            cells.append(reasons.setdefault(template, f"R{len(reasons) + 1}"))
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    notes = [f"- {key}: `{template}`" for template, key in reasons.items()]
    return "\n".join(rows + [""] + notes + ([""] + limits if limits else [])) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("methods", description=(
        "List the registered pruning methods: name, stage (frames / vision / vit / llm), what each does in "
        "one line, its paper, its knobs and the model families wrap() accepts it on (the families are "
        "vlm_prune.adapters.FAMILY_STAGES). Use the names with vlm_prune.wrap(model, NAME, keep=...) or --methods."))
    p.add_argument("--table", action="store_true",
                   help="print instead the method x model-family table (Markdown) of what wrap() accepts, "
                        "with wrap()'s message for every refusal (the docs' models page)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vlm_prune.registry import describe_methods

    if args.table:
        print(works_with_table(), end="")
        return 0

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
