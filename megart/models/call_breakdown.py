"""Per-call views of a decode model's span records: which call each instance belongs to, and each call kind's
wall, busiest worker, body and wait time summed over layers (what bench/llama_decode.py and
bench/stream_bench.py print). A model's calls are its labelled task groups ("L3.gate_up", "lm_head", ...)."""
from __future__ import annotations

import numpy as np

from ..profile import BODY_BEGIN, BODY_END, INSTANCE, STEP, WAIT_START, WORKER, phase_parts


def call_kind(label: str) -> str:
    """'L3.gate_up' -> 'gate_up' (the per-layer calls of one kind are summed in breakdowns)."""
    head, _, rest = label.partition(".")
    return rest if rest and head[:1] == "L" and head[1:].isdigit() else label


def call_index(groups: dict, n_instances: int, n_uid: int = 0):
    """(the call labels of `groups` {label: task group}, in order; an int64 array mapping an instance uid to its
    call's position in them, -1 for an instance of no call), covering uids below max(n_uid, n_instances)."""
    labels = list(groups)
    call_of = np.full(max(n_uid, n_instances), -1, dtype=np.int64)
    for ci, lb in enumerate(labels):
        call_of[groups[lb].uids] = ci
    return labels, call_of


def call_breakdown(groups: dict, nw: int, prof) -> list:
    """Per call kind (qkv, attn, merge, o, gate_up, down, lm_head, ...; summed over layers), medians over
    the profiled steps, in us: `wall` (sum over the kind's calls of first body begin to last body end),
    `slow_cta` (sum over calls of the busiest worker's body time), `sum_cta` (all body time), `wait`
    (time workers spent waiting on events before this kind's instances), `wait_share`: that
    wait as a fraction of all worker-time in the step (nw x step wall), and `last_phases_us`: the body of
    each call's last-ending instance split at its phase marks (to mark 0, mark 0 to mark 1, mark 1 to
    the end; megart::span_mark in the device code), summed over the kind's calls."""
    rec = prof.records
    labels, call_of = call_index(groups, 0, int(rec[:, INSTANCE].max()) + 1 if len(rec) else 0)
    kinds = list(dict.fromkeys(call_kind(lb) for lb in labels))
    kind_of_call = np.array([kinds.index(call_kind(lb)) for lb in labels])
    per_step = {k: [] for k in ("wall", "slow_cta", "sum_cta", "wait", "wait_share")}
    phases = []
    nc, nk = len(labels), len(kinds)
    for st in prof.steps:
        r = rec[rec[:, STEP] == st]
        r = r[call_of[r[:, INSTANCE]] >= 0]
        ci = call_of[r[:, INSTANCE]]
        body = r[:, BODY_END] - r[:, BODY_BEGIN]
        wait = r[:, BODY_BEGIN] - r[:, WAIT_START]
        first = np.full(nc, np.iinfo(np.int64).max)
        last = np.zeros(nc, dtype=np.int64)
        np.minimum.at(first, ci, r[:, BODY_BEGIN])
        np.maximum.at(last, ci, r[:, BODY_END])
        present = last > 0
        wall_c = np.where(present, last - first, 0)
        per_w = np.zeros((nc, nw), dtype=np.int64)
        np.add.at(per_w, (ci, r[:, WORKER]), body)
        step_wall = prof.step_wall(st)
        acc = {k: np.zeros(nk) for k in per_step}
        np.add.at(acc["wall"], kind_of_call, wall_c)
        np.add.at(acc["slow_cta"], kind_of_call, per_w.max(axis=1))
        np.add.at(acc["sum_cta"], kind_of_call, np.bincount(ci, body, minlength=nc))
        np.add.at(acc["wait"], kind_of_call, np.bincount(ci, wait, minlength=nc))
        acc["wait_share"] = acc["wait"] / max(1, nw * step_wall)
        for k in per_step:
            per_step[k].append(acc[k])
        order = np.lexsort((r[:, BODY_END], ci))          # by call, then end: each call's last is its last row
        li = order[np.r_[np.flatnonzero(np.diff(ci[order])), len(order) - 1]] if len(order) else order
        ph_k = np.zeros((nk, 3))
        np.add.at(ph_k, kind_of_call[ci[li]], phase_parts(r[li]))
        phases.append(ph_k)
    out = []
    for i, kind in enumerate(kinds):
        calls = [lb for lb in labels if call_kind(lb) == kind]
        row = dict(kind=kind, calls=len(calls), instances=sum(len(groups[c].uids) for c in calls))
        for k, v in per_step.items():
            med = float(np.median([a[i] for a in v])) if v else 0.0
            row[k if k == "wait_share" else k + "_us"] = med if k == "wait_share" else med / 1e3
        row["last_phases_us"] = [float(np.median([a[i, j] for a in phases])) / 1e3 if phases else 0.0
                                 for j in range(3)]
        out.append(row)
    return out
