"""Shared pieces of the dense decode task declarations (ids 16-63): argument checks, the flag bits
the device bodies test, and the CPU mirror of the
device's x staging (RMSNorm prologue with bf16 rounding)."""
from __future__ import annotations

import torch

from ..errors import GraphError
from ..registry import header_constants, ptr, scalar
from ..tensors import DTYPES, TensorRef, as_ref
from .tiling import even_tiles, require

# helpers every dense body uses, emitted once per kernel in this order: values, loads and x staging; the
# matvec engines; row plans, epilogues and shared bodies
HEADERS = ("tasks/dense_common.cuh", "tasks/dense_engines.cuh", "tasks/dense_bodies.cuh")


def source(name: str) -> str:
    """The device body of dense task type `name`: one file per type."""
    return f"tasks/{name}.cuh"

# flag bits the bodies test, and the block-reduction scratch (x is staged right after it): declared here,
# emitted into the kernel as megart::dense::kFlag* / kScratchBytes before tasks/dense_common.cuh
FLAG_RESIDUAL = 1
FLAG_NORM = 2
FLAG_LOGITS = 4
FLAG_PARTS = 8       # gate_up_silu(_fp8): x = residual + the ranks' f32 partials (a folded all-reduce)
FLAG_TAGGED_X = 16   # x is a tagged tensor (megart/tagged.py): stage_x polls it
FLAG_TAGGED_OUT = 32  # the output (y, h) is tagged: the body stores tagged words
FLAG_TAGGED_RES = 64  # the residual is tagged: polled element by element

SCRATCH_BYTES = 256
header_constants(HEADERS[0], "megart::dense", {"kFlagResidual": FLAG_RESIDUAL, "kFlagNorm": FLAG_NORM,
                                                "kFlagLogits": FLAG_LOGITS, "kFlagParts": FLAG_PARTS,
                                                "kFlagTaggedX": FLAG_TAGGED_X, "kFlagTaggedOut": FLAG_TAGGED_OUT,
                                                "kFlagTaggedRes": FLAG_TAGGED_RES,
                                                "kScratchBytes": SCRATCH_BYTES})
MAX_K = 16384                  # longest x a GEMV-type body stages in shared memory (bf16)
STAGE_SMEM = SCRATCH_BYTES + 2 * MAX_K   # 33,024 B: under the 48 KiB default dynamic limit
ALIGN_BYTES = 16               # every vector-loaded operand starts on a 16-byte boundary

# Weight ring (tasks/dense_engines.cuh): per warp, `slots` stages of one row pair x 256 16-byte chunks,
# filled by TMA bulk copies that the prewait starts before the instance's wait. Python decides the
# slot count (the C++ reads MEGART_DENSE_RING_SLOTS / _OFFSET) and sizes shared memory with it.
# Off unless asked for (MEGART_DENSE_RING_SLOTS=2 or 3 at 256 threads): measured on the H200 it brings
# the LM head from 0.94 to 1.00-1.02 of the read floor alone, but makes the Llama-1B step slower
# (1,056.0 -> 1,274.4-1,320.9 us; bench/RESULTS.md, "Weight ring and attention ring"), so the register
# engine is the default.
SLOT_BYTES = 2 * 256 * 16      # kSlotBytes: 2 rows x kStageChunks (32 lanes x kUnroll 8) x 16 B
RING_OFFSET = STAGE_SMEM       # after x staging; a multiple of 128
assert RING_OFFSET % 128 == 0


def ring_slots(cfg) -> int:
    """Ring slots per warp: MEGART_DENSE_RING_SLOTS from the kernel's or the process's macros, else 0
    (the register engine). More slots than shared memory holds fail the co-residency check, naming
    shared memory (3 fit at 256 threads and one CTA per SM; none fit at two CTAs per SM)."""
    from ..config import caller_macros
    return int(caller_macros(cfg).get("MEGART_DENSE_RING_SLOTS", 0))


def ring_head_bytes(threads: int, slots: int) -> int:
    """mbarriers (8 B per warp and slot) and issued counts (4 B per warp), padded to 128 bytes."""
    warps = threads // 32
    return -(-(warps * slots * 8 + warps * 4) // 128) * 128


def ring_bytes(threads: int, slots: int) -> int:
    """Shared memory of the ring: the head, then warps x slots stages."""
    if slots <= 0:
        return 0
    return ring_head_bytes(threads, slots) + (threads // 32) * slots * SLOT_BYTES


def smem_for(cfg) -> int:
    """Dynamic shared memory of a GEMV-type body with a prewait: x staging, then the ring."""
    return STAGE_SMEM + ring_bytes(cfg.threads, ring_slots(cfg))


def defines_for(cfg) -> dict:
    """The ring's layout for tasks/dense_engines.cuh (which static_asserts what it can check)."""
    slots = ring_slots(cfg)
    if slots <= 0:
        return {"MEGART_DENSE_RING_SLOTS": 0}
    return {"MEGART_DENSE_RING_SLOTS": slots, "MEGART_DENSE_RING_OFFSET": RING_OFFSET,
            "MEGART_DENSE_RING_HEAD_BYTES": ring_head_bytes(cfg.threads, slots),
            "MEGART_DENSE_RING_SLOT_BYTES": SLOT_BYTES}


def whole_pairs_from(threads: int) -> int:
    """Row pairs from which an instance deals whole pairs to its warps (tasks/dense_engines.cuh's
    kWholePairsFrom: half the compute warps, plus one); fewer take the K-split path."""
    return threads // 32 // 2 + 1


def tagged_flag(p) -> bool:
    """Whether a flags-style dense instance reads its x as a tagged tensor."""
    return bool(p.get("flags", 0) & FLAG_TAGGED_X)


def matvec_macros(pairs, tagged_x=None, rounds=None):
    """TaskType.macros_for of a matvec type whose instance `p` has pairs(p) row pairs. MEGART_DENSE_KSPLIT=1 when
    one of them would take the K-split path, else 0 (the path is ~80 KB of code that a step whose instances all
    deal whole pairs never runs; the 1B step measured 8-15 us faster without it). For a type with an x-in-pieces
    path (gemv_m1, gemv_m1_fp8: tagged_x given), MEGART_DENSE_TAGGED_X=1 when one instance reads a tagged x
    (tagged_x(p)), else 0: only such an x is staged in pieces (MEGART_DENSE_X_PIECES), and a kernel without one
    leaves that code out (with the K-split path, it made the dense engines' kernels spill). For gate_up_silu
    (rounds given: an instance's round width, 0 for contiguous rows), MEGART_DENSE_ROW_ROUNDS = that width where an
    instance deals its rows in rounds; the type's instances in one kernel must share it."""
    def macros(params, threads: int) -> dict:
        least = whole_pairs_from(threads)
        out = {"MEGART_DENSE_KSPLIT": int(any(pairs(p) < least for p in params))}
        if tagged_x is not None:
            out["MEGART_DENSE_TAGGED_X"] = int(any(tagged_x(p) for p in params))
        widths = {rounds(p) for p in params} - {0} if rounds is not None else set()
        if len(widths) > 1:
            raise GraphError(f"rows dealt in rounds of different widths {sorted(widths)} in one kernel: the device "
                             "code takes one width (MEGART_DENSE_ROW_ROUNDS)")
        if widths:
            out["MEGART_DENSE_ROW_ROUNDS"] = widths.pop()
        return out
    return macros


def wrappers(*weights: str, ring: bool):
    """TaskType.generated of a dense matvec type: megart_prefetch_<name>, thread 0 handing the head of each
    of `weights` (n x k elements) to the L2 prefetcher, each its share of kPrefetchBytes; with `ring`, also
    megart_prewait_<name> / megart_drain_<name>, which fill the weight ring from plan_<name>(p) (defined by
    the body) and wait it out. Generated from the declaration, so no body file spells them out again."""
    def emit(t) -> str:
        head = "template <class P>\n__device__ __forceinline__ void "
        share = "" if len(weights) == 1 else f", megart::dense::kPrefetchBytes / {len(weights)}"
        calls = [f"megart::dense::prefetch_head(p.{w}, {DTYPES[t.param(w).dtype][2]}ull * p.n * p.k{share});"
                 for w in weights]
        body = f"  if (threadIdx.x == 0) {calls[0]}" if len(calls) == 1 else \
            "  if (threadIdx.x == 0) {\n" + "".join(f"    {c}\n" for c in calls) + "  }"
        out = f"{head}{t.prefetch_name}(const P& p) {{\n{body}\n}}\n"
        if ring:
            out += (f"\n{head}{t.prewait_name}(const P& p, char* smem) {{\n"
                    f"  megart::dense::ring_fill({t.plan_name}(p), smem);\n}}\n"
                    f"\n{head}{t.drain_name}(const P&, char* smem) {{\n  megart::dense::ring_drain(smem);\n}}\n")
        return out
    return emit


def ref(task: str, value, name: str) -> TensorRef:
    require(value is not None, task, f"argument {name!r} is required")
    return as_ref(value, name)


def opt_ref(value, name: str) -> TensorRef | None:
    return None if value is None else as_ref(value, name)


def tagged_flags(x=None, out=None, residual=None) -> int:
    """The FLAG_TAGGED_* bits for operands given as TensorRefs (None: absent)."""
    is_tagged = lambda r: r is not None and r.tensor.tagged  # noqa: E731
    return ((FLAG_TAGGED_X if is_tagged(x) else 0) | (FLAG_TAGGED_OUT if is_tagged(out) else 0)
            | (FLAG_TAGGED_RES if is_tagged(residual) else 0))


def aligned(task: str, r: TensorRef, name: str) -> None:
    require(r.address % ALIGN_BYTES == 0, task,
            f"{name} ({r.tensor.name!r} at element {r.offset}) must start on a {ALIGN_BYTES}-byte boundary "
            "for 16-byte vector loads")


def check_k(task: str, k: int, multiple: int = 8) -> None:
    require(k % multiple == 0, task,
            f"the reduction length k={k} must be a multiple of {multiple} (16-byte weight rows)")
    require(0 < k <= MAX_K, task, f"k={k} is outside (0, {MAX_K}]: x is staged whole in shared memory")


def overlaps(a: TensorRef, b: TensorRef) -> bool:
    (alo, ahi), (blo, bhi) = a.byte_range, b.byte_range
    return alo < bhi and blo < ahi


def disjoint(task: str, a: TensorRef, an: str, b: TensorRef, bn: str) -> None:
    require(not overlaps(a, b), task,
            f"{an} and {bn} overlap: every instance reads all of {bn} while others write their slice of {an}")


def sub(r: TensorRef, lo: int, count: int) -> TensorRef:
    return r.tensor.ref(r.offset + lo, count)


def shape_of(task: str, value, name: str) -> tuple:
    """The shape of a whole megart Tensor (a TensorRef counts only when it covers its whole tensor)."""
    r = as_ref(value, name)
    require(r.offset == 0 and r.count == r.tensor.numel, task,
            f"{name} must be a whole tensor (its shape is needed), not a slice")
    return r.tensor.shape


def sum_parts(x: torch.Tensor, parts: torch.Tensor, tp: int, stride: int | None = None) -> torch.Tensor:
    """bf16(x + parts[0] + ... + parts[tp-1]): the ranks' slots (`stride` elements apart, default len(x))
    added in f32 in rank order and rounded once, so every rank gets the same bits: tp_sum's and tp_sum_f32's
    arithmetic, and what a folded all-reduce stages."""
    n = x.numel()
    stride = n if stride is None else stride
    acc = x.float().clone()
    for r in range(tp):
        acc += parts[r * stride:r * stride + n].float()
    return acc.to(torch.bfloat16)


# The parameters of a folded all-reduce (fold_pieces' per-instance values), in this order in every type that takes one.
FOLD_PARAMS = (ptr("parts", "f32", "in", optional=True), ptr("x_out", "bf16", "out", optional=True), scalar("tp"),
               scalar("x_lo"), scalar("x_hi"))


def fold_pieces(task: str, x: TensorRef, outs: list, parts, tp, x_out, n_inst: int) -> list:
    """A tensor-parallel all-reduce folded into a body's x staging (gate_up_silu, qkv_rope_append): parts (tp
    f32 slots of len(x)) are added to x, and instance j stores its 8-aligned piece of the sum to x_out. Neither
    may overlap x, and parts may not overlap an output of the call (`outs`: [(ref, name)]). Returns the
    per-instance params (parts, x_out, tp, x_lo, x_hi); parts None: no fold."""
    if parts is None and x_out is None:
        return [dict(parts=None, x_out=None, tp=0, x_lo=0, x_hi=0)] * n_inst
    require(parts is not None and x_out is not None, task, "parts and x_out come together (a folded all-reduce: "
            "x + the ranks' partials is staged, and x_out receives that sum)")
    pr, xo, k = ref(task, parts, "parts"), ref(task, x_out, "x_out"), x.count
    require(isinstance(tp, int) and tp >= 1 and pr.count == tp * k, task,
            f"parts has {pr.count} elements; tp={tp!r} slots of x[{k}] need {tp * k if isinstance(tp, int) else '?'}")
    require(xo.count == k, task, f"x_out has {xo.count} elements, x has {k}")
    aligned(task, pr, "parts")
    aligned(task, xo, "x_out")
    for r, nm in ((pr, "parts"), (xo, "x_out")):
        disjoint(task, r, nm, x, "x")
    disjoint(task, xo, "x_out", pr, "parts")
    for o, nm in outs:
        if o is None:
            continue
        disjoint(task, o, nm, pr, "parts")
        require(not overlaps(o, xo), task, f"{nm} and x_out overlap: the instances write both, {nm} by rows and "
                "x_out by 8-element pieces")
    pieces = even_tiles(k, n_inst, align=8)
    pieces += [(0, 0)] * (n_inst - len(pieces))      # (more instances than 8-element pieces: some store none)
    return [dict(parts=pr, x_out=sub(xo, lo, hi - lo) if hi > lo else None, tp=tp, x_lo=lo, x_hi=hi)
            for lo, hi in pieces]


def fold_ref(p, x: torch.Tensor) -> torch.Tensor:
    """The reference of a folded all-reduce (fold_pieces' params on instance p): the staged x, with this
    instance's piece of it stored to x_out."""
    if p.parts is None:
        return x
    x = sum_parts(x, p.parts, p.tp)
    if p.x_out is not None:
        p.x_out.copy_(x[p.x_lo:p.x_hi])
    return x


def stage_x(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 copy of what the device stages in shared memory: x, or bf16(x * rsqrt(mean(x^2)+eps) * g)."""
    xf = x.float()
    if norm_weight is None:
        return xf
    rstd = torch.rsqrt((xf * xf).sum() / xf.numel() + torch.tensor(eps, dtype=torch.float32))
    return (xf * rstd * norm_weight.float()).to(torch.bfloat16).float()


def silu(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


def nbytes(r: TensorRef | None) -> int:
    """Bytes the operation moves for `r`: a tagged tensor's elements count as their 2-byte bf16 values (the tags
    are the format's overhead, not the operation's: a cost model feeds the floor)."""
    if r is None:
        return 0
    return r.count * (2 if r.tensor.tagged else r.tensor.itemsize)
