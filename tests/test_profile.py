"""Tests for megart.profile on hand-built span buffers with known answers."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megart.layout import MARK_HIGH_SHIFT
from megart.profile import (
    BODY_BEGIN,
    BODY_END,
    SPAN_FIELDS,
    SPAN_WORDS,
    STEP,
    Metric,
    Profile,
    stream_wait_parts,
)

GEMM, NORM = 1, 2
NAMES = {GEMM: "gemm", NORM: "norm"}

# (type_id, instance, worker, smid, wait_start, body_begin, body_end, step)
# Workers 0,1,2 live on SMs 10,11,12.  Expected per-step values are derived
# by hand in the comments and asserted literally below.
ROWS = [
    # step 1
    (GEMM, 0, 0, 10, 1000, 1100, 1600, 1),    # body 500 wait 100
    (GEMM, 1, 1, 11, 1000, 1000, 1300, 1),    # body 300 wait 0
    (GEMM, 2, 0, 10, 1600, 1650, 1850, 1),    # body 200 wait 50
    (NORM, 3, 2, 12, 1000, 1900, 2000, 1),    # body 100 wait 900
    # gemm: w0=700 w1=300 -> slow 700; wall 1850-1000=850; sum 1000; wait 150
    # step wall 2000-1000 = 1000
    # step 2
    (GEMM, 0, 0, 10, 10000, 10020, 10420, 2),  # body 400 wait 20
    (GEMM, 1, 1, 11, 10000, 10200, 10900, 2),  # body 700 wait 200
    (GEMM, 2, 2, 12, 10000, 10050, 10350, 2),  # body 300 wait 50
    (NORM, 3, 0, 10, 10400, 10950, 11100, 2),  # body 150 wait 550
    # gemm: w0=400 w1=700 w2=300 -> slow 700; wall 10900-10020=880; sum 1400;
    # wait 270.  step wall 11100-10000 = 1100 (from wait_start, not begin)
    # step 3
    (GEMM, 0, 0, 10, 20000, 20000, 20600, 3),  # body 600 wait 0
    (GEMM, 1, 1, 11, 20000, 20010, 20410, 3),  # body 400 wait 10
    (GEMM, 2, 1, 11, 20410, 20410, 20810, 3),  # body 400 wait 0
    (NORM, 3, 2, 12, 20000, 20820, 21020, 3),  # body 200 wait 820
    # gemm: w0=600 w1=800 -> slow 800; wall 810; sum 1400; wait 10
    # step wall 21020-20000 = 1020
]
UNUSED = [
    (0, 0, 0, 0, 0, 0, 0, 0),
    (GEMM, 9, 2, 12, 5, 999, 1, 0),  # garbage in an unused slot: must be ignored
]


def _marked(row) -> tuple:
    """An 8-word row as the device writes it: both phase marks unstamped (at the body's begin)."""
    return tuple(row) + (row[5], row[5]) if len(row) == 8 else tuple(row)


def make_records(rows=ROWS, unused=UNUSED, seed=0) -> np.ndarray:
    """Rows in scrambled order, with unused slots interleaved, as the device
    buffer (filled by racing workers) would be."""
    arr = np.array([_marked(r) for r in list(rows) + list(unused)], dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(len(arr))
    return arr[perm]


@pytest.fixture
def prof() -> Profile:
    return Profile(make_records(), NAMES)


def test_layout_constants():
    assert SPAN_WORDS == 10 == len(SPAN_FIELDS)
    assert SPAN_FIELDS[STEP] == "step" and STEP == 7
    assert (BODY_BEGIN, BODY_END) == (5, 6) and SPAN_FIELDS[8:] == ("mark0", "mark1")


def test_steps_ignore_unused_rows(prof):
    assert prof.steps == [1, 2, 3]
    assert prof.records.shape == (len(ROWS), 10)
    assert prof.task_ids() == [GEMM, NORM]
    assert prof.nw == 3


def test_gemm_per_step_values(prof):
    g = prof.by_task("gemm")
    assert g.steps == [1, 2, 3]
    np.testing.assert_array_equal(g.slow_cta_ns, [700, 700, 800])
    np.testing.assert_array_equal(g.wall_ns, [850, 880, 810])
    np.testing.assert_array_equal(g.sum_cta_ns, [1000, 1400, 1400])
    np.testing.assert_array_equal(g.wait_ns, [150, 270, 10])
    np.testing.assert_array_equal(g.max_wait_ns, [100, 200, 10])
    assert g.instances_per_step == 3


def test_gemm_metrics(prof):
    g = prof.by_task(GEMM)
    assert g.slow_cta == Metric(median=700, min=700, max=800, spread=pytest.approx(100 / 700), n=3)
    assert g.wall.median == 850 and g.wall.min == 810 and g.wall.max == 880
    assert g.wall.spread == pytest.approx(70 / 850)
    assert g.sum_cta.median == 1400
    assert g.wait.median == 150


def test_norm_values(prof):
    n = prof.by_task("norm")
    np.testing.assert_array_equal(n.slow_cta_ns, [100, 150, 200])
    np.testing.assert_array_equal(n.wall_ns, [100, 150, 200])
    np.testing.assert_array_equal(n.sum_cta_ns, [100, 150, 200])
    np.testing.assert_array_equal(n.wait_ns, [900, 550, 820])
    assert n.slow_cta.median == 150
    assert n.slow_cta.spread == pytest.approx(100 / 150)
    assert n.wait.median == 820
    assert n.instances_per_step == 1


def test_step_walls(prof):
    assert prof.step_wall(1) == 1000
    assert prof.step_wall(2) == 1100
    np.testing.assert_array_equal(prof.step_walls(), [1000, 1100, 1020])
    with pytest.raises(ValueError, match="step 7"):
        prof.step_wall(7)


def test_name_and_id_give_same_stats(prof):
    np.testing.assert_array_equal(prof.by_task("gemm").wall_ns, prof.by_task(GEMM).wall_ns)
    np.testing.assert_array_equal(prof.by_task(np.int64(NORM)).wall_ns, [100, 150, 200])


def test_unknown_name_lists_known_names(prof):
    with pytest.raises(KeyError) as ei:
        prof.by_task("attention")
    msg = str(ei.value)
    assert "attention" in msg and "gemm" in msg and "norm" in msg


def test_absent_task_id_raises_value_error(prof):
    with pytest.raises(ValueError, match="no spans"):
        prof.by_task(42)


def test_unnamed_id_labelled_task_id():
    rows = ROWS + [(7, 4, 1, 11, 1300, 1300, 1350, 1)]
    p = Profile(make_records(rows), NAMES)
    t = p.by_task(7)
    assert t.name == "task7"
    assert p.task_name(7) == "task7"
    np.testing.assert_array_equal(t.wall_ns, [50])
    assert p.by_task("task7").type_id == 7
    assert "UNKNOWN" not in p.table()
    assert any(d["name"] == "task7" for d in p.summary())


def test_instances_and_per_instance(prof):
    g = prof.by_task("gemm")
    inst = g.instances
    assert inst.shape == (9, 10) and inst.dtype == np.int64
    assert list(inst[:, STEP]) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    step1 = g.per_instance(step=1)
    assert [d["instance"] for d in step1] == [0, 1, 2]
    assert step1[0] == {"step": 1, "instance": 0, "worker": 0, "smid": 10,
                        "wait_ns": 100, "body_ns": 500, "begin_ns": 100, "mark0_ns": 0, "mark1_ns": 0}
    assert [d["begin_ns"] for d in step1] == [100, 0, 650]
    assert len(g.per_instance()) == 9
    assert [d["begin_ns"] for d in g.per_instance(step=2)] == [0, 180, 30]
    with pytest.raises(ValueError):
        g.per_instance(step=9)


def test_achieved_bandwidth(prof):
    g = prof.by_task("gemm")
    # 1.7 MB in a median wall of 850 ns -> 2e12 B/s
    assert g.achieved_bandwidth(1_700_000) == pytest.approx(2e12)
    assert g.achieved_bandwidth(1_400_000, metric="slow_cta") == pytest.approx(2e12)
    with pytest.raises(ValueError):
        g.achieved_bandwidth(1, metric="bogus")


def test_to_dict_and_summary_are_json(prof):
    d = prof.by_task("gemm").to_dict()
    assert d["name"] == "gemm" and d["type_id"] == GEMM
    assert d["n_steps"] == 3 and d["instances_per_step"] == 3
    assert d["wall"]["median"] == 850 and d["slow_cta"]["median"] == 700
    assert d["wall"]["spread"] == pytest.approx(70 / 850)
    s = prof.summary()
    assert [r["name"] for r in s] == ["gemm", "norm"]
    assert s[0]["wall_us"] == pytest.approx(0.85)
    assert s[0]["sum_cta_us"] == pytest.approx(1.4)
    assert json.loads(json.dumps({"tasks": s, "gemm": d}))["gemm"]["n_steps"] == 3


def test_table_content(prof):
    t = prof.table()
    lines = t.splitlines()
    assert "WARNING" not in t
    gemm_line = next(line for line in lines if line.startswith("gemm"))
    assert gemm_line.split() == ["gemm", "1", "3", "0.70", "0.85", "1.40", "0.15"]
    norm_line = next(line for line in lines if line.startswith("norm"))
    assert norm_line.split() == ["norm", "2", "1", "0.15", "0.15", "0.15", "0.82"]


def test_overflow_warning():
    p = Profile(make_records(), NAMES, overflow=5)
    assert p.overflow == 5
    assert "WARNING" in p.table() and "5" in p.table().splitlines()[0]


def test_variable_instance_count():
    rows = ROWS + [(GEMM, 5, 2, 12, 1900, 1900, 2000, 1)]  # extra gemm in step 1 on w2
    g = Profile(make_records(rows), NAMES).by_task("gemm")
    np.testing.assert_array_equal(g.counts, [4, 3, 3])
    np.testing.assert_array_equal(g.wall_ns, [1000, 880, 810])
    np.testing.assert_array_equal(g.sum_cta_ns, [1100, 1400, 1400])


@pytest.mark.parametrize("shape", [(10,), (4, 9), (2, 11), (2, 2, 10)])
def test_bad_shape(shape):
    with pytest.raises(ValueError, match="10 columns"):
        Profile(np.zeros(shape, dtype=np.int64), NAMES)


def test_records_without_phase_marks_read_as_unmarked():
    """8-column records (written before the phase marks) are accepted; their marks are the body's begin."""
    eight = make_records(ROWS)[:, :8]
    a, b = Profile(eight, NAMES), Profile(make_records(ROWS), NAMES)
    np.testing.assert_array_equal(a.by_task("gemm").wall_ns, b.by_task("gemm").wall_ns)
    assert a.by_task("gemm").phases()["median_to_mark0"] == 0


def test_float_records_rejected():
    with pytest.raises(ValueError, match="integer"):
        Profile(np.ones((2, 10), dtype=np.float64), NAMES)


def test_corrupt_row_named():
    arr = make_records(unused=[])
    bad = 4
    arr[bad, BODY_END] = arr[bad, BODY_BEGIN] - 1
    with pytest.raises(ValueError, match=rf"row {bad}\b.*body_end < body_begin"):
        Profile(arr, NAMES)


def test_wait_after_begin_rejected():
    arr = make_records(unused=[])
    arr[2, 4] = arr[2, BODY_BEGIN] + 10  # wait_start after body_begin
    with pytest.raises(ValueError, match="row 2"):
        Profile(arr, NAMES)


def test_nw_checked_and_kept():
    assert Profile(make_records(), NAMES, nw=8).nw == 8
    with pytest.raises(ValueError, match="nw"):
        Profile(make_records(), NAMES, nw=2)


def test_empty_profile():
    p = Profile(np.zeros((4, 10), dtype=np.int64), NAMES)
    assert p.steps == [] and p.task_ids() == []
    assert "no span records" in p.table()
    with pytest.raises(ValueError, match="no spans"):
        p.by_task("gemm")


def test_metric_zero_median():
    assert Metric.of(np.array([0, 0, 0])).spread == 0.0
    m = Metric.of(np.array([0, 0, 5]))
    assert m.spread == float("inf") and m.to_dict()["spread"] is None


def test_phases_split_the_last_and_the_median_body_at_the_marks():
    """Two steps of three gemm instances with both marks stamped: the last-ending instance's body split at
    mark 0 and mark 1, and each part's median over the instances (medians over steps); an unmarked body is
    all 'mark1_to_end'."""
    rows = []
    for s, base in ((1, 0), (2, 10000)):
        for inst, (begin, m0, m1, end) in enumerate([(100, 150, 400, 500), (100, 120, 300, 700), (100, 110, 200, 300)]):
            rows.append((GEMM, inst, inst, 10 + inst, base, base + begin, base + end, s, base + m0, base + m1))
        rows.append((NORM, 3, 0, 10, base, base + 800, base + 900, s, base + 800, base + 800))
    p = Profile(np.array(rows, dtype=np.int64), NAMES)
    ph = p.by_task("gemm").phases()
    assert (ph["last_to_mark0"], ph["last_mark0_to_mark1"], ph["last_mark1_to_end"]) == (20, 180, 400)
    assert (ph["median_to_mark0"], ph["median_mark0_to_mark1"], ph["median_mark1_to_end"]) == (20, 180, 100)
    assert p.by_task("norm").phases()["last_mark1_to_end"] == 100
    assert p.by_task("gemm").per_instance(1)[0]["mark1_ns"] == 300


def test_a_phase_mark_outside_its_body_is_refused():
    bad = _marked(ROWS[0])[:8] + (ROWS[0][6] + 1, ROWS[0][5])    # mark0 after the body's end
    with pytest.raises(ValueError, match="phase mark outside its body"):
        Profile(make_records(rows=[bad] + ROWS[1:]), NAMES)


def test_stream_wait_counts_in_the_mark_words():
    """A MEGART_STREAM_WAITS build keeps counts in the mark words: refused as phase marks by default, read
    with timed_marks=False, and split by stream_wait_parts into (stage wait, dots, before the first stage,
    stages read)."""
    # stage wait 5 ns, dots 7 ns; before the first stage 11 ns, 3 stages
    words = (7 << MARK_HIGH_SHIFT) | 5, (3 << MARK_HIGH_SHIFT) | 11
    row = _marked(ROWS[0])[:8] + words
    with pytest.raises(ValueError, match="phase mark outside its body"):
        Profile(make_records(rows=[row] + ROWS[1:]), NAMES)
    p = Profile(make_records(rows=[row] + ROWS[1:]), NAMES, timed_marks=False)
    mine = p.records[(p.records[:, BODY_BEGIN] == row[5]) & (p.records[:, STEP] == row[7])]
    assert stream_wait_parts(mine).tolist() == [[5, 7, 11, 3]]
