"""Attention task types on the CPU (tasks/attention.py): attention_decode and attention_merge, and the chains
from qkv_rope_append through them, are built into a PersistentKernel (nw=132, device="cpu"), compiled with
NVRTC for sm_90a (0 spill bytes), emulated, and compared with the whole-op fp32 references of
megart.geometry.attention. qkv_rope_append alone: tests/test_tasks_qkv.py (with this module's builders).

Tolerances (measured, docs/TASKS.md "Attention tasks"): relative error ||got - ref|| / ||ref|| under
TOL_QKV / TOL_ATTN and cosine >= 0.99.
  qkv_rope_append: E = 3.5e-3 (bf16-projection HF-style implementation vs fp32), D = 0.195 (RoPE at pos - 1,
                   = RoPE skipped at pos 1); tol 1e-2 = 2.9x E, D / 19.5.
  attention:       E = 2.3e-3 (torch SDPA in bf16 vs fp32), D = 0.18 (last of 16 chunks dropped; the current
                   token dropped at kv_len <= 17); tol 1e-2 = 4.3x E, D / 18.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megart
from megart.errors import GraphError
from megart.geometry.attention import (attention_m1, attention_scratch, qkv_m1, ref_attention_decode,
                                       ref_qkv_rope_append, rope_tables)
from megart.geometry.attention import active_chunks, attention_chunks, chunk_length, chunk_range
from megart.tasks.attention import body_defines
from megart.tasks.attention_common import ATTN_SUBGROUP

TOL_QKV = megart.registry.get("qkv_rope_append").tol            # TaskType.tol, measured as above
TOL_ATTN = megart.registry.get("attention_decode").tol
COS_MIN = 0.99
NW = 132
THETA = 500000.0
ROOT = Path(__file__).resolve().parents[1]

SHAPES = {64: dict(n_q=32, n_kv=8, hd=64, d=2048), 128: dict(n_q=32, n_kv=8, hd=128, d=4096)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The emulator runs hundreds of tiny per-instance torch ops; intra-op threads only add sync overhead
    (50x on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel(got, ref) -> float:
    got, ref = got.float().reshape(-1), ref.float().reshape(-1)
    return ((got - ref).norm() / ref.norm()).item()


def cos(got, ref) -> float:
    return torch.nn.functional.cosine_similarity(got.float().reshape(1, -1), ref.float().reshape(1, -1)).item()


def check(got, ref, tol, what):
    r, c = rel(got, ref), cos(got, ref)
    assert c >= COS_MIN and r < tol, f"{what}: cosine {c:.5f}, relative error {r:.3e} (tol {tol:.0e})"


def compiled(pk):
    pk.compile()
    rep = pk.report
    assert rep.spill_bytes == 0, f"register spills: {rep}"
    return pk


# --- builders --------------------------------------------------------------------------------------------

def build_qkv(pk, sh, max_seq, pos, seed=0, norm=True, kv_refs="strict", tiles=NW, cache_seed=100, dev="cpu",
              **head_norm):
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    w, x, nwt = qkv_m1(n_q, n_kv, hd, d, seed=seed)
    cs, sn = rope_tables(max_seq, hd, THETA)
    _, k, v = attention_m1(n_q, n_kv, hd, 0, max_seq, seed=cache_seed)
    T = lambda a, name: pk.tensor(a.clone().to(dev), name)
    t = dict(q=T(torch.zeros(n_q * hd, dtype=torch.bfloat16), "q"), k=T(k, "k"), v=T(v, "v"), w=T(w, "w"),
             x=T(x, "x"), nw=T(nwt, "norm_w"), cos=T(cs, "cos"), sin=T(sn, "sin"),
             pos=T(torch.tensor([pos], dtype=torch.int32), "pos"))
    pk.task("qkv_rope_append", q=t["q"], k_cache=t["k"], v_cache=t["v"], w_qkv=t["w"], x=t["x"],
            norm_weight=t["nw"] if norm else None, eps=1e-5, cos=t["cos"], sin=t["sin"], pos=t["pos"],
            n_q=n_q, n_kv=n_kv, hd=hd, tiles=tiles, kv_refs=kv_refs, **head_norm)
    ref = ref_qkv_rope_append(x, w, cs, sn, pos, n_q, n_kv, hd, nwt if norm else None, 1e-5) if pos < max_seq else None
    return t, dict(k0=k, v0=v, ref=ref, w=w, x=x, nw=nwt if norm else None, cos=cs, sin=sn)


def build_attention(pk, t, sh, max_seq, chunk=0, tiles=1, dev="cpu", merge="call", min_chunk=0, width=None,
                    direct_upto=0):
    """attention_decode then its merge: attention_merge (merge="call") or the fused form (merge="fused":
    out and arrivals given to attention_decode, the last chunk of each kv head merges; with direct_upto, the
    switch to the direct form at kv_len <= direct_upto), or none (merge="direct": out alone, one chunk per kv
    head, instances of `width` q heads write it; no partials)."""
    n_q, n_kv, hd = sh["n_q"], sh["n_kv"], sh["hd"]
    if merge == "direct":
        t["out"] = pk.tensor(torch.zeros(n_q * hd, dtype=torch.bfloat16, device=dev), "out")
        pk.task("attention_decode", q=t["q"], k_cache=t["k"], v_cache=t["v"], pos=t["pos"], out=t["out"],
                n_q=n_q, n_kv=n_kv, hd=hd, width=width)
        return 1
    C = attention_chunks(n_kv, max_seq, pk.nw, chunk=chunk, tiles=tiles)
    po, pm = attention_scratch(n_q, n_kv, hd, C, device=dev)
    t["po"], t["pm"] = pk.tensor(po, "part_o"), pk.tensor(pm, "part_ml")
    t["out"] = pk.tensor(torch.zeros(n_q * hd, dtype=torch.bfloat16, device=dev), "out")
    fused = {}
    if merge == "fused":
        t["arrivals"] = pk.tensor(torch.zeros(n_kv, dtype=torch.int32, device=dev), "arrivals")
        fused = dict(out=t["out"], arrivals=t["arrivals"], direct_upto=direct_upto)
    pk.task("attention_decode", q=t["q"], k_cache=t["k"], v_cache=t["v"], pos=t["pos"], part_o=t["po"],
            part_ml=t["pm"], n_q=n_q, n_kv=n_kv, hd=hd, chunk=chunk, tiles=tiles, min_chunk=min_chunk, **fused)
    if merge == "call":
        pk.task("attention_merge", out=t["out"], part_o=t["po"], part_ml=t["pm"], n_q=n_q, n_kv=n_kv, hd=hd,
                chunks=C, tiles=n_q)
    return C


def attention_only(sh, max_seq, kv_len, chunk=0, tiles=1, seed=0, dev="cpu", nw=NW, **pk_kw):
    n_q, n_kv, hd = sh["n_q"], sh["n_kv"], sh["hd"]
    q, k, v = attention_m1(n_q, n_kv, hd, kv_len, max_seq, seed=seed)
    pk = megart.PersistentKernel(nw=nw, device=dev, **pk_kw)
    T = lambda a, name: pk.tensor(a.clone().to(dev), name)
    t = dict(q=T(q, "q"), k=T(k, "k"), v=T(v, "v"), pos=T(torch.tensor([kv_len - 1], dtype=torch.int32), "pos"))
    C = build_attention(pk, t, sh, max_seq, chunk=chunk, tiles=tiles, dev=dev)
    return pk, t, (q, k, v), C


# --- qkv_rope_append ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("kv_len,chunk", [(1, 0), (2, 0), (17, 0), (333, 0), (2048, 0), (1, 256), (333, 256),
                                          (2047, 256), (2048, 256)])
def test_attention(hd, kv_len, chunk):
    sh, ms = SHAPES[hd], 2048
    pk, t, (q, k, v), C = attention_only(sh, ms, kv_len, chunk=chunk, seed=kv_len + hd)
    compiled(pk)
    h = pk.emulate()
    check(h["out"], ref_attention_decode(q, k, v, kv_len), TOL_ATTN, "attention out")
    # every partial slot was written (scratch starts as NaN); empty chunks carry m = -inf, l = 0
    assert not torch.isnan(h["part_o"]).any() and not torch.isnan(h["part_ml"]).any()
    ml = h["part_ml"].view(sh["n_kv"], C, -1, 2)
    for c in range(C):
        lo, hi = chunk_range(chunk, c, C, kv_len)
        if hi <= lo:
            assert torch.all(ml[:, c, :, 0] == float("-inf")) and torch.all(ml[:, c, :, 1] == 0)
        else:
            assert torch.all(ml[:, c, :, 1] >= 1.0)


@pytest.mark.parametrize("n_q,n_kv,hd", [(24, 8, 128), (28, 4, 128), (14, 2, 64), (40, 8, 64), (12, 2, 128),
                                         (36, 3, 64), (16, 1, 128)])
def test_attention_any_group(n_q, n_kv, hd):
    """GQA groups 3, 7, 7, 5, 6 (one instance per kv head and chunk, its own width) and 12, 16 (two
    instances per kv head and chunk: 6 + 6, 8 + 8 q heads) against the fp32 reference."""
    from megart.tasks.attention import head_subgroups
    sh, ms, kv_len = dict(n_q=n_q, n_kv=n_kv, hd=hd), 1024, 333
    pk, t, (q, k, v), C = attention_only(sh, ms, kv_len, seed=n_q + hd)
    group = n_q // n_kv
    insts = [pk.graph.instances[u] for g in pk.graph.groups if g.label == "attention_decode" for u in g.uids]
    assert len(insts) == n_kv * C * len(head_subgroups(group))
    assert max(i.params["group"] for i in insts) <= 8
    compiled(pk)
    h = pk.emulate()
    check(h["out"], ref_attention_decode(q, k, v, kv_len), TOL_ATTN, f"attention group {group}")
    assert not torch.isnan(h["part_o"]).any() and not torch.isnan(h["part_ml"]).any()


def test_head_subgroups():
    from megart.tasks.attention import head_subgroups
    assert head_subgroups(3) == [(0, 3)] and head_subgroups(8) == [(0, 8)]
    assert head_subgroups(9) == [(0, 5), (5, 4)] and head_subgroups(16) == [(0, 8), (8, 8)]


def test_attention_32k_context():
    """32768-token cache, dynamic chunks over the grid; kv_len 32768 (full) and an odd short length."""
    sh, ms = SHAPES[64], 32768
    for kv_len in (32768, 1001):
        pk, t, (q, k, v), C = attention_only(sh, ms, kv_len, seed=7)
        assert C == NW // sh["n_kv"]
        compiled(pk)
        h = pk.emulate()
        check(h["out"], ref_attention_decode(q, k, v, kv_len), TOL_ATTN, f"attention kv_len {kv_len}")


def test_attention_32k_static_small_chunks():
    """Static 2048-position chunks over a 32k cache: 16 chunks per head, only the first has work."""
    sh, ms, kv_len = SHAPES[128], 32768, 1500
    pk, t, (q, k, v), C = attention_only(sh, ms, kv_len, chunk=2048, seed=3)
    assert C == 16
    compiled(pk)
    h = pk.emulate()
    check(h["out"], ref_attention_decode(q, k, v, kv_len), TOL_ATTN, "attention static 32k")



@pytest.mark.parametrize("nw,threads,defines,ring", [(NW, 256, None, 64 << 10), (NW, 128, None, 64 << 10),
                                                     (2 * NW, 256, None, 0), (NW, 512, None, 0),
                                                     (NW, 256, {"MEGART_ATTN_RING_BYTES": 0}, 0)])
def test_attention_ring_config(nw, threads, defines, ring):
    """The K/V ring (group < 8, one CTA per SM, < 512 threads) sizes the dynamic shared memory; two CTAs per
    SM, 512 threads or MEGART_ATTN_RING_BYTES=0 keep the register path and the merge stage's 33,280 bytes."""
    from megart.tasks.attention import SMEM_ATTN, SMEM_ATTN_MERGE
    from megart.tasks.attention_ring import attn_ring_bytes
    pk, *_ = attention_only(SHAPES[128], 2048, 2048, nw=nw, threads=threads, defines=defines)
    assert attn_ring_bytes(pk.kernel_config()) == ring
    assert pk.smem_bytes() == max(ring, SMEM_ATTN_MERGE) <= SMEM_ATTN
    compiled(pk)
    assert f"#define MEGART_ATTN_RING_BYTES {ring}\n" in pk.source.text
    from megart.tasks.attention_ring import ring_geometry
    per_stage, stages = ring_geometry(ring, threads)
    assert f"#define MEGART_ATTN_RING_U {per_stage}\n" in pk.source.text
    assert f"#define MEGART_ATTN_RING_STAGES {stages}\n" in pk.source.text


def test_attention_detects_feature_drops():
    """The gate discriminates: dropping the last chunk or the current token is far outside TOL_ATTN."""
    sh, ms, kv_len = SHAPES[64], 2048, 17
    q, k, v = attention_m1(sh["n_q"], sh["n_kv"], sh["hd"], kv_len, ms, seed=1)
    ref = ref_attention_decode(q, k, v, kv_len)
    assert rel(ref_attention_decode(q, k, v, kv_len - 1), ref) > 10 * TOL_ATTN
    ref2 = ref_attention_decode(q, k, v, 2048)
    assert rel(ref_attention_decode(q, k, v, 2048 - 128), ref2) > 10 * TOL_ATTN


# --- the fused chain in one kernel ------------------------------------------------------------------------

@pytest.mark.parametrize("hd,pos", [(64, 0), (64, 2046), (128, 1234)])
def test_decode_chain(hd, pos):
    """qkv_rope_append -> attention_decode -> attention_merge in one kernel: the new row is attended."""
    sh, ms = SHAPES[hd], 2048
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    t, r = build_qkv(pk, sh, ms, pos, seed=pos)
    build_attention(pk, t, sh, ms)
    compiled(pk)
    a, b = pk.emulate(seed=0), pk.emulate(seed=1)
    assert torch.equal(a["out"], b["out"])
    q_ref, k_ref, v_ref = r["ref"]
    check(a["q"], q_ref, TOL_QKV, "q")
    kc, vc = r["k0"].float(), r["v0"].float()
    kc[:, pos], vc[:, pos] = k_ref, v_ref
    check(a["out"], ref_attention_decode(q_ref, kc, vc, pos + 1), TOL_ATTN, "attention out vs fp32 chain")
    # attention waits on the projection (one whole-call wait), the merge on attention
    groups = {g.label: g for g in pk.graph.groups}
    att = pk.graph.instances[groups["attention_decode"].uids[0]]
    assert set(groups["qkv_rope_append"].uids) & att.deps


# --- the CUDA bodies themselves, on the host (megart.emulate.hostsim: TaskType.hostsim) ---------------------

def _chain_on_the_host(hd, pos, overrides=None, merge="call", defines=None, min_chunk=0, width=None, direct_upto=0,
                       **pk_kw):
    sh, ms = SHAPES[hd], 2048
    # (only the attention body this shape runs is compiled, as the models do: the host compile is the slow part)
    group = sh["n_q"] // sh["n_kv"]
    defines = {**body_defines(hd, group, width or ATTN_SUBGROUP), **(defines or {})}
    pk = megart.PersistentKernel(nw=NW, device="cpu", source_overrides=overrides or {}, defines=defines, **pk_kw)
    t, r = build_qkv(pk, sh, ms, pos, seed=pos)
    build_attention(pk, t, sh, ms, merge=merge, min_chunk=min_chunk, width=width, direct_upto=direct_upto)
    compiled(pk)
    emu = {k: v.clone() for k, v in pk.emulate().items()}
    q_ref, k_ref, v_ref = r["ref"]
    kc, vc = r["k0"].float(), r["v0"].float()
    kc[:, pos], vc[:, pos] = k_ref, v_ref
    return pk, emu, q_ref, ref_attention_decode(q_ref, kc, vc, pos + 1)


@pytest.mark.parametrize("hd,pos,defines", [(64, 2046, {}), (64, 2046, {"MEGART_ATTN_RING_BYTES": 32 << 10}),
                                             (128, 1234, {"MEGART_ATTN_RING_BYTES": 0})],
                         ids=["hd64-ring", "hd64-32KB-ring", "hd128-registers"])
def test_attention_bodies_run_on_the_host(hd, pos, defines):
    """qkv_rope_append, attention_decode (the cp.async ring and the register path) and attention_merge run as
    CUDA compiled by g++ (one CTA as fibers, random order): against the fp32 chain and the emulator."""
    from megart.emulate import hostsim
    assert {"qkv_rope_append", "attention_decode", "attention_merge"} <= {t.name for t in hostsim.simulated_types()}
    pk, emu, q_ref, out_ref = _chain_on_the_host(hd, pos, defines=defines)
    dev = hostsim.run(pk, seed=3)
    assert hostsim.run.prefetched, "no instance ran through the host-compiled bodies"
    check(dev["q"], q_ref, TOL_QKV, "q (host-run body)")
    check(dev["out"], out_ref, TOL_ATTN, "attention out (host-run bodies)")
    assert rel(dev["out"], emu["out"]) <= TOL_ATTN / 2 and rel(dev["part_o"], emu["part_o"]) <= TOL_ATTN / 2


def _merge_shape(hd):
    """The Llama model's macros for the fused merge of this shape compiled in (megart/models/llama.py)."""
    sh = SHAPES[hd]
    return {"MEGART_MERGE_G": sh["n_q"] // sh["n_kv"], "MEGART_MERGE_HD": hd, "MEGART_MERGE_C": NW // sh["n_kv"]}


@pytest.mark.parametrize("hd,fixed", [(64, False), (128, False), (64, True), (128, True)],
                         ids=["hd64", "hd128", "hd64-shape-compiled-in", "hd128-shape-compiled-in"])
def test_fused_merge_gives_the_merge_calls_bits(hd, fixed):
    """attention_decode with out and arrivals (the last chunk of each kv head to arrive merges) writes the same
    bits as attention_decode + attention_merge, in the host-run CUDA bodies and in the emulator, and leaves
    every arrival counter at 0 for the next step. (The merge runs after either K/V path of the body, so the
    ring path's shape stands for both; the register path's partials are checked above.) hd 128, group 4 gives
    each thread two outputs. With MEGART_MERGE_G / _HD / _C (the Llama model's) the merge of that shape is
    compiled with its strides as constants: the same bits."""
    pos = 2046
    from megart.emulate import hostsim
    runs = {}
    for merge in ("call", "fused"):
        defines = _merge_shape(hd) if fixed and merge == "fused" else {}
        pk, emu, q_ref, out_ref = _chain_on_the_host(hd, pos, merge=merge, defines=defines)
        runs[merge] = hostsim.run(pk, seed=3), emu
        check(runs[merge][0]["out"], out_ref, TOL_ATTN, f"{merge}: attention out (host-run bodies)")
        check(emu["out"], out_ref, TOL_ATTN, f"{merge}: attention out (emulator)")
    (dev_call, _), (dev_fused, emu_fused) = runs["call"], runs["fused"]
    assert torch.equal(dev_fused["out"], dev_call["out"]) and torch.equal(dev_fused["part_o"], dev_call["part_o"])
    assert not dev_fused["arrivals"].any() and not emu_fused["arrivals"].any()
    assert len({g.label for g in pk.graph.groups}) == 2      # qkv and attention: no merge call


@pytest.mark.parametrize("fixed", [False, True], ids=["general", "shape-compiled-in"])
def test_min_chunk_keeps_the_merge_calls_bits_with_fewer_partials(fixed):
    """min_chunk=64 at kv_len 101: two chunks of the 16 hold positions, the rest are empty. With
    MEGART_MERGE_ACTIVE=1 the fused merge reads only those two; the host-run bodies still give the bits of
    attention_merge over all 16 (an empty chunk adds exactly nothing), and both match the fp32 chain; so does
    the merge with the shape compiled in (the Llama model's)."""
    from megart.emulate import hostsim
    pos, hd = 100, 64
    assert active_chunks(16, pos + 1, 64) == 2 and chunk_range(0, 1, 16, pos + 1, 64) == (64, 101)
    runs = {}
    fused = {"MEGART_MERGE_ACTIVE": 1, **(_merge_shape(hd) if fixed else {})}
    for merge, defines in (("call", {}), ("fused", fused)):
        pk, emu, q_ref, out_ref = _chain_on_the_host(hd, pos, merge=merge, defines=defines, min_chunk=64)
        runs[merge] = hostsim.run(pk, seed=3)
        check(runs[merge]["out"], out_ref, TOL_ATTN, f"{merge}: attention out (host-run bodies)")
        check(emu["out"], out_ref, TOL_ATTN, f"{merge}: attention out (emulator)")
        ml = runs[merge]["part_ml"].view(SHAPES[hd]["n_kv"], -1, 4, 2)
        assert torch.all(ml[:, 2:, :, 0] == float("-inf")) and torch.all(ml[:, :2, :, 1] >= 1.0)
    assert torch.equal(runs["fused"]["out"], runs["call"]["out"])
    assert not runs["fused"]["arrivals"].any()


def test_chunk_lengths():
    """Dynamic chunks: ceil(kv_len / nchunks) positions, at least min_chunk; the chunks past the context are
    empty and active_chunks counts the others (at least 1, the merge's count)."""
    assert chunk_length(16, 2049) == 129 and chunk_length(16, 2049, 64) == 129 and chunk_length(16, 129, 64) == 64
    assert [chunk_range(0, c, 16, 129, 64) for c in range(4)] == [(0, 64), (64, 128), (128, 129), (192, 192)]
    assert active_chunks(16, 129, 64) == 3 and active_chunks(16, 2049, 64) == 16 and active_chunks(16, 0, 64) == 1
    assert active_chunks(16, 1) == 1 and active_chunks(16, 17) == 9     # (cl 2: chunks 9..15 empty)
    for L in range(0, 300, 7):
        for m in (0, 1, 64):
            spans = [chunk_range(0, c, 16, L, m) for c in range(16)]
            assert sum(hi - lo for lo, hi in spans) == L and all(lo <= hi for lo, hi in spans)
            assert sum(hi > lo for lo, hi in spans) == (active_chunks(16, L, m) if L else 0)


def test_fused_merge_orders_readers_after_every_chunk():
    """The chunks of one kv head claim disjoint pieces of its outputs and share its arrival counter, which is
    no dependency: they run unordered among themselves, and a reader of the head's outputs waits for all of
    them (whichever arrives last writes every output)."""
    sh, ms = SHAPES[64], 2048
    pk, t, _, C = attention_only(sh, ms, 1000, nw=NW)
    pk2 = megart.PersistentKernel(nw=NW, device="cpu")
    T = lambda name: pk2.tensor(t[name].data.clone(), name)
    t2 = {k: T(k) for k in ("q", "k", "v", "pos")}
    build_attention(pk2, t2, sh, ms, merge="fused")
    n = sh["n_q"] // sh["n_kv"] * sh["hd"]
    head0 = t2["out"].ref(0, n)                           # kv head 0's outputs, read by one instance
    pk2.task("silu_mul", h=pk2.tensor(torch.zeros(n, dtype=torch.bfloat16), "y"), g=head0, u=head0, tiles=1)
    att = [i for i in pk2.graph.instances if i.type.name == "attention_decode"]
    assert len(att) == sh["n_kv"] * C and not any(i.deps & {a.uid for a in att} for i in att)
    reader = next(i for i in pk2.graph.instances if i.type.name == "silu_mul")
    assert reader.deps == {a.uid for a in att if a.params["arrivals"].offset == 0}
    assert pk2.graph.sync_tensors() == [t2["arrivals"]]


def _fused_inputs():
    """An attention graph of the hd-64 shape and the arguments of a second attention_decode over its tensors:
    (pk, its tensors, the partials' arguments, an out of n_q * hd, arrivals of n_kv counters)."""
    sh, ms = SHAPES[64], 2048
    pk, t, _, C = attention_only(sh, ms, 100, nw=NW)
    n_q, n_kv, hd = sh["n_q"], sh["n_kv"], sh["hd"]
    out = pk.tensor(torch.zeros(n_q * hd, dtype=torch.bfloat16), "out2")
    arr = pk.tensor(torch.zeros(n_kv, dtype=torch.int32), "arr")
    base = dict(q=t["q"], k_cache=t["k"], v_cache=t["v"], pos=t["pos"], part_o=t["po"], part_ml=t["pm"],
                n_q=n_q, n_kv=n_kv, hd=hd)
    return pk, t, base, out, arr


def test_fused_merge_refusals():
    pk, t, base, out, arr = _fused_inputs()
    n_kv, hd = base["n_kv"], base["hd"]
    _raises(lambda: pk.task("attention_decode", **base, arrivals=arr), "arrivals needs out")
    _raises(lambda: pk.task("attention_decode", **base, out=out), "writes no partials")
    _raises(lambda: pk.task("attention_decode", **base, out=out, arrivals=arr.ref(0, n_kv - 1)),
            "one i32 counter per kv head")
    _raises(lambda: pk.task("attention_decode", **base, out=out.ref(0, hd), arrivals=arr), "expected n_q")
    few = megart.PersistentKernel(nw=8, device="cpu")
    T = lambda a, name: few.tensor(a, name)
    big = dict(q=T(torch.zeros(16 * 64, dtype=torch.bfloat16), "q"), k_cache=T(torch.zeros(1, 64, 64, dtype=torch.bfloat16), "k"),
               v_cache=T(torch.zeros(1, 64, 64, dtype=torch.bfloat16), "v"), pos=T(torch.zeros(1, dtype=torch.int32), "p"),
               part_o=T(torch.zeros(16 * 64, dtype=torch.float32), "po"), part_ml=T(torch.zeros(32, dtype=torch.float32), "pm"),
               n_q=16, n_kv=1, hd=64, chunks=1, out=T(torch.zeros(16 * 64, dtype=torch.bfloat16), "o"),
               arrivals=T(torch.zeros(1, dtype=torch.int32), "a"))
    _raises(lambda: few.task("attention_decode", **big), "group 16 > 8")


@pytest.mark.parametrize("hd,width", [(64, 1), (128, 4)], ids=["hd64-width1", "hd128-width4"])
def test_direct_form_writes_the_output_itself(hd, width):
    """The direct form (out without arrivals or partials): one chunk per kv head, instances of `width` q heads
    each write o / l for their heads. In the host-run bodies and the emulator it matches the fp32 chain, and the
    instances read nothing but q, K and V: no partial tensor, no merge call."""
    from megart.emulate import hostsim
    pos = 100
    pk, emu, q_ref, out_ref = _chain_on_the_host(hd, pos, merge="direct", width=width)
    dev = hostsim.run(pk, seed=3)
    check(dev["out"], out_ref, TOL_ATTN, "direct: attention out (host-run bodies)")
    check(emu["out"], out_ref, TOL_ATTN, "direct: attention out (emulator)")
    assert rel(dev["out"], emu["out"]) <= TOL_ATTN / 2
    att = [i for i in pk.graph.instances if i.type.name == "attention_decode"]
    assert len(att) == SHAPES[hd]["n_q"] // width and {i.params["group"] for i in att} == {width}
    assert "part_o" not in pk.graph.tensors and len({g.label for g in pk.graph.groups}) == 2


@pytest.mark.parametrize("hd,upto", [(64, 101), (128, 101), (64, 100)], ids=["hd64", "hd128", "hd64-past-it"])
def test_the_switch_runs_the_direct_form_up_to_its_length(hd, upto):
    """The fused form with direct_upto (kv_len 101 here): at kv_len <= direct_upto chunk c < group of each kv head
    attends q head c over the whole context and writes its output, so no chunk writes partials and no counter
    moves; past it (direct_upto 100) the chunks and their merge run. Either way the host-run bodies and the
    emulator match the fp32 chain."""
    from megart.emulate import hostsim
    pos = 100
    pk, emu, q_ref, out_ref = _chain_on_the_host(hd, pos, merge="fused", direct_upto=upto,
                                                 defines=_merge_shape(hd))
    dev = hostsim.run(pk, seed=3)
    switched = pos + 1 <= upto
    for name, run in (("host-run bodies", dev), ("emulator", emu)):
        check(run["out"], out_ref, TOL_ATTN, f"switch at {upto}: attention out ({name})")
        written = bool(run["part_o"].isfinite().all() and run["part_o"].any())   # (the host run poisons outputs: NaN)
        assert written != switched, name
        assert not run["arrivals"].any(), name
    att = [i for i in pk.graph.instances if i.type.name == "attention_decode"]
    assert {i.params["direct_upto"] for i in att} == {upto} and len(att) >= SHAPES[hd]["n_q"]


def test_switch_refusals():
    pk, t, base, out, arr = _fused_inputs()
    n_q, n_kv, hd = base["n_q"], base["n_kv"], base["hd"]
    for bad in (-1, True, 1.5, "64"):
        _raises(lambda: pk.task("attention_decode", **base, out=out, arrivals=arr, direct_upto=bad),
                "direct_upto must be an integer")
    _raises(lambda: pk.task("attention_decode", **base, direct_upto=64), "needs the fused form")
    _raises(lambda: pk.task("attention_decode", **{k: v for k, v in base.items() if k not in ("part_o", "part_ml")},
                            out=out, direct_upto=64), "applies to the fused form")
    few = megart.PersistentKernel(nw=8, device="cpu")   # one chunk per kv head: fewer than its 4 q heads
    q, k, v = attention_m1(n_q, n_kv, hd, 100, 128)
    po, pm = attention_scratch(n_q, n_kv, hd, 1)
    T = lambda a, name: few.tensor(a, name)  # noqa: E731
    _raises(lambda: few.task("attention_decode", q=T(q, "q"), k_cache=T(k, "k"), v_cache=T(v, "v"),
                             pos=T(torch.tensor([99], dtype=torch.int32), "p"), part_o=T(po, "po"), part_ml=T(pm, "pm"),
                             n_q=n_q, n_kv=n_kv, hd=hd, chunks=1, out=T(torch.zeros(n_q * hd, dtype=torch.bfloat16), "o"),
                             arrivals=T(torch.zeros(n_kv, dtype=torch.int32), "a"), direct_upto=64), "there are 1 chunks")
    from megart import tagged as tagged_words
    stamp = pk.tensor(tagged_words.empty(1, "cpu"), "stamp", tagged=True)
    _raises(lambda: pk.task("attention_decode", **base, out=out, arrivals=arr, direct_upto=64, pos_stamp=stamp),
            "leave pos_stamp out")


def test_direct_form_refusals():
    sh, ms = SHAPES[64], 2048
    pk, t, _, C = attention_only(sh, ms, 100, nw=NW)
    n_q, n_kv, hd = sh["n_q"], sh["n_kv"], sh["hd"]
    out = pk.tensor(torch.zeros(n_q * hd, dtype=torch.bfloat16), "out2")
    base = dict(q=t["q"], k_cache=t["k"], v_cache=t["v"], pos=t["pos"], n_q=n_q, n_kv=n_kv, hd=hd, out=out)
    _raises(lambda: pk.task("attention_decode", **base, chunks=2), "one chunk per kv head")
    _raises(lambda: pk.task("attention_decode", **base, chunk=64), "one chunk per kv head")
    _raises(lambda: pk.task("attention_decode", **base, width=0), "width")
    _raises(lambda: pk.task("attention_decode", **base, width=9), "width")
    _raises(lambda: pk.task("attention_decode", **{**base, "out": out.ref(0, hd)}), "expected n_q")
    _raises(lambda: pk.task("attention_decode", **{k: v for k, v in base.items() if k != "out"}),
            "part_o and part_ml are required")
    _raises(lambda: pk.task("attention_decode", **{k: v for k, v in base.items() if k != "out"}, part_o=t["po"],
                            part_ml=t["pm"], width=1), "direct form only")


def test_hostsim_catches_a_missing_barrier_in_attention(tmp_path):
    """Drop the barrier between the cross-warp merge's shared-memory writes and its reads: the emulator (Python
    references) cannot see it; the host-run body reads slots other warps have not written yet."""
    from megart.emulate import hostsim
    src = (megart.sources.source_root() / "tasks" / "attention_decode.cuh").read_text()
    old = "    __syncthreads();\n    const int nw_round"
    assert src.count(old) == 1
    (tmp_path / "attention_decode.cuh").write_text(src.replace(old, "    const int nw_round"))
    pk, emu, q_ref, out_ref = _chain_on_the_host(64, 2046, {"attention_decode": str(tmp_path / "attention_decode.cuh")})
    check(emu["out"], out_ref, TOL_ATTN, "emulator (references only)")
    dev = hostsim.run(pk, seed=3)
    assert not (rel(dev["out"], out_ref) < TOL_ATTN), "the host-run body missed the dropped barrier"


# --- refusals ---------------------------------------------------------------------------------------------

def _raises(fn, match):
    with pytest.raises(GraphError, match=match):
        fn()


def test_bad_shapes_are_refused():
    sh, ms = SHAPES[64], 64
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    pk = megart.PersistentKernel(nw=8, device="cpu")
    bf = torch.bfloat16
    z = lambda *s, dt=bf: torch.zeros(*s, dtype=dt)
    q, k, v = pk.tensor(z(n_q * hd), "q"), pk.tensor(z(n_kv, ms, hd), "k"), pk.tensor(z(n_kv, ms, hd), "v")
    w, x = pk.tensor(z((n_q + 2 * n_kv) * hd, d), "w"), pk.tensor(z(d + 8), "x")
    cs, sn = pk.tensor(z(ms, hd // 2, dt=torch.float32), "cos"), pk.tensor(z(ms, hd // 2, dt=torch.float32), "sin")
    pos = pk.tensor(torch.zeros(2, dtype=torch.int32), "pos")
    po, pm = pk.tensor(z(n_kv, 1, 4, hd, dt=torch.float32), "po"), pk.tensor(z(n_kv, 1, 4, 2, dt=torch.float32), "pm")
    out = pk.tensor(z(n_q * hd), "out")
    base = dict(q=q, k_cache=k, v_cache=v, w_qkv=w, x=x.ref(0, d), cos=cs, sin=sn, pos=pos.ref(0, 1), n_q=n_q,
                n_kv=n_kv, hd=hd)
    qkv = lambda **kw: pk.task("qkv_rope_append", **{**base, **kw})
    _raises(lambda: qkv(hd=96), "hd must be one of")
    _raises(lambda: qkv(n_kv=5), "multiple of n_kv")
    _raises(lambda: qkv(x=x.ref(0, d - 8)), "w_qkv has")
    _raises(lambda: qkv(x=x.ref(4, d)), "16-byte boundary")
    _raises(lambda: qkv(x=x.ref(0, 12)), "multiple of 8")
    _raises(lambda: qkv(pos=pos), "single i32")
    _raises(lambda: qkv(cos=cs.ref(0, ms * hd // 2 - hd // 2)), "cos must be")
    _raises(lambda: qkv(q=q.ref(0, n_q * hd - 1)), "q has")
    _raises(lambda: qkv(v_cache=v.ref(0, n_kv * ms * hd - hd)), "k_cache/v_cache")
    _raises(lambda: qkv(kv_refs="loose"), "kv_refs")
    _raises(lambda: qkv(norm_weight=x), "norm_weight has")
    _raises(lambda: qkv(max_seq=ms + 1), "max_seq")
    _raises(lambda: qkv(eps=0.0), "eps")
    abase = dict(q=q, k_cache=k, v_cache=v, pos=pos.ref(0, 1), part_o=po, part_ml=pm, n_q=n_q, n_kv=n_kv, hd=hd,
                 chunks=1)
    att = lambda **kw: pk.task("attention_decode", **{**abase, **kw})
    _raises(lambda: att(n_q=17 * n_kv), "group")
    _raises(lambda: att(hd=32), "hd must be one of")
    _raises(lambda: att(chunks=2), "part_o has")
    _raises(lambda: att(chunk=-1), "chunk must be")
    _raises(lambda: att(chunk=16, chunks=3), "chunks=3")
    _raises(lambda: att(min_chunk=-1), "min_chunk must be")
    _raises(lambda: att(min_chunk=ms + 1), "min_chunk must be")
    _raises(lambda: att(min_chunk=2.5), "min_chunk must be")
    _raises(lambda: att(chunk=16, chunks=4, min_chunk=8), "applies to dynamic chunks")
    _raises(lambda: att(part_ml=po), "part_ml has")
    _raises(lambda: att(pos=pos), "single i32")
    mbase = dict(out=out, part_o=po, part_ml=pm, n_q=n_q, n_kv=n_kv, hd=hd, chunks=1)
    mrg = lambda **kw: pk.task("attention_merge", **{**mbase, **kw})
    _raises(lambda: mrg(chunks=2), "part_o has")
    _raises(lambda: mrg(out=q.ref(0, hd)), "out has")
    _raises(lambda: mrg(chunks=0), "chunks must be")
    assert not pk.graph.instances     # nothing was added by a refused call
    pk.task("attention_merge", **mbase)    # the good call is accepted


# --- sources, costs ---------------------------------------------------------------------------------------

def test_shared_helpers_are_emitted_once():
    """The attention bodies share tasks/attention_common.cuh, declared once and emitted once per kernel
    (qkv_rope_append also runs on the dense matvec engine: tasks/dense_*.cuh, once too; its fp8 form
    shares its body, tasks/qkv_common.cuh, once with both in the kernel)."""
    from megart import codegen, registry
    types = [registry.get(n) for n in ("qkv_rope_append", "qkv_rope_append_fp8", "attention_decode",
                                       "attention_merge")]
    assert all(t.headers[0] == "tasks/attention_common.cuh" for t in types)
    assert types[0].headers == types[1].headers == (
        "tasks/attention_common.cuh", "tasks/dense_common.cuh", "tasks/dense_engines.cuh", "tasks/dense_bodies.cuh",
        "tasks/qkv_common.cuh")
    src = codegen.generate(types, codegen.KernelConfig()).text
    assert src.count("namespace megart_attn {\n#ifdef __CUDA_ARCH__\n// 16 bytes of a weight") == 1
    assert src.count("constexpr int kQkvMaxD = 8192;") == 1       # its generated constants, once too
    assert src.count("__device__ __forceinline__ void qkv_body(") == 1
    for t in types:
        assert "ld_weight16(const void*" not in (ROOT / t.source).read_text()


def test_costs():
    from megart import registry
    sh, ms, pos = SHAPES[64], 2048, 2047
    pk = megart.PersistentKernel(nw=NW, device="cpu")
    t, _ = build_qkv(pk, sh, ms, pos)
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    c = registry.get("qkv_rope_append").cost(q=t["q"], k_cache=t["k"], v_cache=t["v"], w_qkv=t["w"], x=t["x"],
                                             norm_weight=t["nw"], n_q=n_q, n_kv=n_kv, hd=hd)
    assert c.bytes > (n_q + 2 * n_kv) * hd * d * 2 and c.flops == 2 * (n_q + 2 * n_kv) * hd * d
    a = registry.get("attention_decode").cost(q=t["q"], k_cache=t["k"], pos=t["pos"], n_q=n_q, n_kv=n_kv, hd=hd)
    assert a.bytes >= 2 * n_kv * (pos + 1) * hd * 2     # the KV bytes are the floor
    m = registry.get("attention_merge").cost(n_q=n_q, n_kv=n_kv, hd=hd, chunks=16)
    assert m.bytes > 0


def test_pos_stamp_is_one_tagged_word_and_chooses_the_forms_compiled_in():
    """pos_stamp (pos_advance's stamp, which the weight stream's producer polls before it loads attention's
    K/V ahead) must be one tagged word, for both types; an instance without it has its own K/V path compiled
    in (MEGART_ATTN_UNSTAMPED), so a kernel whose attention is all stamped carries only the streamed one."""
    from megart import tagged
    sh, ms = SHAPES[64], 2048
    pk, t, _, C = attention_only(sh, ms, 100, nw=NW)
    base = dict(q=t["q"], k_cache=t["k"], v_cache=t["v"], pos=t["pos"], part_o=t["po"], part_ml=t["pm"],
                n_q=sh["n_q"], n_kv=sh["n_kv"], hd=sh["hd"])
    plain = pk.tensor(torch.zeros(1, dtype=torch.int32), "plain_stamp")
    two = pk.tensor(tagged.empty(2), "two_stamps", tagged=True)
    _raises(lambda: pk.task("attention_decode", **base, pos_stamp=plain), "pos_stamp must be one tagged word")
    _raises(lambda: pk.task("attention_decode", **base, pos_stamp=two), "pos_stamp must be one tagged word")
    _raises(lambda: pk.task("pos_advance", pos=t["pos"], pos_next=plain, pos_stamp=plain),
            "pos_stamp must be one tagged word")
    attn = megart.registry.get("attention_decode")
    po, arr, off = dict(part_o=t["po"]), dict(part_o=t["po"], arrivals=two), {"MEGART_ATTN_FUSED_MERGE": 0}
    assert attn.macros_for([{"pos_stamp": None, **po}, {"pos_stamp": two, **po}], 256) == {
        "MEGART_ATTN_UNSTAMPED": 1, **off}
    assert attn.macros_for([{"pos_stamp": two, "k_new": two, **po}], 256) == {"MEGART_ATTN_TAGGED": 1, **off}
    # the direct form's store (an instance without partials) and the fused merge (one with arrivals) likewise
    assert attn.macros_for([{"pos_stamp": two, **arr}], 256) == {"MEGART_ATTN_FUSED_MERGE": 1}
    assert attn.macros_for([{"pos_stamp": two}, {"pos_stamp": two, **arr}], 256) == {
        "MEGART_ATTN_DIRECT": 1, "MEGART_ATTN_FUSED_MERGE": 1}


def test_attention_mark0_moves_the_stamp_only_in_phase_marked_builds():
    """MEGART_ATTN_MARK0 (a timing diagnostic) puts attention_decode's mark 0 at another point of the chunk: in a
    phase-marked build each point is its own code; without the marks the macro changes nothing (a profiled build
    is what the faithful numbers time)."""
    n_q, n_kv, hd, L = 8, 2, 64, 64

    def cubin(**defines):
        pk = megart.PersistentKernel(nw=4, device="cpu", profile=True,
                                     defines={**body_defines(hd, n_q // n_kv, ATTN_SUBGROUP), **defines})
        chunks = attention_chunks(n_kv, L, pk.nw)
        q, k, v = attention_m1(n_q, n_kv, hd, L, L)
        po, pm = attention_scratch(n_q, n_kv, hd, chunks)
        pk.task("attention_decode", q=pk.tensor(q, "q"), k_cache=pk.tensor(k, "k"), v_cache=pk.tensor(v, "v"),
                pos=pk.tensor(torch.full((1,), L - 1, dtype=torch.int32), "pos"), part_o=pk.tensor(po, "po"),
                part_ml=pk.tensor(pm, "pm"), n_q=n_q, n_kv=n_kv, hd=hd, max_seq=L, chunks=chunks,
                tiles=chunks * n_kv)
        return pk.compile().compiled.cubin

    assert cubin(MEGART_ATTN_MARK0=3) == cubin()
    marked = {k: cubin(MEGART_PHASE_MARKS=1, MEGART_ATTN_MARK0=k) for k in (0, 3, 5, 6)}
    assert len(set(marked.values())) == 4
