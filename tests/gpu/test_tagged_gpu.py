"""Tagged tensors on the GPU (megart/tagged.py): the Llama step with its vectors tagged gives the same bits as
the step with plain vectors and event waits, step after step; a polled read whose writer never stores the
tag ends in HangError naming the poll, and the kernel runs again after the reset."""
import pytest
import torch

import megart
from megart import tagged
from megart.layout import step_tag
from megart.models import llama
from megart.models.llama_config import clone_kv

pytestmark = pytest.mark.gpu


def _inputs(name, cuda):
    """(config, weights, KV prefix, steps): the tiny model for 24 steps or the 1B shape for 8."""
    cfg = llama.tiny() if name == "tiny" else llama.llama_1b()
    return cfg, llama.make_weights(cfg, 0, cuda), llama.make_kv_cache(cfg, 1, cuda), 24 if name == "tiny" else 8


def _decode(cfg, W, prefix, steps, **model_kw):
    """`steps` greedy steps from the prefix: (logits, tokens, the KV caches, the model)."""
    m = llama.LlamaModel(cfg, W, clone_kv(prefix), **model_kw)
    m.reset(cfg.prefill, 3)
    logits, tokens = [], []
    for _ in range(steps):
        lg, tok = m.step()
        logits.append(lg.clone())
        tokens.append(tok.clone())
    m.sync()
    return torch.stack(logits), torch.cat(tokens), [kv.clone() for pair in m.kv for kv in pair], m


@pytest.mark.parametrize("name", ["tiny", "1b"])
def test_tagged_step_gives_the_plain_steps_bits(name, cuda):
    inputs = _inputs(name, cuda)
    runs = {}
    for tg in (False, True):
        *runs[tg], m = _decode(*inputs, tagged=tg)
        if tg:   # every tagged vector carries the last step's tag
            last = step_tag(m.pk.step)
            for t in m.pk.graph.tagged_tensors():
                assert set(tagged.tags(t.data).unique().tolist()) == {last}, t.name
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))


@pytest.mark.parametrize("name", ["tiny", "1b"])
def test_tagged_attention_gives_the_event_steps_bits(name, cuda):
    """tagged_attn: qkv -> attention through tagged q and new K/V rows (kv_commit appends the rows after the LM
    head): logits, tokens and both caches equal the step where attention waits on qkv's events."""
    inputs = _inputs(name, cuda)
    runs = {ta: _decode(*inputs, tagged_attn=ta)[:3] for ta in (False, True)}
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1], runs[False][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))


def test_a_poll_that_never_sees_its_tag_raises_hang_error(cuda, tmp_path):
    src = tmp_path / "forgets_tag.cuh"   # declares a tagged output and stores nothing
    src.write_text("__device__ __forceinline__ void megart_task_forgets_tag(const megart_params_forgets_tag&, char*) {}\n")
    try:
        megart.registry.get("forgets_tag")
    except megart.RegistryError:
        megart.register_task("forgets_tag", 1998, [megart.registry.ptr("y", "bf16", "out", tagged=True)], src,
                             reference=lambda p: None)
    pk = megart.PersistentKernel(nw=4, watchdog_s=0.5)
    x = pk.tensor(tagged.empty(256, cuda), "x", tagged=True)
    pk.task("forgets_tag", y=x, worker=0)
    y = pk.tensor(torch.zeros(64, dtype=torch.bfloat16, device=cuda), "y")
    w = pk.tensor(torch.ones(64, 256, dtype=torch.bfloat16, device=cuda), "w")
    pk.task("gemv_m1", y=y, w=w, x=x, tiles=2)
    pk.compile()
    with pytest.raises(megart.HangError, match="tagged words polled") as ei:
        pk()
    rec = ei.value.record
    assert rec["task"] == "gemv_m1" and rec["need"] == step_tag(1) and rec["have"] == 0
    assert not x.data.any()       # the reset zeroed the tagged words
    # the context and the runtime survive: a kernel whose writer stores the tag runs
    ok = megart.PersistentKernel(nw=4)
    xt = ok.tensor(tagged.empty(256, cuda), "x", tagged=True)
    src_x = ok.tensor(torch.full((256,), 0.5, dtype=torch.bfloat16, device=cuda), "src")
    eye = ok.tensor(torch.eye(256, dtype=torch.bfloat16, device=cuda), "eye")
    ok.task("gemv_m1", y=xt, w=eye, x=src_x, tiles=2)
    y2 = ok.tensor(torch.zeros(64, dtype=torch.bfloat16, device=cuda), "y")
    ok.task("gemv_m1", y=y2, w=ok.tensor(torch.ones(64, 256, dtype=torch.bfloat16, device=cuda), "w"), x=xt, tiles=2)
    ok.compile()
    ok(3)
    assert torch.all(tagged.values(xt.data) == 0.5) and torch.all(y2.data == 128.0)
