"""vlm-prune bench (quick, in process) and bench --speed on a tiny scale."""
from __future__ import annotations

import json

import pytest
import torch
from vlm_prune.adapters.llava import LlavaAdapter
from vlm_prune.adapters.llava_onevision import LlavaOnevisionAdapter
from vlm_prune.eval.bench import fit_layer
from vlm_prune.eval.speed import LLAMA_7B, QWEN2_7B, scaled

import vlm_prune
from vlm_prune.cli import main
from vlm_prune.registry import method_class

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def applicable(stages: set[str], family: str) -> set[str]:
    out = set()
    for name in vlm_prune.available_methods():
        cls = method_class(name)
        if cls.stage in stages and (cls.supported is None or family in cls.supported):
            out.add(name)
            if cls.stage == "frames":
                out.add(f"{name}+pact")
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "--quick", "--limit", "4", "--batch-size", "4", "--keep", "0.25", "--repeats", "1", "--out", str(out)]
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
    assert "| synthetic-video | quota+pact | 0.25 |" in table and "asvit - vit-stage method" in table
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_quick_bench_numbers_are_consistent(quick):
    _, result = quick
    rows = result["rows"]
    base = {r["model"]: r for r in rows if r["method"] == "none"}
    assert base["synthetic-image"]["visual_tokens_in"] == 64  # 64x64 image, patch 8
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["n"] == 4
        assert r["retention"] == pytest.approx(r["accuracy"] / base[r["model"]]["accuracy"])
        assert r["prefill_ratio"] > 0 and r["prefill_cpu_ratio"] > 0
        if r["method"] in ("random", "pool", "divprune", "cdpruner", "visionzip") and r["model"] == "synthetic-image":
            assert r["visual_tokens_out"] == 16 and r["kept_fraction"] == 0.25  # floor(0.25 * 64)
            assert r["flops_ratio"] < 1.0
        if r["method"] == "uniform":
            assert r["visual_tokens_out"] == 4 * 4 + 1  # 4 of 16 frames x 2x2 tokens + the newline


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
    assert video["visual_tokens_in"] == 197  # 14x14 pooled tokens + the newline
    assert tome["ideal_ratio"] < 1 and tome["visual_tokens_out"] < 576  # ToMe is timed (inside CLIP)
    assert identity["ideal_ratio"] == 1.0 and identity["efficiency"] is None
    for r in rows:
        assert 0 < r["ideal_ratio"] <= 1 and r["overhead"] == pytest.approx(r["measured_ratio"] / r["ideal_ratio"])
        assert r["ratio_min"] <= r["measured_ratio"] <= r["ratio_max"] and r["timer"] == "process CPU time"
        if r["ideal_ratio"] < 1:
            assert r["efficiency"] == pytest.approx((1 / r["measured_ratio"] - 1) / (1 / r["ideal_ratio"] - 1))
    assert image["measured_ratio"] < 1.0  # process CPU time: stable on a shared machine, unlike wall-clock
    assert [s["method"] for s in out["skipped"]] == ["tome"]  # OneVision's SigLIP path has no ViT stage
    assert (tmp_path / "speed.md").read_text().count("| random | 0.05 |") == 2


def test_speed_unknown_method_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="tomme"):
        main(["bench", "--speed", "--methods", "tomme", "--shapes", "image", "--out", str(tmp_path)])


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
