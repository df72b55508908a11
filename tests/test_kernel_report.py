"""Every Triton kernel compiles to real GPU machine code (no GPU needed) within the chip's limits.

The interpreter tests (test_kernels.py) check what the kernels compute; this file checks what
the interpreter cannot: that each launch the wrappers make compiles for sm_90 (H100 / H200) and
sm_80 (A100), spills no registers, fits the shared memory of one thread block, and that the dot
kernels run on tensor cores for half-precision inputs. It runs in a subprocess because the
report needs Triton without TRITON_INTERPRET.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vlm_prune.kernels import _dispatch

DOT_KERNELS = {"_row_stats", "_rows_out", "_keys_out", "_cosine", "_density", "_nearest_denser"}
LAUNCHED = DOT_KERNELS | {"_euti_stats", "_euti_out", "_gather", "_segment_mean"}


def _triton_version() -> tuple[int, int]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("triton").split(".")[:2])


@pytest.mark.skipif(not _dispatch.triton_available() or _triton_version() < (3, 8),
                    reason="the report uses Triton >= 3.8 compiler internals")
@pytest.mark.parametrize("arch, dtype", [(90, "bfloat16"), (80, "float32")])
def test_every_launch_compiles_without_spills(tmp_path, arch, dtype):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from an old cache
    proc = subprocess.run([sys.executable, "-m", "vlm_prune.eval.kernel_report", "--arch", str(arch), "--dtype", dtype,
                           "--shapes", "cpu", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["kernel"] for r in rows} == LAUNCHED
    assert len({r["wrapper"] for r in rows}) == 9
    for r in rows:
        assert r["stack_bytes"] == 0, f"{r['wrapper']} / {r['kernel']} spills registers on sm_{arch}: {r}"
        assert r["fits"], f"{r['kernel']} needs {r['shared_bytes']} B of shared memory, more than sm_{arch} has"
        assert r["blocks"] >= 1 and r["registers"] <= 255
        uses_tensor_cores = r["tensor_core_ops"] > 0
        assert uses_tensor_cores == (dtype != "float32" and r["kernel"] in DOT_KERNELS), r
    assert f"sm_{arch}" in proc.stdout and "_nearest_denser" in proc.stdout


def test_report_refuses_the_interpreter(monkeypatch):
    from vlm_prune.eval import kernel_report

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="without TRITON_INTERPRET"):
        kernel_report.report(90, kernel_report.SHAPES["cpu"], None)
