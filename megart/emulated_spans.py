"""Span records for a machine without a GPU: the compiled schedule played on a timing MODEL, so the
profile table and the timeline plots can be seen (and their code exercised) anywhere. Nothing here is
measured. The Profile carries source="emulated ..." and every report built from it says so.

The model: each instance takes a fixed dispatch cost plus the bytes its refs cover at one CTA's share
of the H200 read floor (4.53 TB/s over 132 CTAs); a worker starts waiting when its previous instance
ends and starts the body when every event it waits on has all its signals (a barrier: when every
worker has arrived). Instances run in the verifier's legal order, so the times respect the schedule.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from . import registry
from .layout import SPAN_WORDS
from .profile import Profile
from .tensors import TensorRef
from .verify import simulate

FLOOR_BW = 4.53e12            # H200 HBM read floor (16-byte loads), bytes/s
SMS = 132
DISPATCH_NS = 300.0           # one instance's fixed cost (measured: ~0.27-0.30 us per empty task)


def _bytes(inst) -> int:
    return sum(v.count * v.tensor.itemsize for v in inst.params.values() if isinstance(v, TensorRef))


def emulated_records(s, per_cta_bw: float = FLOOR_BW / SMS, dispatch_ns: float = DISPATCH_NS) -> np.ndarray:
    """One step of span records (step 1) for schedule `s` under the timing model."""
    order = simulate(s)
    signallers = defaultdict(list)
    for uid, evs in s.signals.items():
        for e in evs:
            signallers[e].append(uid)
    end, arrive = {}, {}
    rows = []
    for uid in order:
        inst, w = s.instances[uid], s.worker_of[uid]
        pos = s.pos_of[uid]
        wait_start = end[s.queues[w][pos - 1]] if pos > 0 else 0.0
        if inst.is_barrier:
            arrive[uid] = wait_start
        ready = wait_start
        for e in s.waits.get(uid, ()):
            for u in signallers[e]:
                # a barrier arrival signals as it arrives (before its wait); any other instance at its end
                t = arrive.get(u) if s.instances[u].is_barrier else end.get(u)
                if t is None:                  # an arrival whose queue head is not processed yet
                    q, p = s.worker_of[u], s.pos_of[u]
                    t = end[s.queues[q][p - 1]] if p > 0 else 0.0
                ready = max(ready, t)
        for u in s.polls.get(uid, ()):        # a polled read: its body starts once the words' writers ended
            ready = max(ready, end[u])
        body = 0.0 if inst.type.id in registry.NO_BODY else dispatch_ns + _bytes(inst) / per_cta_bw * 1e9
        end[uid] = ready + body
        rows.append((inst.type.id, uid, w, w, round(wait_start), round(ready), round(end[uid]), 1,
                     round(ready), round(ready)))   # (no phase marks in the model: both at the body's begin)
    return np.array(rows, dtype=np.int64).reshape(-1, SPAN_WORDS)


def emulated_profile(pk, per_cta_bw: float = FLOOR_BW / SMS, dispatch_ns: float = DISPATCH_NS) -> Profile:
    """A Profile of one modelled step of compiled kernel `pk`, labelled as emulated."""
    pk._need_compiled()
    rec = emulated_records(pk.schedule, per_cta_bw, dispatch_ns)
    src = (f"EMULATED (timing model: {dispatch_ns:.0f} ns per task + bytes at {per_cta_bw / 1e9:.1f} GB/s per CTA; "
           "not measured)")
    return Profile(rec, registry.names_by_id(), nw=pk.nw, source=src)
