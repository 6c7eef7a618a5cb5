#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over a few Llama decode steps (scripts/sanitize_step.py),
# for the default build and for the weight stream. Prints each tool's error summary; exit 1 if any reported errors.
# Usage: scripts/sanitize.sh [sanitize_step.py args...]   (LAYERS=n trims the model; TOOL_TIMEOUT=s per tool)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
bad=0
for defs in "" "MEGART_STREAM_SLOTS=auto"; do
  for tool in memcheck racecheck synccheck; do
    echo "=== $tool ${defs:-default}"
    timeout "${TOOL_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python3 scripts/sanitize_step.py --layers "${LAYERS:-16}" --defines "$defs" "$@" 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_step|Error|error" | head -8
    rc=${PIPESTATUS[0]}
    echo "exit $rc"
    [ "$rc" = 0 ] || bad=1
  done
done
exit $bad
