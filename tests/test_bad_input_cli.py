"""Issue 11, the faithful command line: the lock file, compare's band, what a CPU run checks and records,
SIGTERM, the reduced shape, strict JSON, and --json / --sweep-workers / compare on a CPU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megart.faithful import codes, gates
from megart.faithful.codes import GateError
from megart.faithful.lock import GpuLock
from test_faithful import _no_gpu, _results, fake_gpu, rec, replaced_gate, run_cli  # noqa: F401  (_no_gpu, fake_gpu: fixtures)

REPO = Path(__file__).resolve().parents[1]


def strict_lines(text: str) -> list[dict]:
    """Parse JSON lines the way a strict parser does: NaN / Infinity are errors."""
    def no_constants(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return [json.loads(line, parse_constant=no_constants) for line in text.splitlines() if line.strip()]


# --- item 1: the lock never destroys a file ------------------------------------------------------------
def test_item01_lock_refuses_a_file_with_content_and_leaves_it_intact(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text('{"task": "gemv_m1"}\n')
    with pytest.raises(GateError) as ei:
        GpuLock(results, timeout=1).acquire()
    assert ei.value.code == codes.USAGE and "not empty" in ei.value.message
    assert results.read_text() == '{"task": "gemv_m1"}\n'


def test_item01_lock_file_is_never_written(tmp_path):
    path = tmp_path / "gpu.lock"
    path.touch()
    with GpuLock(path, timeout=1):
        assert path.read_text() == ""
        assert json.loads((tmp_path / "gpu.lock.holder").read_text())["pid"] == os.getpid()
    assert path.read_text() == "" and not (tmp_path / "gpu.lock.holder").exists()


def test_item01_lock_file_equal_to_json_keeps_the_results(fake_gpu, tmp_path, capsys):  # noqa: F811
    out_json = tmp_path / "same.jsonl"
    common = ["--task", "axpy", "--shape", "4096", "--iters", "2", "--warmup", "0", "--repeats", "1"]
    rc, out, err = run_cli(capsys, *common, "--json", str(out_json), "--lock-file", str(out_json))
    assert rc == codes.USAGE and "same file" in err
    rc, out, err = run_cli(capsys, *common, "--json", str(out_json))
    assert rc == 0, err
    before = out_json.read_text()
    assert len(strict_lines(before)) == 1
    # a lock pointed at the results file (a different spelling of it is still refused, never truncated)
    rc, out, err = run_cli(capsys, *common, "--lock-file", str(out_json))
    assert rc == codes.USAGE and "not empty" in err
    assert out_json.read_text() == before


# --- item 9: compare's band must be finite ------------------------------------------------------------
@pytest.mark.parametrize("band", ["nan", "inf", "-0.5", "1.5"])
def test_item09_non_finite_min_band_is_refused(tmp_path, capsys, band):
    base, cand = tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    base.write_text(json.dumps(rec(10000, 12000, 400000)) + "\n")
    cand.write_text(json.dumps(rec(20000, 24000, 800000)) + "\n")          # 2x slower
    rc, out, err = run_cli(capsys, "compare", str(base), str(cand), "--min-band", band)
    assert rc == codes.USAGE and "--min-band" in err and "NULL" not in out
    rc, out, err = run_cli(capsys, "compare", str(base), str(cand))
    assert rc == 0 and "REGRESS" in out


# --- item 10: a wrong candidate body is not a CPU pass ------------------------------------------------
WRONG_GEMV = """
// megart-faithful: include-baseline
__device__ __forceinline__ void megart_task_gemv_m1(const megart_params_gemv_m1& p, char* smem) {
  megart_task_gemv_m1<megart_params_gemv_m1>(p, smem);
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < p.n; ++i) p.y[i] = __float2bfloat16_rn(-__bfloat162float(p.y[i]));   // wrong sign
}
"""

WRONG_AXPY = """
__device__ __forceinline__ void megart_task_axpy(const megart_params_axpy& p, char*) {
  for (int i = threadIdx.x; i < p.n; i += blockDim.x) p.y[i] = 0.f;                        // wrong
}
"""


def test_item10_wrong_dense_body_fails_on_a_cpu(tmp_path, capsys):
    cand = tmp_path / "wrong_gemv.cuh"
    cand.write_text(WRONG_GEMV)
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "256x256", "--num-workers", "8",
                           "--kernel", str(cand))
    assert rc == codes.INCORRECT, out + err
    assert "candidate CUDA body (host simulation): cos -0.99" in out and "is WRONG" in err
    assert "host simulation of the CUDA body" in err


def test_item10_body_that_cannot_run_on_a_cpu_is_not_a_pass(tmp_path, capsys):
    cand = tmp_path / "wrong_axpy.cuh"
    cand.write_text(WRONG_AXPY)
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "4096", "--num-workers", "8", "--kernel", str(cand))
    assert rc == 0, err
    cpu = json.loads(next(x for x in out.splitlines() if x.startswith("FAITHFUL_CPU")).split(" ", 1)[1])
    assert cpu["correctness"]["body_checked"] is False and cpu["correctness"]["pass"] is None
    assert "NOT CHECKED" in out and "PASS" not in out


# --- item 12: tiles far beyond any grid fail at once, naming the limit ----------------------------------
def test_item12_huge_tiles_on_the_command_line_and_in_a_directive(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--task", "axpy", "--tiles", "100000000")
    assert rc == codes.USAGE and "--tiles must be in [1, 65536]" in err
    cand = tmp_path / "many.cuh"
    cand.write_text("// megart-faithful: include-baseline, tiles=100000000\n")
    rc, out, err = run_cli(capsys, "--task", "axpy", "--kernel", str(cand))
    assert rc == codes.USAGE and "more than 65536 instances" in err


# --- item 13: SIGTERM cleans up as Ctrl-C does --------------------------------------------------------
def test_item13_sigterm_removes_the_candidate_temp_dir(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cand = tmp_path / "cand.cuh"
    cand.write_text("// megart-faithful: include-baseline\n")
    env = dict(os.environ, MEGART_FAITHFUL_FORCE_CPU="1", PYTHONPATH=str(REPO), TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "megart.faithful", "--task", "gemv_m1", "--kernel", str(cand)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        first = proc.stdout.readline()             # printed once the candidate's temp dir exists
        assert "megart.faithful: task gemv_m1" in first, first + proc.stderr.read()
        assert list(tmp.glob("megart-faithful-*")), "the candidate should hold a temporary directory"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not list(tmp.glob("megart-faithful-*"))


# --- item 15: the reduced CPU shape keeps K --------------------------------------------------------------
def test_item15_reduced_shape_keeps_the_requested_k(capsys):
    rc, out, err = run_cli(capsys, "--task", "gemv_m1", "--shape", "99999999992x8", "--num-workers", "8")
    assert rc == 0, err
    cpu = json.loads(next(x for x in out.splitlines() if x.startswith("FAITHFUL_CPU")).split(" ", 1)[1])
    assert cpu["emulated_shape"] == "2048x8" and cpu["reduced_dims"] == ["N"] and cpu["reduced_shape"]
    assert "REDUCED shape 2048x8 (N differ" in out


def test_item15_reduced_shape_says_which_dims_differ():
    spec = gates.get("gemv_m1")
    assert spec.cpu_reduce((65536, 2048)) == ((2048, 2048), ["N"])
    assert spec.cpu_reduce((65536, 16384)) == ((2048, 16384), ["N"])        # K kept
    assert spec.cpu_reduce((8192, 2048)) == ((8192, 2048), [])               # small enough as it is


# --- item 16: NaN is written as null with a reason ---------------------------------------------------
def test_item16_nan_results_are_strict_json(fake_gpu, tmp_path, capsys):  # noqa: F811
    spec = gates.get("copy")

    def with_nan(shape, **kw):
        gi = spec.build(shape, **kw)
        gi.tensors["src"][3] = float("nan")
        return gi

    with replaced_gate("copy", build=with_nan):
        rc, out, err = run_cli(capsys, "--task", "copy", "--shape", "4096", "--iters", "2",
                               "--json", str(tmp_path / "o.jsonl"))
    assert rc == codes.INCORRECT
    line = strict_lines((tmp_path / "o.jsonl").read_text())[0]
    assert line["correctness"]["cos"] is None and line["nonfinite"]["correctness.cos"] == "nan"
    strict_lines("\n".join(x.split(" ", 1)[1] for x in out.splitlines() if x.startswith("FAITHFUL_RESULT")))


# --- item 20: --json, --sweep-workers and compare on a CPU --------------------------------------------------
def test_item20_json_and_sweep_on_a_cpu_write_emulated_results(tmp_path, capsys):
    out_json = tmp_path / "cpu.jsonl"
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "4096", "--sweep-workers", "8,16",
                           "--json", str(out_json))
    assert rc == 0, err
    lines = strict_lines(out_json.read_text())
    assert [r["nw"] for r in lines] == [8, 16]
    assert all(r["emulated"] and r["timings"] is None and r["correctness"]["pass"] for r in lines)
    assert "sweep plot skipped" in out and "emulated" in out


def test_item20_compare_reads_cpu_lines_and_refuses_them(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--task", "axpy", "--shape", "4096", "--num-workers", "8")
    assert rc == 0, err
    log = tmp_path / "cpu.log"
    log.write_text(out)                                # a captured stdout with its FAITHFUL_CPU line
    rc, out, err = run_cli(capsys, "compare", str(log), str(log))
    assert rc == codes.NO_TIMINGS == 13 and "emulated results have no timings" in err


def test_item20_help_says_what_needs_a_gpu(capsys):
    rc, out, err = run_cli(capsys, "--help")
    assert rc == 0
    flat = " ".join(out.split())
    for text in ("profiled steps to time (default 50). Needs a GPU", "CPU: the compile/verify/emulate check at each nw",
                 "On a CPU the lines are the emulated results", "(GPU only: it plots timings)"):
        assert text in flat, text
