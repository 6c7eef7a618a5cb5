#!/usr/bin/env bash
# Per-instruction stall sampling of the decode megakernel: Nsight Compute over a few Llama decode steps
# (scripts/sanitize_step.py), its source page exported as CSV, then bench/sass_stalls.py's tables.
# Usage: scripts/ncu_stalls.sh [CONFIG [LAYERS [OPCODE]]]   e.g. scripts/ncu_stalls.sh 1b_fp8_all 4 F2FP.F16.E4M3
#   OUT=dir for the report and CSV (default ./out). ncu runs the kernel at its own base clocks: compare
#   builds with each other, not with bench/ timings. The report is removed (it is large); the CSV stays.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MEGART_CACHE_DIR=${MEGART_CACHE_DIR:-/tmp/megart-cache}
config=${1:-1b}; layers=${2:-4}; around=${3:-}
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 scripts/sanitize_step.py --config "$config" --layers "$layers" --steps 1 > /dev/null || exit 1  # (compile outside ncu)
# the second of three steps' launches (the first warms up)
ncu -k regex:megart_kernel -s 1 -c 1 --section WarpStateStats --section SourceCounters -o "$OUT/$config" -f \
  python3 scripts/sanitize_step.py --config "$config" --layers "$layers" --steps 3 2>&1 | tail -2
ncu -i "$OUT/$config.ncu-rep" --page source --csv --print-source sass > "$OUT/${config}_sass.csv" || exit 1
rm -f "$OUT/$config.ncu-rep"
python3 bench/sass_stalls.py "$OUT/${config}_sass.csv" ${around:+--around "$around"}
