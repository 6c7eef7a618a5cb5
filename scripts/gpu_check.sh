#!/usr/bin/env bash
# One call on the H200: GPU tests (a skip is a failure) then the benchmarks; a short table last.
# Usage: scripts/gpu_check.sh [pytest args...]   (OUT=dir for logs and results; default ./out)
# Without pytest args the GPU modules run in TEST_GROUPS (default 3) pytest processes at once: most of a cold run is
# NVRTC compiling kernels one after another, which the CPUs then do in parallel (the whole suite took 292 s
# in three processes on a cold H200 host, against more than 580 s in one). The processes share the GPU by time
# slices; each kernel keeps all its CTAs resident within its own slice. TEST_GROUPS=1 runs one process.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"; export MEGART_GPU_OUT=$OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MEGART_REQUIRE_GPU=1
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
if [ $# -gt 0 ] || [ "${TEST_GROUPS:-3}" -le 1 ]; then
  python3 -m pytest -q -p no:cacheprovider "${@:-tests/gpu}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  echo "GPU tests exit: ${PIPESTATUS[0]}"
else
  # the modules dealt to the groups largest first (by test count), each group's log in $OUT/gpu_tests_<i>.log
  mapfile -t groups < <(python3 - "${TEST_GROUPS:-3}" <<'PY'
import re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                     capture_output=True, text=True).stdout
count = {}
for line in out.splitlines():
    m = re.match(r"(tests/gpu/[\w.]+\.py)::", line)
    if m:
        count[m.group(1)] = count.get(m.group(1), 0) + 1
n = int(sys.argv[1])
groups, load = [[] for _ in range(n)], [0] * n
for mod, c in sorted(count.items(), key=lambda kv: -kv[1]):
    i = load.index(min(load))
    groups[i].append(mod)
    load[i] += c
print("\n".join(" ".join(g) for g in groups if g))
PY
)
  pids=()
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider ${groups[$i]} > "$OUT/gpu_tests_$i.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "group $i (${groups[$i]}):"; tail -3 "$OUT/gpu_tests_$i.log"
  done
  cat "$OUT"/gpu_tests_*.log > "$OUT/gpu_tests.log"
  echo "GPU tests exit: $rc"
fi
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
