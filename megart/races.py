"""Unordered writers: two instances of one barrier epoch that write overlapping bytes with nothing in
the schedule ordering them. Their result depends on timing, so the verifier refuses them.

Inferred instances are ordered with every earlier overlapping access by construction (graph.py), so
only pairs where at least one side was built with infer=False need checking. "Ordered" means the
schedule makes one wait for the other: through its own queue, or through the events it waits on.
"""
from __future__ import annotations

from collections import defaultdict

from .schedule import Schedule


def _writes(s: Schedule):
    """(epoch, storage key) -> [(lo, hi, uid, tensor name)] of every written byte range."""
    out = defaultdict(list)
    for inst in s.graph.instances:
        for p in inst.type.params:
            ref = inst.params.get(p.name)
            if p.writes and ref is not None:
                for lo, hi in inst.type.byte_ranges(inst.params, p.name):
                    out[(inst.epoch, ref.tensor.storage_key)].append((lo, hi, inst.uid, ref.tensor.name))
    return out


def _overlapping_pairs(s: Schedule):
    """Pairs of distinct instances writing overlapping bytes, at least one of them not inferred."""
    insts = s.graph.instances
    for ranges in _writes(s).values():
        if all(insts[u].inferred for _, _, u, _ in ranges):
            continue
        ranges.sort()
        active = []                                  # ranges that may still overlap the next one
        for lo, hi, uid, name in ranges:
            active = [a for a in active if a[1] > lo]
            for alo, ahi, auid, aname in active:
                if auid != uid and not (insts[auid].inferred and insts[uid].inferred):
                    yield (min(auid, uid), max(auid, uid)), (max(lo, alo), min(hi, ahi)), aname, name
            active.append((lo, hi, uid, name))


class _Order:
    """Who the schedule makes wait for whom, within one barrier epoch (memoised ancestor sets)."""

    def __init__(self, s: Schedule):
        self.s = s
        self.signallers = defaultdict(list)
        for uid, evs in s.signals.items():
            for e in evs:
                self.signallers[e].append(uid)
        self.memo: dict = {}

    def ancestors(self, uid: int) -> set:
        if uid in self.memo:
            return self.memo[uid]
        s, epoch = self.s, self.s.instances[uid].epoch
        seen, todo = set(), [uid]
        while todo:
            u = todo.pop()
            w, pos = s.worker_of[u], s.pos_of[u]
            preds = [s.queues[w][pos - 1]] if pos > 0 else []
            for e in s.waits.get(u, ()):
                preds.extend(self.signallers[e])
            for p in preds:
                if p not in seen and s.instances[p].epoch == epoch and not s.instances[p].is_barrier:
                    seen.add(p)
                    todo.append(p)
        self.memo[uid] = seen
        return seen

    def ordered(self, a: int, b: int) -> bool:
        return a in self.ancestors(b) or b in self.ancestors(a)


def unordered_writers(s: Schedule, limit: int = 8) -> list[dict]:
    """Up to `limit` unordered pairs: {a, b (uids), tensor, bytes (lo, hi) relative to the tensor}."""
    order = _Order(s)
    found, seen = [], set()
    for (a, b), (lo, hi), name_a, name_b in _overlapping_pairs(s):
        if (a, b) in seen:
            continue
        seen.add((a, b))
        if not order.ordered(a, b):
            t = s.graph.tensors[name_a]
            found.append(dict(a=a, b=b, tensor=name_a, other_tensor=name_b, bytes=(lo - t.ptr, hi - t.ptr)))
            if len(found) >= limit:
                break
    return found
