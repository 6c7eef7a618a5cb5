"""megart.faithful.model_context: the shapes and bytes of a model's calls come from each task type's gate spec
and cost model, never from a table of task names in the context (a new gated task type edits neither)."""
import ast
from pathlib import Path

import pytest

from megart import registry
from megart.faithful import model_context
from megart.faithful.model_context import LlamaContext
from megart.faithful.run import GateConfig, prepare
from megart.models.llama import LlamaModel
from megart.models.llama_config import config

GATED = ("gemv_m1", "gemv_m1_fp8", "gate_up_silu", "qkv_rope_append", "attention_decode", "attention_merge")


def _model(key: str):
    cfg = config(key)
    m = LlamaModel(cfg, device="cpu", init="empty", nw=132, sm_count=132, compile=False)
    m.pos.fill_(cfg.prefill)       # the device state after a timed step at pos = prefill (pos_advance wrote it)
    return m


def _expected(m, task: str, label: str):
    """(shape, bytes) of one call, written out by hand from what the call must read and write (weights, the
    activation in, the output and a residual; attention: the KV rows up to the position), independently of the
    cost models, so a drift in either side fails."""
    c = m.cfg
    kind = label.split(".", 1)[1]
    if task in ("gemv_m1", "gemv_m1_fp8"):
        n, k = {"o": (c.d, c.n_q * c.hd), "down": (c.d, c.ffn), "gate_up_gemv": (2 * c.ffn, c.d)}[kind]
        w = n * k * (1 + (task == "gemv_m1"))                   # e4m3 weights are 1 byte
        scale = n * 4 if task == "gemv_m1_fp8" else 0
        res = n * 2 if kind in ("o", "down") else 0            # o_proj and down_proj add the residual stream
        norm = k * 2 if kind == "gate_up_gemv" else 0           # the fused post-attention RMSNorm reads its gain
        return (n, k), w + scale + k * 2 + n * 2 + res + norm
    if task == "gate_up_silu":
        return (c.ffn, c.d), 2 * c.ffn * c.d * 2 + c.d * 2 + c.d * 2 + c.ffn * 2     # + x, its norm gain, h
    if task == "qkv_rope_append":
        rows = (c.n_q + 2 * c.n_kv) * c.hd
        head_norms = 2 * c.hd * 2 if c.qk_norm else 0
        return ((c.d, c.n_q, c.n_kv, c.hd, c.prefill),
                rows * c.d * 2 + 2 * c.d * 2 + head_norms + c.n_q * c.hd * 2 + 2 * c.n_kv * c.hd * 2)
    merge = c.n_q * m.chunks * (c.hd + 2) * 4 + c.n_q * c.hd * 2     # the partials in, the merged outputs out
    if task == "attention_decode":
        L = c.prefill + 1
        fused = merge if m.merge_fused else 0                            # the call merges its own partials
        return (c.n_q, c.n_kv, c.hd, L), 2 * c.n_kv * L * c.hd * 2 + c.n_q * c.hd * 2 + fused
    assert task == "attention_merge"
    return (c.n_q, c.n_kv, c.hd, m.chunks), merge


@pytest.mark.parametrize("key", ["1b", "1b_fp8", "1b_fp8_split", "qwen3_0.6b", "tiny"])
def test_call_shapes_and_bytes_at_the_model_shapes(key):
    m = _model(key)
    ctx = LlamaContext(f"llama_{key}", key)
    seen = set()
    for task in GATED:
        if task not in {g.type.name for g in m.groups.values()}:
            continue
        p = prepare(GateConfig(task=task, context=ctx.name))
        for shape, groups in ctx.calls_by_shape(p, m).items():
            for label, g in groups:
                want_shape, want_bytes = _expected(m, task, label)
                assert shape == want_shape, (task, label)
                assert g.cost().bytes == want_bytes, (task, label)
            assert ctx.call_bytes(p, m, groups, m.cfg.prefill) == want_bytes, (task, shape)
            seen.add(task)
    fp8 = m.cfg.wdtype == "fp8"
    absent = ({"gemv_m1", "gate_up_silu"} if fp8 else {"gemv_m1_fp8"}) | ({"attention_merge"} if m.merge_fused else set())
    assert seen == set(GATED) - absent


def test_call_bytes_refuse_a_device_pos_other_than_the_timed_one():
    m = _model("tiny")
    ctx = LlamaContext("llama_tiny", "tiny")
    p = prepare(GateConfig(task="attention_decode", context=ctx.name))
    (groups,) = ctx.calls_by_shape(p, m).values()
    m.pos.fill_(0)
    with pytest.raises(RuntimeError, match="device pos is 0, not the timed position 40"):
        ctx.call_bytes(p, m, groups, m.cfg.prefill)


def test_model_context_names_no_task_type():
    """The context reaches each task through its declaration (gate spec, cost model), so no task name appears
    in it as a string: a new gated task type needs no edit here."""
    tree = ast.parse(Path(model_context.__file__).read_text())
    names = set(registry.names_by_id().values())
    found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names}
    assert not found, f"model_context.py branches on task names {sorted(found)}"
