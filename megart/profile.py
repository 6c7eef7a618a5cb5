"""Host-side analysis of the megakernel's in-kernel span records.

The device profiler writes one fixed-size record per executed task instance
(see ``SPAN_FIELDS``).  A persistent megakernel has no per-task launch
boundaries, so "how long did task X take" has several honest answers; this
module computes them all per step and summarises them over steps:

* ``slow_cta`` - the busiest worker's total body time for the task.  This is
  the critical-path cost if nothing else overlapped it.
* ``wall``     - first body begin to last body end; includes load imbalance
  and any interleaved work on the same workers.
* ``sum_cta``  - total body time over all workers (aggregate work).
* ``wait``     - time spent waiting on events before bodies could start.

Medians over steps are reported because the first steps are usually
perturbed (cold caches, clocks ramping) and a mean would hide that.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence, Union

import numpy as np

# The record layout is declared once, in megart.layout (the device header is generated from it).
from .layout import MARK_HIGH_SHIFT, SPAN_FIELDS, SPAN_WORDS  # noqa: E402

SPAN_COL: dict[str, int] = {name: i for i, name in enumerate(SPAN_FIELDS)}

TYPE_ID = SPAN_COL["type_id"]
INSTANCE = SPAN_COL["instance"]
WORKER = SPAN_COL["worker"]
SMID = SPAN_COL["smid"]
WAIT_START = SPAN_COL["wait_start"]
BODY_BEGIN = SPAN_COL["body_begin"]
BODY_END = SPAN_COL["body_end"]
STEP = SPAN_COL["step"]
MARK0 = SPAN_COL["mark0"]
MARK1 = SPAN_COL["mark1"]

TaskRef = Union[str, int, np.integer]


def phase_parts(rows: np.ndarray) -> np.ndarray:
    """(n, 3) ns per record: body begin to mark 0, mark 0 to mark 1, mark 1 to the body's end (the body split
    at its phase marks; an unmarked body has all of its time in the last part)."""
    return np.stack([rows[:, MARK0] - rows[:, BODY_BEGIN], rows[:, MARK1] - rows[:, MARK0],
                     rows[:, BODY_END] - rows[:, MARK1]], axis=1)


def stream_wait_parts(rows: np.ndarray) -> np.ndarray:
    """(n, 4) per record of a MEGART_STREAM_WAITS build (csrc/runtime.cuh), ns summed over the compute
    warps: waiting for weight stages to land, reading them (the dots), from the body's begin to the first
    stage request (x staging, the input's wait); and the stages read."""
    low = (1 << MARK_HIGH_SHIFT) - 1
    m0, m1 = rows[:, MARK0].astype(np.int64), rows[:, MARK1].astype(np.int64)
    return np.stack([m0 & low, m0 >> MARK_HIGH_SHIFT, m1 & low, m1 >> MARK_HIGH_SHIFT], axis=1)


_METRICS = ("slow_cta", "wall", "sum_cta", "wait")


@dataclass(frozen=True)
class Metric:
    """Distribution of one per-step quantity (ns) over the profiled steps.

    ``spread`` = (max - min) / median is a quick noise indicator: a large
    spread means the median should not be trusted without more steps.
    """

    median: float
    min: float
    max: float
    spread: float
    n: int

    @classmethod
    def of(cls, values: np.ndarray) -> "Metric":
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            raise ValueError("Metric of an empty series")
        med, lo, hi = float(np.median(v)), float(v.min()), float(v.max())
        if med != 0.0:
            spread = (hi - lo) / med
        else:
            spread = 0.0 if hi == lo else float("inf")
        return cls(median=med, min=lo, max=hi, spread=spread, n=int(v.size))

    def to_dict(self) -> dict:
        """JSON-safe dict (a non-finite spread becomes None)."""
        d = asdict(self)
        if not np.isfinite(d["spread"]):
            d["spread"] = None
        return d


def _as_records(records: np.ndarray, timed_marks: bool = True) -> np.ndarray:
    """Check shape/dtype and return the used rows (step != 0) as int64.

    A corrupted buffer must fail loudly rather than yield plausible-looking
    nonsense, so impossible timestamps raise with the offending row index.
    """
    arr = np.asarray(records)
    if arr.ndim != 2 or arr.shape[1] not in (SPAN_WORDS, MARK0):
        raise ValueError(
            f"span records must be a 2-D array with {SPAN_WORDS} columns "
            f"{SPAN_FIELDS} (or the first {MARK0}, without phase marks), got shape {arr.shape}"
        )
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"span records must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.shape[1] == MARK0:   # records written before the phase marks: unmarked (marks at the body's begin)
        arr = np.concatenate([arr, arr[:, [BODY_BEGIN, BODY_BEGIN]]], axis=1)
    used_idx = np.flatnonzero(arr[:, STEP] != 0)
    used = arr[used_idx]

    def _fail(mask: np.ndarray, what: str) -> None:
        bad = np.flatnonzero(mask)
        if bad.size == 0:
            return
        i = int(used_idx[bad[0]])
        r = arr[i]
        fields = " ".join(f"{n}={int(r[c])}" for n, c in SPAN_COL.items())
        raise ValueError(
            f"corrupt span buffer: row {i} has {what} ({fields}); "
            f"{bad.size} bad row(s) in total"
        )

    _fail(used[:, STEP] < 0, "a negative step")
    _fail(used[:, BODY_END] < used[:, BODY_BEGIN], "body_end < body_begin")
    _fail(used[:, BODY_BEGIN] < used[:, WAIT_START], "body_begin < wait_start")
    _fail(used[:, WORKER] < 0, "a negative worker")
    if timed_marks:  # (a MEGART_STREAM_WAITS build keeps counts in the mark words: stream_wait_parts)
        _fail((used[:, MARK0] < used[:, BODY_BEGIN]) | (used[:, MARK1] < used[:, BODY_BEGIN])
              | (used[:, MARK0] > used[:, BODY_END]) | (used[:, MARK1] > used[:, BODY_END]),
              "a phase mark outside its body")
    return np.ascontiguousarray(used)


class TaskStats:
    """Per-step timing of one task type (all its instances, all workers).

    Built by :meth:`Profile.by_task`; arrays hold one value per step in which
    the task ran, ordered by step (see ``steps``).
    """

    def __init__(self, rows: np.ndarray, name: str, type_id: int) -> None:
        self.name = name
        self.type_id = int(type_id)
        if rows.shape[0] == 0:
            raise ValueError(
                f"task {name!r} (id {type_id}) has no spans: "
                "profiling off, or wrong task id?"
            )
        order = np.lexsort((rows[:, INSTANCE], rows[:, STEP]))
        self._rows = rows[order]
        r = self._rows
        steps, sidx = np.unique(r[:, STEP], return_inverse=True)
        workers, widx = np.unique(r[:, WORKER], return_inverse=True)
        ns = steps.size
        body = r[:, BODY_END] - r[:, BODY_BEGIN]
        wait = r[:, BODY_BEGIN] - r[:, WAIT_START]

        per_worker = np.zeros((ns, workers.size), dtype=np.int64)
        np.add.at(per_worker, (sidx, widx), body)
        first = np.full(ns, np.iinfo(np.int64).max, dtype=np.int64)
        last = np.full(ns, np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(first, sidx, r[:, BODY_BEGIN])
        np.maximum.at(last, sidx, r[:, BODY_END])
        self._step_begin = first

        self.steps: list[int] = [int(s) for s in steps]
        self.slow_cta_ns: np.ndarray = per_worker.max(axis=1)
        self.wall_ns: np.ndarray = last - first
        self.sum_cta_ns: np.ndarray = per_worker.sum(axis=1)
        self.wait_ns: np.ndarray = np.zeros(ns, dtype=np.int64)
        np.add.at(self.wait_ns, sidx, wait)
        self.max_wait_ns: np.ndarray = np.zeros(ns, dtype=np.int64)
        np.maximum.at(self.max_wait_ns, sidx, wait)
        self.counts: np.ndarray = np.bincount(sidx, minlength=ns)

    # -- summary metrics ------------------------------------------------
    @property
    def slow_cta(self) -> Metric:
        return Metric.of(self.slow_cta_ns)

    @property
    def wall(self) -> Metric:
        return Metric.of(self.wall_ns)

    @property
    def sum_cta(self) -> Metric:
        return Metric.of(self.sum_cta_ns)

    @property
    def wait(self) -> Metric:
        return Metric.of(self.wait_ns)

    @property
    def max_wait(self) -> Metric:
        return Metric.of(self.max_wait_ns)

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def instances_per_step(self) -> Union[int, float]:
        """Instances per step: an int when constant, else the median."""
        lo, hi = int(self.counts.min()), int(self.counts.max())
        return lo if lo == hi else float(np.median(self.counts))

    def metric(self, which: str) -> Metric:
        if which not in _METRICS:
            raise ValueError(f"unknown metric {which!r}; expected one of {_METRICS}")
        return getattr(self, which)

    # -- raw data --------------------------------------------------------
    @property
    def instances(self) -> np.ndarray:
        """Raw (n, SPAN_WORDS) int64 rows of this task, sorted by (step, instance)."""
        return self._rows.copy()

    def per_instance(self, step: int | None = None) -> list[dict]:
        """One dict per instance; ``begin_ns`` is relative to that step's
        first body begin of this task, which makes stragglers easy to spot."""
        rows, sidx = self._rows, np.searchsorted(self.steps, self._rows[:, STEP])
        if step is not None:
            if step not in self.steps:
                raise ValueError(
                    f"task {self.name!r} has no spans in step {step}; "
                    f"steps present: {self.steps}"
                )
            keep = rows[:, STEP] == step
            rows, sidx = rows[keep], sidx[keep]
        rel = rows[:, BODY_BEGIN] - self._step_begin[sidx]
        return [
            {
                "step": int(r[STEP]),
                "instance": int(r[INSTANCE]),
                "worker": int(r[WORKER]),
                "smid": int(r[SMID]),
                "wait_ns": int(r[BODY_BEGIN] - r[WAIT_START]),
                "body_ns": int(r[BODY_END] - r[BODY_BEGIN]),
                "begin_ns": int(b),
                "mark0_ns": int(r[MARK0] - r[BODY_BEGIN]),
                "mark1_ns": int(r[MARK1] - r[BODY_BEGIN]),
            }
            for r, b in zip(rows, rel)
        ]

    def phases(self) -> dict:
        """The body split at its phase marks (megart::span_mark in the device code), in ns, medians over
        steps: ``to_mark0``, ``mark0_to_mark1``, ``mark1_to_end`` of the instance that ended last in each
        step (the one the next call waits for, ``last_*``), and each part's median over the instances
        (``median_*``).
        A body without marks has all of its time in ``mark1_to_end``."""
        names = ("to_mark0", "mark0_to_mark1", "mark1_to_end")
        last, med = [], []
        for s in self.steps:
            r = self._rows[self._rows[:, STEP] == s]
            parts = phase_parts(r)
            last.append(parts[int(np.argmax(r[:, BODY_END]))])
            med.append(np.median(parts, axis=0))
        out = {f"last_{n}": float(np.median([x[i] for x in last])) for i, n in enumerate(names)}
        out.update({f"median_{n}": float(np.median([x[i] for x in med])) for i, n in enumerate(names)})
        return out

    def achieved_bandwidth(self, bytes_per_step: float, metric: str = "wall") -> float:
        """Bytes/s moved if ``bytes_per_step`` bytes took the median ``metric``."""
        med = self.metric(metric).median
        if med <= 0:
            raise ValueError(f"task {self.name!r}: median {metric} is 0 ns")
        return float(bytes_per_step) / (med * 1e-9)

    def to_dict(self) -> dict:
        """JSON-ready summary; all times in ns."""
        d: dict = {
            "name": self.name,
            "type_id": self.type_id,
            "n_steps": self.n_steps,
            "instances_per_step": self.instances_per_step,
        }
        for m in (*_METRICS, "max_wait"):
            d[m] = getattr(self, m).to_dict()
        return d

    def __repr__(self) -> str:
        return (
            f"TaskStats({self.name!r}, id={self.type_id}, steps={self.n_steps}, "
            f"wall_med={self.wall.median:.0f}ns)"
        )


class Profile:
    """All span records of one profiled run, with task names attached.

    ``overflow`` is the device's count of records it had to drop because the
    buffer was full; when non-zero every statistic is potentially partial.
    """

    def __init__(
        self,
        records: np.ndarray,
        task_names: Mapping[int, str] | None = None,
        overflow: int = 0,
        nw: int | None = None,
        source: str = "measured",
        timed_marks: bool = True,
    ) -> None:
        #: timed_marks=False: the mark words hold MEGART_STREAM_WAITS counts, not times (stream_wait_parts)
        self.records: np.ndarray = _as_records(records, timed_marks)
        #: "measured" (the device's span buffer), or a description of a model (megart.emulated_spans)
        self.source = str(source)
        self.task_names: dict[int, str] = {int(k): str(v) for k, v in (task_names or {}).items()}
        self.overflow = int(overflow)
        workers = self.records[:, WORKER]
        seen_nw = int(workers.max()) + 1 if workers.size else 0
        if nw is not None and seen_nw > nw:
            raise ValueError(f"span record has worker {seen_nw - 1} but nw={nw}")
        self.nw: int = int(nw) if nw is not None else seen_nw
        self._cache: dict[int, TaskStats] = {}

    @property
    def emulated(self) -> bool:
        return self.source != "measured"

    # -- naming ------------------------------------------------------------
    def task_name(self, type_id: int) -> str:
        """Name of a type id; ids without a name are labelled ``task<id>``."""
        return self.task_names.get(int(type_id), f"task{int(type_id)}")

    def resolve(self, task: TaskRef) -> int:
        """Map a task name or numeric id to its type id."""
        if isinstance(task, (int, np.integer)) and not isinstance(task, bool):
            return int(task)
        if isinstance(task, str):
            for tid, name in self.task_names.items():
                if name == task:
                    return tid
            m = re.fullmatch(r"task(\d+)", task)
            if m and int(m.group(1)) not in self.task_names:
                return int(m.group(1))
            known = sorted(set(self.task_names.values()))
            raise KeyError(f"unknown task name {task!r}; known names: {known}")
        raise TypeError(f"task must be a name or an integer id, got {type(task).__name__}")

    # -- queries -----------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        return [int(s) for s in np.unique(self.records[:, STEP])]

    def task_ids(self) -> list[int]:
        return [int(t) for t in np.unique(self.records[:, TYPE_ID])]

    def by_task(self, task: TaskRef) -> TaskStats:
        tid = self.resolve(task)
        if tid not in self._cache:
            rows = self.records[self.records[:, TYPE_ID] == tid]
            self._cache[tid] = TaskStats(rows, self.task_name(tid), tid)
        return self._cache[tid]

    def step_wall(self, step: int) -> int:
        """Whole-step time: last body end minus first wait start (ns)."""
        rows = self.records[self.records[:, STEP] == step]
        if rows.shape[0] == 0:
            raise ValueError(f"no spans for step {step}; steps present: {self.steps}")
        return int(rows[:, BODY_END].max() - rows[:, WAIT_START].min())

    def step_walls(self) -> np.ndarray:
        return np.array([self.step_wall(s) for s in self.steps], dtype=np.int64)

    # -- reports -----------------------------------------------------------
    def summary(self) -> list[dict]:
        """One dict per task type present (medians over steps, in us)."""
        out = []
        for tid in self.task_ids():
            ts = self.by_task(tid)
            out.append(
                {
                    "name": ts.name,
                    "type_id": tid,
                    "instances_per_step": ts.instances_per_step,
                    "slow_cta_us": ts.slow_cta.median / 1e3,
                    "wall_us": ts.wall.median / 1e3,
                    "sum_cta_us": ts.sum_cta.median / 1e3,
                    "wait_us": ts.wait.median / 1e3,
                }
            )
        return out

    def table(self) -> str:
        """Plain-text table of :meth:`summary` (medians over steps, us)."""
        lines: list[str] = []
        if self.emulated:
            lines.append(self.source)
        if self.overflow > 0:
            lines.append(
                f"WARNING: {self.overflow} span records were dropped (profile "
                "buffer full); statistics are incomplete"
            )
        if self.records.shape[0] == 0:
            lines.append("no span records (profiling off?)")
            return "\n".join(lines)
        walls = self.step_walls()
        lines.append(
            f"{len(self.steps)} steps, {self.nw} workers, step wall med "
            f"{np.median(walls) / 1e3:.2f} us (medians over steps, times in us)"
        )
        header = ("task", "id", "inst/step", "slowCTA med", "wall med", "sumCTA med", "wait med")
        body: list[Sequence[str]] = []
        for d in self.summary():
            ips = d["instances_per_step"]
            body.append(
                (
                    d["name"],
                    str(d["type_id"]),
                    str(ips) if isinstance(ips, int) else f"{ips:g}",
                    *(f"{d[k]:.2f}" for k in ("slow_cta_us", "wall_us", "sum_cta_us", "wait_us")),
                )
            )
        widths = [max(len(r[i]) for r in (header, *body)) for i in range(len(header))]

        def fmt(r: Sequence[str]) -> str:
            first = r[0].ljust(widths[0])
            rest = (c.rjust(w) for c, w in zip(r[1:], widths[1:]))
            return "  ".join((first, *rest))

        lines.append(fmt(header))
        lines.extend(fmt(r) for r in body)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Profile({self.records.shape[0]} spans, steps={len(self.steps)}, "
            f"tasks={len(self.task_ids())}, nw={self.nw}, overflow={self.overflow}"
            + (", EMULATED)" if self.emulated else ")")
        )
