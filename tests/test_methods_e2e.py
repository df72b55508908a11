"""PACT, AdaptInfer, VisionZip, DivPrune and CDPruner through ``wrap()`` on a tiny LLaVA.

Prefill and a short greedy generate run; the per-stage token counts reported in
``last_stats`` match what each method promises. Exactness of removal is the engine's and the
adapters' business (their invariant tests); here the methods' budgets are checked end to end.
"""
from __future__ import annotations

import math

import pytest
import torch
from tiny_models import llava_inputs, tiny_llava

import vlm_prune
from vlm_prune.methods import PACT, AdaptInfer, CDPruner, DivPrune, VisionZip
from vlm_prune.methods.adaptinfer import auto_layers, derive_counts, final_counts

N_IMG = 16  # visual tokens per image of the tiny LLaVA


@pytest.fixture(scope="module")
def model():
    return tiny_llava()


def run(model, method, **kw) -> dict:
    inputs = llava_inputs()
    vlm_prune.wrap(model, method, **kw)
    try:
        with torch.no_grad():
            model(**inputs)
            stats = model.vlm_prune.last_stats
            out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    finally:
        vlm_prune.unwrap(model)
    return stats


@pytest.mark.parametrize("method, kw, expected", [
    (DivPrune(), {"keep": 0.25}, 4),
    (CDPruner(), {"budget": 5}, 5),
])
def test_vision_methods_keep_exactly_their_budget(model, method, kw, expected):
    stats = run(model, method, **kw)
    (stage,) = stats["stages"]
    assert stage["stage"] == "vision" and stage["tokens_out"] == [expected, expected]


def test_visionzip_keeps_its_budget(model):
    stats = run(model, VisionZip(), budget=8)
    assert stats["stages"][0]["tokens_out"] == [8, 8]


def test_pact_meets_the_target_and_runs_the_official_knobs_without_one(model):
    stats = run(model, PACT(layer=2), keep=0.5)
    (stage,) = stats["stages"]
    assert stage["stage"] == "llm" and stage["layer"] == 2
    assert stage["tokens_out"] == [8, 8] and stats["visual_tokens_out"] == [8, 8]
    # no target: family defaults (llava: rho 0.55): at most floor(0.55 * 16) = 8 rows remain
    stats = run(model, PACT(layer=2))
    assert all(1 <= n <= 8 for n in stats["stages"][0]["tokens_out"])
    # the official knobs given with a target: the target wins
    assert run(model, PACT(layer=2, rho=0.5, cutoff=0.6), keep=0.25)["visual_tokens_out"] == [4, 4]


def test_adaptinfer_stage_counts_end_at_the_target(model):
    stats = run(model, AdaptInfer(), keep=0.3)
    after = auto_layers(6)
    counts = final_counts(N_IMG, math.floor(0.3 * N_IMG), len(after))
    assert [s["layer"] for s in stats["stages"]] == [a + 1 for a in after]
    assert [s["tokens_out"] for s in stats["stages"]] == [[c, c] for c in counts]
    assert stats["visual_tokens_out"] == [4, 4]


def test_adaptinfer_average_follows_the_derived_schedule(model):
    stats = run(model, AdaptInfer(average=0.3))
    after = auto_layers(6)
    counts = derive_counts(N_IMG, 0.3 * N_IMG, after, 6, (0.25, 0.25))
    assert [s["tokens_out"] for s in stats["stages"]] == [[c, c] for c in counts]
