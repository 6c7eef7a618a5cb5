"""Attention decode task types (ids 64-95): fused QKV projection + RoPE + KV-cache append, flash-decoding
attention over KV chunks, and the log-sum-exp merge of the chunks. bf16 storage, fp32 math.

The decode position is device data (`pos`, an i32 tensor of one element), so one compiled kernel serves
every step: kv_len = pos + 1 is read on the device, never baked into the descriptors.

Dependency refs (the byte ranges that order instances):
* qkv_rope_append writes q exactly (two refs per instance: the low and the high half of its pairs). A
  cache-writing instance may write row `pos` of its kv head, which is only known on the device, so its
  write ref covers the head's whole cache region [h, 0:max_seq, :].
  - kv_refs="strict" (default): k and v heads are never sub-tiled (sub-tiles of one head would all claim the
    whole head and be serialised by write-after-write dependencies), only q heads are.
  - kv_refs="partition": k and v heads are sub-tiled like q heads, and the sub-tiles of one head claim
    disjoint pieces of the head's region whose union is the whole region. Every byte any of them may
    write lies in the union, so a consumer whose read ref covers the whole head (attention_decode's does)
    waits on all of them; a consumer reading only part of the head would not be ordered correctly.
    Shorter longest instance (hd/2 x d instead of hd x d weight bytes); see docs/TASKS.md.
* attention_decode reads q (its group's heads), the whole k/v head (pos is dynamic) and writes its own
  partial slots exactly; attention_merge reads the partials of its q heads and writes out exactly.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from ..geometry.attention import attention_chunks, auto_tiles, chunk_range
from ..registry import Cost, TaskType, header_constants, ptr, register, scalar
from ..tensors import as_ref
from .attention_ring import ATTN_RING, LOW_REG_THREADS, attn_ring_bytes, ring_defines
from .dense_common import (HEADERS as DENSE_HEADERS, SCRATCH_BYTES as DENSE_SCRATCH, FOLD_PARAMS, fold_pieces,
                           fold_ref, nbytes, opt_ref)
from .shapes import check_shape
from .tiling import even_tiles, pos_stamp_ref, require

ATTN_HD = (64, 128)
ATTN_MAX_GROUP = 16       # n_q / n_kv; an instance serves at most ATTN_SUBGROUP of them
ATTN_SUBGROUP = 8         # q heads one attention_decode instance holds in registers (its template width)
QKV_MAX_D = 8192
QKV_MAX_ROWS = max(ATTN_HD)  # rows of one qkv_rope_append instance (2 * half; hd <= 128)
ATTN_STAGE_WARPS = 8      # warps attention_decode merges per shared-memory round
MODE_ROPE, MODE_NORM, MODE_CACHE, MODE_HEAD_NORM = 1, 2, 4, 8
MODE_TAGGED_X = 16    # qkv_rope_append's x is a tagged tensor (megart/tagged.py): polled as it is staged
MODE_TAGGED_OUT = 32  # its outputs are tagged words: q, and the new k/v rows in [n_kv, hd] buffers (not the cache)
MODE_PARTS = 64      # a tensor-parallel all-reduce folded into the x staging (parts, tp, x_out: fold_pieces)
# qkv_rope_append runs on the dense matvec engine: its block scratch, x staged whole (bf16), then the
# instance's 2 * npairs fp32 dots
SMEM_QKV = DENSE_SCRATCH + 2 * QKV_MAX_D + 4 * QKV_MAX_ROWS


def merge_bytes(hd: int, width: int) -> int:
    """attention_decode's merge scratch across warps for instances of `width` q heads of size hd:
    [warp][group][hd + m, l] fp32."""
    return 4 * ATTN_STAGE_WARPS * width * (hd + 2)


SMEM_ATTN_MERGE = merge_bytes(max(ATTN_HD), ATTN_SUBGROUP)   # any shape
NEW_ROW_BYTES = 2 * 16 * 16   # the staged new K and V row (hd <= 128: 16 vectors of 8 bf16 each)
ATTENTION_HEADERS = ("tasks/attention_common.cuh",)
# qkv_rope_append(_fp8): their shared body after the attention and dense headers it uses
QKV_HEADERS = ATTENTION_HEADERS + DENSE_HEADERS + ("tasks/qkv_common.cuh",)
# declared here, emitted into the kernel as megart_attn::k* before tasks/attention_common.cuh
header_constants(ATTENTION_HEADERS[0], "megart_attn", {
    "kModeRope": MODE_ROPE, "kModeNorm": MODE_NORM, "kModeCache": MODE_CACHE, "kModeHeadNorm": MODE_HEAD_NORM,
    "kModeTaggedX": MODE_TAGGED_X, "kModeTaggedOut": MODE_TAGGED_OUT, "kModeParts": MODE_PARTS,
    "kQkvMaxD": QKV_MAX_D, "kQkvMaxRows": QKV_MAX_ROWS, "kAttnStageWarps": ATTN_STAGE_WARPS,
    "kLowRegThreads": LOW_REG_THREADS})
SMEM_ATTN = max(SMEM_ATTN_MERGE, ATTN_RING)  # the merge reuses the ring's bytes once it is drained


def _aligned16(ref, name, task):
    require(ref.byte_range[0] % 16 == 0, task, f"{name} must start on a 16-byte boundary (16-byte vector loads)")


def _check_q_and_caches(T, qr, kr, vr, n_q, n_kv, hd, max_seq) -> int:
    """q holds n_q heads, the caches n_kv heads of max_seq positions each (as declared, if declared): the
    cache length."""
    require(qr.count == n_q * hd, T, f"q has {qr.count} elements, expected n_q * hd = {n_q * hd}")
    return _cache_len(T, kr, vr, n_kv, hd, max_seq)


def _cache_len(T, kr, vr, n_kv, hd, max_seq) -> int:
    """The caches hold n_kv heads of max_seq positions each (as declared, if declared): the cache length."""
    require(kr.count == vr.count and kr.count % (n_kv * hd) == 0, T,
            f"k_cache/v_cache must both hold n_kv * max_seq * hd elements (got {kr.count}, {vr.count})")
    ms = kr.count // (n_kv * hd)
    _check_caches(T, kr, vr, n_kv, ms, hd)
    require(max_seq is None or max_seq == ms, T, f"max_seq={max_seq} but the caches hold {ms} positions")
    return ms


def _check_caches(task, kr, vr, n_kv, ms, hd):
    for r, name in ((kr, "k_cache"), (vr, "v_cache")):
        check_shape(task, r, name, (n_kv, ms, hd), "[n_kv, max_seq, hd]")


def _wide(view, n):
    """A view of n elements starting where `view` starts (same storage): the cache row `pos` of a
    partition-mode instance can lie outside its own claim (see the module docstring)."""
    if view.numel() >= n:
        return view
    return view.as_strided((n,), (1,), view.storage_offset())


# --- qkv_rope_append -------------------------------------------------------------------------------------

def _sub_counts(total, n, cap):
    """Spread `total` sub-tiles over n heads (each 1..cap)."""
    base, extra = divmod(max(total, n), n)
    return [min(cap, max(1, base + (1 if i < extra else 0))) for i in range(n)]


def _tagged_rows(T, k_new, v_new, n_kv, hd) -> dict:
    """k_new and v_new as refs ({"k_new": ref, "v_new": ref}): tagged tensors of n_kv * hd elements each."""
    out = {}
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        r = as_ref(t, name)
        require(r.tensor.tagged, T, f"{name} must be a tagged tensor (pk.tensor(..., tagged=True))")
        require(r.count == n_kv * hd, T, f"{name} has {r.count} elements, expected n_kv * hd = {n_kv * hd}")
        out[name] = r
    return out


def _new_rows(T, qr, k_new, v_new, n_kv, hd):
    """The tagged form's [n_kv, hd] buffers of this step's new k and v rows ({"k": ref, "v": ref}), or None.
    q, k_new and v_new are tagged tensors together or not at all: qkv writes them as tagged words instead of
    appending to the caches, and attention_decode polls them (kv_commit appends the rows later in the step)."""
    if k_new is None and v_new is None and not qr.tensor.tagged:
        return None
    require(k_new is not None and v_new is not None and qr.tensor.tagged, T,
            "the tagged form takes q, k_new and v_new as tagged tensors, all three (pk.tensor(..., tagged=True))")
    rows = _tagged_rows(T, k_new, v_new, n_kv, hd)
    for name, r in rows.items():
        _aligned16(r, name, T)
    return {"k": rows["k_new"], "v": rows["v_new"]}


def _qkv_split(nw, tiles=1, *, q, k_cache, v_cache, w_qkv, x, cos, sin, pos, n_q, n_kv, hd, norm_weight=None,
               eps=1e-5, max_seq=None, kv_refs="strict", q_norm=None, k_norm=None, scale=None, k_new=None, v_new=None,
               parts=None, tp=0, x_out=None, T="qkv_rope_append"):
    fp8 = T == "qkv_rope_append_fp8"     # e4m3 rows, one f32 scale per row (`scale`, [rows])
    qr, kr, vr, wr = as_ref(q, "q"), as_ref(k_cache, "k_cache"), as_ref(v_cache, "v_cache"), as_ref(w_qkv, "w_qkv")
    xr, cr, sr, pr = as_ref(x, "x"), as_ref(cos, "cos"), as_ref(sin, "sin"), as_ref(pos, "pos")
    require(hd in ATTN_HD, T, f"hd must be one of {ATTN_HD}, got {hd}")
    require(n_q >= 1 and n_kv >= 1 and n_q % n_kv == 0, T, f"n_q ({n_q}) must be a positive multiple of n_kv ({n_kv})")
    require(kv_refs in ("strict", "partition"), T, f"kv_refs must be 'strict' or 'partition', got {kv_refs!r}")
    d = xr.count
    require(d % 8 == 0 and 8 <= d <= QKV_MAX_D, T, f"d (x has {d} elements) must be a multiple of 8 in [8, {QKV_MAX_D}]")
    rows = (n_q + 2 * n_kv) * hd
    require(wr.count == rows * d, T, f"w_qkv has {wr.count} elements, expected (n_q + 2 n_kv) * hd * d = {rows * d}")
    check_shape(T, wr, "w_qkv", (rows, d), "[(n_q + 2 n_kv) * hd, d]")
    ms = _check_q_and_caches(T, qr, kr, vr, n_q, n_kv, hd, max_seq)
    half = hd // 2
    for ref, name in ((cr, "cos"), (sr, "sin")):
        require(ref.count % half == 0 and ref.count // half >= ms, T,
                f"{name} must be [>= max_seq ({ms}), hd/2 ({half})] f32, has {ref.count} elements")
    require(pr.count == 1, T, f"pos must be a single i32 element, has {pr.count}")
    _aligned16(wr, "w_qkv", T)
    if fp8:
        require(d % 16 == 0, T, f"d = {d} must be a multiple of 16 for e4m3 rows (16 weights a 16-byte chunk)")
        require(scale is not None, T, "scale (f32, one per row of w_qkv) is required")
        scr = as_ref(scale, "scale")
        require(scr.count == rows, T, f"scale has {scr.count} elements, w_qkv has {rows} rows")
    _aligned16(xr, "x", T)
    mode_norm = 0
    nr = None
    if norm_weight is not None:
        nr = as_ref(norm_weight, "norm_weight")
        require(nr.count == d, T, f"norm_weight has {nr.count} elements, x has {d}")
        _aligned16(nr, "norm_weight", T)
        mode_norm = MODE_NORM
    if xr.tensor.tagged:
        mode_norm |= MODE_TAGGED_X
    eps = float(eps)
    require(eps > 0, T, f"eps must be > 0, got {eps}")
    require((q_norm is None) == (k_norm is None), T, "q_norm and k_norm come together (Qwen3) or not at all")
    head_norm = {}
    if q_norm is not None:
        for name, t in (("q", q_norm), ("k", k_norm)):
            r = as_ref(t, f"{name}_norm")
            require(r.count == hd, T, f"{name}_norm has {r.count} elements, expected hd = {hd}")
            head_norm[name] = r

    new = _new_rows(T, qr, k_new, v_new, n_kv, hd)   # tagged outputs: {"k": ref, "v": ref} or None
    heads = [("q", h) for h in range(n_q)] + [("k", h) for h in range(n_kv)] + [("v", h) for h in range(n_kv)]
    total = auto_tiles(tiles, nw)
    if head_norm:
        # a normed head needs all hd dots in one instance: q and k heads whole, v heads share the rest
        v_subs = _sub_counts(total - n_q - n_kv, n_kv, half) if kv_refs == "partition" else [1] * n_kv
        subs = [1] * (n_q + n_kv) + v_subs
    elif kv_refs == "partition":
        subs = _sub_counts(total, len(heads), half)
    else:
        subs = _sub_counts(total - 2 * n_kv, n_q, half) + [1] * (2 * n_kv)
    out = []
    for (kind, h), nsub in zip(heads, subs):
        row0 = {"q": h, "k": n_q + h, "v": n_q + n_kv + h}[kind] * hd
        pieces = even_tiles(half, nsub)
        cache = kr if kind == "k" else vr
        base = cache.offset + h * ms * hd
        for s, (a, b) in enumerate(pieces):
            w_ref = wr.tensor.ref(wr.offset + (row0 + a) * d, (half + b - a) * d)
            tagged_out = dict(tdst=None, tdst2=None)
            if new is not None:   # q or the head's new k/v row, as tagged words: exact refs, no cache row
                tr = qr if kind == "q" else new[kind]
                tagged_out = dict(tdst=tr.tensor.ref(tr.offset + h * hd + a, b - a),
                                  tdst2=tr.tensor.ref(tr.offset + h * hd + half + a, b - a))
                dst = dst2 = None
                mode = MODE_TAGGED_OUT | (MODE_ROPE if kind != "v" else 0)
            elif kind == "q":
                dst = qr.tensor.ref(qr.offset + h * hd + a, b - a)
                dst2 = qr.tensor.ref(qr.offset + h * hd + half + a, b - a)
                mode = MODE_ROPE
            else:
                end = pieces[s + 1][0] if s + 1 < len(pieces) else ms * hd
                dst = cache.tensor.ref(base + a, end - a)   # whole head when nsub == 1
                dst2 = dst
                mode = MODE_CACHE | (MODE_ROPE if kind == "k" else 0)
            # an unused pointer: qkv_rope_append's needs a valid ref (its bf16 weights), the fp8 form's is null
            dummy = None if fp8 else w_ref.tensor.ref(w_ref.offset, 1)
            hn = head_norm.get(kind)
            if hn is not None:
                mode |= MODE_HEAD_NORM
            out.append(dict(w=w_ref, x=xr, norm_weight=nr if nr is not None else dummy,
                            cos=cr, sin=sr, pos=pr, dst=dst, dst2=dst2, head_norm=hn if hn is not None else dummy,
                            mode=mode | mode_norm, npairs=b - a, pair0=a, d=d, half=half, max_seq=ms, eps=eps,
                            **tagged_out))
            if fp8:    # (the scales of the same rows as w: the instance's first row on)
                out[-1]["scale"] = scr.tensor.ref(scr.offset + row0 + a, half + b - a)
    # (parts may not overlap what the call writes: q, the caches, the tagged rows)
    outs = [(qr, "q"), (kr, "k_cache"), (vr, "v_cache")] + [(r, f"{k}_new") for k, r in (new or {}).items()]
    for params, fold in zip(out, fold_pieces(T, xr, outs, parts, tp, x_out, len(out))):
        params.update(fold)
        if parts is not None:
            params["mode"] |= MODE_PARTS
    return out


def _qkv_ref(p) -> None:
    """One instance, mirroring the device: fp32 dots of bf16 W with the (optionally RMS-normalised and
    bf16-rounded) x, RoPE in fp32 on the fp32 dots, one rounding to bf16 at the store."""
    import torch
    x = fold_ref(p, p.x).float()    # (the folded sum's piece is stored whatever pos is, as on the device)
    pos = int(p.pos[0])
    if not 0 <= pos < p.max_seq:
        return
    d, n, half, a = p.d, p.npairs, p.half, p.pair0
    if p.mode & MODE_NORM:
        inv = torch.rsqrt((x * x).sum() / d + torch.tensor(p.eps, dtype=torch.float32))
        x = ((x * inv) * p.norm_weight.float()).to(torch.bfloat16).float()
    w = p.w.view(-1, d)
    lo = w[:n].float() @ x
    hi = w[half:half + n].float() @ x
    if hasattr(p, "scale"):     # qkv_rope_append_fp8: each row's scale after its fp32 dot, as the device
        lo, hi = lo * p.scale[:n], hi * p.scale[half:half + n]
    if p.mode & MODE_HEAD_NORM:     # the instance holds the whole head (n == half)
        inv = torch.rsqrt((lo * lo + hi * hi).sum() / (2 * n) + torch.tensor(p.eps, dtype=torch.float32))
        g = p.head_norm.float()
        lo, hi = lo * inv * g[a:a + n], hi * inv * g[half + a:half + a + n]
    if p.mode & MODE_ROPE:
        c = p.cos[pos * half + a:pos * half + a + n]
        s = p.sin[pos * half + a:pos * half + a + n]
        lo, hi = lo * c - hi * s, hi * c + lo * s
    if p.mode & MODE_TAGGED_OUT:
        p.tdst.copy_(lo.to(torch.bfloat16))
        p.tdst2.copy_(hi.to(torch.bfloat16))
    elif p.mode & MODE_CACHE:
        row = pos * 2 * half
        dst = _wide(p.dst, row + half + n)
        dst[row:row + n] = lo.to(torch.bfloat16)
        dst[row + half:row + half + n] = hi.to(torch.bfloat16)
    else:
        p.dst.copy_(lo.to(torch.bfloat16))
        p.dst2.copy_(hi.to(torch.bfloat16))


def _qkv_cost(*, q, k_cache, w_qkv, x, n_q, n_kv, hd, norm_weight=None, q_norm=None, scale=None, parts=None,
              x_out=None, **_):
    wr, d = as_ref(w_qkv, "w_qkv"), as_ref(x, "x").count
    head_norms = 2 * hd * 2 if q_norm is not None else 0          # q_norm and k_norm gains (Qwen3), bf16 [hd] each
    w_bytes = wr.count * wr.tensor.itemsize + (as_ref(scale, "scale").count * 4 if scale is not None else 0)
    total = w_bytes + d * 2 + (d * 2 if norm_weight is not None else 0) + head_norms \
        + n_q * hd * 2 + 2 * n_kv * hd * 2 + nbytes(opt_ref(parts, "parts")) + nbytes(opt_ref(x_out, "x_out"))
    return Cost(bytes=total, flops=2 * wr.count)



register(TaskType(
    name="qkv_rope_append", id=64, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:qkv_rope_append",
    params=(ptr("w", "bf16", "weight"), ptr("x", "bf16", "in", tagged=True), ptr("norm_weight", "bf16", "weight"),
            ptr("cos", "f32", "weight"), ptr("sin", "f32", "weight"), ptr("pos", "i32", "in"),
            ptr("dst", "bf16", "inout", optional=True), ptr("dst2", "bf16", "inout", optional=True),
            ptr("head_norm", "bf16", "weight"),
            scalar("mode"), scalar("npairs"), scalar("pair0"), scalar("d"), scalar("half"), scalar("max_seq"),
            scalar("eps", "f32"), ptr("tdst", "bf16", "out", optional=True, tagged=True),
            ptr("tdst2", "bf16", "out", optional=True, tagged=True), *FOLD_PARAMS),
    source="tasks/qkv_rope_append.cuh", headers=QKV_HEADERS, reference=_qkv_ref,
    split=_qkv_split, cost=_qkv_cost, smem_bytes=SMEM_QKV, prefetch=True, stream=True,
    doc="q, k, v = (rmsnorm(x)) @ w_qkv.T; optional per-head RMSNorm of q, k (q_norm / k_norm, Qwen3); "
        "rotate-half RoPE on q, k at the device position pos; k, v appended to the caches at row pos, or (the "
        "tagged form: q, k_new, v_new tagged tensors) q and the new k, v rows stored as tagged words."), builtin=True)


register(TaskType(
    name="qkv_rope_append_fp8", id=67, hostsim=True,
    params=(ptr("w", "fp8e4m3", "weight"), ptr("x", "bf16", "in", tagged=True),
            ptr("norm_weight", "bf16", "weight", optional=True),
            ptr("cos", "f32", "weight"), ptr("sin", "f32", "weight"), ptr("pos", "i32", "in"),
            ptr("dst", "bf16", "inout", optional=True), ptr("dst2", "bf16", "inout", optional=True),
            ptr("head_norm", "bf16", "weight", optional=True),
            scalar("mode"), scalar("npairs"), scalar("pair0"), scalar("d"), scalar("half"), scalar("max_seq"),
            scalar("eps", "f32"), ptr("scale", "f32", "weight"), ptr("tdst", "bf16", "out", optional=True, tagged=True),
            ptr("tdst2", "bf16", "out", optional=True, tagged=True), *FOLD_PARAMS),
    source="tasks/qkv_rope_append_fp8.cuh", headers=QKV_HEADERS, reference=_qkv_ref,
    split=lambda nw, tiles=1, **kw: _qkv_split(nw, tiles, T="qkv_rope_append_fp8", **kw), cost=_qkv_cost,
    smem_bytes=SMEM_QKV, prefetch=True, stream=True,
    doc="qkv_rope_append over e4m3 rows of w_qkv with one f32 scale per row (`scale`, [rows]): each dot times "
        "its row's scale, then the head norm, RoPE and the stores as qkv_rope_append. d a multiple of 16."),
    builtin=True)


# --- attention_decode ------------------------------------------------------------------------------------

def _attn_shapes(T, q, k_cache, v_cache, n_q, n_kv, hd, max_seq):
    qr, kr, vr = as_ref(q, "q"), as_ref(k_cache, "k_cache"), as_ref(v_cache, "v_cache")
    require(hd in ATTN_HD, T, f"hd must be one of {ATTN_HD}, got {hd}")
    require(n_q >= 1 and n_kv >= 1 and n_q % n_kv == 0, T, f"n_q ({n_q}) must be a positive multiple of n_kv ({n_kv})")
    group = n_q // n_kv
    require(1 <= group <= ATTN_MAX_GROUP, T, f"group n_q / n_kv must be in [1, {ATTN_MAX_GROUP}], got {group}")
    ms = _check_q_and_caches(T, qr, kr, vr, n_q, n_kv, hd, max_seq)
    for ref, name in ((qr, "q"), (kr, "k_cache"), (vr, "v_cache")):
        _aligned16(ref, name, T)
    return qr, kr, vr, group, ms


def _attn_split(nw, tiles=1, *, q, k_cache, v_cache, pos, part_o, part_ml, n_q, n_kv, hd, max_seq=None, chunk=0,
                chunks=None, scale=None, out=None, arrivals=None, k_new=None, v_new=None, pos_stamp=None):
    T = "attention_decode"
    qr, kr, vr, group, ms = _attn_shapes(T, q, k_cache, v_cache, n_q, n_kv, hd, max_seq)
    pr, por, pmr = as_ref(pos, "pos"), as_ref(part_o, "part_o"), as_ref(part_ml, "part_ml")
    require(pr.count == 1, T, f"pos must be a single i32 element, has {pr.count}")
    chunk = int(chunk or 0)
    require(chunk >= 0, T, f"chunk must be >= 0 (0: dynamic chunks), got {chunk}")
    nch = attention_chunks(n_kv, ms, nw, chunk, None if chunk else chunks, tiles)
    if chunk and chunks is not None:
        require(chunks == nch, T, f"chunks={chunks} but chunk={chunk} over max_seq={ms} gives {nch}")
    require(nch >= 1, T, f"chunks must be >= 1, got {nch}")
    require(por.count == n_kv * nch * group * hd, T,
            f"part_o has {por.count} elements, expected [n_kv, chunks, group, hd] = {n_kv * nch * group * hd}")
    require(pmr.count == n_kv * nch * group * 2, T,
            f"part_ml has {pmr.count} elements, expected [n_kv, chunks, group, 2] = {n_kv * nch * group * 2}")
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    fused = _fused_refs(T, out, arrivals, n_q, n_kv, hd, group, nch)
    tagged_out = int(out is not None and as_ref(out, "out").tensor.tagged)
    new = _new_rows(T, qr, k_new, v_new, n_kv, hd)   # the tagged form: q and the new rows polled
    stamp = pos_stamp_ref(T, pos_stamp)   # (the weight stream's producer reads pos once it is stamped)
    res = []
    for h in range(n_kv):
        k_ref = kr.tensor.ref(kr.offset + h * ms * hd, ms * hd)
        v_ref = vr.tensor.ref(vr.offset + h * ms * hd, ms * hd)
        rows = dict(k_new=None, v_new=None) if new is None else {
            f"{k}_new": r.tensor.ref(r.offset + h * hd, hd) for k, r in new.items()}
        for g0, ng in head_subgroups(group):
            q_ref = qr.tensor.ref(qr.offset + (h * group + g0) * hd, ng * hd)
            for c in range(nch):
                slot = (h * nch + c) * group + g0        # [n_kv, chunks, group] index of the first q head
                res.append(dict(q=q_ref, k_cache=k_ref, v_cache=v_ref, pos=pr,
                                part_o=por.tensor.ref(por.offset + slot * hd, ng * hd),
                                part_ml=pmr.tensor.ref(pmr.offset + slot * 2, ng * 2),
                                group=ng, hd=hd, chunk=chunk, cidx=c, nchunks=nch, max_seq=ms, scale=scale,
                                tagged_out=tagged_out, pos_stamp=stamp, **rows, **fused(h, c)))
    return res


def fused_merge_fits(group: int, hd: int, chunks: int) -> bool:
    """attention_decode can merge its own partials: every q head of a kv head in one instance, and each of
    the head's chunks a non-empty piece of its group * hd outputs to claim."""
    return group <= ATTN_SUBGROUP and chunks <= group * hd


def out_claim(n: int, parts: int, i: int) -> tuple[int, int]:
    """Instance i's disjoint piece [lo, hi) of a kv head's n merged outputs (the device finds its head's
    start as its own pointer minus lo)."""
    return i * n // parts, (i + 1) * n // parts


def _fused_refs(T, out, arrivals, n_q, n_kv, hd, group, nch):
    """The fused form's per-instance refs, (h, c) -> {out, arrivals}: chunk c of kv head h claims piece c of
    the head's outputs (a reader of out waits for every chunk; the last to arrive writes all of them) and
    the head's arrival counter. Without out and arrivals: null pointers (attention_merge merges)."""
    if out is None and arrivals is None:
        return lambda h, c: dict(out=None, arrivals=None)
    require(out is not None and arrivals is not None, T, "out and arrivals come together (the fused merge) or not at all")
    orf, ar = as_ref(out, "out"), as_ref(arrivals, "arrivals")
    n = group * hd
    if not fused_merge_fits(group, hd, nch):
        require(group <= ATTN_SUBGROUP, T, f"the fused merge needs every q head of a kv head in one instance: "
                                           f"group {group} > {ATTN_SUBGROUP}; merge with attention_merge instead")
        require(False, T, f"the fused merge gives each of a kv head's {nch} chunks a piece of its {n} outputs; "
                          f"use at most {n} chunks or attention_merge")
    require(orf.count == n_q * hd, T, f"out has {orf.count} elements, expected n_q * hd = {n_q * hd}")
    require(ar.count == n_kv, T, f"arrivals has {ar.count} elements, expected one i32 counter per kv head ({n_kv})")

    def refs(h, c):
        lo, hi = out_claim(n, nch, c)
        return dict(out=orf.tensor.ref(orf.offset + h * n + lo, hi - lo), arrivals=ar.tensor.ref(ar.offset + h, 1))
    return refs


def head_subgroups(group: int) -> list[tuple[int, int]]:
    """(first q head, count) of the instances sharing one kv head: the whole group up to ATTN_SUBGROUP,
    else the fewest near-equal pieces (9 -> 5 + 4, 16 -> 8 + 8), each a size the device code instantiates.
    Each piece reads the kv head's K/V itself, so groups over 8 stream it twice."""
    n = -(-group // ATTN_SUBGROUP)
    return [(a, b - a) for a, b in even_tiles(group, n)]


def _kv_len(pos: int, max_seq: int) -> int:
    return 0 if pos < 0 else min(pos + 1, max_seq)


def _attn_ref(p) -> None:
    import torch
    G, hd = p.group, p.hd
    kv_len = _kv_len(int(p.pos[0]), p.max_seq)
    lo, hi = chunk_range(p.chunk, p.cidx, p.nchunks, kv_len)
    if hi <= lo:
        p.part_o.zero_()
        p.part_ml.view(G, 2)[:, 0] = float("-inf")
        p.part_ml.view(G, 2)[:, 1] = 0.0
        return
    q = p.q.reshape(G, hd).float()
    k = p.k_cache.view(-1, hd)[lo:hi].float()
    v = p.v_cache.view(-1, hd)[lo:hi].float()
    pos = int(p.pos[0])
    if getattr(p, "k_new", None) is not None and lo <= pos < hi:   # the tagged form: row pos is this step's new row
        k[pos - lo] = p.k_new.float()
        v[pos - lo] = p.v_new.float()
    s = (q @ k.T) * torch.tensor(p.scale, dtype=torch.float32)
    m = s.max(dim=1).values
    e = torch.exp(s - m[:, None])
    p.part_o.copy_((e @ v).reshape(-1))
    ml = p.part_ml.view(G, 2)
    ml[:, 0] = m
    ml[:, 1] = e.sum(dim=1)


def _attn_fused_ref(p) -> None:
    """The partials, then (the fused form) the arrival: the last chunk of the kv head merges them all."""
    _attn_ref(p)
    if p.arrivals is None:
        return
    p.arrivals[0] += 1
    if int(p.arrivals[0]) != p.nchunks:
        return
    p.arrivals[0] = 0
    G, hd, C = p.group, p.hd, p.nchunks
    back = lambda view, n, total: view.as_strided(  # noqa: E731  (stride: a tagged out's values are every other half)
        (total,), (view.stride(0),), view.storage_offset() - n * view.stride(0))
    _merge_ref(SimpleNamespace(out=back(p.out, out_claim(G * hd, C, p.cidx)[0], G * hd),
                               part_o=back(p.part_o, p.cidx * G * hd, C * G * hd),
                               part_ml=back(p.part_ml, p.cidx * G * 2, C * G * 2),
                               nheads=G, group=G, hd=hd, chunks=C, g0=0))


def _attn_cost(*, q, k_cache, pos, n_q, n_kv, hd, out=None, part_o=None, **_):
    pr, kr = as_ref(pos, "pos"), as_ref(k_cache, "k_cache")
    ms = kr.count // (n_kv * hd)
    kv_len = _kv_len(int(pr.tensor.data.reshape(-1)[pr.offset].item()), ms)
    kv_bytes = 2 * n_kv * kv_len * hd * 2
    cost = Cost(bytes=kv_bytes + n_q * hd * 2, flops=4 * n_q * kv_len * hd)
    if out is None:
        return cost
    chunks = as_ref(part_o, "part_o").count // (n_q * hd)      # part_o is [n_kv, chunks, group, hd]
    merge = _merge_cost(n_q=n_q, n_kv=n_kv, hd=hd, chunks=chunks)
    return Cost(bytes=cost.bytes + merge.bytes, flops=cost.flops + merge.flops)


def body_defines(hd: int, group: int) -> dict:
    """Macros that compile only the attention_decode bodies one shape runs: its head size and the instance
    widths its GQA group splits into (the models' kernels and the benches that stand in for them)."""
    mask = sum(1 << n for n in {n for _, n in head_subgroups(group)})
    return {"MEGART_ATTN_HD_ONLY": hd, "MEGART_ATTN_GROUP_MASK": hex(mask)}


def compiled_merge_bytes(cfg) -> int:
    """The merge scratch of the bodies a kernel built with `cfg` compiles: its head size and widest instance
    (MEGART_ATTN_HD_ONLY / MEGART_ATTN_GROUP_MASK, body_defines), else any shape."""
    from ..config import caller_macros
    macros = caller_macros(cfg)
    hd = int(macros.get("MEGART_ATTN_HD_ONLY", max(ATTN_HD)))
    mask = int(str(macros.get("MEGART_ATTN_GROUP_MASK", "0")), 0)
    widths = [g for g in range(1, ATTN_SUBGROUP + 1) if mask >> g & 1]
    return merge_bytes(hd, max(widths) if widths else ATTN_SUBGROUP)


def stages_new_row(cfg) -> bool:
    """Whether attention_decode stages a new K/V row in shared memory: its tagged form (q and the new rows as
    tagged words), or K/V through the weight stream (row pos staged from the cache)."""
    from ..config import kv_streamed, macro_on
    return macro_on(cfg, "MEGART_ATTN_TAGGED") or kv_streamed(cfg)


def new_row_offset(cfg) -> int:
    """Where the staged new row lies in the instance's shared memory (MEGART_ATTN_NEW_ROW_OFFSET): past the K/V
    ring, which it is copied into while the ring is read, and past the compiled merge scratch, which is written
    once the row is dead."""
    return -(-max(attn_ring_bytes(cfg), compiled_merge_bytes(cfg)) // 16) * 16


def _attn_smem(cfg) -> int:
    # The merge scratch for any shape stays the floor: the default kernels' layout, as measured. The new row
    # fits below it where the compiled shapes' merge is smaller than the ring's 32 KB (the 1B shape: 8,448 B).
    smem = max(SMEM_ATTN_MERGE, attn_ring_bytes(cfg))
    if stages_new_row(cfg):
        smem = max(smem, new_row_offset(cfg) + NEW_ROW_BYTES)
    return smem


def _attn_defines(cfg) -> dict:
    return {**ring_defines(cfg), "MEGART_ATTN_NEW_ROW_OFFSET": new_row_offset(cfg)}


def _attn_macros(params) -> dict:
    """The forms the graph's instances use: tagged (k_new given), and unstamped (no pos_stamp: K/V read by
    the body even where the stream carries the others')."""
    out = {}
    if any(p.get("k_new") is not None for p in params):
        out["MEGART_ATTN_TAGGED"] = 1
    if any(p.get("pos_stamp") is None for p in params):
        out["MEGART_ATTN_UNSTAMPED"] = 1
    return out


register(TaskType(
    name="attention_decode", id=65, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:attention_decode",
    params=(ptr("q", "bf16", "in", tagged=True), ptr("k_cache", "bf16", "in"), ptr("v_cache", "bf16", "in"),
            ptr("pos", "i32", "in"), ptr("part_o", "f32", "out"), ptr("part_ml", "f32", "out"),
            scalar("group"), scalar("hd"), scalar("chunk"), scalar("cidx"), scalar("nchunks"), scalar("max_seq"),
            scalar("scale", "f32"), ptr("out", "bf16", "out", optional=True, tagged=True),
            ptr("arrivals", "i32", "sync", optional=True), scalar("tagged_out"),
            ptr("k_new", "bf16", "in", optional=True, tagged=True), ptr("v_new", "bf16", "in", optional=True, tagged=True),
            ptr("pos_stamp", "bf16", "in", optional=True, tagged=True)),
    source="tasks/attention_decode.cuh", headers=ATTENTION_HEADERS + ("tasks/attention_decode_blocks.cuh",),
    reference=_attn_fused_ref, split=_attn_split,
    stream=True, stream_format="kv",
    cost=_attn_cost, smem_bytes=SMEM_ATTN, smem_for=_attn_smem, defines_for=_attn_defines,
    macros_for=_attn_macros,
    doc="Flash-decoding partials (m, l, unnormalised o) of one query token over one KV chunk of one kv "
        "head (GQA), kv_len = pos + 1 read on the device; with out and arrivals (one i32 counter per kv head, "
        "zero at the start) the last chunk of each kv head to finish also merges its partials into out. The "
        "tagged form (q, k_new, v_new tagged, from qkv_rope_append's tagged form) polls q and takes position pos "
        "from k_new / v_new, so it waits on no event of qkv's. With pos_stamp (the word pos_advance stamps once "
        "pos is written) and the weight stream on, the chunk's K/V rows come through the stream, loaded ahead "
        "while the calls before it run; without it the instance reads them itself."),
    builtin=True)


# --- attention_merge -------------------------------------------------------------------------------------

def _merge_split(nw, tiles=1, *, out, part_o, part_ml, n_q, n_kv, hd, chunks):
    T = "attention_merge"
    orf, por, pmr = as_ref(out, "out"), as_ref(part_o, "part_o"), as_ref(part_ml, "part_ml")
    require(hd in ATTN_HD, T, f"hd must be one of {ATTN_HD}, got {hd}")
    require(n_q >= 1 and n_kv >= 1 and n_q % n_kv == 0, T, f"n_q ({n_q}) must be a positive multiple of n_kv ({n_kv})")
    require(chunks >= 1, T, f"chunks must be >= 1, got {chunks}")
    G, C = n_q // n_kv, int(chunks)
    require(orf.count == n_q * hd, T, f"out has {orf.count} elements, expected n_q * hd = {n_q * hd}")
    require(por.count == n_kv * C * G * hd, T,
            f"part_o has {por.count} elements, expected [n_kv, chunks, group, hd] = {n_kv * C * G * hd}")
    require(pmr.count == n_kv * C * G * 2, T,
            f"part_ml has {pmr.count} elements, expected [n_kv, chunks, group, 2] = {n_kv * C * G * 2}")
    n = min(n_q, nw) if tiles is None or tiles <= 1 else int(tiles)
    res = []
    for i0, i1 in even_tiles(n_q, n):
        (h0, g0), (h1, g1) = divmod(i0, G), divmod(i1 - 1, G)
        o_lo, o_hi = (h0 * C * G + g0) * hd, ((h1 * C + C - 1) * G + g1 + 1) * hd
        m_lo, m_hi = (h0 * C * G + g0) * 2, ((h1 * C + C - 1) * G + g1 + 1) * 2
        res.append(dict(out=orf.tensor.ref(orf.offset + i0 * hd, (i1 - i0) * hd),
                        part_o=por.tensor.ref(por.offset + o_lo, o_hi - o_lo),
                        part_ml=pmr.tensor.ref(pmr.offset + m_lo, m_hi - m_lo),
                        nheads=i1 - i0, group=G, hd=hd, chunks=C, g0=g0, tagged_out=int(orf.tensor.tagged)))
    return res


def _merge_ref(p) -> None:
    import torch
    G, hd, C, g0 = p.group, p.hd, p.chunks, p.g0
    out = p.out.view(p.nheads, hd)
    for k in range(p.nheads):
        dh, g = divmod(g0 + k, G)
        head = dh * C * G + (g - g0)
        idx = torch.arange(C) * G + head
        m = p.part_ml[idx * 2]
        l = p.part_ml[idx * 2 + 1]
        o = p.part_o.view(-1)[(idx * hd)[:, None] + torch.arange(hd)[None, :]]
        M = m.max()
        if M == float("-inf"):
            out[k] = 0
            continue
        w = torch.exp(m - M)
        L = (w * l).sum()
        out[k] = ((w[:, None] * o).sum(dim=0) / L).to(torch.bfloat16) if L > 0 else 0


def _merge_cost(*, n_q, n_kv, hd, chunks, **_):
    return Cost(bytes=n_q * chunks * (hd + 2) * 4 + n_q * hd * 2, flops=3 * n_q * chunks * hd)


register(TaskType(
    name="attention_merge", id=66, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:attention_merge",
    params=(ptr("out", "bf16", "out", tagged=True), ptr("part_o", "f32", "in"), ptr("part_ml", "f32", "in"),
            scalar("nheads"), scalar("group"), scalar("hd"), scalar("chunks"), scalar("g0"), scalar("tagged_out")),
    source="tasks/attention_merge.cuh", headers=ATTENTION_HEADERS, reference=_merge_ref, split=_merge_split, cost=_merge_cost,
    doc="out[q head] = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c over the attention_decode chunks "
        "(out may be a tagged tensor: tagged_out, set by the splitter)."),
    builtin=True)


# --- kv_commit -------------------------------------------------------------------------------------------

def _commit_split(nw, tiles=1, *, k_new, v_new, k_cache, v_cache, pos, n_kv, hd, max_seq=None):
    T = "kv_commit"
    require(hd in ATTN_HD, T, f"hd must be one of {ATTN_HD}, got {hd}")
    require(n_kv >= 1, T, f"n_kv must be >= 1, got {n_kv}")
    kr, vr, pr = as_ref(k_cache, "k_cache"), as_ref(v_cache, "v_cache"), as_ref(pos, "pos")
    ms = _cache_len(T, kr, vr, n_kv, hd, max_seq)
    require(pr.count == 1, T, f"pos must be a single i32 element, has {pr.count}")
    return [dict(**_tagged_rows(T, k_new, v_new, n_kv, hd), k_cache=kr, v_cache=vr, pos=pr, n=n_kv * hd, hd=hd,
                 max_seq=ms)]


def _commit_ref(p) -> None:
    pos = int(p.pos[0])
    if not 0 <= pos < p.max_seq:
        return
    nkv = p.n // p.hd
    p.k_cache.view(nkv, p.max_seq, p.hd)[:, pos] = p.k_new.reshape(nkv, p.hd)
    p.v_cache.view(nkv, p.max_seq, p.hd)[:, pos] = p.v_new.reshape(nkv, p.hd)


register(TaskType(
    name="kv_commit", id=68, hostsim=True,
    params=(ptr("k_new", "bf16", "in", tagged=True), ptr("v_new", "bf16", "in", tagged=True),
            ptr("k_cache", "bf16", "inout"), ptr("v_cache", "bf16", "inout"), ptr("pos", "i32", "in"),
            scalar("n"), scalar("hd"), scalar("max_seq")),
    source="tasks/kv_commit.cuh", headers=ATTENTION_HEADERS, reference=_commit_ref, split=_commit_split,
    cost=lambda *, n_kv, hd, **_: Cost(bytes=2 * n_kv * hd * (4 + 2), flops=0),
    doc="k_cache[h, pos] = k_new[h], v_cache[h, pos] = v_new[h] for every kv head: the tagged form's cache "
        "append (qkv_rope_append stored the new rows as tagged words; attention_decode polled them), after "
        "every instance that reads the caches."),
    builtin=True)
