"""The eval harness end to end on a tiny LLaVA-OneVision checkpoint and real MP4s: results,
summaries, plot, resume after a kill, two ranks, and configuration errors."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from eval_tiny import save_tiny_checkpoint, write_image, write_video
from vlm_prune.eval import sharding
from vlm_prune.eval.runner import EvalConfig, EvalConfigError, run_eval

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
    # the title names the model by its folder's name, not the absolute path of this machine
    assert table.startswith(f"# {os.path.basename(os.path.normpath(str(ckpt)))} on ") and str(ckpt) not in table
    assert "- none: category=x: 0.500 (n=2); category=y: 1.000 (n=2)" in table
    assert json.load(open(tmp_path / "summary.json"))[0]["name"] == "none"
    assert os.path.getsize(tmp_path / "sweep.png") > 5000


#: the video methods of issue 31 (those registered when the test runs; PruneVid and FrameFusion may land later)
VIDEO_RECORDS = ("vidcom2", "fastvid", "holitom", "dycoke", "prunevid", "framefusion")


@pytest.mark.skipif(not HAS_OV_ADAPTER, reason="needs the LLaVA-OneVision adapter")
def test_sweep_runs_the_video_records(ckpt, data, tmp_path):
    """`vlm-prune eval` sweeps take every registered video method of issue 31 by name, alone and
    composed with a vision-stage method, and each prunes the video (answers pinned to "A": 3 of 4)."""
    import vlm_prune
    from vlm_prune.registry import method_class

    methods = [m for m in VIDEO_RECORDS if m in vlm_prune.available_methods()]
    assert {"vidcom2", "fastvid", "holitom", "dycoke"} <= set(methods)
    model, processor = load(ckpt)
    always_a(model, processor)
    # a default pruning layer beyond the tiny model's 2 decoder layers (PruneVid's layer=11, HoliTom's inner
    # merge at 18) stops the sweep before any question, with the method's own message (wrap() refuses it)
    deep = [m for m in methods if m in ("prunevid", "holitom") and method_class(m)().layer >= 2]
    for name in deep:
        with pytest.raises(EvalConfigError, match=rf"--method {name}: {name} layer=\d+ but the model has only 2 decoder layers"):
            run_eval(cfg_for(ckpt, data, str(tmp_path / "deep"), methods=["none", name], keeps=[0.25]), model, processor)
        assert not (tmp_path / "deep" / "none").exists()
    methods = [m for m in methods if m not in deep]
    plan = ["none", *methods, "vidcom2+random"]
    rows = run_eval(cfg_for(ckpt, data, str(tmp_path), methods=plan, keeps=[0.25]), model, processor)
    assert [r["name"] for r in rows] == ["none", *(f"{m}_keep0.25" for m in plan[1:])]
    for row in rows:
        assert (row["n"], row["correct"], row["failed"]) == (N, 3, 0), row["name"]
        if row["name"] != "none":  # 4 frames x 3x3 pooled tokens (the newline is not counted once wrapped)
            assert row["visual_tokens_in"] == 4 * 9, row["name"]
            assert row["visual_tokens_out"] < 4 * 9 and row["flops_ratio"] < 1.0, row["name"]
    assert set(methods) >= {"vidcom2", "fastvid", "dycoke"} and "holitom" in deep
    assert not hasattr(model, "vlm_prune")


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


# The eval command, killed by SIGKILL right after its first record reached the disk: a kill at a
# fixed point, however fast or loaded the machine (a timed kill raced a quick run to the end).
KILL_AFTER_FIRST_RECORD = """
import os, signal, sys
from vlm_prune.eval import sharding
from vlm_prune.eval.__main__ import main
write = sharding.RankWriter.write
def write_then_die(self, record):
    write(self, record)
    os.kill(os.getpid(), signal.SIGKILL)
sharding.RankWriter.write = write_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_resume_after_kill_gives_the_same_totals(ckpt, data, tmp_path):
    out = str(tmp_path / "killed")
    rank_file = os.path.join(out, "none", "samples.rank0.jsonl")
    cmd = [sys.executable, "-c", KILL_AFTER_FIRST_RECORD, *_cli(ckpt, data, out)[3:]]
    done = subprocess.run(cmd, env={**os.environ, **ONE_THREAD_ENV}, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    lines = open(rank_file).read().count("\n")
    assert lines == 1, "the run should have been killed right after its first record"
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


def test_two_ranks_under_torchrun_cover_every_sample_once(ckpt, data, tmp_path):
    out = str(tmp_path / "ranks")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *_cli(ckpt, data, out)[1:]]
    done = subprocess.run(cmd, env={**os.environ, **ONE_THREAD_ENV}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = lambda p: [r["id"] for r in read_jsonl(os.path.join(out, "none", p))]
    assert ids("samples.rank0.jsonl") == ["q0", "q2"]
    assert ids("samples.rank1.jsonl") == ["q1", "q3"]
    assert ids("results.jsonl") == [f"q{i}" for i in range(N)]
    summary = json.load(open(os.path.join(out, "none", "summary.json")))
    assert (summary["n"], summary["evaluated"], summary["failed"]) == (N, N, 0)
    assert done.stdout.count("evaluated 4 of 4") == 1  # rank 0 reports, once


def test_sharding_resume_reads_all_rank_files(tmp_path):
    d0, d1 = sharding.Dist(0, 2, 0), sharding.Dist(1, 2, 1)
    assert sharding.shard(list("abcde"), d0) == ["a", "c", "e"] and sharding.shard(list("abcde"), d1) == ["b", "d"]
    with sharding.RankWriter(str(tmp_path), d0) as w:
        w.write({"id": "a", "correct": True})
    with sharding.RankWriter(str(tmp_path), d1) as w:
        w.write({"id": "b", "correct": False})
        w.write({"id": "a", "correct": False})  # a duplicate id: the first record wins
    assert {k: v["correct"] for k, v in sharding.read_records(str(tmp_path)).items()} == {"a": True, "b": False}
    with sharding.RankWriter(str(tmp_path), d0) as w:  # a failed record is replaced by a later answer
        w.write({"id": "c", "status": "failed", "error": "E: x"})
        w.write({"id": "c", "status": "ok", "correct": True})
        w.write({"id": "c", "status": "failed", "error": "E: y"})
    assert sharding.read_records(str(tmp_path))["c"]["status"] == "ok"
    # questions about one video go to one rank, so each video is decoded once
    items = [("v1", 0), ("v2", 1), ("v1", 2), ("v3", 3), ("v2", 4)]
    assert sharding.shard(items, d0, key=lambda x: x[0]) == [("v1", 0), ("v1", 2), ("v3", 3)]
    assert sharding.shard(items, d1, key=lambda x: x[0]) == [("v2", 1), ("v2", 4)]


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


def test_nothing_lost_silently_failures_isolated_and_retried(ckpt, tmp_path, monkeypatch, capsys):
    from vlm_prune.eval import runner
    from vlm_prune.eval.__main__ import main

    root = tmp_path / "qa"
    rows_in = [("q0", "v0.mp4", "what ?"), ("q1", "v1.mp4", "what ?"), ("q2", "gone.mp4", "what ?"),
               ("q3", "junk.mp4", "what ?"), ("q4", "v4.mp4", "which shape ?")]
    root.mkdir()
    with open(root / "qa.jsonl", "w") as f:
        for qid, video, question in rows_in:
            f.write(json.dumps({"id": qid, "video": video, "question": question, "options": ["red", "blue"],
                                "answer": "A"}) + "\n")
    for i in (0, 1, 4):
        write_video(str(root / f"v{i}.mp4"), n_frames=6, seed=i)
    (root / "junk.mp4").write_bytes(os.urandom(3000))
    model, processor = load(ckpt)
    always_a(model, processor)
    real = runner.Predictor.generate

    def out_of_memory_on_shape(self, text, *args, **kw):
        if "shape" in text:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, text, *args, **kw)

    monkeypatch.setattr(runner.Predictor, "generate", out_of_memory_on_shape)
    out = str(tmp_path / "out")
    cfg = cfg_for(ckpt, str(root), out, skip_missing=True)
    with pytest.raises(ValueError, match="1 of 5 samples have missing media.*--skip-missing"):
        run_eval(cfg_for(ckpt, str(root), out), model, processor)
    [row] = run_eval(cfg, model, processor)
    assert (row["n"], row["evaluated"], row["skipped"], row["failed"], row["correct"]) == (5, 2, 1, 2, 2)
    assert row["accuracy"] == 1.0 and row["official"] == 1.0  # over the evaluated questions only
    assert row["not_evaluated"] == {"skipped": {"missing media": 1}, "failed": {"VideoDecodeError": 1, "RuntimeError": 1}}
    recs = {r["id"]: r for r in read_jsonl(os.path.join(out, "none", "results.jsonl"))}
    assert [recs[q]["status"] for q in ("q0", "q1", "q2", "q3", "q4")] == ["ok", "ok", "skipped", "failed", "failed"]
    assert recs["q2"]["reason"].endswith("gone.mp4") and recs["q3"]["stage"] == "decode"
    assert recs["q4"]["stage"] == "model" and "out of memory" in recs["q4"]["error"]
    md = open(os.path.join(out, "summary.md")).read()
    assert "- none: evaluated 2 of 5 (skipped 1: missing media 1; failed 2: VideoDecodeError 1, RuntimeError 1)" in md
    assert json.load(open(os.path.join(out, "none", "summary.json")))["failed"] == 2

    # repaired: the video downloaded, the broken file replaced, the model fixed -> rerun retries exactly those
    monkeypatch.setattr(runner.Predictor, "generate", real)
    write_video(str(root / "gone.mp4"), n_frames=6, seed=2)
    write_video(str(root / "junk.mp4"), n_frames=6, seed=3)
    [row] = run_eval(cfg, model, processor)
    assert (row["evaluated"], row["skipped"], row["failed"], row["correct"]) == (5, 0, 0, 5)
    rank0 = [r["id"] for r in read_jsonl(os.path.join(out, "none", "samples.rank0.jsonl"))]
    assert sorted(rank0) == ["q0", "q1", "q2", "q3", "q3", "q4", "q4"]  # answered ones not asked again

    # a run where nothing can be evaluated exits non-zero and says why
    empty = tmp_path / "empty"
    empty.mkdir()
    with open(empty / "qa.jsonl", "w") as f:
        f.write(json.dumps({"id": "z", "video": "nope.mp4", "question": "what ?", "options": ["a", "b"], "answer": "A"}) + "\n")
    code = main(["--model", ckpt, "--data", str(empty), "--dataset", "jsonl", "--frames", "2", "--skip-missing",
                 "--max-new-tokens", "1", "--out", str(tmp_path / "out_empty")])
    captured = capsys.readouterr()
    assert code == 1 and "no question was evaluated in none" in captured.err
    assert "evaluated 0 of 1 (skipped 1: missing media 1)" in captured.out


def test_misspelled_method_is_rejected_before_anything_runs(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=r"--method 'pakt': unknown method 'pakt'. Did you mean 'pact'"):
        run_eval(EvalConfig(model=tmp_path / "no_model", data=tmp_path / "no_data", dataset="jsonl", out=out,
                            methods=["none", "pakt"], keeps=[0.5]))
    assert not out.exists()  # neither data nor model were touched (both paths do not exist)


def test_limit_spreads_over_tasks():
    from vlm_prune.eval.datasets import Sample
    from vlm_prune.eval.runner import spread

    samples = [Sample(f"{t}/{i}", [], "video", "q", [], "x", {"task": t}) for t in "abcd" for i in range(10)]
    picked = spread(samples, 8)
    assert [s.id for s in picked] == ["a/0", "a/6", "b/1", "b/7", "c/2", "c/8", "d/3", "d/9"]
    assert spread(samples, None) == samples and spread(samples, 100) == samples


# ---- issue 27: a long-running job that a dead launcher or a broken file must not hang ------------------
def test_a_truncated_video_is_counted_in_the_summary(ckpt, tmp_path):
    """A video that lists more frames than decode is answered on the frames that decode; its record says
    so and the summary counts it (with the listed / decoded counts), like the missing and broken ones."""
    from test_video import _faststart_mp4

    from vlm_prune.eval import metrics

    root = tmp_path / "qa"
    root.mkdir()
    write_video(str(root / "v0.mp4"), n_frames=6, seed=0)
    data = open(_faststart_mp4(str(tmp_path / "full.mp4"), n=60), "rb").read()
    (root / "cut.mp4").write_bytes(data[: len(data) // 2])
    with open(root / "qa.jsonl", "w") as f:
        for qid, video in (("q0", "v0.mp4"), ("q1", "cut.mp4")):
            f.write(json.dumps({"id": qid, "video": video, "question": "what ?", "options": ["red", "blue"],
                                "answer": "A"}) + "\n")
    model, processor = load(ckpt)
    [row] = run_eval(cfg_for(ckpt, str(root), str(tmp_path / "out")), model, processor)
    assert (row["n"], row["evaluated"], row["failed"], row["truncated"]) == (2, 2, 0, 1)
    [example] = row["truncated_examples"]
    assert example["id"] == "q1" and example["listed"] == 60 and 0 < example["decoded"] < 60
    recs = {r["id"]: r for r in read_jsonl(os.path.join(str(tmp_path / "out"), "none", "results.jsonl"))}
    assert recs["q1"]["truncated"] == {"listed": 60, "decoded": example["decoded"]} and "truncated" not in recs["q0"]
    line = "- none: evaluated 2 of 2 (1 of the evaluated on truncated videos (scored on the frames that decode))"
    assert line in open(os.path.join(str(tmp_path / "out"), "summary.md")).read()
    assert metrics.counts_line(row) == line[len("- none: "):]


def test_the_final_sync_gives_up_after_the_sync_timeout(tmp_path):
    """A rank whose peers never arrive (dead, or their launcher is) waits --sync-timeout minutes, not a day,
    then says why and how to resume."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **ONE_THREAD_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    code = "from vlm_prune.eval import sharding; sharding.barrier(sharding.Dist(0, 2, 0), timeout_min=0.05)"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode != 0 and "SyncTimeout" in done.stderr, done.stderr[-2000:]
    assert "did not reach the final sync within 0.05 minutes (--sync-timeout)" in done.stderr
    assert took < 120, f"gave up after {took:.0f} s"
    with pytest.raises(sharding.SyncTimeout, match="1 samples are still missing"):
        sharding.wait_for(str(tmp_path), ["x"], poll_s=0.05, timeout_min=0.002)
    with pytest.raises(ValueError, match="sync_timeout_min .* must be > 0"):
        run_eval(EvalConfig(model="m", data="d", dataset="jsonl", out=str(tmp_path), sync_timeout_min=0))


LAUNCHER = """
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "WORLD_SIZE": "2", "RANK": "0",
                        "LOCAL_RANK": "0"}, stderr=open(sys.argv[2], "w"))
print(rank.pid, flush=True)
time.sleep(300)
"""
RANK = """
import sys, time
from vlm_prune.eval import sharding
assert sharding.exit_with_launcher(sharding.current(), poll_s=0.1)
print("watching", file=sys.stderr, flush=True)
time.sleep(300)  # a rank still working (or waiting at the sync) when its launcher dies
"""


def test_ranks_exit_when_the_launcher_dies(tmp_path):
    """SIGKILL to the launcher (torchrun, accelerate) ends its ranks within seconds, with a message
    saying how to resume, instead of leaving them to run on and wait at the final sync."""
    import time

    err = tmp_path / "rank.err"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(err)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **ONE_THREAD_ENV}, cwd=tmp_path)
    rank = int(launcher.stdout.readline())

    def rank_alive() -> bool:
        try:
            with open(f"/proc/{rank}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 120
    while "watching" not in err.read_text() and rank_alive() and time.monotonic() < deadline:
        time.sleep(0.2)  # until the rank's watcher runs
    assert rank_alive(), err.read_text()
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while rank_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = rank_alive()
    if alive:
        os.kill(rank, signal.SIGKILL)
    assert not alive, "the rank outlived its launcher by 30 s"
    assert f"the launcher (pid {launcher.pid}) is gone; exiting" in err.read_text()
