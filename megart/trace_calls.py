"""What a reader of a step timeline looks for, which the per-worker chart (trace.plot_timeline: one row
per worker, the whole step) is too coarse to show: where each CALL starts and ends, the gaps between
calls, and how much of each call kind's worker-time is body and how much is waiting.

    calls = trace_calls.calls_of(pk)                 # {call label: instance uids}, program order
    trace_calls.plot_calls(prof, calls, "calls.png", zoom="L0.")
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Union

import numpy as np

from .profile import BODY_BEGIN, BODY_END, INSTANCE, STEP, WAIT_START, Profile

PathLike = Union[str, os.PathLike]
MAX_ZOOM_ROWS = 16


def calls_of(pk) -> dict:
    """{label: uids} of every task call of a kernel in program order (grid barriers left out); a label
    used twice gets its call index appended."""
    groups = [g for g in pk.graph.groups if g.uids and not pk.graph.instances[g.uids[0]].is_barrier]
    seen = {}
    for g in groups:
        seen[g.label] = seen.get(g.label, 0) + 1
    return {(g.label if seen[g.label] == 1 else f"{g.label}#{g.index}"): list(g.uids) for g in groups}


def layer_kind(label: str) -> str:
    """'L3.gate_up' -> 'gate_up': calls of one kind in every layer are summed in the kind bars."""
    m = re.fullmatch(r"L\d+\.(.+)", label)
    return m.group(1) if m else label


def call_spans(profile: Profile, calls: dict, step: int) -> list[dict]:
    """Per call (in the given order): first wait start, first body begin, last body end, body and wait
    worker-time (ns), for one step. Calls with no records in that step are left out."""
    rec = profile.records[profile.records[:, STEP] == step]
    uid = rec[:, INSTANCE]
    out = []
    for label, uids in calls.items():
        r = rec[np.isin(uid, np.asarray(uids, dtype=np.int64))]
        if not len(r):
            continue
        out.append(dict(label=label, wait_start=int(r[:, WAIT_START].min()), begin=int(r[:, BODY_BEGIN].min()),
                        end=int(r[:, BODY_END].max()), body=int((r[:, BODY_END] - r[:, BODY_BEGIN]).sum()),
                        wait=int((r[:, BODY_BEGIN] - r[:, WAIT_START]).sum()), instances=len(r)))
    return out


def plot_calls(profile: Profile, calls: dict, path: PathLike, step: int | None = None, zoom: str | None = None,
               kind_of: Callable[[str], str] = layer_kind, title: str | None = None) -> Path:
    """Two panels: (1) a zoom on the calls whose label starts with `zoom` (default: the first layer's
    "L0." calls if there are any, else the first calls), each call's span from its first body begin to its
    last body end, the time its instances waited before the first began, and the gap after the previous
    call; (2) per call kind, the worker-time in bodies and in waits over the whole step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not profile.steps:
        raise ValueError("profile has no span records (profiling off?)")
    step = profile.steps[-1] if step is None else int(step)
    spans = call_spans(profile, calls, step)
    if not spans:
        raise ValueError(f"no records of the given calls in step {step}")
    t0 = min(s["wait_start"] for s in spans)
    if zoom is None:
        zoom = "L0." if any(s["label"].startswith("L0.") for s in spans) else ""
    zs = [s for s in spans if s["label"].startswith(zoom)][:MAX_ZOOM_ROWS]
    kinds: dict = {}
    for s in spans:
        k = kinds.setdefault(kind_of(s["label"]), [0, 0])
        k[0] += s["body"]
        k[1] += s["wait"]

    fig = Figure(figsize=(12, 2.5 + 0.35 * (len(zs) + len(kinds))), dpi=100)
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(2, 1, gridspec_kw={"height_ratios": [max(2, len(zs)), max(2, len(kinds))]})
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    prev_end = None
    for i, s in enumerate(zs):
        ax.barh(i, us(s["begin"]) - us(s["wait_start"]), left=us(s["wait_start"]), height=0.6, color="0.85")
        ax.barh(i, (s["end"] - s["begin"]) / 1e3, left=us(s["begin"]), height=0.6, color="tab:blue")
        note = f"{(s['end'] - s['begin']) / 1e3:.2f} us"
        if prev_end is not None:
            gap = (s["begin"] - prev_end) / 1e3
            note += f", {'gap' if gap >= 0 else 'overlap'} {abs(gap):.2f} us after the previous call"
            ax.plot([us(prev_end), us(s["begin"])], [i - 0.5, i - 0.3], color="tab:red", linewidth=1)
        ax.text(us(s["end"]), i, "  " + note, va="center", fontsize=7)
        prev_end = s["end"]
    ax.set_yticks(range(len(zs)))
    ax.set_yticklabels([f"{s['label']} ({s['instances']})" for s in zs], fontsize=8)
    ax.set_ylim(len(zs) - 0.5, -0.7)
    ax.set_xlabel("us since the step's first wait")
    ax.set_xlim(0, us(max(s["end"] for s in zs)) * 1.45)       # room for the notes
    ax.legend(handles=[Patch(color="0.85", label="waiting before the call's first body"),
                       Patch(color="tab:blue", label="call: first body begin to last body end"),
                       Patch(color="tab:red", label="gap after the previous call")], fontsize=7, loc="upper right")
    ax.set_title(f"calls {zoom + '* ' if zoom else ''}of step {step}", fontsize=10)
    names = list(kinds)
    body = np.array([kinds[k][0] for k in names]) / 1e3
    wait = np.array([kinds[k][1] for k in names]) / 1e3
    bx.barh(range(len(names)), body, color="tab:blue", label="body")
    bx.barh(range(len(names)), wait, left=body, color="0.7", label="wait")
    bx.set_yticks(range(len(names)))
    bx.set_yticklabels(names, fontsize=8)
    bx.set_ylim(len(names) - 0.5, -0.5)
    bx.set_xlabel("worker-time in the step (us, summed over instances and layers)")
    bx.legend(fontsize=8, loc="lower right")
    head = title or f"megart step {step}: wall {profile.step_wall(step) / 1e3:.2f} us"
    fig.suptitle(f"{head}\n{profile.source}" if profile.emulated else head, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
