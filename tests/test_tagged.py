"""Tagged tensors (megart/tagged.py): the word format, the graph's rules (one write per step, a polled read
after its writer, only tagged parameters take them), the schedule (a polled read makes no wait and its writer
signals nothing for it), the simulator (a poll whose writer can never run is a deadlock, named) and the Llama
step with its vectors tagged: same bits in the emulator and in the host-run CUDA bodies, fewer events."""
import pytest
import torch

import megart
from megart import tagged
from megart.emulate import hostsim
from megart.layout import TAG_MARK, step_tag
from megart.models import llama
from megart.models.llama_config import clone_kv
from megart.registry import RegistryError, TaskType, ptr, register

pytestmark = pytest.mark.usefixtures("cpu_settings")


def test_word_format_round_trips_values_and_tags():
    v = torch.randn(64).to(torch.bfloat16)
    w = tagged.pack(v, 3)
    assert w.dtype == torch.int32 and torch.equal(tagged.values(w), v)
    assert set(tagged.tags(w).tolist()) == {step_tag(3)} == {TAG_MARK | 3}
    tagged.stamp(w, 0x7FFF + 2)                 # the tag wraps at 15 bits, keeping the mark
    assert set(tagged.tags(w).tolist()) == {step_tag(1)} and torch.equal(tagged.values(w), v)
    assert step_tag(1) != step_tag(2) and not (tagged.empty(4) >> 16).any()   # zeroed words match no step
    tagged.values(w)[0] = 2.0                   # the view writes values and keeps tags
    assert tagged.values(w)[0].item() == 2.0 and tagged.tags(w)[0].item() == step_tag(1)


def _kernel(nw=4):
    return megart.PersistentKernel(nw=nw, device="cpu")


def _gemv(pk, y, x, name, n=16, k=64, **kw):
    w = pk.tensor(torch.randn(n, k).to(torch.bfloat16), name + "_w")
    return pk.task("gemv_m1", y=y, w=w, x=x, label=name, **kw)


def test_a_tagged_tensor_needs_int32_words_and_a_tagged_parameter():
    pk = _kernel()
    with pytest.raises(megart.GraphError, match="32-bit words"):
        pk.tensor(torch.zeros(8, dtype=torch.bfloat16), "x", tagged=True)
    x = pk.tensor(tagged.empty(64), "x", tagged=True)
    assert x.tagged and x.dtype == "tagged_bf16" and x.itemsize == 4
    with pytest.raises(megart.GraphError, match="tensor 'x' is tagged.*'x' does not take tagged words"):
        pk.task("axpy", y=pk.tensor(torch.zeros(64), "y"), x=x, a=1.0)
    with pytest.raises(RegistryError, match="tagged=True needs a bf16 'in' or 'out'"):
        register(TaskType("bad_tagged", 1997, (ptr("w", "bf16", "weight", tagged=True),), "tasks/noop.cuh",
                          reference=lambda p: None), builtin=False)


def test_one_write_per_step_and_no_poll_before_the_write():
    pk = _kernel()
    src = pk.tensor(torch.randn(64).to(torch.bfloat16), "src")
    x = pk.tensor(tagged.empty(64), "x", tagged=True)
    with pytest.raises(megart.GraphError, match="read by polling, but no earlier task of this step writes"):
        _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y0"), x, "early")
    _gemv(pk, x.ref(0, 16), src, "first")                    # elements [0, 16) written
    with pytest.raises(megart.GraphError, match="elements \\[0, 64\\)\\) is read by polling"):
        _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y1"), x, "partial")   # [16, 64) never
    n = len(pk.graph.instances)
    with pytest.raises(megart.GraphError, match="written twice in one step \\(also by gemv_m1#0\\)"):
        _gemv(pk, x.ref(8, 16), src, "again", tiles=2)
    assert len(pk.graph.instances) == n             # a refused call adds nothing
    with pytest.raises(megart.GraphError, match="cannot poll words it writes"):   # in place: x += W a
        pk.task("gemv_m1", y=x.ref(0, 16), w=pk.tensor(torch.randn(16, 16).to(torch.bfloat16), "w_in"),
                x=pk.tensor(torch.randn(16).to(torch.bfloat16), "s16"), residual=x.ref(0, 16))
    fresh = pk.tensor(tagged.empty(16), "fresh", tagged=True)    # (in place on words nobody wrote yet: the
    with pytest.raises(megart.GraphError, match="cannot poll words it writes"):   # poll would wait on itself)
        pk.task("gemv_m1", y=fresh, w=pk.graph.tensors["w_in"], x=pk.graph.tensors["s16"], residual=fresh)
    with pytest.raises(megart.GraphError, match="shares memory with 'x', and only one of them is tagged"):
        pk.tensor(x.data.view(torch.bfloat16), "raw_view")
    with pytest.raises(megart.GraphError, match="is i32 \\(tagged words are added with pk.tensor"):
        _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.int32), "untagged_words"), src, "words")


def test_a_polled_read_makes_no_wait_and_its_writer_no_signal():
    pk = _kernel()
    src = pk.tensor(torch.randn(64).to(torch.bfloat16), "src")
    x = pk.tensor(tagged.empty(64), "x", tagged=True)
    plain = pk.tensor(torch.zeros(64, dtype=torch.bfloat16), "plain")
    gw = _gemv(pk, x, src, "writer", n=64, tiles=4)
    gp = _gemv(pk, plain, src, "plain_writer", n=64, tiles=4)
    gr = _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y"), x, "reader", tiles=4)
    gpr = _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y2"), plain, "plain_reader", tiles=4)
    pk.compile()
    s = pk.schedule
    assert all(s.waits[u] == [] for u in gr.uids)
    assert all(s.polls[u] == gw.uids for u in gr.uids)
    assert all(s.signals[u] == [] for u in gw.uids)           # nothing waits on the tagged writer
    assert any(s.signals[u] for u in gp.uids) and any(s.waits[u] for u in gpr.uids)   # the plain edge: events
    out = pk.emulate(2)                                       # the emulator reads values through the tags
    want = pk.graph.tensors["reader_w"].data.float() @ (pk.graph.tensors["writer_w"].data.float() @
                                                        src.data.float()).to(torch.bfloat16).float()
    torch.testing.assert_close(out["y"].float(), want, rtol=2e-2, atol=2e-2)


def test_the_emulated_timeline_starts_a_poller_after_its_writers():
    pk = _kernel()
    src = pk.tensor(torch.randn(64).to(torch.bfloat16), "src")
    x = pk.tensor(tagged.empty(64), "x", tagged=True)
    gw = _gemv(pk, x, src, "writer", n=64, tiles=4)
    gr = _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y"), x, "reader", tiles=4)
    pk.compile()
    from megart.emulated_spans import emulated_records
    from megart.layout import SPAN
    rec = {int(r[SPAN["instance"]]): r for r in emulated_records(pk.schedule)}
    last_write = max(rec[u][SPAN["body_end"]] for u in gw.uids)
    assert all(rec[u][SPAN["body_begin"]] >= last_write for u in gr.uids)


def test_a_poll_whose_writer_waits_on_the_reader_is_a_named_deadlock():
    pk = _kernel()
    src = pk.tensor(torch.randn(64).to(torch.bfloat16), "src")
    x = pk.tensor(tagged.empty(16), "x", tagged=True)
    e = pk.event("after_reader")
    _gemv(pk, x, src, "writer", waits=[e])
    _gemv(pk, pk.tensor(torch.zeros(16, dtype=torch.bfloat16), "y"), x, "reader", k=16, signals=[e])
    with pytest.raises(megart.ScheduleError, match="polls the tagged words of gemv_m1#0, which never run"):
        pk.compile()


@pytest.fixture(scope="module")
def tiny_pair():
    cfg = llama.tiny()
    prefix = llama.make_kv_cache(cfg, 1)
    weights = llama.make_weights(cfg, 0)
    return cfg, weights, prefix


def test_llama_tagged_step_matches_the_plain_step_in_the_emulator(tiny_pair):
    cfg, W, prefix = tiny_pair
    out = {}
    for tg in (False, True):
        m = llama.LlamaModel(cfg, W, clone_kv(prefix), device="cpu", nw=8, tagged=tg)
        logits, token = m.step(5, pos=cfg.prefill)
        out[tg] = (logits.clone(), token.clone(), m.pk.schedule)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    n_waits = {tg: sum(map(len, out[tg][2].waits.values())) for tg in out}
    n_signals = {tg: sum(map(len, out[tg][2].signals.values())) for tg in out}
    assert n_waits[True] < n_waits[False] and n_signals[True] < n_signals[False] / 2
    names = {t.name for t in out[True][2].graph.tagged_tensors()}
    assert names == {"x1", "x2", "L0.xm", "L1.xm", "L0.h", "L1.h", "L0.attn", "L1.attn"}   # not x0 (the embedding
    #                                                               writes it plain)


def _host_steps(tiny_pair, slots, merge, **model_kw):
    """Two steps of the tiny model through the CUDA bodies on the host: (every tensor's values, the raw
    tensors, the model)."""
    cfg, W, prefix = tiny_pair
    m = llama.LlamaModel(cfg, W, clone_kv(prefix), device="cpu", nw=8, attn_merge=merge,
                         defines={"MEGART_STREAM_SLOTS": slots}, **model_kw)
    m.reset(cfg.prefill, 5)
    out = hostsim.run(m.pk, steps=2)
    values = {k: (tagged.values(v) if m.pk.graph.tensors[k].tagged else v).clone() for k, v in out.items()}
    return values, out, m


@pytest.mark.parametrize("slots,merge", [(0, "auto"), ("auto", "auto"), (0, "call")])
def test_llama_tagged_step_gives_the_same_bits_in_the_host_run_bodies(tiny_pair, slots, merge):
    """Two whole steps through the CUDA bodies on the host: every tensor's values equal the plain kernel's,
    and every tagged word carries the last step's tag (a poll of an untagged word faults the run)."""
    res = {}
    for tg in (False, True):
        res[tg], out, m = _host_steps(tiny_pair, slots, merge, tagged=tg)
        if tg:
            for t in m.pk.graph.tagged_tensors():
                assert set(tagged.tags(out[t.name]).tolist()) == {step_tag(m.pk._hostsim_steps)}, t.name
    assert res[True].keys() == res[False].keys()
    for k in res[False]:
        assert torch.equal(res[True][k], res[False][k]), k


def test_explicit_dependencies_with_tagged_vectors_give_the_same_bits(tiny_pair):
    """deps="explicit" (infer=False calls with after= edges) still polls the tagged words: it waits on events
    the inferred graph does not, and computes the same bits."""
    cfg, W, prefix = tiny_pair
    out = {}
    for deps in ("explicit", "infer"):
        m = llama.LlamaModel(cfg, W, clone_kv(prefix), device="cpu", nw=8, deps=deps)
        assert m.tagged and m.pk.schedule.polls
        out[deps] = m.step(3, cfg.prefill)[0].clone()
    assert torch.equal(out["explicit"], out["infer"])


def _attn_waits_on(m, kinds):
    """The task types whose instances the model's attention instances wait on (events, not polls)."""
    g = m.pk.graph
    return {g.instances[d].type.name for i in g.instances if i.type.name == "attention_decode" for d in i.deps} & kinds


# (qkv's e4m3 form shares the body and its tagged epilogue with the bf16 form: tiny_fp8_all, ~40 s of CI, left out)
@pytest.mark.parametrize("cfg_name", ["tiny", "tiny_features"])
def test_tagged_attention_matches_the_event_step_in_the_emulator(cfg_name):
    """tagged_attn: qkv stores q and the new k/v rows as tagged words, attention polls them and waits on no qkv
    event, kv_commit appends the rows: three steps give the same logits, tokens and caches."""
    from megart.models.llama_config import config
    cfg = llama.tiny().with_(name="tiny_features", n_q=6, n_kv=2, hd=128, tied=False, qk_norm=True, eps=1e-6) \
        if cfg_name == "tiny_features" else config(cfg_name)     # (GQA group 3, hd 128, q/k norms)
    W, prefix = llama.make_weights(cfg, 0), llama.make_kv_cache(cfg, 1)
    runs = {}
    for ta in (False, True):
        m = llama.LlamaModel(cfg, W, clone_kv(prefix), device="cpu", nw=8, tagged_attn=ta)
        m.reset(cfg.prefill, 3)
        outs = [tuple(t.clone() for t in m.step()) for _ in range(3)]
        runs[ta] = (outs, [t.clone() for pair in m.kv for t in pair], m)
    for (la, ta_), (lb, tb) in zip(runs[False][0], runs[True][0]):
        assert torch.equal(la, lb) and torch.equal(ta_, tb)
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    qkv = {"qkv_rope_append", "qkv_rope_append_fp8"}
    assert _attn_waits_on(runs[False][2], qkv) and not _attn_waits_on(runs[True][2], qkv)
    # the tagged form is compiled in only where the graph uses it (TaskType.macros_for), and fits the registers
    assert runs[True][2].pk.kernel_config().defines.get("MEGART_ATTN_TAGGED") == 1
    assert "MEGART_ATTN_TAGGED" not in runs[False][2].pk.kernel_config().defines
    assert runs[True][2].pk.report.spill_bytes == 0
    g = runs[True][2].pk.graph
    commits = [i for i in g.instances if i.type.name == "kv_commit"]
    assert len(commits) == cfg.layers and all(
        any(g.instances[d].type.name == "attention_decode" for d in i.deps) for i in commits)


@pytest.mark.parametrize("slots,merge", [(0, "auto"), ("auto", "auto"), (0, "call")])
def test_tagged_attention_gives_the_same_bits_in_the_host_run_bodies(tiny_pair, slots, merge):
    """Two steps through the CUDA bodies on the host: the caches and every other tensor equal the event
    build's, and q and the new rows carry the last step's tag."""
    res = {}
    for ta in (False, True):
        res[ta], out, m = _host_steps(tiny_pair, slots, merge, tagged_attn=ta)
        if ta:
            for name in ("L0.q", "L1.q", "L0.k_new", "L1.v_new"):
                assert set(tagged.tags(out[name]).tolist()) == {step_tag(m.pk._hostsim_steps)}, name
    shared = res[False].keys() & res[True].keys()
    assert {"L0.k_cache", "L1.v_cache", "L0.q", "L0.attn"} <= shared
    for k in shared:
        assert torch.equal(res[True][k], res[False][k]), k


def test_bad_tagged_attention_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="tagged_attn=True needs tagged=True"):
        llama.LlamaModel(llama.tiny(), device="cpu", nw=8, tagged=False, tagged_attn=True, compile=False)
    n_q, n_kv, hd, ms, d = 4, 2, 64, 16, 256
    pk = megart.PersistentKernel(nw=4, device="cpu")
    bf = lambda n: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    T = pk.tensor
    q_plain, q_tag = T(bf(n_q * hd), "q"), T(tagged.empty(n_q * hd), "qt", tagged=True)
    kc, vc, pos = T(bf(n_kv * ms * hd), "kc"), T(bf(n_kv * ms * hd), "vc"), T(torch.zeros(1, dtype=torch.int32), "pos")
    kn, vn = T(tagged.empty(n_kv * hd), "kn", tagged=True), T(tagged.empty(n_kv * hd), "vn", tagged=True)
    kn_plain = T(bf(n_kv * hd), "kn_plain")
    qkv = dict(k_cache=kc.data.view(n_kv, ms, hd), v_cache=vc.data.view(n_kv, ms, hd), pos=pos, n_q=n_q, n_kv=n_kv,
               hd=hd, w_qkv=T(bf((n_q + 2 * n_kv) * hd * d).view(-1, d), "w"), x=T(bf(d), "x"),
               cos=T(torch.ones(ms, hd // 2), "cos"), sin=T(torch.zeros(ms, hd // 2), "sin"))
    qkv = {k: (pk.tensor(v, k + "_v") if isinstance(v, torch.Tensor) else v) for k, v in qkv.items()}
    with pytest.raises(megart.GraphError, match="q, k_new and v_new as tagged tensors, all three"):
        pk.task("qkv_rope_append", q=q_tag, **qkv)                          # tagged q without the new rows
    with pytest.raises(megart.GraphError, match="q, k_new and v_new as tagged tensors, all three"):
        pk.task("qkv_rope_append", q=q_plain, k_new=kn, v_new=vn, **qkv)    # new rows with a plain q
    with pytest.raises(megart.GraphError, match="k_new must be a tagged tensor"):
        pk.task("kv_commit", k_new=kn_plain, v_new=vn, k_cache=qkv["k_cache"], v_cache=qkv["v_cache"], pos=pos,
                n_kv=n_kv, hd=hd)
    with pytest.raises(megart.GraphError, match="v_new has 64 elements, expected n_kv \\* hd = 128"):
        pk.task("kv_commit", k_new=kn, v_new=T(tagged.empty(hd), "short", tagged=True), k_cache=qkv["k_cache"],
                v_cache=qkv["v_cache"], pos=pos, n_kv=n_kv, hd=hd)


def test_bad_tagged_options_are_refused_by_name():
    from megart.layout import HANG_POLL
    from megart.stream import hang_site
    assert "tagged words polled" in hang_site(HANG_POLL)       # the HangError's event name for a poll
    with pytest.raises(ValueError, match="tagged must be True or False"):
        llama.LlamaModel(llama.tiny(), device="cpu", nw=8, tagged="yes", compile=False)
    from megart.models.llama_tp import LlamaTPGroup
    with pytest.raises(megart.GraphError, match="LlamaTPRank does not take tagged=True"):
        LlamaTPGroup(llama.tiny(), 2, nw=8, tagged=True)
