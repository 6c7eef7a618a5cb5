"""Candidate task bodies: a .cuh file compiled in place of a task type's in-tree body through
PersistentKernel(source_overrides={task: path}). The installed tree is never written.

A candidate may carry gate directives in comment lines (`// megart-faithful: ...`):

    // megart-faithful: include-baseline
        Paste the task type's in-tree source here (what `--baseline` compiles). Lets a candidate
        wrap or overload the in-tree body without copying it (so it cannot drift from it). Task
        bodies built on shared helpers (tasks/dense_common.cuh) are templates on their params struct; a
        non-template `megart_task_<name>(const megart_params_<name>&, char*)` defined after the
        paste wins overload resolution.
    // megart-faithful: include-baseline as=megart_task_axpy_base
        The same, with the in-tree body function renamed (for non-template bodies: wrap it).
    // megart-faithful: tiles=2x      (or tiles=264)
        The candidate splits one call into 2x the production instance count (or exactly 264). In a
        persistent kernel the instance count is fixed by the graph, not by the body, so this is how
        a candidate "spreads the same work over more CTAs" - and how the planted sloughing
        candidate is built. The gate reports the tiles it used; compare's SLOUGHING rule catches it.

Packaged planted candidates live in megart/faithful/candidates/ and can be named without a path:
`--kernel gemv_m1_slower` finds megart/faithful/candidates/gemv_m1_slower.cuh.
"""
from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..graph import MAX_TILES
from ..sources import read_source
from .codes import COMPILE, USAGE, GateError

CANDIDATES_DIR = Path(__file__).resolve().parent / "candidates"
_DIRECTIVE = re.compile(r"^\s*//\s*megart-faithful:\s*(.*?)\s*$")


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def packaged() -> list[Path]:
    return sorted(CANDIDATES_DIR.glob("*.cuh"))


def find(spec: str) -> Path:
    """A candidate path as given, else a packaged candidate of that name (with or without .cuh)."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p.resolve()
    for name in (spec, spec + ".cuh"):
        q = CANDIDATES_DIR / name
        if q.is_file() and "/" not in spec:
            return q
    names = ", ".join(q.stem for q in packaged()) or "none"
    raise GateError(USAGE, f"--kernel {spec!r}: no such file (and no packaged candidate of that name; packaged: "
                           f"{names}). Give the path of a .cuh file defining the task's body.")


@dataclass
class Candidate:
    """What the gate compiles for the task under test."""
    task: str
    label: str                    # "baseline" or the candidate path as given
    path: Path | None             # the user's file; None for the baseline
    text: str                     # the task source compiled (directives resolved)
    override: Path | None         # what source_overrides[task] points at; None for the baseline
    tiles_scale: float | None = None
    tiles_abs: int | None = None
    directives: list = field(default_factory=list)
    _tmp: object = None           # keeps a resolved copy alive while the kernel compiles

    @property
    def is_baseline(self) -> bool:
        return self.path is None

    @property
    def sha(self) -> str:
        return short_hash(self.text)

    def tiles(self, production: int) -> int:
        if self.tiles_abs is not None:
            return self.tiles_abs
        if self.tiles_scale is not None:
            return max(1, int(round(production * self.tiles_scale)))
        return production

    def overrides(self) -> dict:
        return {} if self.override is None else {self.task: str(self.override)}

    def describe(self) -> str:
        if self.is_baseline:
            return f"baseline (in-tree body, sha {self.sha})"
        extra = f"; directives: {', '.join(self.directives)}" if self.directives else ""
        return f"candidate {self.label} (sha {self.sha}{extra})"

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def baseline(ttype) -> Candidate:
    text, _ = read_source(ttype.source)
    return Candidate(task=ttype.name, label="baseline", path=None, text=text, override=None)


def load(spec: str, ttype) -> Candidate:
    """Read a candidate for `ttype`, resolve its directives, and check it defines the task's body."""
    path = find(spec)
    try:
        raw = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise GateError(USAGE, f"--kernel {spec!r}: cannot read {path}: {exc}") from None
    out, directives = [], []
    tiles_scale = tiles_abs = None
    resolved = False
    for n, line in enumerate(raw.split("\n"), 1):
        m = _DIRECTIVE.match(line)
        if not m:
            out.append(line)
            continue
        body = m.group(1)
        directives.append(body)
        out.append(line)
        for item in [s.strip() for s in re.split(r"[,;]", body) if s.strip()]:
            if item.startswith("include-baseline"):
                rest = item[len("include-baseline"):].strip()
                rename = None
                if rest:
                    mm = re.fullmatch(r"as\s*=\s*([A-Za-z_]\w*)", rest)
                    if not mm:
                        raise GateError(USAGE, f"{path}:{n}: bad directive {item!r}; write "
                                               "'include-baseline' or 'include-baseline as=NEW_NAME'.")
                    rename = mm.group(1)
                text, src_path = read_source(ttype.source)
                if rename:
                    text = re.sub(rf"\b{re.escape(ttype.body_name)}\b", rename, text)
                out.append(f"// ---- begin in-tree {src_path.name} (include-baseline) ----")
                out.extend(text.rstrip("\n").split("\n"))
                out.append(f"// ---- end in-tree {src_path.name} ----")
                resolved = True
            elif item.startswith("tiles"):
                mm = re.fullmatch(r"tiles\s*=\s*(\d+(?:\.\d+)?)\s*(x?)", item)
                if not mm or float(mm.group(1)) <= 0:
                    raise GateError(USAGE, f"{path}:{n}: bad directive {item!r}; write 'tiles=2x' (a multiple "
                                           "of the production instance count) or 'tiles=264'.")
                if mm.group(2):
                    tiles_scale = float(mm.group(1))
                else:
                    tiles_abs = int(float(mm.group(1)))
                if (tiles_abs or 0) > MAX_TILES or (tiles_scale or 0) > MAX_TILES:
                    raise GateError(USAGE, f"{path}:{n}: directive {item!r} asks for more than {MAX_TILES} "
                                           "instances, the most one call may have.")
            else:
                raise GateError(USAGE, f"{path}:{n}: unknown megart-faithful directive {item!r} (known: "
                                       "include-baseline [as=NAME], tiles=Nx, tiles=N).")
    text = "\n".join(out)
    if not re.search(rf"\b{re.escape(ttype.body_name)}\b", text):
        raise GateError(COMPILE, f"candidate {path} does not define {ttype.body_name}(const {ttype.struct_name}& p, "
                                 f"char* smem), the body of task {ttype.name!r}; nothing would replace the "
                                 "in-tree body. Check --task, or add '// megart-faithful: include-baseline'.")
    cand = Candidate(task=ttype.name, label=spec, path=path, text=text, override=path,
                     tiles_scale=tiles_scale, tiles_abs=tiles_abs, directives=directives)
    if resolved:
        tmp = tempfile.TemporaryDirectory(prefix="megart-faithful-")
        resolved_path = Path(tmp.name) / f"{path.stem}.resolved.cuh"
        resolved_path.write_text(text)
        cand.override, cand._tmp = resolved_path, tmp
    return cand
