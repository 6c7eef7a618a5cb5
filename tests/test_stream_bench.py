"""bench/stream_bench.py's --waits summary on the CPU (the bench itself times a GPU): the per-call split of the
compute warps' time, fed by hand-made span records whose mark words hold MEGART_STREAM_WAITS counts."""
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megart.layout import MARK_HIGH_SHIFT
from megart.profile import SPAN_COL, SPAN_WORDS, Profile

BENCH = Path(__file__).resolve().parents[1] / "bench" / "stream_bench.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))   # (stream_bench imports llama_decode from bench/)
    spec = importlib.util.spec_from_file_location("stream_bench_mod", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(instance, worker, begin_ns, body_ns, step, wait, read, before, stages):
    r = np.zeros(SPAN_WORDS, dtype=np.int64)
    r[SPAN_COL["type_id"]], r[SPAN_COL["instance"]], r[SPAN_COL["worker"]] = 1, instance, worker
    r[SPAN_COL["wait_start"]] = r[SPAN_COL["body_begin"]] = begin_ns
    r[SPAN_COL["body_end"]], r[SPAN_COL["step"]] = begin_ns + body_ns, step
    r[SPAN_COL["mark0"]], r[SPAN_COL["mark1"]] = wait | (read << MARK_HIGH_SHIFT), before | (stages << MARK_HIGH_SHIFT)
    return r


def test_waits_split_the_mean_warps_time_per_call(bench):
    """Two calls (instances 0-1: L0.gate_up, 2: L0.down) on 2 workers of 2 warps, 2 steps: the table gives per
    step the stages read, the mean worker's body, and its mean warp's time before the first stage, waiting,
    reading and the rest."""
    labels = ["L0.gate_up", "L0.down"]
    model = SimpleNamespace(nw=2, pk=SimpleNamespace(threads=64), call_kind=lambda lb: lb.split(".", 1)[1],
                            call_index=lambda n=0: (labels, np.array([0, 0, 1])))
    rows = []
    for step in (1, 2):
        base = step * 100_000
        rows.append(_record(0, 0, base, 8_000, step, wait=2_000, read=8_000, before=4_000, stages=10))
        rows.append(_record(1, 1, base, 8_000, step, wait=0, read=12_000, before=2_000, stages=10))
        rows.append(_record(2, 0, base + 9_000, 4_000, step, wait=0, read=4_000, before=0, stages=4))
    prof = Profile(np.stack(rows), {1: "t"}, timed_marks=False)
    out = {c["kind"]: c for c in bench.stream_waits(model, prof)}
    up = out["gate_up"]
    assert up["stages"] == 20 and up["body_per_worker_us"] == pytest.approx(8.0)
    # per step, summed over the two workers' two warps, divided by 2 workers x 2 warps
    assert up["before_first_us"] == pytest.approx(1.5) and up["stage_wait_us"] == pytest.approx(0.5)
    assert up["read_us"] == pytest.approx(5.0) and up["rest_us"] == pytest.approx(8.0 - 7.0)
    down = out["down"]
    assert down["stages"] == 4 and down["body_per_worker_us"] == pytest.approx(2.0) and down["read_us"] == 1.0
    assert "gate_up" in bench.waits_text({"stream_waits": list(out.values())})


def test_occupancy_gives_each_calls_stages_per_warp_as_its_reads_begin(bench):
    """A MEGART_STREAM_WAITS=2 record holds, summed over its warps, the stages landed (word 0) and the stages
    issued and not yet read plus one per warp in the high half (word 1): --occupancy divides by the warps."""
    labels = ["L0.gate_up", "L0.down"]
    model = SimpleNamespace(nw=2, pk=SimpleNamespace(threads=64), call_kind=lambda lb: lb.split(".", 1)[1],
                            call_index=lambda n=0: (labels, np.array([0, 0, 1])))
    rows = [_record(0, 0, 1_000, 500, 1, wait=12, read=0, before=12, stages=2),   # 2 warps, 6 of 6 landed each
            _record(1, 1, 1_000, 500, 1, wait=2, read=0, before=10, stages=2),    # 1 of 5 landed per warp
            _record(2, 0, 2_000, 500, 1, wait=0, read=0, before=3, stages=1)]     # 1 warp: 0 of 3
    prof = Profile(np.stack(rows), {1: "t"}, timed_marks=False)
    out = {c["kind"]: c for c in bench.stream_occupancy(model, prof)}
    assert out["gate_up"]["warps"] == 4 and out["gate_up"]["landed_per_warp"] == pytest.approx(3.5)
    assert out["gate_up"]["issued_unread_per_warp"] == pytest.approx(5.5)
    assert out["down"]["landed_per_warp"] == 0 and out["down"]["issued_unread_per_warp"] == 3
    assert "landed" in bench.occupancy_text({"stream_waits": list(out.values())})


def test_contexts_keep_the_shape_and_its_decode_headroom(bench):
    """--contexts: each config at other prefilled lengths, the same shape and the same decode headroom."""
    from megart.models import llama
    base = llama.config("1b_128")
    c = bench.at_context(base, 512)
    assert (c.prefill, c.max_seq - c.prefill, c.d, c.layers, c.vocab) == (512, base.max_seq - base.prefill, 2048, 16,
                                                                          base.vocab)
    assert c.name != base.name and bench.at_context(base, None) is base
    with pytest.raises(SystemExit, match="at least 1"):
        bench.at_context(base, 0)


def test_spans_files_are_named_with_plain_characters(bench, tmp_path):
    """--spans: one file per config and variant, its name free of a context's '@' and a macro's '=' (a copy tool
    that refuses such names would drop the records), and distinct per context and variant."""
    a = bench.spans_file(tmp_path, "1b@2048", {"MEGART_ATTN_MARK0": "3"})
    b = bench.spans_file(tmp_path, "1b@128", {"MEGART_ATTN_MARK0": "3"})
    c = bench.spans_file(tmp_path, "1b@2048", {})
    assert a.parent == tmp_path and a.name == "1b-2048_MEGART_ATTN_MARK0-3.npz"
    assert c.name == "1b-2048_default.npz" and len({a, b, c}) == 3
    assert all(ch.isalnum() or ch in "._-" for ch in a.name + b.name + c.name)
