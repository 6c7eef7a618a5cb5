"""Dense decode task types on the CPU. Each test builds a PersistentKernel(device="cpu"), compiles it
with NVRTC for sm_90a (0 spill bytes), then runs it twice: the reference emulator (each task's Python
reference, `emu`) and the host simulation of the CUDA bodies themselves (megart.emulate.hostsim,
`dev`: the dense bodies compiled with g++, one CTA as 256 fibers in random order). Both are gated
against the fp32 whole-op references of megart.geometry.dense: cosine >= 0.99 AND relative error
<= the per-task tolerance of docs/TASKS.md (tol >= 2x E, <= D/10), and against each other. Each
test also recomputes D (the cheapest feature drop) and checks the tolerance would catch it. Bad
shapes and dtypes must raise GraphError at build time. (The LM head and argmax_reduce:
tests/test_tasks_lm_head.py; the shared runs and gate: tests/dense_checks.py.)"""
from __future__ import annotations

import pytest
import torch

import megart
from megart import GraphError, tagged
from megart.geometry import dense as geo
from megart.tasks import dense as dense_tasks

from dense_checks import NW, bf16, gate, kernel, run

# ---- gemv_m1 -------------------------------------------------------------------------------------------
GEMV_SHAPES = [
    pytest.param(2048, 2048, 132, id="1b-qproj"),
    pytest.param(2048, 8192, 132, id="1b-down"),
    pytest.param(4096, 14336, 132, id="8b-down"),
    pytest.param(1001, 2056, 7, id="odd"),
    pytest.param(3, 24, 5, id="tiny"),
]


@pytest.mark.parametrize("n,k,tiles", GEMV_SHAPES)
@pytest.mark.parametrize("mode", ["plain", "residual", "inplace", "norm", "norm+residual"])
def test_gemv_m1(n, k, tiles, mode):
    if k > 8192 and mode not in ("inplace", "norm"):
        pytest.skip("8B-class shape: two modes are enough on the CPU")
    w, x = geo.dense_m1(n, k, seed=n + k)
    res = bf16(torch.randn(n, generator=torch.Generator().manual_seed(7)))
    g = geo.norm_weight(k, seed=3) if "norm" in mode else None
    pk = kernel()
    W, X = pk.tensor(w, "w"), pk.tensor(x, "x")
    G = pk.tensor(g, "g") if g is not None else None
    if mode == "inplace":                        # x += W a: the residual stream is y itself
        Y = pk.tensor(res.clone(), "y")
        R = Y
    else:
        Y = pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y")
        R = pk.tensor(res, "r") if "residual" in mode else None
    has_res = R is not None
    pk.task("gemv_m1", y=Y, w=W, x=X, residual=R, norm_weight=G, eps=1e-5, tiles=tiles)
    emu, dev = run(pk)
    ref = geo.ref_gemv(w, x, residual=res if has_res else None, norm_weight=g)
    if has_res:
        drop = geo.ref_gemv(w, x, norm_weight=g)
    elif g is not None:
        drop = geo.ref_gemv(w, x, norm_weight=torch.ones_like(g))   # forgot the norm gain
    else:
        drop = None
    if n >= 100:
        gate("gemv_m1", emu["y"], dev["y"], ref, drop)
    else:                                        # a handful of outputs: elementwise instead of norms
        for out in (emu["y"], dev["y"]):
            torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_gemv_m1_dependencies_and_absent_operands():
    """Absent residual/norm operands are null pointers (no dependency); y slices do not overlap."""
    n, k = 300, 64
    w, x = geo.dense_m1(n, k, seed=1)
    pk = kernel(8)
    W, X, Y = pk.tensor(w, "w"), pk.tensor(x, "x"), pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y")
    g = pk.task("gemv_m1", y=Y, w=W, x=X, tiles=8)
    insts = [pk.graph.instances[u] for u in g.uids]
    assert len(insts) == 8 and all(not i.deps for i in insts)
    for i in insts:
        assert i.params["residual"] is None and i.params["norm_weight"] is None and i.params["flags"] == 0
    spans = sorted((i.params["y"].offset, i.params["y"].count) for i in insts)
    assert spans[0][0] == 0 and sum(c for _, c in spans) == n
    assert all(a + c == b for (a, c), (b, _) in zip(spans, spans[1:]))
    assert all(i.params["w"].count == i.params["n"] * k for i in insts)
    # a consumer of y waits on the producer of its slice only
    Z = pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "z")
    c = pk.task("silu_mul", h=Z, g=Y, u=Y, tiles=8)
    for u in c.uids:
        assert pk.graph.instances[u].deps


def test_gemv_m1_rejects_bad_shapes_and_dtypes():
    pk = kernel(4)
    w, x = geo.dense_m1(64, 64, seed=0)
    W, X = pk.tensor(w, "w"), pk.tensor(x, "x")
    Y = pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "y")
    with pytest.raises(GraphError, match="multiple of 8"):
        pk.task("gemv_m1", y=Y, w=W.ref(0, 64 * 63), x=X.ref(0, 63), tiles=2)
    with pytest.raises(GraphError, match="needs 4096"):
        pk.task("gemv_m1", y=Y, w=W.ref(0, 4000), x=X, tiles=2)
    with pytest.raises(GraphError, match="needs bf16"):
        pk.task("gemv_m1", y=pk.tensor(torch.zeros(64, dtype=torch.float16), "yh"), w=W, x=X, tiles=2)
    with pytest.raises(GraphError, match="needs bf16"):
        pk.task("gemv_m1", y=Y, w=pk.tensor(w.float(), "wf"), x=X, tiles=2)
    with pytest.raises(GraphError, match="norm_weight has"):
        pk.task("gemv_m1", y=Y, w=W, x=X, norm_weight=X.ref(0, 32), tiles=2)
    with pytest.raises(GraphError, match="residual has"):
        pk.task("gemv_m1", y=Y, w=W, x=X, residual=Y.ref(0, 32), tiles=2)
    with pytest.raises(GraphError, match="16-byte boundary"):
        big = pk.tensor(torch.zeros(72, dtype=torch.bfloat16), "big")
        pk.task("gemv_m1", y=Y, w=W, x=big.ref(1, 64), tiles=2)
    with pytest.raises(GraphError, match="overlap"):
        yx = pk.tensor(torch.zeros(128, dtype=torch.bfloat16), "yx")
        pk.task("gemv_m1", y=yx.ref(0, 64), w=W, x=yx.ref(32, 64), tiles=2)
    with pytest.raises(GraphError, match="exactly y"):
        r2 = pk.tensor(torch.zeros(96, dtype=torch.bfloat16), "r2")
        pk.task("gemv_m1", y=r2.ref(0, 64), w=W, x=X, residual=r2.ref(8, 64), tiles=2)
    big_k = dense_tasks.MAX_K + 8
    with pytest.raises(GraphError, match="shared memory"):
        xb = pk.tensor(torch.zeros(big_k, dtype=torch.bfloat16), "xb")
        pk.task("gemv_m1", y=Y.ref(0, 1), w=pk.tensor(torch.zeros(big_k, dtype=torch.bfloat16), "wb"), x=xb)
    with pytest.raises(GraphError, match="tiles"):
        pk.task("gemv_m1", y=Y, w=W, x=X, tiles=0)


# ---- gemv_m1_fp8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,tiles,mode", [
    pytest.param(2048, 2048, 132, "residual", id="1b-qproj-res"),
    pytest.param(8192, 2048, 132, "norm", id="1b-up-norm"),
    pytest.param(4096, 14336, 132, "plain", id="8b-down"),
    pytest.param(1001, 272, 7, "norm+residual", id="odd"),
])
def test_gemv_m1_fp8(n, k, tiles, mode):
    w, x = geo.dense_m1(n, k, seed=n * 3 + k)
    w8, scale = geo.quantize_fp8_per_channel(w)
    res = bf16(torch.randn(n, generator=torch.Generator().manual_seed(5))) if "residual" in mode else None
    g = geo.norm_weight(k, seed=4) if "norm" in mode else None
    pk = kernel()
    Y = pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y")
    pk.task("gemv_m1_fp8", y=Y, w=pk.tensor(w8, "w8"), scale=pk.tensor(scale, "s"), x=pk.tensor(x, "x"),
            residual=pk.tensor(res, "r") if res is not None else None,
            norm_weight=pk.tensor(g, "g") if g is not None else None, tiles=tiles)
    emu, dev = run(pk)
    ref = geo.ref_gemv_fp8(w8, scale, x, residual=res, norm_weight=g)
    if res is not None:
        drop = geo.ref_gemv_fp8(w8, scale, x, norm_weight=g)
    elif g is not None:
        drop = geo.ref_gemv_fp8(w8, scale, x, norm_weight=torch.ones_like(g))
    else:
        drop = geo.ref_gemv_fp8(w8, torch.ones_like(scale) * scale.mean(), x)   # one scale for all channels
    gate("gemv_m1_fp8", emu["y"], dev["y"], ref, drop)
    # the quantisation itself stays small next to the bf16 weights it came from
    assert geo.relerr(ref, geo.ref_gemv(w, x, residual=res, norm_weight=g)) < 0.1


def test_gemv_m1_fp8_rejects():
    pk = kernel(4)
    w8, s = geo.quantize_fp8_per_channel(geo.dense_m1(16, 40, seed=0)[0])
    x = pk.tensor(torch.zeros(40, dtype=torch.bfloat16), "x")
    Y = pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y")
    with pytest.raises(GraphError, match="multiple of 16"):
        pk.task("gemv_m1_fp8", y=Y, w=pk.tensor(w8, "w8"), scale=pk.tensor(s, "s"), x=x)
    with pytest.raises(GraphError, match="needs fp8e4m3"):
        pk.task("gemv_m1_fp8", y=Y.ref(0, 8), w=pk.tensor(torch.zeros(8, 32, dtype=torch.bfloat16), "wb"),
                scale=pk.tensor(s[:8].clone(), "s8"), x=x.ref(0, 32))
    with pytest.raises(GraphError, match="scale"):
        pk.task("gemv_m1_fp8", y=Y.ref(0, 8), w=pk.tensor(w8[:8, :32].contiguous(), "w8b"), x=x.ref(0, 32))


# ---- gate_up_silu --------------------------------------------------------------------------------------
@pytest.mark.parametrize("f,k,tiles,norm", [
    pytest.param(8192, 2048, 132, True, id="1b-norm"),
    pytest.param(14336, 4096, 132, True, id="8b-norm"),
    pytest.param(1000, 264, 7, False, id="odd"),
])
def test_gate_up_silu(f, k, tiles, norm):
    wg, x = geo.dense_m1(f, k, seed=11)
    wu, _ = geo.dense_m1(f, k, seed=12)
    g = geo.norm_weight(k, seed=13) if norm else None
    pk = kernel()
    H = pk.tensor(torch.zeros(f, dtype=torch.bfloat16), "h")
    pk.task("gate_up_silu", h=H, w_gate=pk.tensor(wg, "wg"), w_up=pk.tensor(wu, "wu"), x=pk.tensor(x, "x"),
            norm_weight=pk.tensor(g, "g") if g is not None else None, tiles=tiles)
    emu, dev = run(pk)
    ref = geo.ref_gate_up_silu(wg, wu, x, norm_weight=g)
    drop = (geo.ref_gate_up_silu(wg, wu, x, norm_weight=torch.ones_like(g)) if norm
            else (wg.float() @ x.float()) * (wu.float() @ x.float()))        # forgot the silu
    gate("gate_up_silu", emu["h"], dev["h"], ref, drop)


@pytest.mark.parametrize("f,k,tiles,norm", [
    pytest.param(8192, 2048, 132, True, id="1b-norm"),
    pytest.param(1000, 272, 7, False, id="odd"),
])
def test_gate_up_silu_fp8(f, k, tiles, norm):
    """The fp8 form: e4m3 gate and up rows with per-row scales (gemv_m1_fp8's format), fp32 gate and up."""
    wg, x = geo.dense_m1(f, k, seed=21)
    wu, _ = geo.dense_m1(f, k, seed=22)
    (wg8, sg), (wu8, su) = geo.quantize_fp8_per_channel(wg), geo.quantize_fp8_per_channel(wu)
    g = geo.norm_weight(k, seed=23) if norm else None
    pk = kernel()
    H = pk.tensor(torch.zeros(f, dtype=torch.bfloat16), "h")
    pk.task("gate_up_silu_fp8", h=H, w_gate=pk.tensor(wg8, "wg8"), w_up=pk.tensor(wu8, "wu8"),
            s_gate=pk.tensor(sg, "sg"), s_up=pk.tensor(su, "su"), x=pk.tensor(x, "x"),
            norm_weight=pk.tensor(g, "g") if g is not None else None, tiles=tiles)
    emu, dev = run(pk)
    xs = geo.ref_rmsnorm(x, g).float() if norm else x.float()
    gate_, up = (wg8.float() @ xs) * sg, (wu8.float() @ xs) * su
    ref = torch.nn.functional.silu(gate_) * up
    drop = gate_ * up                                                          # forgot the silu
    gate("gate_up_silu_fp8", emu["h"], dev["h"], ref, drop)
    # the quantisation stays small next to the bf16 weights it came from
    assert geo.relerr(ref, geo.ref_gate_up_silu(wg, wu, x, norm_weight=g)) < 0.1
    bad = kernel(4)
    T = bad.tensor
    args = dict(h=T(torch.zeros(f, dtype=torch.bfloat16), "h"), w_gate=T(wg8, "wg8"), w_up=T(wu8, "wu8"),
                s_gate=T(sg, "sg"), s_up=T(su, "su"))
    with pytest.raises(GraphError, match="multiple of 16"):
        bad.task("gate_up_silu_fp8", **args, x=T(x[:8].clone(), "x8"))
    with pytest.raises(GraphError, match="s_up"):
        bad.task("gate_up_silu_fp8", **{**args, "s_up": T(su[:-1].clone(), "su_short")}, x=T(x, "x"))
    assert not bad.graph.instances


@pytest.mark.parametrize("f,k,tiles,tp", [
    pytest.param(8192, 2048, 132, 2, id="1b-tp2"),
    pytest.param(1000, 264, 7, 3, id="odd-tp3"),
    pytest.param(64, 16, 4, 2, id="fewer-pieces-than-instances"),
])
def test_gate_up_silu_folded_all_reduce(f, k, tiles, tp):
    """A tensor-parallel all-reduce folded into the staging: the body stages bf16(x + parts[0] + ... ) (rank
    order, one rounding), normalises it, and the instances store that sum to x_out between them. Bit for bit
    what tp_sum_f32 then gate_up_silu give (the host-run CUDA body against a kernel fed the finished sum)."""
    from megart.tasks.dense_common import sum_parts
    wg, x = geo.dense_m1(f, k, seed=31)
    wu, _ = geo.dense_m1(f, k, seed=32)
    g = geo.norm_weight(k, seed=33)
    parts = torch.randn(tp * k, generator=torch.Generator().manual_seed(34)) * 0.5
    total = sum_parts(x, parts, tp)
    outs = {}
    for how in ("folded", "summed"):
        pk = kernel()
        T = pk.tensor
        common = dict(h=T(torch.zeros(f, dtype=torch.bfloat16), "h"), w_gate=T(wg, "wg"), w_up=T(wu, "wu"),
                      norm_weight=T(g, "g"), tiles=tiles)
        if how == "folded":
            pk.task("gate_up_silu", x=T(x, "x"), parts=T(parts, "parts"), tp=tp,
                    x_out=T(torch.zeros(k, dtype=torch.bfloat16), "x_out"), **common)
        else:
            pk.task("gate_up_silu", x=T(total.clone(), "x"), **common)
        outs[how] = run(pk)
    (emu, dev), (_, dev_summed) = outs["folded"], outs["summed"]
    assert torch.equal(dev["x_out"], total) and torch.equal(emu["x_out"], total)
    assert torch.equal(dev["h"], dev_summed["h"])
    ref = geo.ref_gate_up_silu(wg, wu, total, norm_weight=g)
    drop = geo.ref_gate_up_silu(wg, wu, x, norm_weight=g)                      # forgot the partials
    gate("gate_up_silu", emu["h"], dev["h"], ref, drop)


def test_gate_up_silu_fold_rejects():
    pk = kernel(4)
    T = pk.tensor
    k = 64
    args = dict(h=T(torch.zeros(16, dtype=torch.bfloat16), "h"), w_gate=T(torch.zeros(16, k, dtype=torch.bfloat16), "wg"),
                w_up=T(torch.zeros(16, k, dtype=torch.bfloat16), "wu"), x=T(torch.zeros(k, dtype=torch.bfloat16), "x"))
    parts, x_out = T(torch.zeros(2 * k), "parts"), T(torch.zeros(k, dtype=torch.bfloat16), "x_out")
    with pytest.raises(GraphError, match="parts and x_out come together"):
        pk.task("gate_up_silu", **args, parts=parts, tp=2)
    with pytest.raises(GraphError, match="tp=3 slots"):
        pk.task("gate_up_silu", **args, parts=parts, tp=3, x_out=x_out)
    with pytest.raises(GraphError, match="x_out has 32"):
        pk.task("gate_up_silu", **args, parts=parts, tp=2, x_out=T(torch.zeros(32, dtype=torch.bfloat16), "short"))
    with pytest.raises(GraphError, match="x_out and x overlap"):
        pk.task("gate_up_silu", **args, parts=parts, tp=2, x_out=args["x"])
    h_wide = T(torch.zeros(k, dtype=torch.bfloat16), "h_wide")     # h over x_out's bytes (k = 64 rows)
    with pytest.raises(GraphError, match="h and x_out overlap"):
        pk.task("gate_up_silu", **{**args, "h": h_wide.ref(0, 16)}, parts=parts, tp=2, x_out=h_wide)
    assert not pk.graph.instances


def test_gate_up_silu_rejects():
    pk = kernel(4)
    x = pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "x")
    H = pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "h")
    wg = pk.tensor(torch.zeros(16, 64, dtype=torch.bfloat16), "wg")
    with pytest.raises(GraphError, match="w_up has"):
        pk.task("gate_up_silu", h=H, w_gate=wg, w_up=pk.tensor(torch.zeros(15, 64, dtype=torch.bfloat16), "wu"),
                x=x)
    wu = pk.tensor(torch.zeros(16, 64, dtype=torch.bfloat16), "wu16")
    for bad in (-1, 1.0, True):
        with pytest.raises(GraphError, match="rotate must be"):
            pk.task("gate_up_silu", h=H, w_gate=wg, w_up=wu, x=x, tiles=3, rotate=bad)


def test_gate_up_silu_rotates_its_larger_tiles():
    """rotate=r: the tiles one row larger are those from instance r on (cyclically), still contiguous in order."""
    from megart.tasks.tiling import even_tiles
    assert even_tiles(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_tiles(10, 4, rotate=2) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert even_tiles(10, 4, rotate=3) == [(0, 3), (3, 5), (5, 7), (7, 10)]
    pk = kernel(4)
    x = pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "x")
    wg, wu = (pk.tensor(torch.zeros(10, 64, dtype=torch.bfloat16), nm) for nm in ("wg", "wu"))
    g = pk.task("gate_up_silu", h=pk.tensor(torch.zeros(10, dtype=torch.bfloat16), "h"), w_gate=wg, w_up=wu, x=x,
                tiles=4, rotate=2)
    assert [pk.graph.instances[u].params["n"] for u in g.uids] == [2, 2, 3, 3]


def test_round_rows_deal_every_row_once_in_rounds():
    """round_rows: rounds of `width` rows per instance, then contiguous tails; every row once, sizes within one."""
    from megart.tasks.tiling import round_rows
    for n, tiles, width in ((8192, 132, 8), (1000, 7, 8), (64, 8, 8), (5, 8, 4), (100, 3, 1)):
        deal = round_rows(n, tiles, width)
        rows = sorted(r for d in deal for lo, hi in d["ranges"] for r in range(lo, hi))
        assert rows == list(range(n)), (n, tiles, width)
        assert all(d["n"] == sum(hi - lo for lo, hi in d["ranges"]) for d in deal)
        assert max(d["n"] for d in deal) - min(d["n"] for d in deal) <= 1
    d = round_rows(1000, 7, 8)      # 17 rounds of 56 rows, then 48 rows as 7 tails of 7 or 6
    assert d[2]["ranges"][:2] == [(16, 24), (72, 80)] and d[2]["ranges"][-1] == (952 + 14, 952 + 21)
    assert [d["n"] for d in round_rows(100, 3, 12)] == [34, 33, 33]     # (any width: 2 rounds of 36, then tails)
    with pytest.raises(GraphError, match="round width must be >= 1"):
        round_rows(64, 4, 0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("stream", [False, True], ids=["registers", "stream"])
def test_gate_up_silu_in_rounds(fp8, stream):
    """rounds=W: each instance's rows dealt in rounds of W (tasks/tiling.py round_rows) give the contiguous tiles'
    h bit for bit, on the register engine and the weight stream, host-run and emulated; the graph sees each
    instance write only its rows of the tagged h (a reader polls all of h after the call)."""
    f, k, tiles = 1000, 264 if not fp8 else 256, 7
    wg, x = geo.dense_m1(f, k, seed=41)
    wu, _ = geo.dense_m1(f, k, seed=42)
    g = geo.norm_weight(k, seed=43)
    outs = {}
    for rounds in (0, 8):
        pk = megart.PersistentKernel(nw=NW, device="cpu", defines={"MEGART_STREAM_SLOTS": 4} if stream else None)
        T = pk.tensor
        H = T(tagged.empty(f), "h", tagged=True)
        y = T(torch.zeros(8, dtype=torch.bfloat16), "y")
        if fp8:
            (wg8, sg), (wu8, su) = geo.quantize_fp8_per_channel(wg), geo.quantize_fp8_per_channel(wu)
            wts = dict(w_gate=T(wg8, "wg8"), w_up=T(wu8, "wu8"), s_gate=T(sg, "sg"), s_up=T(su, "su"))
        else:
            wts = dict(w_gate=T(wg, "wg"), w_up=T(wu, "wu"))
        gu = pk.task("gate_up_silu_fp8" if fp8 else "gate_up_silu", h=H, x=T(x, "x"), norm_weight=T(g, "g"),
                     tiles=tiles, **wts, **({"rounds": rounds} if rounds else {}))
        pk.task("gemv_m1", y=y, w=T(torch.zeros(8, f, dtype=torch.bfloat16), "wd"), x=H, tiles=2)
        if rounds:
            insts = [pk.graph.instances[u] for u in gu.uids]
            assert [i.params["n"] for i in insts] == [143, 143, 143, 143, 143, 143, 142]
            assert insts[1].params["row_full"] == 136 and insts[1].params["row_stride"] == 56
            assert insts[1].type.elem_ranges(insts[1].params, "h")[:2] == [(8, 16), (64, 72)]
        emu, dev = run(pk)
        outs[rounds] = (tagged.values(emu["h"]), tagged.values(dev["h"]))
    assert torch.equal(outs[0][1], outs[8][1]) and torch.equal(outs[0][0], outs[8][0])


def test_gate_up_silu_rounds_fall_back_to_tiles_where_no_round_fits():
    """rounds=W with F < W * tiles: not one whole round fits, so the call deals round_rows' contiguous tails, which
    are even_tiles' tiles: the contiguous call itself (its refs, no row map, no MEGART_DENSE_ROW_ROUNDS)."""
    pk = kernel(4)
    T = pk.tensor
    args = dict(w_gate=T(torch.zeros(20, 64, dtype=torch.bfloat16), "wg"), w_up=T(torch.zeros(20, 64, dtype=torch.bfloat16), "wu"),
                x=T(torch.zeros(64, dtype=torch.bfloat16), "x"), tiles=3)
    a = pk.task("gate_up_silu", h=T(tagged.empty(20), "h", tagged=True), rounds=8, **args)
    b = pk.task("gate_up_silu", h=T(tagged.empty(20), "h2", tagged=True), **args)
    pa, pb = ([pk.graph.instances[u].params for u in g.uids] for g in (a, b))
    assert [p["n"] for p in pa] == [7, 7, 6] and [(p["h"].offset, p["row_full"]) for p in pa] == [(0, 0), (7, 0), (14, 0)]
    assert [{k: v for k, v in p.items() if k != "h"} for p in pa] == [{k: v for k, v in p.items() if k != "h"} for p in pb]
    assert "MEGART_DENSE_ROW_ROUNDS" not in pk.kernel_config().defines


def test_gate_up_silu_rounds_rejects():
    pk = kernel(4)
    T = pk.tensor
    args = dict(h=T(torch.zeros(16, dtype=torch.bfloat16), "h"), w_gate=T(torch.zeros(16, 64, dtype=torch.bfloat16), "wg"),
                w_up=T(torch.zeros(16, 64, dtype=torch.bfloat16), "wu"), x=T(torch.zeros(64, dtype=torch.bfloat16), "x"))
    for bad in (-1, 1.0, True):
        with pytest.raises(GraphError, match="rounds must be"):
            pk.task("gate_up_silu", **args, rounds=bad)
    with pytest.raises(GraphError, match="does not take parts"):
        pk.task("gate_up_silu", **args, rounds=4, parts=T(torch.zeros(128), "parts"), tp=2,
                x_out=T(torch.zeros(64, dtype=torch.bfloat16), "x_out"))
    big = 1 << 16
    with pytest.raises(GraphError, match="at most 65,535 rows"):
        pk.task("gate_up_silu", h=T(torch.zeros(big, dtype=torch.bfloat16), "hb"),
                w_gate=T(torch.zeros(big, 8, dtype=torch.bfloat16), "wgb"),
                w_up=T(torch.zeros(big, 8, dtype=torch.bfloat16), "wub"), x=T(torch.zeros(8, dtype=torch.bfloat16), "xb"),
                rounds=4)
    assert not pk.graph.instances
    # two widths in one kernel: the device code takes one
    pk.task("gate_up_silu", **args, rounds=4, tiles=2)
    pk.task("gate_up_silu", **{**args, "h": T(torch.zeros(16, dtype=torch.bfloat16), "h2")}, rounds=2, tiles=2)
    with pytest.raises(GraphError, match="different widths"):
        pk.compile()


# ---- silu_mul / rmsnorm / embedding ----------------------------------------------------------------------
@pytest.mark.parametrize("n,tiles", [(8192, 132), (14336, 132), (1001, 7), (5, 3)])
@pytest.mark.parametrize("inplace", [False, True])
def test_silu_mul(n, tiles, inplace):
    gen = torch.Generator().manual_seed(n)
    g, u = bf16(3 * torch.randn(n, generator=gen)), bf16(torch.randn(n, generator=gen))
    pk = kernel()
    G, U = pk.tensor(g.clone(), "g"), pk.tensor(u, "u")
    H = G if inplace else pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "h")
    pk.task("silu_mul", h=H, g=G, u=U, tiles=tiles)
    emu, dev = run(pk)
    key = "g" if inplace else "h"
    ref = geo.ref_silu_mul(g, u)
    gate("silu_mul", emu[key], dev[key], ref, drop=g.float() * u.float())
    # one rounding of the fp32 result: equal to the rounded reference bar exp() ulps at rounding ties
    for out in (emu[key], dev[key]):
        assert geo.relerr(out, ref.to(torch.bfloat16)) < 1e-3


@pytest.mark.parametrize("d,tiles", [(2048, 132), (4096, 16), (2056, 7), (8, 1)])
def test_rmsnorm(d, tiles):
    x = bf16(3 * torch.randn(d, generator=torch.Generator().manual_seed(d)))
    w = geo.norm_weight(d, seed=d + 1)
    pk = kernel()
    Y = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "y")
    pk.task("rmsnorm", y=Y, x=pk.tensor(x, "x"), w=pk.tensor(w, "w"), eps=1e-5, tiles=tiles)
    emu, dev = run(pk)
    ref = geo.ref_rmsnorm(x, w, 1e-5)
    gate("rmsnorm", emu["y"], dev["y"], ref, drop=geo.ref_rmsnorm(x, torch.ones_like(w)))


def test_rmsnorm_rejects():
    pk = kernel(4)
    x = pk.tensor(torch.zeros(20, dtype=torch.bfloat16), "x")
    with pytest.raises(GraphError, match="multiple of 8"):
        pk.task("rmsnorm", y=pk.tensor(torch.zeros(20, dtype=torch.bfloat16), "y"), x=x, w=x)
    xx = pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "xx")
    with pytest.raises(GraphError, match="overlap"):
        pk.task("rmsnorm", y=xx, x=xx, w=pk.tensor(torch.ones(16, dtype=torch.bfloat16), "w"))


@pytest.mark.parametrize("vocab,d,tiles,token", [
    (5000, 2048, 132, 4321), (3000, 4096, 16, 0), (1000, 264, 7, 999), (1000, 264, 3, 5000), (1000, 264, 3, -7)])
def test_embedding(vocab, d, tiles, token):
    table = geo.dense_m1(vocab, d, seed=vocab)[0]
    pk = kernel()
    Y = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "y")
    pk.task("embedding", y=Y, table=pk.tensor(table, "table"),
            token=pk.tensor(torch.tensor([token], dtype=torch.int32), "tok"), tiles=tiles)
    emu, dev = run(pk)
    row = min(max(token, 0), vocab - 1)                      # out-of-range ids are clamped
    assert torch.equal(emu["y"], table[row]) and torch.equal(dev["y"], table[row])
    assert geo.relerr(table[(row + 1) % vocab], table[row]) > 0.1   # D: the neighbouring row


def test_embedding_rejects():
    pk = kernel(4)
    t = pk.tensor(torch.zeros(10, 16, dtype=torch.bfloat16), "t")
    y = pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y")
    with pytest.raises(GraphError, match="one element"):
        pk.task("embedding", y=y, table=t, token=pk.tensor(torch.zeros(2, dtype=torch.int32), "tok2"))
    with pytest.raises(GraphError, match="needs i32"):
        pk.task("embedding", y=y, table=t, token=pk.tensor(torch.zeros(1, dtype=torch.int64), "tok64"))
    with pytest.raises(GraphError, match="whole tensor"):
        pk.task("embedding", y=y, table=t.ref(0, 80), token=pk.tensor(torch.zeros(1, dtype=torch.int32), "tk"))


# ---- group_gemm_m1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("e,active,n,k,tiles", [
    pytest.param(8, [1, 4, 6], 2048, 2048, 132, id="8x2048x2048"),
    pytest.param(16, [0, 3, 5, 9, 10, 12, 14, 15], 1536, 2048, 132, id="16x1536x2048-8active"),
    pytest.param(3, [2, 0], 200, 136, 5, id="odd"),
])
def test_group_gemm_m1(e, active, n, k, tiles):
    w, a, rows = geo.moe_m1(e, active, n, k, seed=e + n)
    sentinel = bf16(torch.full((e * geo.EXPERT_ROWS, n), 7.0))
    pk = kernel()
    Y = pk.tensor(sentinel.clone(), "y")
    g = pk.task("group_gemm_m1", y=Y, w=pk.tensor(w, "w"), a=pk.tensor(a, "a"), active=active, tiles=tiles)
    emu, dev = run(pk)
    ref = geo.ref_group_gemm_m1(w, a, active)
    wrong = torch.stack([w[(ex + 1) % e].float() @ a[ex * geo.EXPERT_ROWS].float() for ex in active])
    gate("group_gemm_m1", emu["y"][rows], dev["y"][rows], ref, drop=wrong)
    mask = torch.ones(e * geo.EXPERT_ROWS, dtype=torch.bool)
    mask[rows] = False
    for out in (emu["y"], dev["y"]):
        assert torch.equal(out[mask], sentinel[mask]), "padding rows and inactive experts must not be written"
    # only active experts' weights are referenced
    insts = [pk.graph.instances[u] for u in g.uids]
    assert len(insts) >= min(tiles, len(active))
    touched = {i.params["w"].offset // (n * k) for i in insts}
    assert touched == set(active)


def test_group_gemm_m1_rejects():
    pk = kernel(4)
    w = pk.tensor(torch.zeros(4, 16, 32, dtype=torch.bfloat16), "w")
    a = pk.tensor(torch.zeros(4 * 128, 32, dtype=torch.bfloat16), "a")
    y = pk.tensor(torch.zeros(4 * 128, 16, dtype=torch.bfloat16), "y")
    for act, msg in (([4], "in \\[0, 4\\)"), ([1, 1], "twice"), ([], "at least one")):
        with pytest.raises(GraphError, match=msg):
            pk.task("group_gemm_m1", y=y, w=w, a=a, active=act, tiles=4)
    with pytest.raises(GraphError, match="experts, N, K"):
        pk.task("group_gemm_m1", y=y, w=pk.tensor(torch.zeros(64, 32, dtype=torch.bfloat16), "w2"), a=a, active=[0])
    with pytest.raises(GraphError, match="a has"):
        pk.task("group_gemm_m1", y=y, w=w, a=a.ref(0, 100 * 32), active=[0])


# ---- a chained decode fragment: embedding -> fused-norm gemv (in place) -> gate_up -> lm_head -> token ------
def test_chain_feeds_token_back():
    """embedding(token) -> x += W_o norm(x) -> h = gate_up(norm(x)) -> lm_head(norm(x)) -> token: two steps
    in one emulation, the second reading the token the first produced (no host in the loop)."""
    vocab, d, f = 512, 256, 512
    table, _ = geo.dense_m1(vocab, d, seed=21)
    wo, _ = geo.dense_m1(d, d, seed=22)
    wg, _ = geo.dense_m1(f, d, seed=23)
    wu, _ = geo.dense_m1(f, d, seed=24)
    g1, g2 = geo.norm_weight(d, seed=25), geo.norm_weight(d, seed=26)
    pk = kernel(16)
    T = pk.tensor(torch.tensor([17], dtype=torch.int32), "token")
    X = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "x")
    Xn = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "x2")
    H = pk.tensor(torch.zeros(f, dtype=torch.bfloat16), "h")
    PV, PI = pk.tensor(torch.zeros(16), "pv"), pk.tensor(torch.zeros(16, dtype=torch.int32), "pi")
    TAB, G1, G2 = pk.tensor(table, "table"), pk.tensor(g1, "g1"), pk.tensor(g2, "g2")
    pk.task("embedding", y=X, table=TAB, token=T, tiles=4)
    pk.task("gemv_m1", y=Xn, w=pk.tensor(wo, "wo"), x=X, residual=X, norm_weight=G1, tiles=16)
    pk.task("gate_up_silu", h=H, w_gate=pk.tensor(wg, "wg"), w_up=pk.tensor(wu, "wu"), x=Xn, norm_weight=G2,
            tiles=16)
    pk.task("lm_head_argmax", w=TAB, x=Xn, part_val=PV, part_idx=PI, norm_weight=G2, tiles=16)
    pk.task("argmax_reduce", token=T, part_val=PV, part_idx=PI)
    emu, dev = run(pk, steps=2)

    tok = 17
    for _ in range(2):
        x = table[tok]
        x2 = bf16(geo.ref_gemv(wo, x, residual=x, norm_weight=g1))
        logits = geo.ref_lm_head(table, x2, norm_weight=g2)
        tok = int(torch.argmax(logits))
    h = geo.ref_gate_up_silu(wg, wu, x2, norm_weight=g2)
    assert int(emu["token"][0]) == tok and int(dev["token"][0]) == tok
    gate("gemv_m1", emu["x2"], dev["x2"], x2.float())
    gate("gate_up_silu", emu["h"], dev["h"], h)
