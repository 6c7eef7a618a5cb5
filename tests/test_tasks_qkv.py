"""qkv_rope_append and qkv_rope_append_fp8 on the CPU (tasks/qkv.py): built into a PersistentKernel (nw=132,
device="cpu"), compiled with NVRTC for sm_90a, emulated, and compared with the fp32 reference of
megart.geometry.attention (tolerances: tests/test_tasks_attention.py's docstring, TaskType.tol); the head
norms, the partition of the k/v heads, the fp8 rows and the folded tensor-parallel all-reduce. The chains
through attention are in tests/test_tasks_attention.py, whose builders these share."""
from __future__ import annotations

import pytest
import torch

import megart
from megart.errors import GraphError
from megart.geometry.attention import attention_m1, qkv_m1, ref_attention_decode, ref_qkv_rope_append, rope_tables
from test_tasks_attention import (NW, SHAPES, THETA, TOL_ATTN, TOL_QKV, build_attention, build_qkv, check, compiled,
                                  rel)

pytestmark = pytest.mark.usefixtures("cpu_settings")   # (one torch thread for the emulator)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("pos,norm", [(0, True), (1, False), (777, True), (4095, True)])
def test_qkv_rope_append(hd, pos, norm):
    sh, ms = SHAPES[hd], 4096
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    t, r = build_qkv(pk, sh, ms, pos, seed=hd + pos, norm=norm)
    compiled(pk)
    h = pk.emulate()
    q_ref, k_ref, v_ref = r["ref"]
    check(h["q"], q_ref, TOL_QKV, "q")
    check(h["k"][:, pos], k_ref, TOL_QKV, "k row")
    check(h["v"][:, pos], v_ref, TOL_QKV, "v row")
    keep = torch.ones(ms, dtype=torch.bool)
    keep[pos] = False
    assert torch.equal(h["k"][:, keep], r["k0"][:, keep]), "k cache changed outside row pos"
    assert torch.equal(h["v"][:, keep], r["v0"][:, keep]), "v cache changed outside row pos"


@pytest.mark.parametrize("hd,kv_refs", [(64, "partition"), (128, "strict")])
def test_qkv_head_norm(hd, kv_refs):
    """Qwen3's per-head RMSNorm of q and k before RoPE: q and k heads stay whole (one instance each), v heads
    are still spread; the result matches the fp32 reference and differs from the un-normed one."""
    sh, ms, pos = dict(SHAPES[hd], d=1024), 256, 37
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    gen = torch.Generator().manual_seed(hd)
    qn, kn = [(1 + 0.2 * torch.randn(hd, generator=gen)).to(torch.bfloat16) for _ in range(2)]
    t, r = build_qkv(pk, sh, ms, pos, seed=hd, kv_refs=kv_refs, q_norm=pk.tensor(qn, "q_norm"),
                     k_norm=pk.tensor(kn, "k_norm"))
    insts = [pk.graph.instances[u] for g in pk.graph.groups for u in g.uids]
    half = hd // 2
    assert sum(i.params["npairs"] == half for i in insts) >= sh["n_q"] + sh["n_kv"]
    compiled(pk)
    h = pk.emulate()
    q_ref, k_ref, v_ref = ref_qkv_rope_append(r["x"], r["w"], r["cos"], r["sin"], pos, sh["n_q"], sh["n_kv"], hd,
                                              r["nw"], 1e-5, q_norm=qn, k_norm=kn)
    check(h["q"], q_ref, TOL_QKV, "normed q")
    check(h["k"][:, pos], k_ref, TOL_QKV, "normed k row")
    check(h["v"][:, pos], v_ref, TOL_QKV, "v row")
    assert rel(h["q"], r["ref"][0]) > 10 * TOL_QKV      # the un-normed q is far away


def test_qkv_spreads_over_the_grid_and_keeps_pairs():
    sh = SHAPES[64]
    for kv_refs in ("strict", "partition"):
        pk = megart.PersistentKernel(nw=NW, device="cpu")
        build_qkv(pk, sh, 256, 5, kv_refs=kv_refs)
        insts = pk.graph.instances
        assert len(insts) == NW
        half = sh["hd"] // 2
        covered = {}
        for inst in insts:
            p = inst.params
            assert p["npairs"] >= 1 and p["pair0"] + p["npairs"] <= half
            # the w slice holds both halves of every pair of the instance
            assert p["w"].count == (half + p["npairs"]) * sh["d"]
            key = (p["w"].offset // sh["d"] - p["pair0"]) // sh["hd"]
            covered.setdefault(key, []).append((p["pair0"], p["npairs"]))
        for head, parts in covered.items():
            parts.sort()
            assert parts[0][0] == 0 and sum(n for _, n in parts) == half, head
        cache_insts = [i for i in insts if i.params["mode"] & 4]
        if kv_refs == "strict":
            assert len(cache_insts) == 2 * sh["n_kv"]
        else:
            assert len(cache_insts) > 2 * sh["n_kv"]
        # no instance of the call waits on another one (no false write-after-write chains)
        assert all(not inst.deps for inst in insts), kv_refs


def test_qkv_partition_mode_matches():
    sh, ms, pos = SHAPES[64], 512, 300
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    t, r = build_qkv(pk, sh, ms, pos, kv_refs="partition")
    build_attention(pk, t, sh, ms)
    compiled(pk)
    outs = [pk.emulate(seed=s) for s in range(3)]
    q_ref, k_ref, v_ref = r["ref"]
    check(outs[0]["k"][:, pos], k_ref, TOL_QKV, "k row")
    check(outs[0]["v"][:, pos], v_ref, TOL_QKV, "v row")
    kc, vc = r["k0"].clone(), r["v0"].clone()
    kc[:, pos], vc[:, pos] = outs[0]["k"][:, pos], outs[0]["v"][:, pos]
    check(outs[0]["out"], ref_attention_decode(outs[0]["q"], kc, vc, pos + 1), TOL_ATTN, "attention")
    for o in outs[1:]:   # other legal interleavings give the same bytes: every dependency is in the graph
        for name in ("q", "k", "v", "out"):
            assert torch.equal(o[name], outs[0][name]), name
    # every attention instance waits on every qkv instance writing its kv head
    qkv = [i for i in pk.graph.instances if i.type.name == "qkv_rope_append"]
    for a in (i for i in pk.graph.instances if i.type.name == "attention_decode"):
        h = (a.params["k_cache"].offset // (ms * sh["hd"]))
        writers = {i.uid for i in qkv if i.params["mode"] & 4
                   and i.params["dst"].tensor is a.params["k_cache"].tensor
                   and i.params["dst"].offset // (ms * sh["hd"]) == h}
        assert writers and writers <= a.deps


def test_qkv_pos_out_of_range_writes_nothing():
    sh, ms = SHAPES[64], 128
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    t, r = build_qkv(pk, sh, ms, ms)      # pos == max_seq
    compiled(pk)
    h = pk.emulate()
    assert torch.equal(h["k"], r["k0"]) and torch.equal(h["v"], r["v0"])
    assert not h["q"].any()


def test_qkv_small_grid_and_default_tiles():
    sh, ms, pos = SHAPES[64], 64, 9
    pk = megart.PersistentKernel(nw=8, device="cpu")
    t, r = build_qkv(pk, sh, ms, pos, tiles=1)     # tiles=1: one sub-tile per head at nw=8 (48 heads)
    assert len(pk.graph.instances) == 48
    compiled(pk)
    h = pk.emulate()
    check(h["q"], r["ref"][0], TOL_QKV, "q")
    check(h["k"][:, pos], r["ref"][1], TOL_QKV, "k row")


# --- attention_decode + attention_merge -------------------------------------------------------------------


def build_qkv_fp8(pk, sh, max_seq, pos, dev="cpu", tiles=NW):
    """qkv_rope_append_fp8 over quantize_fp8(w) (per-row scales), and the fp32 chain's q, k row, v row over the
    dequantised weights."""
    from megart.models.llama_config import dequant, quantize_fp8
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    w, x, nwt = qkv_m1(n_q, n_kv, hd, d, seed=hd)
    w8, scale = quantize_fp8(w)
    cs, sn = rope_tables(max_seq, hd, THETA)
    _, k, v = attention_m1(n_q, n_kv, hd, 0, max_seq, seed=100)
    T = lambda a, name: pk.tensor(a.clone().to(dev), name)  # noqa: E731
    t = dict(q=T(torch.zeros(n_q * hd, dtype=torch.bfloat16), "q"), k=T(k, "k"), v=T(v, "v"))
    pk.task("qkv_rope_append_fp8", q=t["q"], k_cache=t["k"], v_cache=t["v"], w_qkv=T(w8, "w"),
            scale=T(scale, "scale"), x=T(x, "x"), norm_weight=T(nwt, "norm_w"), eps=1e-5, cos=T(cs, "cos"),
            sin=T(sn, "sin"), pos=T(torch.tensor([pos], dtype=torch.int32), "pos"), n_q=n_q, n_kv=n_kv, hd=hd,
            tiles=tiles)
    return t, ref_qkv_rope_append(x, dequant(w8, scale), cs, sn, pos, n_q, n_kv, hd, nwt, 1e-5)


@pytest.mark.parametrize("hd,pos", [(64, 5), (128, 777)])
def test_qkv_fp8_matches_the_dequantised_projection(hd, pos):
    """qkv_rope_append_fp8: e4m3 rows with per-row f32 scales give the bf16 projection of the dequantised
    weights (the same fp32 chain), in the emulator and in the host-run CUDA body, which agree closely."""
    from megart.emulate import hostsim
    sh, ms = SHAPES[hd], 1024
    outs = {}
    for how in ("emulator", "host-run body"):
        pk = megart.PersistentKernel(nw=NW, device="cpu")
        t, (q_ref, k_ref, v_ref) = build_qkv_fp8(pk, sh, ms, pos)
        compiled(pk)
        h = pk.emulate() if how == "emulator" else hostsim.run(pk, seed=1)
        check(h["q"], q_ref, TOL_QKV, f"q ({how})")
        check(h["k"][:, pos], k_ref, TOL_QKV, f"k row ({how})")
        check(h["v"][:, pos], v_ref, TOL_QKV, f"v row ({how})")
        outs[how] = torch.cat([h["q"].float(), h["k"][:, pos].float().reshape(-1), h["v"][:, pos].float().reshape(-1)])
    assert rel(outs["host-run body"], outs["emulator"]) <= TOL_QKV / 4


def test_qkv_fp8_needs_a_scale_per_row():
    sh = SHAPES[64]
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    T = lambda a, name: pk.tensor(a, name)  # noqa: E731
    kw = dict(q=T(torch.zeros(n_q * hd, dtype=torch.bfloat16), "q"),
              k_cache=T(torch.zeros(n_kv, 64, hd, dtype=torch.bfloat16), "k"),
              v_cache=T(torch.zeros(n_kv, 64, hd, dtype=torch.bfloat16), "v"),
              w_qkv=T(torch.zeros((n_q + 2 * n_kv) * hd, d, dtype=torch.float8_e4m3fn), "w"),
              x=T(torch.zeros(d, dtype=torch.bfloat16), "x"), cos=T(torch.zeros(64, hd // 2), "cos"),
              sin=T(torch.zeros(64, hd // 2), "sin"), pos=T(torch.zeros(1, dtype=torch.int32), "pos"),
              n_q=n_q, n_kv=n_kv, hd=hd)
    with pytest.raises(megart.GraphError, match="scale has 3 elements, w_qkv has 3072 rows"):
        pk.task("qkv_rope_append_fp8", scale=T(torch.ones(3), "scale"), **kw)
    with pytest.raises(megart.GraphError, match="scale .* is required"):
        pk.task("qkv_rope_append_fp8", **kw)


def build_qkv_fold(pk, how, pos, dev="cpu"):
    """qkv_rope_append at hd 128 on the full grid whose x is down's all-reduce at TP=2: folded (x, the two
    ranks' f32 slots, x_out) or fed the finished sum. Returns (the tensors, the sum, the inputs)."""
    from megart.tasks.dense_common import sum_parts
    sh, ms, tp = SHAPES[128], 2048, 2
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    w, x, nwt = qkv_m1(n_q, n_kv, hd, d, seed=5)
    cs, sn = rope_tables(ms, hd, THETA)
    _, k, v = attention_m1(n_q, n_kv, hd, 0, ms, seed=6)
    parts = torch.randn(tp * d, generator=torch.Generator().manual_seed(7)) * 0.5
    total = sum_parts(x, parts, tp)
    T = lambda a, name: pk.tensor(a.clone().to(dev), name)  # noqa: E731
    t = dict(q=T(torch.zeros(n_q * hd, dtype=torch.bfloat16), "q"), k=T(k, "k"), v=T(v, "v"))
    fold = {}
    if how == "folded":
        t["x_out"] = T(torch.zeros(d, dtype=torch.bfloat16), "x_out")
        fold = dict(parts=T(parts, "parts"), tp=tp, x_out=t["x_out"])
    pk.task("qkv_rope_append", q=t["q"], k_cache=t["k"], v_cache=t["v"], w_qkv=T(w, "w"),
            x=T(x if fold else total, "x"), norm_weight=T(nwt, "norm_w"), eps=1e-5, cos=T(cs, "cos"),
            sin=T(sn, "sin"), pos=T(torch.tensor([pos], dtype=torch.int32), "pos"), n_q=n_q, n_kv=n_kv, hd=hd,
            tiles=pk.nw, **fold)
    return t, total, dict(w=w, nw=nwt, cos=cs, sin=sn, k=k, v=v, sh=sh, ms=ms)


@pytest.mark.parametrize("pos", [777, 2048], ids=["in-range", "pos-out-of-range"])
def test_qkv_folded_all_reduce(pos):
    """Down's tensor-parallel all-reduce folded into qkv_rope_append's staging: the body stages bf16(x +
    parts[0] + parts[1]) (rank order, one rounding), normalises and projects it, and the instances store the
    sum to x_out between them, also when pos is out of range (then nothing else is written). Bit for bit
    what qkv fed the finished sum gives, in the host-run CUDA body and in the emulator."""
    from megart.emulate import hostsim
    runs = {}
    for how in ("folded", "summed"):
        pk = megart.PersistentKernel(nw=NW, device="cpu")
        _, total, inp = build_qkv_fold(pk, how, pos)
        compiled(pk)
        runs[how] = {k_: v_.clone() for k_, v_ in pk.emulate().items()}, hostsim.run(pk, seed=3)
    (emu, dev), (emu_sum, dev_sum) = runs["folded"], runs["summed"]
    assert torch.equal(emu["x_out"], total) and torch.equal(dev["x_out"], total)
    for name in ("q", "k", "v"):
        assert torch.equal(dev[name], dev_sum[name]) and torch.equal(emu[name], emu_sum[name]), name
    sh = inp["sh"]
    if pos < inp["ms"]:
        want = ref_qkv_rope_append(total, inp["w"], inp["cos"], inp["sin"], pos, sh["n_q"], sh["n_kv"], sh["hd"],
                                   inp["nw"], 1e-5)[0]
        check(dev["q"], want, TOL_QKV, "q")
    else:
        assert not dev["q"].any() and torch.equal(dev["k"], inp["k"]) and torch.equal(dev["v"], inp["v"])


def test_qkv_fold_rejects():
    pk = megart.PersistentKernel(nw=8, device="cpu")
    sh, ms = SHAPES[64], 64
    t, _ = build_qkv(pk, sh, ms, 3, tiles=8)
    d = sh["d"]
    parts = pk.tensor(torch.zeros(2 * d), "parts")
    args = dict(q=t["q"], k_cache=t["k"], v_cache=t["v"], w_qkv=t["w"], x=t["x"], norm_weight=t["nw"], cos=t["cos"],
                sin=t["sin"], pos=t["pos"], n_q=sh["n_q"], n_kv=sh["n_kv"], hd=sh["hd"], tiles=8)
    before = len(pk.graph.instances)
    with pytest.raises(GraphError, match="parts and x_out come together"):
        pk.task("qkv_rope_append", **args, parts=parts, tp=2)
    with pytest.raises(GraphError, match="x_out and x overlap"):
        pk.task("qkv_rope_append", **args, parts=parts, tp=2, x_out=t["x"])
    assert sh["n_q"] * sh["hd"] == d
    with pytest.raises(GraphError, match="q and x_out overlap"):
        pk.task("qkv_rope_append", **args, parts=parts, tp=2, x_out=t["q"])
    with pytest.raises(GraphError, match="k_cache and parts"):
        pk.task("qkv_rope_append", **args, parts=t["k"].ref(0, 2 * d), tp=2,
                x_out=pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "x_out"))
    assert len(pk.graph.instances) == before
