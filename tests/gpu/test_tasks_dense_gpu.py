"""Dense decode task types on the GPU at the production grid (nw = SM count, 132 on the H200): the
GPU result against the fp32 whole-op reference (cosine >= 0.99, relerr <= TaskType.tol, the gate of
docs/TASKS.md) and against the CPU emulator run on the same starting tensors (relerr <= tol / 2; exact
for integer outputs). Also: several steps without reset, an nw sweep, a decode-chain fragment that feeds
the argmax back on the device, and a bandwidth report against the HBM read floor measured in the run.

    MEGART_REQUIRE_GPU=1 python -m pytest tests/gpu/test_tasks_dense_gpu.py -v -s
"""
from __future__ import annotations

import functools

import pytest
import torch

import megart
from megart.geometry import dense as geo

pytestmark = pytest.mark.gpu
TOL = {t.name: t.tol for t in megart.registry.all_types() if t.tol is not None}   # TaskType.tol


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def kernel(nw: int | None = None, **kw) -> megart.PersistentKernel:
    return megart.PersistentKernel(nw=nw or sms(), device="cuda", **kw)


def run(pk: megart.PersistentKernel, steps: int = 1):
    """Compile, emulate from the starting contents, then run on the GPU: (emulator dict, GPU dict on CPU)."""
    pk.compile()
    assert pk.report.spill_bytes == 0, pk.report
    emu = pk.emulate(steps=steps)
    assert pk(steps) >= steps
    torch.cuda.synchronize()
    gpu = {name: t.data.detach().cpu() for name, t in pk.graph.tensors.items()}
    return emu, gpu


def gate(task: str, gpu, emu, ref) -> None:
    tol = TOL[task]
    c, e = geo.cosine(gpu, ref), geo.relerr(gpu, ref)
    d = geo.relerr(gpu, emu)
    print(f"[gpu] {task}: relerr vs ref {e:.3e} (E), cosine {c:.6f}, vs emulator {d:.3e}")
    assert c >= 0.99, f"{task}: cosine {c:.5f}"
    assert e <= tol, f"{task}: relerr {e:.3e} > {tol:.0e}"
    assert d <= tol / 2, f"{task}: GPU and emulator differ by {d:.3e}"


def cu(t):
    return t.to("cuda")


# ---- gemv_m1 / gemv_m1_fp8 ------------------------------------------------------------------------------
GEMV = [
    pytest.param(2048, 2048, "inplace", id="1b-oproj-inplace"),
    pytest.param(2048, 8192, "norm+residual", id="1b-down-norm-res"),
    pytest.param(3072, 2048, "norm", id="1b-qkv-norm"),
    pytest.param(4096, 14336, "residual", id="8b-down-res"),
    pytest.param(14336, 4096, "norm", id="8b-up-norm"),
    pytest.param(1001, 2056, "norm+residual", id="odd"),
    pytest.param(13, 64, "plain", id="tiny-splitk"),
]


@pytest.mark.parametrize("n,k,mode", GEMV)
def test_gemv_m1_gpu(n, k, mode):
    w, x = geo.dense_m1(n, k, seed=n + k)
    res = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    g = geo.norm_weight(k, seed=2) if "norm" in mode else None
    pk = kernel()
    if mode == "inplace":
        Y = R = pk.tensor(cu(res), "y")
    else:
        Y = pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), "y")
        R = pk.tensor(cu(res), "r") if "residual" in mode else None
    pk.task("gemv_m1", y=Y, w=pk.tensor(cu(w), "w"), x=pk.tensor(cu(x), "x"), residual=R,
            norm_weight=pk.tensor(cu(g), "g") if g is not None else None, tiles=pk.nw)
    emu, gpu = run(pk)
    ref = geo.ref_gemv(w, x, residual=res if R is not None else None, norm_weight=g)
    if n < 100:
        torch.testing.assert_close(gpu["y"].float(), ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(gpu["y"].float(), emu["y"].float(), rtol=1e-2, atol=1e-2)
    else:
        gate("gemv_m1", gpu["y"], emu["y"], ref)


@pytest.mark.parametrize("n,k,mode", [
    pytest.param(2048, 2048, "residual", id="1b-qproj-res"),
    pytest.param(8192, 2048, "norm", id="1b-up-norm"),
    pytest.param(4096, 14336, "plain", id="8b-down"),
    pytest.param(1001, 272, "norm+residual", id="odd"),
])
def test_gemv_m1_fp8_gpu(n, k, mode):
    w, x = geo.dense_m1(n, k, seed=3 * n + k)
    w8, s = geo.quantize_fp8_per_channel(w)
    res = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) if "residual" in mode else None
    g = geo.norm_weight(k, seed=4) if "norm" in mode else None
    pk = kernel()
    pk.task("gemv_m1_fp8", y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), "y"),
            w=pk.tensor(cu(w8), "w8"), scale=pk.tensor(cu(s), "s"), x=pk.tensor(cu(x), "x"),
            residual=pk.tensor(cu(res), "r") if res is not None else None,
            norm_weight=pk.tensor(cu(g), "g") if g is not None else None, tiles=pk.nw)
    emu, gpu = run(pk)
    gate("gemv_m1_fp8", gpu["y"], emu["y"], geo.ref_gemv_fp8(w8, s, x, residual=res, norm_weight=g))


# ---- gate_up_silu / silu_mul / rmsnorm / embedding --------------------------------------------------------
@pytest.mark.parametrize("f,k,norm", [(8192, 2048, True), (14336, 4096, True), (1000, 264, False), (6, 64, True)])
def test_gate_up_silu_gpu(f, k, norm):
    wg, x = geo.dense_m1(f, k, seed=11)
    wu, _ = geo.dense_m1(f, k, seed=12)
    g = geo.norm_weight(k, seed=13) if norm else None
    pk = kernel()
    pk.task("gate_up_silu", h=pk.tensor(torch.zeros(f, dtype=torch.bfloat16, device="cuda"), "h"),
            w_gate=pk.tensor(cu(wg), "wg"), w_up=pk.tensor(cu(wu), "wu"), x=pk.tensor(cu(x), "x"),
            norm_weight=pk.tensor(cu(g), "g") if g is not None else None, tiles=pk.nw)
    emu, gpu = run(pk)
    ref = geo.ref_gate_up_silu(wg, wu, x, norm_weight=g)
    if f < 100:
        torch.testing.assert_close(gpu["h"].float(), ref, rtol=2e-2, atol=2e-2)
    else:
        gate("gate_up_silu", gpu["h"], emu["h"], ref)


@pytest.mark.parametrize("n", [8192, 14336, 1001])
def test_silu_mul_gpu(n):
    gen = torch.Generator().manual_seed(n)
    g, u = (3 * torch.randn(n, generator=gen)).to(torch.bfloat16), torch.randn(n, generator=gen).to(torch.bfloat16)
    pk = kernel()
    pk.task("silu_mul", h=pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), "h"),
            g=pk.tensor(cu(g), "g"), u=pk.tensor(cu(u), "u"), tiles=pk.nw)
    emu, gpu = run(pk)
    gate("silu_mul", gpu["h"], emu["h"], geo.ref_silu_mul(g, u))


@pytest.mark.parametrize("d", [2048, 4096, 2056])
def test_rmsnorm_gpu(d):
    x = (3 * torch.randn(d, generator=torch.Generator().manual_seed(d))).to(torch.bfloat16)
    w = geo.norm_weight(d, seed=d + 1)
    pk = kernel()
    pk.task("rmsnorm", y=pk.tensor(torch.zeros(d, dtype=torch.bfloat16, device="cuda"), "y"),
            x=pk.tensor(cu(x), "x"), w=pk.tensor(cu(w), "w"), tiles=16)
    emu, gpu = run(pk)
    gate("rmsnorm", gpu["y"], emu["y"], geo.ref_rmsnorm(x, w))


@functools.lru_cache(maxsize=1)
def _table(vocab: int, d: int) -> torch.Tensor:
    return torch.randn(vocab, d, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


@pytest.mark.parametrize("token", [0, 128255, 77777, 500000, -3])
def test_embedding_gpu(token):
    vocab, d = 128256, 2048
    table = _table(vocab, d)
    pk = kernel()
    pk.task("embedding", y=pk.tensor(torch.zeros(d, dtype=torch.bfloat16, device="cuda"), "y"),
            table=pk.tensor(cu(table), "table"),
            token=pk.tensor(torch.tensor([token], dtype=torch.int32, device="cuda"), "tok"), tiles=16)
    emu, gpu = run(pk)
    row = min(max(token, 0), vocab - 1)
    assert torch.equal(gpu["y"], table[row]) and torch.equal(emu["y"], table[row])


# ---- lm_head_argmax + argmax_reduce ------------------------------------------------------------------------
def _lm(w, x, g, tiles, nw=None, logits=True):
    pk = kernel(nw)
    v = w.shape[0]
    parts = min(tiles, v)
    PV = pk.tensor(torch.zeros(parts, device="cuda"), "pv")
    PI = pk.tensor(torch.zeros(parts, dtype=torch.int32, device="cuda"), "pi")
    pk.task("lm_head_argmax", w=pk.tensor(cu(w), "w"), x=pk.tensor(cu(x), "x"), part_val=PV, part_idx=PI,
            logits=pk.tensor(torch.zeros(v, device="cuda"), "logits") if logits else None,
            norm_weight=pk.tensor(cu(g), "g") if g is not None else None, tiles=tiles)
    pk.task("argmax_reduce", token=pk.tensor(torch.full((1,), -1, dtype=torch.int32, device="cuda"), "token"),
            part_val=PV, part_idx=PI)
    return pk


@pytest.mark.parametrize("v,d,tiles", [(128256, 2048, 264), (128256, 4096, 132), (1001, 264, 7)])
def test_lm_head_argmax_gpu(v, d, tiles):
    w, x = geo.dense_m1(v, d, seed=v + d)
    g = geo.norm_weight(d, seed=2)
    emu, gpu = run(_lm(w, x, g, tiles))
    ref = geo.ref_lm_head(w, x, norm_weight=g)
    gate("lm_head_argmax", gpu["logits"], emu["logits"], ref)
    tok = int(gpu["token"][0])
    assert tok == int(torch.argmax(gpu["logits"])), "the token is the argmax of the logits the GPU stored"
    assert torch.equal(gpu["pv"], gpu["logits"][gpu["pi"].long()])
    assert ref[tok] >= ref.max() - 1e-2 * ref.abs().max()


def test_lm_head_ties_gpu():
    v, d = 4096, 2048
    w, x = geo.dense_m1(v, d, seed=9)
    best = (x.float() / x.float().norm() * 3).to(torch.bfloat16)
    w[100], w[3000] = best, best
    emu, gpu = run(_lm(w, x, None, tiles=132, logits=False))
    assert int(gpu["token"][0]) == 100 == int(emu["token"][0])


# ---- group_gemm_m1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("e,active,n,k", [(8, [1, 4, 6, 7], 2048, 2048), (64, [3, 9, 17, 30, 41, 50, 58, 63], 1536, 2048),
                                          (3, [2, 0], 200, 136)])
def test_group_gemm_m1_gpu(e, active, n, k):
    w, a, rows = geo.moe_m1(e, active, n, k, seed=e + n)
    sentinel = torch.full((e * geo.EXPERT_ROWS, n), 7.0).to(torch.bfloat16)
    pk = kernel()
    pk.task("group_gemm_m1", y=pk.tensor(cu(sentinel), "y"), w=pk.tensor(cu(w), "w"), a=pk.tensor(cu(a), "a"),
            active=active, tiles=pk.nw)
    emu, gpu = run(pk)
    gate("group_gemm_m1", gpu["y"][rows], emu["y"][rows], geo.ref_group_gemm_m1(w, a, active))
    mask = torch.ones(e * geo.EXPERT_ROWS, dtype=torch.bool)
    mask[rows] = False
    assert torch.equal(gpu["y"][mask], sentinel[mask])


# ---- steps, grids, a decode fragment ------------------------------------------------------------------------
def test_inplace_residual_over_steps_gpu():
    """x += W a, five launches: each step adds once (no reset launch between steps)."""
    n, k = 2048, 2048
    w, a = geo.dense_m1(n, k, seed=7)
    x0 = torch.randn(n, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    pk = kernel()
    X = pk.tensor(cu(x0), "x")
    pk.task("gemv_m1", y=X, w=pk.tensor(cu(w), "w"), x=pk.tensor(cu(a), "a"), residual=X, tiles=pk.nw)
    emu, gpu = run(pk, steps=5)
    ref = x0.float() + 5 * (w.float() @ a.float())
    gate("gemv_m1", gpu["x"], emu["x"], ref)


@pytest.mark.parametrize("nw", [8, 64, 68, 128, 132])
def test_gemv_grid_sweep_gpu(nw):
    n, k = 2048, 2048
    w, x = geo.dense_m1(n, k, seed=nw)
    g = geo.norm_weight(k, seed=1)
    pk = kernel(nw)
    pk.task("gemv_m1", y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), "y"),
            w=pk.tensor(cu(w), "w"), x=pk.tensor(cu(x), "x"), norm_weight=pk.tensor(cu(g), "g"), tiles=nw)
    emu, gpu = run(pk, steps=3)
    gate("gemv_m1", gpu["y"], emu["y"], geo.ref_gemv(w, x, norm_weight=g))


def test_decode_fragment_feeds_token_back_gpu():
    """embedding(token) -> x2 = x + W norm(x) -> h = gate_up(norm(x2)) -> lm_head(norm(x2)) -> token, 3 steps:
    each step reads the token the previous one wrote on the device. GPU and emulator agree on every output."""
    vocab, d, f = 32000, 2048, 8192
    table, _ = geo.dense_m1(vocab, d, seed=21)
    wo, _ = geo.dense_m1(d, d, seed=22)
    wg, _ = geo.dense_m1(f, d, seed=23)
    wu, _ = geo.dense_m1(f, d, seed=24)
    g1, g2 = geo.norm_weight(d, seed=25), geo.norm_weight(d, seed=26)
    pk = kernel()
    nw = pk.nw
    T = pk.tensor(torch.tensor([17], dtype=torch.int32, device="cuda"), "token")
    X = pk.tensor(torch.zeros(d, dtype=torch.bfloat16, device="cuda"), "x")
    X2 = pk.tensor(torch.zeros(d, dtype=torch.bfloat16, device="cuda"), "x2")
    H = pk.tensor(torch.zeros(f, dtype=torch.bfloat16, device="cuda"), "h")
    PV = pk.tensor(torch.zeros(nw, device="cuda"), "pv")
    PI = pk.tensor(torch.zeros(nw, dtype=torch.int32, device="cuda"), "pi")
    TAB, G1, G2 = pk.tensor(cu(table), "table"), pk.tensor(cu(g1), "g1"), pk.tensor(cu(g2), "g2")
    pk.task("embedding", y=X, table=TAB, token=T, tiles=8)
    pk.task("gemv_m1", y=X2, w=pk.tensor(cu(wo), "wo"), x=X, residual=X, norm_weight=G1, tiles=nw)
    pk.task("gate_up_silu", h=H, w_gate=pk.tensor(cu(wg), "wg"), w_up=pk.tensor(cu(wu), "wu"), x=X2,
            norm_weight=G2, tiles=nw)
    pk.task("lm_head_argmax", w=TAB, x=X2, part_val=PV, part_idx=PI, norm_weight=G2, tiles=nw)
    pk.task("argmax_reduce", token=T, part_val=PV, part_idx=PI)
    emu, gpu = run(pk, steps=3)
    assert int(gpu["token"][0]) == int(emu["token"][0])
    assert geo.relerr(gpu["x2"], emu["x2"]) < 5e-3 and geo.relerr(gpu["h"], emu["h"]) < 5e-3


# ---- bandwidth report ---------------------------------------------------------------------------------------
BW_CASES = [
    ("gemv_m1", "1b-down 2048x8192", 2048, 8192),
    ("gemv_m1", "8b-down 4096x14336", 4096, 14336),
    ("gate_up_silu", "1b 2x8192x2048", 8192, 2048),
    ("gate_up_silu", "8b 2x14336x4096", 14336, 4096),
    ("gemv_m1_fp8", "8b-down fp8 4096x14336", 4096, 14336),
    ("lm_head_argmax", "1b lm-head 128256x2048", 128256, 2048),
]


def test_dense_bandwidth_report():
    """Achieved HBM bandwidth inside the megakernel (profiled wall span of the task, median of 20 steps)
    against the read floor measured now. Weights are larger than L2 or rotated, so the reads are cold.
    Prints a table; fails only below 50% of the floor (a pathological slowdown, not a tuning target)."""
    from megart.bandwidth import read_bandwidth
    floor = read_bandwidth()
    rows = []
    for task, label, n, k in BW_CASES:
        copies = max(1, -(-(120 << 20) // (n * k * 2)))       # rotate through >= 120 MB: no L2 reuse
        pk = kernel(profile=True, profile_steps=20)
        nw = pk.nw
        x = pk.tensor(torch.randn(k, device="cuda").to(torch.bfloat16), "x")
        g = pk.tensor(torch.ones(k, dtype=torch.bfloat16, device="cuda"), "g")
        bytes_ = 0
        for c in range(copies):
            if task == "gemv_m1":
                w = pk.tensor((torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16), f"w{c}")
                pk.task(task, y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), f"y{c}"),
                        w=w, x=x, tiles=nw)
                bytes_ += n * k * 2
            elif task == "gemv_m1_fp8":
                w8, s = geo.quantize_fp8_per_channel(torch.randn(n, k, device="cuda") / k ** 0.5)
                pk.task(task, y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), f"y{c}"),
                        w=pk.tensor(w8, f"w{c}"), scale=pk.tensor(s, f"s{c}"), x=x, tiles=nw)
                bytes_ += n * k + 4 * n
            elif task == "gate_up_silu":
                wg = pk.tensor((torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16), f"wg{c}")
                wu = pk.tensor((torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16), f"wu{c}")
                pk.task(task, h=pk.tensor(torch.zeros(n, dtype=torch.bfloat16, device="cuda"), f"h{c}"),
                        w_gate=wg, w_up=wu, x=x, norm_weight=g, tiles=nw)
                bytes_ += 2 * n * k * 2
            else:
                w = pk.tensor((torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16), f"w{c}")
                pv = pk.tensor(torch.zeros(2 * nw, device="cuda"), f"pv{c}")
                pi = pk.tensor(torch.zeros(2 * nw, dtype=torch.int32, device="cuda"), f"pi{c}")
                pk.task(task, w=w, x=x, part_val=pv, part_idx=pi, norm_weight=g, tiles=2 * nw)
                bytes_ += n * k * 2
        pk.compile()
        pk(3)
        pk.reset_profile(20)
        pk(20)
        st = pk.profile().by_task(task)
        per_call = bytes_ / copies
        achieved = per_call / (st.wall.median / copies * 1e-9)
        rows.append((label, copies, per_call / 1e6, st.wall.median / copies / 1e3, achieved / 1e12,
                     achieved / floor, pk.report.registers))
        del pk
        torch.cuda.empty_cache()
    print(f"\nHBM read floor measured now: {floor / 1e12:.2f} TB/s")
    print(f"{'case':28s} {'calls':>5s} {'MB/call':>8s} {'us/call':>8s} {'TB/s':>6s} {'x floor':>8s} {'regs':>5s}")
    for r in rows:
        print(f"{r[0]:28s} {r[1]:5d} {r[2]:8.1f} {r[3]:8.1f} {r[4]:6.2f} {r[5]:8.2f} {r[6]:5d}")
    for r in rows:
        assert r[5] >= 0.5, f"{r[0]}: {r[5]:.2f} of the HBM floor"
