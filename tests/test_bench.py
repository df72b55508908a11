"""vlm-prune bench (quick, in process) and bench --speed on a tiny scale."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vlm_prune.adapters.llava import LlavaAdapter
from vlm_prune.adapters.llava_onevision import LlavaOnevisionAdapter
from vlm_prune.eval.bench import fit_layer, query_objects
from vlm_prune.eval.speed import LLAMA_7B, QWEN2_7B, scaled

import vlm_prune
from vlm_prune.cli import main
from vlm_prune.registry import method_class, method_stages

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def applicable(stages: set[str], family: str) -> set[str]:
    out = {"saturation"}  # the required model-free baseline
    for name in vlm_prune.available_methods():
        cls = method_class(name)
        if cls.refusal(family, tuple(stages)) is None:  # wrap()'s rule (PruneVid needs the frames and llm stages)
            out.add(name)
            if method_stages(name) == ("frames",):  # (HoliTom brings its own llm stage: no partner)
                out.add(f"{name}+pact")
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # one model seed per kind (pooling over the shipped seeds has its own test below)
    argv = ["bench", "--quick", "--seeds", "1", "--limit", "4", "--batch-size", "4", "--keep", "0.25", "--repeats", "1",
            "--out", str(out)]
    assert main(argv) == 0
    return out, json.loads((out / "bench.json").read_text())


def test_quick_bench_has_a_row_per_applicable_method(quick):
    out, result = quick
    rows, skipped = result["rows"], result["skipped"]
    for model, adapter in (("synthetic-image", LlavaAdapter), ("synthetic-video", LlavaOnevisionAdapter)):
        stages, family = set(adapter.stages), adapter.family
        methods = [r["method"] for r in rows if r["model"] == model]
        assert sorted(methods) == sorted(applicable(stages, family) | {"none"})
        left_out = {s["method"] for s in skipped if s["model"] == model}
        assert left_out == set(vlm_prune.available_methods()) - applicable(stages, family)
    table = (out / "bench.md").read_text()
    assert "| synthetic-video | quota+pact | 0.25 |" in table and "asvit - method 'asvit' works in the 'vit' stage" in table
    assert "Matched layer-avg tokens, synthetic-image" in table and "Best method per task family" in table
    for refs, model in (("saturation, divprune", "synthetic-image"), ("saturation, quota, keyscore, divprune", "synthetic-video")):
        for axis in ("final tokens", "layer-avg tokens"):
            assert f"Every method against {refs} at matched {axis}, {model}" in table
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "bench.svg").read_text().lstrip().startswith("<?xml") and (out / "bench.pdf").read_bytes()[:4] == b"%PDF"


def test_quick_bench_numbers_are_consistent(quick):
    _, result = quick
    rows = result["rows"]
    base = {r["model"]: r for r in rows if r["method"] == "none"}
    assert base["synthetic-image"]["visual_tokens_in"] == 64  # 64x64 image, patch 8
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and len(r["correct"]) == r["n"] == 4
        assert r["accuracy"] == r["correct"].count("1") / r["n"]
        b = base[r["model"]]
        assert r["retention"] == pytest.approx(r["accuracy"] / b["accuracy"])
        if b["accuracy"] > b["chance"]:
            assert r["chance_retention"] == pytest.approx((r["accuracy"] - b["chance"]) / (b["accuracy"] - b["chance"]))
        assert r["prefill_ratio"] > 0 and r["prefill_cpu_ratio"] > 0
        if r["method"] in ("random", "pool", "divprune", "cdpruner", "visionzip", "saturation") and r["model"] == "synthetic-image":
            assert r["visual_tokens_out"] == 16 and r["kept_fraction"] == 0.25  # floor(0.25 * 64)
            assert r["visual_tokens_layer_avg"] == 16 and r["flops_ratio"] < 1.0  # removed before layer 0
        if r["method"] == "fastv" and r["model"] == "synthetic-image":  # all 64 through layers 0-1, 16 after
            assert r["visual_tokens_layer_avg"] == pytest.approx((2 * 64 + 4 * 16) / 6)
        if r["method"] in ("uniform", "saturation") and r["model"] == "synthetic-video":
            assert r["visual_tokens_out"] - b["visual_tokens_in"] + 64 == 4 * 4  # 4 of 16 frames x 2x2 tokens
        assert r["visual_tokens_in"] == b["visual_tokens_in"]
    pooled = {(p["model"], p["method"], p["keep"]): p for p in result["pooled"]}
    for r in rows:
        assert pooled[(r["model"], r["method"], r["keep"])]["accuracy"] == pytest.approx(r["accuracy"])


def test_speed_tiny_scale_reports_savings(tmp_path):
    argv = ["bench", "--speed", "--scale", "16", "--frames", "1", "--methods", "random,tome",
            "--speed-keeps", "0.05", "--repeats", "3", "--threads", "1", "--shapes", "image,video", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = json.loads((tmp_path / "speed.json").read_text())
    rows = out["rows"]
    assert [(r["method"], r["keep"]) for r in rows] == [("random", 0.05), ("tome", 0.05), ("random", 1.0),
                                                        ("random", 0.05), ("random", 1.0)]
    image, tome, identity, video, _ = rows
    assert image["visual_tokens_in"] == 576 and image["visual_tokens_out"] == 28  # floor(0.05 * 576)
    assert video["visual_tokens_in"] == 196  # 14x14 pooled tokens (the newline is not a visual token)
    assert tome["ideal_ratio"] < 1 and tome["visual_tokens_out"] < 576  # ToMe is timed (inside CLIP)
    assert identity["ideal_ratio"] == 1.0 and identity["efficiency"] is None
    for r in rows:
        assert 0 < r["ideal_ratio"] <= 1 and r["overhead"] == pytest.approx(r["measured_ratio"] / r["ideal_ratio"])
        assert r["ratio_min"] <= r["measured_ratio"] <= r["ratio_max"] and r["timer"] == "process CPU time"
        assert 0 <= r["scoring_share"] < 1  # process CPU seconds of the selection over the prefill's
        if r["ideal_ratio"] < 1:
            assert r["efficiency"] == pytest.approx((1 / r["measured_ratio"] - 1) / (1 / r["ideal_ratio"] - 1))
    assert image["measured_ratio"] < 1.0  # process CPU time: stable on a shared machine, unlike wall-clock
    assert [s["method"] for s in out["skipped"]] == ["tome"]  # OneVision's SigLIP path has no ViT stage
    assert (tmp_path / "speed.md").read_text().count("| random | 0.05 |") == 2


def test_speed_unknown_method_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # a usage error: one line, exit code 2
        main(["bench", "--speed", "--methods", "tomme", "--shapes", "image", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "unknown method 'tomme'; did you mean tome" in capsys.readouterr().err


def test_speed_times_every_registered_method_the_shape_runs(monkeypatch):
    """Without --methods, --speed times its listed methods first, then every other registered
    method the shape's adapter runs: the video records of issue 31 with no change to speed.py."""
    from vlm_prune.eval import speed

    monkeypatch.setitem(speed.SPEED_METHODS, "video", ("uniform", "tome"))
    model = speed.build("video", 64, torch.float32, "cpu")
    methods = speed.default_methods("video", model)
    assert methods[:2] == ["uniform", "tome"]  # listed ones stay, refused or not (tome: skipped with the reason)
    assert {"vidcom2", "fastvid", "holitom", "dycoke", "keyscore", "quota", "pact"} <= set(methods)
    assert "asvit" not in methods and len(methods) == len(set(methods))
    adapter = LlavaOnevisionAdapter
    for name in methods[2:]:
        assert method_class(name).refusal(adapter.family, adapter.stages) is None, name


def test_bench_methods_take_the_saturation_baseline(tmp_path, capsys):
    argv = ["bench", "--quick", "--kinds", "video", "--limit", "4", "--batch-size", "4", "--keep", "0.25",
            "--methods", "vidcom2,Saturation", "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "b" / "bench.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["none", "saturation", "vidcom2"]
    assert main(["bench", "--speed", "--methods", "random,saturation", "--out", str(tmp_path / "s")]) == 2
    assert "'saturation' is the accuracy bench's model-free baseline" in capsys.readouterr().err


def test_proportional_shape_keeps_the_7b_proportions():
    from vlm_prune.eval.speed import LLAVA_VISION, proportional

    deep = proportional(LLAMA_7B, heads=1, depth_div=2, gated=True)
    assert (deep["hidden_size"], deep["num_hidden_layers"], deep["head_dim"]) == (128, 16, 128)
    per_width = lambda c: 2 * c["hidden_size"] + 2 * c["num_key_value_heads"] * c["head_dim"] + 3 * c["intermediate_size"]
    assert abs(per_width(deep) - per_width({**LLAMA_7B, "head_dim": 128})) < 3  # attention share as at 7B
    tower = proportional(LLAVA_VISION, heads=1, depth_div=4, gated=False)
    assert (tower["hidden_size"], tower["num_hidden_layers"]) == (64, 6)
    assert 2 * 64 + 2 * 64 + 2 * tower["intermediate_size"] == 4 * 1024 + 2 * 4096


def test_scaled_shapes_keep_head_size():
    llama = scaled(LLAMA_7B, 8)
    assert (llama["num_attention_heads"], llama["hidden_size"], llama["intermediate_size"], llama["num_hidden_layers"]) == (4, 512, 1376, 4)
    qwen = scaled(QWEN2_7B, 8)
    assert (qwen["num_attention_heads"], qwen["num_key_value_heads"], qwen["hidden_size"], qwen["head_dim"]) == (3, 1, 384, 128)
    assert scaled(LLAMA_7B, 1) == {**LLAMA_7B, "head_dim": 128}


def test_fit_layer_moves_pruning_inside_shallow_models():
    fastv, note = fit_layer("fastv", 2)
    assert fastv.layer == 1 and "default 2" in note
    pact, _ = fit_layer("pact", 32)
    assert pact.layer == 4
    pact, _ = fit_layer("pact", 4, factor=4 / 32)
    assert pact.layer == 1
    ada, note = fit_layer("adaptinfer", 2)
    assert ada.stage_ratios == () and "1 pruning step" in note


def test_methods_missing_an_extra_are_skipped_with_the_install_hint(hide_module):
    from vlm_prune.eval.bench import plan
    from vlm_prune.eval.synthetic import load

    model, processor = load("video")
    hide_module("cv2")
    cases, skipped = plan(model, processor, (0.25,), {"keyscore", "uniform"})
    assert [c.label for c in cases] == ["uniform"]
    assert skipped == [{"method": "keyscore", "reason": skipped[0]["reason"]}] and "vlm-prune[video]" in skipped[0]["reason"]


def test_quota_looks_for_the_objects_the_users_query_names():
    from vlm_prune.frames.quota import PLAIN_PROMPTS, frame_prompt

    assert query_objects("how many times does the red shape appear ?") == ["red shape"]
    assert query_objects("which colour came first ?") == ["coloured shape"]
    assert frame_prompt("is there a blue shape ?", query_objects("is there a blue shape ?"), PLAIN_PROMPTS) == "is there a blue shape ?"


def test_bench_leaves_out_a_seed_at_chance_rather_than_a_family(monkeypatch, capsys):
    """A family three seeds answer is benched on those seeds; the seed at chance on it is left out,
    not the family. With fewer than three seeds that answer everything, all seeds bench what they share."""
    import vlm_prune.eval.bench as bench

    cards = {0: ("a", "b", "c"), 1: ("a", "b", "c"), 2: ("a", "b"), 3: ("a", "c", "b"), 4: ("a",)}
    monkeypatch.setattr(bench, "trained_qtypes", lambda kind, seed: cards[seed])
    assert bench.seeds_and_families("video", [0, 1, 2, 3]) == ([0, 1, 3], ("a", "b", "c"))
    assert "seed 2 is left out: it answers ['c'] no better than chance" in capsys.readouterr().out
    assert bench.seeds_and_families("video", [0, 1, 2]) == ([0, 1, 2], ("a", "b"))  # only two seeds answer c
    assert "families ['c'] are left out" in capsys.readouterr().out
    assert bench.seeds_and_families("video", [0, 2, 4, 3]) == ([0, 2, 3], ("a", "b"))
    assert bench.seeds_and_families("video", [2, 4]) == ([2, 4], ("a",))
    assert bench.seeds_and_families("video", [0, 2]) == ([0, 2], ("a", "b"))  # two seeds given: both must answer


def _row(method, keep, correct, frac, flops=None, seed=0, model="m"):
    return {"model": model, "method": method, "keep": keep, "seed": seed, "n": len(correct), "correct": correct,
            "accuracy": correct.count("1") / len(correct), "kept_fraction": frac, "layer_avg_fraction": frac,
            "flops_ratio": flops if flops is not None else frac, "by_family": {}, "notes": ""}


def test_pooling_over_seeds_concatenates_paired_samples():
    from vlm_prune.eval.bench_stats import pool_seeds

    rows = [_row("a", 0.5, "1100", 0.5, seed=0), _row("a", 0.5, "1110", 0.5, seed=1), _row("b", 0.5, "0000", 0.5)]
    pooled = {r["method"]: r for r in pool_seeds(rows)}
    a = pooled["a"]
    assert a["correct"] == "11001110" and a["seeds"] == [0, 1] and a["n"] == 8
    assert a["accuracy"] == pytest.approx(0.625) and (a["accuracy_min"], a["accuracy_max"]) == (0.5, 0.75)
    sd = np.std([1, 1, 0, 0, 1, 1, 1, 0], ddof=1)
    assert a["accuracy_ci"] == pytest.approx(1.959964 * sd / np.sqrt(8), rel=1e-5)


def test_interpolation_and_paired_intervals_are_exact():
    from vlm_prune.eval.bench_stats import interpolate, paired

    lo, hi = np.array([0.0, 1.0, 0.0, 1.0]), np.array([1.0, 1.0, 1.0, 0.0])
    mid = interpolate([(0.1, lo), (0.3, hi)], 0.15)  # a quarter of the way from 0.1 to 0.3
    assert mid == pytest.approx(0.75 * lo + 0.25 * hi)
    assert interpolate([(0.1, lo), (0.3, hi)], 0.05) is None  # never extrapolated
    assert interpolate([(0.1, lo), (0.1, hi), (1.0, hi)], 0.1) == pytest.approx((lo + hi) / 2)  # ties averaged
    d, h = paired(hi, lo)
    diffs = hi - lo
    assert d == pytest.approx(diffs.mean()) and h == pytest.approx(1.959964 * diffs.std(ddof=1) / 2, rel=1e-5)


def test_matched_view_names_the_best_method_with_paired_intervals():
    from vlm_prune.eval.bench_stats import matched, pool_seeds

    ones, zeros = "1" * 10, "0" * 10
    rows = [_row("none", 1.0, ones, 1.0),
            _row("random", 0.25, "1" * 5 + "0" * 5, 0.25, flops=0.4), _row("random", 0.05, zeros, 0.05, flops=0.2),
            _row("good", 0.25, ones, 0.25, flops=0.4), _row("good", 0.05, "1" * 8 + "00", 0.05, flops=0.2),
            _row("late", 0.5, ones, 0.5, flops=0.6)]  # never reaches 25%
    view = matched(pool_seeds(rows), {"m": ["x"] * 10})
    at = {(e["family"], e["axis"], e["fraction"]): e for e in view}
    e = at[("all", "layer_avg_fraction", 0.25)]
    assert e["best"] == "good" and e["accuracy"] == {"random": 0.5, "good": 1.0, "late": None}
    assert e["vs_random"]["diff"] == pytest.approx(0.5) and e["vs_runner_up"]["method"] == "random"
    e11 = at[("all", "kept_fraction", 0.11)]  # 0.11 lies 0.3 of the way from 0.05 to 0.25
    assert e11["accuracy"]["good"] == pytest.approx(0.8 + 0.3 * 0.2)
    flops = at[("all", "flops_ratio", 0.25)]  # random's FLOPs at 25% tokens: 0.4
    assert flops["target"] == pytest.approx(0.4) and flops["accuracy"]["good"] == 1.0
    assert at[("x", "layer_avg_fraction", 0.05)]["accuracy"]["good"] == pytest.approx(0.8)


def test_matched_view_sets_every_method_against_the_references():
    """Each method's paired difference to saturation / QuoTA / KeyScore at every matched target,
    and the bench.md table that prints it (issue 31: where each video record stands)."""
    from vlm_prune.eval.bench import _reference_table
    from vlm_prune.eval.bench_stats import matched, pool_seeds

    ones = "1" * 10
    rows = [_row("none", 1.0, ones, 1.0), _row("saturation", 0.25, "1" * 6 + "0" * 4, 0.25),
            _row("quota", 0.25, "1" * 4 + "0" * 6, 0.25), _row("vidcom2", 0.25, "0" * 2 + "1" * 8, 0.25),
            _row("dycoke", 0.5, ones, 0.5)]  # never reaches 25%
    view = matched(pool_seeds(rows), {"m": ["x"] * 10})
    e = next(e for e in view if (e["family"], e["axis"], e["fraction"]) == ("all", "layer_avg_fraction", 0.25))
    vs = e["vs_references"]["vidcom2"]
    assert set(vs) == {"saturation", "quota"}  # keyscore / divprune: not in this bench
    diffs = np.array([-1, -1, 0, 0, 0, 0, 1, 1, 1, 1], float)  # vidcom2 - saturation per sample
    assert vs["saturation"]["diff"] == pytest.approx(0.2)
    assert vs["saturation"]["ci"] == pytest.approx(1.959964 * diffs.std(ddof=1) / np.sqrt(10), rel=1e-5)
    assert vs["quota"]["diff"] == pytest.approx(0.4) and set(e["vs_references"]["quota"]) == {"saturation"}
    assert "dycoke" not in e["vs_references"] and e["ci"]["dycoke"] is None
    assert e["ci"]["vidcom2"] == pytest.approx(1.959964 * np.std([0] * 2 + [1] * 8, ddof=1) / np.sqrt(10), rel=1e-5)
    table = _reference_table("m", "layer-avg tokens", [x for x in view if x["axis"] == "layer_avg_fraction" and x["family"] == "all"])
    assert "| method | target | accuracy % | vs saturation | vs quota |" in table
    assert f"| vidcom2 | 25% | 80.0 +- {100 * e['ci']['vidcom2']:.1f} | +20.0 +- {100 * vs['saturation']['ci']:.1f} | +40.0 +- " in "\n".join(table)
    assert not any(line.startswith("| dycoke |") for line in table)


def test_figures_give_each_method_its_own_colour_and_write_png_svg_pdf(tmp_path):
    from vlm_prune.eval.plots import METHOD_COLOURS, method_style, write_sweep

    names = [*vlm_prune.available_methods(), "saturation"]
    colours = [method_style(m, names)["color"] for m in names]
    assert len(set(colours)) == len(names) and set(colours) <= set(METHOD_COLOURS.values())
    assert method_style("quota+pact", names)["color"] == method_style("quota", names)["color"]
    assert method_style("quota+pact", names)["ls"] == "--"
    rows = [{"name": "none", "method": "none", "n": 2, "accuracy": 0.5, "kept_fraction": 1.0, "ttft_s": 1.0, "prefill_flops": 4.0},
            {"name": "random-0.25", "method": "random", "n": 2, "accuracy": 0.5, "kept_fraction": 0.25, "ttft_s": 0.5,
             "prefill_flops": 1.0, "flops_ratio": 0.25}]
    paths = write_sweep(rows, str(tmp_path), "test")
    assert paths["plot"].endswith("sweep.png") and (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "sweep.svg").exists() and (tmp_path / "sweep.pdf").read_bytes()[:4] == b"%PDF"


def test_bench_figure_says_what_the_models_points_and_bars_are():
    from vlm_prune.eval.plots import bench_caption, bench_plot

    pooled = [
        {"model": "synthetic-image", "method": "none", "seeds": [0, 1, 2], "n": 900, "accuracy": 0.9,
         "layer_avg_fraction": 1.0, "flops_ratio": 1.0, "chance": 0.25},
        {"model": "synthetic-image", "method": "random", "seeds": [0, 1, 2], "n": 900, "accuracy": 0.6,
         "accuracy_min": 0.5, "accuracy_max": 0.7, "layer_avg_fraction": 0.25, "flops_ratio": 0.3},
        {"model": "my/ckpt", "method": "none", "seeds": [0], "n": 96, "accuracy": 0.8,
         "layer_avg_fraction": 1.0, "flops_ratio": 1.0},
    ]
    caption = bench_caption(pooled).splitlines()
    assert caption == [
        "synthetic-image: the shipped synthetic toy model (tiny, trained on procedural shapes; not a real checkpoint); "
        "3 seed(s) x 300 test samples (n = 900 per point); points: accuracy, mean over seeds; bars: min-max over the seeds",
        "my/ckpt: model; 1 seed(s) x 96 test samples (n = 96 per point); points: accuracy, mean over seeds; "
        "bars: 95% interval over the samples",
    ]
    assert bench_plot(pooled)._suptitle.get_text() == "\n".join(caption)


def test_quick_runs_on_one_thread_unless_told():
    from vlm_prune.cli import build_parser
    from vlm_prune.eval.bench import torch_threads

    def threads(*argv: str) -> int | None:
        return torch_threads(build_parser("bench").parse_args(["bench", *argv]))

    assert threads("--quick") == 1 and threads("--quick", "--threads", "2") == 2
    assert threads() is None and threads("--threads", "3") == 3
    assert threads("--quick", "--model", "some/ckpt") is None and threads("--quick", "--speed") is None


def test_quick_times_each_setting_once_unless_told():
    from vlm_prune.cli import build_parser
    from vlm_prune.eval.bench import timing_repeats

    def repeats(*argv: str) -> int:
        return timing_repeats(build_parser("bench").parse_args(["bench", *argv]))

    assert repeats("--quick") == 1 and repeats("--quick", "--repeats", "5") == 5
    assert repeats() == 3 and repeats("--speed") == 3 and repeats("--quick", "--model", "x/y") == 3
