"""CPU simulation of the worker queues. The verifier proves every wait of a schedule can be met
(or names the stuck queue heads); the emulator reuses the same engine to execute instances."""
from __future__ import annotations

import random
from collections import defaultdict

from .errors import ScheduleError
from .schedule import Schedule


def simulate(s: Schedule, execute=None, rng: random.Random | None = None, step: int = 1) -> list:
    """Run one step of the queues on the host. `execute(uid)` is called for each instance in a
    legal interleaving; with `rng`, the next runnable worker is drawn at random (each draw is a
    different legal interleaving), otherwise lowest worker first. Returns the execution order.
    Raises ScheduleError naming every stuck queue head if the queues cannot all finish.
    A rank of a tensor-parallel group is simulated against mirror images of itself: each signal it sends
    a peer stands for the peer's matching signal to it (verify_ranks runs the real group)."""
    run = None if execute is None else (lambda r, uid: execute(uid))
    return [uid for _, uid in simulate_ranks([s], run, rng, mirror=True)]


def simulate_ranks(ranks: list, execute=None, rng: random.Random | None = None, mirror: bool = False) -> list:
    """One step of every rank's queues together: a peer signal (event e, rank q) counts e up on rank q
    (with `mirror`, on the sender itself). `execute(rank, uid)`; returns [(rank, uid), ...] in order."""
    have = [[0] * len(s.events) for s in ranks]
    need = [[e.count for e in s.events] for s in ranks]
    head = {(r, w): 0 for r, s in enumerate(ranks) for w in range(s.nw)}
    arrived = set()                      # signal-first instances that already signalled
    blocked_on = defaultdict(list)       # (rank, event) -> workers parked on it; (rank, "ran", uid) likewise
    ran = set()                          # (rank, uid) executed: a polled read needs its writers' words
    runnable = [(r, w) for r, s in enumerate(ranks) for w in range(s.nw) if s.queues[w]]
    order = []

    def count(r, e):
        have[r][e] += 1
        if have[r][e] >= need[r][e] and blocked_on[(r, e)]:
            runnable.extend(blocked_on.pop((r, e)))

    def signal(r, uid):
        s = ranks[r]
        for e in s.signals[uid]:
            count(r, e)
        for e, q in s.peer_signals.get(uid, ()):
            count(r if mirror else q, e)

    while runnable:
        i = rng.randrange(len(runnable)) if rng else 0
        r, w = runnable[i]
        runnable[i] = runnable[-1]
        runnable.pop()
        s = ranks[r]
        if head[(r, w)] >= len(s.queues[w]):
            continue
        uid = s.queues[w][head[(r, w)]]
        if s.flags(uid) and (r, uid) not in arrived:
            arrived.add((r, uid))
            signal(r, uid)
        missing = next((e for e in s.waits[uid] if have[r][e] < need[r][e]), None)
        if missing is not None:
            blocked_on[(r, missing)].append((r, w))
            continue
        unwritten = next((u for u in s.polls.get(uid, ()) if (r, u) not in ran), None)
        if unwritten is not None:          # the body would spin on words not yet written
            blocked_on[(r, "ran", unwritten)].append((r, w))
            continue
        if execute is not None:
            execute(r, uid)
        order.append((r, uid))
        ran.add((r, uid))
        runnable.extend(blocked_on.pop((r, "ran", uid), ()))
        if not s.flags(uid):
            signal(r, uid)
        head[(r, w)] += 1
        if head[(r, w)] < len(s.queues[w]):
            runnable.append((r, w))

    stuck = []
    for (r, w), h in head.items():
        s = ranks[r]
        if h < len(s.queues[w]):
            uid = s.queues[w][h]
            e = next((e for e in s.waits[uid] if have[r][e] < need[r][e]), None)
            if e is None:                    # spinning on tagged words whose writer never runs
                u = next(u for u in s.polls[uid] if (r, u) not in ran)
                stuck.append(dict(rank=r, worker=w, position=h, task=s.instances[uid].type.name, instance=uid,
                                  event=None, event_name=f"tagged words of {s.instances[u].label()}", have=0,
                                  need=1, polls=u))
                continue
            stuck.append(dict(rank=r, worker=w, position=h, task=s.instances[uid].type.name, instance=uid,
                              event=e, event_name=s.events[e].name, have=have[r][e], need=need[r][e]))
    if stuck:
        where = (lambda d: f"rank {d['rank']} ") if len(ranks) > 1 else (lambda d: "")
        lines = [f"  {where(d)}worker {d['worker']} position {d['position']}: {d['task']}#{d['instance']} " + (
                 f"waits on event {d['event']} {d['event_name']!r} (has {d['have']} of {d['need']} signals)"
                 if d["event"] is not None else f"polls the {d['event_name']}, which never run")
                 for d in stuck[:8]]
        more = f"\n  ... and {len(stuck) - 8} more" if len(stuck) > 8 else ""
        raise ScheduleError(f"deadlock: {len(stuck)} worker queue(s) can never finish:\n" + "\n".join(lines) + more,
                            stuck=stuck)
    return order


def verify(s: Schedule) -> None:
    """Prove the schedule completes and that no two unordered instances write the same bytes; raise
    ScheduleError otherwise."""
    _check_signalled(s)
    simulate(s)
    _check_writers(s)


def _check_signalled(s: Schedule) -> None:
    """Every wait names an event something signals."""
    for uid, evs in s.waits.items():
        for e in evs:
            if s.events[e].count == 0 and s.events[e].peer:
                raise ScheduleError(
                    f"{s.describe(uid)} waits on {s.events[e].name!r}, a peer event this rank never signals on a "
                    f"peer: rank graphs are built alike, so no peer would signal it here either (a dangling "
                    f"peer wait; add the signals=[ev.to(rank)] call that feeds it)",
                    stuck=[dict(worker=s.worker_of[uid], position=s.pos_of[uid], task=s.instances[uid].type.name,
                                instance=uid, event=e, event_name=s.events[e].name, have=0, need=0)])
            if s.events[e].count == 0:
                raise ScheduleError(
                    f"{s.describe(uid)} waits on event {e} {s.events[e].name!r}, which no task signals",
                    stuck=[dict(worker=s.worker_of[uid], position=s.pos_of[uid], task=s.instances[uid].type.name,
                                instance=uid, event=e, event_name=s.events[e].name, have=0, need=0)])


def _check_writers(s: Schedule) -> None:
    from .races import unordered_writers
    pairs = unordered_writers(s)
    if not pairs:
        return
    lines = [f"  {s.describe(d['a'])} and {s.describe(d['b'])} both write bytes [{d['bytes'][0]}, {d['bytes'][1]}) "
             f"of tensor {d['tensor']!r}" for d in pairs]
    raise ScheduleError("unordered writers: these instances write the same bytes and nothing orders them, so the "
                        "result depends on timing:\n" + "\n".join(lines) + "\nOrder them with after=[group] or an "
                        "event, or build the later call with dependency inference (infer=True, the default).")


def verify_ranks(ranks: list) -> None:
    """Prove a tensor-parallel group's rank schedules complete together: the ranks are 0..world-1, declare
    the same peer events in the same order, every peer event receives as many signals per step as its
    waiters count on (from each peer), and the joint simulation finishes; ScheduleError otherwise."""
    world = len(ranks)
    if sorted(s.rank for s in ranks) != list(range(world)) or any(s.world != world for s in ranks):
        raise ScheduleError(f"verify_ranks needs the schedules of ranks 0..{world - 1} of one group, got ranks "
                            f"{[s.rank for s in ranks]} of worlds {sorted({s.world for s in ranks})}")
    ranks = sorted(ranks, key=lambda s: s.rank)
    names = [[e.name for e in s.events if e.peer] for s in ranks]
    for r in range(1, world):
        if names[r] != names[0]:
            raise ScheduleError(f"rank {r} declares peer events {names[r][:6]}..., rank 0 {names[0][:6]}...: ranks "
                                "must declare the same peer events in the same order")
    for r, s in enumerate(ranks):
        _check_signalled(s)
        for e, info in enumerate(s.events):
            if not info.peer:
                continue
            got = {q: sum(1 for v in ranks[q].peer_signals.values() for ev, to in v if ev == e and to == r)
                   for q in range(world) if q != r}
            waited = any(e in w for w in s.waits.values())
            if waited and sum(got.values()) != info.count:
                raise ScheduleError(
                    f"rank {r} waits on {info.name!r} for {info.count} signals per step, but its peers send "
                    f"{sum(got.values())} ({', '.join(f'rank {q}: {n}' for q, n in got.items())}); a wait with no "
                    "matching peer signal would hang")
    simulate_ranks(ranks)
    for s in ranks:
        _check_writers(s)

