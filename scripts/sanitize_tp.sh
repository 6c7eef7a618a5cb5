#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over a few tensor-parallel decode steps (scripts/sanitize_tp_step.py),
# every rank a process under torchrun and every process under the tool (--target-processes all). The kernels
# are compiled once first, outside the tools. Prints each tool's summaries; exit 1 if any tool reported errors.
# Usage: scripts/sanitize_tp.sh [sanitize_tp_step.py args...]   (NPROC=2, LAYERS=2, TOOL_TIMEOUT=300,
#   TOOLS="memcheck racecheck")
set -u
cd "$(dirname "$0")/.."
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
# (scripts/tp_run.sh: torchrun with NPROC ranks and NVLink multicast off)
run=(scripts/tp_run.sh scripts/sanitize_tp_step.py --layers "${LAYERS:-2}")
bad=0
"${run[@]}" --steps 1 "$@" > /dev/null || bad=1
for tool in ${TOOLS:-memcheck racecheck}; do
  echo "=== $tool"
  timeout "${TOOL_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no \
    --error-exitcode 9 "${run[@]}" "$@" 2>&1 | grep -aE "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_tp_step|rror|access at|hazards"
  rc=${PIPESTATUS[0]}
  echo "exit $rc"
  [ "$rc" = 0 ] || bad=1
done
exit $bad
