"""Placement of instances on worker queues and the events that order them.

Policy (documented in docs/ARCHITECTURE.md): instances keep program order. A pinned instance goes
to its worker; the rest are dealt round robin from a cursor that runs on across calls, so small
calls spread over the grid instead of piling onto worker 0. Grid barriers put one arrival on every
queue. Each dependency becomes a wait on an event counter: a whole producer call is one event
(count = its instances); a consumer that needs only a few instances of a call waits on those
instances' own events instead, so it can start before the rest of the call lands. A dependency on
an earlier instance of the same queue needs no wait at all.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from . import registry
from .errors import GraphError
from .graph import Graph, Instance
from .layout import FLAG_SIGNAL_FIRST, MAX_SIGNALS, MAX_WAITS

FINE_GRAINED_LIMIT = 2  # wait on at most this many single-instance events per producer call


@dataclass
class EventInfo:
    name: str
    count: int  # signals per step; a waiter in step g needs count * g


@dataclass
class Schedule:
    nw: int
    graph: Graph
    instances: list                 # uid -> Instance: the graph's, then runtime-added join entries
    queues: list                    # worker -> [uid, ...] in execution order
    waits: dict                     # uid -> [event id, ...]
    signals: dict                   # uid -> [event id, ...]
    events: list                    # event id -> EventInfo
    worker_of: dict = field(default_factory=dict)
    pos_of: dict = field(default_factory=dict)

    def flags(self, uid: int) -> int:
        return FLAG_SIGNAL_FIRST if self.instances[uid].is_barrier else 0

    @property
    def total_instances(self) -> int:
        return sum(len(q) for q in self.queues)

    def describe(self, uid: int) -> str:
        inst = self.instances[uid]
        return (f"{inst.label()} (call {self.graph.groups[inst.group].label!r}, worker {self.worker_of[uid]}, "
                f"queue position {self.pos_of[uid]})")


def place(graph: Graph) -> tuple[list, dict]:
    nw = graph.nw
    queues = [[] for _ in range(nw)]
    worker_of = {}
    cursor = 0
    for inst in graph.instances:
        if inst.worker is not None:
            w = inst.worker
        else:
            w = cursor
            cursor = (cursor + 1) % nw
        queues[w].append(inst.uid)
        worker_of[inst.uid] = w
    return queues, worker_of


def build(graph: Graph) -> Schedule:
    if not graph.instances:
        raise GraphError("the graph has no tasks")
    queues, worker_of = place(graph)
    pos_of = {uid: i for q in queues for i, uid in enumerate(q)}
    insts = list(graph.instances)          # plus the join entries added below
    join_type = registry.get(registry.JOIN_ID)
    group_size = {g.index: len(g.uids) for g in graph.groups}

    events: list[EventInfo] = []
    event_id: dict = {}

    def ev(key, name, count) -> int:
        if key not in event_id:
            event_id[key] = len(events)
            events.append(EventInfo(name, count))
        return event_id[key]

    waits: dict = {}
    want_group, want_inst = set(), set()
    plans = {}
    for inst in insts:
        if inst.is_barrier:
            continue
        w = worker_of[inst.uid]
        needed = [d for d in inst.deps if not (worker_of[d] == w and pos_of[d] < pos_of[inst.uid])]
        by_group = defaultdict(list)
        for d in needed:
            by_group[insts[d].group].append(d)
        plan = []
        for gi, members in sorted(by_group.items()):
            if len(members) == group_size[gi] or len(members) > FINE_GRAINED_LIMIT:
                plan.append(("group", gi))
            else:
                plan.extend(("inst", d) for d in sorted(members))
        n_user = len(set(inst.waits))
        if len(plan) + n_user > MAX_WAITS:      # coarsen to whole calls before giving up
            plan = sorted({("group", k[1] if k[0] == "group" else insts[k[1]].group) for k in plan})
        plans[inst.uid] = plan
        for kind, key in plan:
            (want_group if kind == "group" else want_inst).add(key)

    # user events: count = number of signalling instances
    user_count = defaultdict(int)
    for inst in insts:
        for e in set(inst.signals):
            user_count[e.index] += 1

    for inst in graph.instances:
        wl = []
        if inst.is_barrier:
            b = ev(("barrier", inst.group), graph.groups[inst.group].label, graph.nw)
            wl.append(b)
        else:
            for kind, key in plans[inst.uid]:
                if kind == "group":
                    wl.append(ev(("group", key), graph.groups[key].label, group_size[key]))
                else:
                    wl.append(ev(("inst", key), insts[key].label(), 1))
            for e in dict.fromkeys(inst.waits):
                wl.append(ev(("user", e.index), e.name, user_count[e.index]))
        # More waits than a descriptor holds: wait-only "join" entries go just before the instance on
        # its own queue; queue order then carries their waits to it.
        while len(wl) > MAX_WAITS:
            join = Instance(len(insts), inst.group, join_type, {}, inst.epoch, worker=worker_of[inst.uid])
            insts.append(join)
            waits[join.uid], wl = wl[:MAX_WAITS], wl[MAX_WAITS:]
            worker_of[join.uid] = join.worker
            q = queues[join.worker]
            q.insert(q.index(inst.uid), join.uid)
        waits[inst.uid] = wl

    pos_of = {uid: i for q in queues for i, uid in enumerate(q)}
    signals = {}
    for inst in insts:
        sl = []
        if inst.type.id == registry.JOIN_ID:
            signals[inst.uid] = sl
            continue
        if inst.is_barrier:
            sl.append(event_id[("barrier", inst.group)])
        if inst.group in want_group:
            sl.append(event_id[("group", inst.group)])
        if inst.uid in want_inst:
            sl.append(event_id[("inst", inst.uid)])
        for e in dict.fromkeys(inst.signals):
            sl.append(ev(("user", e.index), e.name, user_count[e.index]))
        if len(sl) > MAX_SIGNALS:
            raise GraphError(f"{inst.label()} must signal {len(sl)} events; an instance signals at most "
                             f"{MAX_SIGNALS}. Use fewer explicit signals on this call.")
        signals[inst.uid] = sl
    return Schedule(graph.nw, graph, insts, queues, waits, signals, events, worker_of, pos_of)
