"""qkv_rope_append and qkv_rope_append_fp8 (ids 64 and 67): the fused QKV projection (optionally RMS-normed x,
per-head q/k norms) with rotate-half RoPE and the KV-cache append at the device position `pos`, on the dense
matvec engine. bf16 storage (or e4m3 rows with one f32 scale each), fp32 math.

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
"""
from __future__ import annotations

from ..geometry.attention import auto_tiles
from ..registry import Cost, TaskType, ptr, register, scalar
from ..tensors import as_ref
from .attention_common import (ATTENTION_HEADERS, ATTN_HD, MODE_CACHE, MODE_HEAD_NORM, MODE_NORM, MODE_PARTS,
                               MODE_ROPE, MODE_TAGGED_OUT, MODE_TAGGED_X, QKV_MAX_D, QKV_MAX_ROWS, aligned16,
                               check_q_and_caches, new_rows)
from .dense_common import (HEADERS as DENSE_HEADERS, SCRATCH_BYTES as DENSE_SCRATCH, FOLD_PARAMS, fold_pieces,
                           fold_ref, matvec_macros, nbytes, opt_ref)
from .shapes import check_shape
from .tiling import even_tiles, require

# qkv_rope_append runs on the dense matvec engine: its block scratch, x staged whole (bf16), then the
# instance's 2 * npairs fp32 dots
SMEM_QKV = DENSE_SCRATCH + 2 * QKV_MAX_D + 4 * QKV_MAX_ROWS
# their shared body after the attention and dense headers it uses
QKV_HEADERS = ATTENTION_HEADERS + DENSE_HEADERS + ("tasks/qkv_common.cuh",)


def _wide(view, n):
    """A view of n elements starting where `view` starts (same storage): the cache row `pos` of a
    partition-mode instance can lie outside its own claim (see the module docstring)."""
    if view.numel() >= n:
        return view
    return view.as_strided((n,), (1,), view.storage_offset())


# --- qkv_rope_append ----------------------------------------------------------------------------------------

def _sub_counts(total, n, cap):
    """Spread `total` sub-tiles over n heads (each 1..cap)."""
    base, extra = divmod(max(total, n), n)
    return [min(cap, max(1, base + (1 if i < extra else 0))) for i in range(n)]


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
    ms = check_q_and_caches(T, qr, kr, vr, n_q, n_kv, hd, max_seq)
    half = hd // 2
    for ref, name in ((cr, "cos"), (sr, "sin")):
        require(ref.count % half == 0 and ref.count // half >= ms, T,
                f"{name} must be [>= max_seq ({ms}), hd/2 ({half})] f32, has {ref.count} elements")
    require(pr.count == 1, T, f"pos must be a single i32 element, has {pr.count}")
    aligned16(wr, "w_qkv", T)
    if fp8:
        require(d % 16 == 0, T, f"d = {d} must be a multiple of 16 for e4m3 rows (16 weights a 16-byte chunk)")
        require(scale is not None, T, "scale (f32, one per row of w_qkv) is required")
        scr = as_ref(scale, "scale")
        require(scr.count == rows, T, f"scale has {scr.count} elements, w_qkv has {rows} rows")
    aligned16(xr, "x", T)
    mode_norm = 0
    nr = None
    if norm_weight is not None:
        nr = as_ref(norm_weight, "norm_weight")
        require(nr.count == d, T, f"norm_weight has {nr.count} elements, x has {d}")
        aligned16(nr, "norm_weight", T)
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

    new = new_rows(T, qr, k_new, v_new, n_kv, hd)   # tagged outputs: {"k": ref, "v": ref} or None
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
    macros_for=matvec_macros(lambda p: p["npairs"]),
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
    macros_for=matvec_macros(lambda p: p["npairs"]),
    doc="qkv_rope_append over e4m3 rows of w_qkv with one f32 scale per row (`scale`, [rows]): each dot times "
        "its row's scale, then the head norm, RoPE and the stores as qkv_rope_append. d a multiple of 16."),
    builtin=True)
