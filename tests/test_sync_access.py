"""The "sync" parameter access (megart/registry.py): counters the instances of one call update with atomics
to order themselves. A read for dependency inference (the call's instances stay unordered among themselves),
a writable pointer in the generated struct, never a weight of another task, and listed for the runtime to
zero after an abort (Graph.sync_tensors). Its user, attention_decode's fused merge, is tested in
tests/test_tasks_attention.py."""
import os
import subprocess
import sys
from pathlib import Path

import megart
from megart import registry

REPO = Path(__file__).resolve().parents[1]


def test_a_sync_pointer_is_read_for_ordering_and_writable_in_c():
    p = megart.ptr("arrivals", "i32", "sync")
    assert p.reads and not p.writes and p.mutates
    assert p.c_decl() == "int* arrivals;"
    assert "sync" in registry.ACCESS


def test_instances_sharing_a_counter_are_unordered_and_it_is_never_a_weight(tmp_path):
    """In a fresh process (user types registered here stay out of the other tests' registry): two calls that
    count one sync word up have no dependency on each other, the word is listed for the abort reset, and a
    task that reads it as a weight is refused."""
    src = tmp_path / "t.cuh"
    src.write_text("// bodies are not compiled here\n")
    code = f"""
import torch, megart
from megart.errors import GraphError
megart.register_task("sync_count", 1871, [megart.ptr("c", "i32", "sync")], {str(src)!r}, lambda p: None)
megart.register_task("i32_weight_read", 1872, [megart.ptr("w", "i32", "weight")], {str(src)!r}, lambda p: None)
pk = megart.PersistentKernel(nw=4, device="cpu")
c = pk.tensor(torch.zeros(4, dtype=torch.int32), "c")
a, b = pk.task("sync_count", c=c), pk.task("sync_count", c=c)
print("DEPS", [sorted(pk.graph.instances[g.uids[0]].deps) for g in (a, b)])
print("SYNC", [t.name for t in pk.graph.sync_tensors()])
try:
    pk.task("i32_weight_read", w=c)
    print("ACCEPTED")
except GraphError as exc:
    print("REFUSED", exc)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "DEPS [[], []]" in r.stdout and "SYNC ['c']" in r.stdout
    assert "REFUSED" in r.stdout and "read-only" in r.stdout, r.stdout
