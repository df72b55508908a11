"""The `vlm-prune` command: a fast --help, --version, and every subcommand's error paths end in
one line on stderr and exit code 2 (no traceback)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlm_prune import cli

EXAMPLES = Path(__file__).resolve().parents[1] / "demo" / "examples"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``vlm-prune argv`` run in this process."""
    try:
        rc = cli.main(argv)
    except SystemExit as exit_:
        rc = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys, time, contextlib, io\n"
            "t = time.perf_counter()\n"
            "from vlm_prune.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: main(['--help'])\n"
            "    except SystemExit: pass\n"
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'keyframes' in out.getvalue())\n")
    seconds, torch_loaded, listed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True, timeout=60).stdout.split()
    assert torch_loaded == "False" and listed == "True"
    assert float(seconds) < 1.0


def test_version_and_descriptions(capsys):
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.startswith("vlm-prune ") and out.split()[1][0].isdigit()
    for command in ("methods", "eval", "demo", "keyframes", "bench"):
        rc, out, _ = run_cli([command, "--help"], capsys)
        description = out.split("\n\n")[1]
        assert rc == 0 and len(description) > 40, (command, out)
        assert "``" not in out and ":mod:" not in out, command  # no raw reStructuredText


def test_no_command_prints_help_and_unknown_command_is_one_line(capsys):
    rc, out, _ = run_cli([], capsys)
    assert rc == 2 and "COMMAND" in out
    assert_usage_error(["bnech"], capsys, "invalid choice: 'bnech'")


def test_methods_lists_every_method_with_a_description(capsys):
    from vlm_prune.cli_methods import summary
    from vlm_prune.registry import available_methods, method_class

    rc, out, _ = run_cli(["methods"], capsys)
    assert rc == 0
    for name in available_methods():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name} "))
        title = (method_class(name).__doc__ or "").strip().split("\n")[0]
        assert summary(name) in line and summary(name) != title  # a one-line description (ONE_LINE / summary)


def test_method_list_validates_every_name_with_a_suggestion():
    assert cli.method_list("pact, keyscore+pact") == "pact,keyscore+pact"
    with pytest.raises(Exception, match=r"unknown method 'pactt'; did you mean pact\?"):
        cli.method_list("pactt,divprun")
    with pytest.raises(Exception, match="unknown method 'divprun'; did you mean divprune"):
        cli.method_list("pact,divprun")


def test_bench_rejects_unknown_methods_and_an_earlier_out(capsys, tmp_path):
    assert_usage_error(["bench", "--methods", "pactt,divprun"], capsys, "--methods", "did you mean pact?")
    (tmp_path / "bench.json").write_text("{}")
    line = assert_usage_error(["bench", "--out", str(tmp_path)], capsys, "already holds bench.json", "--overwrite")
    assert str(tmp_path) in line
    assert json.loads((tmp_path / "bench.json").read_text()) == {}  # untouched


def test_exit_code_and_one_line_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "vlm_prune.cli", "keyframes", "nope.mp4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "vlm-prune keyframes: error: no video file among nope.mp4; give paths of existing video files"]


def test_keyframes_on_an_undecodable_file_is_one_line_and_exit_code_2(tmp_path):
    """A file no decoder reads: exit 2 with vlm_prune's one line, and none of the decoders' own logs
    (FFmpeg's "moov atom not found", decord's "ERROR opening"), which they write to the process's stderr;
    its record (with the error) still goes to the output. With a good video beside it: exit 1, a warning."""
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(bytes(range(256)) * 20)
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "vlm_prune.cli", "keyframes", str(bad), "--method", "uniform",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("vlm-prune keyframes: error: ") and str(bad) in lines[0]
    assert "error" in json.loads(out.read_text())
    proc = subprocess.run([sys.executable, "-m", "vlm_prune.cli", "keyframes", str(bad), str(EXAMPLES / "synthetic_clip.mp4"),
                           "--method", "uniform", "--budget", "2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("warning: ") and str(bad) in lines[0], proc.stderr
    assert [("error" in json.loads(line)) for line in out.read_text().splitlines()] == [True, False]


def test_keyframes_error_paths(capsys, tmp_path):
    video = str(EXAMPLES / "synthetic_clip.mp4")
    captions = tmp_path / "captions.txt"
    captions.write_text("a red square\n")
    assert_usage_error(["keyframes", "nope.mp4", str(tmp_path)], capsys, "no video file among nope.mp4")
    assert_usage_error(["keyframes", video, "--num-frames", "0"], capsys, "--num-frames", ">= 1, got '0'")
    assert_usage_error(["keyframes", video, "--fps", "-1"], capsys, "--fps", "> 0")
    assert_usage_error(["keyframes", video, "--fps", "2", "--num-frames", "4"], capsys, "not allowed with")
    assert_usage_error(["keyframes", video, "--budget", "0"], capsys, "--budget")
    assert_usage_error(["keyframes", video, "--captions", "missing.txt", "--encoder", "org/clip"], capsys,
                       "--captions", "missing.txt does not exist")
    assert_usage_error(["keyframes", video, "--captions", str(captions), "--encoder", "./no-such-clip"], capsys,
                       "--encoder", "./no-such-clip does not exist", "hub id")
    assert_usage_error(["keyframes", video, "--captions", str(captions), "--encoder", str(tmp_path)], capsys,
                       "no config.json")
    assert_usage_error(["keyframes", video], capsys, "needs --encoder", "--method uniform")
    bad = tmp_path / "captions.json"
    bad.write_text("{not json")
    assert_usage_error(["keyframes", video, "--captions", str(bad), "--encoder", "org/clip"], capsys,
                       f"--captions {bad}")
    two = tmp_path / "two.txt"
    two.write_text("one\ntwo\nthree\n")
    assert_usage_error(["keyframes", video, video, "--captions", str(two), "--encoder", "org/clip"], capsys,
                       "3 captions for 2 videos")


def test_keyframes_on_a_short_clip_says_it_returned_fewer_frames(capsys):
    rc, out, err = run_cli(["keyframes", str(EXAMPLES / "synthetic_clip.mp4"), "--method", "uniform",
                            "--budget", "64"], capsys)
    record = json.loads(out)
    assert rc == 0 and len(record["indices"]) < 64
    assert f"returned {len(record['indices'])} frames, fewer than --budget 64" in err


def test_demo_error_paths_come_before_any_model_loads(capsys, monkeypatch):
    pytest.importorskip("gradio")
    from vlm_prune.demo import app

    monkeypatch.setattr(app, "make_sessions", lambda *a, **k: pytest.fail("models loaded before the checks"))
    assert_usage_error(["demo", "--model", "./no-such-model"], capsys, "--model", "does not exist")
    assert_usage_error(["demo", "--frames", "0"], capsys, "--frames")
    assert_usage_error(["demo", "--port", "70000"], capsys, "--port 70000")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        line = assert_usage_error(["demo", "--port", str(port)], capsys, f"127.0.0.1:{port}", "--port")
        assert "GRADIO_SERVER_PORT" not in line and time.perf_counter() - start < 5


def test_fit_terminal_drops_wide_columns_and_says_where_they_are():
    table = "\n".join([
        "intro",
        "| model | method | " + " | ".join(f"column {i} with a long name" for i in range(8)) + " |",
        "|---|---|" + "---|" * 8,
        "| synthetic-image | pact | " + " | ".join("0.123" for _ in range(8)) + " |",
        "",
        "| short | table |",
        "|---|---|",
    ])
    fitted = cli.fit_terminal(table, width=80, where="bench.md").splitlines()
    assert fitted[0] == "intro" and fitted[-2:] == ["| short | table |", "|---|---|"]
    rows = [ln for ln in fitted if ln.startswith("|")]
    assert all(len(ln) <= 80 for ln in rows)
    assert rows[0].startswith("| model") and "synthetic-image" in rows[2]
    assert any(ln.startswith("(") and ln.endswith("more columns in bench.md)") for ln in fitted)
    assert cli.fit_terminal("| a | b |\n|---|---|", width=80) == "| a | b |\n|---|---|"


# ---- every subcommand: --help stays light, mistakes are one line and exit code 2 -------------------
@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_every_subcommand_help_imports_neither_torch_nor_transformers(command):
    code = ("import sys, time, contextlib, io\n"
            "t = time.process_time()\n"
            "from vlm_prune.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: main([sys.argv[1], '--help'])\n"
            "    except SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "print(time.process_time() - t, ','.join(heavy) or '-', len(out.getvalue()))\n")
    proc = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cpu_seconds, heavy, help_chars = proc.stdout.split()
    assert heavy == "-", f"`vlm-prune {command} --help` imported {heavy}"
    assert int(help_chars) > 200 and f"usage: vlm-prune {command}" in subprocess.run(
        [sys.executable, "-c", code.replace("io.StringIO()) as out", "sys.stderr) as out").replace(
            "len(out.getvalue())", "0"), command], capture_output=True, text=True, timeout=120).stderr
    assert float(cpu_seconds) < 1.5, f"`vlm-prune {command} --help` took {cpu_seconds} CPU-seconds"


def test_a_real_eval_process_without_data_is_one_line_and_exit_code_2(tmp_path):
    """`vlm-prune eval` and `python -m vlm_prune.eval` alike."""
    model = str(Path(__file__).resolve().parents[1] / "eval" / "synthetic" / "models" / "image")
    args = ["eval", "--model", model, "--dataset", "jsonl", "--out", str(tmp_path)]
    for argv, prog in (([sys.executable, "-m", "vlm_prune.cli", *args], "vlm-prune eval"),
                       ([sys.executable, "-m", "vlm_prune.eval", *args[1:], "--data", str(tmp_path / "none")],
                        "python -m vlm_prune.eval")):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    assert "required: --data" in subprocess.run([sys.executable, "-m", "vlm_prune.cli", *args], capture_output=True,
                                                text=True, timeout=120).stderr


@pytest.fixture
def offline_hub(monkeypatch):
    """The Hugging Face hub as on a machine without it: nothing cached, HF_HUB_OFFLINE set."""
    import huggingface_hub.constants  # a submodule: huggingface_hub 2.x no longer imports it with the package

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


SYNTHETIC = Path(__file__).resolve().parents[1] / "eval" / "synthetic" / "models"


def test_eval_error_paths(capsys, tmp_path, offline_hub):
    model = str(SYNTHETIC / "image")
    base = ["eval", "--model", model, "--out", str(tmp_path / "out")]
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "q.jsonl").write_text(json.dumps({"video": "gone.mp4", "question": "what colour?",
                                                "options": ["red", "blue"], "answer": "A"}) + "\n")
    data = ["--data", str(videos), "--dataset", "jsonl"]
    assert_usage_error(["eval", "--model", model, "--dataset", "jsonl", "--out", "o"], capsys, "required: --data")
    assert_usage_error([*base, *data, "--method", "pactt", "--keep", "0.5"], capsys, "--method 'pactt'",
                       "Did you mean 'pact'?")
    assert_usage_error([*base, *data, "--method", "random"], capsys, "method 'random' needs --keep")
    assert_usage_error([*base, "--data", str(tmp_path / "nowhere"), "--dataset", "jsonl"], capsys,
                       f"--data {tmp_path / 'nowhere'} does not exist")
    assert_usage_error([*base, *data], capsys, "1 of 1 samples have missing media", "--skip-missing")
    assert_usage_error([*base, *data, "--keep", "1.5"], capsys, "--keep", "(0, 1]")
    assert_usage_error([*base, *data, "--budget", "0"], capsys, "--budget")
    assert_usage_error([*base, *data, "--limit", "0"], capsys, "--limit", ">= 1")
    assert_usage_error([*base, *data, "--frames", "x"], capsys, "--frames")
    assert_usage_error([*base, *data, "--dataset", "nope"], capsys, "--dataset", "invalid choice")
    assert_usage_error(["eval", "--model", "./no-such-model", *data, "--out", "o"], capsys, "--model",
                       "does not exist")
    assert_usage_error(["eval", "--model", "not/a-model", *data, "--out", "o"], capsys, "--model not/a-model",
                       "not in the local Hugging Face cache", "HF_HUB_OFFLINE")
    assert not (tmp_path / "out").exists()


def test_eval_refuses_a_method_the_model_cannot_run_before_any_question(capsys, tmp_path):
    """A frames method on the LLaVA (image) model: wrap()'s refusal, one line, before answering."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "q.jsonl").write_text(json.dumps({"image": str(EXAMPLES / "synthetic_colour_0.png"),
                                                "question": "what colour?", "answer": "red"}) + "\n")
    line = assert_usage_error(["eval", "--model", str(SYNTHETIC / "image"), "--data", str(images), "--dataset",
                               "image", "--method", "uniform", "--keep", "0.5", "--out", str(tmp_path / "out")],
                              capsys, "--method uniform", "'frames' stage, which the llava adapter does not offer")
    assert "offers: vision, vit, llm" in line
    assert not list((tmp_path / "out").rglob("results.jsonl"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "--device cuda: no CUDA device is visible to torch; use --device cpu"),
    (["--device-map", "cuda"], "--device-map cuda: no CUDA device is visible to torch; use --device cpu"),
    (["--device-map", "0"], "--device-map 0: no CUDA device"),
])
def test_eval_on_a_gpu_without_cuda_is_one_line_and_exit_code_2(capsys, tmp_path, flags, message):
    """--device cuda (once read as --device-map cuda, then a traceback from the model's move) and a GPU
    --device-map are refused before the dataset is read, as bench --device cuda is."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "q.jsonl").write_text(json.dumps({"image": "gone.png", "question": "what colour?", "answer": "red"}) + "\n")
    assert_usage_error(["eval", "--model", str(SYNTHETIC / "image"), "--data", str(images), "--dataset", "image",
                        *flags, "--out", str(tmp_path / "out")], capsys, message)
    assert not (tmp_path / "out").exists()


def test_bench_error_paths(capsys, tmp_path, offline_hub):
    out = ["--out", str(tmp_path / "b")]
    assert_usage_error(["bench", "--model", "not/a-model", *out], capsys, "--model not/a-model",
                       "not in the local Hugging Face cache")
    assert_usage_error(["bench", "--model", "./no-such-model", *out], capsys, "--model", "does not exist")
    assert_usage_error(["bench", "--limit", "0", *out], capsys, "--limit", ">= 1, got '0'")
    assert_usage_error(["bench", "--keep", "2", *out], capsys, "--keep", "(0, 1]")
    assert_usage_error(["bench", "--kinds", "audio", *out], capsys, "--kinds")
    assert_usage_error(["bench", "--device", "tpu", *out], capsys, "--device", "invalid choice")
    import torch

    if not torch.cuda.is_available():
        assert_usage_error(["bench", "--device", "cuda", *out], capsys, "--device cuda", "--device cpu")
    assert_usage_error(["bench", "--speed", "--shapes", "image,cube", *out], capsys, "--shapes", "cube")


def test_serve_error_paths_come_before_vllm(capsys, tmp_path):
    """vLLM is not needed to find these: the checkpoint, the method and the budget are checked first."""
    model = str(SYNTHETIC / "image")
    assert_usage_error(["serve", str(tmp_path / "none"), "--method", "divprune", "--keep", "0.5"], capsys,
                       "config.json not found", "local checkpoint folder")
    assert_usage_error(["serve", model, "--method", "pactt", "--keep", "0.5"], capsys, "unknown method 'pactt'",
                       "Did you mean 'pact'?")
    assert_usage_error(["serve", model, "--method", "pact", "--keep", "0.5"], capsys, "inside the language model",
                       "vision-stage method")
    assert_usage_error(["serve", model, "--method", "divprune"], capsys, "give --method with --keep or --budget, or --config")
    assert_usage_error(["serve", model, "--method", "divprune", "--keep", "2"], capsys, "--keep", "(0, 1]")
    assert_usage_error(["serve", model, "--method", "divprune", "--budget", "0"], capsys, "--budget")
    assert_usage_error(["serve", model, "--method", "divprune", "--keep", "0.5", "--vllm", "'--port"], capsys,
                       "--vllm", "No closing quotation")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    assert_usage_error(["serve", str(bert), "--method", "divprune", "--keep", "0.5"], capsys, "BertModel")


def test_demo_refuses_an_unreachable_hub_model_before_loading(capsys, monkeypatch, offline_hub):
    pytest.importorskip("gradio")
    from vlm_prune.demo import app

    monkeypatch.setattr(app, "make_sessions", lambda *a, **k: pytest.fail("models loaded before the checks"))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert_usage_error(["demo", "--model", "not/a-model", "--port", str(port)], capsys, "--model not/a-model",
                       "not in the local Hugging Face cache")


def test_methods_error_path(capsys):
    assert_usage_error(["methods", "--all"], capsys, "unrecognized arguments: --all")


# ---- `vlm-prune methods`: the models column is what wrap() accepts ---------------------------------
def _tiny_family_models() -> dict:
    import tiny_models as T
    import tiny_models_llavalike as L
    import tiny_models_qwen3 as Q
    from timm.models.vision_transformer import VisionTransformer

    return {"llava": T.tiny_llava(tower_layers=4), "llava_next": T.tiny_llava_next(tower_layers=4),
            "llava_onevision": T.tiny_onevision(), "qwen2_vl": T.tiny_qwen2_vl(),
            "timm_vit": VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=12, num_heads=2).eval(),
            "mistral3": L.tiny_mistral3(), "gemma3": L.tiny_gemma3(), "internvl": L.tiny_internvl(),
            "llava_next_video": L.tiny_llava_next_video(tower_layers=4), "llava_onevision15": L.tiny_onevision15(),
            "qwen3_vl": Q.tiny_qwen3_vl(), "glm4v": Q.tiny_glm4v(), "qwen3_5": Q.tiny_qwen3_5(),
            "smolvlm": L.tiny_smolvlm(), "videollama3": L.tiny_videollama3()}


def test_methods_lists_the_model_families_wrap_accepts(capsys):
    import torch

    import vlm_prune
    from vlm_prune.adapters import FAMILY_STAGES
    from vlm_prune.frames.quota import QuoTA
    from vlm_prune.registry import available_methods, method_class

    pytest.importorskip("timm")
    rc, out, _ = run_cli(["methods"], capsys)
    assert rc == 0
    lines = out.splitlines()
    listed = {}
    for name in available_methods():
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"{name} "))
        models = next(ln for ln in lines[at + 1:] if ln.strip().startswith("models: "))
        listed[name] = {m.split(" (")[0] for m in models.split("models: ")[1].split(", ")}
    assert "all supported models" not in out
    models = _tiny_family_models()
    assert set(models) == set(FAMILY_STAGES)
    for name in available_methods():
        for family, model in models.items():
            spec = QuoTA(scorer=lambda pixels, prompt: torch.ones(pixels.shape[0])) if name == "quota" else name
            if name in ("prunevid", "holitom") or (name, family) == ("pact", "qwen3_5"):  # default layers 11 / 18
                spec = method_class(name)(layer=2)  # (PACT's 4) lie beyond the tiny models' 6 (4): a depth refusal
            try:
                vlm_prune.wrap(model, spec, keep=0.5)
            except ValueError as err:
                assert family not in listed[name], f"`vlm-prune methods` lists {name} on {family}, wrap() refuses: {err}"
                assert "does not offer" in str(err) or "supports" in str(err), err
            else:
                vlm_prune.unwrap(model)
                assert family in listed[name], f"wrap() accepts {name} on {family}, `vlm-prune methods` omits it"
    assert listed["visionzip"] == {"llava", "llava_onevision"} and "(video only" in out
    assert listed["uniform"] == {"llava_onevision", "qwen2_vl", "llava_next_video", "llava_onevision15", "qwen3_vl",
                                 "glm4v", "qwen3_5"}
    assert listed["tome"] == {"llava", "llava_next", "llava_next_video", "timm_vit"}
    assert "qwen3_vl" not in listed["quota"] and "glm4v" not in listed["quota"] and "qwen3_5" in listed["fastv"]


def test_methods_table_says_why_for_every_refusal(capsys):
    """Every cell of `vlm-prune methods --table` (the docs' generated method x family table) is wrap()'s
    rule: "yes" where Method.refusal accepts, else a footnote matching its message."""
    import re

    from vlm_prune.adapters import FAMILY_STAGES
    from vlm_prune.cli import main
    from vlm_prune.registry import available_methods, method_class

    assert main(["methods", "--table"]) == 0
    table = capsys.readouterr().out
    notes = dict(re.findall(r"^- (R\d+): `(.*)`$", table, flags=re.M))
    rows = {r[0].strip("` "): [c.strip() for c in r[1:]] for r in
            (line.strip("|").split("|") for line in table.splitlines() if line.startswith("| `"))}
    assert set(rows) == set(available_methods())
    for name, cells in rows.items():
        for family, cell in zip(FAMILY_STAGES, cells):
            why = method_class(name).refusal(family, FAMILY_STAGES[family])
            if why is None:
                assert cell in ("yes", "yes*"), (name, family)
                continue
            pattern = re.escape(notes[cell]).replace("METHOD", re.escape(name)).replace("FAMILY", re.escape(family))
            assert re.fullmatch(pattern.replace(re.escape("it offers: ..."), "it offers: [^)]*"), why), (name, family, why)


def test_the_generate_matrix_runs_every_registered_method_but_keyscore():
    """The docs' models page says M covers every "yes" cell: the matrix's methods are the registry's
    (KeyScore's STACFP clustering is too slow for it: tests/test_frames_keyscore.py, test_qwen3_families.py)."""
    from test_generate_matrix import METHODS

    from vlm_prune.registry import available_methods

    assert set(available_methods()) - set(METHODS) == {"keyscore"}
