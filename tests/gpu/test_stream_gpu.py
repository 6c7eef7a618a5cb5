"""The weight stream on a real GPU (csrc/weight_stream.cuh): the bulk copies, mbarriers and producer warps
give the register engine's outputs bit for bit, across instances and calls, at every stage size; a stage
that never lands ends in HangError naming the ring slot, and the context runs a good kernel afterwards.
(The decode models stream by default, so tests/gpu/test_llama_gpu.py covers the whole step too.)"""
import pytest
import torch

import megart
from megart.geometry import dense as geo
from megart.models import llama
from test_dense_engines import _broken

pytestmark = pytest.mark.gpu

REGISTERS = {"MEGART_STREAM_SLOTS": 0}
ENGINES = [{"MEGART_STREAM_SLOTS": "auto"}, {"MEGART_STREAM_SLOTS": "auto", "MEGART_STREAM_STAGE": 256},
           {"MEGART_STREAM_SLOTS": 8, "MEGART_STREAM_STAGE": 64},
           {"MEGART_STREAM_SLOTS": 3, "MEGART_STREAM_PRODUCER_WARPS": 1},
           {"MEGART_STREAM_SLOTS": "auto", "MEGART_STREAM_FREE": 0},     # lane 0 alone frees its slot
           {"MEGART_STREAM_SLOTS": "auto", "MEGART_STREAM_INFLIGHT": 1},  # one stage in flight per warp
           {"MEGART_STREAM_SLOTS": "auto", "MEGART_STREAM_INFLIGHT": 0}]  # the ring alone caps


def _dense_chain(defines, n, k, tiles, nw, dev):
    """gemv_m1 (norm + residual), a weightless copy, gemv_m1_fp8, gate_up_silu, lm_head_argmax and
    group_gemm_m1 in one kernel: the producer streams across instances (tiles > nw) and steps over the copy."""
    w, x = geo.dense_m1(n, k, seed=3)
    we, a, _ = geo.moe_m1(2, [1], n, k, seed=7)
    wu, _ = geo.dense_m1(n, k, seed=4)
    w8, s8 = geo.quantize_fp8_per_channel(w)
    g, res = geo.norm_weight(k, seed=5), geo.dense_m1(1, n, seed=6)[1]
    pk = megart.PersistentKernel(nw=nw, defines=defines)
    X, W = pk.tensor(x.to(dev), "x"), pk.tensor(w.to(dev), "w")
    out = {"y": torch.zeros(n, dtype=torch.bfloat16, device=dev), "y8": torch.zeros(n, dtype=torch.bfloat16, device=dev),
           "h": torch.zeros(n, dtype=torch.bfloat16, device=dev), "pv": torch.zeros(tiles, device=dev),
           "pi": torch.zeros(tiles, dtype=torch.int32, device=dev), "logits": torch.zeros(n, device=dev),
           "ye": torch.zeros(2 * geo.EXPERT_ROWS, n, dtype=torch.bfloat16, device=dev)}
    pk.task("gemv_m1", y=pk.tensor(out["y"], "y"), w=W, x=X, norm_weight=pk.tensor(g.to(dev), "g"),
            residual=pk.tensor(res.to(dev), "res"), tiles=tiles)
    pk.task("copy", dst=pk.tensor(torch.zeros(64, device=dev), "c_dst"),
            src=pk.tensor(torch.ones(64, device=dev), "c_src"), tiles=nw)
    pk.task("gemv_m1_fp8", y=pk.tensor(out["y8"], "y8"), w=pk.tensor(w8.to(dev), "w8"),
            scale=pk.tensor(s8.to(dev), "s8"), x=X, tiles=tiles)
    pk.task("gate_up_silu", h=pk.tensor(out["h"], "h"), w_gate=W, w_up=pk.tensor(wu.to(dev), "wu"), x=X, tiles=tiles)
    pk.task("lm_head_argmax", w=W, x=X, part_val=pk.tensor(out["pv"], "pv"), part_idx=pk.tensor(out["pi"], "pi"),
            logits=pk.tensor(out["logits"], "logits"), tiles=tiles)
    pk.task("group_gemm_m1", y=pk.tensor(out["ye"], "ye"), w=pk.tensor(we.to(dev), "we"), a=pk.tensor(a.to(dev), "a"),
            active=[1], tiles=tiles)
    pk.compile()
    return pk, out, (w, x, g, res)


@pytest.mark.parametrize("n,k,tiles,nw", [(4096, 2048, 264, 132), (8200, 1040, 40, 16), (6, 8208, 2, 2)],
                         ids=["2048-wide,2-per-worker", "odd-K,many-pairs", "split-K"])
def test_stream_is_bit_identical_to_registers(n, k, tiles, nw, cuda):
    pk, want, (w, x, g, res) = _dense_chain(REGISTERS, n, k, tiles, nw, cuda)
    assert pk.stream_layout().slots == 0
    pk(steps=2)
    assert geo.relerr(want["y"].cpu(), geo.ref_gemv(w, x, norm_weight=g, residual=res)) < 1e-2
    for defines in ENGINES:
        spk, got, _ = _dense_chain(defines, n, k, tiles, nw, cuda)
        assert spk.stream_layout().slots > 0, defines
        spk(steps=2)
        for name, t in want.items():
            assert torch.equal(got[name], t), (defines, name)


def test_a_stage_that_never_lands_names_the_ring_slot(tmp_path, cuda):
    """The producer skips every stage past each warp's first row pair: the warp waits for bytes that never
    come, the watchdog records the ring slot, and the context runs a good kernel afterwards."""
    broken = _broken(tmp_path, "  if (!st.live) return false;\n  const long long off",
                     "  if (!st.live || st.k > 0) return false;\n  const long long off")
    w, x = geo.dense_m1(300, 64, seed=1)

    def gemv(**kw):
        pk = megart.PersistentKernel(nw=1, defines={"MEGART_STREAM_SLOTS": 2}, **kw)
        y = torch.zeros(300, dtype=torch.bfloat16, device=cuda)
        pk.task("gemv_m1", y=pk.tensor(y, "y"), w=pk.tensor(w.to(cuda), "w"), x=pk.tensor(x.to(cuda), "x"))
        pk.compile()
        return pk, y

    bad, _ = gemv(source_overrides=broken, watchdog_s=0.5)
    with pytest.raises(megart.HangError) as ei:
        bad()
    rec = ei.value.record
    assert "weight-stream ring slot" in rec["event_name"] and "never landed" in rec["event_name"], rec
    assert rec["task"] == "gemv_m1" and rec["worker"] == 0
    assert torch.ones(4, device=cuda).sum().item() == 4
    good, y = gemv()
    good()
    assert geo.relerr(y.cpu(), geo.ref_gemv(w, x)) < 1e-2


def _few_steps(m, cfg) -> list:
    """A few steps of a freshly reset model: its outputs (block: each step's; else 4 greedy tokens and the last
    logits) and the K/V rows they appended, cloned."""
    if cfg.block:
        xs = llama.make_inputs(cfg, 3, device=m.pk.device)
        m.reset(cfg.prefill, clear_kv=True)
        out = [m.step(x).clone() for x in xs]
    else:
        m.reset(cfg.prefill, token=17, clear_kv=True)
        out = [m.generate(4).clone(), m.logits.clone()]
    return out + [k[:, cfg.prefill:cfg.prefill + 4].clone() for k, _ in m.kv]


@pytest.mark.parametrize("name,tagged_attn", [("1b", False), ("1b", True), ("block8b", False)],
                         ids=["hd64", "hd64-tagged", "hd128-group4"])
def test_streamed_kv_is_bit_identical_to_the_attention_ring(name, tagged_attn, cuda):
    """Attention's K/V rows through the weight stream (MEGART_STREAM_KV=1) against attention's own cp.async
    ring (the default): the same positions per lane in the same batches, so every output bit for bit, over
    steps whose chunks end inside a stage (2k context: 129 positions per chunk)."""
    cfg = llama.config(name).with_(layers=2)
    runs = []
    for defines in ({"MEGART_STREAM_KV": 1}, {}):
        m = llama.LlamaModel(cfg, device=cuda, defines=defines, tagged_attn=tagged_attn)
        assert ("attention_decode" in m.pk.stream_layout().types) == bool(defines), defines
        runs.append(_few_steps(m, cfg))
        del m
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,pieces,whole", [
    ("1b", {}, {"MEGART_DENSE_X_PIECES": 0}), ("block8b", {}, {"MEGART_DENSE_X_PIECES": 0}),
    ("1b_fp8", {}, {"MEGART_DENSE_X_PIECES_FP8": 0})],
    ids=["1b", "block8b", "1b_fp8"])
def test_x_in_pieces_is_bit_identical(name, pieces, whole, cuda):
    """x in pieces (the default: down's and o_proj's tagged x staged in pieces behind mbarriers, and so for their
    e4m3 forms) against x staged whole: the same chunks in the same order, so every logit, token and K/V row bit
    for bit."""
    cfg = llama.config(name).with_(layers=2)
    runs, cubins = [], []
    for defines in (pieces, whole):
        m = llama.LlamaModel(cfg, device=cuda, defines=defines)
        assert m.pk.stream_layout().slots > 0, defines
        cubins.append(m.pk.compiled.cubin)
        runs.append(_few_steps(m, cfg))
        del m
    assert cubins[0] != cubins[1]              # the pieces path is compiled in, so the test compares two engines
    for a, b in zip(*runs):
        assert torch.equal(a, b)
