"""Emulating a tensor-parallel group on the CPU: every rank's schedule in one joint interleaving, each
instance through its task type's reference, in place on the kernels' own tensors. A peer buffer is the very
tensor the peer rank owns (megart.peer_memory.HostPeers), so a rank's peer_copy lands where the peer reads."""
from __future__ import annotations

import random

from ..errors import GraphError
from ..verify import simulate_ranks
from .reference import run_reference, run_steps


def emulate_ranks(kernels: list, steps: int = 1, seed: int = 0) -> list:
    """Run `steps` steps of the group (kernels: compiled CPU PersistentKernels, one per rank, in rank order).
    Returns each rank's {tensor name: tensor} (the kernels' own tensors, updated in place)."""
    for r, pk in enumerate(kernels):
        pk._need_compiled()
        if pk.device.type != "cpu":
            raise GraphError("emulate_ranks runs CPU kernels (PersistentKernel(device='cpu')); on GPUs each "
                             "rank is its own process")
        if pk.schedule.rank != r or pk.schedule.world != len(kernels):
            raise GraphError(f"kernel {r} is rank {pk.schedule.rank} of {pk.schedule.world}; pass ranks 0..."
                             f"{len(kernels) - 1} of one group, in order")
    schedules = [pk.schedule for pk in kernels]
    hosts = [{name: t.data for name, t in pk.graph.tensors.items()} for pk in kernels]
    rng = random.Random(seed)
    execute = lambda r, uid: run_reference(schedules[r], hosts[r], uid)  # noqa: E731
    run_steps(steps, lambda: simulate_ranks(schedules, execute, rng))
    return hosts
