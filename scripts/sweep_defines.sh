#!/usr/bin/env bash
# Tuning sweep on the GPU: the GEMV task bench and the Llama-1B step under each set of kernel macros.
# Usage: scripts/sweep_defines.sh "" "MEGART_DENSE_RING_SLOTS=0" "MEGART_PREFETCH_KB=0,MEGART_DENSE_RING_SLOTS=2"
# (each argument is a MEGART_DEFINES value; OUT=dir for the JSON results)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
i=0
for defs in "$@"; do
  i=$((i + 1))
  echo "=== [$i] MEGART_DEFINES='$defs'"
  MEGART_DEFINES="$defs" python3 bench/tasks_bench.py --only "${ONLY:-gemv,lm_head}" --steps 20 --json "$OUT/tasks_$i.json" 2>&1 | tail -4
  MEGART_DEFINES="$defs" python3 bench/llama_decode.py --configs "${CONFIGS:-1b}" --compile-configs none --steps 100 \
    --out "$OUT/llama_$i" 2>&1 | tail -2
done
