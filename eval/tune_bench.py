"""The tuner against the exhaustive grid on the shipped toy models, and its results section.

    python -m vlm_prune.eval.tune_bench --kinds image,video --work runs/tune-bench --results results/tune
    python -m vlm_prune.eval.tune_bench --kinds image --data-seed 7 --work runs/tune-bench --results results/tune

For each kind it runs ``vlm_prune.tune`` twice into separate folders (nothing shared): the search,
and ``grid=True`` (every setting on every sample). It records both fronts, how many of the grid's
front points the search found, whether the recommendation is the same, and the cost of each in
model answers and process CPU seconds, in ``results/tune/tune-<kind>.json`` (``--data-seed N``, a
freshly drawn synthetic set: ``tune-<kind>-seed<N>.json``) with its provenance (``meta``: mode,
command, code version, machine, date, data seed). :func:`render_tune_results` turns those files
into the results page's Markdown section.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Sequence

MODE = "tune"


def meta(command: Sequence[str]) -> dict[str, Any]:
    """Provenance of a result file: the command, the code version (git commit, "+dirty" when the
    checkout has changes outside ``results/``), the machine (CPU model, cores), the date."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    code = git("rev-parse", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"):  # results: written here
        code += "+dirty"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"mode": MODE, "command": " ".join(command), "code": code,
            "machine": f"{cpu}, {os.cpu_count()} cores, {platform.system()}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}


def compare(kind: str, work: str, data_seed: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """The search and the grid on the shipped ``kind`` model, each timed in process CPU seconds."""
    from vlm_prune.eval.tune import tune

    runs = {}
    for name, grid in (("search", False), ("grid", True)):
        start = time.process_time()
        folder = f"{kind}-{name}" + ("" if data_seed is None else f"-seed{data_seed}")
        result = tune(os.path.join(work, folder), kind, grid=grid, data_seed=data_seed, **kwargs)
        runs[name] = {"front": [{k: e[k] for k in ("setting", "accuracy", "retention", "retention_lower",
                                                   "retention_upper", "flops_ratio", "visual_tokens")}
                                for e in result.front],
                      "recommended": result.recommended["setting"] if result.recommended else None,
                      "calls": result.cost["calls"], "cpu_s": time.process_time() - start,
                      "rungs": result.rungs, "candidates": result.candidates, "goal": result.goal.text(),
                      "baseline_accuracy": result.baseline["accuracy"], "compositions": result.compositions}
    grid_front = {e["setting"] for e in runs["grid"]["front"]}
    found = grid_front & {e["setting"] for e in runs["search"]["front"]}
    return {"kind": kind, "data_seed": data_seed, **runs, "grid_front_found": len(found),
            "grid_front_size": len(grid_front),
            "same_recommendation": runs["search"]["recommended"] == runs["grid"]["recommended"],
            "calls_fraction": runs["search"]["calls"] / runs["grid"]["calls"],
            "cpu_fraction": runs["search"]["cpu_s"] / runs["grid"]["cpu_s"] if runs["grid"]["cpu_s"] else None}


def render_tune_results(paths: Sequence[str]) -> str:
    """The results page's section on the tuner from ``results/tune/*.json`` files."""
    files = []
    for path in sorted(paths):
        with open(path, encoding="utf-8") as f:
            files.append((path, json.load(f)))
    return "\n".join(_section(files)) + "\n"


def render(files: Sequence[Any], page: Any = None) -> list[str]:
    """The same section for the report's registry: ``files`` with ``.path`` and ``.data``."""
    return _section([(f.path, f.data) for f in files])


def _section(files: list[tuple[str, dict[str, Any]]]) -> list[str]:
    def seed(r: dict[str, Any]) -> str:
        return "published" if r.get("data_seed") is None else str(r["data_seed"])

    files = sorted(files, key=lambda f: (f[1]["result"]["kind"], f[1]["result"].get("data_seed") is not None,
                                         f[1]["result"].get("data_seed") or 0))
    results = [data["result"] for _, data in files]
    goals = sorted({r["search"]["goal"] for r in results})
    lines = ["### The tuner against the exhaustive grid", "",
             "`vlm-prune tune` (a race, docs/tune.md) against the grid (every setting on every sample), on the toy "
             f"models' validation split (published or a fresh data seed); goal: {'; '.join(goals)}. Found: the grid's "
             "front points on the search's front; answers, CPU: the search's share of the grid's.", "",
             "| model | data seed | settings | grid front found | same recommendation | answers | CPU |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        s, g = r["search"], r["grid"]
        same = (f"yes ({s['recommended']})" if r["same_recommendation"]
                else f"no ({s['recommended'] or 'none'} / {g['recommended'] or 'none'})")
        cpu = f"{r['cpu_fraction']:.2f}" if r.get("cpu_fraction") else "-"
        lines.append(f"| synthetic-{r['kind']} | {seed(r)} | {s['candidates']} | {r['grid_front_found']} of "
                     f"{r['grid_front_size']} | {same} | {r['calls_fraction']:.2f} ({s['calls']} / {g['calls']}) | {cpu} |")
    lines.append("")
    for r in results:
        comps = r["grid"]["compositions"] if r.get("data_seed") is None else []
        if comps:
            lines.append(f"Pipelines against single methods on synthetic-{r['kind']} (grid, paired 95% intervals): "
                         + "; ".join(f"keep {c['keep']:g}: {c['composition']} {c['verdict']} {c['single']} "
                                     f"({100 * c['diff']:+.1f} +- {100 * c['ci']:.1f} points, {c['n']} samples)"
                                     for c in comps) + ".")
            lines.append("")
    return lines  # the commands: the page's provenance


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlm_prune.eval.tune_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="image,video", help="shipped toy models to run (default image,video)")
    p.add_argument("--work", required=True, help="folder for the two runs per kind (answers cached there)")
    p.add_argument("--results", default="results/tune", help="where tune-<kind>.json goes")
    p.add_argument("--samples", type=int, default=None, help="tuning set size (default: the tuner's, 288)")
    p.add_argument("--keeps", default=None, help="keeps searched, e.g. 0.5,0.25,0.11 (default: the tuner's)")
    p.add_argument("--methods", default=None, help="methods searched (default: all the model accepts)")
    p.add_argument("--data-seed", type=int, default=None,
                   help="draw the synthetic set with this seed (default: the published one); "
                        "writes tune-<kind>-seed<N>.json")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.makedirs(args.results, exist_ok=True)
    kwargs: dict[str, Any] = {"samples": args.samples}
    if args.keeps:
        kwargs["keeps"] = tuple(float(k) for k in args.keeps.split(","))
    if args.methods:
        kwargs["methods"] = args.methods.split(",")
    # the provenance of the code that runs, taken before the runs
    provenance = {**meta([os.path.basename(sys.executable), "-m", "vlm_prune.eval.tune_bench",
                          *(argv if argv is not None else sys.argv[1:])]), "data_seed": args.data_seed}
    for kind in args.kinds.split(","):
        result = compare(kind, args.work, args.data_seed, **kwargs)
        seed = "" if args.data_seed is None else f"-seed{args.data_seed}"
        path = os.path.join(args.results, f"tune-{kind}{seed}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"meta": provenance, "result": result}, f, indent=1)
        print(f"{path}: grid front found {result['grid_front_found']} of {result['grid_front_size']}, same "
              f"recommendation {result['same_recommendation']}, answers {result['calls_fraction']:.2f} of the grid's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
