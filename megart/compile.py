"""NVRTC compilation through cuda.core, with a disk cache (CuPy/Triton style) and the ptxas report.

Cache: MEGART_CACHE_DIR (default ~/.cache/megart), disabled with MEGART_DISABLE_CACHE=1. The key
hashes the full source, the options, the NVRTC version and the arch. Each entry is a cubin plus a
JSON file holding the ptxas report and one hash over the cubin and that report; both are written to a
temp file and renamed into place. An entry whose hash does not match, or whose report is not all
non-negative integers, is a miss and is rewritten. A cache that cannot be written (a read-only
directory, an entry path taken by a directory) is a warning, once per process; the compile result is
used without it."""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .codegen import FILE_NAME, Source
from .cubin_info import function_resources
from .errors import CompileError

CACHE_VERSION = 2       # 2: the hash covers the report as well as the cubin


@dataclass
class PtxasReport:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    smem_bytes: int = 0      # static shared memory
    barriers: int = 0

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class Compiled:
    cubin: bytes
    report: PtxasReport
    key: str
    arch: str
    cache_hit: bool
    log: str = ""
    path: Path | None = None


def parse_ptxas(log: str, kernel: str) -> PtxasReport:
    """Pull the entry function's resource use out of a `ptxas -v` log."""
    r = PtxasReport()
    section = log.split(f"Function properties for {kernel}")
    text = section[1] if len(section) > 1 else log
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        r.stack_bytes, r.spill_stores, r.spill_loads = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", text)
    if m:
        r.registers = int(m.group(1))
    m = re.search(r"used (\d+) barriers", text)
    if m:
        r.barriers = int(m.group(1))
    m = re.search(r"(\d+) bytes smem", text)
    if m:
        r.smem_bytes = int(m.group(1))
    return r


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def include_paths() -> list[str]:
    """CUDA headers (cuda_bf16.h, cuda_fp8.h) from pip wheels or the toolkit, via cuda.pathfinder."""
    from cuda.pathfinder import find_nvidia_header_directory
    paths = []
    for lib in ("cudart", "cccl"):
        try:
            p = find_nvidia_header_directory(lib)
        except Exception:
            p = None
        if p:
            paths.append(str(p))
    if not paths:
        raise CompileError("CUDA headers not found: install nvidia-cuda-runtime (pip) or a CUDA toolkit")
    return paths


def cache_dir() -> Path | None:
    if os.environ.get("MEGART_DISABLE_CACHE", "") not in ("", "0"):
        return None
    return Path(os.environ.get("MEGART_CACHE_DIR", Path.home() / ".cache" / "megart"))


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _options(arch: str) -> dict:
    """The NVRTC options, built once for both the cache key and the compile (include paths too: another
    header set is another kernel)."""
    opts = dict(arch=arch, std="c++17", ptxas_options=["-v"], name=FILE_NAME, include_path=include_paths())
    if _nvrtc_caches():
        opts["no_cache"] = True
    return opts


def _nvrtc_caches() -> bool:
    """Whether NVRTC keeps its own cache of compiled code (12.9 on, where a driver is installed) and cuda.core
    can turn it off. A build it serves from that cache skips ptxas, so the log carries no ptxas report (no
    registers, no spills: seen on the H200 host, every build of a source compiled there before); this module's
    cache keeps the report beside the cubin instead."""
    from cuda.core import ProgramOptions
    major, minor = (int(v) for v in nvrtc_version().split("."))
    return (major, minor) >= (12, 9) and "no_cache" in getattr(ProgramOptions, "__dataclass_fields__", {})


def cache_key(src: Source, arch: str) -> str:
    h = hashlib.sha256()
    for part in (f"megart-cache-{CACHE_VERSION}", nvrtc_version(), arch, json.dumps(_options(arch)), src.text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _entry_hash(cubin: bytes, arch: str, report: dict, log: str) -> str:
    """One hash over everything a cache hit hands back, so no field is trusted beyond it."""
    h = hashlib.sha256(cubin)
    h.update(json.dumps({"arch": arch, "report": report, "log": log}, sort_keys=True).encode())
    return h.hexdigest()


def _report_of(raw) -> PtxasReport | None:
    names = [f.name for f in fields(PtxasReport)]
    if not isinstance(raw, dict) or set(raw) != set(names):
        return None
    if any(type(raw[n]) is not int or raw[n] < 0 for n in names):
        return None
    return PtxasReport(**raw)


def _load_cached(d: Path, key: str, arch: str) -> Compiled | None:
    meta_p, bin_p = d / f"{key}.json", d / f"{key}.cubin"
    try:
        meta = json.loads(meta_p.read_text())
        cubin = bin_p.read_bytes()
        report, log = _report_of(meta["report"]), meta["log"]
        if report is None or meta["arch"] != arch or not isinstance(log, str):
            return None
        if _entry_hash(cubin, arch, meta["report"], log) != meta["sha256"]:
            return None
        return Compiled(cubin, report, key, arch, True, log, bin_p)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None   # missing or corrupt: recompile and overwrite


_warned_cache = False


def _warn_cache(d: Path, exc: OSError) -> None:
    global _warned_cache
    if not _warned_cache:
        _warned_cache = True
        warnings.warn(f"megart compile cache {d} cannot be written ({exc}); compiling without it. Set "
                      "MEGART_CACHE_DIR to a writable directory, or MEGART_DISABLE_CACHE=1.", RuntimeWarning,
                      stacklevel=3)


def _store(d: Path, key: str, compiled: "Compiled", src: Source) -> None:
    meta = dict(arch=compiled.arch, report=asdict(compiled.report), log=compiled.log)
    meta["sha256"] = _entry_hash(compiled.cubin, compiled.arch, meta["report"], compiled.log)
    try:
        _atomic_write(d / f"{key}.cubin", compiled.cubin)
        _atomic_write(d / f"{key}.cu", src.text.encode())
        _atomic_write(d / f"{key}.json", json.dumps(meta, indent=1).encode())
    except OSError as exc:
        _warn_cache(d, exc)
        return
    compiled.path = d / f"{key}.cubin"


def annotate_log(log: str, src: Source) -> str:
    """Add, after each `megart_kernel.cu(N)` mention, the task/runtime file and line it came from."""
    lines_src = src.text.split("\n")
    out = []
    for line in log.splitlines():
        out.append(line)
        m = re.search(re.escape(FILE_NAME) + r"\((\d+)\)", line)
        if m:
            n = int(m.group(1))
            origin = src.origin(n)
            code = lines_src[n - 1].strip() if 0 < n <= len(lines_src) else ""
            if origin:
                out.append(f"    -> {origin[0]}:{origin[1]}: {code}")
    return "\n".join(out)


def compile_source(src: Source, arch: str, use_cache: bool = True) -> Compiled:
    """Compile to a cubin for `arch` (e.g. "sm_90a"). Works without a GPU."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise CompileError(f"arch must look like 'sm_90a', got {arch!r}")
    key = cache_key(src, arch)
    d = cache_dir() if use_cache else None
    if d is not None:
        hit = _load_cached(d, key, arch)
        if hit is not None:
            return hit
    from cuda.core import Program, ProgramOptions

    class _Log:
        def __init__(self):
            self.parts = []

        def write(self, s):
            self.parts.append(s)

    log = _Log()
    opts = ProgramOptions(**_options(arch))
    try:
        prog = Program(src.text, "c++", opts)
        obj = prog.compile("cubin", logs=log)
    except Exception as exc:
        text = "".join(log.parts) or str(exc)
        raise CompileError("NVRTC could not compile the generated kernel:\n" + annotate_log(text, src),
                           log=text, source=src.text) from None
    from .codegen import KERNEL_NAME
    text = "".join(log.parts)
    report = parse_ptxas(text, KERNEL_NAME)
    cubin = bytes(obj.code)
    if report.registers == 0:   # (every kernel uses registers: the log said nothing readable about this one)
        res = function_resources(cubin, KERNEL_NAME)
        if res is not None:     # the cubin records registers and the frame, not what part of it is spill
            report = replace(report, registers=res.registers, stack_bytes=max(report.stack_bytes, res.frame_bytes))
        said = (f"the cubin records {res.registers} registers and a {res.frame_bytes}-byte stack frame"
                if res is not None else "nor does the cubin, so its report reads 0 registers")
        warnings.warn(f"megart: the ptxas log names no register count for {KERNEL_NAME} ({len(text)} characters "
                      f"of log); {said}, and 0 spill bytes: the spill checks cannot see this build",
                      RuntimeWarning, stacklevel=2)
    compiled = Compiled(cubin, report, key, arch, False, text)
    if d is not None:
        _store(d, key, compiled, src)
    return compiled
