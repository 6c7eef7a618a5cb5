"""The emulator runs schedules on the CPU and matches a straight numpy/torch replay of the graph."""
import random

import pytest
import torch

import megart

import random_dag


def replay(pk) -> dict:
    """Execute the graph's instances in plain program order: the meaning the schedule must preserve."""
    host = {n: t.data.clone() for n, t in pk.graph.tensors.items()}
    for inst in pk.graph.instances:
        if not inst.is_barrier:
            inst.type.reference(pk.graph.host_views(inst, host))
    return host


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("nw", [1, 5, 32])
def test_emulator_matches_program_order(seed, nw):
    pk = megart.PersistentKernel(nw=nw, device="cpu")
    random_dag.build(pk, seed, calls=50, size=777)
    pk.compile()
    want = replay(pk)
    for interleaving in range(3):
        got = pk.emulate(seed=interleaving)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, interleaving)


def test_emulator_detects_missing_dependency():
    """With inference off the copy may run before the axpy it reads: some interleaving differs."""
    results = set()
    for seed in range(20):
        pk = megart.PersistentKernel(nw=2, device="cpu")
        x = pk.tensor(torch.ones(64), "x")
        y = pk.tensor(torch.zeros(64), "y")
        pk.task("axpy", y=x, x=x, a=1.0, worker=0)
        pk.task("copy", dst=y, src=x, worker=1, infer=False)
        pk.compile()
        results.add(float(pk.emulate(seed=seed)["y"][0]))
    assert results == {1.0, 2.0}


def test_emulate_multiple_steps():
    pk = megart.PersistentKernel(nw=3, device="cpu")
    y = pk.tensor(torch.zeros(10), "y")
    x = pk.tensor(torch.ones(10), "x")
    pk.task("axpy", y=y, x=x, a=2.0, tiles=3)
    pk.compile()
    assert torch.equal(pk.emulate(steps=4)["y"], torch.full((10,), 8.0))
