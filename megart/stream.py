"""Sizing of the launch-wide weight stream (csrc/weight_stream.cuh): which task types of a kernel stream
their weights, how many ring slots each warp gets, and where the ring sits in shared memory.

The ring comes after the largest per-instance shared memory of the kernel's types (it must survive every
instance), so its depth depends on the whole kernel. Little's law sets what it must hold: at ~33 KB per
us per SM (4.3 TB/s over 132 SMs) and ~1-1.5 us of loaded latency, >= ~50 KB per SM in flight keeps
the SM's share of HBM busy; 8 warps x 5-6 slots x 4 KB = 160-192 KB also covers a dependency wait.
MEGART_STREAM_SLOTS="auto" gives as many slots as the shared memory left holds (2..8), N asks for N, unset
or 0 keeps the register engine. A PersistentKernel leaves it off unless asked (a kernel of every built-in
type spills 16 bytes under the 232-register split); the decode models (megart/models/llama.py) ask for
"auto": the Llama-1B step measured 966.9 us with it against 1,010.0 with registers (bench/RESULTS.md)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import KernelConfig, caller_macros, kv_streamed, macro_on, stream_requested
from .errors import GraphError
from .layout import HANG_POLL
from .registry import USER_ID_BASE

SMEM_PER_BLOCK = 232448        # sm_90: 227 KiB of shared memory for one block
STATIC_BASE = 1088             # the worker's static shared memory other than the ring's mbarriers and the warps'
                               # stream state (descriptor slots and the stream's header: with 8 warps' state, 1,632 B
                               # at 24 parameter slots), plus the padding to codegen.SMEM_ALIGN
WARP_STATE_BYTES = 88          # per compute warp: its producer state (csrc/weight_stream.cuh WarpStream)
KV_POS_STATIC = 16             # per warp, with attention's K/V on the stream: the pos its producer lane read
BARRIER_BYTES = 16             # static, per compute warp and slot: its "full" and "empty" mbarriers
MAX_SLOTS = 8                  # past this the warps' stages already cover several us of HBM time
DEFAULT_STAGE_CHUNKS = 128     # measured fastest on the Llama-1B step with 4 producer warps (bench/RESULTS.md)
STAGE_CHUNKS = (64, 128, 256)  # 16-byte chunks per row in one stage (MEGART_STREAM_STAGE): smaller stages
#                                free their slot sooner, so the producer refills the ring earlier
DEFAULT_INFLIGHT = 3           # stages per warp issued and not yet landed (MEGART_STREAM_INFLIGHT): at 5 slots, 3
#                                measured fastest on the Llama-1B step (bench/RESULTS.md); 0 = the ring alone caps
MIN_AUTO_SLOTS = 2             # one slot per warp cannot load a stage while the warp reads the last one
ALIGN = 128
WARPGROUP = 128                # setmaxnreg works per warpgroup (4 warps)
REGS_PER_SM = 65536
PRODUCER_REGS = 40             # the producer's registers after setmaxnreg (the Llama-1B kernel compiles
#                                without spills at 40 / 232); the compute warps get what is left
MAX_REGS = 256
# Hang records of the ring (csrc/weight_stream.cuh): the event word holds -1 - slot for a stage that never
# landed, HANG_SLOT_FREE - slot for a slot the producer waited on that no warp freed.
HANG_SLOT_FREE = -1001


@dataclass(frozen=True)
class StreamLayout:
    slots: int = 0             # per warp; 0 = no stream
    offset: int = 0            # dynamic shared memory offset of the first slot
    types: tuple = ()          # names of the streamed task types
    producer_warp: bool = True  # a producer warp beside the compute warps, or lane 0 of each warp inline
    stage_chunks: int = 256    # 16-byte chunks of each row in one stage (a slot holds a row pair's stage)
    inflight: int = 0          # a warp's stages issued and not yet landed, at most; 0 = up to the slot count

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.stage_chunks)

    def producer_threads(self, threads: int) -> int:
        """The producer's threads: a warpgroup (which can hand registers to the compute warpgroups) where
        the compute threads are whole warpgroups, else one warp; 0 without a producer warp."""
        if not (self.slots and self.producer_warp):
            return 0
        return WARPGROUP if threads % WARPGROUP == 0 else 32

    def block_threads(self, threads: int) -> int:
        """CTA size: the compute threads, plus the producer's."""
        return threads + self.producer_threads(threads)

    def register_split(self, threads: int) -> tuple[int, int] | None:
        """(compute, producer) registers per thread after setmaxnreg, or None (no hand-over)."""
        if self.producer_threads(threads) != WARPGROUP:
            return None
        # setmaxnreg moves registers within what the CTA got at launch (every thread at the entry count,
        # which launch bounds make the most that fits); asking for more than was given blocks forever.
        block = threads + WARPGROUP
        at_launch = REGS_PER_SM // block // 8 * 8
        compute = min(MAX_REGS, (at_launch * block - WARPGROUP * PRODUCER_REGS) // threads // 8 * 8)
        return compute, PRODUCER_REGS

    def ring_bytes(self, threads: int) -> int:
        return (threads // 32) * self.slots * self.slot_bytes if self.slots else 0

    def defines(self, threads: int) -> dict:
        if not self.slots:
            return {"MEGART_STREAM_SLOTS": 0}
        out = {"MEGART_STREAM_SLOTS": self.slots, "MEGART_STREAM_OFFSET": self.offset,
               "MEGART_STREAM_SLOT_BYTES": self.slot_bytes, "MEGART_STREAM_STAGE_CHUNKS": self.stage_chunks,
               "MEGART_STREAM_PRODUCER": int(self.producer_warp), "MEGART_STREAM_INFLIGHT_STAGES": self.inflight,
               "MEGART_PRODUCER_THREADS": self.producer_threads(threads), "MEGART_STREAM_HANG_FREE": HANG_SLOT_FREE}
        split = self.register_split(threads)
        if split:
            out["MEGART_COMPUTE_REGS"], out["MEGART_PRODUCER_REGS"] = split
        return out


def _forced(cfg: KernelConfig) -> int | None:
    """MEGART_STREAM_SLOTS: "auto" = as many as shared memory allows (2..MAX_SLOTS), N = N slots per warp,
    unset or 0 = off (the register engine)."""
    if not stream_requested(cfg):
        return 0
    v = caller_macros(cfg).get("MEGART_STREAM_SLOTS")
    if str(v).strip().lower() == "auto":
        return None
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise GraphError(f"MEGART_STREAM_SLOTS={v!r}: expected a non-negative integer (0 turns the stream off)") from None
    if n < 0:
        raise GraphError(f"MEGART_STREAM_SLOTS={n}: expected a non-negative integer (0 turns the stream off)")
    return n


def streams(t, cfg: KernelConfig, overrides: dict) -> bool:
    """Whether task type `t` is on the stream of a kernel built with `cfg` (a type whose body is overridden by
    a candidate is not: its body need not consume the stream)."""
    return t.stream and t.name not in overrides and (t.stream_format != "kv" or kv_streamed(cfg))


def static_reserve(cfg: KernelConfig, slots: int) -> int:
    """The static shared memory a kernel of `cfg` with `slots` ring slots per warp may use beside the dynamic
    (the ring is sized against it): the slots' mbarriers are static."""
    # (attention's staged new row is dynamic: its smem_for) MEGART_STREAM_WAITS=1 stamps per warp; =2 counts only
    waits = str(caller_macros(cfg).get("MEGART_STREAM_WAITS", "0")).strip() == "1"
    warps = cfg.threads // 32
    kv = kv_streamed(cfg)
    return (STATIC_BASE + (WARP_STATE_BYTES + BARRIER_BYTES * slots) * warps
            + (warps * KV_POS_STATIC if kv else 0)
            + (warps * 16 if waits else 0))  # (the diagnostic's two stamps per warp)


def slot_bytes(stage_chunks: int) -> int:
    """One slot: a row pair's stage of `stage_chunks` 16-byte chunks per row."""
    return 2 * 16 * stage_chunks


def layout(types, cfg: KernelConfig, overrides: dict | None = None) -> StreamLayout:
    """The ring of a kernel of `types`. A type whose body is overridden (a candidate) is not streamed: its
    body need not consume the stream. Per-instance shared memory comes first, the ring after it."""
    overrides = overrides or {}
    if any(t.id >= USER_ID_BASE for t in types):
        return StreamLayout()   # a user body may size loops by blockDim.x, which the producer warp would change
    names = tuple(t.name for t in types if streams(t, cfg, overrides))
    forced = _forced(cfg)
    old_ring = int(caller_macros(cfg).get("MEGART_DENSE_RING_SLOTS", 0) or 0)
    if old_ring > 0:
        if forced:
            raise GraphError("MEGART_DENSE_RING_SLOTS (the per-instance ring) and MEGART_STREAM_SLOTS (the weight "
                             "stream) both use the dense types' shared memory: set one of them")
        return StreamLayout()
    if not names or forced == 0:
        return StreamLayout()
    offset = -(-max([t.shared_bytes(cfg) for t in types] + [0]) // ALIGN) * ALIGN
    warps = cfg.threads // 32
    chunks = stage_chunks(cfg)
    _check_kv_stage(types, names, cfg, chunks)
    if forced is not None:
        slots = forced
    elif cfg.min_blocks > 1:
        slots = 0               # two CTAs per SM: no room for a ring worth having
    else:
        slots = max([s for s in range(MAX_SLOTS + 1)
                     if offset + s * warps * slot_bytes(chunks) + static_reserve(cfg, s) <= SMEM_PER_BLOCK])
        if slots < MIN_AUTO_SLOTS:
            slots = 0
    if not slots:
        return StreamLayout()
    producer = _choice(cfg, "MEGART_STREAM_PRODUCER", (0, 1), "a producer warpgroup (1) or lane 0 of each "
                       "compute warp inline (0)", 1) == 1
    # Bytes issued and not landed are what every other load of the SM queues behind; landed ones are what
    # hide a wait. Below the slot count the cap keeps the second without the first.
    inflight = _choice(cfg, "MEGART_STREAM_INFLIGHT", tuple(range(0, slots + 1)), "a warp's weight stages issued "
                       f"and not yet landed, at most (0: up to the {slots} slots)", min(DEFAULT_INFLIGHT, slots))
    lay = StreamLayout(slots=slots, offset=offset, types=names, producer_warp=producer, stage_chunks=chunks,
                       inflight=0 if inflight >= slots else inflight)
    most = max(1, lay.producer_threads(cfg.threads) // 32)
    _choice(cfg, "MEGART_STREAM_PRODUCER_WARPS", tuple(range(1, most + 1)),
            f"producer warps that issue copies (the producer has {most} at {cfg.threads} compute threads)", most)
    _choice(cfg, "MEGART_STREAM_POLL", (0, 1), "the producer polls free slots without suspending (1) or with "
            "the suspending try_wait (0)", 1)
    _choice(cfg, "MEGART_STREAM_FREE", (0, 1, 2), "how a warp frees a slot: lane 0 arrives on its mbarrier (0), a "
            "release store of the warp's read count (1), every lane arrives (2, the default)", 2)
    return lay


def _check_kv_stage(types, names, cfg: KernelConfig, chunks: int) -> None:
    """Attention's K/V on the stream: a stage holds UB steps of each warp's rows (UB = slot bytes / 1 KB at any
    head size), read in the batches of attention's own ring at its default size (RU positions: 4, 2 or 1 by
    the thread count); the stage must hold whole batches (tasks/attention_decode.cuh static_asserts it)."""
    if not any(t.name in names and t.stream_format == "kv" for t in types):
        return
    from .tasks.attention_ring import ATTN_RING, ring_geometry
    ru = ring_geometry(ATTN_RING, cfg.threads)[0]
    ub = slot_bytes(chunks) // 1024
    if ub < ru or ub % ru:
        raise GraphError(f"MEGART_STREAM_KV=1 with MEGART_STREAM_STAGE={chunks} at {cfg.threads} threads: a K/V "
                         f"stage would hold {ub} steps of each warp's rows, not whole batches of attention's {ru}; "
                         "use a larger MEGART_STREAM_STAGE, or MEGART_STREAM_KV=0")


def stage_chunks(cfg: KernelConfig) -> int:
    """MEGART_STREAM_STAGE of the caller's defines: 128 by default (a slot holds 4 KB, half a 2048-wide bf16 row
    pair); a value not in STAGE_CHUNKS is a GraphError naming it."""
    return _choice(cfg, "MEGART_STREAM_STAGE", STAGE_CHUNKS, "16-byte chunks per row in one weight-stream stage",
                   DEFAULT_STAGE_CHUNKS)


def _choice(cfg: KernelConfig, name: str, allowed: tuple, what: str, default: int) -> int:
    """The integer macro `name` of the caller's defines, one of `allowed`; else a GraphError naming it."""
    v = caller_macros(cfg).get(name, default)
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = None
    if n not in allowed:
        raise GraphError(f"{name}={v!r}: expected one of {', '.join(map(str, allowed))} ({what})")
    return n


def chosen_automatically(types, cfg: KernelConfig, overrides: dict | None = None) -> bool:
    """The kernel streams because MEGART_STREAM_SLOTS is "auto" (not a number the caller gave): a build
    that spills may fall back to the register engine (PersistentKernel.compile)."""
    return _forced(cfg) is None and layout(types, cfg, overrides).slots > 0


def hang_site(event: int) -> str:
    """What a negative event of a hang record names, or '?'."""
    if HANG_SLOT_FREE - 64 < event <= HANG_SLOT_FREE:
        return f"weight-stream ring slot {HANG_SLOT_FREE - event} (never freed; have = the warp's stage, need = warp)"
    if event == HANG_POLL:
        return ("tagged words polled by the body (never written with this step's tag; have = the tag seen, "
                "need = this step's)")
    if -64 <= event <= -1:
        return f"weight-stream ring slot {-1 - event} (stage never landed; have = the warp's stage, need = warp)"
    return "?"
