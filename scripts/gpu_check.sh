#!/usr/bin/env bash
# One call on the H200: GPU tests (a skip is a failure) then the benchmarks; a short table last.
# Usage: scripts/gpu_check.sh [pytest args...]   (OUT=dir for logs and results; default ./out)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"; export MEGART_GPU_OUT=$OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGART_REQUIRE_GPU=1
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
python3 -m pytest -q -p no:cacheprovider "${@:-tests/gpu}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
echo "GPU tests exit: ${PIPESTATUS[0]}"
# The tensor-parallel tests run under torchrun, one process per GPU (outside it their module is skipped at
# collection, so the run above cannot cover them): on a host with two or more GPUs, and no pytest args given.
if [ $# -eq 0 ] && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  scripts/tp_run.sh -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py 2>&1 | tee "$OUT/tp_tests.log" | tail -12
  echo "TP GPU tests exit: ${PIPESTATUS[0]}"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench/runtime_bench.py --json "$OUT/runtime.json" 2>&1 | tee "$OUT/runtime_bench.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench/tasks_bench.py --json "$OUT/tasks.json" 2>&1 | tee "$OUT/tasks_bench.log"
  python3 bench/llama_decode.py --out "$OUT/llama_decode" 2>&1 | tee "$OUT/llama_decode.log" | tail -8
  # the machine-readable result beside the logs too: a caller that takes back only a few files from $OUT (the
  # first ones by name, top level first) keeps it, not the plots
  cp "$OUT/llama_decode/llama_decode.json" "$OUT/" 2>/dev/null || true
fi
