"""The faithful gate's compare step on a CPU (megart/faithful/compare.py): verdicts (WIN / NULL / REGRESS /
SLOUGHING / INVALID) on synthetic results, the noise band, and `compare`'s CLI with its exit codes."""
from __future__ import annotations

import json

import pytest

from megart.faithful import codes
from megart.faithful import compare as cmp

from faithful_records import rec, run_cli, verdict_of, write_jsonl


def test_compare_win():
    v = verdict_of(rec(10_000, 12_000, 1_300_000), rec(8_000, 9_800, 1_050_000))
    assert v.verdict == "WIN", v.reason
    assert v.ratio["slow_cta"] == pytest.approx(0.8)


def test_compare_notes_engines_that_differ():
    """A streamed baseline against a candidate on registers (--engine stream: the candidate's type is never
    streamed) is judged, with a note that says so; same engines, or records that do not say, get none."""
    def with_engine(r, weights):
        return {**r, "engine": {"weights": weights, "slots": 5 if weights == "stream" else 0, "declined": None}}
    base, cand = rec(10_000, 12_000, 1_300_000), rec(9_000, 11_000, 1_200_000)
    v = verdict_of(with_engine(base, "stream"), with_engine(cand, "registers"))
    assert v.verdict == "WIN" and any("engines differ (baseline stream, candidate registers)" in n for n in v.notes)
    for b, c in ((with_engine(base, "stream"), with_engine(cand, "stream")), (base, with_engine(cand, "registers"))):
        assert not any("engines differ" in n for n in verdict_of(b, c).notes)


def test_compare_null_within_spread():
    # 3 % slower / faster everywhere, but the runs' own noise is 8 %: inside the band
    v = verdict_of(rec(10_000, 12_000, 1_300_000, noise=0.08), rec(10_300, 11_700, 1_330_000, noise=0.08))
    assert v.verdict == "NULL", v.reason
    assert v.band["slow_cta"] == pytest.approx(0.08)
    # the same 3 % with tight runs is outside the band
    assert verdict_of(rec(10_000, 12_000, 1_300_000, noise=0.005),
                      rec(10_300, 12_360, 1_339_000, noise=0.005)).verdict == "REGRESS"


def test_compare_regress():
    v = verdict_of(rec(10_000, 12_000, 1_300_000), rec(19_000, 21_000, 2_500_000))
    assert v.verdict == "REGRESS"
    assert "slowCTA" in v.reason and "sumCTA" in v.reason


def test_compare_regress_when_only_wall_worse():
    v = verdict_of(rec(10_000, 12_000, 1_300_000), rec(10_000, 15_000, 1_300_000))
    assert v.verdict == "REGRESS" and "wall" in v.reason


def test_compare_sloughing_sum_rises():
    # slowCTA halves, but the same work on twice the CTAs costs more CTA-time: rejected, not a WIN
    v = verdict_of(rec(20_000, 22_000, 1_280_000, ctas=64, tiles=64),
                   rec(11_000, 13_000, 1_400_000, ctas=128, tiles=128))
    assert v.verdict == "SLOUGHING", v.reason
    assert "sumCTA rose" in v.reason and "Rejected" in v.reason


def test_compare_sloughing_more_ctas_same_sum():
    # slowCTA halves at unchanged total CTA-time: only because twice the CTAs did it
    v = verdict_of(rec(20_000, 22_000, 1_280_000, ctas=64, tiles=64),
                   rec(10_000, 12_000, 1_290_000, ctas=128, tiles=128))
    assert v.verdict == "SLOUGHING", v.reason
    assert "128 CTAs per step instead of 64" in v.reason


def test_compare_balanced_on_same_ctas_is_a_win():
    # a straggler fixed on the same CTAs: slowCTA falls, sumCTA flat -> a real WIN
    v = verdict_of(rec(20_000, 22_000, 1_280_000), rec(14_000, 16_000, 1_285_000))
    assert v.verdict == "WIN", v.reason


def test_compare_invalid_when_candidate_incorrect_or_untimed():
    bad = rec(5_000, 6_000, 600_000, ok=False)
    assert verdict_of(rec(10_000, 12_000, 1_300_000), bad).verdict == "INVALID"
    untimed = dict(rec(10_000, 12_000, 1_300_000), timings=None)
    assert verdict_of(rec(10_000, 12_000, 1_300_000), untimed).verdict == "INVALID"


def test_compare_band_grows_with_cross_run_spread():
    base = [rec(10_000, 12_000, 1_300_000, noise=0.005), rec(11_000, 12_000, 1_300_000, noise=0.005)]
    vs, _ = cmp.compare(base, [rec(10_700, 12_000, 1_300_000, noise=0.005)])
    assert vs[0].band["slow_cta"] == pytest.approx(1000 / 10_500)
    assert vs[0].verdict == "NULL"


def test_compare_cli_and_exit_codes(tmp_path, capsys):
    b = write_jsonl(tmp_path / "b.jsonl", [rec(10_000, 12_000, 1_300_000),
                                          rec(10_000, 12_000, 1_300_000, nw=128)])
    log = tmp_path / "c.log"   # a captured stdout log works too
    log.write_text("some line\nFAITHFUL_RESULT " + json.dumps(rec(19_000, 21_000, 2_500_000)) + "\n")
    rc, out, err = run_cli(capsys, "compare", b, str(log), "--json", str(tmp_path / "v.jsonl"))
    assert rc == codes.OK, err
    assert "REGRESS" in out and "only in baseline: gemv_m1 8192x2048 nw=128 isolated" in out
    v = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("FAITHFUL_VERDICT")]
    assert v[0]["verdict"] == "REGRESS"
    assert json.loads((tmp_path / "v.jsonl").read_text())["verdict"] == "REGRESS"
    # nothing in common / malformed / missing
    other = write_jsonl(tmp_path / "o.jsonl", [rec(1, 1, 1, task="axpy", shape="16")])
    rc, out, err = run_cli(capsys, "compare", b, other)
    assert rc == codes.COMPARE_INPUT and "nothing can be compared" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "x", \n')
    rc, out, err = run_cli(capsys, "compare", b, str(bad))
    assert rc == codes.COMPARE_INPUT and "bad.jsonl:1" in err
    rc, out, err = run_cli(capsys, "compare", b, str(tmp_path / "missing.jsonl"))
    assert rc == codes.COMPARE_INPUT and "cannot read" in err
