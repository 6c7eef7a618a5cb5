"""Issue 11: bad input that used to lose data, give a silent wrong answer, hang, or fail with a bare
Python error. Each test names its item; the faithful command line's cases are in test_bad_input_cli.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import megart
from megart import compile as mcompile
from megart.errors import ConfigError, GraphError, InputError, RegistryError, ScheduleError

REPO = Path(__file__).resolve().parents[1]


def pk(nw=4, **kw):
    return megart.PersistentKernel(nw=nw, device="cpu", **kw)


# --- item 2: a user type with a built-in's name -------------------------------------------------------
def test_item02_register_builtin_name_fails_at_once_and_keeps_the_registry(tmp_path):
    """In a fresh process (the built-ins not loaded yet), registering 'copy' fails at once; afterwards
    every built-in is still there."""
    src = tmp_path / "mine.cuh"
    src.write_text("__device__ void megart_task_copy(const megart_params_copy& p, char* smem) {}\n")
    code = f"""
import megart
from megart import registry
try:
    megart.register_task("copy", 1000, [megart.ptr("dst", "f32", "out")], {str(src)!r}, lambda p: None)
    print("REGISTERED")
except megart.RegistryError as exc:
    print("REFUSED", exc)
print("COPY_ID", registry.get("copy").id, "GEMV_ID", registry.get("gemv_m1").id,
      "HAS_1000", any(t.id == 1000 for t in registry.all_types()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "'copy' is already registered" in r.stdout
    assert "COPY_ID 4 GEMV_ID 16 HAS_1000 False" in r.stdout


# --- item 3: overlapping views of one buffer in the emulator ------------------------------------------
def test_item03_emulator_shares_storage_of_aliased_views():
    k = pk()
    buf = torch.zeros(16)
    a, b = k.tensor(buf[0:8], "a"), k.tensor(buf[4:12], "b")      # b[0:4] is a[4:8]
    src = k.tensor(torch.arange(1.0, 9.0), "src")
    out = k.tensor(torch.zeros(8), "out")
    k.task("copy", dst=a, src=src, tiles=2)
    k.task("copy", dst=out, src=b, tiles=2)                        # ordered after the write by inference
    k.compile()
    host = k.emulate()
    assert host["out"].tolist() == [5.0, 6.0, 7.0, 8.0, 0.0, 0.0, 0.0, 0.0]
    assert host["b"].tolist() == host["out"].tolist()
    assert buf.sum() == 0                       # the caller's buffer is not written by the emulator


# --- item 4: Llama token ids and block inputs ---------------------------------------------------------
def test_item04_llama_refuses_tokens_it_would_clamp_or_truncate():
    from megart.models import llama
    m = llama.LlamaModel(llama.tiny(), device="cpu", nw=8, compile=False)
    v = m.cfg.vocab
    for bad, match in ((v, "outside the vocabulary"), (-1, "outside the vocabulary"), (3.0, "int id"),
                       (True, "int id"), (torch.tensor([1, 2]), "one integer element"),
                       (torch.tensor(1.5), "one integer element"), (torch.tensor([v], dtype=torch.int32), "outside")):
        with pytest.raises(InputError, match=match):
            m.step(bad)
    with pytest.raises(InputError, match="n must be an int >= 0"):
        m.generate(-3)
    with pytest.raises(InputError, match="outside the vocabulary"):
        m.generate(2, token=v + 5)
    with pytest.raises(ValueError):             # InputError is a ValueError, as before
        m.step(v)


def test_item04_llama_block_refuses_broadcast_inputs():
    from megart.models import llama
    m = llama.LlamaModel(llama.tiny(vocab=0), device="cpu", nw=8, compile=False)
    for bad in (torch.zeros(1), torch.tensor(0.5), torch.zeros(m.cfg.d + 1), 3):
        with pytest.raises(InputError, match=f"\\({m.cfg.d},\\) tensor"):
            m.step(bad, m.cfg.prefill)


# --- item 5: shapes, not only element counts ----------------------------------------------------------
def test_item05_transposed_weight_with_the_right_numel_is_refused():
    from megart.geometry import dense as geo
    n, k = 64, 128
    w, x = geo.dense_m1(n, k, seed=0)
    kk = pk()
    W_t = kk.tensor(w.t().contiguous(), "w_t")                      # [K, N]: same numel, wrong layout
    X, Y = kk.tensor(x, "x"), kk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y")
    with pytest.raises(GraphError, match=r"shape \(128, 64\), expected \(64, 128\)"):
        kk.task("gemv_m1", y=Y, w=W_t, x=X)
    kk.task("gemv_m1", y=Y, w=kk.tensor(w.reshape(-1), "w_flat"), x=X)   # flat: row-major, accepted
    H = kk.tensor(torch.zeros(n, dtype=torch.bfloat16), "h")
    with pytest.raises(GraphError, match="w_gate .* has shape"):
        kk.task("gate_up_silu", h=H, w_gate=W_t, w_up=kk.tensor(w, "w_ok"), x=X)


# --- item 6: unordered writers of the same bytes ------------------------------------------------------
def test_item06_unordered_writers_are_reported_naming_both():
    k = pk()
    a, b = k.tensor(torch.ones(64), "a"), k.tensor(torch.full((64,), 2.0), "b")
    y = k.tensor(torch.zeros(64), "y")
    k.task("copy", dst=y, src=a, tiles=2, infer=False)
    k.task("copy", dst=y, src=b, tiles=2, infer=False)
    with pytest.raises(ScheduleError, match="unordered writers") as ei:
        k.compile()
    msg = str(ei.value)
    assert "copy#0" in msg and "copy#2" in msg and "tensor 'y'" in msg and "bytes [0, 128)" in msg


def test_item06_ordered_writers_still_compile():
    k = pk()
    a, b = k.tensor(torch.ones(64), "a"), k.tensor(torch.full((64,), 2.0), "b")
    y = k.tensor(torch.zeros(64), "y")
    g = k.task("copy", dst=y, src=a, tiles=2, infer=False)
    k.task("copy", dst=y, src=b, tiles=2, infer=False, after=[g])
    k.compile()
    assert all(k.emulate(seed=s)["y"].eq(2.0).all() for s in range(4))


# --- item 7: a source_overrides key that names nothing ------------------------------------------------
def test_item07_override_typo_is_an_error_listing_the_valid_keys(tmp_path):
    body = tmp_path / "g.cuh"
    body.write_text("// nothing\n")
    with pytest.raises(ConfigError, match="'gemv_m' names no task type") as ei:
        pk(source_overrides={"gemv_m": str(body)})
    assert "gemv_m1" in str(ei.value) and "tasks/dense_common.cuh" in str(ei.value)
    pk(source_overrides={"gemv_m1": str(body), "tasks/dense_common.cuh": str(body)})    # valid keys


# --- item 8: defines the runtime owns, malformed macro names ------------------------------------------
@pytest.mark.parametrize("defines,match", [
    ({"MEGART_THREADS": 64}, "set by megart itself"),
    ({"MEGART_MIN_BLOCKS": 2}, "set by megart itself"),
    ({"MEGART_SMEM_ALIGN": 16}, "set by megart itself"),
    ({"MEGART_PHASE_MARKS": "on"}, "MEGART_PHASE_MARKS='on' must be a non-negative integer"),
    ({"1BAD": 1}, "not a macro name"),
    ({"A B": 1}, "not a macro name"),
    ({"X": "1\n#define Y 2"}, "one non-empty line"),
    ({"MEGART_DENSE_RING_SLOTS": "two"}, "non-negative integer"),
    ({"MEGART_LEAN_SYNC": "yes"}, "MEGART_LEAN_SYNC='yes' must be a non-negative integer"),
    ({"MEGART_STREAM_WAITS": 3}, r"MEGART_STREAM_WAITS=3 is not one of its modes: 0 \(off\), 1 \(stage times\), 2"),
    ({"MEGART_PHASE_MARKS": "7"}, "MEGART_PHASE_MARKS='7' is not one of its modes"),
    ({"MEGART_ATTN_MARK0": 7}, r"MEGART_ATTN_MARK0=7 is not one of its modes: 0 \(K/V attended\), 1 \(body start\)"),
])
def test_item08_owned_or_malformed_defines_are_refused(defines, match):
    with pytest.raises(ConfigError, match=match):
        pk(defines=defines)


def test_item08_env_defines_are_checked_too(monkeypatch):
    monkeypatch.setenv("MEGART_DEFINES", "MEGART_THREADS=64")
    with pytest.raises(ConfigError, match="MEGART_DEFINES: MEGART_THREADS is set by megart"):
        pk()
    monkeypatch.setenv("MEGART_DEFINES", "MEGART_DENSE_RING_SLOTS=abc")
    with pytest.raises(ConfigError, match="MEGART_DEFINES: MEGART_DENSE_RING_SLOTS='abc'"):
        pk()
    monkeypatch.setenv("MEGART_DEFINES", "FOO=")
    with pytest.raises(ConfigError, match="no value after '='"):
        pk()


# --- item 11: the compile cache ------------------------------------------------------------------------
def _noop_kernel():
    k = pk(nw=2)
    k.task("noop", tiles=2)
    return k


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("MEGART_CACHE_DIR", str(d))
    monkeypatch.setattr(mcompile, "_warned_cache", False)
    return d


def test_item11_unwritable_cache_warns_once_and_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")                     # mkdir fails under it, even for root
    monkeypatch.setenv("MEGART_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(mcompile, "_warned_cache", False)
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        k = _noop_kernel().compile()
    assert k.report.registers > 0 and not k.compiled.cache_hit
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once per process
        _noop_kernel().compile()


def test_item11_entry_path_that_is_a_directory(cache):
    k = _noop_kernel().compile()
    key = k.compiled.key
    for f in cache.glob(f"{key}.*"):
        f.unlink()
    (cache / f"{key}.cubin").mkdir()
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        k2 = _noop_kernel().compile()
    assert k2.report == k.report and not k2.compiled.cache_hit


def test_item11_record_is_trusted_only_within_its_hash(cache):
    k = _noop_kernel().compile()
    real = k.report.registers
    meta_p = cache / f"{k.compiled.key}.json"
    for bad in ("40", 1):                       # a non-numeric field; a number the hash does not cover
        meta = json.loads(meta_p.read_text())
        meta["report"]["registers"] = bad
        meta_p.write_text(json.dumps(meta))
        k2 = _noop_kernel().compile()
        assert not k2.compiled.cache_hit and k2.report.registers == real, bad
    assert _noop_kernel().compile().compiled.cache_hit        # the rewritten entry is good again


# --- item 12: tiles far beyond the work, and a linear build -------------------------------------------
def test_item12_huge_tiles_fail_at_once():
    k = pk()
    x, y = k.tensor(torch.zeros(1 << 20), "x"), k.tensor(torch.zeros(1 << 20), "y")
    t0 = time.monotonic()
    with pytest.raises(GraphError, match="tiles=100000000 is outside"):
        k.task("axpy", y=y, x=x, tiles=100_000_000)
    with pytest.raises(GraphError, match="tiles=100000000"):
        k.task("noop", tiles=100_000_000)
    with pytest.raises(GraphError, match="tiles must be an int"):
        k.task("noop", tiles=2.5)
    assert time.monotonic() - t0 < 5


def test_item12_graph_build_is_linear_in_tiles():
    def build_s(n):
        best = float("inf")
        for _ in range(3):
            k = pk(nw=132)
            x, y = k.tensor(torch.zeros(n * 8), "x"), k.tensor(torch.zeros(n * 8), "y")
            t0 = time.perf_counter()
            k.task("axpy", y=y, x=x, a=2.0, tiles=n)
            k.task("copy", dst=x, src=y, tiles=n)
            best = min(best, time.perf_counter() - t0)
        return best
    small, large = build_s(2000), build_s(32000)
    # 16x the tiles: ~16x the time when linear; the old scan of every earlier access took ~60x
    assert large / small < 35, (small, large)


# --- item 14: bare errors ------------------------------------------------------------------------------
def test_item14_after_a_group_of_another_kernel():
    k1, k2 = pk(), pk()
    g = k1.task("noop", tiles=4)
    k2.task("noop", tiles=1)
    with pytest.raises(GraphError, match="after= takes groups returned by this kernel"):
        k2.task("noop", after=[g])


def test_item14_waits_signals_after_need_a_list():
    k = pk()
    ev = k.event("e")
    g = k.task("noop", signals=[ev])
    with pytest.raises(GraphError, match=r"waits= takes a list \(e.g. waits=\[x\]\), got event 'e'"):
        k.task("noop", waits=ev)
    with pytest.raises(GraphError, match="after= takes a list"):
        k.task("noop", after=g)


def test_item14_environment_and_sm_count(monkeypatch):
    monkeypatch.setenv("MEGART_WATCHDOG_S", "abc")
    with pytest.raises(ConfigError, match="MEGART_WATCHDOG_S='abc'"):
        pk()
    monkeypatch.delenv("MEGART_WATCHDOG_S")
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="sm_count must be a positive int"):
            pk(sm_count=bad)
    assert pk(sm_count=8).sm_count == 8


@pytest.mark.parametrize("name,tid,match", [
    ("big_id", 2**31, "id must be an int in"),
    ("template", 1500, "is a C\\+\\+ keyword"),
    ("register", 1501, "is a C\\+\\+ keyword"),
    ("__x", 1502, "reserved C\\+\\+ identifier"),
])
def test_item14_user_task_ids_and_names(tmp_path, name, tid, match):
    src = tmp_path / "t.cuh"
    src.write_text("// body\n")
    with pytest.raises(RegistryError, match=match):
        megart.register_task(name, tid, [megart.ptr("y", "f32", "out")], src, lambda p: None)
    with pytest.raises(RegistryError, match="parameter name 'int' is a C\\+\\+ keyword"):
        megart.register_task("fine_name", 1503, [megart.ptr("int", "f32", "out")], src, lambda p: None)
