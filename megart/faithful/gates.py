"""Per-task gate specs: what "production decode geometry" means for each task type.

A gate spec says, for one registered task type:

* the shape the gate builds by default (the production decode shape) and how to parse `--shape`,
* how many instances (tiles) one call has at the production grid for a worker count,
* how to build seeded inputs at decode geometry (M = 1; one live row per active MoE expert; one query
  token against the real KV length) and the PyTorch whole-op reference of the call's output, with the
  rows the correctness check looks at (the live rows),
* the bytes one call moves (for achieved bandwidth; default: the task type's own cost model),
* a reduced shape for the CPU emulator when the production one would take too long there.

Specs come from two places, first match wins:

1. `register_gate(GateSpec(...))` (tests, task authors who prefer it),
2. the task type's declaration: `TaskType(gate=...)`, a callable returning the GateSpec or a
   "module:function" reference to one (the built-ins name theirs: the synthetic ones below, the decode
   types' in decode_gates.py).
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from .. import registry
from ..errors import RegistryError
from .codes import UNKNOWN_TASK, GateError
from .gate_spec import GateInputs, GateSpec, generator  # noqa: F401  (the spec types live there)


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
    """The spec TaskType.gate gives (None when the type declares no gate)."""
    hook = ttype.gate
    if hook is None:
        return None
    if isinstance(hook, str):           # "module:function", resolved here rather than imported by the declaration
        module, _, name = hook.partition(":")
        try:
            hook = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise RegistryError(f"task {ttype.name!r}: gate {ttype.gate!r} names no function "
                                f"('module:function'): {exc}") from None
    spec = hook() if callable(hook) and not isinstance(hook, GateSpec) else hook
    if not isinstance(spec, GateSpec) or spec.task != ttype.name:
        raise RegistryError(f"task {ttype.name!r}: gate {ttype.gate!r} must give a GateSpec for task "
                            f"{ttype.name!r}, got {spec!r:.120}")
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
    spec = spec or _from_declaration(ttype)
    if spec is None:
        raise GateError(UNKNOWN_TASK, f"task {task!r} (id {ttype.id}) is registered but has no faithful gate spec "
                                      "(production shape, input builder, PyTorch reference). Add one with "
                                      "megart.faithful.gates.register_gate(...) or gate=... in its "
                                      f"declaration. Tasks with a gate: {', '.join(available()) or 'none'}.")
    return spec


def available() -> list[str]:
    out = []
    for t in registry.all_types():
        if t.id in registry.NO_BODY:
            continue
        try:
            if t.name in _GATES or _from_declaration(t) is not None:
                out.append(t.name)
        except Exception:      # a broken plug-in must not hide the others
            continue
    return out


# ------------------------------------------------------------------------------------------------
# helpers shared by specs
# ------------------------------------------------------------------------------------------------
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


def axpy() -> GateSpec:
    return _synthetic("axpy", _bind_call(_axpy_build))


def copy() -> GateSpec:
    return _synthetic("copy", _bind_call(_copy_build))
