"""Imports inside megart/ run one way: no module imports (at the top or inside a function) a module that
imports it back, directly or through others, and none imports from a higher floor than its own in
docs/ARCHITECTURE.md's floor list. Read with the standard library's ast; nothing is imported."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megart"
TASKS = ROOT / "tasks"      # the package megart.tasks (setup.py maps it; megart/sources.py loads it from here)


def _modules() -> dict:
    out = {}
    for base, prefix in ((PKG, ()), (TASKS, ("megart", "tasks"))):
        for p in base.rglob("*.py"):
            parts = prefix + p.relative_to(base.parent if not prefix else base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def test_the_task_declarations_are_seen():
    mods = _modules()
    assert {"megart.tasks", "megart.tasks.dense_matvec", "megart.tasks.attention", "megart"} <= set(mods)
    assert mods["megart.tasks"] == TASKS / "__init__.py"


def _edges(mods: dict) -> dict:
    """module -> the megart modules it imports (relative and absolute forms, lazy imports included)."""
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_megart():
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "import cycles (each a set of modules that import one another): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _floors() -> dict:
    """{top-level unit (module or subpackage of megart, or 'megart' for its __init__): floor}."""
    block = re.search(r"```floors\n(.*?)```", (ROOT / "docs" / "ARCHITECTURE.md").read_text(), re.S).group(1)
    out = {}
    for line in block.strip().splitlines():
        floor, _, names = line.partition(":")
        out.update({n.strip(): int(floor) for n in names.split(",")})
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_architecture_floor_list_matches_the_imports():
    floors, mods = _floors(), _modules()
    missing = sorted({_unit(m) for m in mods} - set(floors))
    assert not missing, f"docs/ARCHITECTURE.md's floor list misses {missing}"
    upward = sorted({f"{_unit(m)} (floor {floors[_unit(m)]}) imports {_unit(d)} (floor {floors[_unit(d)]})"
                     for m, deps in _edges(mods).items() for d in deps
                     if _unit(d) != _unit(m) and floors[_unit(d)] > floors[_unit(m)]})
    assert not upward, "imports from a higher floor: " + "; ".join(upward)
