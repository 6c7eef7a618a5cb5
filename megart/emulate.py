"""The CPU emulator: executes a schedule with each task type's one-instance reference on host
copies of the tensors, in a (seeded, random) legal interleaving of the queues."""
from __future__ import annotations

import random

import torch

from .schedule import Schedule
from .verify import simulate


def emulate(s: Schedule, steps: int = 1, seed: int = 0, host: dict | None = None) -> dict:
    """Run `steps` steps; returns {tensor name: CPU tensor} of the final contents. The starting
    contents are copied from the kernel's tensors unless `host` supplies them (it is updated in place)."""
    if host is None:
        host = {name: t.data.detach().to("cpu", copy=True) for name, t in s.graph.tensors.items()}
    rng = random.Random(seed)
    insts = s.instances

    def execute(uid):
        inst = insts[uid]
        if not inst.is_barrier:
            inst.type.reference(s.graph.host_views(inst, host))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # thousands of tiny ops: intra-op threading only adds overhead
    try:
        with torch.no_grad():
            for _ in range(steps):
                simulate(s, execute, rng)
    finally:
        torch.set_num_threads(threads)
    return host
