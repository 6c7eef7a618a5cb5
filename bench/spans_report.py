"""Where a profiled step's time goes, per worker and per call, from the raw span records that
`bench/stream_bench.py --spans DIR` saves (one .npz per config and variant).

    PYTHONPATH=. python bench/spans_report.py out/spans/1b_default.npz [--layer 1]

Two tables, medians over the profiled steps after the first:
* per worker: the step (first wait to last end), each worker's summed body time (mean and busiest), its
  summed wait before bodies, and how long it sat idle after its last instance. With every dependency wait
  passed at once (MEGART_DIAG_NO_WAIT=3) the busiest worker's body time is what the instances alone cost;
  the per-kind rows say which calls make it.
* one layer's calls: first begin, median end and last end, in us from the step's start (the spread between
  the median and the last end is the call's straggler tail);
* a layer's hops: the same three times of each call after the previous call's last end, medians over the
  middle layers (what each link of the dependency chain adds to the step);
* each call's bodies: the median instance's body and the last-ending instance's, medians over the middle
  layers. Where the last instance does more than the others (attention's: the chunk that arrives last also
  merges the head's partials), their difference is what that extra work costs the chain;
* each call's instances in six index bands: body and end after the call's last end per band (instances
  dealt a row pair less, or taking another code path, end apart from the rest);
* the step's ends: the calls after the last layer (in one step) and those before and in layer 0 (in the next),
  after the earlier step's last end: the boundary between two steps;
* with the phase marks (`--phases` records): a layer's chain event by event, each call's wait start, body
  begin, marks and end (min / median / max over its instances) after the layer's first call's last end.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megart.layout import SPAN  # noqa: E402
from megart.models.call_breakdown import call_kind  # noqa: E402

WORKER, WAIT, BEGIN, END, STEP, INSTANCE = (SPAN[k] for k in ("worker", "wait_start", "body_begin", "body_end",
                                                                "step", "instance"))
MARK0, MARK1 = SPAN["mark0"], SPAN["mark1"]
# An instance's events in order: the phase marks are stamped only by MEGART_PHASE_MARKS builds (0 otherwise).
EVENTS = (("wait starts", WAIT), ("body begins", BEGIN), ("mark 0", MARK0), ("mark 1", MARK1), ("end", END))


def load(path) -> tuple[np.ndarray, np.ndarray, list]:
    z = np.load(path)
    return z["records"].astype(np.int64), z["call_of"], [str(x) for x in z["labels"]]


def _step_rows(records, call_of, step):
    r = records[records[:, STEP] == step]
    ci = call_of[r[:, INSTANCE]]
    keep = ci >= 0
    return r[keep], ci[keep]


def per_worker(records, call_of, labels, step) -> dict:
    """One step: the step's span, per-worker sums (us) and, per call kind, the mean and busiest worker's body."""
    r, ci = _step_rows(records, call_of, step)
    kinds = list(dict.fromkeys(call_kind(lb) for lb in labels))
    kind = np.array([kinds.index(call_kind(lb)) for lb in labels])[ci]
    nw = int(r[:, WORKER].max()) + 1
    t0, t1 = r[:, WAIT].min(), r[:, END].max()
    body, wait = r[:, END] - r[:, BEGIN], r[:, BEGIN] - r[:, WAIT]
    last_end = np.full(nw, t0)
    np.maximum.at(last_end, r[:, WORKER], r[:, END])
    by_kind = np.zeros((len(kinds), nw))
    np.add.at(by_kind, (kind, r[:, WORKER]), body)
    per_w = np.bincount(r[:, WORKER], body, nw)
    return dict(step_us=(t1 - t0) / 1e3, body_mean_us=per_w.mean() / 1e3, body_max_us=per_w.max() / 1e3,
                wait_mean_us=np.bincount(r[:, WORKER], wait, nw).mean() / 1e3,
                idle_after_mean_us=(t1 - last_end).mean() / 1e3,
                kinds={k: (by_kind[i].mean() / 1e3, by_kind[i].max() / 1e3) for i, k in enumerate(kinds)})


def timeline(records, call_of, labels, step, prefix: str) -> list:
    """The calls whose label starts with `prefix` (say "L1."), in graph order: (label, first begin, median end,
    last end), us from the step's start."""
    r, ci = _step_rows(records, call_of, step)
    t0 = r[:, WAIT].min()
    rows = []
    for i, lb in enumerate(labels):
        if not lb.startswith(prefix):
            continue
        x = r[ci == i]
        if len(x):
            rows.append((lb, (x[:, BEGIN].min() - t0) / 1e3, np.median(x[:, END] - t0) / 1e3,   # (differences
                         (x[:, END].max() - t0) / 1e3))   # first: a float64 of the timer's ns is 256 ns coarse)
    return rows


def _layer(label: str) -> int | None:
    """n of a label "L<n>.<call>", None for a label outside a layer."""
    m = re.match(r"^L(\d+)\.", label)
    return int(m.group(1)) if m else None


def _layers(labels) -> tuple[list, list]:
    """The layer numbers of the labels, and the middle ones (the first and last left out where there are three
    or more): the layers a median over layers takes."""
    layers = sorted({n for lb in labels if (n := _layer(lb)) is not None})
    return layers, layers[1:-1] if len(layers) >= 3 else layers


def hops(records, call_of, labels, step) -> dict:
    """A layer's chain, one hop per call: for each call kind of the layers "L<n>." (the first and last layer
    left out where there are three or more), its first begin, median end and last end in us after the previous
    call's last end (the layer's first call: after the previous layer's last call), medians over the layers."""
    layers, mid = _layers(labels)
    rows: dict = {}
    prev_end = None
    for n in layers:
        for lb, b, me, le in timeline(records, call_of, labels, step, f"L{n}."):
            if prev_end is not None and n in mid:
                rows.setdefault(call_kind(lb), []).append((b - prev_end, me - prev_end, le - prev_end))
            prev_end = le
    return {k: tuple(float(np.median([r[j] for r in v])) for j in range(3)) for k, v in rows.items()}


def last_bodies(records, call_of, labels, step) -> dict:
    """Per call kind of the middle layers "L<n>.": (median instance body, the last-ending instance's body) in us,
    medians over the layers."""
    mid = set(_layers(labels)[1])
    r, ci = _step_rows(records, call_of, step)
    rows: dict = {}
    for i, lb in enumerate(labels):
        x = r[ci == i]
        if _layer(lb) not in mid or not len(x):
            continue
        body = (x[:, END] - x[:, BEGIN]) / 1e3
        rows.setdefault(call_kind(lb), []).append((float(np.median(body)), float(body[np.argmax(x[:, END])])))
    return {k: tuple(float(np.median([v[j] for v in vs])) for j in range(2)) for k, vs in rows.items()}


def by_instance(records, call_of, labels, step, bands: int = 6) -> dict:
    """Per call kind of the middle layers "L<n>.": its instances in index order (uid minus the call's first),
    cut into `bands` contiguous bands: (first index, last index, median body, median end after the call's last
    end), us, medians over the layers. Instances dealt unequal work (even_tiles: a row pair less for the last
    ones) or run on a different path show here as a band that ends apart from the others."""
    mid = set(_layers(labels)[1])
    r, ci = _step_rows(records, call_of, step)
    rows: dict = {}
    for i, lb in enumerate(labels):
        x = r[ci == i]
        if _layer(lb) not in mid or len(x) < bands:
            continue
        x = x[np.argsort(x[:, INSTANCE])]
        last = x[:, END].max()
        for j, band in enumerate(np.array_split(np.arange(len(x)), bands)):
            y = x[band]
            rows.setdefault(call_kind(lb), {}).setdefault(j, []).append(
                (int(band[0]), int(band[-1]), float(np.median(y[:, END] - y[:, BEGIN])) / 1e3,
                 float(np.median(y[:, END] - last)) / 1e3))
    return {k: [(v[0][0], v[0][1], float(np.median([t[2] for t in v])), float(np.median([t[3] for t in v])))
                for _, v in sorted(bs.items())] for k, bs in rows.items()}


def chain(records, call_of, labels, step) -> dict:
    """A layer's chain event by event: per (call kind, event) of the middle layers "L<n>.", (min, median, max)
    over the call's instances of the event's time in us after the last end of the layer's first call (qkv in
    the models), medians over the layers. Events: wait start, body begin, the two phase marks where the build
    stamped them (bench/stream_bench.py --phases: attention's "K/V attended" and "partials stored, arrival
    counted", a GEMV's "x staged" and "dots done"), body end."""
    mid = _layers(labels)[1]
    r, ci = _step_rows(records, call_of, step)
    rows: dict = {}
    for n in mid:
        calls = [i for i, lb in enumerate(labels) if _layer(lb) == n]   # (n is a layer of the labels: not empty)
        head = r[ci == calls[0]]
        if not len(head):
            continue
        t0 = head[:, END].max()
        for i in calls:
            x = r[ci == i]
            for name, col in EVENTS:
                v = x[:, col][x[:, col] > 0]
                if len(v):
                    rows.setdefault((call_kind(labels[i]), name), []).append(
                        np.percentile((v - t0) / 1e3, [0, 50, 100]))
    return {k: tuple(float(t) for t in np.median(np.array(v), axis=0)) for k, v in rows.items()}


def step_ends(records, call_of, labels) -> dict:
    """Across consecutive profiled steps, in us after the earlier step's last instance end: the calls that end a
    step (those after its last layer, in the earlier step: ("end", label)) and those that start one (before and
    in layer 0, in the later step: ("start", label)), each as first wait start / median body begin / median end /
    last end, medians over the pairs. How long one step's end and the next one's start take, and what of them
    overlapping the launches (LlamaModel.overlap_steps) hides."""
    layer_of = [_layer(lb) for lb in labels]
    in_layers = [i for i, n in enumerate(layer_of) if n is not None]
    if not in_layers:
        return {}
    calls = {"end": [i for i in range(len(labels)) if i > in_layers[-1]],
             "start": [i for i in range(len(labels)) if i < in_layers[0] or layer_of[i] == 0]}
    steps = sorted(set(records[:, STEP].tolist()))
    rows = {}
    for a, b in zip(steps, steps[1:]):
        if b != a + 1:
            continue
        ra, ca = _step_rows(records, call_of, a)
        t0 = ra[:, END].max()
        for tag, (r, ci) in (("end", (ra, ca)), ("start", _step_rows(records, call_of, b))):
            for i in calls[tag]:
                x = r[ci == i]
                if len(x):
                    rows.setdefault((tag, labels[i]), []).append(
                        ((x[:, WAIT].min() - t0) / 1e3, np.median(x[:, BEGIN] - t0) / 1e3,
                         np.median(x[:, END] - t0) / 1e3, (x[:, END].max() - t0) / 1e3))
    return {k: tuple(float(m) for m in np.median(np.array(v), axis=0)) for k, v in rows.items()}


def _median_of(dicts: list) -> dict:
    out = {k: float(np.median([d[k] for d in dicts])) for k in dicts[0] if k != "kinds"}
    out["kinds"] = {k: tuple(float(np.median([d["kinds"][k][j] for d in dicts])) for j in (0, 1))
                    for k in dicts[0]["kinds"]}
    return out


def report(path, layer: int = 1) -> str:
    records, call_of, labels = load(path)
    steps = sorted(set(records[:, STEP].tolist()))
    use = steps[1:] or steps          # the first profiled step is the least settled
    w = _median_of([per_worker(records, call_of, labels, s) for s in use])
    lines = [f"{Path(path).name}: {len(use)} steps, step {w['step_us']:.1f} us; per worker: body mean "
             f"{w['body_mean_us']:.1f} / busiest {w['body_max_us']:.1f}, waiting {w['wait_mean_us']:.1f}, idle after "
             f"its last instance {w['idle_after_mean_us']:.1f}",
             f"  {'kind':14s} {'body/worker':>12s} {'busiest':>9s}"]
    lines += [f"  {k:14s} {m:12.1f} {x:9.1f}" for k, (m, x) in w["kinds"].items()]
    mid = use[len(use) // 2]
    lines.append(f"  layer {layer}, step {mid} (us from the step's start): first begin / median end / last end")
    lines += [f"  {lb:14s} {b:8.1f} {me:8.1f} {le:8.1f}" for lb, b, me, le in
              timeline(records, call_of, labels, mid, f"L{layer}.")]
    h = hops(records, call_of, labels, mid)
    if h:
        lines.append(f"  a layer's hops, step {mid} (us after the previous call's last end, medians over the middle "
                     "layers): first begin / median end / last end")
        lines += [f"  {k:14s} {b:8.1f} {me:8.1f} {le:8.1f}" for k, (b, me, le) in h.items()]
    lb = last_bodies(records, call_of, labels, mid)
    if lb:
        lines.append(f"  each call's bodies, step {mid} (us, medians over the middle layers): median instance / the "
                     "last-ending instance / its extra")
        lines += [f"  {k:14s} {m:8.2f} {x:8.2f} {x - m:8.2f}" for k, (m, x) in lb.items()]
    bi = by_instance(records, call_of, labels, mid)
    if bi:
        lines.append(f"  each call's instances in index bands, step {mid} (medians over the middle layers): "
                     "first-last index: body us / end us after the call's last end")
        lines += [f"  {k:14s} " + "  ".join(f"{a}-{b}: {bd:.2f} / {e:.2f}" for a, b, bd, e in v) for k, v in bi.items()]
    se = step_ends(records, call_of, labels)
    if se:
        lines.append("  the step's ends (us after the previous step's last end, medians over consecutive steps): "
                     "first wait / median begin / median end / last end")
        lines += [f"  {('previous ' if tag == 'end' else '') + lb:22s} " + " ".join(f"{t:8.2f}" for t in v)
                  for (tag, lb), v in se.items()]
    ch = chain(records, call_of, labels, mid)
    if any(ev.startswith("mark") for _, ev in ch):
        lines.append(f"  a layer's chain, step {mid} (us after the layer's first call's last end, medians over the "
                     "middle layers): min / median / max over a call's instances")
        lines += [f"  {k:14s} {ev:12s} {a:7.2f} {m:7.2f} {b:7.2f}" for (k, ev), (a, m, b) in ch.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spans", nargs="+", help=".npz files from bench/stream_bench.py --spans")
    ap.add_argument("--layer", type=int, default=1, help="the layer whose call timeline is printed")
    args = ap.parse_args(argv)
    for p in args.spans:
        print(report(p, args.layer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
