"""The faithful per-task gate on a CPU (its compare step: tests/test_faithful_compare.py): one distinct exit code
per kind of bad input, the GPU lock, candidate overlays
(directives, compile errors with the NVRTC log), span extraction by numeric id, and the CPU path of
the main command (compile, verify, emulate, then "timing needs a GPU", exit 0)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import megart
import megart.bandwidth

from megart.faithful import codes
from megart.faithful import gates
from megart.faithful.codes import GateError
from megart.faithful.lock import GpuLock
from megart.faithful.stats import task_timings
from megart.profile import SPAN_WORDS

from faithful_records import rec, run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch, tmp_path):
    # the CPU path even on a GPU machine; a private lock dir
    monkeypatch.setenv("MEGART_FAITHFUL_FORCE_CPU", "1")
    monkeypatch.setenv("MEGART_LOCK_DIR", str(tmp_path / "lock"))


@contextlib.contextmanager
def replaced_gate(task: str, **fields):
    """While inside: `task`'s gate spec with `fields` replaced (yields the original spec); after: the
    replacement is dropped again, so the declared gate is looked up anew."""
    spec = gates.get(task)
    gates.register_gate(gates.GateSpec(**{**spec.__dict__, **fields}), replace=True)
    try:
        yield spec
    finally:
        gates.unregister_gate(task)


def run_module(*argv, env=None, timeout=300):
    e = dict(os.environ, MEGART_FAITHFUL_FORCE_CPU="1", PYTHONPATH=str(REPO))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "megart.faithful", *argv], capture_output=True, text=True,
                          cwd=REPO, env=e, timeout=timeout)


# ------------------------------------------------------------------------------------------------
# span extraction: numeric id, only the calls under test, CTAs per step
# ------------------------------------------------------------------------------------------------
def span(tid, inst, worker, begin, end, step):
    return (tid, inst, worker, worker + 10, begin - 5, begin, end, step, begin, begin)   # (no phase marks)


def test_task_timings_by_numeric_id_and_call():
    rows = []
    for step in (1, 2, 3):
        t0 = step * 100_000
        rows += [span(16, 0, 0, t0, t0 + 1000, step), span(16, 1, 1, t0 + 50, t0 + 900, step)]   # call A
        rows += [span(16, 7, 0, t0 + 5000, t0 + 5400, step)]                                      # call B
        rows += [span(17, 2, 2, t0, t0 + 99_999, step)]                                           # another task
    recs = np.array(rows, dtype=np.int64)
    assert recs.shape[1] == SPAN_WORDS
    t = task_timings(recs, 16, calls=[[0, 1]])
    assert t["slow_cta"]["median"] == 1000 and t["wall"]["median"] == 1000 and t["sum_cta"]["median"] == 1850
    assert t["ctas_per_step"] == 2 and t["samples"] == 3 and t["instances_per_call"] == 2
    both = task_timings(recs, 16, calls=[[0, 1], [7]])
    assert both["samples"] == 6 and both["calls"] == 2
    with pytest.raises(ValueError, match="no spans with task id 99"):
        task_timings(recs, 99)


# ------------------------------------------------------------------------------------------------
# exit codes, one per kind of bad input
# ------------------------------------------------------------------------------------------------
def test_unknown_task(capsys):
    rc, out, err = run_cli(capsys, "--task", "no_such_task")
    assert rc == codes.UNKNOWN_TASK
    assert "unknown task 'no_such_task'" in err and "axpy" in err and "Traceback" not in err


def test_task_without_spec(capsys):
    rc, out, err = run_cli(capsys, "--task", "spin")
    assert rc == codes.UNKNOWN_TASK and "no faithful gate spec" in err


def test_usage_errors(capsys):
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "big")
    assert rc == codes.USAGE and "is not a shape" in err
    rc, out, err = run_cli(capsys, "--task", "axpy", "--iters", "x")
    assert rc == codes.USAGE
    rc, out, err = run_cli(capsys, "--task", "axpy", "--kernel", "/nonexistent/cand.cuh")
    assert rc == codes.USAGE and "no such file" in err
    rc, out, err = run_cli(capsys, "--task", "axpy", "--baseline", "--kernel", "axpy_slower")
    assert rc == codes.USAGE
    rc, out, err = run_cli(capsys)
    assert rc == codes.USAGE and "--task is required" in err
    rc, out, err = run_cli(capsys, "--task", "axpy", "--num-workers", "0")
    assert rc == codes.USAGE


def test_shape_refused(capsys):
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "16x16")
    assert rc == codes.BAD_SHAPE and "1-dimensional" in err
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "1024x1001")
    assert rc == codes.BAD_SHAPE and "multiple of 8" in err
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "64x32768")   # x no longer fits in smem
    assert rc == codes.BAD_SHAPE and "refuses" in err


def test_decode_m1_refused_by_a_task_without_that_mode(capsys):
    with replaced_gate("copy", decode_m1="none"):
        rc, out, err = run_cli(capsys, "--task", "copy", "--decode-m1")
    assert rc == codes.BAD_SHAPE and "--decode-m1" in err


def test_candidate_compile_error_prints_nvrtc_log(tmp_path, capsys):
    cand = tmp_path / "broken_axpy.cuh"
    cand.write_text("__device__ __forceinline__ void megart_task_axpy(const megart_params_axpy& p, char*) {\n"
                    "  p.y[0] = undeclared_thing;\n}\n")
    rc, out, err = run_cli(capsys, "--task", "axpy", "--kernel", str(cand))
    assert rc == codes.COMPILE
    assert "failed to compile with NVRTC" in err
    assert "undeclared_thing" in err and "broken_axpy.cuh:2" in err      # the log, mapped to the file
    assert "FAITHFUL_RESULT" not in out and "Traceback" not in err


def test_candidate_compile_error_after_include_baseline_names_the_file(tmp_path, capsys):
    cand = tmp_path / "broken2.cuh"
    cand.write_text("// megart-faithful: include-baseline as=inner_axpy\n"
                    "__device__ void megart_task_axpy(const megart_params_axpy& p, char* s) { inner_axpy(p); }\n")
    rc, out, err = run_cli(capsys, "--task", "axpy", "--kernel", str(cand))
    assert rc == codes.COMPILE and "broken2.cuh (after include-baseline)" in err


def test_candidate_without_the_body(tmp_path, capsys):
    cand = tmp_path / "wrong_task.cuh"
    cand.write_text("__device__ void megart_task_copy(const megart_params_copy& p, char*) {}\n")
    rc, out, err = run_cli(capsys, "--task", "axpy", "--kernel", str(cand))
    assert rc == codes.COMPILE and "does not define megart_task_axpy" in err


def test_bad_directive(tmp_path, capsys):
    cand = tmp_path / "d.cuh"
    cand.write_text("// megart-faithful: tiles=lots\n// megart-faithful: include-baseline\n")
    rc, out, err = run_cli(capsys, "--task", "axpy", "--kernel", str(cand))
    assert rc == codes.USAGE and "d.cuh:1" in err


def test_nw_over_co_residency(capsys):
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "2048x2048", "--num-workers", "5000")
    assert rc == codes.RESIDENCY
    assert "cannot all be co-resident" in err and "registers" in err


def test_no_gpu_when_timing_asked(capsys, tmp_path):
    # (--json and --sweep-workers run the CPU check there: tests/test_bad_input_cli.py)
    for extra in (["--iters", "10"], ["--require-gpu"]):
        rc, out, err = run_cli(capsys, "--task", "axpy", *extra)
        assert rc == codes.NO_GPU, extra
        assert "needs a GPU" in err and extra[0] in err


def test_unknown_context(capsys):
    rc, out, err = run_cli(capsys, "--task", "axpy", "--context", "gpt_17")
    assert rc == codes.UNKNOWN_CONTEXT and "--context 'gpt_17'" in err and "isolated" in err


def test_incorrect_output_fails_with_its_code(capsys):
    spec = gates.get("copy")

    def wrong(shape, **kw):
        gi = spec.build(shape, **kw)
        gi.expected = -gi.expected        # a reference the task cannot match
        return gi

    with replaced_gate("copy", build=wrong):
        rc, out, err = run_cli(capsys, "--task", "copy", "--shape", "4096")
    assert rc == codes.INCORRECT and "is WRONG" in err and "no timing" in err


def test_internal_error_is_one_paragraph(capsys):
    def boom(shape, **kw):
        raise RuntimeError("spec bug")

    with replaced_gate("copy", build=boom):
        rc, out, err = run_cli(capsys, "--task", "copy")
    assert rc == codes.INTERNAL and "spec bug" in err and "MEGART_FAITHFUL_DEBUG" in err
    assert "Traceback" not in err


def test_exit_codes_are_distinct_and_documented():
    nums = [c for c, _ in codes.TABLE]
    assert len(nums) == len(set(nums))
    doc = (REPO / "docs" / "FAITHFUL.md").read_text()
    for c, _ in codes.TABLE:
        assert f"| {c} |" in doc, f"exit code {c} is not in docs/FAITHFUL.md"


# ------------------------------------------------------------------------------------------------
# the GPU lock
# ------------------------------------------------------------------------------------------------
def test_lock_second_holder_times_out_naming_the_first(tmp_path):
    path = tmp_path / "gpu.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(REPO)!r})
            from megart.faithful.lock import GpuLock
            with GpuLock({str(path)!r}, timeout=5, label="holder-under-test"):
                print("held", flush=True)
                time.sleep(30)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(GateError) as ei:
            GpuLock(path, timeout=0.5).acquire()
        assert 0.4 < time.monotonic() - t0 < 5
        e = ei.value
        assert e.code == codes.LOCKED
        assert f"pid {holder.pid}" in e.message and "holder-under-test" in e.message
        assert "--lock-timeout" in e.message
    finally:
        holder.kill()
        holder.wait()
    with GpuLock(path, timeout=2) as lk:      # the dead holder's lock is gone (flock dies with it)
        assert lk.waited < 2


def test_lock_is_reentrant_in_sequence_and_clears_holder(tmp_path):
    path = tmp_path / "l.lock"
    holder = tmp_path / "l.lock.holder"
    with GpuLock(path, timeout=1):
        assert json.loads(holder.read_text())["pid"] == os.getpid()
        assert path.read_text() == ""          # the lock file itself is never written
    assert path.read_text() == "" and not holder.exists()
    with GpuLock(path, timeout=1):
        pass


# ------------------------------------------------------------------------------------------------
# candidates and specs
# ------------------------------------------------------------------------------------------------
def test_packaged_candidates_resolve_and_carry_directives():
    from megart import registry
    from megart.faithful import candidate
    names = {p.stem for p in candidate.packaged()}
    assert {"gemv_m1_slower", "gemv_m1_sloughing", "axpy_slower", "axpy_sloughing"} <= names
    c = candidate.load("gemv_m1_sloughing", registry.get("gemv_m1"))
    try:
        assert c.tiles(64) == 128 and "tiles=2x" in c.directives
        assert c.override != c.path and c.override.read_text() == c.text   # resolved copy, tree untouched
        assert "megart_task_gemv_m1" in c.text
    finally:
        c.close()
    b = candidate.baseline(registry.get("gemv_m1"))
    assert b.is_baseline and b.overrides() == {} and b.tiles(132) == 132


def test_every_available_spec_builds_small(capsys):
    """Each spec builds, its reference matches the emulator at a small shape (the split is right)."""
    from megart.faithful.run import GateConfig, build, check_output, compile_kernel, prepare, result_of
    small = {"axpy": "4096", "copy": "4096", "gemv_m1": "256x512", "gemv_m1_fp8": "256x512",
             "gate_up_silu": "256x512", "group_gemm_m1": "16x128x256"}
    for name in gates.available():
        spec = gates.get(name)
        shape = small.get(name)
        if shape is None:
            shape = spec.shape_str(spec.cpu_shape or spec.default_shape)
        p = prepare(GateConfig(task=name, shape=shape))
        b = build(p, 16, "cpu")
        compile_kernel(p, b)
        corr = check_output(result_of(b.inputs, b.pk.emulate()), b.inputs)
        assert corr["pass"] and corr["cos"] > 0.999, (name, corr)


# ------------------------------------------------------------------------------------------------
# the CPU path of the main command
# ------------------------------------------------------------------------------------------------
def test_cpu_path_gemv_m1_subprocess():
    r = run_module("--task", "gemv_m1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "task gemv_m1 (task id 16), shape 8192x2048" in out
    assert "ptxas (sm_90a):" in out and "registers" in out and "co-resident >= nw 132" in out
    assert "PASS" in out and "TIMING NEEDS A GPU" in out
    cpu = json.loads(next(line for line in out.splitlines() if line.startswith("FAITHFUL_CPU")).split(" ", 1)[1])
    assert cpu["timings"] is None and cpu["correctness"]["pass"] and cpu["task_id"] == 16
    assert "FAITHFUL_RESULT" not in out


def test_engine_choice_builds_that_engine(capsys):
    """--engine stream builds the isolated gate with the weight stream the decode models ship (and says so, in
    the report and the record), --engine registers without it; a model context refuses the option."""
    runs = {}
    for engine, says in (("stream", "weights: the launch-wide stream"), ("registers", "weights: registers")):
        rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "2048x2048", "--engine", engine)
        assert rc == 0, err
        assert says in out
        runs[engine] = json.loads(next(line for line in out.splitlines()
                                       if line.startswith("FAITHFUL_CPU")).split(" ", 1)[1])
        assert runs[engine]["correctness"]["pass"]
    assert runs["stream"]["engine"]["weights"] == "stream" and runs["stream"]["engine"]["slots"] >= 2
    assert runs["registers"]["engine"] == {"weights": "registers", "slots": 0, "declined": None}
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--context", "llama_tiny", "--engine", "registers")
    assert rc == codes.USAGE and "a model context runs the model as it ships" in err
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "65536", "--engine", "stream")
    assert rc == 0 and "declares no weight stream" in out and "weights: registers" in out
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "2048x2048", "--tiles", "32",
                           "--kernel", "gemv_m1_sloughing", "--engine", "stream")
    assert rc == 0 and "this candidate runs on registers" in out and "weights: registers" in out


def test_cpu_path_reduced_shape_says_so(capsys):
    rc, out, err = run_cli(capsys, "--task", "axpy")
    assert rc == 0, err
    assert "REDUCED shape 1048576" in out and "requested 16777216" in out


def test_cpu_path_sloughing_candidate_splits_more(capsys):
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "2048x2048", "--tiles", "32",
                           "--kernel", "gemv_m1_sloughing")
    assert rc == 0, err
    cpu = json.loads(next(line for line in out.splitlines() if line.startswith("FAITHFUL_CPU")).split(" ", 1)[1])
    assert cpu["production_tiles"] == 32 and cpu["tiles"] == 64 and cpu["instances"] == 64
    assert "the task's CPU reference and split" in out
    # the candidate's own CUDA body ran in the host simulation (the in-tree body: right answer)
    assert cpu["correctness"]["body_checked"] is True and cpu["correctness"]["pass"] is True
    assert "candidate CUDA body (host simulation)" in out


def test_list(capsys):
    rc, out, err = run_cli(capsys, "--list")
    assert rc == 0 and "gemv_m1" in out and "gemv_m1_slower" in out and "contexts: isolated" in out


def test_help_lists_exit_codes(capsys):
    rc, out, err = run_cli(capsys, "--help")
    assert rc == 0 and "exit codes:" in out and "no GPU" in out


def test_sweep_plot(tmp_path):
    from megart.faithful.sweep import plot_sweep, sweep_table
    res = []
    for nw in (8, 64, 128):
        r = rec(1e6 / nw, 1.1e6 / nw, 1e6)
        r.update(nw=nw, kernel="baseline", tiles=nw)
        res.append(r)
    out = plot_sweep(res, tmp_path / "s.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    assert "128" in sweep_table(res)


def test_sweep_order_128_first():
    from megart.faithful.cli import _parse_workers
    assert _parse_workers("8,64,68,128,132") == [128, 8, 64, 68, 132]
    assert _parse_workers("8,8,64") == [8, 64]
    with pytest.raises(GateError):
        _parse_workers("8,-1")


# ------------------------------------------------------------------------------------------------
# model context (CPU path): the candidate compiled into the whole model's kernel
# ------------------------------------------------------------------------------------------------
def _has_llama():
    from megart.faithful import context
    return bool(context.known())


@pytest.mark.skipif(not _has_llama(), reason="megart.models.llama is not in this checkout")
def test_model_context_cpu_path(capsys):
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--context", "llama_tiny", "--kernel", "gemv_m1_slower",
                           "--num-workers", "16")
    assert rc == 0, err
    assert "every gemv_m1 call of the model" in out and "calls under test:" in out
    assert "ptxas (sm_90a):" in out and "TIMING NEEDS A GPU" in out
    cpu = json.loads(next(line for line in out.splitlines() if line.startswith("FAITHFUL_CPU")).split(" ", 1)[1])
    assert cpu["context"] == "llama_tiny" and cpu["correctness"]["reference_pass"]
    # the candidate body only compiled into the model's kernel: never a pass on a CPU
    assert cpu["correctness"]["pass"] is None and cpu["correctness"]["body_checked"] is False


@pytest.mark.skipif(not _has_llama(), reason="megart.models.llama is not in this checkout")
def test_model_context_shape_not_in_model(capsys):
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--context", "llama_tiny", "--shape", "64x64",
                           "--num-workers", "16")
    assert rc == codes.BAD_SHAPE and "has no gemv_m1 call of shape 64x64" in err and "L0.o" in err


# ------------------------------------------------------------------------------------------------
# the timed path end to end on a simulated device: the real gate code (build, correctness, profiled
# steps, span extraction, table, FAITHFUL_RESULT, JSONL, sweep plot, compare), with the kernel run by
# the emulator and span records synthesised from a bandwidth model. It proves the plumbing, not the
# CUDA bodies: tests/gpu/test_faithful_gpu.py does that on a GPU.
# ------------------------------------------------------------------------------------------------
PER_CTA_BW = 50e9      # bytes/s one CTA streams when HBM is not the limit
TOTAL_BW = 4.0e12      # HBM read bandwidth shared by all CTAs


def _inst_bytes(inst) -> int:
    from megart.tensors import TensorRef
    return sum(v.count * v.tensor.itemsize for v in inst.params.values() if isinstance(v, TensorRef))


@pytest.fixture
def fake_gpu(monkeypatch):
    from megart.faithful import cli, floor, lock, run
    from megart.kernel import PersistentKernel
    from megart.profile import Profile
    from megart import registry

    rng = np.random.default_rng(0)

    def launch(self):
        self._fake_step = getattr(self, "_fake_step", 0) + 1
        self.emulate(1, seed=self._fake_step, host={n: t.data for n, t in self.graph.tensors.items()})
        base, cap = getattr(self, "_fake_window", (1, self.profile_steps))
        if not base <= self._fake_step < base + cap:
            return
        slow = 2.0 if any("slower" in str(v) for v in self.source_overrides.values()) else 1.0
        s = self.schedule
        recs = getattr(self, "_fake_recs", [])
        t0 = self._fake_step * 10_000_000
        for w, q in enumerate(s.queues):
            t = t0 + 32 * w
            for uid in q:
                inst = s.instances[uid]
                group = [u for u in s.graph.groups[inst.group].uids] if inst.group < len(s.graph.groups) else [uid]
                active = min(len(group), self.nw)
                bw = min(PER_CTA_BW, TOTAL_BW / active)
                dur = int((500 + _inst_bytes(inst) / bw * 1e9 * slow) * (1 + 0.01 * rng.standard_normal()))
                recs.append((inst.type.id, uid, w, w, t, t, t + dur, self._fake_step, t, t))
                t += dur
        self._fake_recs = recs

    def check(self):
        return getattr(self, "_fake_step", 0)

    def reset_profile(self, steps=None):
        self.profile_steps = steps or self.profile_steps
        self._fake_window = (getattr(self, "_fake_step", 0) + 1, self.profile_steps)
        self._fake_recs = []

    def profile(self):
        recs = np.array(getattr(self, "_fake_recs", []), dtype=np.int64).reshape(-1, SPAN_WORDS)
        return Profile(recs, registry.names_by_id(), overflow=0, nw=self.nw)

    for name, fn in (("launch", launch), ("check", check), ("reset_profile", reset_profile), ("profile", profile)):
        monkeypatch.setattr(PersistentKernel, name, fn)
    monkeypatch.setattr(run, "BUILD_DEVICE", "cpu")
    monkeypatch.setattr(run, "gpu_usable", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("P", (), {"name": "simulated H200", "multi_processor_count": 132})())
    monkeypatch.setattr(megart.bandwidth, "read_floor", lambda **k: {"floor_bw": TOTAL_BW, "floor_method": "simulated",
                                                               "floor_spread": 0.0})
    monkeypatch.setattr(floor, "L2Flush", lambda dev, **k: (lambda: None))
    monkeypatch.setattr(lock, "other_gpu_processes", lambda *a: [{"pid": 4242, "name": "intruder",
                                                                   "used_memory_mib": "1000"}])
    return cli


def _results(out: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("FAITHFUL_RESULT")]


def test_timed_path_simulated_end_to_end(fake_gpu, tmp_path, capsys):
    base, slow, slough = (str(tmp_path / f"{n}.jsonl") for n in ("base", "slow", "slough"))
    common = ["--task", "gemv_m1", "--shape", "1024x2048", "--tiles", "32", "--iters", "8", "--warmup", "1"]
    rc, out, err = run_cli(capsys, *common, "--baseline", "--json", base)
    assert rc == 0, err
    assert "other processes are using this GPU" in err and "pid 4242" in err
    assert "slowCTA" in out and "sumCTA" in out and "x floor" in out and "read floor" in out
    r = _results(out)[0]
    assert r["task_id"] == 16 and r["nw"] == 132 and r["tiles"] == 32 and r["ctas_per_step"] == 32
    assert r["timings"]["slow_cta"]["n"] == 3 * 8 and r["correctness"]["pass"] and r["repeats"] == 3
    assert len(r["timings"]["slow_cta"]["runs"]) == 3 and r["timings"]["slow_cta"]["run_spread"] < 0.05
    rc, out, err = run_cli(capsys, *common, "--kernel", "gemv_m1_slower", "--json", slow)
    assert rc == 0, err
    rc, out, err = run_cli(capsys, *common, "--kernel", "gemv_m1_sloughing", "--json", slough)
    assert rc == 0, err
    assert _results(out)[0]["tiles"] == 64
    rc, out, err = run_cli(capsys, *common, "--baseline", "--json", base)     # a second baseline run
    assert rc == 0, err
    verdicts = {}
    for name, path in (("slow", slow), ("slough", slough), ("self", base)):
        rc, out, err = run_cli(capsys, "compare", base, path)
        assert rc == 0, err
        verdicts[name] = json.loads(next(line for line in out.splitlines()
                                         if line.startswith("FAITHFUL_VERDICT")).split(" ", 1)[1])["verdict"]
    assert verdicts == {"slow": "REGRESS", "slough": "SLOUGHING", "self": "NULL"}


def test_timed_sweep_simulated_writes_plot(fake_gpu, tmp_path, capsys):
    out_json = tmp_path / "sweep.jsonl"
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "65536", "--sweep-workers", "8,64,128",
                           "--iters", "4", "--warmup", "0", "--json", str(out_json))
    assert rc == 0, err
    nws = [r["nw"] for r in _results(out)]
    assert nws == [128, 8, 64]                      # 128 first
    png = tmp_path / "sweep.sweep.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(out_json.read_text().splitlines()) == 3


def test_timed_wrong_candidate_gets_no_timing(fake_gpu, tmp_path, capsys, monkeypatch):
    spec = gates.get("copy")

    def wrong(shape, **kw):
        gi = spec.build(shape, **kw)
        gi.expected = -gi.expected
        return gi

    with replaced_gate("copy", build=wrong):
        rc, out, err = run_cli(capsys, "--task", "copy", "--shape", "4096", "--iters", "3",
                               "--json", str(tmp_path / "o.jsonl"))
    assert rc == codes.INCORRECT and "no timing" in err
    r = _results(out)[0]
    assert r["timings"] is None and not r["correctness"]["pass"]
    assert json.loads((tmp_path / "o.jsonl").read_text())["timings"] is None


@pytest.mark.skipif(not _has_llama(), reason="megart.models.llama is not in this checkout")
def test_timed_model_context_simulated(fake_gpu, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--context", "llama_tiny", "--num-workers", "16",
                           "--iters", "2", "--warmup", "0", "--kernel", "gemv_m1_slower")
    assert rc == 0, err
    rs = _results(out)
    assert {r["shape"] for r in rs} == {"256x256", "256x512"}
    for r in rs:
        assert r["context"] == "llama_tiny" and r["calls"] == 2 and r["samples"] == 3 * 2 * 2
        assert r["correctness"]["pass"] and r["correctness"]["model"]["available"]
        assert r["calls_under_test"][0].startswith("L0.")
        n, k = map(int, r["shape"].split("x"))
        assert r["bytes"] == n * k * 2 + k * 2 + 2 * n * 2      # W, x, y and the residual (cost model, per call)
    assert "correctness in context: cos 1.000000" in out


def test_device_failures_carry_the_device_exit_code():
    """The timed path's build device and the DEVICE exit code are different names (one shadowed the other)."""
    from megart.faithful import codes, run
    assert run.BUILD_DEVICE == "cuda"
    assert run.DEVICE == codes.DEVICE == 10
    assert run.classify(megart.HangError("stuck")).code == codes.DEVICE
    assert run.classify(megart.DeviceError("gone")).code == codes.DEVICE
