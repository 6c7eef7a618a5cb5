"""Helpers for the faithful gate's CPU tests: synthetic gate results (one FAITHFUL_RESULT record) and the CLI
run in-process."""
from __future__ import annotations

import json
from pathlib import Path

from megart.faithful import compare as cmp
from megart.faithful.cli import main


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def rec(slow, wall, summ, *, noise=0.02, ctas=132, tiles=132, task="gemv_m1", shape="8192x2048", nw=132,
        context="isolated", sha="aaaa", ok=True, floor=4.2e12):
    def m(v):
        return {"median": v, "min": v * (1 - noise / 2), "max": v * (1 + noise / 2), "spread": noise,
                "noise": noise, "n": 50}
    return {"task": task, "shape": shape, "nw": nw, "context": context, "kernel_sha": sha, "tiles": tiles,
            "ctas_per_step": ctas, "correctness": {"cos": 0.9999 if ok else 0.5, "pass": ok},
            "timings": {"slow_cta": m(slow), "wall": m(wall), "sum_cta": m(summ)}, "floor_bw": floor}


def write_jsonl(path: Path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def verdict_of(base, cand, **kw):
    vs, _ = cmp.compare([base], [cand], **kw)
    assert len(vs) == 1
    return vs[0]
