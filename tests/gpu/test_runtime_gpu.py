"""The runtime on a real GPU: random DAGs match the emulator over many steps at several grid sizes,
spans measure known spins, the watchdog turns a stuck graph into HangError and the context
survives, and worker counts beyond co-residency are refused."""
import pytest
import torch

import megart

import random_dag

pytestmark = pytest.mark.gpu


def _assert_same(got: dict, want: dict):
    for name, t in want.items():
        torch.testing.assert_close(got[name].cpu(), t, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("nw", [1, 8, 64, 128, 132])
def test_random_dags_match_emulator(nw, cuda):
    for seed in range(3):
        pk = megart.PersistentKernel(nw=nw, profile=(seed == 0))
        bufs = random_dag.build(pk, seed=100 * nw + seed, calls=150, size=8192)
        pk.compile()
        want = pk.emulate(steps=5, seed=seed)
        assert pk(steps=5) == 5
        _assert_same({n: t.data for n, t in bufs.items()}, want)


def test_steps_repeat_without_reset(cuda):
    pk = megart.PersistentKernel(nw=132)
    y = pk.tensor(torch.zeros(132 * 64, device="cuda"), "y")
    x = pk.tensor(torch.ones(132 * 64, device="cuda"), "x")
    pk.task("axpy", y=y, x=x, a=1.0, tiles=132)
    pk.barrier()
    pk.task("axpy", y=y, x=x, a=1.0, tiles=132)
    pk.compile()
    for k in range(1, 201):
        pk.launch()
    assert pk.check() == 200
    assert torch.all(y.data == 400.0)


@pytest.mark.parametrize("ns", [2_000, 10_000, 50_000])
def test_spin_spans_are_measured(ns, cuda):
    pk = megart.PersistentKernel(nw=132, profile=True, profile_steps=4)
    pk.task("spin", ns=ns, tiles=132 * 3)
    pk.compile()
    pk(steps=4)
    stats = pk.profile().by_task("spin")
    body = stats.instances[:, 6] - stats.instances[:, 5]
    assert len(body) == 4 * 132 * 3
    err = abs(body - ns)
    assert (err <= max(0.05 * ns, 200)).all(), (err.max(), ns)


def test_watchdog_raises_and_context_survives(cuda):
    pk = megart.PersistentKernel(nw=8, watchdog_s=0.5)
    e1, e2 = pk.event("e1"), pk.event("e2")
    pk.task("noop", waits=[e1], signals=[e2], worker=0)
    pk.task("noop", waits=[e2], signals=[e1], worker=3)
    pk.compile(verify=False)
    with pytest.raises(megart.HangError) as ei:
        pk()
    rec = ei.value.record
    assert rec["task"] == "noop" and rec["worker"] in (0, 3) and rec["event_name"] in ("e1", "e2")
    assert rec["have"] == 0 and rec["need"] == 1
    # the context is usable: torch works, and a valid kernel runs
    assert torch.ones(4, device="cuda").sum().item() == 4
    ok = megart.PersistentKernel(nw=132)
    y = ok.tensor(torch.zeros(1024, device="cuda"), "y")
    ok.task("axpy", y=y, x=ok.tensor(torch.ones(1024, device="cuda"), "x"), a=3.0, tiles=16)
    ok.compile()
    ok()
    assert torch.all(y.data == 3.0)
    # and the hung kernel itself was reset: it hangs again the same way rather than corrupting state
    with pytest.raises(megart.HangError):
        pk()


def test_nw_beyond_coresidency_is_refused(cuda, tmp_path):
    big = tmp_path / "big_smem.cuh"
    big.write_text("__device__ __forceinline__ void megart_task_big_smem(const megart_params_big_smem&, char* s)"
                   " { s[threadIdx.x] = 1; }\n")
    try:
        t = megart.registry.get("big_smem")
    except megart.RegistryError:
        t = megart.register_task("big_smem", 1999, [], big, reference=lambda p: None, smem_bytes=150 * 1024)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pk = megart.PersistentKernel(nw=sms + 4)
    pk.task(t)
    with pytest.raises(megart.ResidencyError, match="shared memory"):
        pk.compile()
    ok = megart.PersistentKernel(nw=sms)
    ok.task(t)
    ok.compile()
    ok()


def test_two_ctas_per_sm_when_they_fit(cuda):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pk = megart.PersistentKernel(nw=sms + 4)
    y = pk.tensor(torch.zeros(4096, device="cuda"), "y")
    pk.task("axpy", y=y, x=pk.tensor(torch.ones(4096, device="cuda"), "x"), a=1.0, tiles=sms + 4)
    pk.barrier()
    pk.compile()
    assert pk.occupancy.per_sm >= 2
    pk(steps=3)
    assert torch.all(y.data == 3.0)


def test_cupy_arrays_are_accepted(cuda):
    cupy = pytest.importorskip("cupy")
    pk = megart.PersistentKernel(nw=16)
    x = cupy.arange(256, dtype=cupy.float32)
    y = cupy.zeros(256, dtype=cupy.float32)
    pk.task("copy", dst=pk.tensor(y, "y"), src=pk.tensor(x, "x"), tiles=4)
    pk.compile()
    pk()
    assert bool((y == x).all())


def test_profile_overflow_and_trace_export(cuda, tmp_path):
    from megart.trace import plot_timeline, to_chrome_trace
    pk = megart.PersistentKernel(nw=16, profile=True, profile_steps=3)
    y = pk.tensor(torch.zeros(4096, device="cuda"), "y")
    pk.task("axpy", y=y, x=pk.tensor(torch.ones(4096, device="cuda"), "x"), a=1.0, tiles=32)
    pk.task("spin", ns=3000, tiles=16)
    pk.compile()
    pk(steps=5)                                   # two steps past the 3-step window
    prof = pk.profile()
    assert prof.steps == [1, 2, 3]
    assert prof.overflow == 2 * 48                # counted, not written
    assert prof.by_task("axpy").instances_per_step == 32
    trace = to_chrome_trace(prof, tmp_path / "t.json")
    assert sum(e.get("ph") == "X" and not e["name"].startswith("wait:") for e in trace["traceEvents"]) == 3 * 48
    png = plot_timeline(prof, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pk.reset_profile(2)                           # a new window: the next two steps
    pk(steps=2)
    assert pk.profile().steps == [6, 7]


def test_launch_inside_a_cuda_graph(cuda):
    pk = megart.PersistentKernel(nw=132)
    y = pk.tensor(torch.zeros(132 * 32, device="cuda"), "y")
    pk.task("axpy", y=y, x=pk.tensor(torch.ones(132 * 32, device="cuda"), "x"), a=1.0, tiles=132)
    pk.compile()
    pk()                                          # warm up (module loaded) before capture
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            pk.launch()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    assert pk.check() == 6                        # the step advances on the device, not baked into the graph
    assert torch.all(y.data == 6.0)
