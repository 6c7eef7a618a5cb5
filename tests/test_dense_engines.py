"""The dense matvec engines and the host simulation on the CPU (tasks/dense_engines.cuh): launch geometry and
CTA sizes, the L2 prefetch cap, cost models, the host simulation catching broken bodies (a missing or divergent
barrier, a ring wait that never returns), the per-instance weight ring and the weight stream bit for bit
against the register engine, and the profiler's phase marks compiled out unless asked. The per-type numerics
are tests/test_tasks_dense.py."""
from __future__ import annotations

import pytest
import torch

import megart
from megart.geometry import dense as geo
from megart.emulate import hostsim as dense_hostsim
from dense_checks import kernel, run

# ---- launch geometry, prefetch, cost, and the host simulation itself ---------------------------------------
def _all_dense_kernel(nw: int, threads: int = 256, defines: dict | None = None) -> megart.PersistentKernel:
    """One instance-rich graph over every dense task type (small shapes)."""
    pk = megart.PersistentKernel(nw=nw, device="cpu", threads=threads, defines=defines)
    d, f, v = 256, 512, 640
    table, _ = geo.dense_m1(v, d, seed=31)
    wq, _ = geo.dense_m1(d, d, seed=32)
    wg, _ = geo.dense_m1(f, d, seed=33)
    wu, _ = geo.dense_m1(f, d, seed=34)
    wd, _ = geo.dense_m1(d, f, seed=35)
    w8, s8 = geo.quantize_fp8_per_channel(geo.dense_m1(d, d, seed=36)[0])
    we, a, _ = geo.moe_m1(4, [1, 3], d, d, seed=37)
    T = pk.tensor(torch.tensor([5], dtype=torch.int32), "token")
    X = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "x")
    Xn = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "xn")
    Q = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "q")
    Q8 = pk.tensor(torch.zeros(d, dtype=torch.bfloat16), "q8")
    H = pk.tensor(torch.zeros(f, dtype=torch.bfloat16), "h")
    H2 = pk.tensor(torch.zeros(f, dtype=torch.bfloat16), "h2")
    YE = pk.tensor(torch.zeros(4 * geo.EXPERT_ROWS, d, dtype=torch.bfloat16), "ye")
    PV, PI = pk.tensor(torch.zeros(8), "pv"), pk.tensor(torch.zeros(8, dtype=torch.int32), "pi")
    G = pk.tensor(geo.norm_weight(d, seed=38), "g")
    TAB = pk.tensor(table, "table")
    pk.task("embedding", y=X, table=TAB, token=T, tiles=4)
    pk.task("rmsnorm", y=Xn, x=X, w=G, tiles=3)
    pk.task("gemv_m1", y=Q, w=pk.tensor(wq, "wq"), x=Xn, tiles=nw)
    pk.task("gemv_m1_fp8", y=Q8, w=pk.tensor(w8, "w8"), scale=pk.tensor(s8, "s8"), x=X, norm_weight=G, tiles=5)
    pk.task("gate_up_silu", h=H, w_gate=pk.tensor(wg, "wg"), w_up=pk.tensor(wu, "wu"), x=X, norm_weight=G, tiles=nw)
    pk.task("silu_mul", h=H2, g=H, u=H, tiles=4)
    pk.task("gemv_m1", y=X, w=pk.tensor(wd, "wd"), x=H2, residual=X, tiles=nw)
    pk.task("group_gemm_m1", y=YE, w=pk.tensor(we, "we"), a=pk.tensor(a, "a"), active=[1, 3], tiles=6)
    pk.task("lm_head_argmax", w=TAB, x=X, part_val=PV, part_idx=PI, norm_weight=G, tiles=8)
    pk.task("argmax_reduce", token=T, part_val=PV, part_idx=PI)
    return pk


def test_two_ctas_per_sm_fit_without_spills():
    """nw = 2 x SMs compiles with __launch_bounds__(256, 2): every dense body in <= 128 registers, no spills."""
    pk = _all_dense_kernel(nw=264)
    pk.compile()
    assert pk.report.spill_bytes == 0 and pk.report.registers <= 128, pk.report
    assert pk.occupancy.per_sm >= 2


@pytest.mark.parametrize("threads", [128, 512])
def test_other_cta_sizes(threads):
    """MEGART_THREADS is a parameter of every body (warps own rows; K split when rows are scarce)."""
    pk = _all_dense_kernel(nw=8, threads=threads)
    emu, dev = run(pk, steps=2)
    for name in ("q", "q8", "h", "h2", "x", "xn", "ye"):
        assert geo.relerr(dev[name], emu[name]) < 5e-3, name
    assert torch.equal(dev["token"], emu["token"])


@pytest.mark.parametrize("engine", ["registers", "stream"])
def test_prefetch_is_capped_and_covers_the_slice_head(engine):
    """The L2 prefetch of the next instance's weight head: capped, and left out for the streamed types
    when the stream runs (it already loads their first stages ahead)."""
    pk = _all_dense_kernel(nw=4, defines=REGISTERS if engine == "registers" else STREAM("auto"))
    pk.compile()
    streamed = pk.stream_layout().types
    assert (engine == "stream") == bool(streamed)
    dense_hostsim.run(pk)
    cap = 64 << 10
    for inst in pk.graph.instances:
        if not inst.type.prefetch:
            continue
        if inst.type.name in streamed:
            assert dense_hostsim.run.prefetched[inst.uid] == 0, inst.label()
            assert f"case {inst.type.id}: megart_prefetch_" not in pk.source.text
            continue
        asked = dense_hostsim.run.prefetched[inst.uid]
        slice_bytes = sum(inst.params[n].count * inst.params[n].tensor.itemsize
                          for n in ("w", "w_gate", "w_up") if n in inst.params)
        assert 0 < asked <= min(slice_bytes, cap), (inst.label(), asked, slice_bytes)
        assert asked == min(slice_bytes, cap) or inst.type.name == "gate_up_silu"


def test_cost_models():
    pk = kernel(4)
    n, k = 96, 64
    W = pk.tensor(torch.zeros(n, k, dtype=torch.bfloat16), "w")
    X, Y = pk.tensor(torch.zeros(k, dtype=torch.bfloat16), "x"), pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y")
    t = megart.registry.get("gemv_m1")
    c = t.cost(y=Y, w=W, x=X, residual=Y, norm_weight=None)
    assert c.bytes == n * k * 2 + k * 2 + 2 * n * 2 and c.flops == 2 * n * k
    c = megart.registry.get("group_gemm_m1").cost(y=None, w=pk.tensor(torch.zeros(8, n, k, dtype=torch.bfloat16), "we"),
                                                   a=None, active=[1, 2, 5])
    assert c.bytes == 3 * (n * k * 2 + k * 2 + n * 2)


def _broken(tmp_path, old: str, new: str) -> dict:
    """source_overrides for a copy of the one dense source holding `old` (a body: keyed by its task name;
    the shared helpers: keyed by their path) with `old` replaced by `new`."""
    hits = [f for f in sorted((megart.sources.source_root() / "tasks").glob("*.cuh")) if old in f.read_text()]
    assert len(hits) == 1 and hits[0].read_text().count(old) == 1
    p = tmp_path / hits[0].name
    p.write_text(hits[0].read_text().replace(old, new))
    key = f"tasks/{hits[0].name}" if hits[0].name.startswith("dense_") else hits[0].stem
    return {key: str(p)}


def _one_gemv(src: dict, defines: dict, n: int = 16, k: int = 64) -> megart.PersistentKernel:
    """One gemv_m1 call on one worker, compiled with the sources in `src` overridden, for the host simulation."""
    pk = megart.PersistentKernel(nw=1, device="cpu", source_overrides=src, defines=defines)
    w, x = geo.dense_m1(n, k, seed=1)
    pk.task("gemv_m1", y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y"), w=pk.tensor(w, "w"),
            x=pk.tensor(x, "x"))
    return pk.compile()


def test_hostsim_catches_a_missing_syncthreads(tmp_path):
    """Dropping the barrier after x staging makes threads read unstaged (NaN-filled) shared memory."""
    src = _broken(tmp_path, "      xs[c] = pack8(f);\n    }\n  }\n  __syncthreads();\n",
                  "      xs[c] = pack8(f);\n    }\n  }\n")
    n, k = 64, 512
    w, x = geo.dense_m1(n, k, seed=1)
    pk = megart.PersistentKernel(nw=2, device="cpu", source_overrides=src)
    Y = pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y")
    pk.task("gemv_m1", y=Y, w=pk.tensor(w, "w"), x=pk.tensor(x, "x"), tiles=2)
    pk.compile()
    out = dense_hostsim.run(pk)["y"]
    assert not torch.isfinite(out.float()).all() or geo.relerr(out, geo.ref_gemv(w, x)) > 0.1


# The three ways a dense body gets its weights, as kernel macros: the register engine, the per-instance
# ring (opt-in) and the launch-wide weight stream (the default where shared memory allows).
REGISTERS = {"MEGART_STREAM_SLOTS": 0}
def RING(slots): return {"MEGART_DENSE_RING_SLOTS": slots}
def STREAM(slots): return {"MEGART_STREAM_SLOTS": slots}


@pytest.mark.parametrize("engine", ["registers", "ring", "stream"])
def test_hostsim_catches_a_divergent_barrier(tmp_path, engine):
    if engine == "ring":        # matvec_ring
        src = _broken(tmp_path, "  int j = 0;\n  auto consume_segment",
                      "  int j = 0;\n  if (threadIdx.x == 3) return;\n  auto consume_segment")
        defines = RING(3)
    elif engine == "stream":    # matvec_stream
        src = _broken(tmp_path, "  unsigned j = stream_read_begin(warp);",
                      "  unsigned j = stream_read_begin(warp);\n  if (threadIdx.x == 3) return;")
        defines = STREAM(2)
    else:                       # matvec
        src = _broken(tmp_path, "  const int warp = threadIdx.x >> 5;\n  if (whole_pairs(groups)) {",
                      "  const int warp = threadIdx.x >> 5;\n  if (threadIdx.x == 3) return;\n  if (whole_pairs(groups)) {")
        defines = REGISTERS
    with pytest.raises(dense_hostsim.HostSimError, match="barrier"):
        dense_hostsim.run(_one_gemv(src, defines))


# ---- the weight ring and the weight stream (TMA-fed shared-memory stages) against the register engine ----
# (each engine is a device and a host build, ~25 s of CI: a small stage size is covered once, with "auto", and the
# per-warp ring once, at 8 warps; every thread count has its register engine, the bits the others must give)
ENGINES = [(256, REGISTERS), (256, RING(3)), (256, STREAM(1)), (256, STREAM("auto")),
           (256, STREAM("auto") | {"MEGART_STREAM_STAGE": 128}), (128, REGISTERS), (128, STREAM(4)), (96, REGISTERS),
           (96, STREAM(2))]


# Two xdist groups (each on one worker), so they run side by side: the shapes of a group share their kernels'
# compiles. The K-split path is compiled in only where an instance takes it, so the groups share only the
# 256-thread kernels of stream-across-instances (K-split at 8 warps; found in the shared cache once built).
KSPLIT, WHOLE = pytest.mark.xdist_group("dense_engines_ksplit"), pytest.mark.xdist_group("dense_engines_whole")


# (split-K's 3 row pairs are whole pairs at 4 and 3 warps, which the WHOLE cases cover: its 128- and 96-thread
# engines, ~100 s of one CI worker, are left out; empty-K's single pair takes the K-split path at every size)
@pytest.mark.parametrize("n,k,tiles,nw,sizes", [
    pytest.param(37, 4112, 3, 3, None, id="pairs>=warps,3-stage-rows", marks=WHOLE),
    pytest.param(6, 8208, 2, 2, (256,), id="split-K,uneven-slices", marks=KSPLIT),
    pytest.param(2, 16, 1, 1, None, id="empty-K-slices", marks=KSPLIT),
    pytest.param(300, 2064, 1, 1, None, id="many-pairs-per-warp", marks=WHOLE),
    pytest.param(40, 528, 5, 2, None, id="stream-across-instances", marks=WHOLE)])
def test_weight_engines_are_bit_identical_to_the_register_path(n, k, tiles, nw, sizes):
    """The ring and the stream consume the same chunks in the same order as dot2's registers, so each
    dense type gives bit-identical outputs with every engine and depth. Each worker runs several calls'
    instances in a row (nw < tiles: several of one call), with a weightless copy in between that the
    stream's producer steps over, so the stream crosses instance and call boundaries."""
    engines = [(t, d) for t, d in ENGINES if sizes is None or t in sizes]
    w, x = geo.dense_m1(n, k, seed=3)
    wu, _ = geo.dense_m1(n, k, seed=4)
    w8, s8 = geo.quantize_fp8_per_channel(w)
    g, res = geo.norm_weight(k, seed=5), geo.dense_m1(1, n, seed=6)[1]
    we, a, _ = geo.moe_m1(2, [1], n, k, seed=7)
    outs = {}
    for threads, defines in engines:
        pk = megart.PersistentKernel(nw=nw, device="cpu", threads=threads, defines=defines)
        X, G, W = pk.tensor(x, "x"), pk.tensor(g, "g"), pk.tensor(w, "w")
        pk.task("gemv_m1", y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y"), w=W, x=X, norm_weight=G,
                residual=pk.tensor(res, "res"), tiles=tiles)
        pk.task("copy", dst=pk.tensor(torch.zeros(64), "c_dst"), src=pk.tensor(torch.ones(64), "c_src"), tiles=nw)
        pk.task("gemv_m1_fp8", y=pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "y8"), w=pk.tensor(w8, "w8"),
                scale=pk.tensor(s8, "s8"), x=X, tiles=tiles)
        pk.task("gate_up_silu", h=pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "h"), w_gate=W,
                w_up=pk.tensor(wu, "wu"), x=X, tiles=tiles)
        W8, S8 = pk.tensor(w8, "gw8"), pk.tensor(s8, "gs8")
        pk.task("gate_up_silu_fp8", h=pk.tensor(torch.zeros(n, dtype=torch.bfloat16), "h8"), w_gate=W8, w_up=W8,
                s_gate=S8, s_up=S8, x=X, norm_weight=G, tiles=tiles)
        pk.task("lm_head_argmax_fp8", w=W8, scale=S8, x=X, part_val=pk.tensor(torch.zeros(tiles), "pv8"),
                part_idx=pk.tensor(torch.zeros(tiles, dtype=torch.int32), "pi8"), logits=pk.tensor(torch.zeros(n), "lg8"),
                tiles=tiles)
        pk.task("lm_head_argmax", w=W, x=X, part_val=pk.tensor(torch.zeros(tiles), "pv"),
                part_idx=pk.tensor(torch.zeros(tiles, dtype=torch.int32), "pi"),
                logits=pk.tensor(torch.zeros(n), "logits"), tiles=tiles)
        pk.task("group_gemm_m1", y=pk.tensor(torch.zeros(2 * geo.EXPERT_ROWS, n, dtype=torch.bfloat16), "ye"),
                w=pk.tensor(we, "we"), a=pk.tensor(a, "a"), active=[1], tiles=tiles)
        pk.compile()
        assert pk.report.spill_bytes == 0, pk.report
        lay = pk.stream_layout()
        want = defines.get("MEGART_STREAM_SLOTS", 0)
        assert lay.slots == (lay.slots if want == "auto" else want) and (lay.slots > 0) == (want != 0), \
            (threads, defines, lay)
        outs[threads, str(defines)] = {kk: v.clone() for kk, v in dense_hostsim.run(pk, steps=2).items()}
    assert geo.relerr(outs[256, str(REGISTERS)]["y"], geo.ref_gemv(w, x, norm_weight=g, residual=res)) < 1e-2
    live = outs[256, str(REGISTERS)]["ye"][geo.EXPERT_ROWS]  # (expert 1's live row; the rest stays zero)
    assert geo.relerr(live, geo.ref_group_gemm_m1(we, a, [1])[0]) < 1e-2
    for threads, defines in engines:
        for name in ("y", "y8", "h", "h8", "pv", "pi", "logits", "pv8", "pi8", "lg8", "ye"):
            assert torch.equal(outs[threads, str(defines)][name], outs[threads, str(REGISTERS)][name]), \
                (threads, defines, name)


@pytest.mark.parametrize("n", [10, 14])   # 5 and 7 row pairs: fewer than the 8 warps, more than half of them
def test_an_instance_of_more_pairs_than_half_the_warps_deals_whole_pairs(n):
    """5-7 row pairs give each warp a whole pair (the spare warps idle, no combine through shared memory): each
    row's output is the bits of the same row in an 8-pair instance (whole pairs too), with a residual and for
    gate/up, on the register engine and on the stream; and the rule reaches the generated source."""
    w16, x = geo.dense_m1(16, 2064, seed=8)
    wu16, _ = geo.dense_m1(16, 2064, seed=9)
    res16 = geo.dense_m1(1, 16, seed=10)[1]

    def run(defines, rows):
        pk = megart.PersistentKernel(nw=1, device="cpu", defines=defines)
        X, W = pk.tensor(x, "x"), pk.tensor(w16[:rows].contiguous(), "w")
        pk.task("gemv_m1", y=pk.tensor(torch.zeros(rows, dtype=torch.bfloat16), "y"), w=W, x=X,
                residual=pk.tensor(res16[:rows].contiguous(), "res"))
        pk.task("gate_up_silu", h=pk.tensor(torch.zeros(rows, dtype=torch.bfloat16), "h"), w_gate=W,
                w_up=pk.tensor(wu16[:rows].contiguous(), "wu"), x=X)
        pk.compile()
        assert "constexpr int kWholePairsFrom = kWarps / 2 + 1;" in pk.source.text
        return {kk: v.clone() for kk, v in dense_hostsim.run(pk, steps=1).items()}

    for defines in (REGISTERS, STREAM("auto")):
        few, eight = run(defines, n), run(defines, 16)
        assert geo.relerr(few["y"], geo.ref_gemv(w16[:n], x, residual=res16[:n])) < 1e-2
        assert torch.equal(few["y"], eight["y"][:n]) and torch.equal(few["h"], eight["h"][:n]), defines


@pytest.mark.parametrize("threads,rows,ksplit", [(256, 8, 1), (256, 10, 0), (128, 4, 1), (128, 6, 0)])
def test_the_k_split_path_is_compiled_in_only_where_an_instance_takes_it(threads, rows, ksplit):
    """An instance with fewer row pairs than half the warps plus one (4 at 8 warps, 2 at 4 warps) splits K; the
    code of that path (inlined into every engine) is compiled in only when the graph has one. A type asking for
    it wins over one that does not (gate_up_silu here has 16 pairs), and its output is right either way."""
    w, x = geo.dense_m1(rows, 512, seed=11)
    wg, _ = geo.dense_m1(32, 512, seed=12)
    pk = megart.PersistentKernel(nw=1, device="cpu", threads=threads)
    X = pk.tensor(x, "x")
    pk.task("gate_up_silu", h=pk.tensor(torch.zeros(32, dtype=torch.bfloat16), "h"), w_gate=pk.tensor(wg, "wg"),
            w_up=pk.tensor(wg, "wu"), x=X)
    pk.task("gemv_m1", y=pk.tensor(torch.zeros(rows, dtype=torch.bfloat16), "y"), w=pk.tensor(w, "w"), x=X)
    assert pk.kernel_config().defines["MEGART_DENSE_KSPLIT"] == ksplit
    pk.compile()
    assert f"#define MEGART_DENSE_KSPLIT {ksplit}" in pk.source.text
    assert geo.relerr(dense_hostsim.run(pk, steps=1)["y"], geo.ref_gemv(w, x)) < 1e-2


def test_matvec_macros_mirror_the_whole_pairs_rule_and_the_tagged_inputs():
    """tasks/dense_common.py's whole_pairs_from is tasks/dense_engines.cuh's kWholePairsFrom (half the warps
    plus one); the x-in-pieces paths are compiled in where an instance reads a tagged x; the user may set
    neither macro (each must agree with the instances)."""
    from megart.tasks import dense_common as dc
    assert [dc.whole_pairs_from(t) for t in (96, 128, 256, 512)] == [2, 3, 5, 9]
    asks = dc.matvec_macros(lambda p: p["n"], dc.tagged_flag)
    tagged = {"n": 9, "flags": dc.FLAG_TAGGED_X | dc.FLAG_NORM}
    assert asks([{"n": 4}, {"n": 9}], 256) == {"MEGART_DENSE_KSPLIT": 1, "MEGART_DENSE_TAGGED_X": 0}
    assert asks([{"n": 4}, tagged], 128) == {"MEGART_DENSE_KSPLIT": 0, "MEGART_DENSE_TAGGED_X": 1}
    # a type without a pieces path (gate_up, the LM head, qkv) does not ask for them, tagged x or not
    assert dc.matvec_macros(lambda p: p["n"])([{"n": 4}, tagged], 128) == {"MEGART_DENSE_KSPLIT": 0}
    for macro in ("MEGART_DENSE_KSPLIT", "MEGART_DENSE_TAGGED_X"):
        with pytest.raises(megart.ConfigError, match=macro):
            megart.PersistentKernel(nw=1, device="cpu", defines={macro: 0})


def test_weight_ring_sizing():
    """Off by default (the register engine: 33 KB); asked for, 3 slots of 8 KB per warp at 256 threads
    fit the 227 KB an SM gives one CTA, and 4 do not: a clear co-residency error naming shared memory."""
    from megart.codegen import KernelConfig
    from megart.tasks import dense_common as dc
    assert dc.ring_slots(KernelConfig(threads=256)) == 0
    assert dc.smem_for(KernelConfig(threads=256)) == dc.STAGE_SMEM
    three = KernelConfig(threads=256, defines={"MEGART_DENSE_RING_SLOTS": 3})
    assert dc.ring_slots(three) == 3
    assert dc.smem_for(three) == dc.STAGE_SMEM + 256 + 8 * 3 * 8192 <= 227 * 1024
    assert _all_dense_kernel(nw=4).smem_bytes() <= 64 * 1024
    pk = megart.PersistentKernel(nw=4, device="cpu", defines=RING(4))
    w, x = geo.dense_m1(64, 256, seed=1)
    pk.task("gemv_m1", y=pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "y"), w=pk.tensor(w, "w"),
            x=pk.tensor(x, "x"), tiles=4)
    with pytest.raises(megart.errors.ResidencyError, match="shared memory"):
        pk.compile()


def test_hostsim_catches_a_ring_wait_that_would_never_return(tmp_path):
    """The host model of the mbarriers counts completed phases: waiting on the wrong parity (a device
    hang) is reported, not silently passed because the host copies land at once."""
    src = _broken(tmp_path, "mbar_wait(ring_bar(smem, warp, slot), (unsigned)((j / kRingSlots) & 1));",
                  "mbar_wait(ring_bar(smem, warp, slot), (unsigned)(((j / kRingSlots) + 1) & 1));")
    with pytest.raises(dense_hostsim.HostSimError, match="never completes"):
        dense_hostsim.run(_one_gemv(src, RING(2)))


def test_prewait_and_drain_are_dispatched_for_the_ring_types_only():
    from megart import codegen, registry
    src = codegen.generate(registry.all_types(), codegen.KernelConfig()).text
    for name in ("gemv_m1", "gemv_m1_fp8", "gate_up_silu", "lm_head_argmax", "group_gemm_m1", "gemv_partial"):
        t = registry.get(name)
        assert f"case {t.id}: megart_prewait_{name}(" in src and f"case {t.id}: megart_drain_{name}(" in src
    for t in registry.all_types():  # (the prewaits are generated, never written by hand in a body file)
        if t.prewait and t.source.endswith(".cuh"):
            assert f"megart_prewait_{t.name}" not in (megart.sources.source_root() / t.source).read_text(), t.name
    assert "#define MEGART_DENSE_RING_SLOTS 0" in src and "#define MEGART_DENSE_RING_OFFSET" not in src


def test_phase_marks_compile_to_nothing_unless_asked(tmp_path):
    """A profiled build without MEGART_PHASE_MARKS is the same machine code as one whose bodies never call
    span_mark (the stamps would lengthen the instances a faithful number times); with it, they are in (=2: the
    warps' spread, a different stamp)."""
    import re
    unmarked, calls = {}, 0
    for header in ("dense_common.cuh", "dense_engines.cuh"):
        src = (megart.sources.source_root() / "tasks" / header).read_text()
        calls += src.count("span_mark(")
        (tmp_path / header).write_text(re.sub(r"^\s*span_mark\(\d\);.*\n", "", src, flags=re.M))
        assert "span_mark(" not in (tmp_path / header).read_text()
        unmarked[f"tasks/{header}"] = str(tmp_path / header)
    assert calls >= 3
    cubins = {}
    for name, kw in (("default", {}), ("unmarked", dict(source_overrides=unmarked)),
                     ("marks", dict(defines={"MEGART_PHASE_MARKS": 1})),
                     ("spread", dict(defines={"MEGART_PHASE_MARKS": 2}))):
        pk = megart.PersistentKernel(nw=4, device="cpu", profile=True, **kw)
        T = pk.tensor
        pk.task("gemv_m1", y=T(torch.zeros(64, dtype=torch.bfloat16), "y"),
                w=T(torch.zeros(64, 128, dtype=torch.bfloat16), "w"), x=T(torch.zeros(128, dtype=torch.bfloat16), "x"),
                tiles=4)
        cubins[name] = pk.compile().compiled.cubin
    assert cubins["default"] == cubins["unmarked"]
    assert cubins["marks"] != cubins["default"]
    assert cubins["spread"] not in (cubins["default"], cubins["marks"])  # (2: the first and last warp's stamps)
