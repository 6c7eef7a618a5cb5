"""Attention task types on the GPU at the production grid (nw = SM count, 132 on the H200): the device
bodies against the whole-op fp32 references (TOL_QKV / TOL_ATTN, cosine >= 0.99) and against the CPU
emulator (the per-instance references), including a 32768-token context and several steps of one compiled
kernel at advancing positions. test_report_times prints per-task times against the HBM floor (run with -s).
"""
from __future__ import annotations

import pytest
import torch

import megart
from megart.geometry.attention import attention_m1, ref_attention_decode, ref_qkv_rope_append
from megart.geometry.attention import chunk_range

import test_tasks_attention as cpu
from test_tasks_attention import SHAPES, TOL_ATTN, TOL_QKV, build_attention, build_qkv, check
from test_tasks_qkv import build_qkv_fold, build_qkv_fp8

pytestmark = pytest.mark.gpu


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def compiled(pk):
    pk.compile()
    assert pk.report.spill_bytes == 0, pk.report
    return pk


# --- qkv_rope_append -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_refs", ["strict", "partition"])
@pytest.mark.parametrize("hd,pos,norm", [(64, 0, True), (64, 777, False), (64, 4095, True), (128, 1, True),
                                         (128, 3000, True)])
def test_qkv_rope_append_gpu(cuda, hd, pos, norm, kv_refs):
    sh, ms = SHAPES[hd], 4096
    pk = megart.PersistentKernel(nw=sms())
    t, r = build_qkv(pk, sh, ms, pos, seed=pos, norm=norm, kv_refs=kv_refs, tiles=sms(), dev="cuda")
    compiled(pk)
    emu = pk.emulate()           # before the launch: the emulator starts from the tensors' current contents
    pk()
    q_ref, k_ref, v_ref = r["ref"]
    got = {n: t[n].data.cpu() for n in ("q", "k", "v")}
    check(got["q"], q_ref, TOL_QKV, "q vs fp32")
    check(got["k"][:, pos], k_ref, TOL_QKV, "k row vs fp32")
    check(got["v"][:, pos], v_ref, TOL_QKV, "v row vs fp32")
    check(got["q"], emu["q"], TOL_QKV, "q vs emulator")
    check(got["k"][:, pos], emu["k"][:, pos], TOL_QKV, "k row vs emulator")
    keep = torch.ones(ms, dtype=torch.bool)
    keep[pos] = False
    assert torch.equal(got["k"][:, keep], r["k0"][:, keep]) and torch.equal(got["v"][:, keep], r["v0"][:, keep])


@pytest.mark.parametrize("pos", [777, 2048], ids=["in-range", "pos-out-of-range"])
def test_qkv_folded_all_reduce_gpu(cuda, pos):
    """qkv_rope_append with down's TP=2 all-reduce folded into its staging, on the GPU at the production grid:
    x_out is the sum, and q and the caches are the bits of the same kernel fed the finished sum."""
    runs = {}
    for how in ("folded", "summed"):
        pk = megart.PersistentKernel(nw=sms())
        t, total, _ = build_qkv_fold(pk, how, pos, dev="cuda")
        compiled(pk)
        pk()
        runs[how] = {n: x.data.cpu() for n, x in t.items()}
    assert torch.equal(runs["folded"]["x_out"], total)
    for n in ("q", "k", "v"):
        assert torch.equal(runs["folded"][n], runs["summed"][n]), n


@pytest.mark.parametrize("hd,pos", [(64, 5), (128, 777)])
def test_qkv_fp8_gpu(cuda, hd, pos):
    """qkv_rope_append_fp8 on the GPU against the fp32 chain over the dequantised weights."""
    sh, ms = SHAPES[hd], 1024
    pk = megart.PersistentKernel(nw=sms())
    t, (q_ref, k_ref, v_ref) = build_qkv_fp8(pk, sh, ms, pos, dev="cuda", tiles=sms())
    pk.compile()
    assert pk.report.spill_bytes == 0
    pk()
    check(t["q"].data.cpu(), q_ref, TOL_QKV, "q")
    check(t["k"].data[:, pos].cpu(), k_ref, TOL_QKV, "k row")
    check(t["v"].data[:, pos].cpu(), v_ref, TOL_QKV, "v row")


def test_qkv_pos_out_of_range_gpu(cuda):
    sh, ms = SHAPES[64], 256
    pk = megart.PersistentKernel(nw=sms())
    t, r = build_qkv(pk, sh, ms, ms, dev="cuda")
    compiled(pk)
    pk()
    assert torch.equal(t["k"].data.cpu(), r["k0"]) and not t["q"].data.any()


# --- attention_decode + attention_merge ------------------------------------------------------------------

@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("max_seq,kv_len,chunk", [(2048, 1, 0), (2048, 2, 0), (2048, 17, 0), (2048, 333, 0),
                                                  (2048, 2048, 0), (2048, 2047, 256), (2048, 1, 256),
                                                  (32768, 32768, 0), (32768, 20001, 0), (32768, 5000, 2048)])
def test_attention_gpu(cuda, hd, max_seq, kv_len, chunk):
    sh = SHAPES[hd]
    pk, t, (q, k, v), C = cpu.attention_only(sh, max_seq, kv_len, chunk=chunk, seed=kv_len, dev="cuda", nw=sms())
    compiled(pk)
    emu = pk.emulate()
    pk()
    out = t["out"].data.cpu()
    check(out, ref_attention_decode(q, k, v, kv_len), TOL_ATTN, "attention vs fp32")
    check(out, emu["out"], TOL_ATTN, "attention vs emulator")
    po, pm = t["po"].data.cpu(), t["pm"].data.cpu()
    assert not torch.isnan(po).any() and not torch.isnan(pm).any()
    ml, eml = pm.view(sh["n_kv"], C, -1, 2), emu["part_ml"].view(sh["n_kv"], C, -1, 2)
    for c in range(C):
        lo, hi = chunk_range(chunk, c, C, kv_len)
        if hi <= lo:
            assert torch.all(ml[:, c, :, 0] == float("-inf")) and torch.all(ml[:, c, :, 1] == 0)
        else:
            torch.testing.assert_close(ml[:, c], eml[:, c], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("group", [1, 2, 3, 7, 8])
def test_attention_groups_gpu(cuda, group):
    sh = dict(n_q=8 * group, n_kv=8, hd=128, d=4096)
    pk, t, (q, k, v), C = cpu.attention_only(sh, 4096, 3001, seed=group, dev="cuda", nw=sms())
    compiled(pk)
    pk()
    check(t["out"].data.cpu(), ref_attention_decode(q, k, v, 3001), TOL_ATTN, f"group {group}")


@pytest.mark.parametrize("defines", [{}, {"MEGART_ATTN_RING_BYTES": 32 << 10}, {"MEGART_ATTN_RING_BYTES": 0}],
                         ids=["ring", "ring-32KB", "registers"])
def test_attention_after_a_late_pos_advance_gpu(cuda, defines):
    """pos_advance in the same launch, after a 200 us spin on worker 0, so pos moves while the attention
    workers wait (dynamic chunks: the chunk bounds move with it). Each body (the K/V ring and the register
    path) must attend the chunk of the pos it finds after its wait: the output is the attention at the new
    pos. (A guard for any design that reads pos or K/V before the wait.)"""
    sh, ms, kv_len = SHAPES[64], 2048, 1500
    n_q, n_kv, hd = sh["n_q"], sh["n_kv"], sh["hd"]
    q, k, v = attention_m1(n_q, n_kv, hd, kv_len, ms, seed=5)
    pk = megart.PersistentKernel(nw=sms(), defines=defines)
    T = lambda a, name: pk.tensor(a.clone().to("cuda"), name)  # noqa: E731
    t = dict(q=T(q, "q"), k=T(k, "k"), v=T(v, "v"), pos=T(torch.tensor([kv_len - 2], dtype=torch.int32), "pos"))
    pos_next = T(torch.tensor([kv_len - 1], dtype=torch.int32), "pos_next")
    pk.task("spin", ns=200_000, worker=0)
    pk.task("pos_advance", pos=t["pos"], pos_next=pos_next, worker=0)
    build_attention(pk, t, sh, ms, dev="cuda", merge="fused")
    compiled(pk)
    pk()
    assert int(t["pos"].data.item()) == kv_len - 1
    check(t["out"].data.cpu(), ref_attention_decode(q, k, v, kv_len), TOL_ATTN, "attention at the new pos")


# --- the chain, several steps of one compiled kernel ------------------------------------------------------

@pytest.mark.parametrize("hd,max_seq,pos0", [(64, 2048, 0), (128, 2048, 1500), (64, 32768, 32760)])
def test_decode_chain_steps_gpu(cuda, hd, max_seq, pos0):
    """qkv -> attention -> merge, one kernel, three steps at pos0, pos0+1, pos0+2 (pos advanced in device
    memory between launches): each step's new row is appended and attended."""
    sh = SHAPES[hd]
    pk = megart.PersistentKernel(nw=sms())
    t, r = build_qkv(pk, sh, max_seq, pos0, seed=hd, dev="cuda", tiles=sms())
    build_attention(pk, t, sh, max_seq, dev="cuda")
    compiled(pk)
    kc, vc = r["k0"].float(), r["v0"].float()
    for step, pos in enumerate(range(pos0, pos0 + 3)):
        t["pos"].data.fill_(pos)
        assert pk() == step + 1
        q_ref, k_ref, v_ref = ref_qkv_rope_append(r["x"], r["w"], r["cos"], r["sin"], pos, sh["n_q"], sh["n_kv"],
                                                  hd, r["nw"], 1e-5)
        kc[:, pos], vc[:, pos] = k_ref, v_ref
        check(t["q"].data.cpu(), q_ref, TOL_QKV, f"q step {step}")
        check(t["k"].data.cpu()[:, pos], k_ref, TOL_QKV, f"k row step {step}")
        check(t["out"].data.cpu(), ref_attention_decode(q_ref, kc, vc, pos + 1), TOL_ATTN, f"out step {step}")


@pytest.mark.parametrize("nw", [8, 64, 68, 128, 132])
def test_decode_chain_worker_sweep_gpu(cuda, nw):
    sh, ms, pos = SHAPES[64], 2048, 1999
    pk = megart.PersistentKernel(nw=min(nw, sms()))
    t, r = build_qkv(pk, sh, ms, pos, dev="cuda", tiles=pk.nw)
    build_attention(pk, t, sh, ms, dev="cuda")
    compiled(pk)
    emu = pk.emulate()
    pk()
    check(t["out"].data.cpu(), emu["out"], TOL_ATTN, f"out vs emulator nw={nw}")
    check(t["q"].data.cpu(), emu["q"], TOL_QKV, f"q vs emulator nw={nw}")


# --- times against the floor (printed; run with -s) --------------------------------------------------------

def _hbm_read_bw() -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    x.sum()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        x.sum()
    e.record()
    torch.cuda.synchronize()
    return 5 * x.numel() * 2 / (s.elapsed_time(e) * 1e-3)


def _profile(pk, steps=12):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    pk()
    pk.reset_profile(steps)
    for _ in range(steps):
        flush.fill_(1)          # evict L2 between steps: a real step streams every layer's weights and KV
        pk.launch()
    pk.check()
    return pk.profile()


def test_report_times(cuda):
    bw = _hbm_read_bw()
    rows = []
    sh = SHAPES[64]
    n_q, n_kv, hd, d = sh["n_q"], sh["n_kv"], sh["hd"], sh["d"]
    for kv_refs in ("strict", "partition"):
        pk = megart.PersistentKernel(nw=sms(), profile=True, profile_steps=12)
        build_qkv(pk, sh, 2048, 1000, kv_refs=kv_refs, dev="cuda", tiles=sms())
        compiled(pk)
        st = _profile(pk).by_task("qkv_rope_append")
        nbytes = (n_q + 2 * n_kv) * hd * d * 2
        rows.append((f"qkv_rope_append 1B {kv_refs}", nbytes, st))
    for ms, chunk in ((2048, 0), (32768, 0)):
        pk, t, _, C = cpu.attention_only(sh, ms, ms, chunk=chunk, dev="cuda", nw=sms(), profile=True,
                                         profile_steps=12)
        compiled(pk)
        prof = _profile(pk)
        rows.append((f"attention_decode kv {ms} chunks {C}", 2 * n_kv * ms * hd * 2, prof.by_task("attention_decode")))
        rows.append((f"attention_merge chunks {C}", n_q * C * (hd + 2) * 4, prof.by_task("attention_merge")))
    print(f"\nHBM read bandwidth measured now: {bw / 1e12:.2f} TB/s")
    print(f"{'task':44s} {'MB':>8s} {'slowCTA us':>11s} {'wall us':>9s} {'x floor(wall)':>14s}")
    for name, nbytes, st in rows:
        floor_us = nbytes / bw * 1e6
        wall = st.wall.median / 1e3
        print(f"{name:44s} {nbytes / 1e6:8.2f} {st.slow_cta.median / 1e3:11.2f} {wall:9.2f} {wall / floor_us:14.2f}")
        assert wall > 0
