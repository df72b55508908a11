#!/usr/bin/env bash
# Every check that needs a GPU, in one run (a lent H200 gives a session 15 minutes in all).
#
# 1. tests/test_cuda.py: Triton kernels vs references at real sizes; methods with Triton vs with
#    the references on the same GPU; keep=1.0 equals the unwrapped model on CUDA.
# 2. bench_kernels --device cuda: kernel vs reference vs eager attention weights, time and memory.
# 3. bench --speed --device cuda --scale 1: time to first token, LLaVA-1.5-7B / OneVision-7B (32 frames)
#    shapes at full size, every method, 3 repeats: efficiency, keep=1.0 overhead, scoring share
#    (wall-clock on CUDA), the issue-15 acceptance table. (image-deep is a CPU stand-in for 7B
#    proportions; at --scale 1 the real shapes are timed instead.)
#
# Prepare on the CPU machine (the device image has transformers 5.17, below our 5.18 floor):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     transformers==5.24.0 "regex>=2025.10.22"
# then run it there with the device tool: carry [".whl"], command "bash scripts/gpu_checks.sh",
# timeout_s 560. Logs and JSON land in $OUT (the tool brings them back); each step has its own
# time limit so a slow one cannot take the others down with it.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

site=/tmp/vlm_prune_site
rm -rf "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" . || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/machine.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py
step bench_kernels 90 python3 -m vlm_prune.eval.bench_kernels --device cuda --json "$OUT/kernels.json"
step speed 270 vlm-prune bench --speed --device cuda --scale 1 --shapes image,video --frames 32 --repeats 3 \
  --out "$OUT/speed"
