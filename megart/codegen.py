"""Generates the kernel's CUDA source: the layout header, the runtime, one parameter struct per
task type, the task bodies, the dispatch switch and the entry point, all from the task table.
Every chunk's origin is recorded so compile errors can be mapped back to the file they came from."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import registry
from .layout import layout_header
from .registry import TaskType
from .sources import read_source, source_root

KERNEL_NAME = "megart_kernel"
FILE_NAME = "megart_kernel.cu"


@dataclass
class KernelConfig:
    threads: int = 256
    profile: bool = False
    min_blocks: int = 1         # __launch_bounds__ minimum CTAs per SM (2 when nw exceeds the SM count)
    defines: dict = field(default_factory=dict)   # tuning macros (e.g. MEGART_PREFETCH_KB), part of the cache key


def env_defines() -> dict:
    """MEGART_DEFINES="NAME=VALUE,FLAG": tuning macros for every kernel this process compiles."""
    import os
    from .options import parse_env_defines
    return parse_env_defines(os.environ.get("MEGART_DEFINES", ""))


def caller_macros(cfg: KernelConfig) -> dict:
    """The macros the caller asked for: MEGART_DEFINES, overridden by the kernel's own `defines`."""
    return {**env_defines(), **cfg.defines}


def kernel_defines(types: list[TaskType], cfg: KernelConfig) -> dict:
    """The macros a kernel of `types` is compiled with: each type's own (defines_for) first, then
    MEGART_DEFINES, then the kernel's `defines`, so the caller's tuning macros win."""
    out = {}
    for t in types:
        if t.defines_for:
            out.update(t.defines_for(cfg))
    out.update(caller_macros(cfg))
    return out


@dataclass
class Source:
    text: str
    chunks: list = field(default_factory=list)   # (first generated line, n lines, origin path, origin first line)

    def origin(self, line: int) -> tuple[str, int] | None:
        """Map a 1-based generated line to (origin file, origin line)."""
        for first, n, path, o_first in self.chunks:
            if first <= line < first + n:
                return path, o_first + (line - first)
        return None


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.chunks: list = []

    def add(self, text: str, origin: str = "<generated>", origin_first: int = 1):
        new = text.rstrip("\n").split("\n")
        self.chunks.append((len(self.lines) + 1, len(new), origin, origin_first))
        self.lines.extend(new)

    def source(self) -> Source:
        return Source("\n".join(self.lines) + "\n", self.chunks)


def params_struct(t: TaskType) -> str:
    fields = "\n".join(f"  {p.c_decl()}" for p in t.params) or "  int _unused;"
    return (f"struct {t.struct_name} {{  // task {t.name!r}, id {t.id}\n{fields}\n}};\n"
            f"static_assert(sizeof({t.struct_name}) <= megart::kParamWords * 8, \"params of {t.name} too large\");")


def dispatch(types: list[TaskType]) -> str:
    cases = "\n".join(
        f"    case {t.id}: {t.body_name}(*reinterpret_cast<const {t.struct_name}*>(d.params), smem); break;"
        for t in types if t.id not in registry.NO_BODY)
    pre = "\n".join(
        f"    case {t.id}: {t.prefetch_name}(*reinterpret_cast<const {t.struct_name}*>(d.params)); break;"
        for t in types if t.prefetch)

    def with_smem(fn):
        return "\n".join(f"    case {t.id}: {fn(t)}(*reinterpret_cast<const {t.struct_name}*>(d.params), smem); break;"
                         for t in types if t.prewait)
    return (
        "__device__ __forceinline__ void megart_dispatch(const megart::TaskDesc& d, char* smem) {\n"
        "  switch (d.hdr[megart::kHdr_type]) {\n"
        f"{cases}\n"
        "    default: break;  // barrier arrivals and joins have no body\n"
        "  }\n}\n"
        "__device__ __forceinline__ void megart_prefetch(const megart::TaskDesc& d) {\n"
        "  switch (d.hdr[megart::kHdr_type]) {\n"
        f"{pre}\n"
        "    default: break;\n"
        "  }\n}\n"
        "__device__ __forceinline__ void megart_prewait(const megart::TaskDesc& d, char* smem) {\n"
        "  switch (d.hdr[megart::kHdr_type]) {\n"
        f"{with_smem(lambda t: t.prewait_name)}\n"
        "    default: break;\n"
        "  }\n}\n"
        "__device__ __forceinline__ void megart_drain(const megart::TaskDesc& d, char* smem) {\n"
        "  switch (d.hdr[megart::kHdr_type]) {\n"
        f"{with_smem(lambda t: t.drain_name)}\n"
        "    default: break;\n"
        "  }\n}\n")


def generate(types: list[TaskType], cfg: KernelConfig, overrides: dict | None = None,
             root: Path | None = None) -> Source:
    """The whole translation unit for a kernel that can run `types` (the barrier is always in)."""
    overrides = overrides or {}
    root = root or source_root()
    barrier = registry.get(registry.BARRIER_ID)
    types = sorted({t.id: t for t in [*types, barrier]}.values(), key=lambda t: t.id)
    defines = kernel_defines(types, cfg)
    w = _Writer()
    w.add("// Generated by megart.codegen. Edit the task declarations and .cuh sources, not this file.\n"
          "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda_fp8.h>\n"
          f"#define MEGART_THREADS {cfg.threads}\n#define MEGART_MIN_BLOCKS {cfg.min_blocks}\n"
          + ("#define MEGART_PROFILE 1\n" if cfg.profile else "")
          + "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items())))
    w.add(layout_header(), "megart/layout.py")
    for rel in ("csrc/runtime.cuh", "csrc/tile_helpers.cuh"):
        text, path = read_source(rel, root)
        w.add(text, str(path))
    for rel in dict.fromkeys(h for t in types for h in t.headers):   # shared task headers, once each
        text, path = read_source(overrides.get(rel, rel), root)
        w.add(text, str(path))
    for t in types:
        if t.id in registry.NO_BODY:
            continue
        w.add(params_struct(t), f"megart/tasks ({t.name})")
        text, path = read_source(overrides.get(t.name, t.source), root)
        w.add(text, str(path))
    w.add(dispatch(types))
    for rel in ("profiler/spans.cuh", "csrc/worker_loop.cuh"):
        text, path = read_source(rel, root)
        w.add(text, str(path))
    w.add('extern "C" __global__ void __launch_bounds__(MEGART_THREADS, MEGART_MIN_BLOCKS)\n'
          f"{KERNEL_NAME}(const megart::TaskDesc* __restrict__ descs, const int* __restrict__ queue_start,\n"
          "              unsigned* events, long long* ctrl, long long* spans, long long watchdog_ns) {\n"
          "  extern __shared__ __align__(16) char megart_smem[];\n"
          "  megart::worker(descs, queue_start, events, ctrl, spans, watchdog_ns, megart_smem);\n}\n")
    return w.source()


def main(argv=None) -> int:
    """Write the kernel source with every registered task type (for nvcc/SASS inspection, CMake)."""
    import argparse
    ap = argparse.ArgumentParser(description="dump megart's generated kernel source")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    src = generate(registry.all_types(), KernelConfig(threads=args.threads, profile=args.profile))
    Path(args.out).write_text(src.text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
