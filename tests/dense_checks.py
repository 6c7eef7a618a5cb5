"""What the dense task tests share (tests/test_tasks_dense.py, tests/test_tasks_lm_head.py,
tests/test_dense_engines.py): a CPU kernel, its two runs (the reference emulator and the host simulation of the
CUDA bodies) and the gate both must pass (cosine, relative error within the type's measured tolerance, the
feature drop it must catch)."""
from __future__ import annotations

import torch

import megart
from megart.emulate import hostsim as dense_hostsim
from megart.geometry import dense as geo

# per task, declared as TaskType.tol (docs/TASKS.md, "Dense tasks": E and D measured at the shapes below)
TOL = {t.name: t.tol for t in megart.registry.all_types() if t.tol is not None}
NW = 132
LLAMA1B = dict(d=2048, ffn=8192, vocab=128256)


def kernel(nw: int = NW) -> megart.PersistentKernel:
    return megart.PersistentKernel(nw=nw, device="cpu")


def run(pk: megart.PersistentKernel, steps: int = 1, seed: int = 0):
    """Compile (no spills), then (emulator result, host-simulated device result)."""
    pk.compile()
    r = pk.report
    assert r.spill_bytes == 0, f"ptxas spilled: {r}"
    emu = pk.emulate(steps=steps, seed=seed)
    dev = {k: v.clone() for k, v in dense_hostsim.run(pk, steps=steps, seed=seed).items()}
    return emu, dev


def gate(task: str, emu, dev, ref, drop=None) -> None:
    """Both results: cosine >= 0.99 and relerr <= TOL[task]; device body vs Python mirror within tol/2;
    `drop` (a feature-dropped reference) must be >= 10x tol away from ref."""
    tol = TOL[task]
    for which, out in (("emu", emu), ("dev", dev)):
        c, e = geo.cosine(out, ref), geo.relerr(out, ref)
        print(f"[gate] {task} {which}: E={e:.3e} cos={c:.6f}")
        assert c >= 0.99, f"{task} ({which}): cosine {c:.5f} < 0.99 (relerr {e:.3e})"
        assert e <= tol, f"{task} ({which}): relerr {e:.3e} > tol {tol:.0e} (cosine {c:.5f})"
    de = geo.relerr(dev, emu)
    print(f"[gate] {task} dev-vs-emu: {de:.3e}")
    assert de <= tol / 2, f"{task}: device body and Python mirror differ by {de:.3e}"
    if drop is not None:
        d = geo.relerr(drop, ref)
        print(f"[gate] {task}: D={d:.3e}")
        assert d >= 10 * tol, f"{task}: the feature drop differs by only {d:.3e}; tol {tol:.0e} cannot see it"


def bf16(t):
    return t.to(torch.bfloat16)
