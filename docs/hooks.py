"""MkDocs hook: pages generated from vlm_prune's method registry when the site builds.

A page holding one of the markers below gets, in its place, what the registry says now: the method x
model-family table (``vlm-prune methods --table``, the rule ``wrap()`` applies) and the method
catalogue (``vlm-prune methods``: stage, what it does, paper, knobs, families, budget note).
"""
from __future__ import annotations

from typing import Any, Callable


def methods_table() -> str:
    """The method x family table of ``vlm-prune methods --table``."""
    from vlm_prune.cli_methods import works_with_table

    return works_with_table()


def methods_catalogue() -> str:
    """One section per registered method, from ``vlm_prune.describe_methods()``."""
    from vlm_prune.cli_methods import summary
    from vlm_prune.registry import describe_methods

    rows = ["| method | stage | what it does |", "|---|---|---|"]
    sections = []
    for m in describe_methods():
        name = m["name"]
        rows.append(f"| [`{name}`](#{name}) | {m['stage']} | {summary(name)} |")
        knobs = ", ".join(f"`{k}={v!r}`" for k, v in m["knobs"].items()) or "(none)"
        families = ", ".join(f"`{f}` ({m['family_notes'][f]})" if f in m["family_notes"] else f"`{f}`"
                             for f in m["supported"])
        lines = [f"### `{name}`", "", summary(name) + ".", "",
                 f"- **stage**: {m['stage']}", f"- **paper**: {m['paper']}", f"- **knobs**: {knobs}",
                 f"- **model families**: {families}"]
        if m.get("budget_note"):
            lines.append(f"- **budget**: {m['budget_note']}")
        sections.append("\n".join(lines))
    return "\n".join(rows) + "\n\n" + "\n\n".join(sections) + "\n"


#: marker in a page -> what replaces it
MARKERS: dict[str, Callable[[], str]] = {
    "<!-- vlm-prune:methods-table -->": methods_table,
    "<!-- vlm-prune:methods-catalogue -->": methods_catalogue,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace every marker in a page by its generated Markdown."""
    for marker, render in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
