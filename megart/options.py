"""Checks of PersistentKernel's options and of the MEGART_* environment, each failing with a
ConfigError that names the option and the accepted values, before anything is generated."""
from __future__ import annotations

import math
import os
import re

from .errors import ConfigError

_MACRO = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Set by codegen from the kernel's configuration: a second #define would make __launch_bounds__, the
# launch and the shared-memory layout disagree.
OWNED_MACROS = {
    "MEGART_THREADS": "the CTA size (threads=)",
    "MEGART_MIN_BLOCKS": "CTAs per SM, from nw and the SM count",
    "MEGART_SMEM_ALIGN": "the dynamic shared-memory window's alignment (codegen.SMEM_ALIGN)",
    "MEGART_PROFILE": "profiling (profile=True)",
    "MEGART_TP": "the tensor-parallel group size, set when the graph uses peer events (peers=)",
    "MEGART_DENSE_RING_OFFSET": "the dense ring layout, computed from MEGART_DENSE_RING_SLOTS",
    "MEGART_DENSE_RING_HEAD_BYTES": "the dense ring layout, computed from MEGART_DENSE_RING_SLOTS",
    "MEGART_DENSE_RING_SLOT_BYTES": "the dense ring layout, computed from MEGART_DENSE_RING_SLOTS",
    "MEGART_BLOCK_THREADS": "the CTA size with the weight stream's producer (threads= and MEGART_STREAM_SLOTS)",
    "MEGART_STREAM_OFFSET": "the weight stream's layout, computed from MEGART_STREAM_SLOTS",
    "MEGART_STREAM_SLOT_BYTES": "the weight stream's layout, computed from MEGART_STREAM_SLOTS",
    "MEGART_STREAM_STAGE_CHUNKS": "the weight stream's stage size, from MEGART_STREAM_STAGE",
    "MEGART_PRODUCER_THREADS": "the weight stream's producer, from MEGART_STREAM_SLOTS and threads=",
    "MEGART_COMPUTE_REGS": "the weight stream's register split, from threads=",
    "MEGART_PRODUCER_REGS": "the weight stream's register split, from threads=",
    "MEGART_STREAM_HANG_FREE": "the weight stream's hang code (megart/stream.py)",
    "MEGART_STREAM_INFLIGHT_STAGES": "the weight stream's in-flight cap, from MEGART_STREAM_INFLIGHT",
    "MEGART_ATTN_TAGGED": "attention_decode's tagged form, compiled in when the graph uses it (k_new given)",
    "MEGART_DENSE_KSPLIT": "the dense engines' K-split path, compiled in when an instance has fewer row pairs than "
                           "half the compute warps plus one (tasks/dense_common.py)",
    "MEGART_DENSE_TAGGED_X": "the dense engines' x-in-pieces paths, compiled in when an instance reads a tagged x "
                             "(tasks/dense_common.py)",
    "MEGART_ATTN_UNSTAMPED": "attention_decode's own K/V reads beside the stream's, compiled in when an instance has no pos_stamp",
    "MEGART_ATTN_RING_U": "the attention ring's positions per stage, from MEGART_ATTN_RING_BYTES (tasks/attention_ring.py)",
    "MEGART_ATTN_RING_STAGES": "the attention ring's stages, from MEGART_ATTN_RING_BYTES (tasks/attention_ring.py)",
    "MEGART_ATTN_ORDER_U": "the attention ring's positions per stage at its default size, whose order the streamed "
                           "K/V keep (tasks/attention_ring.py)",
}
# Macros that must be non-negative integers: Python also reads them (to size shared memory), or the device
# code tests them as numbers (MEGART_LEAN_SYNC: one release fence per instance's signals, csrc/runtime.cuh).
INT_MACROS = ("MEGART_DENSE_RING_SLOTS", "MEGART_ATTN_RING_BYTES", "MEGART_PREFETCH_KB", "MEGART_LEAN_SYNC",
              "MEGART_PHASE_MARKS", "MEGART_DIAG_NO_WAIT", "MEGART_STREAM_WAITS", "MEGART_STREAM_KV",
              "MEGART_ATTN_MARK0")
# Profiler modes whose every value means something (csrc/runtime.cuh): another number would build a mode no
# reader decodes, so it is refused.
MODE_MACROS = {"MEGART_PHASE_MARKS": {0: "off", 1: "phase stamps", 2: "the warps' spread"},
               "MEGART_STREAM_WAITS": {0: "off", 1: "stage times", 2: "ring occupancy"},
               # where attention_decode stamps mark 0 (tasks/attention_decode_blocks.cuh)
               "MEGART_ATTN_MARK0": {0: "K/V attended", 1: "body start", 2: "q loaded", 3: "first stage landed",
                                     4: "last stage attended", 5: "task entry", 6: "first stage attended"}}


def check_defines(defines, origin: str = "defines") -> dict:
    """{name: value} with every name a macro identifier the caller may set and every value one line."""
    if not isinstance(defines, dict):
        raise ConfigError(f"{origin} must be a dict {{MACRO: value}}, got {type(defines).__name__}")
    out = {}
    for name, value in defines.items():
        if not isinstance(name, str) or not _MACRO.match(name):
            raise ConfigError(f"{origin}: {name!r} is not a macro name (letters, digits and _, not starting with a "
                              "digit)")
        if name in OWNED_MACROS:
            raise ConfigError(f"{origin}: {name} is set by megart itself ({OWNED_MACROS[name]}); a second #define "
                              "would make the compiled code and the launch disagree. Remove it.")
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{origin}: {name}={value!r} is not a finite number")
        text = str(value).strip()
        if not text or "\n" in text or "\r" in text or text.endswith("\\"):
            raise ConfigError(f"{origin}: {name}={value!r}: the value must be one non-empty line")
        if name in INT_MACROS and not re.fullmatch(r"\d+", text):
            raise ConfigError(f"{origin}: {name}={value!r} must be a non-negative integer")
        if name in MODE_MACROS and int(text) not in MODE_MACROS[name]:
            modes = ", ".join(f"{k} ({v})" for k, v in MODE_MACROS[name].items())
            raise ConfigError(f"{origin}: {name}={value!r} is not one of its modes: {modes}")
        out[name] = text
    return out


def parse_env_defines(text: str) -> dict:
    """MEGART_DEFINES="NAME=VALUE,FLAG" -> {NAME: VALUE, FLAG: "1"}, checked as check_defines does."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if eq and not value:
            raise ConfigError(f"MEGART_DEFINES: {item!r} has no value after '='; write NAME=VALUE or just NAME")
        out[name] = value or "1"
    return check_defines(out, "MEGART_DEFINES")


def watchdog_default() -> float:
    """MEGART_WATCHDOG_S, else 5 seconds."""
    text = os.environ.get("MEGART_WATCHDOG_S", "5")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"MEGART_WATCHDOG_S={text!r} is not a number of seconds (e.g. 5)") from None
    return value


def check_sm_count(sm_count):
    """None (ask the GPU, or assume an H200's 132) or a positive int."""
    if sm_count is None:
        return None
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise ConfigError(f"sm_count must be a positive int (or None for the default), got {sm_count!r}")
    return sm_count


def check_overrides(overrides) -> dict:
    """source_overrides keys must name a registered task type or a shared header one of them uses; a typo
    would otherwise compile the in-tree body without a word."""
    from . import registry
    if not isinstance(overrides, dict):
        raise ConfigError(f"source_overrides must be a dict {{task name or header: path}}, got "
                          f"{type(overrides).__name__}")
    types = [t for t in registry.all_types() if t.id not in registry.NO_BODY]
    valid = {t.name for t in types} | {h for t in types for h in t.headers}
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise ConfigError(f"source_overrides: {', '.join(repr(k) for k in unknown)} names no task type or shared "
                          f"header; valid keys: {', '.join(sorted(valid))}")
    return dict(overrides)


def specialize_skip(text: str) -> set:
    """MEGART_SPECIALIZE_SKIP="attention_decode.max_seq+gemv_m1": the task types (name) and scalars
    (type.param) that MEGART_SPECIALIZE leaves as fields, each checked against the registry."""
    from .registry import RegistryError, get
    out = set()
    for item in filter(None, (x.strip() for x in str(text).split("+"))):
        name, _, param = item.partition(".")
        try:
            t = get(name)
        except RegistryError:
            raise ConfigError(f"MEGART_SPECIALIZE_SKIP: {item!r}: no task type named {name!r}") from None
        if param and param not in {p.name for p in t.params if p.kind != "ptr"}:
            raise ConfigError(f"MEGART_SPECIALIZE_SKIP: {item!r}: {name} has no scalar param {param!r} (its "
                              f"scalars: {', '.join(p.name for p in t.params if p.kind != 'ptr')})")
        out.add(item)
    return out
