"""The eval harness end to end on a tiny LLaVA-OneVision checkpoint and real MP4s: results,
summaries, plot, resume after a kill, two ranks, and configuration errors."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from eval_tiny import save_tiny_checkpoint, write_image, write_video
from vlm_prune.eval import sharding
from vlm_prune.eval.runner import EvalConfig, run_eval

N = 4
ANSWERS = ["A", "B", "A", "A"]  # a model that always says "A" scores 3/4
CATS = ["x", "x", "y", "y"]  # "A" answers: x 1/2, y 2/2
HAS_OV_ADAPTER = importlib.util.find_spec("vlm_prune.adapters.llava_onevision") is not None


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run far faster on one thread than fighting over a busy machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_ov")))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa")
    with open(root / "qa.jsonl", "w") as f:
        for i in range(N):
            write_video(str(root / "clips" / f"v{i}.mp4"), n_frames=8 + i, seed=i)
            f.write(json.dumps({"id": f"q{i}", "video": f"clips/v{i}.mp4", "question": "what is the colour ?",
                                "options": ["red", "green", "blue"], "answer": ANSWERS[i], "category": CATS[i]}) + "\n")
    return str(root)


def cfg_for(ckpt: str, data: str, out: str, **kw) -> EvalConfig:
    base = dict(model=ckpt, data=data, dataset="jsonl", out=out, frames=4, max_new_tokens=3, decode_timeout=None)
    return EvalConfig(**{**base, **kw})


def load(ckpt: str):
    return AutoModelForImageTextToText.from_pretrained(ckpt).eval(), AutoProcessor.from_pretrained(ckpt)


def always_a(model, processor) -> None:
    """Make the LM head's argmax the token "A" (every answer reads "A ...")."""
    a = processor.tokenizer.convert_tokens_to_ids("A")

    def hook(module, inputs, out):
        out = out.clone()
        out[..., a] += 1e4
        return out

    model.lm_head.register_forward_hook(hook)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_sweep_accuracy_tokens_and_outputs(ckpt, data, tmp_path):
    model, processor = load(ckpt)
    always_a(model, processor)
    methods = ["none", "random"] if HAS_OV_ADAPTER else ["none"]
    rows = run_eval(cfg_for(ckpt, data, str(tmp_path), methods=methods, keeps=[0.5]), model, processor)
    assert [r["name"] for r in rows] == (["none", "random_keep0.5"] if HAS_OV_ADAPTER else ["none"])
    for row in rows:  # pruning cannot change a pinned answer: accuracy is exactly the share of "A"
        assert (row["n"], row["correct"], row["accuracy"]) == (N, 3, 0.75)
        assert row["by_category"]["category"] == {"x": {"n": 2, "accuracy": 0.5}, "y": {"n": 2, "accuracy": 1.0}}
        recs = read_jsonl(tmp_path / row["name"] / "results.jsonl")
        assert [r["id"] for r in recs] == [f"q{i}" for i in range(N)]
        assert all(r["output"].startswith("A") and r["pred"] == "A" for r in recs)
    none = rows[0]
    assert none["visual_tokens_in"] == none["visual_tokens_out"] == 4 * 9 + 1  # 4 frames x 3x3 pooled + newline
    assert none["flops_ratio"] == 1.0 and none["ttft_s"] > 0 and none["generate_s"] >= none["ttft_s"]
    if HAS_OV_ADAPTER:
        half = rows[1]
        assert half["visual_tokens_out"] < half["visual_tokens_in"] and half["flops_ratio"] < 1.0
        assert not hasattr(model, "vlm_prune")  # unwrapped after each setting
    table = open(tmp_path / "summary.md").read()
    assert table.count("\n| ") == len(rows) + 1
    assert "- none: category=x: 0.500 (n=2); category=y: 1.000 (n=2)" in table
    assert json.load(open(tmp_path / "summary.json"))[0]["name"] == "none"
    assert os.path.getsize(tmp_path / "sweep.png") > 5000


def test_image_questions(ckpt, tmp_path):
    write_image(str(tmp_path / "img" / "a.png"))
    with open(tmp_path / "vqa.jsonl", "w") as f:
        f.write(json.dumps({"image": "img/a.png", "question": "what colour ?", "answer": "A"}) + "\n")
        f.write(json.dumps({"image": "img/a.png", "question": "which ?", "options": ["x", "y"], "answer": "B"}) + "\n")
    model, processor = load(ckpt)
    always_a(model, processor)
    rows = run_eval(cfg_for(ckpt, str(tmp_path / "vqa.jsonl"), str(tmp_path / "out"), dataset="image",
                            max_new_tokens=1), model, processor)
    recs = read_jsonl(tmp_path / "out" / "none" / "results.jsonl")
    assert [(r["pred"], r["correct"]) for r in recs] == [("a", True), ("A", False)]  # "a" is no article here
    assert rows[0]["visual_tokens_in"] > 0


def _cli(ckpt: str, data: str, out: str) -> list[str]:
    return [sys.executable, "-m", "vlm_prune.eval", "--model", ckpt, "--data", data, "--dataset", "jsonl",
            "--frames", "4", "--max-new-tokens", "3", "--out", out]


def test_resume_after_kill_gives_the_same_totals(ckpt, data, tmp_path):
    out = str(tmp_path / "killed")
    rank_file = os.path.join(out, "none", "samples.rank0.jsonl")
    proc = subprocess.Popen(_cli(ckpt, data, out), env={**os.environ, **ONE_THREAD_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(rank_file) and open(rank_file).read().count("\n") >= 1:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    lines = open(rank_file).read().count("\n")
    assert 1 <= lines < N, "the run should have been killed midway"
    with open(rank_file, "a") as f:
        f.write('{"id": "q9", "correct": tr')  # a torn last line, as a kill during a write leaves it
    resumed = run_eval(cfg_for(ckpt, data, out))
    fresh = run_eval(cfg_for(ckpt, data, str(tmp_path / "fresh")))
    keys = ("n", "correct", "accuracy", "unanswered", "by_category", "visual_tokens_out")
    assert {k: resumed[0][k] for k in keys} == {k: fresh[0][k] for k in keys}
    got = read_jsonl(os.path.join(out, "none", "results.jsonl"))
    want = read_jsonl(str(tmp_path / "fresh" / "none" / "results.jsonl"))
    assert [(r["id"], r["output"]) for r in got] == [(r["id"], r["output"]) for r in want]
    assert len(read_jsonl(rank_file)) == N  # torn line cut, nothing written twice


def test_two_ranks_cover_every_sample_once(ckpt, data, tmp_path, monkeypatch):
    out = str(tmp_path / "ranks")
    env = {**os.environ, **ONE_THREAD_ENV, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    other = subprocess.Popen(_cli(ckpt, data, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        rows = run_eval(cfg_for(ckpt, data, out))  # rank 0 waits for rank 1, then merges
    finally:
        _, err = other.communicate(timeout=300)
    assert other.returncode == 0, err.decode()[-2000:]
    ids = lambda p: [r["id"] for r in read_jsonl(os.path.join(out, "none", p))]
    assert ids("samples.rank0.jsonl") == ["q0", "q2"]
    assert ids("samples.rank1.jsonl") == ["q1", "q3"]
    assert ids("results.jsonl") == [f"q{i}" for i in range(N)]
    assert rows[0]["n"] == N


def test_sharding_resume_reads_all_rank_files(tmp_path):
    d0, d1 = sharding.Dist(0, 2, 0), sharding.Dist(1, 2, 1)
    assert sharding.shard(list("abcde"), d0) == ["a", "c", "e"] and sharding.shard(list("abcde"), d1) == ["b", "d"]
    with sharding.RankWriter(str(tmp_path), d0) as w:
        w.write({"id": "a", "correct": True})
    with sharding.RankWriter(str(tmp_path), d1) as w:
        w.write({"id": "b", "correct": False})
        w.write({"id": "a", "correct": False})  # a duplicate id: the first record wins
    assert {k: v["correct"] for k, v in sharding.read_records(str(tmp_path)).items()} == {"a": True, "b": False}


def test_configuration_errors(ckpt, data, tmp_path):
    with pytest.raises(ValueError, match=r"method 'random' needs --keep"):
        run_eval(cfg_for(ckpt, data, str(tmp_path), methods=["random"]))
    os.makedirs(tmp_path / "none")
    with open(tmp_path / "none" / "run_config.json", "w") as f:
        json.dump({"model": "other"}, f)
    with pytest.raises(ValueError, match="holds results of a different configuration"):
        run_eval(cfg_for(ckpt, data, str(tmp_path), limit=1), *load(ckpt))


def test_cli_rejects_bad_keep(capsys):
    from vlm_prune.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--model", "m", "--data", "d", "--dataset", "jsonl", "--out", "o", "--keep", "0.5,1.5"])
    assert "keep fractions must lie in (0, 1], got [1.5]" in capsys.readouterr().err
