"""megart/sources.py: one device tree, found one way; every built-in is a pair of files in tasks/ (its
declaring module next to its .cuh body), in a checkout as in a wheel (setup.py maps tasks/ to megart.tasks)."""
import sys
from pathlib import Path

import pytest

import megart
from megart import registry, sources
from megart.errors import GraphError

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_the_checkout_and_megart_tasks_is_its_tasks_folder():
    assert sources.source_root() == ROOT
    assert Path(megart.tasks.__file__) == ROOT / "tasks" / "__init__.py"


def test_each_builtin_body_sits_next_to_its_declaration():
    for t in registry.all_types():
        if t.id in registry.NO_BODY or t.id >= registry.USER_ID_BASE:   # (user types other tests registered)
            continue
        declared_in = Path(sys.modules[t.reference.__module__].__file__).parent
        body = sources.source_root() / t.source
        assert body.is_file(), f"{t.name}: {body} missing"
        assert body.parent == declared_in == sources.TASKS_DIR, f"{t.name}: body {body}, declaration in {declared_in}"


def test_setup_maps_the_device_tree_into_the_package():
    text = (ROOT / "setup.py").read_text()
    for pkg, folder in (("megart.tasks", "tasks"), ("megart.csrc", "csrc"), ("megart.profiler", "profiler")):
        assert f'"{pkg}": "{folder}"' in text


def test_a_missing_source_names_the_path(tmp_path):
    with pytest.raises(GraphError, match="nope.cuh"):
        sources.read_source(str(tmp_path / "nope.cuh"))
