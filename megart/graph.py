"""The user's task graph: tensors, task instances grouped by call, explicit events, grid barriers,
and the data dependencies inferred from which byte ranges each instance reads and writes."""
from __future__ import annotations

import contextlib
import copy
import gc
import operator

from dataclasses import dataclass, field
from types import SimpleNamespace

from . import registry
from .access_map import AccessMap
from .errors import GraphError
from .registry import TaskType
from .tensors import Tensor, TensorRef, as_ref


@dataclass(frozen=True)
class Event:
    """A user-declared event: instances that list it in `signals` count it up; waiters need all of them.
    A *peer* event (Graph.peer_event) lives in every rank of a tensor-parallel group: an instance signals
    it on another rank with `signals=[ev.to(rank)]`, and a waiter needs every peer's signals of the step."""
    index: int
    name: str
    peer: bool = False

    def to(self, rank: int) -> "PeerSignal":
        if not self.peer:
            raise GraphError(f"event {self.name!r} is local; only a peer_event() is signalled on another rank")
        return PeerSignal(self, rank)


@dataclass(frozen=True)
class PeerSignal:
    """Count peer event `event` up on rank `rank` (after the instance's body, release at system scope)."""
    event: Event
    rank: int


@dataclass
class Instance:
    uid: int                       # position in program order (the global order waits respect)
    group: int
    type: TaskType
    params: dict                   # param name -> TensorRef | int | float
    epoch: int                     # grid barriers passed before this instance
    worker: int | None = None      # pinned worker, if the caller asked
    deps: set = field(default_factory=set)      # uids this instance must run after (data or `after=`)
    polled: set = field(default_factory=set)    # writers of the tagged words it polls: it runs after their
    #                                             writes but is ordered after nothing else of theirs (no wait)
    waits: list = field(default_factory=list)   # explicit user Events
    signals: list = field(default_factory=list)
    inferred: bool = True          # its dependencies came from byte-range inference (not infer=False)

    @property
    def is_barrier(self) -> bool:
        return self.type.id == registry.BARRIER_ID

    def label(self) -> str:
        return f"{self.type.name}#{self.uid}"


@dataclass
class Group:
    """The instances one `task()` call (or one barrier) created."""
    index: int
    type: TaskType
    uids: list
    label: str
    args: dict = field(default_factory=dict, compare=False, repr=False)   # the call's keyword arguments

    def cost(self):
        """What the call moves and computes (registry.Cost), from its task type's cost model; None without one.
        A model may read device state (attention reads pos), so this is the cost at the state it sees now."""
        return None if self.type.cost is None else self.type.cost(**self.args)


class Graph:
    def __init__(self, nw: int, device, rank: int = 0, world: int = 1):
        self.nw = nw
        self.device = device
        self.rank, self.world = rank, world      # this graph's place in a tensor-parallel group
        self.tensors: dict[str, Tensor] = {}
        self.instances: list[Instance] = []
        self.groups: list[Group] = []
        self.events: list[Event] = []
        self.epoch = 0
        self._accesses: dict = {}   # storage key -> AccessMap, for the current barrier epoch
        self._accesses_epoch = 0
        self._weight_storages: dict = {}    # storage key -> a tensor name, for the weight/write check
        self._tagged_writes: dict = {}      # storage key -> AccessMap of tagged words' writers, the whole step
        self._written_storages: dict = {}

    # --- building ---------------------------------------------------------------------------
    def tensor(self, obj, name: str | None = None, tagged: bool = False) -> Tensor:
        """Add an array the tasks may read or write; tagged=True: int32 words of bf16 values with step tags,
        read by polling (megart/tagged.py)."""
        name = name or f"t{len(self.tensors)}"
        if name in self.tensors:
            raise GraphError(f"a tensor named {name!r} already exists")
        t = Tensor(obj, name, self.device, tagged=tagged)
        other = next((o for o in self.tensors.values() if o.storage_key == t.storage_key and o.tagged != t.tagged),
                     None)
        if other is not None:   # (a plain view would read or write the words unordered with the polls)
            raise GraphError(f"tensor {name!r} shares memory with {other.name!r}, and only one of them is tagged: "
                             "tagged words are read and written through tagged tensors only")
        self.tensors[name] = t
        return t

    def event(self, name: str | None = None) -> Event:
        ev = Event(len(self.events), name or f"event{len(self.events)}")
        self.events.append(ev)
        return ev

    def peer_event(self, name: str) -> Event:
        """An event every rank of the group declares under the same name, in the same order; peers count it
        up on this rank with signals=[ev.to(this rank)] (docs/TP.md)."""
        if self.world < 2:
            raise GraphError(f"peer_event({name!r}): this kernel is not part of a tensor-parallel group "
                             "(PersistentKernel(peers=...) with a world of 2 or more)")
        if not isinstance(name, str) or not name:
            raise GraphError("a peer event needs a name (ranks match their peer events by name and order)")
        if any(e.peer and e.name == name for e in self.events):
            raise GraphError(f"a peer event named {name!r} already exists")
        ev = Event(len(self.events), name, peer=True)
        self.events.append(ev)
        return ev

    @property
    def peer_events(self) -> list:
        return [e for e in self.events if e.peer]

    def barrier(self) -> Group:
        """A grid barrier: every worker arrives; nothing after it starts until all have arrived."""
        btype = registry.get(registry.BARRIER_ID)
        g = Group(len(self.groups), btype, [], f"barrier{self.epoch}")
        for w in range(self.nw):
            inst = Instance(len(self.instances), g.index, btype, {}, self.epoch, worker=w)
            self.instances.append(inst)
            g.uids.append(inst.uid)
        self.groups.append(g)
        self.epoch += 1
        return g

    def task(self, task, *, tiles: int = 1, waits=(), signals=(), after=(), worker=None,
             infer: bool = True, label: str | None = None, **args) -> Group:
        # The cyclic GC would rescan the growing graph while a big call adds its instances (nothing here is
        # garbage), which made the build superlinear in the instance count; it runs again afterwards.
        with _gc_paused():
            return self._task(task, tiles=tiles, waits=waits, signals=signals, after=after, worker=worker,
                              infer=infer, label=label, **args)

    def _task(self, task, *, tiles, waits, signals, after, worker, infer, label, **args) -> Group:
        ttype = registry.get(task)
        if ttype.id == registry.BARRIER_ID:
            raise GraphError("use barrier() for grid barriers")
        check_tiles(ttype.name, tiles)
        waits, signals, after = (_as_list(ttype.name, k, v) for k, v in
                                 (("waits", waits), ("signals", signals), ("after", after)))
        for ev in (*waits, *signals):
            target = ev.event if isinstance(ev, PeerSignal) else ev
            if not isinstance(target, Event) or target.index >= len(self.events) or self.events[target.index] is not target:
                raise GraphError(f"{ttype.name}: waits/signals take events made by this kernel's event(), "
                                 f"got {ev!r}")
        self._check_peer(ttype.name, waits, signals)
        per_instance = self._split(ttype, tiles, args)
        polled, tagged_words = self._check_tagged(ttype, per_instance)   # (recorded below, once the call is in)
        self._check_weights(ttype, per_instance)
        workers = self._workers(ttype, worker, len(per_instance))
        g = Group(len(self.groups), ttype, [], label or ttype.name, dict(args))
        after_uids = set()
        for other in after:
            if not isinstance(other, Group) or other.index >= len(self.groups) or self.groups[other.index] is not other:
                raise GraphError(f"{ttype.name}: after= takes groups returned by this kernel's task()/barrier(); "
                                 f"{_group_name(other)} is not one")
            after_uids.update(other.uids)
        for params, w, polls in zip(per_instance, workers, polled):
            inst = Instance(len(self.instances), g.index, ttype, params, self.epoch, worker=w,
                            waits=list(waits), signals=list(signals), inferred=infer, polled=polls)
            inst.deps |= {u for u in after_uids if self.instances[u].epoch == self.epoch}
            if infer:
                inst.deps |= self._infer(inst)
            self.instances.append(inst)
            g.uids.append(inst.uid)
        self._tagged_writes.update(tagged_words)
        self.groups.append(g)
        return g

    # --- helpers ------------------------------------------------------------------------------
    def _check_peer(self, task: str, waits: list, signals: list) -> None:
        for ev in waits:
            if isinstance(ev, PeerSignal):
                raise GraphError(f"{task}: waits=[...] takes the peer event itself ({ev.event.name!r}), not "
                                 f".to(rank): a waiter needs the signals of every peer")
        for ev in signals:
            if isinstance(ev, Event) and ev.peer:
                raise GraphError(f"{task}: peer event {ev.name!r} is signalled on another rank: "
                                 f"signals=[ev.to(rank)]")
            if isinstance(ev, PeerSignal) and not (0 <= ev.rank < self.world and ev.rank != self.rank):
                raise GraphError(f"{task}: {ev.event.name!r}.to({ev.rank}) names no peer: this is rank "
                                 f"{self.rank} of {self.world}")

    def _split(self, ttype: TaskType, tiles: int, args: dict) -> list[dict]:
        known = {p.name for p in ttype.params}
        if ttype.split is None:
            unknown = set(args) - known
            if unknown:
                raise GraphError(f"{ttype.name}: unknown parameter(s) {sorted(unknown)}; takes {sorted(known)}")
            if tiles != 1:
                raise GraphError(f"{ttype.name}: has no splitter, so tiles must be 1 (pass one call per instance)")
            per_instance = [dict(args)]
        else:
            try:
                per_instance = ttype.split(nw=self.nw, tiles=tiles, **args)
            except TypeError as exc:
                raise GraphError(f"{ttype.name}: bad arguments {sorted(args)}: {exc}") from exc
        if not per_instance:
            raise GraphError(f"{ttype.name}: the call produced no instances")
        return [self._check_params(ttype, p) for p in per_instance]

    def _check_params(self, ttype: TaskType, params: dict) -> dict:
        missing = [p.name for p in ttype.params if p.name not in params]
        if missing:
            raise GraphError(f"{ttype.name}: missing parameter(s) {missing}")
        out = {}
        for p in ttype.params:
            v = params[p.name]
            if p.kind == "ptr" and v is None and p.optional:
                out[p.name] = None        # absent optional operand: a null pointer, nothing to depend on
            elif p.kind == "ptr":
                ref = as_ref(v, p.name)
                if ref.tensor.tagged and not p.tagged:
                    raise GraphError(f"{ttype.name}: tensor {ref.tensor.name!r} is tagged (bf16 values with step "
                                     f"tags), and parameter {p.name!r} does not take tagged words")
                if ref.tensor.dtype != p.dtype and not (ref.tensor.tagged and p.tagged):
                    if p.tagged and ref.tensor.dtype == "i32":
                        raise GraphError(f"{ttype.name}: parameter {p.name!r} needs bf16 or tagged words; tensor "
                                         f"{ref.tensor.name!r} is i32 (tagged words are added with "
                                         "pk.tensor(..., tagged=True))")
                    raise GraphError(f"{ttype.name}: parameter {p.name!r} needs {p.dtype}, "
                                     f"tensor {ref.tensor.name!r} is {ref.tensor.dtype}")
                if self.tensors.get(ref.tensor.name) is not ref.tensor:
                    raise GraphError(f"{ttype.name}: tensor {ref.tensor.name!r} was not added to this kernel")
                out[p.name] = ref
            elif p.kind == "f32":
                out[p.name] = float(v)
            else:
                if int(v) != v:
                    raise GraphError(f"{ttype.name}: parameter {p.name!r} must be an integer, got {v!r}")
                out[p.name] = int(v)
                lim = 2**31 if p.kind == "i32" else 2**63
                if not -lim <= out[p.name] < lim:
                    raise GraphError(f"{ttype.name}: parameter {p.name!r}={v} overflows {p.kind}")
        return out

    def _check_weights(self, ttype: TaskType, per_instance: list) -> None:
        """A "weight" may be read through the non-coherent path, so nothing in the kernel may write it."""
        for params in per_instance:
            for p in ttype.params:
                if p.kind != "ptr" or params[p.name] is None or not (p.access == "weight" or p.mutates):
                    continue
                t = params[p.name].tensor
                mine, other = ((self._weight_storages, self._written_storages) if p.access == "weight"
                               else (self._written_storages, self._weight_storages))
                if t.storage_key in other:
                    raise GraphError(
                        f"{ttype.name}: tensor {t.name!r} ({p.name}) shares memory with a tensor that is "
                        f"{'written' if p.access == 'weight' else 'read as a weight'} by another task; weights "
                        f"must stay read-only for the whole kernel (use an 'in' parameter for data that changes)")
                mine[t.storage_key] = t.name

    def _workers(self, ttype: TaskType, worker, n: int) -> list:
        if worker is None:
            return [None] * n
        ws = [worker] * n if isinstance(worker, int) else list(worker)
        if len(ws) != n:
            raise GraphError(f"{ttype.name}: worker= lists {len(ws)} workers for {n} instances")
        for w in ws:
            if not 0 <= w < self.nw:
                raise GraphError(f"{ttype.name}: worker {w} is outside [0, {self.nw})")
        return ws

    def _infer(self, inst: Instance) -> set:
        """Read-after-write, write-after-read and write-after-write dependencies on earlier instances
        of this barrier epoch, by byte-range overlap. Accesses are kept per storage allocation (views of
        one allocation share a bucket; different allocations cannot overlap) in an AccessMap: a later
        accessor depends on the last writer of each byte (and a write on the readers since), which
        already depends on everything before it."""
        if self._accesses_epoch != self.epoch:      # a barrier orders everything before it
            self._accesses, self._accesses_epoch = {}, self.epoch
        deps = set()
        for p in inst.type.params:
            ref = inst.params[p.name]
            if p.kind != "ptr" or ref is None or ref.tensor.tagged:   # (tagged words: _tagged)
                continue
            bucket = self._accesses.setdefault(ref.tensor.storage_key, AccessMap())
            for lo, hi in inst.type.byte_ranges(inst.params, p.name):
                deps |= bucket.access(lo, hi, inst.uid, p.reads, p.writes)
        deps.discard(inst.uid)
        return deps

    def _check_tagged(self, ttype: TaskType, per_instance: list) -> tuple[list, dict]:
        """_tagged for each instance of a call before any of it is added, on copies of the write maps it
        touches, so a refused call leaves the graph as it was. Returns each instance's polled writers and the
        updated maps, which the caller records once the call is in."""
        keys = {params[p.name].tensor.storage_key for params in per_instance for p in ttype.params
                if p.kind == "ptr" and params[p.name] is not None and params[p.name].tensor.tagged}
        scratch = {k: copy.deepcopy(self._tagged_writes.get(k, AccessMap())) for k in keys}
        polled = [self._tagged(ttype, params, len(self.instances) + i, scratch) if keys else set()
                  for i, params in enumerate(per_instance)]
        return polled, scratch

    def _tagged(self, ttype: TaskType, params: dict, uid: int, maps: dict) -> set:
        """Tagged words: each byte is written by at most one instance per step (a poll cannot tell two writes
        apart), and a polled read comes after the write of every byte it reads (else it would spin until the
        watchdog). Records the writes in `maps` (storage key -> AccessMap) and returns the writers instance
        `uid` polls; whatever else orders them, it is not a wait."""
        polled = set()
        tagged = [p for p in ttype.params if p.kind == "ptr" and params[p.name] is not None and params[p.name].tensor.tagged]
        for p in tagged:          # (an instance may not poll words it writes itself: it would wait for itself)
            for q in tagged:
                a, b = params[p.name], params[q.name]
                if p.reads and q.writes and a.tensor.storage_key == b.tensor.storage_key and \
                        a.byte_range[0] < b.byte_range[1] and b.byte_range[0] < a.byte_range[1]:
                    raise GraphError(f"{ttype.name}: {p.name!r} and {q.name!r} overlap in tagged tensor "
                                     f"{a.tensor.name!r}: an instance cannot poll words it writes (no in-place "
                                     "update of tagged words)")
        for p, (lo, hi) in ((p, r) for p in sorted(tagged, key=lambda p: not p.reads)   # reads first, against
                            for r in ttype.byte_ranges(params, p.name)):               # earlier writers only
            ref = params[p.name]
            t = ref.tensor
            words = maps.setdefault(t.storage_key, AccessMap())
            writers, gap = words.writers(lo, hi)
            elem = ref.offset + (lo - ref.byte_range[0]) // t.itemsize
            where = f"{ttype.name}: {p.name!r} (tagged tensor {t.name!r}, elements " \
                    f"[{elem}, {elem + (hi - lo) // t.itemsize}))"
            if p.writes:
                if writers:
                    first = min(writers)
                    by = self.instances[first].label() if first < len(self.instances) else "this same call"
                    raise GraphError(f"{where} is written twice in one step (also by {by}): tagged words take one "
                                     "write per step, since a reader polling them cannot tell the two apart")
                words.access(lo, hi, uid, False, True)
            else:
                if gap:
                    raise GraphError(f"{where} is read by polling, but no earlier task of this step writes all of "
                                     "those words: the read would spin until the watchdog")
                polled |= writers
        polled.discard(uid)
        return polled

    def tagged_tensors(self) -> list:
        """The tagged tensors of the graph (the runtime zeroes them after an abort: stale tags must not match)."""
        return [t for t in self.tensors.values() if t.tagged]

    def sync_tensors(self) -> list:
        """The tensors some instance updates through a "sync" parameter (arrival counters), each once."""
        seen = {}
        for inst in self.instances:
            for p in inst.type.params:
                ref = inst.params.get(p.name)
                if p.access == "sync" and ref is not None:
                    seen.setdefault(ref.tensor.name, ref.tensor)
        return list(seen.values())

    def host_views(self, inst: Instance, host: dict) -> SimpleNamespace:
        """The instance's parameters as CPU torch views into `host` (tensor name -> flat tensor); a tagged
        tensor's as the view of its bf16 values (the references neither read nor write tags)."""
        from .tagged import values
        ns = {}
        for name, v in inst.params.items():
            if isinstance(v, TensorRef):
                flat = host[v.tensor.name].view(-1)[v.offset:v.offset + v.count]
                ns[name] = values(flat) if v.tensor.tagged else flat
            else:
                ns[name] = v
        return SimpleNamespace(**ns)


@contextlib.contextmanager
def _gc_paused():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


MAX_TILES = 1 << 16     # instances one call may ask for: far above any decode grid, far below a hang


def check_tiles(task: str, tiles) -> None:
    """`tiles` is a positive int no larger than MAX_TILES (a task's splitter may then cap it at the
    work it has, e.g. one instance per row pair)."""
    try:
        tiles = operator.index(tiles)      # ints and numpy ints; not floats
    except TypeError:
        raise GraphError(f"{task}: tiles must be an int, got {tiles!r}") from None
    if isinstance(tiles, bool):
        raise GraphError(f"{task}: tiles must be an int, got {tiles!r}")
    if not 1 <= tiles <= MAX_TILES:
        raise GraphError(f"{task}: tiles={tiles} is outside [1, {MAX_TILES}]; a call is cut into at most "
                         f"{MAX_TILES} instances (a few per worker is the usual count)")


def _as_list(task: str, what: str, value) -> list:
    """waits=, signals=, after= take a list; a bare Event or Group is the usual slip."""
    if isinstance(value, (Event, PeerSignal, Group)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise GraphError(f"{task}: {what}= takes a list (e.g. {what}=[x]), got {_group_name(value)}")
    return list(value)


def _group_name(v) -> str:
    if isinstance(v, Group):
        return f"group {v.label!r} (index {v.index})"
    if isinstance(v, Event):
        return f"event {v.name!r}"
    return f"{type(v).__name__} {v!r}"[:120]
