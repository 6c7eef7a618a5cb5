"""Per-task gate specs: what "production decode geometry" means for each task type.

A gate spec says, for one registered task type:

* the shape the gate builds by default (the production decode shape) and how to parse `--shape`,
* how many instances (tiles) one call has at the production grid for a worker count,
* how to build seeded inputs at decode geometry (M = 1; one live row per active MoE expert; one query
  token against the real KV length) and the PyTorch whole-op reference of the call's output, with the
  rows the correctness check looks at (the live rows),
* the bytes one call moves (for achieved bandwidth; default: the task type's own cost model),
* a reduced shape for the CPU emulator when the production one would take too long there.

Specs come from three places, first match wins:

1. `register_gate(GateSpec(...))` (tests, user task types, task authors who prefer it),
2. a task type's declaration: `TaskType(extra={"faithful": GateSpec | callable -> GateSpec})`,
3. the built-in table below (synthetic tasks, and adapters for the decode task types that look up
   the geometry builders in megart.geometry when those modules provide them).
"""
from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import registry
from ..errors import GraphError, RegistryError
from .codes import BAD_SHAPE, UNKNOWN_TASK, USAGE, GateError


@dataclass
class GateInputs:
    """What `GateSpec.build` returns.

    tensors:   name -> tensor on the run device (the gate adds each with pk.tensor(t, name)).
    call:      keyword arguments of pk.task(...) except `tiles`; a value that is one of `tensors`
               (the same object) is replaced by its megart handle.
    output:    name of the tensor that holds the call's result after one step.
    result:    optional function {tensor name: tensor} -> the tensor to check, when the result is
               derived from several outputs (attention partials merged, q plus the appended cache rows).
    expected:  the PyTorch whole-op reference of `output` after one step, computed from the initial
               inputs (any dtype; compared in float64).
    live:      optional function selecting the live part of a tensor shaped like `expected`
               (e.g. the one real row of each active MoE expert); None = all of it.
    bytes, flops: what one call moves/computes; None = the task type's cost model.
    note:      one line printed with the result (e.g. which experts are live).
    """
    tensors: dict
    call: dict
    output: str
    expected: torch.Tensor
    live: Callable | None = None
    live_desc: str = "all rows"
    result: Callable | None = None
    bytes: int | None = None
    flops: int | None = None
    note: str = ""


@dataclass
class GateSpec:
    task: str
    dims: tuple                       # names of the shape's dimensions, e.g. ("N", "K")
    default_shape: tuple              # the production decode shape
    build: Callable                   # build(shape, *, device, seed, decode_m1, nw, tiles) -> GateInputs
                                      # (keywords it does not declare are not passed)
    tiles: Callable = None            # tiles(shape, nw) -> instances of one call; default nw
    cpu_shape: tuple | None = None    # emulate at this shape when the production one is too big
    cpu_max_elems: int = 1 << 27      # ... i.e. when its tensors hold more elements than this
    cpu_keep: tuple = ()              # dims the reduced shape takes from the requested one (e.g. ("K",))
    decode_m1: str = "native"         # "native": always M = 1 | "mode": --decode-m1 selects live rows | "none"
    check_shape: Callable | None = None   # check_shape(shape) -> None or raise GraphError/ValueError
    doc: str = ""
    origin: str = "megart.faithful.gates"
    extra: dict = field(default_factory=dict)

    def production_tiles(self, shape: tuple, nw: int) -> int:
        return int(self.tiles(shape, nw)) if self.tiles is not None else int(nw)

    def shape_str(self, shape: tuple) -> str:
        return "x".join(str(int(s)) for s in shape)

    def parse_shape(self, text: str | None) -> tuple:
        if text is None:
            return tuple(self.default_shape)
        if not re.fullmatch(r"\s*\d+(\s*[xX*,]\s*\d+)*\s*", text):
            raise GateError(USAGE, f"--shape {text!r} is not a shape: write the dimensions as integers joined by "
                                   f"'x', e.g. {self.shape_str(self.default_shape)!r} ({'x'.join(self.dims)}).")
        shape = tuple(int(v) for v in re.split(r"\s*[xX*,]\s*", text.strip()))
        if len(shape) != len(self.dims):
            raise GateError(BAD_SHAPE, f"task {self.task!r} takes a {len(self.dims)}-dimensional shape "
                                       f"{'x'.join(self.dims)} (default {self.shape_str(self.default_shape)}), "
                                       f"but --shape {text!r} has {len(shape)} dimension(s).")
        if any(s <= 0 for s in shape):
            raise GateError(BAD_SHAPE, f"task {self.task!r} refuses --shape {text!r}: every dimension must be "
                                       "positive.")
        if self.check_shape is not None:
            try:
                self.check_shape(shape)
            except (GraphError, ValueError) as exc:
                raise GateError(BAD_SHAPE, f"task {self.task!r} refuses shape {self.shape_str(shape)}: {exc}")
        return shape

    def cpu_reduce(self, shape: tuple) -> tuple[tuple, list]:
        """The shape the CPU emulator runs and the names of the dims that differ from `shape`: `shape`
        itself when small enough, else cpu_shape with the dims in cpu_keep taken from `shape` (a GEMV's K
        decides its numerics and staging, so it is kept), or plain cpu_shape if that would not fit."""
        if self.cpu_shape is None or self.elements(shape) <= self.cpu_max_elems:
            return tuple(shape), []
        kept = tuple(s if d in self.cpu_keep else c for d, s, c in zip(self.dims, shape, self.cpu_shape))
        if self.elements(kept) > self.cpu_max_elems:
            kept = tuple(self.cpu_shape)
        return kept, [d for d, a, b in zip(self.dims, shape, kept) if a != b]

    def elements(self, shape: tuple) -> int:
        """Rough input size in elements (decides whether the CPU emulator runs a reduced shape)."""
        fn = self.extra.get("elements")
        return int(fn(shape)) if fn else int(math.prod(shape))


_GATES: dict[str, GateSpec | Callable] = {}


def register_gate(spec: GateSpec, *, replace: bool = False) -> GateSpec:
    """Add (or with replace=True, swap) the gate spec of a task type."""
    if spec.task in _GATES and not replace:
        raise RegistryError(f"a gate spec for {spec.task!r} is already registered")
    _GATES[spec.task] = spec
    return spec


def unregister_gate(task: str) -> None:
    _GATES.pop(task, None)


def _from_declaration(ttype) -> GateSpec | None:
    hook = (ttype.extra or {}).get("faithful")
    if hook is None:
        return None
    spec = hook() if callable(hook) and not isinstance(hook, GateSpec) else hook
    if not isinstance(spec, GateSpec):
        raise RegistryError(f"task {ttype.name!r}: extra['faithful'] must be a GateSpec or return one")
    return spec


def get(task: str) -> GateSpec:
    """The gate spec of a task (GateError UNKNOWN_TASK, naming the ones that exist, if none)."""
    try:
        ttype = registry.get(task)
    except RegistryError:
        raise GateError(UNKNOWN_TASK, f"unknown task {task!r}: no task type of that name is registered. Tasks "
                                      f"with a faithful gate: {', '.join(available()) or 'none'}.") from None
    spec = _GATES.get(task)
    if callable(spec) and not isinstance(spec, GateSpec):
        spec = spec()
    spec = spec or _from_declaration(ttype) or _builtin(ttype.name)
    if spec is None:
        raise GateError(UNKNOWN_TASK, f"task {task!r} (id {ttype.id}) is registered but has no faithful gate spec "
                                      "(production shape, input builder, PyTorch reference). Add one with "
                                      "megart.faithful.gates.register_gate(...) or extra={'faithful': ...} in its "
                                      f"declaration. Tasks with a gate: {', '.join(available()) or 'none'}.")
    return spec


def available() -> list[str]:
    out = []
    for t in registry.all_types():
        if t.id in getattr(registry, "NO_BODY", (registry.BARRIER_ID,)):
            continue
        try:
            if t.name in _GATES or _from_declaration(t) is not None or _builtin(t.name) is not None:
                out.append(t.name)
        except Exception:      # a broken plug-in must not hide the others
            continue
    return out


# ------------------------------------------------------------------------------------------------
# helpers shared by specs
# ------------------------------------------------------------------------------------------------
def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def randn(shape, seed_gen: torch.Generator, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """Seeded randn on the CPU (the same bytes on every machine), scaled, cast."""
    t = torch.randn(*shape, generator=seed_gen, dtype=torch.float32)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype)


def _call_kwargs(fn: Callable, **kw):
    """Call a plug-in builder with only the keyword arguments it accepts."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kw)
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kw)
    return fn(**{k: v for k, v in kw.items() if k in params})


# ------------------------------------------------------------------------------------------------
# synthetic tasks (always present): the machinery's own gate, and a stand-in in the tests
# ------------------------------------------------------------------------------------------------
def _axpy_build(shape, *, device, seed, decode_m1=False, nw=None):
    (n,) = shape
    g = generator(seed)
    x, y = randn((n,), g), randn((n,), g)
    a = 0.5
    expected = (torch.tensor(a, dtype=torch.float32) * x) + y
    return GateInputs(tensors={"x": x.to(device), "y": y.to(device)},
                      call={"a": a}, output="y", expected=expected,
                      bytes=3 * 4 * n, flops=2 * n)


def _copy_build(shape, *, device, seed, decode_m1=False, nw=None):
    (n,) = shape
    g = generator(seed)
    src = randn((n,), g)
    return GateInputs(tensors={"dst": torch.zeros(n).to(device), "src": src.to(device)}, call={},
                      output="dst", expected=src.clone(), bytes=2 * 4 * n)


def _synthetic(task: str, build) -> GateSpec:
    # 16 Mi f32 elements: 64 MiB per operand, larger than the H200's 60 MB L2, so the stream is HBM-bound
    return GateSpec(task=task, dims=("N",), default_shape=(1 << 24,), build=build,
                    tiles=lambda shape, nw: nw, cpu_shape=(1 << 20,), cpu_max_elems=1 << 22,
                    decode_m1="native",
                    doc=f"synthetic {task} over N f32 elements, one tile per worker")


def _bind_call(build):
    """Give synthetic builders the tensor handles under the names pk.task expects."""
    def wrapped(shape, **kw):
        gi = _call_kwargs(build, shape=shape, **kw)
        gi.call = {**{k: gi.tensors[k] for k in gi.tensors}, **gi.call}
        return gi
    return wrapped


_BUILTIN: dict[str, Callable[[], GateSpec | None]] = {
    "axpy": lambda: _synthetic("axpy", _bind_call(_axpy_build)),
    "copy": lambda: _synthetic("copy", _bind_call(_copy_build)),
}


def _builtin(name: str) -> GateSpec | None:
    fn = _BUILTIN.get(name)
    if fn is None:
        from . import decode_gates      # adapters for the decode task types (lazy: they import geometry)
        fn = decode_gates.ADAPTERS.get(name)
    return fn() if fn is not None else None
