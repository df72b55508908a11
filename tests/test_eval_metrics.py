"""Analytic prefill FLOPs, rows per layer from last_stats, run summaries, sweep table and plot."""
from __future__ import annotations

import json
import math
import os

import pytest
from transformers import LlavaOnevisionConfig, Qwen2Config

from vlm_prune.eval import metrics, plots


def qwen(layers=2):
    return Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1)


def test_layer_flops_by_hand():
    # H=8, Hq=8, Hkv=4 (head_dim 4), I=16, T=3:
    # projections 2*3*8*(16+8)=1152, attention 2*2*8*(3*4/2)=192, MLP 2*3*3*8*16=2304
    assert metrics.layer_flops(qwen(), 3) == 1152 + 192 + 2304
    # the VLM config resolves to its text config; LM head 2*8*10 on the last position
    vlm = LlavaOnevisionConfig(text_config=qwen().to_dict())
    assert metrics.prefill_flops(vlm, [3, 2]) == metrics.layer_flops(qwen(), 3) + metrics.layer_flops(qwen(), 2) + 160


def test_rows_per_layer_from_stats():
    assert metrics.rows_per_layer(4, 50, None) == [50] * 4
    stats = {"stages": [
        {"stage": "vision", "tokens_in": [36], "tokens_out": [16]},
        {"stage": "llm", "layer": 2, "tokens_in": [16], "tokens_out": [6]},
    ]}
    assert metrics.rows_per_layer(4, 50, stats) == [30, 30, 20, 20]


def test_summarize():
    recs = [
        {"id": "a", "categories": {"duration": "short"}, "correct": True, "pred": "A", "visual_tokens_in": 10,
         "visual_tokens_out": 5, "ttft_s": 1.0, "prefill_flops": 50.0, "prefill_flops_unpruned": 100.0, "peak_memory_bytes": 7},
        {"id": "b", "categories": {"duration": "long"}, "correct": False, "pred": None, "visual_tokens_in": 10,
         "visual_tokens_out": 5, "ttft_s": 3.0, "prefill_flops": 50.0, "prefill_flops_unpruned": 100.0, "peak_memory_bytes": 9},
        {"id": "c", "categories": {"duration": "long"}, "correct": True, "pred": "B", "error": None},
        {"id": "d", "status": "failed", "categories": {"duration": "long"}, "correct": False,
         "error": "OutOfMemoryError: CUDA out of memory"},
        {"id": "e", "status": "skipped", "categories": {"duration": "long"}, "correct": False, "reason": "missing /x.mp4"},
        {"id": "f", "categories": {"duration": "long"}, "correct": False, "error": "VideoDecodeError: bad"},  # old format
    ]
    s = metrics.summarize(recs)
    assert (s["n"], s["evaluated"], s["skipped"], s["failed"], s["correct"], s["unanswered"]) == (6, 3, 1, 2, 2, 1)
    assert s["not_evaluated"] == {"skipped": {"missing media": 1}, "failed": {"OutOfMemoryError": 1, "VideoDecodeError": 1}}
    assert math.isclose(s["accuracy"], 2 / 3) and (s["official_name"], s["official"]) == ("accuracy", s["accuracy"])
    assert metrics.counts_line(s) == ("evaluated 3 of 6 (skipped 1: missing media 1; "
                                      "failed 2: OutOfMemoryError 1, VideoDecodeError 1)")
    assert s["by_category"] == {"duration": {"long": {"n": 2, "accuracy": 0.5}, "short": {"n": 1, "accuracy": 1.0}}}
    assert (s["kept_fraction"], s["ttft_s"], s["flops_ratio"], s["peak_memory_bytes"]) == (0.5, 2.0, 0.5, 9)


def test_lenient_scores_are_means_over_tasks_where_the_leaderboard_says_so():
    # task a: 3 of 4 right, task b: 0 of 1 -> overall 3/5 = 0.6, mean over tasks (0.75 + 0) / 2 = 0.375
    recs = [{"id": str(i), "categories": {"task": t}, "correct": c, "pred": "A" if c else "B",
             "leaderboard_pred": "A" if c else None, "leaderboard_correct": c}
            for i, (t, c) in enumerate([("a", True), ("a", True), ("a", True), ("a", False), ("b", False)])]
    recs.append({"id": "x", "status": "failed", "categories": {"task": "c"}, "correct": False, "error": "E: e"})
    s = metrics.summarize(recs, "mvbench")
    assert math.isclose(s["accuracy"], 0.6) and math.isclose(s["lenient"], 0.375)  # failed task c not a task
    assert math.isclose(s["official"], 0.375) and s["read_differently"] == 2  # B against none, twice
    with pytest.raises(ValueError, match="not among lmms-eval's"):  # MLVU's task types are fixed
        metrics.summarize(recs, "mlvu")
    for r in recs:
        r["categories"]["task"] = {"a": "count", "b": "ego", "c": "order"}[r["categories"]["task"]]
    s = metrics.summarize(recs, "mlvu")  # lmms-eval divides by its 7 task types, the harness by those present
    assert math.isclose(s["official"], 0.75 / 7) and math.isclose(s["lenient"], 0.375)
    s = metrics.summarize(recs, "videomme")
    assert (s["official_name"], s["lenient_name"]) == ("lmms-eval accuracy", "harness accuracy")
    assert math.isclose(s["official"], 0.6) and math.isclose(s["lenient"], 0.6)
    assert math.isnan(metrics.summarize(recs[-1:], "mlvu")["official"])


def test_sweep_outputs(tmp_path):
    rows = [
        {"name": "none", "method": "none", "keep": None, "n": 4, "accuracy": 0.75, "kept_fraction": 1.0,
         "ttft_s": 2.0, "prefill_flops": 100.0},
        {"name": "random_keep0.5", "method": "random", "keep": 0.5, "n": 4, "accuracy": 0.5, "kept_fraction": 0.5,
         "ttft_s": 1.0, "prefill_flops": 40.0},
        {"name": "pact_keep1", "method": "pact", "keep": 1.0, "n": 4, "accuracy": 0.75, "kept_fraction": 1.0,
         "ttft_s": None, "prefill_flops": 100.0},
    ]
    paths = plots.write_sweep(rows, str(tmp_path), "tiny")
    saved = json.load(open(paths["json"]))
    assert [(r["ttft_speedup"], r["flops_speedup"]) for r in saved] == [(1.0, 1.0), (2.0, 2.5), (None, 1.0)]
    md = open(paths["markdown"]).read()
    assert "| random_keep0.5 | - | - | - | 0.500 | - | - | - | 0.500 |" in md and "2.00x | 2.50x" in md
    with open(paths["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(paths["plot"]) > 5000


def test_sweep_figure_short_title_and_a_speed_panel_that_says_why_it_is_empty():
    assert plots.short_name("llava-hf/llava-1.5-7b-hf") == "llava-1.5-7b-hf"
    assert plots.short_name("/home/me/checkpoints/llava-ov/") == "llava-ov"
    one = [{"name": "random_keep0.5", "method": "random", "keep": 0.5, "n": 4, "accuracy": 0.5, "kept_fraction": 0.5,
            "ttft_s": 1.0, "prefill_flops": 40.0}]
    fig = plots.sweep_figure(plots.add_speedups(one), "llava-ov on mlvu")
    speed = fig.axes[2]
    assert [t.get_text() for t in speed.texts] == [plots.NO_SPEEDUP] and "add none to --method" in plots.NO_SPEEDUP
    assert fig._suptitle.get_text() == "llava-ov on mlvu"
    with_ref = [{"name": "none", "method": "none", "keep": None, "n": 4, "accuracy": 0.75, "kept_fraction": 1.0,
                 "ttft_s": 2.0, "prefill_flops": 100.0}] + one
    fig = plots.sweep_figure(plots.add_speedups(with_ref), "t")
    assert len(fig.axes[2].texts) == 0 and len(fig.axes[2].lines) == 3  # TTFT and ideal speed-up of random, the 1x line
