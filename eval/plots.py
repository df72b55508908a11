"""The sweep table (Markdown + JSON) and plot: accuracy and speed-up against the kept fraction.

Speed-ups are relative to the unpruned run ("none") when the sweep has one, otherwise to the
same method's keep=1.0 run: measured time to first token (``ttft_speedup``) and the ideal
from prefill FLOPs (``flops_speedup``). The kept fraction on the x axis is the measured one
(visual tokens out / in), so keep and budget settings share one axis.
"""
from __future__ import annotations

import json
import os
from typing import Any

COLUMNS = [
    ("name", "setting", "{}"),
    ("n", "n", "{}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("kept_fraction", "kept", "{:.3f}"),
    ("visual_tokens_out", "visual tokens", "{:.0f}"),
    ("ttft_s", "TTFT s", "{:.4f}"),
    ("ttft_speedup", "TTFT speed-up", "{:.2f}x"),
    ("flops_speedup", "FLOPs speed-up", "{:.2f}x"),
    ("generate_s", "generate s", "{:.4f}"),
    ("peak_memory_bytes", "peak MiB", "{:.0f}"),
]


def _baseline(row: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    for r in rows:
        if r["method"] == "none":
            return r
    for r in rows:
        if r["method"] == row["method"] and r.get("keep") == 1.0:
            return r
    return None


def add_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ttft_speedup and flops_speedup against its baseline (None without one)."""
    out = []
    for row in rows:
        base = _baseline(row, rows)
        ttft = flops = None
        if base is not None and row.get("ttft_s") and base.get("ttft_s"):
            ttft = base["ttft_s"] / row["ttft_s"]
        if base is not None and row.get("prefill_flops") and base.get("prefill_flops"):
            flops = base["prefill_flops"] / row["prefill_flops"]
        out.append({**row, "ttft_speedup": ttft, "flops_speedup": flops})
    return out


def markdown_table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            if key == "peak_memory_bytes" and value is not None:
                value = value / 2**20
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    cats = [r for r in rows if r.get("by_category")]
    if cats:
        lines += ["", "## Accuracy by category", ""]
        for row in cats:
            parts = [f"{field}={value}: {s['accuracy']:.3f} (n={s['n']})"
                     for field, values in row["by_category"].items() for value, s in values.items()]
            lines.append(f"- {row['name']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Accuracy (left) and speed-up (right) against the kept fraction, one line per method."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    acc_ax, speed_ax = fig.subplots(1, 2)
    methods = sorted({r["method"] for r in rows if r["method"] != "none"})
    for method in methods:
        pts = sorted((r for r in rows if r["method"] == method and r.get("kept_fraction") is not None),
                     key=lambda r: r["kept_fraction"])
        x = [r["kept_fraction"] for r in pts]
        line = acc_ax.plot(x, [r["accuracy"] for r in pts], marker="o", label=method)[0]
        colour = line.get_color()
        speed_ax.plot(x, [r["ttft_speedup"] or float("nan") for r in pts], marker="o", color=colour,
                      label=f"{method} (TTFT)")
        speed_ax.plot(x, [r["flops_speedup"] or float("nan") for r in pts], ls="--", color=colour,
                      label=f"{method} (FLOPs, ideal)")
    for r in rows:
        if r["method"] == "none":
            acc_ax.axhline(r["accuracy"], color="black", ls=":", label="unpruned")
            speed_ax.axhline(1.0, color="black", ls=":", label="unpruned")
    acc_ax.set(xlabel="kept fraction of visual tokens", ylabel="accuracy", title="accuracy")
    speed_ax.set(xlabel="kept fraction of visual tokens", ylabel="speed-up (x)", title="speed-up")
    for ax in (acc_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=120)


def write_sweep(rows: list[dict[str, Any]], out_dir: str, title: str) -> dict[str, str]:
    """Write summary.json, summary.md and sweep.png into ``out_dir``; returns their paths."""
    rows = add_speedups(rows)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "summary.json"), "markdown": os.path.join(out_dir, "summary.md"),
             "plot": os.path.join(out_dir, "sweep.png")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(markdown_table(rows, title))
    plot(rows, paths["plot"], title)
    return paths
