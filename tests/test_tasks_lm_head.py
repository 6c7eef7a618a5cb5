"""The LM head and its argmax on the CPU (tasks/dense_matvec.py: lm_head_argmax, lm_head_argmax_fp8,
argmax_reduce): the logits gated as every dense type is (tests/dense_checks.py), the token the argmax of the
stored logits with ties to the lowest row and NaN as -inf, the greedy log, and bad shapes refused."""
from __future__ import annotations

import pytest
import torch

from megart import GraphError
from megart.geometry import dense as geo

from dense_checks import LLAMA1B, NW, bf16, gate, kernel, run


# ---- lm_head_argmax + argmax_reduce -----------------------------------------------------------------------
def _lm_kernel(w, x, g, tiles, logits=True, nw=NW, scale=None):
    """The LM head then argmax_reduce; with `scale`, w is an e4m3 head and lm_head_argmax_fp8 runs it."""
    pk = kernel(nw)
    v = w.shape[0]
    parts = min(tiles, v)
    W, X = pk.tensor(w, "w"), pk.tensor(x, "x")
    PV, PI = pk.tensor(torch.zeros(parts), "pv"), pk.tensor(torch.zeros(parts, dtype=torch.int32), "pi")
    L = pk.tensor(torch.zeros(v), "logits") if logits else None
    T = pk.tensor(torch.full((1,), -1, dtype=torch.int32), "token")
    fp8 = {} if scale is None else {"scale": pk.tensor(scale, "s")}
    pk.task("lm_head_argmax" if scale is None else "lm_head_argmax_fp8", w=W, x=X, part_val=PV, part_idx=PI,
            logits=L, norm_weight=pk.tensor(g, "g") if g is not None else None, eps=1e-5, tiles=tiles, **fp8)
    pk.task("argmax_reduce", token=T, part_val=PV, part_idx=PI)
    return pk


@pytest.mark.parametrize("v,d,tiles,norm", [
    pytest.param(16384, 2048, 132, True, id="1b-d-16k-vocab"),
    pytest.param(8192, 4096, 132, False, id="8b-d"),
    pytest.param(1001, 264, 7, True, id="odd"),
])
def test_lm_head_argmax(v, d, tiles, norm):
    w, x = geo.dense_m1(v, d, seed=v + d)
    g = geo.norm_weight(d, seed=2) if norm else None
    emu, dev = run(_lm_kernel(w, x, g, tiles))
    ref = geo.ref_lm_head(w, x, norm_weight=g)
    drop = geo.ref_lm_head(w, x, norm_weight=torch.ones_like(g)) if norm else None
    gate("lm_head_argmax", emu["logits"], dev["logits"], ref, drop)
    for out in (emu, dev):
        # the token is exactly the argmax of the logits the same run stored; the reference's up to near-ties
        tok = int(out["token"][0])
        assert tok == int(torch.argmax(out["logits"]))
        assert ref[tok] >= ref.max() - 1e-2 * ref.abs().max()
        # each partial is the max of its tile
        assert torch.equal(out["pv"], out["logits"][out["pi"].long()])


@pytest.mark.parametrize("at", [3, 0, 7, 8, -1])
def test_argmax_reduce_records_the_token_in_history(at):
    """With history and pos, argmax_reduce also writes history[pos[0]] = token (pos inside the history) and
    nothing else of it; both the emulator and the CUDA body on the host."""
    pk = kernel(2)
    pv = torch.tensor([0.5, 2.0, float("nan"), 2.0, -1.0])
    pi = torch.tensor([10, 40, 3, 20, 7], dtype=torch.int32)
    T = pk.tensor(torch.full((1,), -1, dtype=torch.int32), "token")
    H = pk.tensor(torch.full((8,), -2, dtype=torch.int32), "history")
    P = pk.tensor(torch.tensor([at], dtype=torch.int32), "pos")
    pk.task("argmax_reduce", token=T, part_val=pk.tensor(pv, "pv"), part_idx=pk.tensor(pi, "pi"), history=H, pos=P)
    want = torch.full((8,), -2, dtype=torch.int32)
    if 0 <= at < 8:
        want[at] = 20                      # the largest value, 2.0, its lowest index (ties), NaN as -inf
    for out in run(pk):
        assert int(out["token"][0]) == 20
        assert torch.equal(out["history"], want)
    k2 = kernel(2)
    with pytest.raises(GraphError, match="history and pos go together"):
        k2.task("argmax_reduce", token=k2.tensor(torch.zeros(1, dtype=torch.int32), "t"),
                part_val=k2.tensor(pv, "pv"), part_idx=k2.tensor(pi, "pi"),
                history=k2.tensor(torch.zeros(8, dtype=torch.int32), "h"))


@pytest.mark.parametrize("v,d,tiles,norm", [
    pytest.param(16384, 2048, 132, True, id="1b-d-16k-vocab"),
    pytest.param(1001, 272, 7, False, id="odd"),
])
def test_lm_head_argmax_fp8(v, d, tiles, norm):
    """The e4m3 head with per-row scales (half the bytes): logits = scale * (W8 x), the same argmax rules."""
    w, x = geo.dense_m1(v, d, seed=v + d + 1)
    w8, s = geo.quantize_fp8_per_channel(w)
    g = geo.norm_weight(d, seed=2) if norm else None
    emu, dev = run(_lm_kernel(w8, x, g, tiles, scale=s))
    xs = geo.ref_rmsnorm(x, g) if norm else x.float()
    ref = (w8.float() @ xs) * s
    drop = w8.float() @ xs                                                     # the scales forgotten
    gate("lm_head_argmax_fp8", emu["logits"], dev["logits"], ref, drop)
    for out in (emu, dev):
        assert int(out["token"][0]) == int(torch.argmax(out["logits"]))
        assert torch.equal(out["pv"], out["logits"][out["pi"].long()])
    assert geo.relerr(ref, geo.ref_lm_head(w, x, norm_weight=g)) < 0.1      # quantisation stays small
    bad = kernel(4)
    with pytest.raises(GraphError, match="scale"):
        bad.task("lm_head_argmax_fp8", w=bad.tensor(w8, "w8"), x=bad.tensor(x, "x"), scale=bad.tensor(s[:-1].clone(), "s"),
                 part_val=bad.tensor(torch.zeros(4), "pv"), part_idx=bad.tensor(torch.zeros(4, dtype=torch.int32), "pi"),
                 tiles=4)


def test_lm_head_without_logits_and_ties():
    """Two identical best rows in different tiles: the token is the lower index (both here and on the GPU,
    where identical rows give bit-identical sums)."""
    v, d = 999, 128
    w, x = geo.dense_m1(v, d, seed=9)
    best = bf16(x.float() / x.float().norm() * 3)            # a row well aligned with x
    w[100], w[800] = best, best
    for out in run(_lm_kernel(w, x, None, tiles=9, logits=False)):
        assert int(out["token"][0]) == 100
        assert int(out["pi"][0]) == 100 and int(out["pi"][7]) == 800


def test_argmax_reduce_ties_and_nan():
    pk = kernel(4)
    vals = torch.tensor([1.0, float("nan"), 5.0, 5.0, -float("inf"), 5.0, 2.0])
    idx = torch.tensor([10, 3, 70, 40, 1, 55, 2], dtype=torch.int32)
    T = pk.tensor(torch.zeros(1, dtype=torch.int32), "t")
    pk.task("argmax_reduce", token=T, part_val=pk.tensor(vals, "pv"), part_idx=pk.tensor(idx, "pi"))
    for out in run(pk):
        assert int(out["t"][0]) == 40


def test_lm_head_full_vocab_builds():
    """Llama-3.2-1B LM head (128256 x 2048, 525 MB of weights): build + compile + verify only."""
    v, d = LLAMA1B["vocab"], LLAMA1B["d"]
    w = torch.empty(v, d, dtype=torch.bfloat16)
    x = torch.zeros(d, dtype=torch.bfloat16)
    pk = _lm_kernel(w, x, torch.ones(d, dtype=torch.bfloat16), tiles=264)
    pk.compile()
    assert pk.report.spill_bytes == 0
    insts = [i for i in pk.graph.instances if i.type.name == "lm_head_argmax"]
    assert len(insts) == 264 and sum(i.params["n"] for i in insts) == v
    assert max(i.params["n"] for i in insts) - min(i.params["n"] for i in insts) <= 1
    red = [i for i in pk.graph.instances if i.type.name == "argmax_reduce"][0]
    assert set(red.deps) == {i.uid for i in insts}


def test_lm_head_rejects():
    pk = kernel(4)
    W = pk.tensor(torch.zeros(100, 64, dtype=torch.bfloat16), "w")
    X = pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "x")
    PV, PI = pk.tensor(torch.zeros(4), "pv"), pk.tensor(torch.zeros(4, dtype=torch.int32), "pi")
    with pytest.raises(GraphError, match="one entry per instance"):
        pk.task("lm_head_argmax", w=W, x=X, part_val=PV, part_idx=PI, tiles=5)
    with pytest.raises(GraphError, match="vocabulary"):
        pk.task("lm_head_argmax", w=W, x=X, part_val=PV, part_idx=PI, logits=pk.tensor(torch.zeros(99), "l"),
                tiles=4)
    with pytest.raises(GraphError, match="needs f32"):
        pk.task("lm_head_argmax", w=W, x=X, part_val=pk.tensor(torch.zeros(4, dtype=torch.bfloat16), "pvb"),
                part_idx=PI, tiles=4)
