"""Visualise megakernel span records: Chrome/Perfetto JSON and a PNG timeline.

A persistent megakernel looks like one opaque launch to Nsight; these views
recover what each worker (CTA) did and when, which is where scheduling gaps,
stragglers and event-wait chains become visible.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

import numpy as np

from megart.profile import (
    BODY_BEGIN,
    BODY_END,
    INSTANCE,
    SMID,
    STEP,
    TYPE_ID,
    WAIT_START,
    WORKER,
    Profile,
)

PathLike = Union[str, os.PathLike]

KERNEL_PID = 0


def _worker_sms(records: np.ndarray, worker: int) -> str:
    """SM id(s) a worker ran on; normally one, since the kernel is persistent."""
    sms = np.unique(records[records[:, WORKER] == worker, SMID])
    return "/".join(str(int(s)) for s in sms) if sms.size else "?"


def to_chrome_trace(profile: Profile, path: PathLike | None = None) -> dict:
    """Build a trace-event JSON dict (open in ui.perfetto.dev or chrome://tracing).

    One process for the kernel, one thread per worker; a complete ("X") event
    per task body and a separate ``wait:<task>`` event for any time spent
    waiting on events before it.  ``ts``/``dur`` are microseconds (floats),
    relative to the earliest record so the numbers stay readable.
    """
    rec = profile.records
    t0 = int(rec[:, WAIT_START].min()) if rec.shape[0] else 0
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": KERNEL_PID, "tid": 0,
         "args": {"name": "megart megakernel"}},
    ]
    for w in sorted({int(w) for w in rec[:, WORKER]}):
        events.append({"ph": "M", "name": "thread_name", "pid": KERNEL_PID, "tid": w,
                       "args": {"name": f"worker {w} (SM {_worker_sms(rec, w)})"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": KERNEL_PID, "tid": w,
                       "args": {"sort_index": w}})

    order = np.lexsort((rec[:, BODY_BEGIN], rec[:, WORKER]))
    for r in rec[order]:
        name = profile.task_name(int(r[TYPE_ID]))
        args = {"instance": int(r[INSTANCE]), "step": int(r[STEP]), "type_id": int(r[TYPE_ID])}
        w = int(r[WORKER])
        wait = int(r[BODY_BEGIN] - r[WAIT_START])
        if wait > 0:
            events.append({"name": f"wait:{name}", "cat": "wait", "ph": "X",
                           "pid": KERNEL_PID, "tid": w,
                           "ts": (int(r[WAIT_START]) - t0) / 1e3, "dur": wait / 1e3,
                           "args": dict(args)})
        events.append({"name": name, "cat": "task", "ph": "X",
                       "pid": KERNEL_PID, "tid": w,
                       "ts": (int(r[BODY_BEGIN]) - t0) / 1e3,
                       "dur": int(r[BODY_END] - r[BODY_BEGIN]) / 1e3,
                       "args": args})

    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"t0_ns": t0, "nw": profile.nw, "overflow": profile.overflow,
                      "steps": profile.steps, "source": profile.source},
    }
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def plot_timeline(
    profile: Profile,
    path: PathLike,
    step: int | None = None,
    title: str | None = None,
) -> Path:
    """Render one step as a per-worker Gantt chart PNG and return its path.

    Uses matplotlib's Agg canvas directly (no pyplot), so it works headless
    and never touches the user's global backend; matplotlib is imported here
    so that ``import megart.trace`` stays cheap.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    steps = profile.steps
    if not steps:
        raise ValueError("profile has no span records (profiling off?)")
    step = steps[-1] if step is None else int(step)
    if step not in steps:
        raise ValueError(f"step {step} not profiled; steps present: {steps}")
    rec = profile.records[profile.records[:, STEP] == step]
    t0 = int(rec[:, WAIT_START].min())
    workers = list(range(profile.nw))

    task_ids = profile.task_ids()  # colour by global id order: stable across steps
    palette = _colours(len(task_ids))
    colour = {tid: palette[i] for i, tid in enumerate(task_ids)}

    fig = Figure(figsize=(12, min(40.0, 1.5 + 0.3 * len(workers))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    begin_us = (rec[:, BODY_BEGIN] - t0) / 1e3
    body_us = (rec[:, BODY_END] - rec[:, BODY_BEGIN]) / 1e3
    wait_start_us = (rec[:, WAIT_START] - t0) / 1e3
    wait_us = (rec[:, BODY_BEGIN] - rec[:, WAIT_START]) / 1e3
    y = rec[:, WORKER]

    has_wait = wait_us > 0
    if has_wait.any():
        ax.barh(y[has_wait], wait_us[has_wait], left=wait_start_us[has_wait],
                height=0.8, color="0.85", edgecolor="none")
    present = [tid for tid in task_ids if (rec[:, TYPE_ID] == tid).any()]
    for tid in present:
        m = rec[:, TYPE_ID] == tid
        ax.barh(y[m], body_us[m], left=begin_us[m], height=0.8, color=colour[tid],
                edgecolor="none")

    ax.set_yticks(workers)
    sms = {w: _worker_sms(rec, w) for w in workers}
    ax.set_yticklabels([f"w{w} (SM {sms[w]})" if sms[w] != "?" else f"w{w} (idle)"
                        for w in workers], fontsize=7)
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ax.set_xlabel("time since step start (us)")
    ax.set_ylabel("worker")
    ax.set_title(_label(profile, title or f"megart step {step}: wall {profile.step_wall(step) / 1e3:.2f} us"))
    handles = [Patch(color=colour[tid], label=profile.task_name(tid)) for tid in present]
    handles.append(Patch(color="0.85", label="wait"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def _label(profile: Profile, title: str) -> str:
    """Titles of emulated profiles say so, whatever the caller asked for."""
    return f"{title}\n{profile.source}" if profile.emulated else title


def _colours(n: int) -> list:
    """Distinct colours for n task types (tab10, then tab20, then a continuous map)."""
    from matplotlib import colormaps

    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(n)]
    cmap = colormaps["turbo"]
    return [cmap(i / max(1, n - 1)) for i in range(n)]
