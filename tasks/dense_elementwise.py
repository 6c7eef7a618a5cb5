"""Small dense decode tasks: standalone rmsnorm, silu_mul and embedding (token id read on the
device, so the decode loop can feed the argmax back without the host). Bodies: tasks/<name>.cuh."""
from __future__ import annotations

import torch

from ..registry import Cost, TaskType, ptr, register, scalar
from .dense_common import (source, SCRATCH_BYTES, HEADERS, aligned, disjoint, nbytes, overlaps, ref, shape_of, silu,
                           stage_x, sub)
from .tiling import even_tiles, require


# ---- rmsnorm -------------------------------------------------------------------------------------
def _rmsnorm_split(nw, tiles=1, y=None, x=None, w=None, eps=1e-5):
    task = "rmsnorm"
    y, x, w = ref(task, y, "y"), ref(task, x, "x"), ref(task, w, "w")
    k = x.count
    require(k % 8 == 0, task, f"length {k} must be a multiple of 8 (16-byte vectors)")
    require(y.count == k and w.count == k, task, f"y, x, w need equal lengths, got {y.count}, {k}, {w.count}")
    for r, nm in ((y, "y"), (x, "x"), (w, "w")):
        aligned(task, r, nm)
    disjoint(task, y, "y", x, "x")
    return [dict(y=sub(y, lo, hi - lo), x=x, w=sub(w, lo, hi - lo), n=hi - lo, k=k, off=lo, eps=float(eps))
            for lo, hi in even_tiles(k, tiles, align=8)]


def _rmsnorm_ref(p) -> None:
    full = torch.zeros(p.k, dtype=torch.bfloat16)
    full[p.off:p.off + p.n] = p.w
    p.y.copy_(stage_x(p.x, full, p.eps)[p.off:p.off + p.n].to(torch.bfloat16))


register(TaskType(
    name="rmsnorm", id=17, hostsim=True, tol=1e-2,
    params=(ptr("y", "bf16", "out"), ptr("x", "bf16", "in"), ptr("w", "bf16", "weight"),
            scalar("n"), scalar("k"), scalar("off"), scalar("eps", "f32")),
    source=source("rmsnorm"), headers=HEADERS, reference=_rmsnorm_ref, split=_rmsnorm_split,
    cost=lambda y=None, x=None, w=None, **_: Cost(bytes=3 * nbytes(ref("cost", x, "x")),
                                                  flops=4 * ref("cost", x, "x").count),
    smem_bytes=SCRATCH_BYTES,
    doc="y = bf16(x * rsqrt(mean(x^2) + eps) * w) (fp32 math, one rounding). Tiles over output slices; "
        "each instance reduces the whole x itself."), builtin=True)


# ---- silu_mul ------------------------------------------------------------------------------------
def _silu_mul_split(nw, tiles=1, h=None, g=None, u=None):
    task = "silu_mul"
    h, g, u = ref(task, h, "h"), ref(task, g, "g"), ref(task, u, "u")
    n = h.count
    require(g.count == n and u.count == n, task, f"h, g, u need equal lengths, got {n}, {g.count}, {u.count}")
    for r, nm in ((h, "h"), (g, "g"), (u, "u")):
        aligned(task, r, nm)
        if nm != "h":
            require(r.byte_range == h.byte_range or not overlaps(r, h), task,
                    f"{nm} must be exactly h (in place) or not overlap it")
    return [dict(h=sub(h, lo, hi - lo), g=sub(g, lo, hi - lo), u=sub(u, lo, hi - lo), n=hi - lo)
            for lo, hi in even_tiles(n, tiles, align=8)]


def _silu_mul_ref(p) -> None:
    p.h.copy_((silu(p.g.float()) * p.u.float()).to(torch.bfloat16))


register(TaskType(
    name="silu_mul", id=19, hostsim=True, tol=1e-2,
    params=(ptr("h", "bf16", "out"), ptr("g", "bf16", "in"), ptr("u", "bf16", "in"), scalar("n")),
    source=source("silu_mul"), headers=HEADERS, reference=_silu_mul_ref, split=_silu_mul_split,
    cost=lambda h=None, **_: Cost(bytes=3 * nbytes(ref("cost", h, "h")), flops=5 * ref("cost", h, "h").count),
    doc="h = bf16(silu(g) * u) elementwise (fp32 math). h may be g or u itself."), builtin=True)


# ---- embedding -----------------------------------------------------------------------------------
def _embedding_split(nw, tiles=1, y=None, table=None, token=None):
    task = "embedding"
    shape = shape_of(task, ref(task, table, "table"), "table")
    require(len(shape) == 2, task, f"table must be [vocab, d], got shape {shape}")
    vocab, d = shape
    y, table, token = ref(task, y, "y"), ref(task, table, "table"), ref(task, token, "token")
    require(d % 8 == 0, task, f"row length d={d} must be a multiple of 8 (16-byte vectors)")
    require(y.count == d, task, f"y has {y.count} elements, a table row has {d}")
    require(token.count == 1, task, f"token must be one element, got {token.count}")
    aligned(task, y, "y")
    aligned(task, table, "table")
    return [dict(y=sub(y, lo, hi - lo), table=table, token=token, n=hi - lo, d=d, col0=lo, vocab=vocab)
            for lo, hi in even_tiles(d, tiles, align=8)]


def _embedding_ref(p) -> None:
    tok = min(max(int(p.token[0]), 0), p.vocab - 1)
    start = tok * p.d + p.col0
    p.y.copy_(p.table[start:start + p.n])


register(TaskType(
    name="embedding", id=20, hostsim=True, tol=0.0,
    params=(ptr("y", "bf16", "out"), ptr("table", "bf16", "weight"), ptr("token", "i32", "in"),
            scalar("n"), scalar("d"), scalar("col0"), scalar("vocab")),
    source=source("embedding"), headers=HEADERS, reference=_embedding_ref, split=_embedding_split,
    cost=lambda y=None, **_: Cost(bytes=2 * nbytes(ref("cost", y, "y")) + 4),
    doc="y[d] = table[token[0], :] with token an i32 device tensor of one element (clamped into "
        "[0, vocab)). Tiles over the row."), builtin=True)
