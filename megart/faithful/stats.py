"""This task's numbers out of the megakernel's span records, matched by NUMERIC task id (and, inside
a whole model, by the instance ids of the calls under test), never by name.

Per (step, call) sample, over the call's instances only:

* slowCTA  = max over workers of that worker's summed body time for the call (with one instance per
             worker: the slowest single-CTA body). The verdict metric.
* wall     = last body end - first body begin (the call's makespan, dispatch stagger included).
* sumCTA   = total body time over all workers (busy CTA-time; the anti-sloughing guard).
* CTAs     = distinct workers that ran an instance of the call.

Each metric is summarised over the samples as median / min / max / spread ((max-min)/median) /
noise ((p90-p10)/median) / n. In isolated context there is one call, so samples = steps.
"""
from __future__ import annotations

import numpy as np

from ..profile import INSTANCE, STEP, TYPE_ID, WORKER, Metric, TaskStats

METRICS = ("slow_cta", "wall", "sum_cta")


def metric_dict(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    d = Metric.of(v).to_dict()
    med = d["median"]
    p10, p90 = np.percentile(v, [10, 90])
    d["noise"] = float((p90 - p10) / med) if med > 0 else None
    return d


def task_timings(records: np.ndarray, type_id: int, calls: list | None = None, name: str = "") -> dict:
    """`records`: (n, SPAN_WORDS) int64 span rows (Profile.records); `calls`: one collection of
    instance uids per call under test (None: every instance of the type is one call)."""
    rows = records[records[:, TYPE_ID] == int(type_id)]
    if rows.shape[0] == 0:
        raise ValueError(f"no spans with task id {type_id} ({name or '?'}): profiling off, or the task did not run")
    groups = [rows] if calls is None else [rows[np.isin(rows[:, INSTANCE], np.fromiter(c, dtype=np.int64))]
                                           for c in calls]
    slow, wall, summ, ctas, steps, per_call = [], [], [], [], set(), []
    for g in groups:
        if g.shape[0] == 0:
            continue
        ts = TaskStats(g, name, type_id)
        slow.extend(ts.slow_cta_ns.tolist())
        wall.extend(ts.wall_ns.tolist())
        summ.extend(ts.sum_cta_ns.tolist())
        for s in ts.steps:
            ctas.append(int(np.unique(g[g[:, STEP] == s, WORKER]).size))
        steps.update(ts.steps)
        per_call.append(int(np.median(ts.counts)))
    if not slow:
        raise ValueError(f"none of the {len(groups)} call(s) under test has spans (task id {type_id})")
    return {
        "slow_cta": metric_dict(slow),
        "wall": metric_dict(wall),
        "sum_cta": metric_dict(summ),
        "raw": {"slow_cta": slow, "wall": wall, "sum_cta": summ},
        "samples": len(slow),
        "steps": len(steps),
        "calls": len(per_call),
        "instances_per_call": int(np.median(per_call)),
        "ctas_per_step": float(np.median(ctas)),
    }


def pool_runs(runs: list[dict]) -> dict:
    """Metrics over the pooled samples of several repeats, each with `runs` (the per-repeat medians) and
    `run_spread` = (max - min) / median of those medians: the run-to-run spread compare uses as noise."""
    out = {}
    for m in METRICS:
        d = metric_dict([v for r in runs for v in r["raw"][m]])
        meds = [r[m]["median"] for r in runs]
        mid = float(np.median(meds))
        d["runs"] = meds
        d["run_spread"] = float((max(meds) - min(meds)) / mid) if mid > 0 else 0.0
        out[m] = d
    return out
