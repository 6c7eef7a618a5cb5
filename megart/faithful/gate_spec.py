"""The plain data of a faithful gate: GateInputs (what one build produces) and GateSpec (what the gate of one
task type knows), and the seeded generator builders use. Kept apart from gates.py (the lookup and the
built-in table), so the decode adapters can use them without importing the lookup back."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import GraphError
from .codes import BAD_SHAPE, USAGE, GateError


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
    model_tiles: tuple = ()           # the LlamaModel tile keys that size this task's calls (--context llama_*)
    model_shape: Callable | None = None   # model_shape(model, instances) -> this spec's shape of one model call
                                      # (--context llama_*: a LlamaModel and the call's graph Instances);
                                      # None = the requested shape (--shape, else default_shape)
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



def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g
