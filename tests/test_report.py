"""The results page (vlm_prune.eval.report, `vlm-prune bench --report`) and the bench command's edges."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vlm_prune.eval import bench, report
from vlm_prune.eval.synthetic.scenes import DEFAULT_SEED

from vlm_prune import cli

REPO = Path(__file__).resolve().parents[1]
META = {"mode": "bench", "command": "vlm-prune bench --kinds image", "code": "vlm-prune 0.1.0 (abc)",
        "machine": "a CPU", "date": "2026-01-01T00:00:00+00:00", "args": {"repeats": 1}}


def row(method: str, keep: float, correct: str) -> dict:
    acc = correct.count("1") / len(correct)
    return {"model": "synthetic-image", "seed": 0, "method": method, "keep": keep, "n": len(correct), "correct": correct,
            "accuracy": acc, "by_family": {"count": acc}, "visual_tokens_in": 64.0, "visual_tokens_out": 64.0 * keep,
            "visual_tokens_layer_avg": 64.0 * keep, "kept_fraction": keep, "layer_avg_fraction": keep,
            "flops_ratio": 0.5 if keep < 1 else 1.0, "chance": 0.25, "retention": acc, "chance_retention": acc,
            "prefill_ratio": 0.7 if keep < 1 else 1.0, "prefill_cpu_ratio": 0.6 if keep < 1 else 1.0, "notes": ""}


def write(folder: Path, name: str, rows: list[dict], **meta) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"meta": {**META, **meta}, "rows": rows, "skipped": []}))


def fixture_results(root: Path) -> None:
    """A published and a fresh test set: 'best' beats saturation on both, 'good' on the published one only."""
    write(root / "results" / "bench", "image.json", [
        row("none", 1.0, "1111111111"), row("saturation", 0.25, "1111100000"), row("best", 0.25, "1111111111"),
        row("good", 0.25, "1111111110"), row("bad", 0.25, "1111000000")], data_seed=DEFAULT_SEED)
    write(root / "results" / "bench", "image-fresh.json", [
        row("none", 1.0, "1111111111"), row("saturation", 0.25, "1111100000"), row("best", 0.25, "1111111111"),
        row("good", 0.25, "1111100001"), row("bad", 0.25, "1111000000")], data_seed=7,
        command="vlm-prune bench --kinds image --data-seed 7")


def test_report_tables_held_out_check_and_links(tmp_path):
    fixture_results(tmp_path)
    (tmp_path / "README.md").write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\nrest\n")
    report.write_report(root=str(tmp_path))
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "\n".join([
        "| method | accuracy % (95% CI) | retention | vs saturation (paired, % points) | layer-avg tokens | "
        "FLOPs ratio (ideal) | prefill ratio (measured) |",
        "|---|---|---|---|---|---|---|",
        "| best | 100.0 +- 0.0 | 1.00 | +50.0 +- 32.7 | 16.0 | 0.50 | 0.60 |",
        "| good | 90.0 +- 19.6 | 0.90 | +40.0 +- 32.0 | 16.0 | 0.50 | 0.60 |",
        "| saturation | 50.0 +- 32.7 | 0.50 | baseline | 16.0 | 0.50 | 0.60 |",
        "| bad | 40.0 +- 32.0 | 0.40 | -10.0 +- 19.6 | 16.0 | 0.50 | 0.60 |",
    ]) in page
    assert "- At 25% of the tokens, beat it: best (+50.0 +- 32.7)." in page
    assert "- At 25% of the tokens, beat it: good (+10.0 +- 19.6)." in page.split("so not claimed:")[1]
    assert "bad (" not in page  # not significant anywhere: no claim
    assert "- `results/bench/image-fresh.json`: `vlm-prune bench --kinds image --data-seed 7`; code vlm-prune 0.1.0" in page
    assert "Machines and software: [1] a CPU." in page
    # the same page in the docs, figures linked from each place
    docs = (tmp_path / "docs" / "results.md").read_text()
    assert "](docs/img/results/bench-image.png)" in page and "](img/results/bench-image.png)" in docs
    assert docs.replace("](img/results/", "](docs/img/results/") == page
    assert (tmp_path / "docs" / "img" / "results" / "bench-image.png").read_bytes()[:4] == b"\x89PNG"
    # the README block: the best registered method (not the baseline) per use and budget
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith(f"intro\n{report.BEGIN}\n") and readme.endswith(f"{report.END}\nrest\n")
    assert "| images | best (100.0%, beats saturation: image table, 25%) |" in readme
    assert "| serving images (vLLM) | - |" in readme  # neither fixture method runs in vLLM


def test_report_refuses_a_file_without_provenance(tmp_path):
    fixture_results(tmp_path)
    data = json.loads((tmp_path / "results" / "bench" / "image.json").read_text())
    del data["meta"]["code"], data["meta"]["date"]
    (tmp_path / "results" / "bench" / "image.json").write_text(json.dumps(data))
    with pytest.raises(report.ReportError, match=r"results/bench/image.json: no code, date in its meta"):
        report.write_report(root=str(tmp_path))
    assert not (tmp_path / "BENCHMARKS.md").exists()


def test_report_refuses_a_kind_without_renderer(tmp_path):
    fixture_results(tmp_path)
    write(tmp_path / "results" / "other", "x.json", [], mode="not-a-kind")
    with pytest.raises(report.ReportError, match=r"result kind\(s\) not-a-kind \(results/other/x.json\)"):
        report.write_report(root=str(tmp_path))


def test_readme_without_markers_is_left_alone(tmp_path):
    fixture_results(tmp_path)
    (tmp_path / "README.md").write_text("no markers\n")
    notes = report.write_report(root=str(tmp_path))
    assert (tmp_path / "README.md").read_text() == "no markers\n"
    assert any(n.startswith("README.md not changed: it has no <!-- which-method:begin -->") for n in notes)


def test_committed_page_is_generated_from_the_committed_results(tmp_path):
    """BENCHMARKS.md and docs/results.md are exactly what the committed result files render, within the size limit."""
    files = report.load_results(str(REPO / "results"), str(REPO))
    text, _ = report.render(files, str(tmp_path))
    page = report.place(text, report.IMG_FROM_ROOT)
    assert len(page) <= report.MAX_CHARS
    assert (REPO / "BENCHMARKS.md").read_text() == page
    assert (REPO / "docs" / "results.md").read_text() == report.place(text, report.IMG_FROM_DOCS)
    for name in os.listdir(tmp_path):
        assert (REPO / report.IMG_FROM_ROOT / name).is_file()


def test_bench_refuses_methods_none_of_which_runs_before_loading(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "load", lambda *a: pytest.fail("a model was loaded"))
    assert cli.main(["bench", "--methods", "keyscore", "--kinds", "image", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vlm-prune bench: error: --methods keyscore: none runs on the synthetic "
                                                   "image model (method 'keyscore' works in the 'frames' stage")
    assert not (tmp_path / "b").exists()


def test_bench_table_keeps_accuracy_without_a_terminal(monkeypatch):
    rows = [row("none", 1.0, "1111111111"), row("divprune", 0.25, "1111100000")]
    for r in rows:
        r["notes"] = "a long note about how the method was configured for this model " * 2
    rows[0]["qtypes"] = ["count"] * 10
    table = bench.markdown(rows, [])
    assert bench.printed(table, "bench.md") == table  # captured stdout: no terminal, the whole table
    monkeypatch.setattr(bench.sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    fitted = bench.printed(table, "bench.md").splitlines()
    assert fitted[0].split("|")[4].strip() == "accuracy % (95% CI)" and fitted[-1].startswith("(")
    assert fitted[3].split("|")[4].strip() == "50.0 +- 32.7"


def test_cli_prints_warnings_without_the_source_line():
    """A BudgetWarning (as `bench --quick` raises from wrap()) prints on one line, without the
    library's source line under it; in a fresh process, as the command runs."""
    script = ("import warnings\n"
              "from vlm_prune import cli, cli_methods\n"
              "from vlm_prune.methods.base import BudgetWarning\n"
              "def run(args):\n"
              "    warnings.warn('keep=0.01 keeps 1 token', BudgetWarning, stacklevel=2)\n"
              "cli_methods.run = run\n"
              "raise SystemExit(cli.main(['methods']))\n")
    done = subprocess.run([sys.executable, "-W", "always", "-c", script], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, "BudgetWarning: keep=0.01 keeps 1 token\n")


def speed_row(method: str, keep: float, measured: float, ideal: float) -> dict:
    return {"model": "llava-1.5-7b", "method": method, "keep": keep, "visual_tokens_in": 576,
            "visual_tokens_out": 576 * keep, "measured_ratio": measured, "ratio_min": measured - 0.01,
            "ratio_max": measured + 0.01, "timer": "wall-clock", "ideal_ratio": ideal,
            "efficiency": None if keep == 1 else (1 / measured - 1) / (1 / ideal - 1), "scoring_share": 0.02,
            "notes": "a | b" if method == "fastv" else ""}


def test_report_speed_and_kernels_go_to_the_speed_page(tmp_path):
    """A speed file: one line and a figure per shape on the results page, its tables on docs/speed.md (linked
    from both places); a kernels file: its table there too."""
    fixture_results(tmp_path)
    rows = [speed_row("fastv", 0.25, 0.5, 0.4), speed_row("divprune", 0.25, 0.45, 0.3), speed_row("fastv", 1.0, 1.02, 1.0)]
    write(tmp_path / "results" / "gpu", "speed.json", rows, mode="speed", machine="a CPU, GPU NVIDIA H200",
          args={"repeats": 3})
    kernel = {"kernel": "attention_rows", "shape": "B1 S8192", "torch_ms": 3.0, "triton_ms": 1.0, "dense_ms": 9.0,
              "torch_mb": 10.0, "triton_mb": 1.0, "dense_mb": 900.0, "max_abs_diff": 1e-6}
    write(tmp_path / "results" / "gpu", "kernels.json", [kernel], mode="kernels", machine="a CPU, GPU NVIDIA H200")
    report.write_report(root=str(tmp_path))
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert ("- **llava-1.5-7b** (GPU, wall-clock): at 25% of the tokens, 0.47 measured against 0.35 ideal (medians "
            "over 2 methods; efficiency 0.60). Keep 1.0: fastv 1.02.") in page
    assert "[Speed](docs/speed.md)" in page and "[Speed](speed.md)" in (tmp_path / "docs" / "results.md").read_text()
    speed = (tmp_path / "docs" / "speed.md").read_text()
    assert "| divprune | 144 / 576 | 0.45 (0.44-0.46) | 0.30 | 0.52 | 2.0 |  |\n| fastv | 144 / 576 | 0.50" in speed
    assert "a \\| b" in speed and "](img/results/speed-llava-1-5-7b-gpu.png)" in speed
    assert "| attention_rows | B1 S8192 | 3.00 | 1.00 | 9.00 | 10.0 | 1.0 | 900.0 | 1.0e-06 |" in speed
    assert (tmp_path / "docs" / "img" / "results" / "speed-llava-1-5-7b-gpu.png").is_file()
