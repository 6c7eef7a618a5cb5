"""The task-type table: each task type is declared once (name, stable numeric id, parameter
layout, device source, CPU reference, instance splitter, cost model). The C++ parameter structs
and the dispatch switch are generated from these declarations; nothing else names a task id."""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import RegistryError
from .layout import PARAM_WORDS
from .tensors import DTYPES

SCALAR_KINDS = {"i32": "int", "f32": "float", "i64": "long long"}
# "weight": read-only for the whole kernel, so the body may use the non-coherent read-only path;
# "in": read, but possibly written by another task of the same launch, so plain coherent loads.
# "sync": words the instances of one call update with atomics to order themselves (arrival counters: the
# last arrival does the call's final step). For dependency inference a read (after earlier writers, never
# ordered among the call's own instances); the pointer is writable, nothing else may treat the words as a
# weight, and the runtime zeroes them with the event counters after an abort.
ACCESS = ("in", "weight", "out", "inout", "sync")
BARRIER_ID = 1          # the runtime's own grid-barrier arrival; has no body
JOIN_ID = 6             # a wait-only queue entry the scheduler adds when an instance has too many waits
NO_BODY = (BARRIER_ID, JOIN_ID)
USER_ID_BASE = 1000     # ids below are megart's own; user task types take ids from here up
MAX_ID = 2**31 - 1      # the descriptor's type word is a signed 32-bit int
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names become C++ identifiers (megart_params_<name>, struct fields): a C++ keyword or a reserved
# identifier (leading underscore + capital, or a double underscore) would break the generated code.
_CXX_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t class
compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype
default delete do double dynamic_cast else enum explicit export extern false float for friend goto if inline
int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected public register
reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch template
this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t
while xor xor_eq""".split())


def _bad_identifier(name) -> str | None:
    """Why `name` cannot be a task or parameter name (None when it can)."""
    if not isinstance(name, str) or not _IDENT.match(name):
        return "must be a C/Python identifier"
    if keyword.iskeyword(name):
        return "is a Python keyword"
    if name in _CXX_KEYWORDS:
        return "is a C++ keyword"
    if "__" in name or re.match(r"_[A-Z]", name):
        return "is a reserved C++ identifier (double underscore, or underscore + capital)"
    return None


@dataclass(frozen=True)
class Param:
    """One 8-byte parameter slot: a pre-offset pointer (with element dtype and access) or a scalar."""
    name: str
    kind: str                 # "ptr" | "i32" | "f32" | "i64"
    dtype: str | None = None  # element dtype of a pointer
    access: str | None = None  # "in" | "weight" | "out" | "inout" | "sync" for pointers
    optional: bool = False     # a pointer the splitter may leave None: packed as nullptr, no dependency
    tagged: bool = False       # a bf16 pointer that also takes a tagged tensor (megart/tagged.py): an "in" read
    #                            of one is polled (no event wait), an "out" write stores tagged words. The body
    #                            learns which from its own flags (the splitter sets them from the tensor)

    @property
    def reads(self) -> bool:
        return self.kind == "ptr" and self.access in ("in", "weight", "inout", "sync")

    @property
    def mutates(self) -> bool:
        """The device changes the bytes: a declared write, or a sync word's atomics."""
        return self.writes or (self.kind == "ptr" and self.access == "sync")

    @property
    def writes(self) -> bool:
        return self.kind == "ptr" and self.access in ("out", "inout")

    def c_decl(self) -> str:
        if self.kind == "ptr":
            ctype = DTYPES[self.dtype][1]
            if self.access == "weight":
                return f"const {ctype}* __restrict__ {self.name};"
            const = "const " if self.access == "in" else ""
            return f"{const}{ctype}* {self.name};"
        ctype = SCALAR_KINDS[self.kind]
        if self.kind == "i64":
            return f"{ctype} {self.name};"
        return f"{ctype} {self.name}; int _pad_{self.name};"


def ptr(name: str, dtype: str, access: str = "in", optional: bool = False, tagged: bool = False) -> Param:
    return Param(name, "ptr", dtype, access, optional, tagged)


def scalar(name: str, kind: str = "i32") -> Param:
    return Param(name, kind)


@dataclass(frozen=True)
class Cost:
    """What one call of a task moves and computes, for achieved-bandwidth figures."""
    bytes: int
    flops: int = 0


@dataclass(frozen=True)
class TaskType:
    name: str
    id: int
    params: tuple[Param, ...]
    source: str                       # "tasks/<file>.cuh" under the source root, or an absolute path
    reference: Callable               # reference(p) -> None: one instance on CPU torch views, in place
    split: Callable | None = None     # split(nw=, tiles=, **args) -> list[dict]: per-instance params
    cost: Callable | None = None      # cost(**args) -> Cost for the whole call
    smem_bytes: int = 0               # dynamic shared memory one instance needs
    prefetch: bool = False            # source defines megart_prefetch_<name>(p) (weights to L2)
    prewait: bool = False             # source defines megart_prewait_<name>(p, smem), run before the
    #                                   instance's waits, and megart_drain_<name>(p, smem), run after the
    #                                   body or an abort. The prewait may read only what no task of the
    #                                   launch writes ("weight" params: the graph refuses writers of them)
    stream: bool = False              # the weights stream through the launch-wide ring (csrc/weight_stream.cuh):
    #                                   source defines plan_<name>(p), the per-instance weight stream as a
    #                                   dense MatvecPlan (row pairs x 16-byte chunks in consumption order),
    #                                   and its body reads them with dense::matvec_prewaited<FP8, P>
    stream_format: str = "dense"      # what its stages are (codegen.STREAM_FORMATS): "dense" as above, or "kv"
    #                                   (attention_decode: blocks of K/V cache rows, megart_attn::kv_stream_open)
    smem_for: Callable | None = None  # smem_for(cfg) -> bytes, when it depends on the kernel config
    defines_for: Callable | None = None   # defines_for(cfg) -> {macro: value} this type's source needs
    macros_for: Callable | None = None    # macros_for([params of the kernel's instances of this type], threads)
    #                                       -> {macro: int}: code only some instances need, compiled in only
    #                                       then (types asking for one macro get the largest value)
    writes_of: Callable | None = None  # writes_of(params) -> {pointer param: [(lo, hi) elements of its ref]}: what
    #                                   an instance writes where that is not its whole ref (rows dealt in rounds);
    #                                   the graph's dependencies and tagged-word checks use these ranges
    headers: tuple = ()               # shared device headers the body needs, emitted once per kernel
    hostsim: bool = False             # the body also compiles for the host (its PTX-only pieces have host forms
    #                                   under #ifndef __CUDA_ARCH__): the host simulation runs it (megart/emulate)
    generated: Callable | None = None  # generated(t) -> C++ that codegen emits right after the body: device
    #                                   functions the declaration derives (the dense types' prefetch/prewait/drain)
    tol: float | None = None          # full-output relative error the device result may have against the
    #                                   whole-op fp32 reference (with cosine >= 0.99); measured, see docs/TASKS.md
    gate: str | Callable | None = None  # the faithful gate's spec (docs/FAITHFUL.md): a callable returning a
    #                                   GateSpec, or "module:function" naming one (a reference, so a declaration
    #                                   at the bottom floor does not import the gate machinery above it)
    doc: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def struct_name(self) -> str:
        return f"megart_params_{self.name}"

    @property
    def body_name(self) -> str:
        return f"megart_task_{self.name}"

    @property
    def prefetch_name(self) -> str:
        return f"megart_prefetch_{self.name}"

    @property
    def prewait_name(self) -> str:
        return f"megart_prewait_{self.name}"

    @property
    def drain_name(self) -> str:
        return f"megart_drain_{self.name}"

    @property
    def plan_name(self) -> str:
        return f"plan_{self.name}"

    def shared_bytes(self, cfg) -> int:
        """Dynamic shared memory one instance needs in a kernel built with `cfg` (codegen.KernelConfig)."""
        return int(self.smem_for(cfg)) if self.smem_for else self.smem_bytes

    def elem_ranges(self, params: dict, name: str) -> list[tuple[int, int]]:
        """The elements of its tensor an instance with `params` touches through pointer parameter `name`: its
        ref's, or the parts of them the type declares it writes (writes_of)."""
        ref = params[name]
        parts = self.writes_of(params).get(name) if self.writes_of else None
        if parts is None:
            return [(ref.offset, ref.offset + ref.count)]
        return [(ref.offset + a, ref.offset + b) for a, b in parts]

    def byte_ranges(self, params: dict, name: str) -> list[tuple[int, int]]:
        """elem_ranges as device byte ranges."""
        t = params[name].tensor
        return [(t.ptr + a * t.itemsize, t.ptr + b * t.itemsize) for a, b in self.elem_ranges(params, name)]

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


_BY_NAME: dict[str, TaskType] = {}
_BY_ID: dict[int, TaskType] = {}


def _validate(t: TaskType, builtin: bool) -> None:
    why = _bad_identifier(t.name)
    if why:
        raise RegistryError(f"task name {t.name!r} {why}")
    if not isinstance(t.id, int) or isinstance(t.id, bool) or not 0 < t.id <= MAX_ID:
        raise RegistryError(f"task {t.name!r}: id must be an int in [1, {MAX_ID}] (a signed 32-bit descriptor "
                            f"word), got {t.id!r}")
    if builtin and t.id >= USER_ID_BASE:
        raise RegistryError(f"built-in task {t.name!r}: ids >= {USER_ID_BASE} are for user task types")
    if not builtin and t.id < USER_ID_BASE:
        raise RegistryError(f"user task {t.name!r}: id {t.id} is reserved; use an id >= {USER_ID_BASE}")
    if len(t.params) > PARAM_WORDS:
        raise RegistryError(f"task {t.name!r} has {len(t.params)} parameters; the descriptor holds {PARAM_WORDS}")
    seen = set()
    for p in t.params:
        why = _bad_identifier(p.name) or ("is used twice" if p.name in seen else None)
        if why:
            raise RegistryError(f"task {t.name!r}: parameter name {p.name!r} {why}")
        seen.add(p.name)
        if p.kind == "ptr":
            if p.dtype not in DTYPES:
                raise RegistryError(f"task {t.name!r} parameter {p.name!r}: unknown dtype {p.dtype!r}")
            if p.access not in ACCESS:
                raise RegistryError(f"task {t.name!r} parameter {p.name!r}: access must be one of {ACCESS}")
            if p.tagged and (p.dtype != "bf16" or p.access not in ("in", "out")):
                raise RegistryError(f"task {t.name!r} parameter {p.name!r}: tagged=True needs a bf16 'in' or 'out' "
                                    f"pointer (a polled read or a tagged write), got {p.dtype} {p.access!r}")
        elif p.kind not in SCALAR_KINDS:
            raise RegistryError(f"task {t.name!r} parameter {p.name!r}: kind must be ptr or one of {sorted(SCALAR_KINDS)}")
    if not callable(t.reference):
        raise RegistryError(f"task {t.name!r}: a CPU reference for one instance is required")
    if not builtin and not Path(t.source).is_file():
        raise RegistryError(f"task {t.name!r}: device source {t.source!r} not found")


def register(t: TaskType, *, builtin: bool = False) -> TaskType:
    """Add a task type. Re-registering an identical declaration is a no-op; a clash is an error."""
    _validate(t, builtin)   # (the built-ins are in already: megart/__init__ registers them first)
    old = _BY_NAME.get(t.name)
    if old is not None:
        if (old.id, old.source, old.params, old.prewait, old.prefetch, old.stream, old.stream_format) == (
                t.id, t.source, t.params, t.prewait, t.prefetch, t.stream, t.stream_format):
            return old
        raise RegistryError(f"task name {t.name!r} is already registered (id {old.id})")
    if t.id in _BY_ID:
        raise RegistryError(f"task id {t.id} is already taken by {_BY_ID[t.id].name!r}")
    _BY_NAME[t.name] = t
    _BY_ID[t.id] = t
    return t


def register_task(name: str, id: int, params, source: str | Path, reference: Callable, **kw) -> TaskType:
    """Register a user task type whose device body lives in `source` (a .cuh file defining
    `__device__ void megart_task_<name>(const megart_params_<name>& p, char* smem)`)."""
    return register(TaskType(name=name, id=id, params=tuple(params), source=str(Path(source).resolve()),
                             reference=reference, **kw))


def get(task) -> TaskType:
    """Look a task type up by name or numeric id."""
    if isinstance(task, TaskType):
        return task
    table, kind = (_BY_ID, "id") if isinstance(task, int) else (_BY_NAME, "name")
    try:
        return table[task]
    except KeyError:
        raise RegistryError(f"unknown task {kind} {task!r}; registered: {sorted(_BY_NAME)}") from None


def all_types() -> list[TaskType]:
    return sorted(_BY_ID.values(), key=lambda t: t.id)


def names_by_id() -> dict[int, str]:
    return {t.id: t.name for t in all_types()}


# Constants a shared device header uses, declared once in Python (beside the code that reads them there)
# and emitted by codegen (and the host simulation) right before the header: header path -> (C++ namespace,
# {name: int value}).
_HEADER_CONSTANTS: dict[str, tuple[str, dict]] = {}


def header_constants(header: str, namespace: str, constants: dict) -> None:
    """Declare `constants` (name -> int) for the shared header `header`, in C++ namespace `namespace`."""
    for name, value in constants.items():
        if not _IDENT.match(name) or isinstance(value, bool) or not isinstance(value, int):
            raise RegistryError(f"header constant {name!r}={value!r} for {header}: need an identifier and an int")
    _HEADER_CONSTANTS[header] = (namespace, dict(constants))


def header_prelude(header: str) -> str:
    """The C++ declarations of `header`'s constants ('' when it declares none)."""
    if header not in _HEADER_CONSTANTS:
        return ""
    namespace, constants = _HEADER_CONSTANTS[header]
    body = "\n".join(f"constexpr int {k} = {v};" for k, v in constants.items())
    opens = "".join(f"namespace {n} {{ " for n in namespace.split("::"))
    closes = "}" * len(namespace.split("::"))
    return f"// generated from megart's declarations: the constants {header} uses\n{opens}\n{body}\n{closes}\n"
