#!/usr/bin/env bash
# Run a tensor-parallel megart program on the GPUs of this host, one process per GPU (docs/TP.md):
#   scripts/tp_run.sh bench/tp_decode.py --out results.json        (NPROC=2 by default)
#   scripts/tp_run.sh -m pytest -q tests/gpu/test_tp_gpu.py
# NVLink multicast stays off: a program using it can take a shared host's GPUs out of service.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" "$@"
