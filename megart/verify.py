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
    Raises ScheduleError naming every stuck queue head if the queues cannot all finish."""
    have = [0] * len(s.events)
    need = [e.count for e in s.events]
    head = [0] * s.nw
    arrived = set()                      # signal-first instances that already signalled
    blocked_on = defaultdict(list)       # event -> workers parked on it
    runnable = [w for w in range(s.nw) if s.queues[w]]
    order = []

    def signal(uid):
        for e in s.signals[uid]:
            have[e] += 1
            if have[e] >= need[e] and blocked_on[e]:
                runnable.extend(blocked_on.pop(e))

    while runnable:
        i = rng.randrange(len(runnable)) if rng else 0
        w = runnable[i]
        runnable[i] = runnable[-1]
        runnable.pop()
        if head[w] >= len(s.queues[w]):
            continue
        uid = s.queues[w][head[w]]
        if s.flags(uid) and uid not in arrived:
            arrived.add(uid)
            signal(uid)
        missing = next((e for e in s.waits[uid] if have[e] < need[e]), None)
        if missing is not None:
            blocked_on[missing].append(w)
            continue
        if execute is not None:
            execute(uid)
        order.append(uid)
        if not s.flags(uid):
            signal(uid)
        head[w] += 1
        if head[w] < len(s.queues[w]):
            runnable.append(w)

    stuck = []
    for w in range(s.nw):
        if head[w] < len(s.queues[w]):
            uid = s.queues[w][head[w]]
            e = next(e for e in s.waits[uid] if have[e] < need[e])
            stuck.append(dict(worker=w, position=head[w], task=s.instances[uid].type.name, instance=uid,
                              event=e, event_name=s.events[e].name, have=have[e], need=need[e]))
    if stuck:
        lines = [f"  worker {d['worker']} position {d['position']}: {d['task']}#{d['instance']} waits on event "
                 f"{d['event']} {d['event_name']!r} (has {d['have']} of {d['need']} signals)" for d in stuck[:8]]
        more = f"\n  ... and {len(stuck) - 8} more" if len(stuck) > 8 else ""
        raise ScheduleError(f"deadlock: {len(stuck)} worker queue(s) can never finish:\n" + "\n".join(lines) + more,
                            stuck=stuck)
    return order


def verify(s: Schedule) -> None:
    """Prove the schedule completes and that no two unordered instances write the same bytes; raise
    ScheduleError otherwise."""
    for uid, evs in s.waits.items():
        for e in evs:
            if s.events[e].count == 0:
                raise ScheduleError(
                    f"{s.describe(uid)} waits on event {e} {s.events[e].name!r}, which no task signals",
                    stuck=[dict(worker=s.worker_of[uid], position=s.pos_of[uid], task=s.instances[uid].type.name,
                                instance=uid, event=e, event_name=s.events[e].name, have=0, need=0)])
    simulate(s)
    _check_writers(s)


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
