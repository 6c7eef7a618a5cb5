"""Bookkeeping task types for a decode loop that stays on the device (ids 96-111): no host work per step.

* pos_advance(pos, pos_next[, pos_stamp]): pos = pos_next; pos_next += 1 (then pos_stamp gets this step's tag). Put it first in the step: every reader of
  `pos` then depends on this one instance (a read-after-write), and nothing has to write `pos` at the
  step's end, where its write-after-read dependencies on every layer's readers would need a barrier.
* token_record(history, token, pos): history[pos] = token (the argmax the step produced), so a greedy
  run of n steps is read back once at the end.
"""
from __future__ import annotations

from ..registry import Cost, TaskType, ptr, register, scalar
from ..tensors import as_ref
from .tiling import pos_stamp_ref, require


def _one(task, value, name):
    r = as_ref(value, name)
    require(r.count == 1, task, f"{name} must be a single i32 element, got {r.count}")
    return r


def _pos_advance_ref(p) -> None:
    v = int(p.pos_next[0])
    p.pos[0] = v
    p.pos_next[0] = v + 1


def _pos_advance_split(nw, tiles=1, pos=None, pos_next=None, pos_stamp=None):
    require(tiles == 1, "pos_advance", "is a single instance (tiles=1)")
    return [dict(pos=_one("pos_advance", pos, "pos"), pos_next=_one("pos_advance", pos_next, "pos_next"),
                 pos_stamp=pos_stamp_ref("pos_advance", pos_stamp))]


register(TaskType(
    name="pos_advance", id=96,
    params=(ptr("pos", "i32", "out"), ptr("pos_next", "i32", "inout"),
            ptr("pos_stamp", "bf16", "out", optional=True, tagged=True)),
    source="tasks/pos_advance.cuh", reference=_pos_advance_ref, split=_pos_advance_split,
    cost=lambda **_: Cost(bytes=12),
    doc="pos[0] = pos_next[0]; pos_next[0] += 1 (the decode position, advanced on the device). With pos_stamp (one "
        "tagged word), the word then gets this step's tag: a reader outside the event graph (the weight "
        "stream's producer, loading attention's K/V rows ahead) polls it before it reads pos."), builtin=True)


def _token_record_ref(p) -> None:
    at = int(p.pos[0])
    if 0 <= at < p.n:
        p.history[at] = p.token[0]


def _token_record_split(nw, tiles=1, history=None, token=None, pos=None):
    require(tiles == 1, "token_record", "is a single instance (tiles=1)")
    h = as_ref(history, "history")
    return [dict(history=h, token=_one("token_record", token, "token"), pos=_one("token_record", pos, "pos"),
                 n=h.count)]


register(TaskType(
    name="token_record", id=97,
    params=(ptr("history", "i32", "out"), ptr("token", "i32", "in"), ptr("pos", "i32", "in"),
            scalar("n")),
    source="tasks/token_record.cuh", reference=_token_record_ref, split=_token_record_split,
    cost=lambda **_: Cost(bytes=12),
    doc="history[pos[0]] = token[0] when pos is inside the history (the greedy output log)."), builtin=True)
