"""Where device sources come from, one rule: the device tree (csrc/, tasks/, profiler/) sits next to the
package's runtime. In a checkout (and an editable install) that is the repository root around megart/; a wheel
carries the same three folders inside the package (setup.py maps them there), so the root is megart/ itself.
The Python package megart.tasks is that tree's tasks/ folder, so a built-in's declaration and its body are one
pair of files in both cases. `overrides` map a task name to another file, which is how the faithful gate
compiles a candidate body without ever writing the installed tree."""
from __future__ import annotations

from pathlib import Path

from .errors import GraphError

_PKG = Path(__file__).resolve().parent
# a wheel: the tree was mapped into the package; otherwise the checkout around it
ROOT = _PKG if (_PKG / "tasks" / "__init__.py").is_file() else _PKG.parent
TASKS_DIR = ROOT / "tasks"


def source_root() -> Path:
    """The folder that holds csrc/, tasks/ and profiler/ (see the module doc)."""
    if not (ROOT / "csrc" / "runtime.cuh").is_file():
        raise GraphError(f"megart device sources not found in {ROOT} (expected csrc/runtime.cuh next to tasks/)")
    return ROOT


def read_source(rel_or_abs: str, root: Path | None = None) -> tuple[str, Path]:
    path = Path(rel_or_abs)
    if not path.is_absolute():
        path = (root or source_root()) / path
    try:
        return path.read_text(), path
    except OSError as exc:
        raise GraphError(f"cannot read device source {path}: {exc}") from exc
