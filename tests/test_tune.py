"""``vlm-prune tune`` and the one config file: the config round-trips through wrap / eval / serve,
the search finds the exhaustive grid's front on a small space, a killed run resumes to the same
result, the recommendation holds on a held-out split, and bad goals are one-line usage errors."""
from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest
import torch

import vlm_prune
from test_cli import assert_usage_error, run_cli
from vlm_prune.config import ConfigError, PruneConfig, load_config, save_config
from vlm_prune.eval import synthetic
from vlm_prune.eval.tune import (Goal, Point, SyntheticBackend, TuneError, contenders, pareto, point, rung_sizes, sign_test,
                                 tune)
from vlm_prune.methods import FastV

#: the small space of the search-vs-grid test: three vision methods at two keeps, 48 samples in rungs of 16
SPACE = dict(methods=["random", "pool", "divprune"], keeps=(0.5, 0.11), samples=48, quick=True)


@pytest.fixture(scope="module")
def toy():
    return synthetic.load("image", 0)


@pytest.fixture(scope="module")
def searched(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("search"))
    return out, tune(out, "image", min_retention=0.8, loaded=toy, **SPACE)


# ---- the config file -----------------------------------------------------------------------------------
def test_config_round_trips_through_wrap(toy, tmp_path):
    model, processor = toy
    cfg = load_config({"methods": [{"method": "fastv", "layer": 1}], "keep": 0.25, "seed": 3})
    path = save_config(cfg, tmp_path / "c.json", about={"note": "free"})
    assert load_config(path) == cfg and json.load(open(path))["about"] == {"note": "free"}
    samples = synthetic.make_dataset("image", "test", 4)
    inputs = synthetic.encode(processor, samples)
    with torch.no_grad():
        vlm_prune.wrap(model, FastV(layer=1), keep=0.25, seed=3)
        want = model(**inputs).logits
        flops_want = model.vlm_prune.last_stats["visual_tokens_out"]
        vlm_prune.unwrap(model)
        vlm_prune.wrap(model, config=path)
        got = model(**inputs).logits
        assert model.vlm_prune.pipeline[0].layer == 1 and model.vlm_prune.seed == 3
        assert model.vlm_prune.last_stats["visual_tokens_out"] == flops_want
        vlm_prune.unwrap(model)
        vlm_prune.wrap(model, FastV(layer=2), keep=0.25)
        other = model(**inputs).logits
        vlm_prune.unwrap(model)
    assert torch.equal(got, want) and not torch.equal(got, other)  # the knob travelled
    with pytest.raises(ValueError, match="drop keep"):
        vlm_prune.wrap(model, config=path, keep=0.5)


@pytest.mark.parametrize("raw, needle", [
    ({"methods": [{"method": "fastv", "layr": 1}], "keep": 0.5}, "fastv has no knob layr"),
    ({"methods": [{"method": "fastvv"}], "keep": 0.5}, "unknown method 'fastvv'"),
    ({"methods": ["random"], "keep": 0.5, "budget": 4}, "not both"),
    ({"methods": ["random"], "keep": 1.5}, "keep must be a fraction"),
    ({"methods": ["random", "pool"], "keep": 0.5}, "both act in the 'vision' stage"),
    ({"methods": ["random"], "keep": 0.5, "extra": 1}, "unknown key(s) extra"),
    ({"methods": [], "keep": 0.5}, "non-empty list"),
    ({"format": "vlm-prune-config/9", "methods": ["random"], "keep": 0.5}, "vlm-prune-config/1"),
])
def test_config_errors_name_the_field(raw, needle):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert needle in str(err.value)


def test_tune_on_a_dataset_then_eval_and_serve_take_its_config(toy, tmp_path, capsys):
    """tune on a harness layout writes a config; eval --config answers as tune did and as wrap()
    with that config; serve --config gives the same vLLM command as --method / --keep."""
    from eval_tiny import write_image
    from PIL import Image
    from vlm_prune.eval.answers import format_prompt
    from vlm_prune.eval.datasets import read_samples
    from vlm_prune.eval.runner import Predictor

    model, processor = toy
    with open(tmp_path / "qa.jsonl", "w") as f:
        for i in range(2):
            write_image(str(tmp_path / "data" / f"{i}.png"), seed=i)
            f.write(json.dumps({"id": f"q{i}", "image": f"data/{i}.png", "question": "which colour ?",
                                "options": ["red", "blue"], "answer": "A"}) + "\n")
    ckpt = str(synthetic.model_path("image"))
    data = ["--data", str(tmp_path), "--dataset", "image", "--max-new-tokens", "2"]
    rc, out, err = run_cli(["tune", "--model", ckpt, *data, "--methods", "fastv", "--keeps", "0.25",
                            "--max-flops", "0.99", "--out", str(tmp_path / "tune")], capsys)
    assert rc == 0, err
    cfg = str(tmp_path / "tune" / "recommended.json")
    assert f"config: {cfg}" in out and "recommended: fastv-layer" in out
    label = load_config(cfg).label()
    rc, out, err = run_cli(["eval", "--model", ckpt, *data, "--config", cfg, "--out", str(tmp_path / "run")], capsys)
    assert rc == 0, err
    recs = {r["id"]: r for r in map(json.loads, open(tmp_path / "run" / label / "results.jsonl"))}
    tuned = {r["id"]: r for r in map(json.loads, open(tmp_path / "tune" / "runs" / label / "samples.rank0.jsonl"))}
    predictor = Predictor(model, processor, 2)
    for sample in read_samples("image", str(tmp_path)):
        vlm_prune.wrap(model, config=cfg)
        try:
            gen = predictor.generate(format_prompt(sample), [Image.open(sample.media[0]).convert("RGB")], "image")
        finally:
            vlm_prune.unwrap(model)
        assert (recs[sample.id]["output"], recs[sample.id]["prefill_flops"]) == (gen.text, gen.prefill_flops)
        assert (tuned[sample.id]["correct"], tuned[sample.id]["flops"]) == (recs[sample.id]["correct"], gen.prefill_flops)
    serve_cfg = save_config(load_config({"methods": [{"method": "divprune"}], "keep": 0.25, "seed": 2}), tmp_path / "s.json")
    rc, by_config, err = run_cli(["serve", ckpt, "--config", serve_cfg, "--dry-run"], capsys)
    assert rc == 0, err
    rc, by_flags, _ = run_cli(["serve", ckpt, "--method", "divprune", "--keep", "0.25", "--seed", "2", "--dry-run"], capsys)
    assert by_config == by_flags and '"method": "divprune"' in by_config
    assert_usage_error(["serve", ckpt, "--config", cfg], capsys, "inside the language model")
    assert_usage_error(["serve", ckpt, "--config", serve_cfg, "--keep", "0.5"], capsys, "--config holds")


# ---- the search -----------------------------------------------------------------------------------------
def pt(label: str, acc: list[int], flops: float) -> Point:
    return Point(label, None, [str(i) for i in range(len(acc))], np.asarray(acc, float), 0, flops, None)


def test_front_and_the_race_drops_only_what_the_answers_rule_out():
    a, b, c, d = pt("a", [1, 1, 1, 0], 0.5), pt("b", [1, 1, 0, 0], 0.3), pt("c", [1, 0, 0, 0], 0.6), pt("d", [1, 1, 0, 0], 0.3)
    assert [p.label for p in pareto([a, b, c, d], "flops")] == ["b", "d", "a"]  # c: a is better and cheaper
    # the exact sign test: 5 wins, no loss on 5 differing samples: p = 1/32; 4 of 4: 1/16
    assert sign_test(np.ones(5), np.zeros(5)) == 1 / 32 and sign_test(np.ones(4), np.zeros(4)) == 1 / 16
    assert sign_test(np.zeros(5), np.ones(5)) == 1.0
    base = pt("none", [1] * 16, 1.0)
    best, worse, worse4 = pt("best", [1] * 16, 0.5), pt("worse", [1] * 11 + [0] * 5, 0.5), pt("w4", [1] * 12 + [0] * 4, 0.5)
    cheap = pt("cheap", [1] * 11 + [0] * 5, 0.2)
    # worse loses to best (p = 1/32 < 0.05) at the same cost; w4 (p = 1/16) and the cheaper one go on
    assert [p.label for p in contenders([best, worse, worse4, cheap], base, "flops", None)] == ["best", "w4", "cheap"]
    # with a floor of 0.6: cheap (retention 11/16, interval around it) does not meet it, best does;
    # a costlier setting that best would beat anyway, and one past best's cost, are dropped
    costly = pt("costly", [1] * 16, 0.9)
    assert [p.label for p in contenders([best, cheap, costly], base, "flops", 0.6)] == ["best", "cheap"]
    # below the floor and dominated on these samples (no significance needed): dropped
    low, lower = pt("low", [1] * 4 + [0] * 12, 0.2), pt("lower", [1] * 3 + [0] * 13, 0.2)
    assert [p.label for p in contenders([low, lower], base, "flops", 0.9)] == ["low"]
    assert [p.label for p in contenders([low, lower], base, "flops", None)] == ["low", "lower"]  # 1 sample apart
    assert rung_sizes(48, 16) == [16, 32, 48] and rung_sizes(50, 16) == [16, 32, 48, 50] and rung_sizes(10, 16) == [10]


class RaceBackend:
    """Answers without a model: setting i is right on sample j when the sample's difficulty plus
    the setting's own noise is under its accuracy, so settings agree on most samples (as pruned
    and unpruned models do) and differ by their accuracies; costs by keep."""

    FLOPS = {0.11: 0.24, 0.25: 0.36, 0.5: 0.57}

    def __init__(self, accuracy: dict[str, float], n: int) -> None:
        rng = np.random.default_rng(0)
        self.ids = [str(i) for i in range(n)]
        self.difficulty = rng.random(n)
        self.noise = {label: rng.normal(0, 0.1, n) for label in accuracy}
        self.accuracy = accuracy

    def group(self, sample_id: str) -> str:
        return sample_id

    def run(self, cfg, ids):
        label = "none" if cfg is None else cfg.label()
        flops = 1.0 if cfg is None else self.FLOPS[cfg.keep]
        for i in ids:
            j = int(i)
            noise = 0.0 if cfg is None else self.noise[label][j]
            yield {"id": i, "status": "ok", "correct": bool(self.difficulty[j] + noise < self.accuracy[label]),
                   "flops": flops, "flops_full": 1.0}


def test_the_race_answers_a_third_of_the_grid_where_settings_separate(tmp_path):
    """24 settings (8 methods x 3 keeps) 0.05 apart in accuracy at each keep, 192 samples: the race
    finds the grid's recommendation and its front up to it with at most a third of its answers."""
    from vlm_prune.eval.tune import Searcher, recommend, row

    methods = ["random", "pool", "divprune", "cdpruner", "visionzip", "fastv", "pact", "dart"]
    level = {0.11: 0.55, 0.25: 0.66, 0.5: 0.74}
    cands = [PruneConfig(((m, ()),), keep=k) for k in level for m in methods]
    accuracy = {"none": 0.78, **{c.label(): level[c.keep] - 0.05 * methods.index(c.methods[0][0]) for c in cands}}
    backend = RaceBackend(accuracy, 192)
    picks = []
    for name, sizes in (("race", rung_sizes(192, 16)), ("grid", [192])):
        searcher = Searcher(backend, cands, str(tmp_path / name), floor=0.9)
        last, base, _ = searcher.search(sizes)
        front = [row(p, base, "flops") for p in pareto(last, "flops")]
        picks.append(([e["setting"] for e in front], recommend(front, Goal(min_retention=0.9))[0]["setting"],
                      sum(len(r) for r in searcher.records.values())))
    (race_front, race_pick, race_calls), (grid_front, grid_pick, grid_calls) = picks
    assert grid_calls == 25 * 192 and race_calls <= grid_calls / 3
    assert race_pick == grid_pick and set(race_front) <= set(grid_front)
    # the front up to the recommendation is the grid's (the race gives up the costlier part)
    assert race_front == grid_front[:grid_front.index(grid_pick) + 1]


def fronts(result) -> list[tuple[str, float]]:
    return [(e["setting"], round(e["accuracy"], 9)) for e in result.front]


def chosen(result) -> dict:
    """The recommendation without its prefill time ratio (measured anew by each run)."""
    return {k: v for k, v in result.recommended.items() if k != "time_ratio"}


def test_search_finds_the_grid_front_for_less(searched, toy, tmp_path):
    out, result = searched
    grid = tune(str(tmp_path), "image", min_retention=0.8, loaded=toy, grid=True, **SPACE)
    assert fronts(result) == fronts(grid) and result.front
    assert chosen(result) == chosen(grid)
    assert result.cost["calls"] < grid.cost["calls"] == grid.cost["grid_calls"]
    assert result.candidates == 6  # 3 methods x 2 keeps
    assert [r["samples"] for r in result.rungs] == [16, 32, 48] and result.rungs[0]["settings"] == 6
    assert all(r["settings"] == prev["kept"] for prev, r in zip(result.rungs, result.rungs[1:]))
    assert result.rungs[-2]["kept"] < 6
    # the front is measured on every tuning sample, with the paired interval around the retention
    for e in result.front:
        assert e["n"] == 48 and e["retention_lower"] <= e["retention"] <= e["retention_upper"]
    for name in ("tune.json", "front.md", "front.png", "recommended.json"):
        assert os.path.exists(os.path.join(out, name))


def test_recommendation_meets_the_goal_on_a_held_out_split(searched, toy):
    _, result = searched
    assert result.recommended is not None and result.recommended["retention_lower"] >= 0.8
    model, processor = toy
    held_out = synthetic.make_dataset("image", "test", 64, qtypes=synthetic.trained_qtypes("image", 0))
    backend = SyntheticBackend(model, processor, held_out)
    cfg = load_config(result.config_path)
    pruned = [r["correct"] for r in backend.run(cfg, backend.ids)]
    full = [r["correct"] for r in backend.run(None, backend.ids)]
    assert np.mean(pruned) / np.mean(full) >= 0.8


def test_resume_after_a_kill_gives_the_same_result(searched, toy, tmp_path):
    """What a kill leaves: each setting's answers cut after the first rung, half a line torn off."""
    out, result = searched
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    os.remove(tmp_path / "tune.json")
    cut = 0
    for path in glob.glob(str(tmp_path / "runs" / "*" / "samples.rank0.jsonl")):
        lines = open(path).readlines()
        if len(lines) <= 16:  # a setting the first rung dropped
            continue
        cut += 1
        with open(path, "w") as f:
            f.writelines(lines[:16])
            f.write(lines[16][:20])
    assert cut >= 2  # the unpruned answers and at least one setting
    again = tune(str(tmp_path), "image", min_retention=0.8, loaded=toy, **SPACE)
    assert fronts(again) == fronts(result) and chosen(again) == chosen(result)
    assert again.cost["calls"] == result.cost["calls"] and 0 < again.cost["calls_this_run"] < result.cost["calls"]


def test_nothing_meets_an_impossible_goal(searched, toy):
    out, _ = searched  # the cached answers: no model call
    result = tune(out, "image", min_retention=0.8, max_flops=0.01, loaded=toy, **SPACE)
    assert result.recommended is None and result.config_path is None and result.closest
    assert result.cost["calls_this_run"] == 0


def test_bad_goals_are_one_line_errors(capsys, tmp_path):
    out = ["--out", str(tmp_path / "t")]
    assert_usage_error(["tune", "--min-retention", "1.5", *out], capsys, "--min-retention must lie in (0, 1]")
    assert_usage_error(["tune", "--max-flops", "2", *out], capsys, "--max-flops must lie in (0, 1]")
    assert_usage_error(["tune", "--methods", "quota", "--quick", *out], capsys, "no method applies to this llava model")
    assert_usage_error(["tune", "--methods", "fastvv", *out], capsys, "unknown method 'fastvv'")
    with pytest.raises(TuneError, match="--keeps"):
        tune(str(tmp_path), keeps=(0.0,))
    assert PruneConfig((("random", ()),), keep=0.5).label() == "random_keep0.5"


def test_results_section_from_the_benchmark_files(tmp_path):
    from vlm_prune.eval.tune_bench import render_tune_results

    run = {"front": [], "recommended": "pool_keep0.25", "calls": 100, "cpu_s": 10.0, "rungs": [], "candidates": 12,
           "goal": "retention >= 0.95", "baseline_accuracy": 0.7, "compositions": []}
    comp = {"keep": 0.25, "composition": "uniform+pool", "single": "pool", "n": 48, "diff": 0.02, "ci": 0.05,
            "verdict": "is not shown different from"}
    paths = []
    for name, seed, found, other in (("tune-image.json", None, 3, "pool_keep0.25"), ("tune-image-seed7.json", 7, 2, "x")):
        result = {"kind": "image", "data_seed": seed, "search": run,
                  "grid": {**run, "calls": 400, "cpu_s": 40.0, "recommended": other, "compositions": [comp]},
                  "grid_front_found": found, "grid_front_size": 4, "same_recommendation": other == "pool_keep0.25",
                  "calls_fraction": 0.25, "cpu_fraction": 0.25}
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps({"meta": {"mode": "tune", "command": f"python -m vlm_prune.eval.tune_bench {seed}",
                                                  "code": "x", "machine": "m", "date": "d"}, "result": result}))
    text = render_tune_results([str(p) for p in paths])  # sorted by name: the seed-7 file first
    assert "| synthetic-image | published | 12 | 3 of 4 | yes (pool_keep0.25) | 0.25 (100 / 400) | 0.25 |" in text
    assert "| synthetic-image | 7 | 12 | 2 of 4 | no (pool_keep0.25 / x) | 0.25 (100 / 400) | 0.25 |" in text
    assert text.count("uniform+pool is not shown different from pool") == 1  # the published set's grid only
    assert "goal: retention >= 0.95." in text and text.index("| published |") < text.index("| 7 |")


RANK_RUN = """
import json, sys
import vlm_prune
result = vlm_prune.tune(sys.argv[1], "image", min_retention=0.8, **json.loads(sys.argv[2]))
if result is not None:  # rank 0
    print(json.dumps([[e["setting"], round(e["accuracy"], 9)] for e in result.front]))
"""


def test_two_ranks_share_the_work_and_find_the_same_front(searched, tmp_path):
    """Two ranks (WORLD_SIZE=2, as torchrun sets it) split every setting's samples, each answered
    once, and rank 0 reports the front one process finds."""
    import subprocess
    import sys

    space = json.dumps({**SPACE, "keeps": list(SPACE["keeps"])})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    logs = [(open(tmp_path / f"rank{r}.out", "w+"), open(tmp_path / f"rank{r}.err", "w+")) for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_RUN, str(tmp_path), space], env={**env, "RANK": str(r)},
                              stdout=out, stderr=err, text=True) for r, (out, err) in enumerate(logs)]
    for p in ranks:  # files, not pipes: a rank blocked on a full pipe would stall the other at its sync
        p.wait(timeout=600)
    assert all(p.returncode == 0 for p in ranks), [(tmp_path / f"rank{r}.err").read_text()[-2000:] for r in range(2)]
    _, result = searched
    front = (tmp_path / "rank0.out").read_text().strip().splitlines()[-1]
    assert [tuple(e) for e in json.loads(front)] == fronts(result)
    for run in glob.glob(str(tmp_path / "runs" / "*")):
        ids = [[json.loads(line)["id"] for line in open(os.path.join(run, f"samples.rank{r}.jsonl"))] for r in range(2)]
        assert ids[0] and ids[1] and not set(ids[0]) & set(ids[1]), run  # both worked, no sample twice
