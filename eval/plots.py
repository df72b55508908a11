"""The sweep table (Markdown + JSON), the sweep figure and the bench figure.

Speed-ups are relative to the unpruned run ("none") when the sweep has one, otherwise to the
same method's keep=1.0 run: measured time to first token (``ttft_speedup``) and the ideal
from prefill FLOPs (``flops_speedup``). The kept fraction on the x axis is the measured one
(visual tokens out / in), so keep and budget settings share one axis.

Figures use one colour-blind-safe colour per method (the same in every figure) and one marker per
method family, accuracy on the full 0-1 axis with the unpruned run drawn, the legend outside the
axes, and are written as a 200-dpi PNG with SVG and PDF copies beside it.
"""
from __future__ import annotations

import json
import os
from typing import Any

COLUMNS = [
    ("name", "setting", "{}"),
    ("official", "official", "{:.3f}"),
    ("lenient", "lenient", "{:.3f}"),
    ("read_differently", "read differently", "{}"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("evaluated", "evaluated", "{}"),
    ("skipped", "skipped", "{}"),
    ("failed", "failed", "{}"),
    ("kept_fraction", "kept", "{:.3f}"),
    ("visual_tokens_out", "visual tokens", "{:.0f}"),
    ("ttft_s", "TTFT s", "{:.4f}"),
    ("ttft_speedup", "TTFT speed-up", "{:.2f}x"),
    ("flops_speedup", "FLOPs speed-up", "{:.2f}x"),
    ("generate_s", "generate s", "{:.4f}"),
    ("decode_s", "decode s", "{:.4f}"),
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
    """The sweep as Markdown: the official score first (its definition under the table), the
    accuracy over the evaluated questions, and what was skipped or failed, and why."""
    from vlm_prune.eval.metrics import counts_line

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
    names = sorted({r["official_name"] for r in rows if r.get("official_name")})
    if names:
        lines += ["", f"official: {', '.join(names)} over the evaluated questions; accuracy: correct / evaluated."]
    lenient = sorted({r["lenient_name"] for r in rows if r.get("read_differently") is not None})
    if lenient:
        lines += ["", f"lenient: {', '.join(lenient)} (the harness's own answer reading); read differently: "
                  "answered questions whose letter the two readings disagree on."]
    lost = [r for r in rows if r.get("skipped") or r.get("failed")]
    if lost:
        lines += ["", "## Not evaluated (left out of every score)", ""]
        lines += [f"- {r['name']}: {counts_line(r)}" for r in lost]
    cut = [r for r in rows if r.get("truncated")]
    if cut:
        lines += ["", "## Answered on truncated videos (scored on the frames that decode)", ""]
        lines += [f"- {r['name']}: {counts_line(r)}" for r in cut]
    cats = [r for r in rows if r.get("by_category")]
    if cats:
        lines += ["", "## Accuracy by category", ""]
        for row in cats:
            parts = [f"{field}={value}: {s['accuracy']:.3f} (n={s['n']})"
                     for field, values in row["by_category"].items() for value, s in values.items()]
            lines.append(f"- {row['name']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


# ---- figure style: one colour per method (colour-blind safe), one marker per family -------------
#: Paul Tol's "muted" and Okabe-Ito colours; the model-free baselines in black and greys
METHOD_COLOURS = {
    "saturation": "#000000", "random": "#777777", "pool": "#BBBBBB",
    "visionzip": "#0072B2", "divprune": "#117733", "cdpruner": "#CC6677", "asvit": "#AA4499", "tome": "#DDCC77",
    "fastv": "#882255", "pact": "#E69F00", "adaptinfer": "#44AA99",
    "fastervlm": "#4477AA", "vispruner": "#EE6677", "dart": "#228833", "pdrop": "#AA3377",
    "hired": "#CCBB44", "prumerge": "#66CCEE",
    "sparsevlm": "#997700",
    "mustdrop": "#7F3C8D",
    "uniform": "#88CCEE", "keyscore": "#332288", "quota": "#D55E00",
    "vidcom2": "#661100", "fastvid": "#6699CC", "holitom": "#EE8866", "dycoke": "#BBCC33",
    "framefusion": "#994455", "prunevid": "#5D3A9B",
}
SPARE_COLOURS = ("#999933", "#56B4E9", "#009E73", "#F0E442", "#CC79A7")
FAMILY_MARKERS = {"baseline": "X", "vision": "o", "vit": "^", "llm": "s", "frames": "D"}
FAMILY_NAMES = {"baseline": "model-free baseline", "vision": "vision stage", "vit": "inside the ViT",
                "llm": "inside the LLM", "frames": "frames stage"}
BASELINES = ("saturation", "random", "pool")


def method_family(method: str) -> str:
    """"baseline", or the registered stage of the (first) method of ``method`` ("a+b" composes)."""
    first = method.split("+")[0]
    if first in BASELINES:
        return "baseline"
    try:
        from vlm_prune.registry import method_class

        return method_class(first).stage
    except (KeyError, ValueError):
        return "vision"


def method_style(method: str, order: list[str]) -> dict[str, Any]:
    """Colour by method (a composition "a+b" takes a's colour, dashed), marker by family."""
    first = method.split("+")[0]
    colour = METHOD_COLOURS.get(first)
    if colour is None:
        unknown = [m for m in order if m.split("+")[0] not in METHOD_COLOURS]
        colour = SPARE_COLOURS[unknown.index(method) % len(SPARE_COLOURS)] if method in unknown else "#777777"
    return {"color": colour, "marker": FAMILY_MARKERS[method_family(method)], "ls": "--" if "+" in method else "-",
            "lw": 2.2 if method == "saturation" else 1.4, "ms": 5.5, "mec": "white" if first != "pool" else "#555555",
            "mew": 0.6}


def save_figure(fig: Any, path: str) -> list[str]:
    """``path`` as a 200-dpi PNG with SVG and PDF copies beside it; returns the three paths."""
    stem = os.path.splitext(path)[0]
    paths = [f"{stem}.png", f"{stem}.svg", f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=200, bbox_inches="tight")
    return paths


def _fraction_axis(ax: Any, label: str) -> None:
    """Log axis of fractions of visual tokens from 1.5% to 100%, ticks in percent."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.set_xlim(0.015, 1.15)
    ticks = [0.02, 0.05, 0.11, 0.25, 0.5, 1.0]
    ax.set_xticks(ticks, [f"{100 * t:g}%" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


def _accuracy_axis(ax: Any, ylabel: str = "accuracy") -> None:
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.25, lw=0.6)


def _family_legend(fig: Any, handles: list[Any], labels: list[str], families: list[str]) -> None:
    from matplotlib.lines import Line2D

    marks = [Line2D([], [], color="#444444", marker=FAMILY_MARKERS[f], ls="none", label=FAMILY_NAMES[f]) for f in families]
    fig.legend(handles + marks, labels + [m.get_label() for m in marks], loc="center left",
               bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8)


def bench_caption(pooled: list[dict[str, Any]]) -> str:
    """What ``vlm-prune bench``'s figure shows, per model: the models (the shipped synthetic toys
    when their names say so), seeds x samples (n per point) and what the error bars are."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in pooled):
        base = next((r for r in pooled if r["model"] == model and r["method"] == "none"), None)
        if base is None:
            continue
        seeds = len(base.get("seeds") or [0])
        what = "the shipped synthetic toy model (tiny, trained on procedural shapes; not a real checkpoint)" \
            if str(model).startswith("synthetic-") else "model"
        bars = "bars: min-max over the seeds" if seeds > 1 else "bars: 95% interval over the samples"
        lines.append(f"{model}: {what}; {seeds} seed(s) x {base['n'] // seeds} test samples "
                     f"(n = {base['n']} per point); points: accuracy, mean over seeds; {bars}")
    return "\n".join(lines)


def bench_figure(pooled: list[dict[str, Any]], path: str) -> list[str]:
    """:func:`bench_plot` written as PNG, SVG and PDF (:func:`save_figure`)."""
    return save_figure(bench_plot(pooled), path)


def bench_plot(pooled: list[dict[str, Any]]) -> Any:
    """``vlm-prune bench``'s figure: accuracy (mean over model seeds; bars = seed range, or the 95%
    interval with one seed) against the fraction of visual tokens averaged over the LLM's layers
    (left) and the ideal prefill FLOPs ratio (right), one row per model. The unpruned accuracy
    and the chance level are drawn as reference lines; :func:`bench_caption` is its title."""
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r["model"] for r in pooled))
    order = list(dict.fromkeys(r["method"] for r in pooled if r["method"] != "none"))
    fig = Figure(figsize=(10.5, 3.9 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 2, squeeze=False)
    handles: dict[str, Any] = {}
    for row, model in zip(axes, models):
        mine = [r for r in pooled if r["model"] == model]
        base = next((r for r in mine if r["method"] == "none"), None)
        for ax, key, label in ((row[0], "layer_avg_fraction", "visual tokens, averaged over LLM layers (log)"),
                               (row[1], "flops_ratio", "prefill FLOPs ratio (ideal)")):
            for method in order:
                pts = sorted((r for r in mine if r["method"] == method and r.get(key) is not None), key=lambda r: r[key])
                if not pts:
                    continue
                if base is not None:
                    pts = pts + [base]
                ys = [r["accuracy"] for r in pts]
                lo = [r["accuracy"] - r.get("accuracy_min", r["accuracy"]) for r in pts]
                hi = [r.get("accuracy_max", r["accuracy"]) - r["accuracy"] for r in pts]
                if all(len(r.get("seeds", [0])) == 1 for r in pts):
                    lo = hi = [r.get("accuracy_ci") or 0.0 for r in pts]
                line = ax.errorbar([r[key] for r in pts], ys, yerr=[lo, hi], capsize=2, elinewidth=0.8,
                                   label=method, **method_style(method, order))
                handles.setdefault(method, line)
            if base is not None:
                ref = ax.axhline(base["accuracy"], color="black", ls=":", lw=1.0, label="unpruned")
                handles.setdefault("unpruned", ref)
                if base.get("chance") is not None:
                    ch = ax.axhline(base["chance"], color="#999999", ls="-.", lw=0.9, label="chance")
                    handles.setdefault("chance", ch)
            if key == "layer_avg_fraction":
                _fraction_axis(ax, label)
                for t in (0.25, 0.11, 0.05):
                    ax.axvline(t, color="#DDDDDD", lw=0.8, zorder=0)
            else:
                ax.set_xlim(0, 1.05)
                ax.set_xlabel(label)
            _accuracy_axis(ax)
            ax.set_title(f"{model}: accuracy vs {'tokens' if key == 'layer_avg_fraction' else 'FLOPs'}", fontsize=10)
    families = sorted({method_family(m) for m in order}, key=list(FAMILY_MARKERS).index)
    _family_legend(fig, list(handles.values()), list(handles), families)
    fig.suptitle(bench_caption(pooled), fontsize=8)
    return fig


def short_name(model: str) -> str:
    """A model's short name for titles: the last part of a hub id or folder
    ("llava-hf/llava-1.5-7b-hf" -> "llava-1.5-7b-hf", "/home/me/ckpt/llava/" -> "llava")."""
    return os.path.basename(os.path.normpath(model.rstrip("/\\"))) or model


NO_SPEEDUP = ("no speed-up to show: the sweep has no unpruned run\n(setting 'none') nor keep 1.0 run to compare with;\n"
              "add none to --method to get one")


def plot(rows: list[dict[str, Any]], path: str, title: str) -> list[str]:
    """:func:`sweep_figure` written as PNG, SVG and PDF (:func:`save_figure`)."""
    return save_figure(sweep_figure(rows, title), path)


def sweep_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """The sweep figure: accuracy against the kept fraction of visual tokens and against the ideal
    prefill FLOPs ratio, and the speed-up (measured TTFT, solid; ideal from FLOPs, dashed) against
    the kept fraction; one colour per method, the unpruned run as reference. Without a reference
    run (no "none", no keep 1.0) the speed-up panel says so instead of staying empty."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4), layout="constrained")
    acc_ax, flops_ax, speed_ax = fig.subplots(1, 3)
    order = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "none"))
    handles: dict[str, Any] = {}
    for method in order:
        style = method_style(method, order)
        pts = sorted((r for r in rows if r["method"] == method and r.get("kept_fraction") is not None),
                     key=lambda r: r["kept_fraction"])
        x = [r["kept_fraction"] for r in pts]
        handles[method] = acc_ax.plot(x, [r["accuracy"] for r in pts], label=method, **style)[0]
        fl = [r for r in pts if r.get("flops_ratio") is not None]
        flops_ax.plot([r["flops_ratio"] for r in fl], [r["accuracy"] for r in fl], **style)
        ttft = [(r["kept_fraction"], r["ttft_speedup"]) for r in pts if r.get("ttft_speedup")]
        ideal = [(r["kept_fraction"], r["flops_speedup"]) for r in pts if r.get("flops_speedup")]
        if ttft:
            speed_ax.plot(*zip(*ttft), **style)
        if ideal:
            speed_ax.plot(*zip(*ideal), **{**style, "ls": ":", "marker": "_", "ms": 9, "mew": 1.6, "mec": style["color"]})
    from matplotlib.lines import Line2D

    handles["measured TTFT speed-up"] = Line2D([], [], color="#444444", ls="-", marker="o")
    handles["ideal speed-up (FLOPs)"] = Line2D([], [], color="#444444", ls=":", marker="_", ms=9, mew=1.6)
    for r in rows:
        if r["method"] == "none":
            for ax in (acc_ax, flops_ax):
                handles["unpruned"] = ax.axhline(r["accuracy"], color="black", ls=":", lw=1.0, label="unpruned")
            speed_ax.axhline(1.0, color="black", ls=":", lw=1.0)
    for ax in (acc_ax, speed_ax):
        _fraction_axis(ax, "kept fraction of visual tokens (measured, log)")
    flops_ax.set_xlim(0, 1.05)
    flops_ax.set_xlabel("prefill FLOPs ratio (ideal)")
    _accuracy_axis(acc_ax)
    _accuracy_axis(flops_ax)
    speed_ax.set_ylabel("speed-up over unpruned (x)")
    speed_ax.set_ylim(bottom=0)
    speed_ax.grid(alpha=0.25, lw=0.6)
    acc_ax.set_title("accuracy vs tokens", fontsize=10)
    flops_ax.set_title("accuracy vs FLOPs", fontsize=10)
    speed_ax.set_title("speed-up", fontsize=10)
    if not any(r.get("ttft_speedup") or r.get("flops_speedup") for r in rows if r["method"] != "none"):
        speed_ax.text(0.5, 0.5, NO_SPEEDUP, transform=speed_ax.transAxes, ha="center", va="center", fontsize=8,
                      color="#444444", wrap=True)
    families = sorted({method_family(m) for m in order}, key=list(FAMILY_MARKERS).index)
    _family_legend(fig, list(handles.values()), list(handles), families)
    fig.suptitle(title, fontsize=10)
    return fig


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


def speed_plot(rows: list[dict[str, Any]], title: str) -> Any:
    """``vlm-prune bench --speed``'s figure for one model shape: per keep ratio, each method's measured
    prefill-time ratio (median, bars = min-max of the repeats) against its ideal FLOPs ratio; on the
    diagonal a method saves exactly what its FLOPs promise, above it less, and above 1 it is slower than
    the unpruned model."""
    from matplotlib.figure import Figure

    keeps = sorted({r["keep"] for r in rows if r["keep"] < 1}, reverse=True)
    order = list(dict.fromkeys(r["method"] for r in rows))
    fig = Figure(figsize=(4.6 * max(1, len(keeps)), 4.2), layout="constrained")
    axes = fig.subplots(1, max(1, len(keeps)), squeeze=False)[0]
    handles: dict[str, Any] = {}
    top = max([1.1] + [r["ratio_max"] for r in rows if r["keep"] < 1])
    for ax, keep in zip(axes, keeps):
        for r in (r for r in rows if r["keep"] == keep):
            style = {k: v for k, v in method_style(r["method"], order).items() if k not in ("ls", "lw")}
            yerr = [[r["measured_ratio"] - r["ratio_min"]], [r["ratio_max"] - r["measured_ratio"]]]
            handles.setdefault(r["method"], ax.errorbar([r["ideal_ratio"]], [r["measured_ratio"]], yerr=yerr, capsize=2,
                                                         elinewidth=0.8, ls="none", label=r["method"], **style))
        ax.plot([0, 1.05], [0, 1.05], color="#999999", lw=0.9, ls="--", zorder=0)
        ax.axhline(1.0, color="black", ls=":", lw=1.0, zorder=0)
        ax.set_xlim(0, 1.05)
        ax.set_ylim(0, top * 1.05)
        ax.set_xlabel("prefill FLOPs ratio (ideal)")
        ax.set_ylabel(f"prefill time ratio (measured, {rows[0]['timer']})")
        ax.set_title(f"{100 * keep:g}% of the visual tokens", fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="outside right center", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig
