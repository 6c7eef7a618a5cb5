"""Tensor-parallel Llama on the CPU (megart.models.llama_tp, docs/TP.md): the ranks' graphs, emulated
together with shared peer buffers, match the single-GPU megart model and the PyTorch reference; a rank of
the full Llama-3.1-8B shape schedules, verifies and compiles for sm_90a with no spills.

Against the reference the gate is the single-GPU one (TOL 3e-2, tests/test_llama.py). Against the
single-GPU emulated model it is the emulator's (EMU_TOL 2e-3): the row-parallel partials travel in f32 and
the sum is rounded to bf16 once, as one GPU's GEMV rounds, so the two differ only in the f32 summation
order (measured 2e-8 to 6e-5 at this size; with bf16 partials it was 7e-3)."""
import pytest
import torch

from megart.errors import GraphError
from megart.models import llama
from megart.models.llama_config import clone_kv
from megart.models.llama_tp import LlamaTPGroup, LlamaTPRank, empty_shard, fold_set, shard_config
from megart.models.reference import Reference
from megart.peer_memory import HostPeers

TOL = 3e-2
EMU_TOL = 2e-3
NW = 16

pytestmark = pytest.mark.usefixtures("cpu_settings")


@pytest.mark.parametrize("shape,world", [("tiny", 2), ("features", 2), ("tiny4", 4)])
def test_tp_matches_single_gpu_model_and_reference(shape, world):
    """TP=2 pushes partials from the GEMV itself; TP=4 through peer_copy calls, one per peer."""
    cfg = llama.tiny()
    if shape == "features":      # GQA group 3, head_dim 128, untied head, Qwen3 q/k norm
        cfg = cfg.with_(name="tiny_features", n_q=6, n_kv=2, hd=128, tied=False, qk_norm=True, eps=1e-6)
    if shape == "tiny4":
        cfg = cfg.with_(name="tiny4", n_q=8, n_kv=4)
    W, kv = llama.make_weights(cfg, 0), llama.make_kv_cache(cfg, 1)
    group = LlamaTPGroup(cfg, world, W, clone_kv(kv), nw=NW)
    puts = [k for k in group.ranks[0].groups if ".put" in k]       # layer all-reduces through peer_copy
    assert bool(puts) == (world > 2)
    one = llama.LlamaModel(cfg, W, clone_kv(kv), device="cpu", nw=NW)
    ref = Reference(cfg, W, clone_kv(kv))
    tok = 7
    for s in range(3):
        pos = cfg.prefill + s
        logits, token = group.step(tok)
        l1, t1 = one.step(tok)
        lr = ref.step(tok, pos)
        e1, er = llama.relerr(logits, l1), llama.relerr(logits, lr)
        assert e1 <= EMU_TOL and er <= TOL, f"step {s}: relerr vs megart {e1:.2e}, vs reference {er:.2e}"
        assert int(token) == int(t1) == int(torch.argmax(logits))
        for r, m in enumerate(group.ranks):      # the KV rows this rank appended are its heads' rows
            h = cfg.n_kv // world
            for l in range(cfg.layers):
                got, want = m.kv[l][0][:, pos], one.kv[l][0][r * h:(r + 1) * h, pos]
                assert llama.relerr(got, want) <= TOL
        tok = int(token)


@pytest.mark.parametrize("world", [2, 4])
def test_folded_sums_match_the_sum_calls_bit_for_bit(world):
    """o_proj's all-reduce summed in gate_up's x staging and down's in the next layer's qkv (the default)
    instead of tp_sum_f32 calls: two calls fewer per layer (the last layer's down sum stays a call, before the
    LM head), and the same logits to the bit (the same f32 additions in rank order, one rounding)."""
    cfg = llama.tiny() if world == 2 else llama.tiny().with_(name="tiny4", n_q=8, n_kv=4)
    W, kv = llama.make_weights(cfg, 0), llama.make_kv_cache(cfg, 1)
    runs = {}
    for fold in (True, ("o",), ("down",), False):
        group = LlamaTPGroup(cfg, world, W, clone_kv(kv), nw=NW, fold_sums=fold)
        sums = [k for k in group.ranks[0].groups if k.endswith(".sum")]
        folds = fold_set(fold)
        assert sum(k.endswith("o.sum") for k in sums) == (0 if "o" in folds else cfg.layers)
        assert sum(k.endswith("down.sum") for k in sums) == (1 if "down" in folds else cfg.layers)
        tok, runs[fold] = 7, []
        for _ in range(2):
            logits, token = group.step(tok)
            runs[fold].append(logits.clone())
            tok = int(token)
    for fold in (("o",), ("down",), False):
        assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[fold])), fold
    with pytest.raises(GraphError, match="fold_sums"):
        fold_set(("qkv",))


def test_tp_rejects_shapes_it_cannot_split():
    with pytest.raises(GraphError, match="n_kv .* divisible by 4"):
        shard_config(llama.tiny(), 4)
    with pytest.raises(GraphError, match="bf16"):
        shard_config(llama.config("tiny_fp8"), 2)
    with pytest.raises(GraphError, match="LM"):
        shard_config(llama.config("tiny_block"), 2)
    group = LlamaTPGroup(llama.tiny(), 2, nw=4)
    with pytest.raises(GraphError, match="LlamaTPGroup.step"):
        group.ranks[0].step(3)
    with pytest.raises(ValueError, match="gate_up_parts"):
        LlamaTPGroup(llama.tiny(), 2, nw=4, tiles={"gate_up_parts": 2})


def test_llama8b_rank_compiles_clean():
    """Rank 0 of Llama-3.1-8B at TP=2 on the production grid: the MEGART_TP kernel, 0 spill bytes."""
    cfg = llama.config("8b")
    W, kv = empty_shard(cfg, 2)
    peers = HostPeers(2).rank(0)
    m = LlamaTPRank(cfg, W, kv, peers=peers, device="cpu", nw=132, sm_count=132, init="empty")
    r = m.pk.report
    assert "#define MEGART_TP 2" in m.pk.source.text
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    spills = [ln for ln in m.pk.compiled.log.splitlines() if "spill" in ln]   # the kernel and gemv_partial
    assert len(spills) >= 2 and all("0 bytes spill stores, 0 bytes spill loads" in ln for ln in spills), spills
    assert m.pk.occupancy.per_sm >= 1
    assert m.chunks == 16                                    # "match": TP=1's 132 // 8 kv heads
    assert m.merge_fused and m.pk.stream_layout().slots > 0  # the fused merge and the weight stream, as at TP=1
    peers_events = [e for e in m.pk.schedule.events if e.peer]
    assert len(peers_events) == 2 * cfg.layers + 1
    assert m.bytes_per_step() < cfg.bytes_per_step() * 0.55
