"""Tensor parallel on the GPUs of one host (docs/TP.md). Run under torchrun, one process per GPU:

    MEGART_REQUIRE_GPU=1 scripts/tp_run.sh -m pytest -q tests/gpu/test_tp_gpu.py

Every process runs the same tests in the same order (they are collective). Outside torchrun the module is
skipped at collection. Shape: Llama-3.1-8B layers (d 4096, ffn 14336, 32/8 heads, hd 128, vocab 128256,
untied head), 2 layers, random weights: the TP=2 logits match the single-GPU megart model within its gate
at every step of a greedy run, both ranks agree on every token, and a rank whose peer never launches
raises HangError naming the peer event, after which the group runs on cleanly."""
import os

import pytest
import torch

if "LOCAL_RANK" not in os.environ:
    pytest.skip("tensor-parallel GPU tests run under torchrun (scripts/tp_run.sh)", allow_module_level=True)

from megart.errors import HangError  # noqa: E402
from megart.models import llama  # noqa: E402
from megart.models.llama_config import clone_kv  # noqa: E402
from megart.models.llama_tp import LlamaTPRank, reset_group  # noqa: E402
from megart.peer_memory import SymmetricPeers, init_process_group  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 3e-2           # the single-GPU gate (tests/gpu/test_llama_gpu.py)
STEPS = 24


@pytest.fixture(scope="module")
def group():
    rank, world, dev = init_process_group()
    cfg = llama.config("8b").with_(name="llama8b_2l", layers=2, prefill=512, max_seq=640)
    W, kv = llama.make_weights(cfg, 0, dev), llama.make_kv_cache(cfg, 1, dev)
    one = llama.LlamaModel(cfg, W, clone_kv(kv), device=dev)
    tp = LlamaTPRank(cfg, W, kv, peers=SymmetricPeers(device=dev), device=dev, watchdog_s=2.0)
    del W, kv
    torch.cuda.synchronize()
    torch.distributed.barrier()          # ranks start stepping together (peer waits give up after 1 s here)
    yield cfg, rank, world, one, tp
    torch.distributed.barrier()


def test_tp_greedy_matches_single_gpu(group):
    cfg, rank, world, one, tp = group
    lo, hi = tp.vocab_slice
    tok = 11
    for s in range(STEPS):
        l1, t1 = one.step(tok)
        lt, tt = tp.step(tok)            # teacher-forced by the single-GPU tokens, so every step compares
        torch.cuda.synchronize()
        err = llama.relerr(lt, l1[lo:hi])
        mine = torch.tensor([int(tt)], device=lt.device)
        both = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(both, mine)
        assert len({int(b) for b in both}) == 1, f"step {s}: ranks disagree on the token {both}"
        assert err <= TOL, f"rank {rank} step {s}: relerr {err:.4f} > {TOL}"
        tok = int(t1)
    tp.sync()


def test_peer_that_never_launches_is_named(group):
    cfg, rank, world, one, tp = group
    tp.sync()
    reset_group(tp)                       # both ranks from step 1 together
    tp.reset(pos=cfg.prefill, token=5)
    if rank == 0:
        tp.step()
        with pytest.raises(HangError, match=r"peer event") as e:
            tp.sync()
        assert e.value.record["event_name"].startswith("peer L0.o"), e.value.record
    torch.distributed.barrier()           # rank 1 never launched that step
    reset_group(tp)
    tp.reset(pos=cfg.prefill, token=5)
    one.reset(pos=cfg.prefill, token=5)
    lo, hi = tp.vocab_slice
    for _ in range(3):                   # a new run starts cleanly on both ranks
        lt, _ = tp.step()
        l1, _ = one.step()
        torch.cuda.synchronize()
        assert llama.relerr(lt, l1[lo:hi]) <= TOL
    tp.sync()
