"""The Llama step's attention merge (megart.models.llama, attn_merge=): by default the attention call merges
its own partials (the last chunk of each kv head to finish does), one call fewer per layer than
attention_decode + attention_merge; both forms give the same bits, and "auto" keeps the merge call where the
fused form cannot run. The direct form (one chunk per kv head, each instance writing its q heads' output, no
partials) gives the bits of the fused merge over one chunk."""
import pytest
import torch

from megart.emulate import hostsim
from megart.models import llama
from megart.models.llama_config import clone_kv

pytestmark = pytest.mark.usefixtures("cpu_settings")


def _model(cfg, prefix, **kw):
    return llama.LlamaModel(cfg, device="cpu", nw=8, kv=clone_kv(prefix), **kw)


def test_the_fused_merge_is_the_default_and_drops_a_call_per_layer():
    cfg = llama.tiny()
    prefix = llama.make_kv_cache(cfg, 1)
    fused, call = _model(cfg, prefix), _model(cfg, prefix, attn_merge="call")
    assert fused.merge_fused and not call.merge_fused
    kinds = lambda m: {k.split(".", 1)[-1] for k in m.groups}  # noqa: E731
    assert "merge" not in kinds(fused) and "merge" in kinds(call)
    assert len(call.groups) - len(fused.groups) == cfg.layers


def test_both_forms_write_the_same_bits_in_the_host_run_bodies():
    """One whole tiny decode step with the CUDA bodies run on the host: every tensor both kernels hold is
    bit-identical (the fused merge runs attention_merge's arithmetic), and every arrival counter is back to 0."""
    cfg = llama.tiny()
    prefix = llama.make_kv_cache(cfg, 1)
    outs = {}
    for how in ("fused", "call"):
        m = _model(cfg, prefix, attn_merge=how, defines={"MEGART_STREAM_SLOTS": 0})
        torch.manual_seed(0)
        outs[how] = {k: v.clone() for k, v in hostsim.run(m.pk, steps=1).items()}
    shared = outs["fused"].keys() & outs["call"].keys()
    assert {k for k in shared if k.endswith("attn")}, "the merged outputs were not compared"
    for k in shared:
        assert torch.equal(outs["fused"][k], outs["call"][k]), k
    arrivals = [k for k in outs["fused"] if k.endswith("arrivals")]
    assert len(arrivals) == cfg.layers and not any(outs["fused"][k].any() for k in arrivals)


def test_auto_keeps_the_merge_call_where_the_fused_form_cannot_run():
    """A kv head's q heads must fit one attention instance (group <= 8), and each chunk needs a piece of the
    head's outputs; "fused" asked for outside that is refused by the attention splitter, by name."""
    from megart.errors import GraphError
    wide = llama.tiny().with_(name="tiny_g16", n_q=16, n_kv=1, hd=64)
    assert not llama.merge_fused("auto", wide, chunks=4) and llama.merge_fused("fused", wide, chunks=4)
    assert llama.merge_fused("auto", llama.tiny(), chunks=4) and not llama.merge_fused("call", llama.tiny(), 4)
    with pytest.raises(GraphError, match="group 16 > 8"):
        llama.LlamaModel(wide, device="cpu", nw=8, init="empty", attn_merge="fused", compile=False)
    with pytest.raises(ValueError, match="attn_merge must be one of"):
        llama.LlamaModel(llama.tiny(), device="cpu", nw=8, attn_merge="merged", compile=False)


@pytest.mark.parametrize("width", [1, 2])
def test_the_direct_form_gives_the_fused_merge_bits_over_one_chunk(width):
    """Two tiny decode steps with the CUDA bodies run on the host: attn_merge="direct" (instances of `width` q
    heads, no partials, no merge) against the fused merge with one chunk per kv head: every tensor both kernels
    hold is bit-identical (o / l is the one-chunk merge's arithmetic)."""
    cfg = llama.tiny()
    prefix = llama.make_kv_cache(cfg, 1)
    slots = {"MEGART_STREAM_SLOTS": 0}
    direct = _model(cfg, prefix, attn_merge="direct", tiles={"attn_width": width}, defines=slots)
    fused = _model(cfg, prefix, tiles={"attn_chunks": 1}, defines=slots)
    att = [i for i in direct.pk.graph.instances if i.type.name == "attention_decode"]
    assert len(att) == cfg.layers * cfg.n_q // width and {i.params["group"] for i in att} == {width}
    assert all(i.params["part_o"] is None and i.params["arrivals"] is None for i in att)
    assert direct.part_o is None and not direct.merge_fused and direct.chunks == 1
    outs = {}
    for name, m in (("direct", direct), ("fused", fused)):
        torch.manual_seed(0)
        outs[name] = {k: v.clone() for k, v in hostsim.run(m.pk, steps=2).items()}
    shared = outs["direct"].keys() & outs["fused"].keys()
    assert {k for k in shared if k.endswith("attn")} == {f"L{l}.attn" for l in range(cfg.layers)}
    for k in shared:
        assert torch.equal(outs["direct"][k], outs["fused"][k]), k


def test_the_direct_form_compiles_only_its_own_paths():
    """The direct kernel compiles its width's body and no fused merge; the fused kernel neither the direct store nor
    the switch; the default ("auto") kernel the fused merge and the switch's one-head body, not the direct store."""
    cfg = llama.tiny()
    prefix = llama.make_kv_cache(cfg, 1)
    direct = _model(cfg, prefix, attn_merge="direct", compile=False)
    fused = _model(cfg, prefix, attn_merge="fused", compile=False)
    g4 = cfg.with_(name="tiny_g4", n_q=8, n_kv=2)   # (the switch is the default from a GQA group of 4)
    auto, auto_g2 = _model(g4, llama.make_kv_cache(g4, 1), compile=False), _model(cfg, prefix, compile=False)
    dm, fm, am, a2 = (m.pk.kernel_config().defines for m in (direct, fused, auto, auto_g2))
    assert dm["MEGART_ATTN_DIRECT"] == 1 and dm["MEGART_ATTN_FUSED_MERGE"] == 0 and dm["MEGART_ATTN_GROUP_MASK"] == "0x2"
    assert "MEGART_ATTN_DIRECT" not in fm and fm["MEGART_ATTN_FUSED_MERGE"] == 1 and "MEGART_ATTN_SWITCH" not in fm
    assert "MEGART_ATTN_DIRECT" not in am and am["MEGART_ATTN_FUSED_MERGE"] == 1 and am["MEGART_ATTN_SWITCH"] == 1
    assert "MEGART_ATTN_SWITCH" not in a2
    assert auto.direct_upto_auto and not fused.direct_upto_auto and not auto_g2.direct_upto_auto


def test_the_direct_forms_width_is_checked_before_anything_is_built():
    """tiles['attn_width'] applies to the direct form only, and must be a positive integer (a zero width used to
    reach a division in the body macros); a width past the group is the whole group."""
    cfg = llama.tiny()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="attn_width"):
            llama.LlamaModel(cfg, device="cpu", nw=8, init="empty", attn_merge="direct", tiles={"attn_width": bad},
                             compile=False)
    with pytest.raises(ValueError, match="attn_merge='direct' only"):
        llama.LlamaModel(cfg, device="cpu", nw=8, init="empty", tiles={"attn_width": 1}, compile=False)
    wide = llama.LlamaModel(cfg, device="cpu", nw=8, init="empty", attn_merge="direct", tiles={"attn_width": 64},
                            compile=False)
    att = [i for i in wide.pk.graph.instances if i.type.name == "attention_decode"]
    assert {i.params["group"] for i in att} == {cfg.group} and len(att) == cfg.layers * cfg.n_kv


def _host_steps(m, steps=2):
    torch.manual_seed(0)
    return {k: v.clone() for k, v in hostsim.run(m.pk, steps=steps).items()}


@pytest.mark.parametrize("upto,other", [(64, "direct"), (40, "fused")])
def test_the_switch_runs_the_direct_form_up_to_its_length_and_the_chunks_past_it(upto, other):
    """attn_merge="auto" with tiles["attn_direct_upto"]: two tiny decode steps (kv_len 41 and 42) with the CUDA bodies
    run on the host. At kv_len <= direct_upto chunk c < group of each kv head attends q head c over the whole context
    and writes its output: every tensor equals the direct form's (width 1); past it the chunks and their fused merge
    run: every tensor equals the fused form's. Either way every arrival counter is back to 0."""
    cfg = llama.tiny()
    prefix = llama.make_kv_cache(cfg, 1)
    slots = {"MEGART_STREAM_SLOTS": 0}
    short = {"attn_min_chunk": 8}   # (several chunks hold positions: the fused merge's bits differ from one chunk's)
    switch = _model(cfg, prefix, tiles={"attn_direct_upto": upto, **short}, defines=slots)
    att = [i for i in switch.pk.graph.instances if i.type.name == "attention_decode"]
    assert switch.merge_fused and switch.chunks >= cfg.group and {i.params["direct_upto"] for i in att} == {upto}
    refs = {"direct": _model(cfg, prefix, attn_merge="direct", tiles={"attn_width": 1}, defines=slots),
            "fused": _model(cfg, prefix, attn_merge="fused", tiles=short, defines=slots)}
    a, b = _host_steps(switch), _host_steps(refs[other])
    shared = a.keys() & b.keys()
    assert {k for k in shared if k.endswith("attn")} == {f"L{l}.attn" for l in range(cfg.layers)}
    # which form ran: the chunks write their partials (fp32; the bf16 outputs of both forms mostly round alike)
    partials = [k for k in a if k.endswith("part_o")]
    assert len(partials) == cfg.layers and all(a[k].any() == (other == "fused") for k in partials)
    for k in shared:
        assert torch.equal(a[k], b[k]), k
    assert not any(a[k].any() for k in a if k.endswith("arrivals"))
