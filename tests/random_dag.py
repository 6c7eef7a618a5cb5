"""Random task graphs of synthetic tasks (copy/axpy on overlapping f32 slices, spins, barriers),
so that forks, joins and diamonds arise from the data; shared by the CPU and GPU runtime tests."""
from __future__ import annotations

import random

import torch

import megart


def build(pk: megart.PersistentKernel, seed: int, calls: int = 60, buffers: int = 6, size: int = 4096,
          barriers: bool = True, spins: bool = True) -> dict:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bufs = [pk.tensor(torch.randn(size, generator=gen).to(pk.device), f"b{i}") for i in range(buffers)]
    for _ in range(calls):
        r = rng.random()
        if barriers and r < 0.06:
            pk.barrier()
            continue
        if spins and r < 0.12:
            pk.task("spin", ns=rng.choice([200, 1000, 3000]), tiles=rng.randint(1, 8))
            continue
        a, b = rng.sample(bufs, 2)
        n = rng.randint(1, size)
        lo_a, lo_b = rng.randint(0, size - n), rng.randint(0, size - n)
        tiles = rng.randint(1, 24)
        if rng.random() < 0.5:
            pk.task("copy", dst=a.ref(lo_a, n), src=b.ref(lo_b, n), tiles=tiles)
        else:
            pk.task("axpy", y=a.ref(lo_a, n), x=b.ref(lo_b, n), a=rng.choice([0.5, -0.25, 0.75]), tiles=tiles)
    return {t.name: t for t in bufs}
