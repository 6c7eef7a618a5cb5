"""Placement of instances on worker queues and the events that order them.

Policy (documented in docs/ARCHITECTURE.md): instances keep program order. A pinned instance goes
to its worker; the rest are dealt round robin from a cursor that runs on across calls, so small
calls spread over the grid instead of piling onto worker 0. Grid barriers put one arrival on every
queue. Each dependency becomes a wait on an event counter: a whole producer call is one event
(count = its instances); a consumer that needs only some instances of a call waits on an event
signalled by exactly those instances, so it can start before the rest of the call lands. A dependency on
an earlier instance of the same queue needs no wait at all. A read of tagged words (megart/tagged.py) is
polled by the body itself: it makes no wait, and its writers signal nothing for it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from . import registry
from .errors import GraphError
from .graph import Event, Graph, Instance
from .layout import FLAG_SIGNAL_FIRST, MAX_SIGNALS, MAX_WAITS



@dataclass
class EventInfo:
    name: str
    count: int  # signals per step; a waiter in step g needs count * g
    peer: bool = False   # counted up by other ranks (docs/TP.md); peer events take ids 0..P-1


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
    peer_signals: dict = field(default_factory=dict)   # uid -> [(peer event id, rank), ...]
    rank: int = 0
    world: int = 1
    polls: dict = field(default_factory=dict)          # uid -> writers of the tagged words it polls

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


def _plan_waits(graph: Graph, worker_of: dict, pos_of: dict) -> dict:
    """uid -> list of ("group", g) | ("subset", g, frozenset(uids)) wait keys. A subset event is
    signalled by exactly the producer instances a consumer needs; where that would make a producer
    signal more events than its descriptor holds, the consumers fall back to the whole call's event."""
    insts = graph.instances
    group_size = {g.index: len(g.uids) for g in graph.groups}
    plans = {}
    for inst in insts:
        if inst.is_barrier:
            continue
        w = worker_of[inst.uid]
        by_group = defaultdict(set)
        for d in inst.deps:
            if not (worker_of[d] == w and pos_of[d] < pos_of[inst.uid]):   # queue order already covers it
                by_group[insts[d].group].add(d)
        plan = [("group", g) if len(m) == group_size[g] else ("subset", g, frozenset(m))
                for g, m in sorted(by_group.items())]
        if len(plan) + len(set(inst.waits)) > MAX_WAITS:   # fewer, coarser waits before adding joins
            plan = [("group", g) for g in sorted(by_group)]
        plans[inst.uid] = plan
    while True:
        signals = defaultdict(set)
        for plan in plans.values():
            for key in plan:
                if key[0] == "group":
                    for u in graph.groups[key[1]].uids:
                        signals[u].add(key)
                else:
                    for u in key[2]:
                        signals[u].add(key)
        demote = set()
        for u, keys in signals.items():
            extra = len(keys) + len(set(insts[u].signals)) - MAX_SIGNALS
            if extra > 0:
                demote.update(sorted((k for k in keys if k[0] == "subset"), key=lambda k: len(k[2]))[:extra + 1])
        if not demote:
            break
        for uid, plan in plans.items():
            plans[uid] = sorted(set(("group", k[1]) if k in demote else k for k in plan), key=str)
    return plans


def build(graph: Graph) -> Schedule:
    if not graph.instances:
        raise GraphError("the graph has no tasks")
    queues, worker_of = place(graph)
    pos_of = {uid: i for q in queues for i, uid in enumerate(q)}
    plans = _plan_waits(graph, worker_of, pos_of)
    insts = list(graph.instances)          # plus the join entries added below
    join_type = registry.get(registry.JOIN_ID)

    events: list[EventInfo] = []
    event_id: dict = {}
    # Peer events first, in declaration order, so event e is the same counter on every rank. A waiter's
    # count is what this rank's graph signals on its peers: rank graphs built from one description are
    # symmetric, and megart.verify.verify_ranks checks that the peers really send that many.
    peer_count = defaultdict(int)
    for inst in graph.instances:
        for ps in dict.fromkeys(x for x in inst.signals if not isinstance(x, Event)):
            peer_count[ps.event.index] += 1
    for pe in graph.peer_events:
        event_id[("user", pe.index)] = len(events)
        events.append(EventInfo(f"peer {pe.name}", peer_count[pe.index], peer=True))

    def ev(key, name, count) -> int:
        if key not in event_id:
            event_id[key] = len(events)
            events.append(EventInfo(name, count))
        return event_id[key]

    def plan_event(key) -> int:
        g = graph.groups[key[1]]
        if key[0] == "group":
            return ev(key, g.label, len(g.uids))
        members = sorted(key[2])
        name = insts[members[0]].label() if len(members) == 1 else f"{g.label}[{len(members)} of {len(g.uids)}]"
        return ev(key, name, len(members))

    user_count = defaultdict(int)          # user events: count = number of signalling instances
    for inst in insts:
        for e in set(inst.signals):
            if isinstance(e, Event):
                user_count[e.index] += 1

    waits, signals = {}, defaultdict(list)
    for inst in graph.instances:
        if inst.is_barrier:
            wl = [ev(("barrier", inst.group), graph.groups[inst.group].label, graph.nw)]
            signals[inst.uid].append(wl[0])
        else:
            wl = []
            for key in plans[inst.uid]:
                e = plan_event(key)
                wl.append(e)
                producers = graph.groups[key[1]].uids if key[0] == "group" else key[2]
                for u in producers:
                    if e not in signals[u]:
                        signals[u].append(e)
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
    peer_signals = defaultdict(list)
    for inst in graph.instances:
        for e in dict.fromkeys(inst.signals):
            if isinstance(e, Event):
                signals[inst.uid].append(ev(("user", e.index), e.name, user_count[e.index]))
            else:
                peer_signals[inst.uid].append((event_id[("user", e.event.index)], e.rank))
        n_sig = len(signals[inst.uid]) + len(peer_signals[inst.uid])
        if n_sig > MAX_SIGNALS:
            raise GraphError(f"{inst.label()} must signal {n_sig} events; an instance signals at "
                             f"most {MAX_SIGNALS}. Use fewer explicit signals on this call.")
    pos_of = {uid: i for q in queues for i, uid in enumerate(q)}
    signals = {inst.uid: signals.get(inst.uid, []) for inst in insts}
    peer_signals = {uid: v for uid, v in peer_signals.items() if v}
    polls = {inst.uid: sorted(inst.polled) for inst in graph.instances if inst.polled}
    return Schedule(graph.nw, graph, insts, queues, waits, signals, events, worker_of, pos_of, peer_signals,
                    graph.rank, graph.world, polls)
