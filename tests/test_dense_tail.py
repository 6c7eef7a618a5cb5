"""A call's shared tail (tasks/dense_matvec.py _tail, tasks/dense_bodies.cuh matvec_tail): gemv_m1 and gate_up_silu
split all but their last `tail` rows over their instances, and every warp of every instance then claims the tail's
rows one at a time from a counter. On the CPU: the host simulation of the bodies (instances one at a time, so the
first instance claims the whole tail) and the reference emulator (each instance computes its declared piece) both
give the untailed call's results, every output word carries the step's tag in each of two steps (a tail row nobody
claimed keeps the last step's), and the counter is back to zero after each step; bad arguments are named."""
from __future__ import annotations

import pytest
import torch

import megart
from megart import GraphError, tagged
from megart.emulate import hostsim
from megart.geometry import dense as geo

from dense_checks import gate, kernel

STEPS = 2


def _run(pk):
    pk.compile()
    assert pk.report.spill_bytes == 0, pk.report
    emu = pk.emulate(steps=STEPS)
    dev = {k: v.clone() for k, v in hostsim.run(pk, steps=STEPS).items()}
    return emu, dev


def _gemv(n, k, tiles, tail, nw=8, residual=True):
    w, x = geo.dense_m1(n, k, seed=21)
    res = torch.randn(n, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    pk = kernel(nw)
    y = pk.tensor(tagged.empty(n), "y", tagged=True)
    pool = pk.tensor(torch.zeros(1, dtype=torch.int32), "pool") if tail else None
    pk.task("gemv_m1", y=y, w=pk.tensor(w, "w"), x=pk.tensor(x, "x"),
            residual=pk.tensor(res, "res") if residual else None, tiles=tiles, tail=tail, pool=pool)
    return pk, (w.float() @ x.float() + (res.float() if residual else 0))


def _gemv_plain(n, k, tiles, tail):
    return _gemv(n, k, tiles, tail, residual=False)


def _gate_up(f, k, tiles, tail, nw=8):
    wg, x = geo.dense_m1(f, k, seed=11)
    wu, _ = geo.dense_m1(f, k, seed=12)
    g = geo.norm_weight(k, seed=13)
    pk = kernel(nw)
    h = pk.tensor(tagged.empty(f), "y", tagged=True)
    pool = pk.tensor(torch.zeros(1, dtype=torch.int32), "pool") if tail else None
    pk.task("gate_up_silu", h=h, w_gate=pk.tensor(wg, "wg"), w_up=pk.tensor(wu, "wu"), x=pk.tensor(x, "x"),
            norm_weight=pk.tensor(g, "g"), tiles=tiles, tail=tail, pool=pool)
    return pk, geo.ref_gate_up_silu(wg, wu, x, norm_weight=g)


@pytest.mark.parametrize("build,task,n,k,tiles,tail", [
    pytest.param(_gemv, "gemv_m1", 512, 1024, 6, 96, id="gemv"),
    pytest.param(_gemv_plain, "gemv_m1", 71, 264, 4, 2, id="gemv-one-pair-no-residual"),
    pytest.param(_gate_up, "gate_up_silu", 600, 512, 7, 141, id="gate_up"),
    pytest.param(_gate_up, "gate_up_silu", 64, 256, 9, 60, id="gate_up-more-instances-than-static-rows"),
])
def test_a_tailed_call_gives_the_untailed_results_and_rearms(build, task, n, k, tiles, tail):
    pk, ref = build(n, k, tiles, tail)
    emu, dev = _run(pk)
    plain_emu, plain_dev = _run(build(n, k, tiles, 0)[0])
    assert torch.equal(dev["y"], plain_dev["y"]) and torch.equal(emu["y"], plain_emu["y"])   # same bits, same tags
    assert (tagged.tags(dev["y"]) == tagged.tags(dev["y"])[0]).all() and tagged.tags(dev["y"])[0] != 0
    assert int(dev["pool"][0]) == 0 and int(pk.graph.tensors["pool"].data[0]) == 0
    gate(task, tagged.values(emu["y"]), tagged.values(dev["y"]), ref)
    tails = [i.params for i in pk.graph.instances if i.params["tail_n"]]
    assert len(tails) == len(pk.graph.instances) and all(p["tail_n"] == tail for p in tails)
    assert sum(p["n"] for p in tails) == n - tail
    assert sum(p["out_tail"].count for p in tails if p["out_tail"] is not None) == tail


def test_a_counter_that_is_not_reset_leaves_the_next_steps_tail_unwritten(tmp_path):
    """Without the last claim's reset the second step's claims all come back past the tail: its rows keep the
    first step's tags, which the tag check above sees (on the device, their readers would poll until the
    watchdog)."""
    from test_dense_engines import _broken
    src = _broken(tmp_path, "  if ((threadIdx.x & 31) == 0 && t == last) {", "  if (false) {")
    pk, _ = _gemv(512, 1024, 6, 96)
    pk.source_overrides = src   # (read at compile)
    _, dev = _run(pk)
    tags = tagged.tags(dev["y"])
    assert int(dev["pool"][0]) != 0
    assert (tags[-96:] != tags[0]).all() and (tags[:-96] == tags[0]).all()


def test_the_llama_step_with_tails_gives_the_same_bits():
    """A tiny decode step with gate_up's, down's and the LM head's tails (tiles gate_up_tail, down_tail, lm_tail),
    through the weight stream and x in pieces: every tensor of two steps (the logits and tokens too) equals the
    untailed step's, and the counters are back to zero."""
    from megart.models import llama
    from megart.models.llama_config import clone_kv
    cfg = llama.tiny().with_(name="tiny_ffn1k", ffn=1024)
    defines = {"MEGART_STREAM_SLOTS": 8, "MEGART_STREAM_STAGE": 64}

    def steps(tiles):
        m = llama.LlamaModel(cfg, device="cpu", nw=4, kv=clone_kv(llama.make_kv_cache(cfg, 1)), defines=defines,
                             tiles=tiles)
        torch.manual_seed(0)
        return m, {k: v.clone() for k, v in hostsim.run(m.pk, steps=STEPS).items()}
    _, plain = steps({})
    m, tailed = steps({"gate_up_tail": 37, "down_tail": 38, "lm_tail": 100})
    pools = [k for k in tailed if k.endswith("_pool")]
    assert len(pools) == 2 * cfg.layers + 1 and all(int(tailed[k][0]) == 0 for k in pools)
    for k, v in plain.items():   # (the LM head's partials hold other rows; their argmax, the token, is the same)
        if k not in ("part_val", "part_idx"):
            assert torch.equal(tailed[k], v), k


def test_bad_tails_are_named():
    pk = kernel(4)
    x = pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "x")
    w = pk.tensor(torch.zeros(16, 64, dtype=torch.bfloat16), "w")
    y = pk.tensor(tagged.empty(16), "y", tagged=True)
    pool = pk.tensor(torch.zeros(1, dtype=torch.int32), "pool")
    cases = [
        (dict(tail=4), "tail needs pool"),
        (dict(pool=pool), "give it with tail > 0"),
        (dict(tail=3, pool=pool), "whole row pairs"),
        (dict(tail=16, pool=pool), "tail must be an int in \\[1, 16\\)"),
        (dict(tail=4, pool=pk.tensor(torch.zeros(2, dtype=torch.int32), "pool2")), "pool must be one i32 counter"),
        (dict(tail=4, pool=pk.tensor(torch.zeros(1), "pool_f32")), "pool must be one i32 counter"),
        (dict(tail="4", pool=pool), "tail must be an int"),
    ]
    for kw, msg in cases:
        with pytest.raises(GraphError, match=msg):
            pk.task("gemv_m1", y=y, w=w, x=x, **kw)
    with pytest.raises(GraphError, match="needs tagged outputs"):
        pk.task("gemv_m1", y=pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y_plain"), w=w, x=x, tail=4, pool=pool)
    w8 = pk.tensor(torch.zeros(16, 64, dtype=torch.float8_e4m3fn), "w8")
    with pytest.raises(GraphError, match="unexpected keyword argument 'tail'"):
        pk.task("gemv_m1_fp8", y=y, w=w8, scale=pk.tensor(torch.ones(16), "s"), x=x, tail=4, pool=pool)
    with pytest.raises(GraphError, match="built for gate_up_silu only"):
        pk.task("gate_up_silu_fp8", h=y, w_gate=w8, w_up=w8, s_gate=pk.graph.tensors["s"], s_up=pk.graph.tensors["s"],
                x=x, tail=4, pool=pool)
    assert not pk.graph.instances
    assert "pool" not in {p.name for p in megart.registry.get("gate_up_silu_fp8").params}   # (no tail there)


@pytest.mark.parametrize("tie", [False, True])
def test_the_lm_heads_tail_gives_the_same_token_and_logits(tie):
    """lm_head_argmax with a tail: the claimed rows' logits are stored and their argmax joins the claimer's
    partial, so the logits and the token equal the untailed head's (the partials may differ); with the largest
    logit tied between a static row and a tail row, the lower row wins in both runs."""
    v, d, tiles, tail = 1000, 264, 7, 140
    w, x = geo.dense_m1(v, d, seed=5)
    if tie:
        w[900] = w[3] = torch.sign(x).to(w.dtype) * w.abs().max()   # the same row twice: the same dot, the largest
    runs = []
    for t in (0, tail):
        pk = kernel(8)
        parts = min(tiles, v - t)
        pv, pi = pk.tensor(torch.zeros(parts), "pv"), pk.tensor(torch.zeros(parts, dtype=torch.int32), "pi")
        pool = pk.tensor(torch.zeros(1, dtype=torch.int32), "pool") if t else None
        pk.task("lm_head_argmax", w=pk.tensor(w, "w"), x=pk.tensor(x, "x"), part_val=pv, part_idx=pi,
                logits=pk.tensor(torch.zeros(v), "logits"), tiles=tiles, tail=t, pool=pool)
        pk.task("argmax_reduce", token=pk.tensor(torch.full((1,), -1, dtype=torch.int32), "token"), part_val=pv,
                part_idx=pi)
        runs.append(_run(pk))
    (emu0, dev0), (emu1, dev1) = runs
    assert torch.equal(dev1["logits"], dev0["logits"])   # (the CUDA body: one dot order whoever claims a row)
    assert torch.allclose(emu1["logits"], emu0["logits"], rtol=1e-5, atol=1e-6)   # (torch's own blocking)
    for tailed, plain in ((emu1, emu0), (dev1, dev0)):
        assert int(tailed["token"][0]) == int(plain["token"][0])
        if tie:
            assert int(tailed["token"][0]) == 3
    assert int(dev1["pool"][0]) == 0
    gate("lm_head_argmax", emu1["logits"], dev1["logits"], w.float() @ x.float())
