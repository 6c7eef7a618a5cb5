"""The fused attention merge on the GPU (attention_decode with out and arrivals: the last chunk of each kv head
to finish merges the head's partials): the Llama-1B step writes the same bits with it as with attention_merge
as its own call, leaves every arrival counter at 0, and an abort zeroes counters a step left mid-count.

Run: PYTHONPATH=. MEGART_REQUIRE_GPU=1 python -m pytest -q tests/gpu/test_attention_merge_gpu.py
"""
import pytest
import torch

import megart
from megart.geometry.attention import attention_chunks, attention_m1, attention_scratch
from megart.models import llama
from megart.models.llama_config import clone_kv, make_kv_cache, make_weights

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_fused_and_call_merge_give_the_same_bits_in_the_1b_step(cuda):
    cfg = llama.llama_1b()
    W, kv0 = make_weights(cfg, device="cuda"), make_kv_cache(cfg, device="cuda")
    runs = {}
    for how in ("fused", "call"):
        m = llama.LlamaModel(cfg, W, clone_kv(kv0), attn_merge=how)
        assert m.merge_fused == (how == "fused")
        m.reset(cfg.prefill, token=17)
        runs[how] = m.generate(8).clone(), m.logits.clone(), [k[:, cfg.prefill:cfg.prefill + 8].clone() for k, _ in m.kv]
        if m.merge_fused:
            assert not any(a.any() for a in m.arrivals), "an arrival counter was left non-zero after a step"
        del m
        torch.cuda.empty_cache()
    (t_f, l_f, k_f), (t_c, l_c, k_c) = runs["fused"], runs["call"]
    assert torch.equal(t_f, t_c) and torch.equal(l_f, l_c)
    assert all(torch.equal(a, b) for a, b in zip(k_f, k_c))


def test_an_abort_zeroes_the_arrival_counters(cuda):
    n_q, n_kv, hd, ms, kv_len = 32, 8, 64, 256, 200
    q, k, v = attention_m1(n_q, n_kv, hd, kv_len, ms, seed=0)
    pk = megart.PersistentKernel(nw=16, watchdog_s=0.5)
    T = lambda a, name: pk.tensor(a.to("cuda"), name)  # noqa: E731
    C = attention_chunks(n_kv, ms, pk.nw)
    po, pm = attention_scratch(n_q, n_kv, hd, C, device="cuda")
    arrivals = torch.full((n_kv,), 3, dtype=torch.int32, device="cuda")    # as if a step had stopped mid-count
    pk.task("attention_decode", q=T(q, "q"), k_cache=T(k, "k"), v_cache=T(v, "v"),
            pos=T(torch.tensor([kv_len - 1], dtype=torch.int32), "pos"), part_o=pk.tensor(po, "part_o"),
            part_ml=pk.tensor(pm, "part_ml"), n_q=n_q, n_kv=n_kv, hd=hd,
            out=T(torch.zeros(n_q * hd, dtype=torch.bfloat16), "out"), arrivals=pk.tensor(arrivals, "arrivals"))
    e1, e2 = pk.event("e1"), pk.event("e2")      # two instances that wait on each other: the watchdog fires
    pk.task("noop", waits=[e1], signals=[e2], worker=0)
    pk.task("noop", waits=[e2], signals=[e1], worker=3)
    pk.compile(verify=False)
    with pytest.raises(megart.HangError):
        pk()
    assert not arrivals.any()
