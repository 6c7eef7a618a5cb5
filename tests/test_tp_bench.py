"""bench/tp_decode.py's helpers on the CPU (the bench itself needs torchrun and GPUs): the greedy relerr run
against TP=1 megart and the reference, and the per-call-kind summary of a profiled build, here fed by the
emulated TP group and the timing model's spans (megart.emulated_spans), never by measured ones."""
import importlib.util
from pathlib import Path

import pytest

from megart.models import llama
from megart.models.llama_config import clone_kv
from megart.models.llama_tp import LlamaTPGroup
from megart.models.reference import Reference

pytestmark = pytest.mark.usefixtures("cpu_settings")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "tp_decode.py"
NW = 16


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tp_decode_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_greedy_relerr_fields(bench):
    cfg, steps = llama.tiny(), 3
    W, kv = llama.make_weights(cfg, 0), llama.make_kv_cache(cfg, 1)
    one = llama.LlamaModel(cfg, W, clone_kv(kv), device="cpu", nw=NW)
    ins, toks1, l1, lr, errs = bench.greedy_tp1(one, Reference(cfg, W, kv), cfg, 11, steps)
    assert errs == {}
    assert ins[0] == 11 and ins[1:] == toks1[:-1] and len(lr) == steps
    group = LlamaTPGroup(cfg, 2, W, clone_kv(kv), nw=NW)
    l2, toks2 = bench.feed(group.step, ins)
    res = bench.relerr_report(l1, lr, l2, toks1, toks2)
    for k in ("relerr", "relerr_tp1_ref", "relerr_tp2_ref"):
        assert res[k] >= res[k + "_median"] >= 0
    assert res["relerr"] <= 2e-3 and res["relerr_tp1_ref"] <= bench.REF_GATE and res["relerr_tp2_ref"] <= bench.REF_GATE
    assert res["token_agreement"] == res["token_agreement_ref"] == f"{steps}/{steps}"
    assert len(res["relerr_per_step"]["tp2_ref"]) == steps
    # each field compares what its name says: TP=2 given TP=1's logits is TP=1, and a wrong TP=2 shows
    same = bench.relerr_report(l1, lr, l1, toks1, toks1)
    assert same["relerr"] == 0 and same["relerr_tp2_ref"] == res["relerr_tp1_ref"]
    bad = bench.relerr_report(l1, lr, [x.flip(0) for x in l2], toks1, toks2)
    assert bad["relerr_tp2_ref"] > 0.5 and bad["relerr_tp1_ref"] == res["relerr_tp1_ref"]
    # without a reference (the old run's fields only)
    assert "relerr_tp1_ref" in bench.relerr_report(l1, [], l2, toks1, toks2)


def test_error_budget_over_the_greedy_tokens(bench):
    """E and D at the run's shape: each implementation is fed the reference's tokens, and the drop sits far
    above the fp32 spread (the reading the TP=2-vs-TP=1 relerr is measured against)."""
    cfg, steps = llama.tiny(), 3
    W, kv = llama.make_weights(cfg, 0), llama.make_kv_cache(cfg, 1)
    one = llama.LlamaModel(cfg, W, clone_kv(kv), device="cpu", nw=NW)
    budget = bench.error_budget_refs(cfg, W, kv)
    ins, toks1, l1, lr, errs = bench.greedy_tp1(one, Reference(cfg, W, kv), cfg, 11, steps, budget)
    assert set(errs) == {"E_fp32", "E_torch_bf16", "D_skip_last_layer"} and all(len(v) == steps for v in errs.values())
    rep = bench.budget_report(errs)
    assert 0 < rep["E_fp32"]["max"] < 0.05 and rep["D_skip_last_layer"]["min"] > 10 * rep["E_fp32"]["max"]
    assert rep["E_torch_bf16"]["max"] >= rep["E_torch_bf16"]["median"] >= rep["E_torch_bf16"]["min"] > 0
    # the budget's references step on copies of the caches: the reference itself is unchanged by them
    _, _, _, lr2, _ = bench.greedy_tp1(one, Reference(cfg, W, kv), cfg, 11, steps)
    assert all(bool((a == b).all()) for a, b in zip(lr, lr2))


@pytest.mark.parametrize("world", [2, 4])
def test_profile_summary_per_call_kind(bench, world):
    cfg = llama.tiny().with_(n_q=8, n_kv=4)
    group = LlamaTPGroup(cfg, world, nw=NW)
    bw = 4.5e12
    sums = {f"rank{r}": bench.call_summary(m, m.pk.emulated_profile(), bw) for r, m in enumerate(group.ranks)}
    one = llama.LlamaModel(cfg, device="cpu", nw=NW)
    sums = {"tp1": bench.call_summary(one, one.pk.emulated_profile(), bw), **sums}
    for name, s in sums.items():
        kinds = {c["kind"]: c for c in s["calls"]}
        assert s["source"].startswith("EMULATED") and s["step_wall_us"] > 0
        assert {"qkv", "attn", "o", "gate_up", "down", "lm_head", "argmax"} <= set(kinds)   # (attn merges itself)
        assert kinds["o"]["calls"] == kinds["down"]["calls"] == cfg.layers
        assert kinds["gate_up"]["bytes"] > 2 * cfg.ffn // (1 if name == "tp1" else world) * cfg.d * 2
        assert kinds["gate_up"]["floor_us"] == round(kinds["gate_up"]["bytes"] / bw * 1e6, 2)
        if name != "tp1":
            # o_proj's sum is folded into gate_up's staging, down's into the next qkv's (the last layer's
            # stays a call, before the LM head)
            assert "o.sum" not in kinds and kinds["down.sum"]["calls"] == 1
            assert kinds["lm_put"]["calls"] == world - 1
            assert ("o.put" in kinds) == (world > 2)
            if world > 2:        # one kind for the copies to every peer
                assert kinds["o.put"]["calls"] == (world - 1) * cfg.layers
    table = bench.compare_table(sums)
    assert "tp1 wall/slowCTA/wait" in table and f"rank{world - 1} wall/slowCTA/wait" in table and "down.sum" in table
    assert len(table.splitlines()) == 3 + len(dict.fromkeys(c["kind"] for s in sums.values() for c in s["calls"]))
