"""The weight stream (megart/stream.py, csrc/weight_stream.cuh) without a GPU: its sizing, the code generated
for it, its hang codes, and the host simulation catching a producer and consumers that disagree. (Its
outputs against the other engines: tests/test_tasks_dense.py::test_weight_engines_are_bit_identical...)"""
import pytest
import torch

import megart
from megart import codegen, registry, stream
from megart.config import KernelConfig
from megart.errors import ConfigError, GraphError, ResidencyError
from megart.geometry import dense as geo
from megart.emulate import hostsim as dense_hostsim
from test_dense_engines import STREAM, _broken, _one_gemv

DENSE = ("gemv_m1", "gemv_m1_fp8", "gate_up_silu", "lm_head_argmax")


def _types(*names):
    return [registry.get(n) for n in names]


def test_off_unless_asked_for_and_on_in_the_decode_models():
    """A PersistentKernel keeps registers unless asked; "auto" takes the shared memory the types leave (6 slots
    of 4 KB per warp after the 33 KB x staging); two CTAs per SM leave no room. The decode models ask for
    "auto" unless the caller's defines or MEGART_DEFINES choose."""
    assert stream.layout(_types(*DENSE), KernelConfig()).slots == 0
    assert stream.layout(_types(*DENSE), KernelConfig(defines={"MEGART_STREAM_SLOTS": 0})).slots == 0
    lay = stream.layout(_types(*DENSE), KernelConfig(defines={"MEGART_STREAM_SLOTS": "auto"}))
    assert (lay.slots, lay.slot_bytes, lay.offset, set(lay.types)) == (6, 4096, 33024, set(DENSE))
    assert stream.layout(_types(*DENSE), KernelConfig(min_blocks=2, defines={"MEGART_STREAM_SLOTS": "auto"})).slots == 0
    from megart.models import llama
    assert llama.stream_default(None) == {"MEGART_STREAM_SLOTS": "auto"}
    assert llama.stream_default({"MEGART_STREAM_SLOTS": 0}) == {}


def test_auto_depth_follows_the_shared_memory_left():
    """Beside attention's 64 KB K/V ring: 5 slots of 4 KB at 256 threads; 2 at 512 (attention keeps registers
    there, but 16 warps' stream state and barriers leave 700 B too few for a third); 8 KB stages: 2; every
    layout fits the block's shared memory."""
    auto = {"MEGART_STREAM_SLOTS": "auto"}
    with_attn = stream.layout(_types("gemv_m1", "qkv_rope_append", "attention_decode"), KernelConfig(defines=auto))
    assert (with_attn.slots, with_attn.types) == (5, ("gemv_m1", "qkv_rope_append"))
    wide = stream.layout(_types("gemv_m1", "attention_decode"), KernelConfig(threads=512, defines=auto))
    big = stream.layout(_types("gemv_m1", "attention_decode"), KernelConfig(defines=auto | {"MEGART_STREAM_STAGE": 256}))
    assert wide.slots == 2 and big.slots == 2
    for lay, threads in ((with_attn, 256), (wide, 512), (big, 256)):
        cfg = KernelConfig(threads=threads, defines=auto)
        assert lay.offset + lay.ring_bytes(threads) <= stream.SMEM_PER_BLOCK - stream.static_reserve(cfg, lay.slots)
        # each slot's two mbarriers per warp are static memory: a deeper ring leaves less room beside it
        assert stream.static_reserve(cfg, 6) - stream.static_reserve(cfg, 5) == 16 * threads // 32


def test_attention_k_v_on_the_stream_only_when_asked():
    """MEGART_STREAM_KV=1 (with the stream on) puts attention_decode on the stream in its "kv" format: its own
    64 KB ring is off then (its instances keep the merge's shared memory and, past it, the staged row), and
    each warp's pos is static memory the ring is sized against. Without the stream, or by default, attention
    keeps its ring."""
    from megart.tasks.attention import NEW_ROW_BYTES, SMEM_ATTN_MERGE
    from megart.tasks.attention_ring import attn_ring_bytes
    types = _types("gemv_m1", "qkv_rope_append", "attention_decode")
    on = KernelConfig(defines={"MEGART_STREAM_SLOTS": "auto", "MEGART_STREAM_KV": 1})
    lay = stream.layout(types, on)
    assert lay.types == ("gemv_m1", "qkv_rope_append", "attention_decode") and lay.slots == 5
    assert attn_ring_bytes(on) == 0
    assert registry.get("attention_decode").shared_bytes(on) == SMEM_ATTN_MERGE + NEW_ROW_BYTES
    assert stream.static_reserve(on, 5) == stream.static_reserve(KernelConfig(), 5) + 8 * stream.KV_POS_STATIC
    assert lay.offset + lay.ring_bytes(256) <= stream.SMEM_PER_BLOCK - stream.static_reserve(on, lay.slots)
    for cfg in (KernelConfig(defines={"MEGART_STREAM_SLOTS": "auto"}), KernelConfig(defines={"MEGART_STREAM_KV": 1}),
                KernelConfig(defines={"MEGART_STREAM_SLOTS": "auto", "MEGART_STREAM_KV": 0})):
        assert not stream.kv_streamed(cfg) and attn_ring_bytes(cfg) == 64 * 1024
        assert "attention_decode" not in stream.layout(types, cfg).types
    # a candidate attention body is not streamed (it need not read the stream's stages)
    assert "attention_decode" not in stream.layout(types, on, {"attention_decode": "/x/cand.cuh"}).types
    src = codegen.generate(types, on).text
    assert "return megart_attn::kv_stream_open(p, ws, warp);" in src
    assert "if (ws.format == 0) return dense_stage_next(ws, warp, slot);" in src
    assert "return megart_attn::kv_stage_next(ws, warp, slot);" in src


def test_a_k_v_stage_too_small_for_attentions_batches_is_named():
    """At 128 threads attention's ring reads 4 positions per batch; a 2 KB stage holds 2 steps of a warp's rows:
    refused before NVRTC (the device code static_asserts the same)."""
    types = _types("gemv_m1", "attention_decode")
    small = {"MEGART_STREAM_SLOTS": 2, "MEGART_STREAM_KV": 1, "MEGART_STREAM_STAGE": 64}
    with pytest.raises(GraphError, match="MEGART_STREAM_STAGE=64 at 128 threads"):
        stream.layout(types, KernelConfig(threads=128, defines=small))
    assert "attention_decode" in stream.layout(types, KernelConfig(threads=256, defines=small)).types


def test_an_unknown_stream_format_is_named():
    bad = registry.get("gemv_m1").__class__(**{**registry.get("gemv_m1").__dict__, "stream_format": "rows"})
    with pytest.raises(ValueError, match="stream_format 'rows'"):
        codegen.stream_open([bad])


def test_the_tagged_attention_form_stages_its_new_row_past_the_ring_and_the_compiled_merge():
    """attention_decode's tagged form (MEGART_ATTN_TAGGED, set from the graph) stages the new K/V row in the
    instance's shared memory, past the K/V ring (copied into it while the ring is read) and the merge scratch
    of the compiled shapes (written once the row is dead); no static memory, so the stream's reserve is the
    plain form's. Where the compiled merge is smaller than a 32 KB ring (hd 64, 4-wide instances: 8,448 B) the
    row fits below the any-shape merge floor, and the tagged build keeps the plain one's layout."""
    from megart.tasks import attention as ta
    auto = {"MEGART_STREAM_SLOTS": "auto"}
    types = _types("gemv_m1", "qkv_rope_append", "attention_decode")
    tag = {"MEGART_ATTN_TAGGED": 1}
    assert stream.static_reserve(KernelConfig(defines=tag), 5) == stream.static_reserve(KernelConfig(), 5)
    one_b = {"MEGART_ATTN_RING_BYTES": 32768, **ta.body_defines(64, 4)}
    assert ta.compiled_merge_bytes(KernelConfig(defines=one_b)) == 8448 == ta.merge_bytes(64, 4)
    assert ta.new_row_offset(KernelConfig(defines=one_b)) == 32768
    for extra, plain_offset, tagged_offset in ((one_b, ta.SMEM_ATTN_MERGE, ta.SMEM_ATTN_MERGE),
                                              ({}, 64 * 1024, 64 * 1024 + ta.NEW_ROW_BYTES)):
        plain = stream.layout(types, KernelConfig(defines=auto | extra))
        tagged = stream.layout(types, KernelConfig(defines=auto | extra | tag))
        assert (plain.offset, tagged.offset) == (plain_offset, tagged_offset)
        assert plain.slots == tagged.slots
        for lay, d in ((plain, auto | extra), (tagged, auto | extra | tag)):
            cfg = KernelConfig(defines=d)
            assert lay.offset + lay.ring_bytes(256) <= stream.SMEM_PER_BLOCK - stream.static_reserve(cfg, lay.slots)
    src = codegen.generate(types, KernelConfig(defines=auto | one_b | tag)).text
    assert "#define MEGART_ATTN_NEW_ROW_OFFSET 32768\n" in src
    from megart.models import llama   # the Llama-1B kernels, with and without the tagged edge: six slots
    for tagged_attn in (False, True):
        m = llama.LlamaModel(llama.config("1b"), device="cpu", init="empty", nw=132, sm_count=132,
                             tagged_attn=tagged_attn, compile=False)
        assert (m.pk.stream_layout().slots, m.pk.stream_layout().offset) == (6, ta.SMEM_ATTN_MERGE), tagged_attn


def test_stream_waits_is_a_profiled_diagnostic_apart_from_the_phase_marks(monkeypatch):
    """MEGART_STREAM_WAITS (the profiler's per-warp stream accounting, bench/stream_bench.py --waits, and with 2
    the ring's occupancy, --occupancy) changes a profiled streamed build only, the stamps of 1 take their static
    shared memory from the ring's reserve, and it cannot share the mark words with the phase marks."""
    def cubin(profile, **defines):
        pk = megart.PersistentKernel(nw=4, device="cpu", profile=profile, defines={**STREAM("auto"), **defines})
        T = pk.tensor
        pk.task("gemv_m1", y=T(torch.zeros(64, dtype=torch.bfloat16), "y"),
                w=T(torch.zeros(64, 128, dtype=torch.bfloat16), "w"), x=T(torch.zeros(128, dtype=torch.bfloat16), "x"),
                tiles=4)
        assert pk.stream_layout().slots > 0
        return pk.compile().compiled.cubin
    plain = cubin(False)
    assert cubin(False, MEGART_STREAM_WAITS=1) == plain == cubin(False, MEGART_STREAM_WAITS=2)
    profiled = {cubin(True, **({"MEGART_STREAM_WAITS": w} if w else {})) for w in (0, 1, 2)}
    assert len(profiled) == 3   # (2 counts the ring's stages instead of timing them)
    waits = stream.static_reserve(KernelConfig(defines={"MEGART_STREAM_WAITS": 1}), 5)
    assert waits == stream.static_reserve(KernelConfig(), 5) + 8 * 16
    assert stream.static_reserve(KernelConfig(defines={"MEGART_STREAM_WAITS": 2}), 5) == waits - 8 * 16
    with monkeypatch.context() as env:   # asked for through MEGART_DEFINES, the same reserve
        env.setenv("MEGART_DEFINES", "MEGART_STREAM_WAITS=1")
        assert stream.static_reserve(KernelConfig(), 5) == waits
    with pytest.raises(megart.errors.CompileError, match="MEGART_STREAM_WAITS and MEGART_PHASE_MARKS"):
        cubin(True, MEGART_STREAM_WAITS=1, MEGART_PHASE_MARKS=1)


def test_auto_takes_a_slot_less_when_the_static_memory_outgrows_its_estimate(monkeypatch):
    """"auto" sizes the ring against an estimate of the static shared memory. Where the build's static memory
    comes out larger than that (here the estimate is lowered by 512 bytes: at 12 compute warps and a 32 KB
    attention ring a fourth slot per warp then seems to fit), the deeper build does not fit a CTA, so compile()
    builds a slot less, and that kernel fits."""
    from megart.models import llama
    monkeypatch.setattr(stream, "STATIC_BASE", stream.STATIC_BASE - 512)
    m = llama.LlamaModel(llama.config("1b"), device="cpu", init="empty", nw=132, sm_count=132, threads=384,
                         defines={"MEGART_ATTN_RING_BYTES": 32768}, compile=False)
    assert m.pk.stream_layout().slots == 4
    m.pk.compile()
    assert m.pk.stream_shallower == 3 and m.pk.stream_layout().slots == 3 and m.pk.stream_declined is None
    assert m.pk.report.smem_bytes + m.pk.smem_bytes() <= stream.SMEM_PER_BLOCK
    assert "#define MEGART_STREAM_SLOTS 3" in m.pk.source.text


def test_stage_size():
    """Smaller stages (MEGART_STREAM_STAGE chunks per row): the same bytes in more, smaller slots; the
    kernel is told the slot size; a size the format has no stage for is named."""
    auto = {"MEGART_STREAM_SLOTS": "auto"}
    half = stream.layout(_types(*DENSE), KernelConfig(defines=auto | {"MEGART_STREAM_STAGE": 128}))
    assert (half.slots, half.slot_bytes, half.ring_bytes(256)) == (6, 4096, 8 * 6 * 4096)
    defs = half.defines(256)
    assert defs["MEGART_STREAM_SLOT_BYTES"] == 4096 and defs["MEGART_STREAM_STAGE_CHUNKS"] == 128
    assert stream.layout(_types(*DENSE), KernelConfig(defines=auto | {"MEGART_STREAM_STAGE": 64})).slots == \
        stream.MAX_SLOTS
    for bad in (96, "big", 512):
        with pytest.raises(GraphError, match="MEGART_STREAM_STAGE"):
            stream.layout(_types("gemv_m1"), KernelConfig(defines=auto | {"MEGART_STREAM_STAGE": bad}))


def test_inflight_cap():
    """Stages issued and not yet landed, per warp: 3 by default (below the slot count), 0 when it would not
    bind (the ring caps first), and what the caller asks within 0..slots."""
    five = stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 5}))
    assert five.inflight == stream.DEFAULT_INFLIGHT == 3
    assert five.defines(256)["MEGART_STREAM_INFLIGHT_STAGES"] == 3
    assert stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 3})).inflight == 0
    for asked, got in ((0, 0), (2, 2), (5, 0)):
        lay = stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 5,
                                                                      "MEGART_STREAM_INFLIGHT": asked}))
        assert lay.inflight == got
    for bad in (6, -1, "most"):
        with pytest.raises(GraphError, match="MEGART_STREAM_INFLIGHT"):
            stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 5,
                                                                    "MEGART_STREAM_INFLIGHT": bad}))
    with pytest.raises(ConfigError, match="MEGART_STREAM_INFLIGHT_STAGES"):   # set by megart, not the caller
        megart.PersistentKernel(nw=2, device="cpu", defines={"MEGART_STREAM_INFLIGHT_STAGES": 1})


def test_producer_and_register_split():
    lay = stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 2}))
    assert lay.block_threads(256) == 384 and lay.register_split(256) == (232, 40)
    at_launch = stream.REGS_PER_SM // 384 // 8 * 8          # 168: every thread's share at entry
    assert 256 * 232 + 128 * 40 <= 384 * at_launch           # setmaxnreg.inc would block forever past this
    assert lay.block_threads(96) == 128 and lay.register_split(96) is None      # not whole warpgroups
    inline = stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 2,
                                                                     "MEGART_STREAM_PRODUCER": 0}))
    assert inline.block_threads(256) == 256 and inline.register_split(256) is None


def test_what_is_not_streamed():
    two = {"MEGART_STREAM_SLOTS": 2}
    lay = stream.layout(_types(*DENSE), KernelConfig(defines=two), overrides={"gemv_m1": "/x/cand.cuh"})
    assert "gemv_m1" not in lay.types and "gate_up_silu" in lay.types        # a candidate body need not stream
    assert stream.layout(_types("attention_decode", "copy"), KernelConfig(defines=two)).slots == 0


def test_bad_requests_are_named():
    with pytest.raises(GraphError, match="MEGART_STREAM_SLOTS"):
        stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": "lots"}))
    with pytest.raises(GraphError, match="MEGART_DENSE_RING_SLOTS"):
        stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 2, "MEGART_DENSE_RING_SLOTS": 2}))
    for name, bad in (("MEGART_STREAM_PRODUCER_WARPS", 5), ("MEGART_STREAM_PRODUCER_WARPS", "all"),
                      ("MEGART_STREAM_POLL", 2), ("MEGART_STREAM_PRODUCER", "yes"), ("MEGART_STREAM_FREE", 3)):
        with pytest.raises(GraphError, match=name):
            stream.layout(_types("gemv_m1"), KernelConfig(defines={"MEGART_STREAM_SLOTS": 2, name: bad}))
    one = {"MEGART_STREAM_SLOTS": 2, "MEGART_STREAM_PRODUCER_WARPS": 1, "MEGART_STREAM_POLL": 0}
    assert stream.layout(_types("gemv_m1"), KernelConfig(defines=one)).slots == 2
    too_deep = STREAM(4) | {"MEGART_STREAM_STAGE": 256}                     # 8 warps x 4 x 8 KB + 33 KB
    pk = megart.PersistentKernel(nw=2, device="cpu", defines=too_deep)
    w, x = geo.dense_m1(64, 256, seed=1)
    pk.task("gemv_m1", y=pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "y"), w=pk.tensor(w, "w"),
            x=pk.tensor(x, "x"), tiles=2)
    with pytest.raises(ResidencyError, match="shared memory"):
        pk.compile()


def test_generated_source():
    cfg = KernelConfig(defines={"MEGART_STREAM_SLOTS": 2})
    src = codegen.generate(_types("gemv_m1", "gate_up_silu", "copy"), cfg).text
    for name in ("gemv_m1", "gate_up_silu"):
        t = registry.get(name)
        assert f"struct StreamOn<::{t.struct_name}>" in src
        assert f"case {t.id}: {{" in src and f"return dense::stream_open(plan_{name}(p), ws, warp)" in src
        assert f"case {t.id}: megart_prefetch_{name}(" not in src          # the stream is its prefetch
    assert "StreamOn<::megart_params_copy>" not in src
    assert "#define __syncthreads() megart::cta_sync()" in src
    assert "#define MEGART_BLOCK_THREADS 384" in src and "#define MEGART_COMPUTE_REGS 232" in src
    assert "#define MEGART_PRODUCER_REGS 40" in src
    plain = codegen.generate(_types("gemv_m1"), KernelConfig()).text
    assert "StreamOn<::" not in plain and "#define __syncthreads()" not in plain
    assert "#define MEGART_BLOCK_THREADS 256" in plain


def test_hang_codes_name_the_ring_slot():
    assert "slot 1" in stream.hang_site(-2) and "never landed" in stream.hang_site(-2)
    assert "slot 2" in stream.hang_site(stream.HANG_SLOT_FREE - 2) and "never freed" in stream.hang_site(-1003)
    assert stream.hang_site(-500) == "?"


def test_hostsim_catches_a_producer_that_skips_stages(tmp_path):
    """The producer issues only each warp's first row pair; the consumers then wait on a phase that never
    completes (a hang on the device): reported, not hung and not silently read."""
    pk = _one_gemv(_broken(tmp_path, "  if (!st.live) return false;\n  const long long off",
                           "  if (!st.live || st.k > 0) return false;\n  const long long off"), STREAM(2), n=300)
    with pytest.raises(dense_hostsim.HostSimError, match="never completes"):
        dense_hostsim.run(pk)


def test_hostsim_catches_stages_never_read(tmp_path):
    """The consumers read only their first row pair: the stages issued for the rest are reported."""
    pk = _one_gemv(_broken(tmp_path, "      stream_release(warp, j);\n      ++j;\n      st.next();",
                           "      stream_release(warp, j);\n      ++j;\n      st.next();\n"
                           "      if (st.k > 0) st.live = false;"),
                   STREAM(2), n=300)
    with pytest.raises(dense_hostsim.HostSimError, match="never read"):
        dense_hostsim.run(pk)


@pytest.mark.parametrize("cfg_name", ["tiny", "tiny_features"])
def test_llama_step_streams_every_weighted_projection(cfg_name):
    """A whole tiny decode step under the host simulation: with the stream on, qkv_rope_append streams its
    weights too (per-head q/k norm and GQA group 3 in tiny_features), and every tensor the step writes is
    bit-identical to the register engine's (one matvec engine, the same per-lane chunk order); so with
    attention's K/V on the stream too (MEGART_STREAM_KV=1: the ring's position order, at 4 KB and 2 KB stages)."""
    from megart.models import llama
    from megart.models.llama_config import clone_kv
    from test_llama import FEATURES
    cfg = llama.tiny().with_(name="tiny_features", **FEATURES) if cfg_name == "tiny_features" else llama.tiny()
    prefix = [(k.clone(), v.clone()) for k, v in llama.make_kv_cache(cfg, 1)]
    outs = {}
    # (explicit depths: "auto" may decline the stream of a tiny kernel that spills under the register split)
    variants = (("registers", {"MEGART_STREAM_SLOTS": 0}), ("stream", {"MEGART_STREAM_SLOTS": 5}),
                ("kv", {"MEGART_STREAM_SLOTS": 5, "MEGART_STREAM_KV": 1}))
    if cfg_name == "tiny":   # (the other stage sizes and ways to free a slot once: CI time)
        variants += (("stream8k", {"MEGART_STREAM_SLOTS": 2, "MEGART_STREAM_STAGE": 256}),
                     ("lane0_free", {"MEGART_STREAM_SLOTS": 5, "MEGART_STREAM_FREE": 0}),
                     ("kv_small", {"MEGART_STREAM_SLOTS": 8, "MEGART_STREAM_STAGE": 64, "MEGART_STREAM_KV": 1}))
    for name, defines in variants:
        m = llama.LlamaModel(cfg, device="cpu", nw=4, kv=clone_kv(prefix), defines=defines)
        m.pk.compile()
        lay = m.pk.stream_layout()
        assert ("qkv_rope_append" in lay.types) == (name != "registers"), (name, lay)
        assert ("attention_decode" in lay.types) == name.startswith("kv"), (name, lay)
        torch.manual_seed(0)
        outs[name] = {k: v.clone() for k, v in dense_hostsim.run(m.pk, steps=1).items()}
    assert outs["registers"].keys() == outs["stream"].keys()
    for name in list(outs)[1:]:
        for k, v in outs["registers"].items():
            assert torch.equal(outs[name][k], v), (name, k)


def test_auto_declines_a_stream_that_spills():
    """"auto" (the models' default) keeps the register engine where the stream's register split would spill
    (the tiny model's group-2 attention does, with the worker's queue bounds in registers) and says why, after
    first retrying with the bounds in shared memory (MEGART_QUEUE_BOUNDS_SMEM), which streams the tiny model with no
    spill; a caller's choice of that macro is not overridden; an explicit depth is honoured as asked."""
    from megart.models import llama
    cfg = llama.tiny()
    m = llama.LlamaModel(cfg, device="cpu", init="empty", nw=4)
    assert m.pk.queue_bounds_smem and m.pk.stream_declined is None and m.pk.report.spill_bytes == 0
    assert m.pk.stream_layout().slots == 5 and "#define MEGART_QUEUE_BOUNDS_SMEM 1\n" in m.pk.source.text
    kept = llama.LlamaModel(cfg, device="cpu", init="empty", nw=4, defines={"MEGART_QUEUE_BOUNDS_SMEM": 0})
    assert kept.pk.stream_declined and "spilled" in kept.pk.stream_declined and not kept.pk.queue_bounds_smem
    assert kept.pk.stream_layout().slots == 0 and kept.pk.report.spill_bytes == 0
    forced = llama.LlamaModel(cfg, device="cpu", init="empty", nw=4,
                              defines={"MEGART_STREAM_SLOTS": 5, "MEGART_QUEUE_BOUNDS_SMEM": 0})
    assert forced.pk.stream_declined is None and forced.pk.stream_layout().slots == 5
    assert forced.pk.report.spill_bytes > 0          # what "auto" avoided


PIECES = {"MEGART_STREAM_SLOTS": 8, "MEGART_STREAM_STAGE": 64, "MEGART_DENSE_X_PIECES": 1}


def _tiny_steps(cfg, defines, overrides=None, steps=1):
    """Decode steps of a tiny model through the host-run bodies (sources in `overrides` replaced): its tensors."""
    from megart.models import llama
    from megart.models.llama_config import clone_kv
    m = llama.LlamaModel(cfg, device="cpu", nw=4, kv=clone_kv(llama.make_kv_cache(cfg, 1)), defines=defines,
                         compile=False)
    m.pk.source_overrides = overrides or {}
    m.compile()
    torch.manual_seed(0)
    return {k: v.clone() for k, v in dense_hostsim.run(m.pk, steps=steps).items()}


def _tiny_ffn_steps(defines, overrides=None, steps=2):
    """Two tiny decode steps (ffn 1,024: down's x is two pieces of 64 chunks)."""
    from megart.models import llama
    return _tiny_steps(llama.tiny().with_(name="tiny_ffn1k", ffn=1024), defines, overrides, steps)


@pytest.mark.parametrize("arrive_all", [0, 1])
def test_x_in_pieces_gives_the_register_engines_bits(arrive_all):
    """MEGART_DENSE_X_PIECES=1 (the default): a streamed gemv_m1 of a tagged x without a norm (the Llama step's down
    projection) stages x in pieces of one weight stage, each completed by an mbarrier its stager warps (or, with
    MEGART_DENSE_X_ARRIVE_ALL=1, every stager lane) arrive on, and each stage's
    dots wait for their own piece only; every tensor of two steps equals the register engine's."""
    pieces = _tiny_ffn_steps({**PIECES, "MEGART_DENSE_X_ARRIVE_ALL": arrive_all})
    regs = _tiny_ffn_steps({"MEGART_STREAM_SLOTS": 0})
    assert regs.keys() == pieces.keys()
    for k, v in regs.items():
        assert torch.equal(pieces[k], v), k


def test_x_read_in_batches_gives_the_register_engines_bits():
    """MEGART_DENSE_X_BATCH=N: each stager thread reads its next N chunks of x before checking the first (ffn 4,096:
    down's x is 512 chunks, two per thread at 256 threads, so N = 1 takes two rounds and N = 3 one with a chunk past
    x's end, which it must skip); every tensor of two steps equals the register engine's."""
    from megart.models import llama
    cfg = llama.tiny().with_(name="tiny_ffn4k", ffn=4096)
    regs = _tiny_steps(cfg, {"MEGART_STREAM_SLOTS": 0}, steps=2)
    for batch in (1, 3):
        pieces = _tiny_steps(cfg, {**PIECES, "MEGART_DENSE_X_BATCH": batch}, steps=2)
        for k, v in regs.items():
            assert torch.equal(pieces[k], v), (batch, k)


def test_hostsim_catches_a_piece_of_x_never_staged(tmp_path):
    """Without the stager warps' arrival every compute warp waits on a piece that never completes: the host
    simulation reports threads stuck (on the device: the watchdog), and so shows the pieces path ran."""
    from test_dense_engines import _broken
    src = _broken(tmp_path, "        if (lane == 0) mbar_arrive(bars + c / kPiece);\n", "")
    with pytest.raises(dense_hostsim.HostSimError, match="stuck"):
        _tiny_ffn_steps(PIECES, src, steps=1)
    with pytest.raises(dense_hostsim.HostSimError, match="stuck"):   # (the batched reads arrive the same way)
        _tiny_ffn_steps({**PIECES, "MEGART_DENSE_X_BATCH": 2}, src, steps=1)


FP8_PIECES = {"MEGART_STREAM_SLOTS": 8, "MEGART_STREAM_STAGE": 64, "MEGART_DENSE_X_PIECES_FP8": 1}


def _tiny_fp8_step(defines, overrides=None):
    """One decode step of a one-layer tiny_fp8 at ffn 2,048 (down's x: two pieces of one e4m3 stage's x)."""
    from megart.models import llama
    return _tiny_steps(llama.config("tiny_fp8").with_(name="tiny_fp8_ffn2k", ffn=2048, layers=1), defines, overrides)


def test_x_in_pieces_for_fp8_gives_the_register_engines_bits(tmp_path):
    """MEGART_DENSE_X_PIECES_FP8 (on by default): gemv_m1_fp8 stages its tagged x in pieces of one e4m3 stage's
    x (two of its weight chunks' worth per chunk), so every tensor of a step equals the register engine's;
    without the stagers' arrivals the dots wait forever (the pieces path ran)."""
    regs, pieces = _tiny_fp8_step({"MEGART_STREAM_SLOTS": 0}), _tiny_fp8_step(FP8_PIECES)
    for k, v in regs.items():
        assert torch.equal(pieces[k], v), k
    src = _broken(tmp_path, "        if (lane == 0) mbar_arrive(bars + c / kPiece);\n", "")
    with pytest.raises(dense_hostsim.HostSimError, match="stuck"):
        _tiny_fp8_step(FP8_PIECES, src)
