"""Tests for megart.trace: Chrome trace structure and PNG timeline."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megart.profile import Profile
from megart.trace import plot_timeline, to_chrome_trace

NAMES = {1: "gemm", 2: "norm"}
# (type_id, instance, worker, smid, wait_start, body_begin, body_end, step)
ROWS = [
    (1, 0, 0, 10, 1000, 1100, 1600, 1),    # wait 100
    (1, 1, 1, 11, 1000, 1000, 1300, 1),
    (1, 2, 0, 10, 1600, 1650, 1850, 1),    # wait 50
    (2, 3, 2, 12, 1000, 1900, 2000, 1),    # wait 900
    (1, 0, 0, 10, 10000, 10000, 10400, 2),
    (1, 1, 1, 11, 10000, 10200, 10900, 2),  # wait 200
    (1, 2, 2, 12, 10000, 10050, 10350, 2),  # wait 50
    (2, 3, 0, 10, 10400, 10950, 11100, 2),  # wait 550
    (1, 0, 0, 10, 20000, 20000, 20600, 3),
    (1, 1, 1, 11, 20000, 20010, 20410, 3),  # wait 10
    (1, 2, 1, 11, 20410, 20410, 20810, 3),
    (2, 3, 2, 12, 20000, 20820, 21020, 3),  # wait 820
]


def make_records(rows=ROWS) -> np.ndarray:
    """Scrambled rows plus unused (step 0) slots, like a real device buffer."""
    marked = [tuple(r) + (r[5], r[5]) for r in rows]   # (phase marks unstamped: at the body's begin)
    arr = np.array(marked + [(0,) * 10, (1, 9, 2, 12, 5, 999, 1, 0, 0, 0)], dtype=np.int64)
    return arr[np.random.default_rng(1).permutation(len(arr))]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_WAITS = 8  # rows of ROWS with body_begin > wait_start


@pytest.fixture
def prof() -> Profile:
    return Profile(make_records(), NAMES)


def _x(trace: dict, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def test_event_counts(prof):
    tr = to_chrome_trace(prof)
    assert len(_x(tr, "task")) == len(ROWS) == 12
    assert len(_x(tr, "wait")) == N_WAITS
    names = [e for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sorted(e["tid"] for e in names) == [0, 1, 2]
    assert {e["tid"]: e["args"]["name"] for e in names} == {
        0: "worker 0 (SM 10)", 1: "worker 1 (SM 11)", 2: "worker 2 (SM 12)"}
    assert len({e["pid"] for e in tr["traceEvents"]}) == 1


def test_body_event_units_and_args(prof):
    tr = to_chrome_trace(prof)
    ev = next(e for e in _x(tr, "task") if e["args"] == {"instance": 0, "step": 1, "type_id": 1})
    # body 1100..1600 ns, earliest record at 1000 ns -> ts 0.1 us, dur 0.5 us
    assert ev["name"] == "gemm" and ev["tid"] == 0
    assert ev["ts"] == pytest.approx(0.1) and ev["dur"] == pytest.approx(0.5)
    assert isinstance(ev["ts"], float) and isinstance(ev["dur"], float)
    last = next(e for e in _x(tr, "task") if e["args"]["step"] == 3 and e["name"] == "norm")
    assert last["tid"] == 2
    assert last["ts"] == pytest.approx(19.82) and last["dur"] == pytest.approx(0.2)
    assert min(e["ts"] for e in _x(tr, "task") + _x(tr, "wait")) == 0.0


def test_wait_events(prof):
    tr = to_chrome_trace(prof)
    waits = _x(tr, "wait")
    assert {e["name"] for e in waits} == {"wait:gemm", "wait:norm"}
    w = next(e for e in waits if e["name"] == "wait:norm" and e["args"]["step"] == 1)
    assert w["ts"] == pytest.approx(0.0) and w["dur"] == pytest.approx(0.9) and w["tid"] == 2
    assert all(e["dur"] > 0 for e in waits)


def test_json_roundtrip_and_file(prof, tmp_path):
    path = tmp_path / "trace.json"
    tr = to_chrome_trace(prof, path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(tr))
    assert len(loaded["traceEvents"]) == len(tr["traceEvents"])


def test_unnamed_task_in_trace():
    rows = ROWS + [(7, 4, 1, 11, 1300, 1300, 1350, 1)]
    tr = to_chrome_trace(Profile(make_records(rows), NAMES))
    assert "task7" in {e["name"] for e in _x(tr, "task")}


def test_plot_png(prof, tmp_path):
    out = plot_timeline(prof, tmp_path / "tl.png")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    out1 = plot_timeline(prof, str(tmp_path / "tl1.png"), step=1, title="step one")
    assert out1.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="step 9"):
        plot_timeline(prof, tmp_path / "x.png", step=9)


def test_import_is_cheap():
    """Importing megart.trace must not pull in matplotlib."""
    code = "import sys, megart.trace; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.stdout.strip() == "False"
