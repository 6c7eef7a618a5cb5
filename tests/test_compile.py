"""Codegen + NVRTC (sm_90a, no GPU needed): every built-in task compiles with no spills; the cache
hits, misses and recovers from corrupt entries; compile errors are mapped back to task sources."""
import json

import pytest

import megart
from megart import codegen, registry
from megart.compile import CompileError, compile_source, parse_ptxas


# (the profiled build at the models' 8 warps, where registers are tighter than unprofiled: ~60 s of CI. The
# models' own kernels at 256 and 384 threads unprofiled: tests/test_llama.py; the dense and attention bodies at 4
# warps and fewer, where every thread has 255 registers: tests/test_dense_engines.py, tests/test_tasks_attention.py;
# 512 threads, which no model ships, is left out for CI time)
@pytest.mark.parametrize("threads,profile", [(256, True)])
def test_all_builtin_tasks_compile_without_spills(profile, threads):
    src = codegen.generate(registry.all_types(), codegen.KernelConfig(threads=threads, profile=profile))
    out = compile_source(src, "sm_90a")
    assert out.cubin[:4] == b"\x7fELF"
    assert out.report.registers > 0
    assert out.report.spill_bytes == 0, out.log


def test_generated_source_has_one_struct_and_case_per_task():
    types = registry.all_types()
    src = codegen.generate(types, codegen.KernelConfig()).text
    for t in types:
        if t.id in registry.NO_BODY:
            continue
        assert src.count(f"struct {t.struct_name} ") == 1
        assert f"case {t.id}: {t.body_name}(" in src


def test_cache_hit_miss_and_corrupt_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGART_CACHE_DIR", str(tmp_path))
    src = codegen.generate([registry.get("noop")], codegen.KernelConfig(threads=64))
    first = compile_source(src, "sm_90a")
    assert not first.cache_hit and first.path.exists()
    meta = json.loads(first.path.with_suffix(".json").read_text())
    assert meta["report"]["registers"] == first.report.registers
    second = compile_source(src, "sm_90a")
    assert second.cache_hit and second.cubin == first.cubin and second.report == first.report
    first.path.write_bytes(b"garbage")                   # corrupt cubin: a miss, then rewritten
    third = compile_source(src, "sm_90a")
    assert not third.cache_hit and third.cubin == first.cubin
    first.path.with_suffix(".json").write_text("{not json")
    assert not compile_source(src, "sm_90a").cache_hit
    assert compile_source(src, "sm_90a").cache_hit
    other = codegen.generate([registry.get("noop")], codegen.KernelConfig(threads=128))
    assert not compile_source(other, "sm_90a").cache_hit  # different source, different key


def test_cache_can_be_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGART_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEGART_DISABLE_CACHE", "1")
    src = codegen.generate([registry.get("noop")], codegen.KernelConfig(threads=96))
    compile_source(src, "sm_90a")
    assert not compile_source(src, "sm_90a").cache_hit
    assert not list(tmp_path.iterdir())


def test_compile_error_names_the_task_source(tmp_path):
    bad = tmp_path / "broken.cuh"
    bad.write_text("// a candidate body\n__device__ __forceinline__ void megart_task_copy(const megart_params_copy& p, char*) {\n"
                   "  p.dst[0] = undefined_symbol;\n}\n")
    pk = megart.PersistentKernel(nw=2, device="cpu", source_overrides={"copy": str(bad)})
    import torch
    pk.task("copy", dst=pk.tensor(torch.zeros(4), "a"), src=pk.tensor(torch.ones(4), "b"))
    with pytest.raises(CompileError) as ei:
        pk.compile()
    msg = str(ei.value)
    assert "undefined_symbol" in msg and f"{bad}:3" in msg


def test_bad_arch_is_refused():
    src = codegen.generate([registry.get("noop")], codegen.KernelConfig())
    with pytest.raises(CompileError, match="arch"):
        compile_source(src, "hopper")


def test_parse_ptxas_report():
    log = ("ptxas info    : Compiling entry function 'megart_kernel' for 'sm_90a'\n"
           "ptxas info    : Function properties for megart_kernel\n"
           "    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 77 registers, used 1 barriers, 592 bytes smem\n")
    r = parse_ptxas(log, "megart_kernel")
    assert (r.registers, r.stack_bytes, r.spill_stores, r.spill_loads, r.smem_bytes, r.barriers) == (77, 24, 8, 12, 592, 1)
    assert r.spill_bytes == 20


def test_a_log_without_the_register_count_is_named_and_the_cubin_read(monkeypatch):
    """A compile whose ptxas log says nothing readable about the entry function (seen on the device: a log of
    2,584 characters without its resource lines) warns: its spill bytes are unknown, which the spill checks
    would take for a clean build. The register count and the stack frame come from the cubin's own records
    instead (megart.cubin_info), the same figures the full log gives."""
    import megart.compile as mc
    from megart.cubin_info import function_resources
    src = codegen.generate([registry.get("noop")], codegen.KernelConfig())
    full = compile_source(src, "sm_90a", use_cache=False)
    res = function_resources(full.cubin, "megart_kernel")
    assert res is not None and (res.registers, res.frame_bytes) == (full.report.registers, full.report.stack_bytes)
    assert full.report.registers > 0 and function_resources(full.cubin, "no_such_kernel") is None
    assert function_resources(b"not an elf", "megart_kernel") is None
    monkeypatch.setattr(mc, "parse_ptxas", lambda log, kernel: mc.PtxasReport())
    with pytest.warns(RuntimeWarning, match=f"no register count for megart_kernel.*records {res.registers} registers"):
        blind = compile_source(src, "sm_90a", use_cache=False)
    assert blind.report.registers == full.report.registers and blind.report.spill_bytes == 0


def test_nvrtc_own_cache_is_turned_off_where_it_exists(monkeypatch):
    """NVRTC 12.9 on keeps its own cache of compiled code where a driver is installed, and a build it serves
    from there skips ptxas, so its log carries no register or spill count (the H200 host: every build of a
    source compiled there before). The options ask for --no-cache from 12.9 on and never before (an older
    NVRTC would reject the flag); this NVRTC takes it and still reports the registers."""
    import megart.compile as mc
    from cuda.core import ProgramOptions
    real = mc.nvrtc_version()
    monkeypatch.setattr(mc, "nvrtc_version", lambda: "12.8")
    assert "no_cache" not in mc._options("sm_90a")
    monkeypatch.setattr(mc, "nvrtc_version", lambda: "13.0")
    assert b"--no-cache" in ProgramOptions(**mc._options("sm_90a")).as_bytes("nvrtc")
    monkeypatch.setattr(mc, "nvrtc_version", lambda: real)
    built = compile_source(codegen.generate([registry.get("noop")], codegen.KernelConfig()), "sm_90a", use_cache=False)
    assert built.report.registers > 0 and "Used" in built.log


def test_kernel_defines_types_first_then_the_callers_macros():
    """A type's own macros (defines_for) come from the same config its shared memory is sized with; the
    caller's macros override them, and the sizes follow the override."""
    from megart.tasks import dense_common
    types = [registry.get("gemv_m1"), registry.get("attention_decode")]
    plain = codegen.kernel_defines(types, codegen.KernelConfig())
    assert plain["MEGART_DENSE_RING_SLOTS"] == 0 and "MEGART_DENSE_RING_OFFSET" not in plain
    assert plain["MEGART_ATTN_RING_BYTES"] == 64 * 1024
    cfg = codegen.KernelConfig(defines={"MEGART_DENSE_RING_SLOTS": 2, "MEGART_ATTN_RING_BYTES": 0})
    asked = codegen.kernel_defines(types, cfg)
    assert asked["MEGART_DENSE_RING_SLOTS"] == 2 and asked["MEGART_ATTN_RING_BYTES"] == 0
    assert asked["MEGART_DENSE_RING_OFFSET"] == dense_common.RING_OFFSET
    assert registry.get("gemv_m1").shared_bytes(cfg) == dense_common.smem_for(cfg) > dense_common.STAGE_SMEM


def test_specialize_compiles_in_the_scalars_every_instance_of_a_type_shares():
    """MEGART_SPECIALIZE=1: a scalar param that every instance of a type gives one value becomes a static
    constexpr member of the type's params struct (the packed field kept under another name, so the descriptors
    do not change); one that differs stays a field. The host-run bodies, built from the same structs, give the
    bits of the unspecialized kernel."""
    import torch
    from megart.emulate import hostsim
    from megart.geometry import dense as geo
    w, x = geo.dense_m1(10, 512, seed=1)
    wg, _ = geo.dense_m1(8, 512, seed=2)
    outs, texts = [], []
    for defines in ({}, {"MEGART_SPECIALIZE": 1}):
        pk = megart.PersistentKernel(nw=2, device="cpu", defines=defines)
        X = pk.tensor(x, "x")
        pk.task("gemv_m1", y=pk.tensor(torch.zeros(10, dtype=torch.bfloat16), "y"), w=pk.tensor(w, "w"), x=X,
                tiles=3)   # n = 4, 4, 2: not shared
        pk.task("gate_up_silu", h=pk.tensor(torch.zeros(8, dtype=torch.bfloat16), "h"), w_gate=pk.tensor(wg, "wg"),
                w_up=pk.tensor(wg, "wu"), x=X, tiles=2, eps=1e-6)   # n = 4, 4: shared
        pk.compile()
        assert pk.report.spill_bytes == 0
        texts.append(pk.source.text)
        outs.append({k: v.clone() for k, v in hostsim.run(pk, steps=1).items()})
    plain, special = texts
    assert "static constexpr" not in plain.split("struct megart_params_gemv_m1 ")[1].split("};")[0]
    gemv = special.split("struct megart_params_gemv_m1 ")[1].split("};")[0]
    gate_up = special.split("struct megart_params_gate_up_silu ")[1].split("};")[0]
    assert "static constexpr int k = 512; int _packed_k;" in gemv and "  int n; int _pad_n;" in gemv
    assert "static constexpr int n = 4; int _packed_n;" in gate_up
    assert f"static constexpr float eps = {float(torch.tensor(1e-6).item()).hex()}f;" in gate_up
    for name in ("y", "h"):
        assert torch.equal(outs[0][name], outs[1][name]), name


def test_specialize_skip_leaves_the_named_types_and_scalars_as_fields():
    """MEGART_SPECIALIZE_SKIP="type+type.param" keeps those scalars packed fields (to find which constant a
    specialized build's speed comes from); a name that is not a task type or a scalar of it is refused."""
    import torch
    w, x = torch.randn(8, 256).bfloat16(), torch.randn(256).bfloat16()

    def constants(skip):
        defines = {"MEGART_SPECIALIZE": 1, **({"MEGART_SPECIALIZE_SKIP": skip} if skip else {})}
        pk = megart.PersistentKernel(nw=2, device="cpu", defines=defines)
        X = pk.tensor(x, "x")
        pk.task("gemv_m1", y=pk.tensor(torch.zeros(8, dtype=torch.bfloat16), "y"), w=pk.tensor(w, "w"), x=X, tiles=2)
        pk.task("gate_up_silu", h=pk.tensor(torch.zeros(8, dtype=torch.bfloat16), "h"), w_gate=pk.tensor(w, "wg"),
                w_up=pk.tensor(w, "wu"), x=X, tiles=2)
        return pk.kernel_config().constants

    both = constants("")
    assert both["gemv_m1"]["k"] == 256 and both["gate_up_silu"]["k"] == 256
    some = constants("gemv_m1+gate_up_silu.k")
    assert some["gemv_m1"] == {} and "k" not in some["gate_up_silu"] and some["gate_up_silu"]["n"] == 4
    with pytest.raises(megart.ConfigError, match="no task type named 'gemv'"):
        constants("gemv")
    with pytest.raises(megart.ConfigError, match="gemv_m1 has no scalar param 'w'"):
        constants("gemv_m1.w")
