#!/bin/bash
# Issue 10's GPU run in one call (device time is scarce): compile the kernels in parallel into one disk
# cache, then the HF GPU tests, the decode bench on the checkpoint shapes, and attention by GQA group.
#   OUT=out/hf_gpu bash bench/hf_gpu.sh        (env: CONFIGS, TESTS_K, T_WARM / T_TESTS / T_DECODE / T_GQA)
# Logs and JSON go to $OUT (warm.log, hf_gpu.log, decode.log, shapes/llama_decode.json, gqa.log, gqa.json).
set -o pipefail
OUT=${OUT:-out/hf_gpu}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 MEGART_REQUIRE_GPU=1 MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-hf-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
[ -f COMMIT ] && echo "commit $(cat COMMIT)"
timeout "${T_WARM:-40}" python3 bench/warm_cache.py --configs 3b,8b,qwen3_0.6b,g7_7b,1b --gqa --jobs 10 2>&1 \
  | tee "$OUT/warm.log" | grep -v Warning
timeout "${T_TESTS:-130}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hf_gpu.py -rA -s \
  ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/hf_gpu.log" | grep -E "^\[hf-gpu\]|passed|failed|^(PASSED|FAILED|ERROR)|Error"
timeout "${T_DECODE:-90}" python3 bench/llama_decode.py --configs "${CONFIGS:-3b,8b,qwen3_0.6b,qwen3_8b,g7_7b,1b}" \
  --steps 100 --eager-steps 10 --compile-configs none --no-profile --fixed-cost '' --out "$OUT/shapes" 2>&1 \
  | tee "$OUT/decode.log" | grep -E "^\[|^HBM|^config|^[a-z0-9_.]+ +[0-9,-]" | grep -v "weights\|eager\|built"
timeout "${T_GQA:-35}" python3 bench/tasks_bench.py --only gqa --steps 20 --json "$OUT/gqa.json" 2>&1 \
  | tee "$OUT/gqa.log" | tail -n 12
