"""Synthetic task types that exercise the runtime itself: no-op, timed spin, slice copy, axpy.
They are what the runtime tests, the dispatch benchmark and the self-check are built from."""
from __future__ import annotations

from ..registry import BARRIER_ID, JOIN_ID, Cost, TaskType, ptr, register, scalar
from ..tensors import as_ref
from .tiling import even_tiles, require


def _no_ref(p) -> None:
    """Tasks with no data effect."""


def _count_split(nw, tiles=1, **kw):
    return [dict(kw) for _ in range(tiles)]


register(TaskType(name="barrier", id=BARRIER_ID, params=(), source="", reference=_no_ref,
                  doc="Grid-barrier arrival: signals the barrier event, then waits for all workers."),
         builtin=True)

register(TaskType(name="join", id=JOIN_ID, params=(), source="", reference=_no_ref,
                  doc="Wait-only entry added by the scheduler in front of an instance with more waits "
                      "than one descriptor holds."), builtin=True)

register(TaskType(name="noop", id=2, params=(), source="tasks/noop.cuh", reference=_no_ref,
                  split=lambda nw, tiles=1: [{} for _ in range(tiles)],
                  doc="Does nothing; measures dispatch overhead."), builtin=True)


def _spin_split(nw, tiles=1, ns=1000):
    require(0 <= ns < 10**12, "spin", f"ns must be in [0, 1e12), got {ns}")
    return [dict(ns=int(ns)) for _ in range(tiles)]


register(TaskType(name="spin", id=3, params=(scalar("ns", "i64"),), source="tasks/spin.cuh",
                  reference=_no_ref, split=_spin_split,
                  doc="Busy-waits `ns` nanoseconds on %globaltimer; a task of known length."), builtin=True)


def _elementwise_split(name, nw, tiles, dst, src, **scalars):
    d, s = as_ref(dst, "dst" if name == "copy" else "y"), as_ref(src, "src" if name == "copy" else "x")
    require(d.count == s.count, name, f"source has {s.count} elements, destination {d.count}")
    out = []
    for lo, hi in even_tiles(d.count, tiles):
        inst = {"n": hi - lo, **scalars}
        inst["dst" if name == "copy" else "y"] = d.tensor.ref(d.offset + lo, hi - lo)
        inst["src" if name == "copy" else "x"] = s.tensor.ref(s.offset + lo, hi - lo)
        out.append(inst)
    return out


def _copy_ref(p) -> None:
    p.dst.copy_(p.src)


register(TaskType(
    name="copy", id=4, gate="megart.faithful.gates:copy",
    params=(ptr("dst", "f32", "out"), ptr("src", "f32", "in"), scalar("n")),
    source="tasks/copy.cuh", reference=_copy_ref,
    split=lambda nw, tiles=1, dst=None, src=None: _elementwise_split("copy", nw, tiles, dst, src),
    cost=lambda dst, src, **_: Cost(bytes=2 * as_ref(dst, "dst").count * 4),
    doc="dst[i] = src[i] over an f32 slice."), builtin=True)


def _axpy_ref(p) -> None:
    # the device body rounds the product, then the sum (no FMA), so this matches it bit for bit
    import torch
    prod = (p.x * torch.tensor(p.a, dtype=torch.float32))
    p.y.copy_(prod + p.y)


register(TaskType(
    name="axpy", id=5, gate="megart.faithful.gates:axpy",
    params=(ptr("y", "f32", "inout"), ptr("x", "f32", "in"), scalar("a", "f32"), scalar("n")),
    source="tasks/axpy.cuh", reference=_axpy_ref,
    split=lambda nw, tiles=1, y=None, x=None, a=1.0: _elementwise_split("axpy", nw, tiles, y, x, a=float(a)),
    cost=lambda y, x, **_: Cost(bytes=3 * as_ref(y, "y").count * 4, flops=2 * as_ref(y, "y").count),
    doc="y[i] = a * x[i] + y[i] over an f32 slice (product and sum rounded separately)."), builtin=True)
