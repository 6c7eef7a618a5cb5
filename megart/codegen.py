"""Generates the kernel's CUDA source: the layout header, the runtime, one parameter struct per
task type, the task bodies, the dispatch switch and the entry point, all from the task table.
Every chunk's origin is recorded so compile errors can be mapped back to the file they came from."""
from __future__ import annotations

import struct

from dataclasses import dataclass, field
from pathlib import Path

from . import registry, stream
from .config import KernelConfig, caller_macros, env_defines  # noqa: F401  (re-exported)
from .layout import layout_header
from .registry import TaskType
from .sources import read_source, source_root

KERNEL_NAME = "megart_kernel"
FILE_NAME = "megart_kernel.cu"
# The dynamic shared-memory window (the rings, the stream's slots) starts after the static shared memory,
# rounded up to this alignment. At 16 bytes, a static size that was not a multiple of 128 moved every slot
# off a 128-byte boundary, and the Llama-1B step took 9% longer (29% at one size; bench/RESULTS.md,
# eleventh session). ptxas counts the padding as static shared memory.
SMEM_ALIGN = 128


def kernel_defines(types: list[TaskType], cfg: KernelConfig, overrides: dict | None = None) -> dict:
    """The macros a kernel of `types` is compiled with: each type's own (defines_for) first, then
    MEGART_DEFINES, then the kernel's `defines`, so the caller's tuning macros win; last the weight
    stream's layout, which megart/stream.py derived from them."""
    out = {}
    for t in types:
        if t.defines_for:
            out.update(t.defines_for(cfg))
    out.update(caller_macros(cfg))
    out.update(stream.layout(types, cfg, overrides).defines(cfg.threads))   # (read from the caller's macros)
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


def _c_literal(kind: str, value) -> str:
    if kind == "f32":
        return float(struct.unpack("<f", struct.pack("<f", float(value)))[0]).hex() + "f"
    return f"{int(value)}" + ("ll" if kind == "i64" else "")


def params_struct(t: TaskType, streamed: bool = False, constants: dict | None = None) -> str:
    """The C++ parameter struct of `t`; with `streamed`, also the trait that puts its body on the stream.
    A scalar in `constants` becomes a static constexpr member of that value (its packed field renamed)."""
    constants = constants or {}

    def decl(p) -> str:
        if p.name not in constants:
            return p.c_decl()
        ctype = registry.SCALAR_KINDS[p.kind]
        return (f"static constexpr {ctype} {p.name} = {_c_literal(p.kind, constants[p.name])}; "
                + p.c_decl().replace(f" {p.name};", f" _packed_{p.name};", 1))
    fields = "\n".join(f"  {decl(p)}" for p in t.params) or "  int _unused;"
    out = (f"struct {t.struct_name} {{  // task {t.name!r}, id {t.id}\n{fields}\n}};\n"
           f"static_assert(sizeof({t.struct_name}) <= megart::kParamWords * 8, \"params of {t.name} too large\");")
    if streamed:
        out += (f"\nnamespace megart {{ template <> struct StreamOn<::{t.struct_name}> "
                "{ static constexpr bool value = true; }; }")
    return out


def _switch(fn: str, args: str, cases: list[str], default: str = "break;") -> str:
    body = "\n".join(cases)
    return (f"__device__ __forceinline__ void {fn}({args}) {{\n"
            "  switch (d.hdr[megart::kHdr_type]) {\n"
            f"{body}\n"
            f"    default: {default}\n"
            "  }\n}\n")


# The weight stream's stage formats (TaskType.stream_format): ws.format's number, how an entry opens (from
# its params struct `p`) and the function that issues its next stage.
STREAM_FORMATS = {
    "dense": (0, "dense::stream_open({plan}(p), ws, warp) ? kOpenStages : kOpenNone", "dense_stage_next"),
    "kv": (1, "megart_attn::kv_stream_open(p, ws, warp)", "megart_attn::kv_stage_next"),
}


def stream_open(types: list[TaskType]) -> str:
    """megart_stream_open(): where an entry's stages are, per streamed type, and stream_format_next(): the
    formats' stage issue (both declared in csrc/weight_stream.cuh; the producer opens each entry once per
    warp, then issues its stages)."""
    for t in types:
        if t.stream_format not in STREAM_FORMATS:
            raise ValueError(f"task type {t.name!r}: stream_format {t.stream_format!r} is not one of "
                             f"{', '.join(STREAM_FORMATS)}")
    cases = []
    for t in types:
        number, open_expr, _ = STREAM_FORMATS[t.stream_format]
        cases.append(f"    case {t.id}: {{\n      const auto& p = *reinterpret_cast<const {t.struct_name}*>(d.params);\n"
                     f"      ws.format = {number};\n      return {open_expr.format(plan=t.plan_name)};\n    }}")
    used = sorted({(STREAM_FORMATS[t.stream_format][0], STREAM_FORMATS[t.stream_format][2]) for t in types})
    nexts = "".join(f"  if (ws.format == {n}) return {fn}(ws, warp, slot);\n" for n, fn in used[:-1])   # (the last
    nexts += f"  return {used[-1][1]}(ws, warp, slot);\n" if used else "  return false;\n"       # format: no test)
    return ("namespace megart {\n"
            "__device__ __noinline__ int megart_stream_open(const TaskDesc& d, WarpStream& ws, int warp) {\n"
            "  switch (d.hdr[kHdr_type]) {\n" + "\n".join(cases) + "\n"
            "    default: return kOpenNone;  // no weight stream: the producer steps over it\n"
            "  }\n}\n"
            "__device__ __forceinline__ bool stream_format_next(WarpStream& ws, int warp, int slot) {\n"
            + nexts + "}\n}  // namespace megart\n")


def dispatch(types: list[TaskType], streamed: tuple = ()) -> str:
    """The per-type switches. A streamed type's L2 prefetch is left out: the stream already loads its
    first stages ahead of it."""
    def cases(fn, with_smem, which):
        tail = ", smem" if with_smem else ""
        return [f"    case {t.id}: {fn(t)}(*reinterpret_cast<const {t.struct_name}*>(d.params){tail}); break;"
                for t in types if which(t)]
    return (
        _switch("megart_dispatch", "const megart::TaskDesc& d, char* smem",
                cases(lambda t: t.body_name, True, lambda t: t.id not in registry.NO_BODY),
                "break;  // barrier arrivals and joins have no body")
        + _switch("megart_prefetch", "const megart::TaskDesc& d",
                  cases(lambda t: t.prefetch_name, False, lambda t: t.prefetch and t.name not in streamed))
        + _switch("megart_prewait", "const megart::TaskDesc& d, char* smem",
                  cases(lambda t: t.prewait_name, True, lambda t: t.prewait))
        + _switch("megart_drain", "const megart::TaskDesc& d, char* smem",
                  cases(lambda t: t.drain_name, True, lambda t: t.prewait)))


def generate(types: list[TaskType], cfg: KernelConfig, overrides: dict | None = None,
             root: Path | None = None) -> Source:
    """The whole translation unit for a kernel that can run `types` (the barrier is always in)."""
    overrides = overrides or {}
    root = root or source_root()
    barrier = registry.get(registry.BARRIER_ID)
    types = sorted({t.id: t for t in [*types, barrier]}.values(), key=lambda t: t.id)
    defines = kernel_defines(types, cfg, overrides)
    lay = stream.layout(types, cfg, overrides)
    streamed = lay.types
    w = _Writer()
    w.add("// Generated by megart.codegen. Edit the task declarations and .cuh sources, not this file.\n"
          "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda_fp8.h>\n"
          f"#define MEGART_THREADS {cfg.threads}\n#define MEGART_BLOCK_THREADS {lay.block_threads(cfg.threads)}\n"
          f"#define MEGART_MIN_BLOCKS {cfg.min_blocks}\n#define MEGART_SMEM_ALIGN {SMEM_ALIGN}\n"
          + ("#define MEGART_PROFILE 1\n" if cfg.profile else "")
          + (f"#define MEGART_TP {cfg.tp}\n" if cfg.tp > 1 else "")
          + "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items())))
    w.add(layout_header(), "megart/layout.py")
    text, path = read_source("csrc/runtime.cuh", root)
    w.add(text, str(path))
    if streamed:   # the producer warp never joins the compute threads' barriers (csrc/weight_stream.cuh)
        w.add("#define __syncthreads() megart::cta_sync()")
    for rel in ("csrc/tile_helpers.cuh", "csrc/weight_stream.cuh", "csrc/tagged.cuh"):
        text, path = read_source(rel, root)
        w.add(text, str(path))
    for rel in dict.fromkeys(h for t in types for h in t.headers):   # shared task headers, once each
        if registry.header_prelude(rel):
            w.add(registry.header_prelude(rel), f"megart (constants of {rel})")
        text, path = read_source(overrides.get(rel, rel), root)
        w.add(text, str(path))
    for t in types:
        if t.id in registry.NO_BODY:
            continue
        w.add(params_struct(t, t.name in streamed, cfg.constants.get(t.name)), f"tasks/ ({t.name} declaration)")
        text, path = read_source(overrides.get(t.name, t.source), root)
        w.add(text, str(path))
        if t.generated:   # device functions derived from the declaration (they may use the body's plan_<name>)
            w.add(t.generated(t), f"tasks/ ({t.name} declaration: generated)")
    w.add(dispatch(types, streamed))
    if streamed:
        w.add(stream_open([t for t in types if t.name in streamed]))
    for rel in ("profiler/spans.cuh", "csrc/worker_loop.cuh"):
        text, path = read_source(rel, root)
        w.add(text, str(path))
    w.add('extern "C" __global__ void __launch_bounds__(MEGART_BLOCK_THREADS, MEGART_MIN_BLOCKS)\n'
          f"{KERNEL_NAME}(const megart::TaskDesc* __restrict__ descs, const int* __restrict__ queue_start,\n"
          "              unsigned* events, long long* ctrl, long long* spans, long long watchdog_ns) {\n"
          "  extern __shared__ __align__(MEGART_SMEM_ALIGN) char megart_smem[];\n"
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
