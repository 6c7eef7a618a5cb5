"""NVTX ranges (compile, launch, profile readback, the faithful gate's phases) for Nsight Systems,
through the optional `nvtx` package (pip install "megart[nvtx]"). Without it, `ranged` returns the
function itself and `range_` a shared no-op context: nothing is added to any call."""
from __future__ import annotations

import contextlib

try:
    import nvtx as _nvtx
except ImportError:          # optional dependency
    _nvtx = None

DOMAIN = "megart"
_NOOP = contextlib.nullcontext()


def enabled() -> bool:
    return _nvtx is not None


def ranged(name: str):
    """Decorator: the function runs inside an NVTX range `name` (domain "megart") when nvtx is installed."""
    if _nvtx is None:
        return lambda fn: fn
    return _nvtx.annotate(message=name, domain=DOMAIN)


def range_(name: str):
    """Context manager form of `ranged`, for a phase inside a function."""
    if _nvtx is None:
        return _NOOP
    return _nvtx.annotate(message=name, domain=DOMAIN)
