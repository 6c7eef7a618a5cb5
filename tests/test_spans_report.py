"""bench/spans_report.py: per-worker sums and a layer's call timeline from raw span records."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import spans_report  # noqa: E402
from megart.layout import SPAN, SPAN_WORDS  # noqa: E402


def _records(rows):
    """rows: (step, instance uid, worker, wait_start, body_begin, body_end[, mark0, mark1]), times in ns."""
    r = np.zeros((len(rows), SPAN_WORDS), dtype=np.int64)
    for i, row in enumerate(rows):
        cols = ["step", "instance", "worker", "wait_start", "body_begin", "body_end", "mark0", "mark1"][:len(row)]
        r[i, [SPAN[c] for c in cols]] = row
    return r


def test_per_worker_and_timeline(tmp_path):
    labels = ["L0.qkv", "L0.attn", "L1.qkv"]
    call_of = np.array([0, 0, 1, 2, -1])          # uid 4 belongs to no call and is left out
    one_step = [(0, 0, 1000, 2000), (1, 1, 1000, 3000), (2, 0, 5000, 9000), (3, 1, 4000, 6000), (4, 1, 0, 100000)]
    rows = [(st, uid, w, ws + 100000 * st, bb + 100000 * st, bb + 100000 * st + (d - bb))
            for st in (1, 2) for uid, w, bb, d in one_step for ws in [bb - 500]]
    path = tmp_path / "x.npz"
    np.savez_compressed(path, records=_records(rows), call_of=call_of, labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    w = spans_report.per_worker(rec, co, lb, 2)
    # worker 0: bodies 1 + 4 us, worker 1: 2 + 2 us; every body waited 0.5 us; the step runs 0.5 .. 9 us
    assert abs(w["step_us"] - 8.5) < 1e-9 and abs(w["body_mean_us"] - 4.5) < 1e-9 and abs(w["body_max_us"] - 5) < 1e-9
    assert abs(w["wait_mean_us"] - 1.0) < 1e-9 and abs(w["idle_after_mean_us"] - 1.5) < 1e-9
    assert w["kinds"]["qkv"] == (2.5, 4.0) and w["kinds"]["attn"] == (2.0, 4.0)   # (L1.qkv is a qkv too)
    tl = spans_report.timeline(rec, co, lb, 2, "L0.")
    assert [t[0] for t in tl] == ["L0.qkv", "L0.attn"]
    assert np.allclose(tl[0][1:], (0.5, 2.0, 2.5)) and np.allclose(tl[1][1:], (4.5, 8.5, 8.5))
    text = spans_report.report(path, layer=0)
    assert "busiest 5.0" in text and "L0.attn" in text and "L1.qkv" not in text


def test_hops_measure_each_call_after_the_previous_calls_last_end(tmp_path):
    """Three layers of two calls: only the middle layer counts; its first call is measured from the end of the
    layer before's last call, its second from its first call's last end."""
    labels = ["L0.a", "L0.b", "L1.a", "L1.b", "L2.a", "L2.b"]
    call_of = np.arange(6)
    # (uid, worker, body_begin, body_end) in ns: each call one instance; L0.b ends at 3 us
    spans = [(0, 0, 1000, 2000), (1, 1, 2000, 3000), (2, 0, 2500, 7000), (3, 1, 7500, 9000),
             (4, 0, 9000, 10000), (5, 1, 10000, 11000)]
    rows = [(1, uid, w, bb, bb, be) for uid, w, bb, be in spans]
    path = tmp_path / "h.npz"
    np.savez_compressed(path, records=_records(rows), call_of=call_of, labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    h = spans_report.hops(rec, co, lb, 1)
    assert set(h) == {"a", "b"}
    # the step starts at 1 us: L1.a begins at 1.5 (0.5 before L0.b's end at 2.0) and ends at 6.0 (4.0 after it);
    # L1.b begins at 6.5 and ends at 8.0: 0.5 and 2.0 after L1.a's end
    assert np.allclose(h["a"], (-0.5, 4.0, 4.0)) and np.allclose(h["b"], (0.5, 2.0, 2.0))
    assert "a layer's hops" in spans_report.report(path, layer=1)


def test_last_bodies_give_what_the_last_instance_does_more(tmp_path):
    """Per call kind of the middle layer: the median body and the last-ending instance's (a merging chunk)."""
    labels = ["L0.attn", "L1.attn", "L2.attn"]
    call_of = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    # (uid, worker, body_begin, body_end): in L1 the bodies are 3, 3 and 5 us, the 5 us one ending last
    spans = [(0, 0, 0, 1000), (1, 1, 0, 1000), (2, 2, 0, 1000),
             (3, 0, 2000, 5000), (4, 1, 2500, 5500), (5, 2, 2000, 7000),
             (6, 0, 8000, 9000), (7, 1, 8000, 9000), (8, 2, 8000, 9000)]
    rows = [(1, uid, w, bb, bb, be) for uid, w, bb, be in spans]
    path = tmp_path / "b.npz"
    np.savez_compressed(path, records=_records(rows), call_of=call_of, labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    assert spans_report.last_bodies(rec, co, lb, 1) == {"attn": (3.0, 5.0)}
    assert "last-ending instance" in spans_report.report(path, layer=1)


def test_instance_bands_show_the_instances_that_end_apart(tmp_path):
    """Per call kind of the middle layer: instances in index bands; the last band (a row pair less, a slower path)
    ends 1 us after the others, which end 1 us before the call's last end."""
    labels = ["L0.o", "L1.o", "L2.o"]
    call_of = np.repeat(np.arange(3), 6)
    spans = []
    for layer in range(3):
        base = 10000 * layer
        for j in range(6):   # instances 4 and 5 of each layer take 3 us, the others 2
            spans.append((6 * layer + j, j, base, base + (3000 if j >= 4 else 2000)))
    rows = [(1, uid, w, bb, bb, be) for uid, w, bb, be in spans]
    path = tmp_path / "i.npz"
    np.savez_compressed(path, records=_records(rows), call_of=call_of, labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    bands = spans_report.by_instance(rec, co, lb, 1, bands=3)
    assert bands == {"o": [(0, 1, 2.0, -1.0), (2, 3, 2.0, -1.0), (4, 5, 3.0, 0.0)]}
    assert "3-3: 2.00 / -1.00  4-4: 3.00 / 0.00" in spans_report.report(path, layer=1)   # (6 bands)


def test_chain_gives_each_calls_events_after_the_layers_first_call(tmp_path):
    """Three layers of qkv (2 instances) and attn (2 instances, phase-marked): in the middle layer, qkv's last end
    is at 5 us; attn's instances wait from 5.5 and 6, begin at 6 and 7, attend by 7 and 9, arrive at 8 and 10
    and end at 8 and 12 us (the second merges). Unmarked calls have no mark rows; the report prints the table
    only for marked records."""
    labels = ["L0.qkv", "L0.attn", "L1.qkv", "L1.attn", "L2.qkv", "L2.attn"]
    call_of = np.repeat(np.arange(6), 2)
    rows = []
    for layer in range(3):
        b = 20000 * layer
        rows += [(1, 4 * layer, 0, b + 500, b + 1000, b + 4000), (1, 4 * layer + 1, 1, b + 500, b + 1000, b + 5000)]
        rows += [(1, 4 * layer + 2, 0, b + 5500, b + 6000, b + 8000, b + 7000, b + 8000),
                 (1, 4 * layer + 3, 1, b + 6000, b + 7000, b + 12000, b + 9000, b + 10000)]
    path = tmp_path / "c.npz"
    np.savez_compressed(path, records=_records(rows), call_of=call_of, labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    ch = spans_report.chain(rec, co, lb, 1)
    assert np.allclose(ch[("qkv", "end")], (-1.0, -0.5, 0.0))
    assert ("qkv", "mark 0") not in ch
    assert np.allclose(ch[("attn", "wait starts")], (0.5, 0.75, 1.0))
    assert np.allclose(ch[("attn", "body begins")], (1.0, 1.5, 2.0))
    assert np.allclose(ch[("attn", "mark 0")], (2.0, 3.0, 4.0)) and np.allclose(ch[("attn", "mark 1")], (3.0, 4.0, 5.0))
    assert np.allclose(ch[("attn", "end")], (3.0, 5.0, 7.0))
    assert "a layer's chain" in spans_report.report(path, layer=1)
    plain = tmp_path / "p.npz"
    np.savez_compressed(plain, records=_records([r[:6] for r in rows]), call_of=call_of, labels=np.array(labels))
    assert "a layer's chain" not in spans_report.report(plain, layer=1)


def test_step_ends_time_the_boundary_between_steps(tmp_path):
    """The calls after the last layer (earlier step) and before / in layer 0 (later step), after the earlier
    step's last end: first wait, median begin, median end, last end, medians over consecutive pairs."""
    labels = ["embedding", "L0.qkv", "L1.qkv", "lm_head", "argmax"]
    call_of = np.array([0, 1, 2, 3, 3, 4])
    # one step, times in ns from the step's base: (uid, worker, wait, begin, end)
    one = [(0, 0, 0, 500, 1500), (1, 0, 1500, 2000, 6000), (2, 0, 6000, 7000, 10000),
           (3, 0, 10000, 11000, 20000), (4, 1, 10000, 12000, 18000), (5, 1, 18000, 21000, 23000)]
    period = 30000                                        # a step's base every 30 us: 7 us after the last end
    rows = [(st, uid, w, wt + period * st, bb + period * st, e + period * st)
            for st in (1, 2, 3) for uid, w, wt, bb, e in one]
    path = tmp_path / "ends.npz"
    np.savez_compressed(path, records=_records(rows), call_of=call_of, labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    se = spans_report.step_ends(rec, co, lb)
    assert list(se) == [("end", "lm_head"), ("end", "argmax"), ("start", "embedding"), ("start", "L0.qkv")]
    assert np.allclose(se[("end", "argmax")], (-5.0, -2.0, 0.0, 0.0))
    assert np.allclose(se[("end", "lm_head")], (-13.0, -11.5, -4.0, -3.0))       # begins 11 and 12, ends 20 and 18
    assert np.allclose(se[("start", "embedding")], (7.0, 7.5, 8.5, 8.5))
    assert np.allclose(se[("start", "L0.qkv")], (8.5, 9.0, 13.0, 13.0))
    assert "previous argmax" in spans_report.report(path, layer=0)


def test_medians_keep_the_timers_32_ns_at_its_real_magnitude(tmp_path):
    """%globaltimer counts ns since an epoch (~1.7e18): as float64 such a value is 256 ns coarse, so a median
    is taken of differences, never of the raw stamps."""
    base = 1_700_000_000_000_000_000
    labels = ["L0.qkv"]
    rows = [(1, 0, 0, base, base + 32, base + 1000 + 32 * k) for k in range(3)]   # ends 1.000 / 1.032 / 1.064 us
    path = tmp_path / "t.npz"
    np.savez_compressed(path, records=_records(rows), call_of=np.zeros(1, dtype=np.int64), labels=np.array(labels))
    rec, co, lb = spans_report.load(path)
    (_, first, med, last), = spans_report.timeline(rec, co, lb, 1, "L0.")
    assert abs(med - 1.032) < 1e-9 and abs(last - 1.064) < 1e-9
