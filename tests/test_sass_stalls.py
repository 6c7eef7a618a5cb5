"""bench/sass_stalls.py: stall samples per reason, opcode and code region from an ncu source-page CSV."""
import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import sass_stalls  # noqa: E402

HEADER = ["Address", "Source", sass_stalls.SAMPLES, "Warp Stall Sampling (Not-issued Samples)",
          sass_stalls.EXECUTED, "stall_long_sb", "stall_selected", "stall_wait", "stall_long_sb (Not Issued)"]


def _csv(tmp_path, rows, header=HEADER):
    path = tmp_path / "k_sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "megart_kernel", ""])
        w.writerow(header)
        for r in rows:
            w.writerow(r)
    return str(path)


ROWS = [  # address, source, samples, not-issued, executed, long_sb, selected, wait, long_sb (not issued)
    ["0x1000", "  F2FP.F16.E4M3.UNPACK_B R1, R2 ;", "10", "4", "64", "0", "6", "4", "0"],
    ["0x1010", "  FFMA R3, R1, R4, R3 ;", "5", "1", "64", "0", "4", "1", "0"],
    ["0x1020", "@!P0  FMUL R5, R5, R6 ;", "40", "40", "64", "38", "0", "2", "38"],
    ["0x9000", "  F2FP.F16.E4M3.UNPACK_B R7, R8 ;", "3", "0", "8", "0", "3", "0", "0"],
    ["0x9010", "  BRA 0x9000 ;", "0", "0", "8", "", "", "", ""],
]


def test_reasons_opcodes_and_regions(tmp_path):
    instrs = sass_stalls.read(_csv(tmp_path, ROWS))
    assert [i.address for i in instrs] == [0x1000, 0x1010, 0x1020, 0x9000, 0x9010]
    assert instrs[2].opcode == "FMUL"                       # the guard predicate is not the opcode
    # the "(Not Issued)" copies of the reasons are not counted twice
    assert sass_stalls.reasons(instrs) == {"long_sb": 38, "selected": 13, "wait": 7}
    ops = sass_stalls.by_opcode(instrs)
    assert ops["F2FP.F16.E4M3.UNPACK_B"][0] == 13 and ops["FMUL"] == (40, {"long_sb": 38, "wait": 2})
    # two clusters of the marker opcode (0x8000 bytes apart), each widened by one instruction on both sides
    # (the second one reaches back to the FMUL at offset 0x20)
    regions = sass_stalls.regions(instrs, "F2FP", pad=1)
    assert [(r["start"], r["end"], r["hits"], r["samples"]) for r in regions] == [(0x0, 0x10, 1, 15),
                                                                                 (0x20, 0x8010, 1, 43)]
    assert regions[1]["executed"] == 64 and regions[1]["stalls"]["long_sb"] == 38


def test_footprint_and_where_a_reason_falls(tmp_path):
    rows = ROWS + [["0x9020", "  EXIT ;", "0", "0", "0", "", "", "", ""]]   # never executed
    instrs = sass_stalls.read(_csv(tmp_path, rows))
    assert sass_stalls.footprint(instrs) == (5, 80)
    # long_sb only in the first 4 KB window (offset 0x20); wait in two windows, the first one first
    assert sass_stalls.windows(instrs, "long_sb") == [(0x0, 38, 55)]
    assert sass_stalls.windows(instrs, "wait") == [(0x0, 7, 55)]
    assert sass_stalls.windows(instrs, "selected") == [(0x0, 10, 55), (0x8000, 3, 3)]
    assert sass_stalls.windows(instrs, "no_inst") == []  # (a reason with no samples)


def test_cli_tables_and_bad_input(tmp_path, capsys):
    assert sass_stalls.main([_csv(tmp_path, ROWS), "--top", "2", "--around", "F2FP", "--reason", "long_sb"]) == 0
    out = capsys.readouterr().out
    assert "5 instructions, 58 samples; executed: 5 instructions (0.1 KB of code)" in out
    assert "long_sb" in out and "regions around F2FP" in out
    assert "where long_sb falls (38 samples, 65.5%)" in out and "0x20      38  @!P0  FMUL" in out
    # not a source page: named, exit 2, no traceback
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert sass_stalls.main([str(bad)]) == 2
    assert "no header row with 'Address' and 'Source'" in capsys.readouterr().err
    # a source page taken without SourceCounters
    assert sass_stalls.main([_csv(tmp_path, [r[:2] for r in ROWS], header=["Address", "Source"])]) == 2
    assert "--section SourceCounters" in capsys.readouterr().err
    # a page with no samples at all
    zero = [r[:2] + ["0"] + r[3:] for r in ROWS]
    assert sass_stalls.main([_csv(tmp_path, zero)]) == 2
    assert "no stall samples" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sass_stalls.main([])
