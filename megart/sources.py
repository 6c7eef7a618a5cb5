"""Where device sources come from. The source root is the repository (or the installed package's
copy of csrc/, tasks/, profiler/); `overrides` map a task name to another file, which is how the
faithful gate compiles a candidate body without ever writing the installed tree."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import GraphError

_PKG = Path(__file__).resolve().parent


def source_root() -> Path:
    """MEGART_SOURCE_ROOT if set; else the repository checkout; else the copy installed with the package."""
    env = os.environ.get("MEGART_SOURCE_ROOT")
    if env:
        return Path(env)
    for root in (_PKG.parent, _PKG / "_src"):
        if (root / "csrc" / "runtime.cuh").is_file():
            return root
    raise GraphError(f"megart device sources not found next to {_PKG} (expected csrc/runtime.cuh)")


def read_source(rel_or_abs: str, root: Path | None = None) -> tuple[str, Path]:
    path = Path(rel_or_abs)
    if not path.is_absolute():
        path = (root or source_root()) / path
    try:
        return path.read_text(), path
    except OSError as exc:
        raise GraphError(f"cannot read device source {path}: {exc}") from exc
