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
    from vlm_prune.cli_methods import ONE_LINE
    from vlm_prune.registry import available_methods

    rc, out, _ = run_cli(["methods"], capsys)
    assert rc == 0
    for name in available_methods():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name} "))
        assert ONE_LINE[name] in line


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
