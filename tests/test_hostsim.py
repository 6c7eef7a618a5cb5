"""megart/emulate/hostsim.py's library cache (the simulations themselves are tested with the engines and the models
that use them: test_dense_engines, test_stream, test_tasks_attention)."""
import subprocess

from megart import registry
from megart.emulate import hostsim


def test_a_library_is_built_under_its_own_name_and_renamed_in_whole(tmp_path, monkeypatch):
    """Two processes (pytest-xdist workers) building or loading the same library at once: the compiler writes
    to a name of this process's own, and the cache's name appears only once the library is whole (a reader that
    found a half-written one failed in CI with "file too short")."""
    monkeypatch.setenv("MEGART_HOSTSIM_CACHE", str(tmp_path))
    real_run, seen = subprocess.run, []

    def compile_and_look(cmd, **kw):
        out = cmd[cmd.index("-o") + 1]
        seen.append((out, sorted(p.name for p in tmp_path.glob("*.so"))))
        return real_run(cmd, **kw)

    monkeypatch.setattr(hostsim.subprocess, "run", compile_and_look)
    lib = hostsim.library([registry.get("copy")], defines={"MEGART_TEST_HOSTSIM_CACHE": 1})
    assert lib is not None and len(seen) == 1
    out, during = seen[0]
    assert out.endswith(".tmp.so") and during == []              # nothing under the cache's name while it builds
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("*.so")]
    assert len(list(tmp_path.glob("*.so"))) == 1 and not list(tmp_path.glob("*.tmp.so"))
