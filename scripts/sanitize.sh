#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over a few Llama decode steps (scripts/sanitize_step.py),
# for the default build and for the weight stream. Each kernel is compiled once first (outside the tools), so
# the tools time the steps, not NVRTC. Prints each tool's summary; exit 1 if any tool reported errors or failed.
# Usage: scripts/sanitize.sh [sanitize_step.py args...]
#   LAYERS=n trims the model (default 16); TOOL_TIMEOUT=s per tool (default 150);
#   VARIANTS="default;MEGART_STREAM_SLOTS=0" (the model default streams its weights; 0: registers) and TOOLS="memcheck racecheck synccheck" choose what runs.
#   (racecheck reports the x-in-pieces hand-off of the default build, which it does not follow; the variant
#   MEGART_DENSE_X_ARRIVE_ALL=1 builds the form it follows: docs/ARCHITECTURE.md)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
bad=0
IFS=";" read -r -a variants <<< "${VARIANTS:-default;MEGART_STREAM_SLOTS=0}"
for v in "${variants[@]}"; do
  defs=$([ "$v" = default ] && echo "" || echo "$v")
  python3 scripts/sanitize_step.py --layers "${LAYERS:-16}" --defines "$defs" --steps 1 "$@" > /dev/null || bad=1
  for tool in ${TOOLS:-memcheck racecheck synccheck}; do
    echo "=== $tool $v"
    # (API errors are torch's and the driver's own probing, e.g. cuGetProcAddress; kernels are what is checked)
    timeout "${TOOL_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 \
      python3 scripts/sanitize_step.py --layers "${LAYERS:-16}" --defines "$defs" "$@" 2>&1 \
      | grep -aE "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_step|rror|access at|hazards"
    rc=${PIPESTATUS[0]}
    echo "exit $rc"
    [ "$rc" = 0 ] || bad=1
  done
done
exit $bad
