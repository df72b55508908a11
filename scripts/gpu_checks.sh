#!/usr/bin/env bash
# Every check that needs a GPU, in one run (a lent H200 gives a session 15 minutes in all).
#
# 1. tests/test_cuda.py: Triton kernels vs references at real sizes; methods with Triton vs with
#    the references on the same GPU; keep=1.0 equals the unwrapped model on CUDA.
# 2. bench_kernels --device cuda: kernel vs reference vs eager attention weights, time and memory.
# 3. bench --speed --device cuda --scale 1: time to first token, LLaVA-1.5-7B / OneVision-7B (32 frames)
#    shapes at full size, every method, 3 repeats: efficiency, keep=1.0 overhead, scoring share
#    (wall-clock on CUDA). (image-deep is a CPU stand-in for 7B
#    proportions; at --scale 1 the real shapes are timed instead.)
#
# Prepare on the CPU machine (the device image has transformers 5.17, below our 5.18 floor, and an older
# huggingface_hub): download transformers and what it needs beyond that image into .whl/ (git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 regex httpx2 httpcore2 truststore click hf-xet tomlkit
# then run it there with the device tool from a clean checkout: carry [".whl"], command
# "bash scripts/gpu_checks.sh $(git rev-parse --short=12 HEAD)", timeout_s 580. The device gets a copy of the
# working tree without git, so the commit is passed in and written into each result file's meta["code"].
# Each step has its own time limit so a slow one cannot take the others down; what comes back from $OUT
# is at most 8 files: run.log, machine.txt and the result files (kernels.json, speed-image.json,
# speed-video.json), which go to results/gpu/ for the results page (vlm-prune bench --report).
set -uo pipefail
OUT=${OUT:-gpu_out}
CODE=${1:-unknown}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
exec > >(tee -a "$OUT/run.log") 2>&1

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
  echo "code $CODE"
} 2>&1 | tee "$OUT/machine.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@"
  echo "== $name exit $? $(date -u +%T)"
}

stamp() {  # stamp JSON...: the commit the run came from, into each result file's meta["code"]
  python3 - "$CODE" "$@" <<'PY'
import json, sys
code = sys.argv[1]
for path in sys.argv[2:]:
    try:
        data = json.load(open(path))
    except OSError:
        continue
    data["meta"]["code"] += f" (commit {code}, run from a copy of the checkout)"
    json.dump(data, open(path, "w"), indent=1)
PY
}

step cuda_tests 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py
step bench_kernels 60 python3 -m vlm_prune.eval.bench_kernels --device cuda --json "$OUT/kernels.json"
for shape in image video; do
  step "speed_$shape" $([ $shape = image ] && echo 130 || echo 190) \
    vlm-prune bench --speed --device cuda --scale 1 --shapes $shape --frames 32 --repeats 3 --out "/tmp/speed-$shape"
  cp "/tmp/speed-$shape/speed.json" "$OUT/speed-$shape.json" 2>/dev/null
done
stamp "$OUT/kernels.json" "$OUT/speed-image.json" "$OUT/speed-video.json"
