"""The CPU emulator: executes a schedule with each task type's one-instance reference on host
copies of the tensors, in a (seeded, random) legal interleaving of the queues."""
from __future__ import annotations

import random

import torch

from ..errors import GraphError
from ..schedule import Schedule
from ..verify import simulate


def host_copies(tensors: dict) -> dict:
    """CPU copies of the kernel's tensors {name: Tensor}. Tensors that are views of one allocation
    become views of one host buffer, so a write through one name is seen through the others, as on
    the device (copying each name separately would let overlapping views drift apart)."""
    by_storage: dict = {}
    for name, t in tensors.items():
        by_storage.setdefault(t.storage_key, []).append((name, t))
    host = {}
    for group in by_storage.values():
        if len(group) == 1:
            name, t = group[0]
            host[name] = t.data.detach().to("cpu", copy=True)
            continue
        lo = min(t.ptr for _, t in group)
        hi = max(t.ptr + t.nbytes for _, t in group)
        first = group[0][1].data
        raw = torch.empty(0, dtype=torch.uint8, device=first.device)
        raw.set_(first.untyped_storage(), 0, (first.untyped_storage().nbytes(),))
        buf = raw[lo - first.untyped_storage().data_ptr():hi - first.untyped_storage().data_ptr()].to("cpu", copy=True)
        for name, t in group:
            off = t.ptr - lo
            if off % t.itemsize:
                raise GraphError(f"tensor {name!r} starts {off} bytes into memory it shares with "
                                 f"{group[0][0]!r}, not a multiple of its {t.itemsize}-byte elements: the "
                                 "emulator cannot view the shared bytes as both")
            host[name] = buf[off:off + t.nbytes].view(t.data.dtype).view(t.shape)
    return host


def emulate(s: Schedule, steps: int = 1, seed: int = 0, host: dict | None = None) -> dict:
    """Run `steps` steps; returns {tensor name: CPU tensor} of the final contents. The starting
    contents are copied from the kernel's tensors unless `host` supplies them (it is updated in place)."""
    if host is None:
        host = host_copies(s.graph.tensors)
    rng = random.Random(seed)
    run_steps(steps, lambda: simulate(s, lambda uid: run_reference(s, host, uid), rng))
    return host


def run_reference(s: Schedule, host: dict, uid: int) -> None:
    """Instance `uid` of `s` by its task type's CPU reference, on the host buffers (a barrier does nothing)."""
    inst = s.instances[uid]
    if not inst.is_barrier:
        inst.type.reference(s.graph.host_views(inst, host))


def run_steps(steps: int, one_step) -> None:
    """one_step() `steps` times, without autograd and on one torch thread (thousands of tiny ops:
    intra-op threading only adds overhead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(steps):
                one_step()
    finally:
        torch.set_num_threads(threads)
