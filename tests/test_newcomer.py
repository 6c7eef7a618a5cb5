"""Issue 11, the newcomer's path (items 17-25): the README's install and Use sections, a repository that
stands alone, emulated (never "measured") figures and plots on a CPU, readable plots, NVTX ranges."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import megart
from megart.profile import Profile

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


# --- item 17: install on any machine; the two commands ---------------------------------------------
def test_item17_two_commands_each_in_a_fresh_venv_and_ci_runs_the_second():
    cmds = [b.strip() for b in _code_blocks(_section(README, "Two commands")) if "venv" in b]
    assert len(cmds) == 2
    venvs = [re.search(r"python3 -m venv (\S+)", c).group(1) for c in cmds]
    assert venvs[0] != venvs[1], "each command gets its own fresh venv"
    for c, v in zip(cmds, venvs):
        assert f". {v}/bin/activate" in c
    ci = (REPO / ".ci" / "run").read_text()
    pip_ci = re.search(r"^pip install .*$", ci, flags=re.M).group(0)
    test_cmd = cmds[1].split(" && ", 2)[2]
    norm = lambda c: [w for w in shlex.split(c) if w != "-q"]  # noqa: E731
    assert norm(pip_ci) == norm(test_cmd), (pip_ci, test_cmd)


def test_item17_readme_says_how_to_install_anywhere():
    install = " ".join(_section(README, "Install").split())
    assert "download.pytorch.org/whl/cpu" in install            # the CPU wheel
    assert "--no-index --find-links" in install                   # no network
    assert "keeps that torch" in install                          # an existing CUDA torch is not replaced
    assert "nothing can be installed there" not in README and "keeps on disk" not in README
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^\s*"torch",\s*$', pyproject, flags=re.M), "torch stays an ordinary, unpinned dependency"


# --- item 18: the Use example runs on a CPU ---------------------------------------------------------
def test_item18_readme_use_example_runs_on_a_cpu(tmp_path):
    code = _code_blocks(_section(README, "Use"), "python")[0]
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "EMULATED" in r.stdout and "not measured" in r.stdout and "axpy" in r.stdout
    for png in ("step.png", "calls.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG", png


def test_item18_profile_without_gpu_points_to_the_emulated_one():
    pk = megart.PersistentKernel(nw=4, device="cpu", profile=True)
    x, y = pk.tensor(torch.randn(4096), "x"), pk.tensor(torch.zeros(4096), "y")
    a = pk.task("axpy", y=y, x=x, a=2.0, tiles=4)
    c = pk.task("copy", dst=x, src=y, tiles=4)
    pk.compile()
    with pytest.raises(megart.DeviceError, match="emulated_profile"):
        pk.profile()
    prof = pk.emulated_profile()
    assert prof.emulated and prof.table().startswith("EMULATED") and "EMULATED" in repr(prof)
    from megart.profile import BODY_BEGIN, BODY_END, INSTANCE
    r = prof.records
    end_of = {int(i): int(e) for i, e in zip(r[:, INSTANCE], r[:, BODY_END])}
    begin_of = {int(i): int(b) for i, b in zip(r[:, INSTANCE], r[:, BODY_BEGIN])}
    # the copy of a slice starts after the axpy that wrote it (the model respects the schedule)
    for ua, uc in zip(a.uids, c.uids):
        assert begin_of[uc] >= end_of[ua]


# --- item 19: the repository stands alone -----------------------------------------------------------
def test_item19_no_reference_outside_the_repository():
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob("*.md"),
             *(REPO / "megart").rglob("*.py"), *(REPO / "tests" / "gpu").glob("*.py")]
    bad = re.compile(r"\.\./shared|shared/|CALIBRATION\.md|seeds/|DESIGN\.md")
    hits = [f"{p.relative_to(REPO)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
            if bad.search(line)]
    assert not hits, hits
    method = (REPO / "docs" / "METHOD.md").read_text()
    for fact in ("4.53 TB/s", "0.96 us at 132 CTAs", "tol >= 2 x E", "10x below D", "cosine >= 0.99",
                 "randn(out, in) / sqrt(in)", "pre-quantised", "128-row tile", "8 launches", "never top-k"):
        assert fact in method, fact


def test_item19_docs_name_only_files_that_exist():
    for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for ref in re.findall(r"`((?:docs|bench|scripts|tests|megart|tasks|csrc)/[\w./-]+\.(?:md|py|sh|cuh))`",
                              p.read_text()):
            assert (REPO / ref).exists(), f"{p.name} names {ref}"


# --- item 21: the Llama bench on a CPU ---------------------------------------------------------------
def _bench():
    spec = importlib.util.spec_from_file_location("llama_decode_bench", REPO / "bench" / "llama_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_item21_cpu_bench_summary_is_labelled_emulated():
    b = _bench()
    row = dict(config="tiny", floor_us=float("nan"), eager_us=900.0, megart_us=5000.0, tok_s=200.0,
               x_floor=float("nan"), relerr_first_step=0.0, compiled_us=float("nan"))
    cpu = b.summary([row], float("nan"), "none (cpu)", "cpu")
    assert "CUDA events" not in cpu and "EMULATED" in cpu and "not GPU timings" in cpu
    assert "CUDA events" in b.summary([row], 4.5e12, "read kernel", "cuda")


# --- item 22: sweep tick labels for close worker counts ------------------------------------------------
def test_item22_sweep_tick_labels_do_not_overlap(tmp_path):
    pytest.importorskip("matplotlib")
    from megart.faithful import sweep
    res = []
    for nw in (8, 64, 68, 128, 132):
        t = {k: {"median": 1000.0 * (1 + nw / 100), "min": 990.0, "max": 1010.0 * (1 + nw / 100)}
             for k in ("slow_cta", "wall", "sum_cta")}
        res.append(dict(nw=nw, shape="8192x2048", timings=t, task="gemv_m1", context="isolated",
                        kernel="baseline", kernel_sha="abc", tiles=nw))
    captured = {}
    from matplotlib.figure import Figure
    real_savefig = Figure.savefig

    def savefig(self, *a, **k):
        captured["fig"] = self
        return real_savefig(self, *a, **k)

    Figure.savefig = savefig
    try:
        sweep.plot_sweep(res, tmp_path / "s.png")
    finally:
        Figure.savefig = real_savefig
    fig = captured["fig"]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [lb.get_window_extent(renderer) for lb in ax.get_xticklabels() if lb.get_text()]
        assert len(boxes) == 5
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)


# --- item 23: .venv is ignored --------------------------------------------------------------------------
def test_item23_venv_is_ignored():
    r = subprocess.run(["git", "check-ignore", "-q", ".venv/test/bin/python"], cwd=REPO)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.returncode == 0


# --- item 24: NVTX ranges through the optional nvtx package ------------------------------------------
def test_item24_without_nvtx_nothing_is_wrapped():
    from megart import nvtx_ranges
    if nvtx_ranges.enabled():
        pytest.skip("nvtx is installed here")

    def f():
        return 1
    assert nvtx_ranges.ranged("x")(f) is f
    assert megart.PersistentKernel.compile.__name__ == "compile"


def test_item24_with_nvtx_the_phases_are_ranges(tmp_path):
    fake = tmp_path / "fake" / "nvtx.py"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent('''
        import functools
        SEEN = []
        class annotate:
            def __init__(self, message=None, domain=None, **kw):
                self.message, self.domain = message, domain
            def __enter__(self):
                SEEN.append((self.domain, self.message))
            def __exit__(self, *exc):
                return False
            def __call__(self, fn):
                @functools.wraps(fn)
                def wrapped(*a, **k):
                    with self:
                        return fn(*a, **k)
                return wrapped
    '''))
    code = textwrap.dedent('''
        import torch, megart, nvtx
        from megart.faithful.run import GateConfig, prepare, cpu_point
        pk = megart.PersistentKernel(nw=2, device="cpu")
        pk.task("noop", tiles=2)
        pk.compile()
        pk.emulate()
        p = prepare(GateConfig(task="axpy", shape="4096", nw=4))
        cpu_point(p, 4, lambda s: None)
        print(sorted(set(nvtx.SEEN)))
    ''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), str(REPO)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("megart.compile", "megart.emulate", "faithful.prepare", "faithful.cpu_point", "faithful.compile"):
        assert f"('megart', '{name}')" in r.stdout, name


# --- item 25: a readable view of the calls of a step ---------------------------------------------------
def test_item25_calls_plot_shows_spans_gaps_and_body_vs_wait(tmp_path):
    pytest.importorskip("matplotlib")
    from megart.trace_calls import call_spans, layer_kind, plot_calls
    # (type_id, instance, worker, smid, wait_start, body_begin, body_end, step)
    rows = [(16, 0, 0, 0, 0, 100, 600, 1), (16, 1, 1, 1, 0, 150, 700, 1),        # L0.o
            (18, 2, 0, 0, 600, 900, 1500, 1), (18, 3, 1, 1, 700, 800, 1400, 1),   # L0.gate_up
            (16, 4, 0, 0, 1500, 1600, 2000, 1)]                                   # L1.o
    prof = Profile(np.array(rows, dtype=np.int64), {16: "gemv_m1", 18: "gate_up_silu"}, nw=2,
                   source="EMULATED (test)")
    calls = {"L0.o": [0, 1], "L0.gate_up": [2, 3], "L1.o": [4]}
    spans = call_spans(prof, calls, 1)
    assert [(s["label"], s["begin"], s["end"], s["body"], s["wait"]) for s in spans] == [
        ("L0.o", 100, 700, 1050, 250), ("L0.gate_up", 800, 1500, 1200, 400), ("L1.o", 1600, 2000, 400, 100)]
    assert layer_kind("L12.gate_up") == "gate_up" and layer_kind("lm_head") == "lm_head"
    out = plot_calls(prof, calls, tmp_path / "calls.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
