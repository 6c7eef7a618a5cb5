"""Tensor-parallel exchange task types (ids 112-127), used by rank graphs that declare peer events
(docs/TP.md). Importing this module registers them:

    112 peer_copy         dst[i] = src[i], 32-bit words; dst may be another GPU's buffer (NVLink), so each
                          thread ends with a system-scope fence before the instance's peer signal
    113 tp_sum            y = residual + parts[0] + ... + parts[tp-1], f32 in rank order, one bf16 rounding:
                          the all-reduce's consumer, so every rank gets the same bits
    114 tp_argmax_reduce  token = argmax over every rank's LM-head partials (global vocabulary index)
    115 gemv_partial      y = W x in f32, unrounded (a row-parallel rank's partial), optionally also
                          stored into a peer GPU's slot (the push fused into the GEMV)
    116 tp_sum_f32        tp_sum over f32 partials: the sum is rounded to bf16 once, as on one GPU
"""
from __future__ import annotations

import torch

from ..registry import Cost, TaskType, ptr, register, scalar
from ..tensors import as_ref
from .dense_common import HEADERS, SCRATCH_BYTES, source, sum_parts, wrappers
from .dense_matvec import ROW_PAIRS, _gemv_cost, _gemv_split
from .tiling import even_tiles, require


def _sub(r, lo, n):
    return r.tensor.ref(r.offset + lo, n)


# ---- peer_copy -----------------------------------------------------------------------------------
def _copy_split(nw, tiles=1, dst=None, src=None):
    d, s = as_ref(dst, "dst"), as_ref(src, "src")
    require(d.count == s.count, "peer_copy", f"src has {s.count} words, dst {d.count}")
    return [dict(dst=_sub(d, lo, hi - lo), src=_sub(s, lo, hi - lo), n=hi - lo)
            for lo, hi in even_tiles(d.count, tiles, align=4)]     # 16-byte pieces stay aligned


def _copy_ref(p) -> None:
    p.dst.copy_(p.src)


register(TaskType(
    name="peer_copy", id=112,
    params=(ptr("dst", "i32", "out"), ptr("src", "i32", "in"), scalar("n")),
    source="tasks/peer_copy.cuh", reference=_copy_ref, split=_copy_split,
    cost=lambda dst=None, **_: Cost(bytes=8 * as_ref(dst, "dst").count),
    doc="dst[i] = src[i] over 32-bit words (view bf16/f32 data as i32); dst may be a peer GPU's buffer. "
        "Each thread fences at system scope after its stores, so the instance's peer signal publishes "
        "them. Tiles over the words."), builtin=True)


# ---- tp_sum --------------------------------------------------------------------------------------
def _sum_split(nw, tiles=1, y=None, parts=None, residual=None, tp=2):
    task = "tp_sum"
    y, parts = as_ref(y, "y"), as_ref(parts, "parts")
    require(tp >= 1 and parts.count == tp * y.count, task,
            f"parts has {parts.count} elements; {tp} ranks x y[{y.count}] needs {tp * y.count}")
    res = None if residual is None else as_ref(residual, "residual")
    if res is not None:
        require(res.count == y.count, task, f"residual has {res.count} elements, y has {y.count}")
    n, out = y.count, []
    for lo, hi in even_tiles(n, tiles):
        # one ref spans the instance's element of every rank's slot (reads only: over-covering the
        # slots' other elements can only add dependencies, never drop one)
        out.append(dict(y=_sub(y, lo, hi - lo), parts=_sub(parts, lo, (tp - 1) * n + hi - lo),
                        residual=None if res is None else _sub(res, lo, hi - lo),
                        n=hi - lo, stride=n, tp=tp, flags=int(res is not None)))
    return out


def _sum_ref(p) -> None:
    base = p.residual if p.flags & 1 else torch.zeros(p.n, dtype=torch.bfloat16)
    p.y.copy_(sum_parts(base, p.parts, p.tp, p.stride))


def _sum_params(parts_dtype: str) -> tuple:
    return (ptr("y", "bf16", "out"), ptr("parts", parts_dtype, "in"), ptr("residual", "bf16", "in", optional=True),
            scalar("n"), scalar("stride"), scalar("tp"), scalar("flags"))


register(TaskType(
    name="tp_sum", id=113,
    params=_sum_params("bf16"),
    source="tasks/tp_sum.cuh", reference=_sum_ref, split=_sum_split,
    cost=lambda y=None, tp=2, **_: Cost(bytes=2 * as_ref(y, "y").count * (tp + 2)),
    doc="y[i] = residual[i] + parts[0*stride+i] + ... + parts[(tp-1)*stride+i], summed in f32 in rank order "
        "and rounded to bf16 once (the all-reduce of row-parallel partials, identical on every rank). "
        "Tiles over y."), builtin=True)


# ---- tp_argmax_reduce ----------------------------------------------------------------------------
def _argmax_split(nw, tiles=1, token=None, parts=None, n=None, tp=2, vocab_per_rank=None):
    task = "tp_argmax_reduce"
    t, pr = as_ref(token, "token"), as_ref(parts, "parts")
    require(tiles == 1, task, "a single instance reduces all partials; pass tiles=1")
    require(t.count == 1, task, f"token must be one element, got {t.count}")
    require(n is not None and pr.count == tp * 2 * n, task,
            f"parts has {pr.count} words; {tp} ranks x (n values + n indices) needs {tp * 2 * (n or 0)}")
    require(vocab_per_rank is not None and vocab_per_rank > 0, task, "vocab_per_rank (> 0) is required")
    return [dict(token=t, parts=pr, n=n, tp=tp, vocab_per_rank=vocab_per_rank)]


def _argmax_ref(p) -> None:
    best_v, best_i = float("-inf"), 0x7FFFFFFF
    for r in range(p.tp):
        blk = p.parts[r * 2 * p.n:(r + 1) * 2 * p.n]
        vals = torch.nan_to_num(blk[:p.n].view(torch.float32), nan=float("-inf"))
        idx = blk[p.n:] + r * p.vocab_per_rank
        for v, i in zip(vals.tolist(), idx.tolist()):
            if v > best_v or (v == best_v and i < best_i):
                best_v, best_i = v, i
    p.token[0] = best_i


register(TaskType(
    name="tp_argmax_reduce", id=114,
    params=(ptr("token", "i32", "out"), ptr("parts", "i32", "in"), scalar("n"), scalar("tp"),
            scalar("vocab_per_rank")),
    source="tasks/tp_argmax_reduce.cuh", headers=HEADERS, reference=_argmax_ref, split=_argmax_split,
    cost=lambda parts=None, **_: Cost(bytes=4 * as_ref(parts, "parts").count + 4), smem_bytes=SCRATCH_BYTES,
    doc="token[0] = the global vocabulary index of the largest LM-head partial over all ranks: parts holds, "
        "per rank r, n f32 values (as bits) then n i32 rank-local rows, offset by r * vocab_per_rank (ties: "
        "the lowest index; NaN counts as -inf). One instance."), builtin=True)


# ---- gemv_partial / tp_sum_f32 -------------------------------------------------------------------
def _partial_split(nw, tiles=1, y=None, w=None, x=None, peer=None):
    out = _gemv_split("gemv_partial", nw, tiles, y, w, x, None, None, 1e-5)
    y0 = as_ref(y, "y").offset
    pr = None if peer is None else as_ref(peer, "peer")
    if pr is not None:
        require(pr.count == as_ref(y, "y").count, "gemv_partial", f"peer has {pr.count} elements, y has "
                f"{as_ref(y, 'y').count}")
    for inst in out:
        inst["peer"] = None if pr is None else _sub(pr, inst["y"].offset - y0, inst["n"])
    return out


def _partial_ref(p) -> None:
    p.y.copy_(p.w.view(p.n, p.k).float() @ p.x.float())
    if p.peer is not None:
        p.peer.copy_(p.y)


register(TaskType(
    name="gemv_partial", id=115, generated=wrappers("w", ring=True),
    params=(ptr("y", "f32", "out"), ptr("w", "bf16", "weight"), ptr("x", "bf16", "in"),
            ptr("peer", "f32", "out", optional=True), scalar("n"), scalar("k")),
    source=source("gemv_partial"), headers=HEADERS, reference=_partial_ref, split=_partial_split,
    cost=_gemv_cost, prefetch=True, **ROW_PAIRS,
    doc="y[N] = W[N,K] @ x, f32 out with no rounding (gemv_m1's engine; no residual, no norm): a "
        "row-parallel rank's partial, finished by tp_sum_f32. With `peer` (a peer GPU's slot), each row is "
        "stored there too and the instance fences at system scope, so a peer signal publishes it. Tiles over "
        "output rows."), builtin=True)

register(TaskType(
    name="tp_sum_f32", id=116,
    params=_sum_params("f32"),
    source="tasks/tp_sum_f32.cuh", reference=_sum_ref, split=_sum_split,
    cost=lambda y=None, tp=2, **_: Cost(bytes=2 * as_ref(y, "y").count * (2 * tp + 2)),
    doc="tp_sum over f32 partials (gemv_partial): y = residual + parts[0] + ... in f32, rank order, one bf16 "
        "rounding, so the tensor-parallel sum rounds as one GPU's GEMV does. Tiles over y."), builtin=True)
