"""Shared pieces of the dense decode task declarations (ids 16-63): argument checks, the flag bits
the device bodies test, and the CPU mirror of the
device's x staging (RMSNorm prologue with bf16 rounding)."""
from __future__ import annotations

import torch

from ..tensors import TensorRef, as_ref
from .tiling import require

HEADERS = ("tasks/dense_common.cuh",)   # helpers every dense body uses, emitted once per kernel


def source(name: str) -> str:
    """The device body of dense task type `name`: one file per type."""
    return f"tasks/{name}.cuh"

# flag bits, mirrored by megart::dense::kFlag* in tasks/dense_common.cuh
FLAG_RESIDUAL = 1
FLAG_NORM = 2
FLAG_LOGITS = 4

SCRATCH_BYTES = 256            # block reductions; x is staged right after it
MAX_K = 16384                  # longest x a GEMV-type body stages in shared memory (bf16)
STAGE_SMEM = SCRATCH_BYTES + 2 * MAX_K   # 33,024 B: under the 48 KiB default dynamic limit
ALIGN_BYTES = 16               # every vector-loaded operand starts on a 16-byte boundary

# Weight ring (tasks/dense_common.cuh): per warp, `slots` stages of one row pair x 256 16-byte chunks,
# filled by TMA bulk copies that the prewait starts before the instance's wait. Python decides the
# slot count (the C++ reads MEGART_DENSE_RING_SLOTS / _OFFSET) and sizes shared memory with it.
SLOT_BYTES = 2 * 256 * 16      # kSlotBytes: 2 rows x kStageChunks (32 lanes x kUnroll 8) x 16 B
RING_BUDGET = 192 << 10        # slots' share of the 227 KB an SM gives one CTA
MAX_RING_SLOTS = 4
RING_OFFSET = STAGE_SMEM       # after x staging; a multiple of 128
assert RING_OFFSET % 128 == 0


def ring_slots(cfg) -> int:
    """Ring slots per warp for a kernel config: MEGART_DENSE_RING_SLOTS if the caller set it (0 turns
    the ring off), else as many as RING_BUDGET holds (at most 4), and 0 when that is under 2 (512
    threads) or when two CTAs share an SM (they could not both have the ring's shared memory)."""
    from ..codegen import env_defines
    forced = {**env_defines(), **cfg.defines}.get("MEGART_DENSE_RING_SLOTS")
    if forced is not None:
        return int(forced)
    if cfg.min_blocks > 1:
        return 0
    slots = min(MAX_RING_SLOTS, RING_BUDGET // ((cfg.threads // 32) * SLOT_BYTES))
    return slots if slots >= 2 else 0


def ring_bytes(threads: int, slots: int) -> int:
    """Shared memory of the ring: issued counts and mbarriers (kRingHeadBytes), then the slots."""
    if slots <= 0:
        return 0
    warps = threads // 32
    head = -(-(warps * 4 + warps * slots * 8) // 128) * 128
    return head + warps * slots * SLOT_BYTES


def smem_for(cfg) -> int:
    """Dynamic shared memory of a GEMV-type body with a prewait: x staging, then the ring."""
    return STAGE_SMEM + ring_bytes(cfg.threads, ring_slots(cfg))


def defines_for(cfg) -> dict:
    return {"MEGART_DENSE_RING_SLOTS": ring_slots(cfg), "MEGART_DENSE_RING_OFFSET": RING_OFFSET}


def ref(task: str, value, name: str) -> TensorRef:
    require(value is not None, task, f"argument {name!r} is required")
    return as_ref(value, name)


def opt_ref(value, name: str) -> TensorRef | None:
    return None if value is None else as_ref(value, name)


def aligned(task: str, r: TensorRef, name: str) -> None:
    require(r.address % ALIGN_BYTES == 0, task,
            f"{name} ({r.tensor.name!r} at element {r.offset}) must start on a {ALIGN_BYTES}-byte boundary "
            "for 16-byte vector loads")


def check_k(task: str, k: int, multiple: int = 8) -> None:
    require(k % multiple == 0, task,
            f"the reduction length k={k} must be a multiple of {multiple} (16-byte weight rows)")
    require(0 < k <= MAX_K, task, f"k={k} is outside (0, {MAX_K}]: x is staged whole in shared memory")


def overlaps(a: TensorRef, b: TensorRef) -> bool:
    (alo, ahi), (blo, bhi) = a.byte_range, b.byte_range
    return alo < bhi and blo < ahi


def disjoint(task: str, a: TensorRef, an: str, b: TensorRef, bn: str) -> None:
    require(not overlaps(a, b), task,
            f"{an} and {bn} overlap: every instance reads all of {bn} while others write their slice of {an}")


def sub(r: TensorRef, lo: int, count: int) -> TensorRef:
    return r.tensor.ref(r.offset + lo, count)


def shape_of(task: str, value, name: str) -> tuple:
    """The shape of a whole megart Tensor (a TensorRef counts only when it covers its whole tensor)."""
    r = as_ref(value, name)
    require(r.offset == 0 and r.count == r.tensor.numel, task,
            f"{name} must be a whole tensor (its shape is needed), not a slice")
    return r.tensor.shape


def stage_x(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 copy of what the device stages in shared memory: x, or bf16(x * rsqrt(mean(x^2)+eps) * g)."""
    xf = x.float()
    if norm_weight is None:
        return xf
    rstd = torch.rsqrt((xf * xf).sum() / xf.numel() + torch.tensor(eps, dtype=torch.float32))
    return (xf * rstd * norm_weight.float()).to(torch.bfloat16).float()


def silu(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


def nbytes(r: TensorRef | None) -> int:
    return 0 if r is None else r.count * r.tensor.itemsize
