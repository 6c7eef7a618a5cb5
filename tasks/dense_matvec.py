"""Weight-streaming dense decode tasks (M = 1): gemv_m1, gemv_m1_fp8, group_gemm_m1, gate_up_silu, gate_up_silu_fp8,
lm_head_argmax, and argmax_reduce that finishes the LM head. Device bodies: tasks/<name>.cuh over tasks/dense_common.cuh.

Each instance owns a contiguous block of output rows and streams exactly those weight rows; every
instance stages the whole x (optionally RMS-normalised, which each CTA recomputes, so no grid
barrier sits between the norm and the GEMV) in shared memory. Optional operands are encoded as a
`flags` bit plus a pointer that, when absent, points at one element the instance already touches."""
from __future__ import annotations

import torch

from ..geometry.dense import EXPERT_ROWS  # group_gemm_m1: each expert's tile of `a` / `y` rows (row 0 live)
from ..registry import Cost, TaskType, ptr, register, scalar
from .dense_common import (source, defines_for, matvec_macros, tagged_flag, smem_for, FLAG_LOGITS, FLAG_NORM, FLAG_PARTS, FLAG_RESIDUAL, SCRATCH_BYTES, HEADERS,
                           STAGE_SMEM, aligned, check_k, tagged_flags, disjoint, nbytes, opt_ref, overlaps, ref, shape_of, silu, stage_x, sub,
                           wrappers, fold_pieces, fold_ref, FOLD_PARAMS)
from .shapes import check_shape
from .tiling import even_tiles, map_ranges, require, round_rows

# GEMV types whose weights stream through the shared-memory ring (tasks/dense_engines.cuh): every type here
# (group_gemm_m1 too: its active experts are a build-time list, so its rows are known before its wait).
RING = dict(prewait=True, stream=True, smem_for=smem_for, defines_for=defines_for, smem_bytes=STAGE_SMEM)  # (smem_bytes: ring off)
# ... with the row pairs of a pair-plan instance (tasks/dense_bodies.cuh's pair_plan: rows 2g, 2g + 1 of n)
ROW_PAIRS = dict(RING, macros_for=matvec_macros(lambda p: (p["n"] + 1) // 2))
# ... and an x in pieces when it is tagged (gemv_m1, gemv_m1_fp8: MEGART_DENSE_X_PIECES)
GEMV_ROW_PAIRS = dict(RING, macros_for=matvec_macros(lambda p: (p["n"] + 1) // 2, tagged_flag))


def _norm(p):
    return p.norm_weight if p.flags & FLAG_NORM else None


def _common_x(task, x, norm_weight, k_mult=8):
    x = ref(task, x, "x")
    check_k(task, x.count, k_mult)
    aligned(task, x, "x")
    g = opt_ref(norm_weight, "norm_weight")
    if g is not None:
        require(g.count == x.count, task, f"norm_weight has {g.count} elements, x has {x.count}")
        aligned(task, g, "norm_weight")
    return x, g


# ---- gemv_m1 -------------------------------------------------------------------------------------
def _gemv_split(task, nw, tiles, y, w, x, residual, norm_weight, eps, scale=None, w_elem=2):
    y, w = ref(task, y, "y"), ref(task, w, "w")
    x, g = _common_x(task, x, norm_weight, 8 if w_elem == 2 else 16)
    n, k = y.count, x.count
    require(w.count == n * k, task, f"w has {w.count} elements; y[{n}] = W[{n},{k}] @ x[{k}] needs {n * k}")
    check_shape(task, w, "w", (n, k), "[N, K] for y[N] and x[K]")
    aligned(task, w, "w")
    disjoint(task, y, "y", x, "x")
    res = opt_ref(residual, "residual")
    if res is not None:
        require(res.count == n, task, f"residual has {res.count} elements, y has {n}")
        require(res.byte_range == y.byte_range or not overlaps(res, y), task,
                "residual must be exactly y (in-place x += W a) or not overlap it")
    sc = None
    if scale is not None or w_elem == 1:
        sc = ref(task, scale, "scale")
        require(sc.count == n, task, f"scale has {sc.count} elements, y has {n} (one per output channel)")
    flags = (FLAG_RESIDUAL if res is not None else 0) | (FLAG_NORM if g is not None else 0) \
        | tagged_flags(x=x, out=y, residual=res)
    out = []
    for lo, hi in even_tiles(n, tiles, align=2):     # whole row pairs: a warp streams two rows at once
        inst = dict(y=sub(y, lo, hi - lo), w=sub(w, lo * k, (hi - lo) * k), x=x,
                    residual=sub(res, lo, hi - lo) if res is not None else None,
                    norm_weight=g, n=hi - lo, k=k, flags=flags, eps=float(eps))
        if sc is not None:
            inst["scale"] = sub(sc, lo, hi - lo)
        out.append(inst)
    return out


def _gemv_ref(p) -> None:
    xs = stage_x(p.x, _norm(p), p.eps)
    acc = p.w.view(p.n, p.k).float() @ xs
    if p.flags & FLAG_RESIDUAL:
        acc = acc + p.residual.float()
    p.y.copy_(acc.to(torch.bfloat16))


def _gemv_cost(y=None, w=None, x=None, residual=None, norm_weight=None, scale=None, **_):
    y, w, x = ref("cost", y, "y"), ref("cost", w, "w"), ref("cost", x, "x")
    b = nbytes(w) + nbytes(x) + nbytes(y) + nbytes(opt_ref(residual, "residual")) \
        + nbytes(opt_ref(norm_weight, "norm_weight")) + nbytes(opt_ref(scale, "scale"))
    return Cost(bytes=b, flops=2 * y.count * x.count)


register(TaskType(
    name="gemv_m1", id=16, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:gemv_m1",
    generated=wrappers("w", ring=True),
    params=(ptr("y", "bf16", "out", tagged=True), ptr("w", "bf16", "weight"), ptr("x", "bf16", "in", tagged=True),
            ptr("residual", "bf16", "in", optional=True, tagged=True), ptr("norm_weight", "bf16", "weight", optional=True),
            scalar("n"), scalar("k"), scalar("flags"), scalar("eps", "f32")),
    source=source("gemv_m1"), headers=HEADERS, reference=_gemv_ref,
    split=lambda nw, tiles=1, y=None, w=None, x=None, residual=None, norm_weight=None, eps=1e-5:
        _gemv_split("gemv_m1", nw, tiles, y, w, x, residual, norm_weight, eps),
    cost=_gemv_cost, prefetch=True, **GEMV_ROW_PAIRS,
    doc="y[N] = W[N,K] @ x (+ residual[N], may be y itself); with norm_weight, x is RMS-normalised first "
        "(each CTA reduces x itself; the normalised x is rounded to bf16). bf16 in/out, fp32 accumulation. "
        "Tiles over output rows."), builtin=True)


# ---- gemv_m1_fp8 ---------------------------------------------------------------------------------
def _gemv_fp8_ref(p) -> None:
    xs = stage_x(p.x, _norm(p), p.eps)
    acc = (p.w.view(p.n, p.k).float() @ xs) * p.scale
    if p.flags & FLAG_RESIDUAL:
        acc = acc + p.residual.float()
    p.y.copy_(acc.to(torch.bfloat16))


register(TaskType(
    name="gemv_m1_fp8", id=24, hostsim=True, tol=5e-3, gate="megart.faithful.decode_gates:gemv_m1_fp8",
    generated=wrappers("w", ring=True),
    params=(ptr("y", "bf16", "out", tagged=True), ptr("w", "fp8e4m3", "weight"), ptr("scale", "f32", "weight"),
            ptr("x", "bf16", "in", tagged=True), ptr("residual", "bf16", "in", optional=True, tagged=True),
            ptr("norm_weight", "bf16", "weight", optional=True),
            scalar("n"), scalar("k"), scalar("flags"), scalar("eps", "f32")),
    source=source("gemv_m1_fp8"), headers=HEADERS, reference=_gemv_fp8_ref,
    split=lambda nw, tiles=1, y=None, w=None, scale=None, x=None, residual=None, norm_weight=None, eps=1e-5:
        _gemv_split("gemv_m1_fp8", nw, tiles, y, w, x, residual, norm_weight, eps, scale=scale, w_elem=1),
    cost=_gemv_cost, prefetch=True, **GEMV_ROW_PAIRS,
    doc="y[N] = scale[N] * (W8[N,K] @ x) (+ residual): pre-quantised e4m3 weights with per-output-channel "
        "f32 scales; same options as gemv_m1. K must be a multiple of 16."), builtin=True)


# ---- group_gemm_m1 -------------------------------------------------------------------------------
def _group_split(nw, tiles=1, y=None, w=None, a=None, active=None):
    task = "group_gemm_m1"
    shape = shape_of(task, ref(task, w, "w"), "w")
    require(len(shape) == 3, task, f"w must be [experts, N, K], got shape {shape}")
    e, n, k = shape
    w, y, a = ref(task, w, "w"), ref(task, y, "y"), ref(task, a, "a")
    check_k(task, k)
    require(a.count == e * EXPERT_ROWS * k, task, f"a has {a.count} elements, needs [{e}*{EXPERT_ROWS}, {k}]")
    require(y.count == e * EXPERT_ROWS * n, task, f"y has {y.count} elements, needs [{e}*{EXPERT_ROWS}, {n}]")
    check_shape(task, a, "a", (e * EXPERT_ROWS, k), "[experts * 128, K]")
    check_shape(task, y, "y", (e * EXPERT_ROWS, n), "[experts * 128, N]")
    for r, nm in ((w, "w"), (a, "a"), (y, "y")):
        aligned(task, r, nm)
    disjoint(task, y, "y", a, "a")
    require(active is not None and len(active) > 0, task, "active must list at least one expert id")
    act = [int(i) for i in active]
    require(len(set(act)) == len(act), task, f"active lists an expert twice: {act}")
    require(all(0 <= i < e for i in act), task, f"active expert ids must be in [0, {e}), got {act}")
    require(tiles >= 1, task, f"tiles must be >= 1, got {tiles}")
    out = []
    for j, ex in enumerate(act):
        t = max(1, tiles // len(act) + (1 if j < tiles % len(act) else 0))
        row = ex * EXPERT_ROWS
        for lo, hi in even_tiles(n, t, align=2):
            out.append(dict(y=sub(y, row * n + lo, hi - lo), w=sub(w, (ex * n + lo) * k, (hi - lo) * k),
                            a=sub(a, row * k, k), n=hi - lo, k=k))
    return out


def _group_ref(p) -> None:
    p.y.copy_((p.w.view(p.n, p.k).float() @ p.a.float()).to(torch.bfloat16))


def _group_cost(y=None, w=None, a=None, active=(), **_):
    e, n, k = ref("cost", w, "w").tensor.shape
    na = len(active)
    return Cost(bytes=na * (n * k * 2 + k * 2 + n * 2), flops=2 * na * n * k)


register(TaskType(
    name="group_gemm_m1", id=23, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:group_gemm_m1",
    generated=wrappers("w", ring=True),
    params=(ptr("y", "bf16", "out"), ptr("w", "bf16", "weight"), ptr("a", "bf16", "in"),
            scalar("n"), scalar("k")),
    source=source("group_gemm_m1"), headers=HEADERS, reference=_group_ref, split=_group_split, cost=_group_cost,
    prefetch=True, **ROW_PAIRS,
    doc=f"Routed MoE expert GEMM in decode geometry: y[e*{EXPERT_ROWS}, :] = W[e] @ a[e*{EXPERT_ROWS}, :] for "
        "each expert e in `active` (build-time list); only the live row is computed, only active experts' "
        "weights are read. `tiles` instances in all, dealt evenly over the active experts (>= 1 each)."),
    builtin=True)


# ---- gate_up_silu / gate_up_silu_fp8 -------------------------------------------------------------
def _gate_up_split(nw, tiles=1, h=None, w_gate=None, w_up=None, x=None, norm_weight=None, eps=1e-5,
                   s_gate=None, s_up=None, task="gate_up_silu", parts=None, tp=0, x_out=None, rotate=0, rounds=0):
    fp8 = task == "gate_up_silu_fp8"     # e4m3 rows with per-row f32 scales s_gate / s_up
    h, wg, wu = ref(task, h, "h"), ref(task, w_gate, "w_gate"), ref(task, w_up, "w_up")
    x, g = _common_x(task, x, norm_weight, 16 if fp8 else 8)
    f, k = h.count, x.count
    for r, nm in ((wg, "w_gate"), (wu, "w_up")):
        require(r.count == f * k, task, f"{nm} has {r.count} elements; h[{f}] needs [{f}, {k}] = {f * k}")
        check_shape(task, r, nm, (f, k), "[F, K] for h[F] and x[K]")
        aligned(task, r, nm)
    scales = {nm: ref(task, s, nm) for s, nm in ((s_gate, "s_gate"), (s_up, "s_up"))} if fp8 else {}
    for nm, r in scales.items():
        require(r.count == f, task, f"{nm} has {r.count} elements, h has {f} (one scale per row)")
    disjoint(task, h, "h", x, "x")
    require(isinstance(rotate, int) and not isinstance(rotate, bool) and rotate >= 0, task,
            f"rotate must be an int >= 0 (the instance the larger tiles begin at), got {rotate!r}")
    require(isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 0, task,
            f"rounds must be 0 (contiguous tiles) or the rows per instance per round (>= 1), got {rounds!r}")
    require(not rounds or (parts is None and x_out is None), task,
            "rounds (rows dealt in rounds) does not take parts / x_out (a folded all-reduce)")
    require(not rounds or f < 1 << 16, task, f"rounds (rows dealt in rounds) takes h of at most 65,535 rows, got {f}")
    fold = FLAG_PARTS if parts is not None else 0
    flags = (FLAG_NORM if g is not None else 0) | fold | tagged_flags(x=x, out=h)
    deal = round_rows(f, tiles, rounds, rotate) if rounds else []
    if any(d["row_full"] for d in deal):   # every instance sees the whole tensors; its row map names its rows
        return [dict(h=h, w_gate=wg, w_up=wu, x=x, norm_weight=g, n=d["n"], k=k, flags=flags, eps=float(eps),
                     **fold_pieces(task, x, [], None, 0, None, 1)[0], **scales,
                     **{m: d[m] for m in ROW_MAP})
                for d in deal]
    rows = even_tiles(f, tiles, rotate=rotate)   # (also where not one whole round fits: the same tiles as round_rows')
    folds = fold_pieces(task, x, [(h, "h")], parts, tp, x_out, len(rows))
    return [dict(h=sub(h, lo, hi - lo), w_gate=sub(wg, lo * k, (hi - lo) * k), w_up=sub(wu, lo * k, (hi - lo) * k),
                 x=x, norm_weight=g, n=hi - lo, k=k, flags=flags, eps=float(eps), **fd, **NO_ROW_MAP,
                 **{nm: sub(r, lo, hi - lo) for nm, r in scales.items()})
            for (lo, hi), fd in zip(rows, folds)]


# gate_up_silu's row map (tasks/tiling.py round_rows): local row g < row_full is (g // row_width) * row_stride +
# row_first + g % row_width, later ones row_tail + g - row_full. Contiguous tiles: g itself.
ROW_MAP = ("row_first", "row_stride", "row_full", "row_tail", "row_width")
NO_ROW_MAP = dict.fromkeys(ROW_MAP, 0)


def _gate_up_rows(p) -> torch.Tensor:
    """The rows of h (of the instance's h, w_gate, w_up) that instance `p` computes, in its order."""
    g = torch.arange(p.n)
    if not p.row_full:
        return g + p.row_tail
    full = (g // p.row_width) * p.row_stride + p.row_first + g % p.row_width
    return torch.where(g < p.row_full, full, p.row_tail + g - p.row_full)


def _gate_up_writes(params) -> dict:
    """h's elements an instance writes: its rows, as ranges (dealt in rounds, they are not the whole ref; a
    contiguous tile's are [0, n), its whole ref)."""
    return {"h": map_ranges(params)}


def _gate_up_ref(p) -> None:
    x = fold_ref(p, p.x)
    xs = stage_x(x, _norm(p), p.eps)
    rows = _gate_up_rows(p)
    gate = p.w_gate.view(-1, p.k)[rows].float() @ xs
    up = p.w_up.view(-1, p.k)[rows].float() @ xs
    if hasattr(p, "s_gate"):    # gate_up_silu_fp8: per-row scales after the fp32 dots, as the device
        gate, up = gate * p.s_gate[rows], up * p.s_up[rows]
    p.h[rows] = (silu(gate) * up).to(torch.bfloat16)


def _gate_up_cost(h=None, w_gate=None, w_up=None, x=None, norm_weight=None, s_gate=None, s_up=None, parts=None,
                  x_out=None, **_):
    h, x = ref("cost", h, "h"), ref("cost", x, "x")
    b = nbytes(ref("cost", w_gate, "w_gate")) + nbytes(ref("cost", w_up, "w_up")) + nbytes(x) + nbytes(h) \
        + nbytes(opt_ref(norm_weight, "norm_weight")) + nbytes(opt_ref(s_gate, "s_gate")) + nbytes(opt_ref(s_up, "s_up")) \
        + nbytes(opt_ref(parts, "parts")) + nbytes(opt_ref(x_out, "x_out"))
    return Cost(bytes=b, flops=4 * h.count * x.count)


register(TaskType(
    name="gate_up_silu", id=18, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:gate_up_silu",
    generated=wrappers("w_gate", "w_up", ring=True),
    params=(ptr("h", "bf16", "out", tagged=True), ptr("w_gate", "bf16", "weight"), ptr("w_up", "bf16", "weight"),
            ptr("x", "bf16", "in", tagged=True), ptr("norm_weight", "bf16", "weight", optional=True),
            scalar("n"), scalar("k"), scalar("flags"), scalar("eps", "f32"), *FOLD_PARAMS, *map(scalar, ROW_MAP)),
    writes_of=_gate_up_writes,
    source=source("gate_up_silu"), headers=HEADERS, reference=_gate_up_ref, split=_gate_up_split, cost=_gate_up_cost,
    prefetch=True, **RING, macros_for=matvec_macros(lambda p: p["n"], rounds=lambda p: p["row_width"] if p["row_full"] else 0),
    doc="h[F] = silu(Wg[F,K] x) * (Wu[F,K] x), gate and up kept in fp32 registers (never stored); optional "
        "RMSNorm prologue as gemv_m1. With parts (tp f32 slots of K) and x_out, a tensor-parallel all-reduce is "
        "folded in: x + parts[0] + ... + parts[tp-1] (rank order, one bf16 rounding, as tp_sum_f32) is what is "
        "normalised, and each instance stores its piece of that sum to x_out. Tiles over F (rotate = r: the tiles "
        "one row larger are those from instance r on). rounds = W deals F in rounds instead: round j gives "
        "instance i rows [j*W*T + i*W, +W) for as many whole rounds as fit (T instances), the rest as contiguous "
        "tiles; with W = the CTA's warp count the call then finishes h front to back (a reader of h in pieces, "
        "down, finds its first pieces complete early)."), builtin=True)


register(TaskType(
    name="gate_up_silu_fp8", id=25, hostsim=True, tol=1e-2,
    generated=wrappers("w_gate", "w_up", ring=True),
    params=(ptr("h", "bf16", "out", tagged=True), ptr("w_gate", "fp8e4m3", "weight"), ptr("w_up", "fp8e4m3", "weight"),
            ptr("s_gate", "f32", "weight"), ptr("s_up", "f32", "weight"), ptr("x", "bf16", "in", tagged=True),
            ptr("norm_weight", "bf16", "weight", optional=True),
            scalar("n"), scalar("k"), scalar("flags"), scalar("eps", "f32"), *FOLD_PARAMS, *map(scalar, ROW_MAP)),
    writes_of=_gate_up_writes,
    source=source("gate_up_silu_fp8"), headers=HEADERS, reference=_gate_up_ref,
    split=lambda nw, tiles=1, **kw: _gate_up_split(nw, tiles, task="gate_up_silu_fp8", **kw), cost=_gate_up_cost,
    prefetch=True, **RING, macros_for=matvec_macros(lambda p: p["n"], rounds=lambda p: p["row_width"] if p["row_full"] else 0),
    doc="h[F] = silu(s_gate[F] * (Wg8[F,K] x)) * (s_up[F] * (Wu8[F,K] x)): gate_up_silu with pre-quantised e4m3 "
        "weights and per-row f32 scales (gemv_m1_fp8's format), gate and up kept in fp32. K must be a "
        "multiple of 16. Tiles over F."), builtin=True)


# ---- lm_head_argmax / argmax_reduce --------------------------------------------------------------
def _lm_split(nw, tiles=1, w=None, x=None, part_val=None, part_idx=None, logits=None, norm_weight=None, eps=1e-5,
              scale=None, task="lm_head_argmax"):
    fp8 = task == "lm_head_argmax_fp8"
    w = ref(task, w, "w")
    x, g = _common_x(task, x, norm_weight, 16 if fp8 else 8)
    k = x.count
    require(w.count % k == 0, task, f"w has {w.count} elements, not a whole number of rows of {k}")
    aligned(task, w, "w")
    v = w.count // k
    check_shape(task, w, "w", (v, k), "[vocab, K] for x[K]")
    pv, pi = ref(task, part_val, "part_val"), ref(task, part_idx, "part_idx")
    parts = even_tiles(v, tiles)
    require(pv.count == len(parts) and pi.count == len(parts), task,
            f"part_val/part_idx need one entry per instance: {len(parts)} (tiles={tiles} over {v} rows), "
            f"got {pv.count} / {pi.count}")
    lg = opt_ref(logits, "logits")
    if lg is not None:
        require(lg.count == v, task, f"logits has {lg.count} elements, the vocabulary is {v}")
    sc = ref(task, scale, "scale") if fp8 else None
    if sc is not None:
        require(sc.count == v, task, f"scale has {sc.count} elements, the head has {v} rows (one scale per row)")
    flags = (FLAG_LOGITS if lg is not None else 0) | (FLAG_NORM if g is not None else 0) | tagged_flags(x=x)
    out = []
    for i, (lo, hi) in enumerate(parts):
        val = sub(pv, i, 1)
        out.append(dict(w=sub(w, lo * k, (hi - lo) * k), x=x, part_val=val, part_idx=sub(pi, i, 1),
                        logits=sub(lg, lo, hi - lo) if lg is not None else val,
                        norm_weight=g,
                        n=hi - lo, k=k, row0=lo, flags=flags, eps=float(eps)))
        if sc is not None:
            out[-1]["scale"] = sub(sc, lo, hi - lo)
    return out


def _lm_ref(p) -> None:
    xs = stage_x(p.x, _norm(p), p.eps)
    logits = p.w.view(p.n, p.k).float() @ xs
    if hasattr(p, "scale"):     # lm_head_argmax_fp8: per-row scales after the fp32 dot, as the device
        logits = logits * p.scale
    if p.flags & FLAG_LOGITS:
        p.logits.copy_(logits)
    v = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    i = int(torch.argmax(v))
    p.part_val[0] = v[i]
    p.part_idx[0] = p.row0 + i


def _lm_cost(w=None, x=None, part_val=None, part_idx=None, logits=None, norm_weight=None, scale=None, **_):
    w, x = ref("cost", w, "w"), ref("cost", x, "x")
    b = nbytes(w) + nbytes(opt_ref(scale, "scale")) + nbytes(x) + nbytes(ref("cost", part_val, "part_val")) \
        + nbytes(ref("cost", part_idx, "part_idx")) + nbytes(opt_ref(logits, "logits")) \
        + nbytes(opt_ref(norm_weight, "norm_weight"))
    return Cost(bytes=b, flops=2 * w.count)


register(TaskType(
    name="lm_head_argmax", id=21, hostsim=True, tol=1e-2,
    generated=wrappers("w", ring=True),
    params=(ptr("w", "bf16", "weight"), ptr("x", "bf16", "in", tagged=True), ptr("part_val", "f32", "out"),
            ptr("part_idx", "i32", "out"), ptr("logits", "f32", "out"), ptr("norm_weight", "bf16", "weight", optional=True),
            scalar("n"), scalar("k"), scalar("row0"), scalar("flags"), scalar("eps", "f32")),
    source=source("lm_head_argmax"), headers=HEADERS, reference=_lm_ref, split=_lm_split, cost=_lm_cost, prefetch=True, **ROW_PAIRS,
    doc="LM head over vocab rows of W[V,d] (tied: the embedding table) with the final RMSNorm optionally "
        "fused: each instance writes its max logit and its row (ties: lowest) to part_val[i]/part_idx[i], "
        "and, if `logits` is given, the f32 logits of its rows. part_val/part_idx have one entry per "
        "instance (= min(tiles, V))."), builtin=True)


register(TaskType(
    name="lm_head_argmax_fp8", id=26, hostsim=True, tol=1e-2,
    generated=wrappers("w", ring=True),
    params=(ptr("w", "fp8e4m3", "weight"), ptr("scale", "f32", "weight"), ptr("x", "bf16", "in", tagged=True),
            ptr("part_val", "f32", "out"), ptr("part_idx", "i32", "out"), ptr("logits", "f32", "out"),
            ptr("norm_weight", "bf16", "weight", optional=True),
            scalar("n"), scalar("k"), scalar("row0"), scalar("flags"), scalar("eps", "f32")),
    source=source("lm_head_argmax_fp8"), headers=HEADERS, reference=_lm_ref,
    split=lambda nw, tiles=1, **kw: _lm_split(nw, tiles, task="lm_head_argmax_fp8", **kw), cost=_lm_cost,
    prefetch=True, **ROW_PAIRS,
    doc="lm_head_argmax over a pre-quantised e4m3 head W8[V,d] with per-row f32 scales (logit = scale * "
        "(W8 x)): half the LM head's bytes. K must be a multiple of 16."), builtin=True)


def _argmax_split(nw, tiles=1, token=None, part_val=None, part_idx=None, history=None, pos=None):
    task = "argmax_reduce"
    t, pv, pi = ref(task, token, "token"), ref(task, part_val, "part_val"), ref(task, part_idx, "part_idx")
    require(t.count == 1, task, f"token must be one element, got {t.count}")
    require(pv.count == pi.count, task, f"part_val has {pv.count} entries, part_idx {pi.count}")
    require(tiles == 1, task, "a single instance reduces all partials; pass tiles=1")
    require((history is None) == (pos is None), task, "history and pos go together (history[pos[0]] = token)")
    h, ps = opt_ref(history, "history"), opt_ref(pos, "pos")
    require(ps is None or ps.count == 1, task, f"pos must be one element, got {ps.count if ps else 0}")
    return [dict(token=t, part_val=pv, part_idx=pi, n=pv.count, history=h, pos=ps, n_history=h.count if h else 0)]


def _argmax_ref(p) -> None:
    v = torch.nan_to_num(p.part_val, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    best = v.max()
    p.token[0] = int(p.part_idx[v == best].min())
    if p.history is not None and 0 <= int(p.pos[0]) < p.n_history:
        p.history[int(p.pos[0])] = p.token[0]


register(TaskType(
    name="argmax_reduce", id=22, hostsim=True,
    params=(ptr("token", "i32", "out"), ptr("part_val", "f32", "in"), ptr("part_idx", "i32", "in"), scalar("n"),
            ptr("history", "i32", "out", optional=True), ptr("pos", "i32", "in", optional=True), scalar("n_history")),
    source=source("argmax_reduce"), headers=HEADERS, reference=_argmax_ref, split=_argmax_split,
    cost=lambda token=None, part_val=None, **_: Cost(bytes=8 * ref("cost", part_val, "part_val").count + 4),
    smem_bytes=SCRATCH_BYTES,
    doc="token[0] = part_idx[j] of the largest part_val[j] (ties: the lowest index; NaN counts as -inf). "
        "One instance. With history and pos, also history[pos[0]] = token[0] when pos is inside the history "
        "(token_record's job, without its own hop at the end of the step)."), builtin=True)
