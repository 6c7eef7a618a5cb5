"""What a kernel is specialised on (CTA size, CTAs per SM, profiling, tuning macros). Bottom floor:
task declarations and the stream sizing read it, codegen consumes it, nothing here imports upward."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class KernelConfig:
    threads: int = 256
    profile: bool = False
    min_blocks: int = 1         # __launch_bounds__ minimum CTAs per SM (2 when nw exceeds the SM count)
    defines: dict = field(default_factory=dict)   # tuning macros (e.g. MEGART_PREFETCH_KB), part of the cache key
    tp: int = 1                 # ranks of a tensor-parallel group, when the graph uses peer events (MEGART_TP)
    constants: dict = field(default_factory=dict)  # {type name: {scalar param: value}} compiled in (codegen)


def env_defines() -> dict:
    """MEGART_DEFINES="NAME=VALUE,FLAG": tuning macros for every kernel this process compiles."""
    from .options import parse_env_defines
    return parse_env_defines(os.environ.get("MEGART_DEFINES", ""))


def caller_macros(cfg: KernelConfig) -> dict:
    """The macros the caller asked for: MEGART_DEFINES, overridden by the kernel's own `defines`."""
    return {**env_defines(), **cfg.defines}


def macro_on(cfg: KernelConfig, name: str) -> bool:
    """Whether the caller set macro `name` (MEGART_DEFINES or the kernel's defines) to anything but 0."""
    return str(caller_macros(cfg).get(name, "0")).strip() not in ("0", "")


def stream_requested(cfg: KernelConfig) -> bool:
    """Whether the launch-wide weight stream is wanted (megart/stream.py sizes it, or finds no room for
    it): MEGART_STREAM_SLOTS "auto" or N > 0. Unset or 0: the register engine (a PersistentKernel's
    default; the decode models ask for "auto", see megart/models/llama.py)."""
    return macro_on(cfg, "MEGART_STREAM_SLOTS")


def kv_streamed(cfg: KernelConfig) -> bool:
    """Whether a kernel built with `cfg` asks for attention_decode's K/V cache rows through the stream (its
    "kv" format): the stream asked for and MEGART_STREAM_KV=1. Attention's own ring is then off, and the
    models pass pos_stamp; where the layout streams nothing after all (no room for 2 slots, user task types)
    or attention's body is a candidate's, its instances read their rows through registers. The rows below
    pos are read-only in a step, so the producer loads them ahead, while the calls before attention run, and
    the attention body reads them landed, bit for bit as its own cp.async ring would. Off by default: on
    the H200 the Llama-1B step measured slower with it (bench/RESULTS.md), so attention keeps its ring."""
    return stream_requested(cfg) and macro_on(cfg, "MEGART_STREAM_KV")
