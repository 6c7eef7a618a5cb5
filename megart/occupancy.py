"""Co-residency: how many worker CTAs fit on one SM, and which resource limits it. A cooperative
launch of more CTAs than fit would be refused (or, without the flag, spin forever), so megart
checks before launching and names the limit. The same arithmetic runs without a GPU from the
ptxas report, and on a GPU it is cross-checked against the driver's occupancy query."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ResidencyError


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resources of a compute capability (CUDA occupancy calculator tables)."""
    regs: int = 65536
    reg_unit: int = 256             # registers are granted per warp in units of this many
    max_regs_per_thread: int = 255
    threads: int = 2048
    blocks: int = 32
    smem: int = 233472              # 228 KiB per SM on sm_90
    smem_per_block: int = 232448    # 227 KiB usable by one block
    smem_reserved: int = 1024       # the system keeps 1 KiB per block
    sm_count: int = 132


LIMITS = {"sm_90": SMLimits(), "sm_90a": SMLimits()}


def limits_for(arch: str, sm_count: int | None = None) -> SMLimits:
    base = LIMITS.get(arch, SMLimits())
    return base if sm_count is None else SMLimits(**{**base.__dict__, "sm_count": sm_count})


@dataclass(frozen=True)
class Occupancy:
    per_sm: int
    limiter: str        # "registers" | "shared memory" | "threads" | "blocks"
    detail: dict

    def capacity(self, sm_count: int) -> int:
        return self.per_sm * sm_count


def blocks_per_sm(registers: int, threads: int, smem_bytes: int, lim: SMLimits) -> Occupancy:
    """CTAs of this kernel that fit on one SM, and the binding limit."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // lim.reg_unit) * lim.reg_unit
    by = {
        "registers": lim.regs // (regs_per_warp * warps),
        "threads": lim.threads // (warps * 32),
        "blocks": lim.blocks,
        "shared memory": (lim.smem // (smem_bytes + lim.smem_reserved)) if smem_bytes <= lim.smem_per_block else 0,
    }
    limiter = min(by, key=lambda k: by[k])
    detail = dict(by, registers_per_thread=registers, threads_per_block=threads, smem_per_block=smem_bytes)
    return Occupancy(by[limiter], limiter, detail)


def check(nw: int, occ: Occupancy, sm_count: int) -> None:
    """Refuse a worker count that cannot be co-resident, naming the resource that limits it."""
    cap = occ.capacity(sm_count)
    if nw > cap:
        d = occ.detail
        raise ResidencyError(
            f"nw={nw} workers cannot all be co-resident: {occ.per_sm} CTA(s) per SM x {sm_count} SMs = {cap}. "
            f"Limited by {occ.limiter} (registers/thread {d['registers_per_thread']}, threads/CTA "
            f"{d['threads_per_block']}, shared memory/CTA {d['smem_per_block']} B; per-SM fit: "
            f"registers {d['registers']}, threads {d['threads']}, shared memory {d['shared memory']}, "
            f"blocks {d['blocks']}). Use nw <= {cap}, fewer threads, or less shared memory.")
