"""Runtime self-check: build a synthetic graph (copies, axpys, spins, barriers), compile it for the
GPU's arch (sm_90a without a GPU), verify and emulate it, and where a GPU exists run and profile it,
compare with the emulator and print the per-task table.

    python -m megart.selfcheck [--nw 132] [--steps 8]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from . import MegartError, PersistentKernel


def build(pk: PersistentKernel, seed: int = 0, size: int = 1 << 16) -> list:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bufs = [pk.tensor(torch.randn(size, generator=g).to(pk.device), f"buf{i}") for i in range(4)]
    for layer in range(6):
        a, b, c = rng.sample(bufs, 3)
        pk.task("copy", dst=a, src=b, tiles=pk.nw)
        pk.task("axpy", y=c.ref(0, size // 2), x=a.ref(size // 2, size // 2), a=0.5, tiles=pk.nw // 2 or 1)
        pk.task("spin", ns=2000, tiles=pk.nw)
        if layer % 2:
            pk.barrier()
    return bufs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nw", type=int, default=None, help="worker CTAs (default: the SM count; 132 without a GPU)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    try:
        pk = PersistentKernel(nw=args.nw, profile=gpu, profile_steps=args.steps)
        bufs = build(pk)
        t0 = time.perf_counter()
        pk.compile()
        r = pk.report
        print(f"compiled for {pk.arch} in {time.perf_counter() - t0:.2f} s ({'cache hit' if pk.compiled.cache_hit else 'NVRTC'}):"
              f" {r.registers} registers, {r.spill_bytes} spill bytes, {r.stack_bytes} B stack, "
              f"{pk.occupancy.per_sm} CTA/SM (limited by {pk.occupancy.limiter})")
        s = pk.schedule
        print(f"schedule verified: {s.total_instances} instances on {pk.nw} workers, {len(s.events)} events")
        want = pk.emulate(steps=args.steps)
        print(f"emulated {args.steps} steps on the CPU")
        if not gpu:
            print("no CUDA device: compile, verify and emulate passed; running and profiling need a GPU")
            return 0
        pk(steps=args.steps)
        bad = [b.name for b in bufs if not torch.equal(b.data.cpu(), want[b.name])]
        if bad:
            print(f"FAIL: GPU result differs from the emulator in {bad}", file=sys.stderr)
            return 1
        print(f"GPU matches the emulator bit for bit after {args.steps} steps\n")
        print(pk.profile().table())
        return 0
    except MegartError as exc:
        print(f"megart self-check failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
