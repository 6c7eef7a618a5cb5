"""Attention decode task types (ids 64-95; the fused QKV projection + RoPE + KV-cache append that feeds them is
tasks/qkv.py): flash-decoding attention over KV chunks, the log-sum-exp merge of the chunks, and the tagged
form's cache append. bf16 storage, fp32 math.

The decode position is device data (`pos`, an i32 tensor of one element), so one compiled kernel serves
every step: kv_len = pos + 1 is read on the device, never baked into the descriptors.

Dependency refs (the byte ranges that order instances):
* attention_decode reads q (its group's heads), the whole k/v head (pos is dynamic) and writes its own
  partial slots exactly; attention_merge reads the partials of its q heads and writes out exactly.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from ..geometry.attention import active_chunks, attention_chunks, chunk_range
from ..registry import Cost, TaskType, ptr, register, scalar
from ..tensors import as_ref
from .attention_common import (ATTENTION_HEADERS, ATTN_HD, ATTN_MAX_GROUP, ATTN_STAGE_WARPS, ATTN_SUBGROUP,
                               aligned16, cache_len, check_q_and_caches, new_rows, tagged_rows)
from .attention_ring import ATTN_RING, attn_ring_bytes, ring_defines
from .tiling import even_tiles, pos_stamp_ref, require


def merge_bytes(hd: int, width: int) -> int:
    """attention_decode's merge scratch across warps for instances of `width` q heads of size hd:
    [warp][group][hd + m, l] fp32."""
    return 4 * ATTN_STAGE_WARPS * width * (hd + 2)


SMEM_ATTN_MERGE = merge_bytes(max(ATTN_HD), ATTN_SUBGROUP)   # any shape
NEW_ROW_BYTES = 2 * 16 * 16   # the staged new K and V row (hd <= 128: 16 vectors of 8 bf16 each)
SMEM_ATTN = max(SMEM_ATTN_MERGE, ATTN_RING)  # the merge reuses the ring's bytes once it is drained


# --- attention_decode ------------------------------------------------------------------------------------

def _attn_shapes(T, q, k_cache, v_cache, n_q, n_kv, hd, max_seq):
    qr, kr, vr = as_ref(q, "q"), as_ref(k_cache, "k_cache"), as_ref(v_cache, "v_cache")
    require(hd in ATTN_HD, T, f"hd must be one of {ATTN_HD}, got {hd}")
    require(n_q >= 1 and n_kv >= 1 and n_q % n_kv == 0, T, f"n_q ({n_q}) must be a positive multiple of n_kv ({n_kv})")
    group = n_q // n_kv
    require(1 <= group <= ATTN_MAX_GROUP, T, f"group n_q / n_kv must be in [1, {ATTN_MAX_GROUP}], got {group}")
    ms = check_q_and_caches(T, qr, kr, vr, n_q, n_kv, hd, max_seq)
    for ref, name in ((qr, "q"), (kr, "k_cache"), (vr, "v_cache")):
        aligned16(ref, name, T)
    return qr, kr, vr, group, ms


def _kv_head(kr, vr, new, h: int, ms: int, hd: int):
    """kv head h's cache refs (the whole head: pos is dynamic) and, in the tagged form (`new`), its new rows."""
    rows = dict(k_new=None, v_new=None) if new is None else {
        f"{k}_new": r.tensor.ref(r.offset + h * hd, hd) for k, r in new.items()}
    return kr.tensor.ref(kr.offset + h * ms * hd, ms * hd), vr.tensor.ref(vr.offset + h * ms * hd, ms * hd), rows


def _attn_split(nw, tiles=1, *, q, k_cache, v_cache, pos, part_o=None, part_ml=None, n_q, n_kv, hd, max_seq=None,
                chunk=0, chunks=None, min_chunk=0, scale=None, out=None, arrivals=None, k_new=None, v_new=None,
                pos_stamp=None, width=None, direct_upto=0):
    T = "attention_decode"
    qr, kr, vr, group, ms = _attn_shapes(T, q, k_cache, v_cache, n_q, n_kv, hd, max_seq)
    pr = as_ref(pos, "pos")
    require(pr.count == 1, T, f"pos must be a single i32 element, has {pr.count}")
    if out is not None and arrivals is None:   # the direct form: one chunk, the output itself, no partials
        require(not direct_upto, T, f"direct_upto={direct_upto!r} applies to the fused form (out and arrivals); "
                                    "the direct form attends every length directly")
        return _direct_split(T, qr, kr, vr, pr, as_ref(out, "out"), group, ms, n_q=n_q, n_kv=n_kv, hd=hd,
                             chunk=chunk, chunks=chunks, min_chunk=min_chunk, scale=scale, width=width,
                             part_o=part_o, part_ml=part_ml, k_new=k_new, v_new=v_new, pos_stamp=pos_stamp)
    require(part_o is not None and part_ml is not None, T,
            "part_o and part_ml are required (the chunks' partials), unless out is given without arrivals "
            "(the direct form: one chunk per instance writes its heads' output)")
    require(width is None, T, "width (q heads per instance) applies to the direct form only (out without arrivals)")
    por, pmr = as_ref(part_o, "part_o"), as_ref(part_ml, "part_ml")
    chunk = int(chunk or 0)
    require(chunk >= 0, T, f"chunk must be >= 0 (0: dynamic chunks), got {chunk}")
    require(isinstance(min_chunk, int) and not isinstance(min_chunk, bool) and 0 <= min_chunk <= ms, T,
            f"min_chunk must be an integer in [0, max_seq={ms}] (positions per dynamic chunk, at least), "
            f"got {min_chunk!r}")
    require(not (chunk and min_chunk), T, f"min_chunk={min_chunk} applies to dynamic chunks; chunk={chunk} "
                                          "fixes their length already")
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
    new = new_rows(T, qr, k_new, v_new, n_kv, hd)   # the tagged form: q and the new rows polled
    stamp = pos_stamp_ref(T, pos_stamp)   # (the weight stream's producer reads pos once it is stamped)
    _check_direct_upto(T, direct_upto, arrivals, group, nch, ms, new, stamp)
    res = []
    for h in range(n_kv):
        k_ref, v_ref, rows = _kv_head(kr, vr, new, h, ms, hd)
        for g0, ng in head_subgroups(group):
            q_ref = qr.tensor.ref(qr.offset + (h * group + g0) * hd, ng * hd)
            for c in range(nch):
                slot = (h * nch + c) * group + g0        # [n_kv, chunks, group] index of the first q head
                res.append(dict(q=q_ref, k_cache=k_ref, v_cache=v_ref, pos=pr,
                                part_o=por.tensor.ref(por.offset + slot * hd, ng * hd),
                                part_ml=pmr.tensor.ref(pmr.offset + slot * 2, ng * 2),
                                group=ng, hd=hd, chunk=chunk, cidx=c, nchunks=nch, min_chunk=min_chunk,
                                max_seq=ms, scale=scale,
                                tagged_out=tagged_out, direct_upto=direct_upto, pos_stamp=stamp, **rows,
                                **fused(h, c)))
    return res


def _check_direct_upto(T, direct_upto, arrivals, group, nch, ms, new, stamp) -> None:
    """The switch (direct_upto > 0): while kv_len <= direct_upto, chunk c < group of each kv head attends q head c
    over every position and writes its output itself (the direct form's one hop), and the other chunks idle; past
    it the chunks and their fused merge run. It needs the fused form (the output is the merge's), a chunk per q head,
    the caches themselves (not the tagged form's new rows) and K/V read by the body (no pos_stamp)."""
    require(isinstance(direct_upto, int) and not isinstance(direct_upto, bool) and 0 <= direct_upto, T,
            f"direct_upto must be an integer >= 0 (positions up to which the direct form runs; 0: never), "
            f"got {direct_upto!r}")
    if not direct_upto:
        return
    require(arrivals is not None, T, f"direct_upto={direct_upto} needs the fused form (out and arrivals): "
                                     "past it the chunks' merge writes out")
    require(nch >= group, T, f"direct_upto={direct_upto} gives each of a kv head's {group} q heads a chunk's "
                             f"instance; there are {nch} chunks")
    require(new is None, T, f"direct_upto={direct_upto} reads the caches; the tagged form (k_new, v_new) is not "
                            "supported with it")
    require(stamp is None, T, f"direct_upto={direct_upto} reads K/V in the body; leave pos_stamp out (K/V through "
                              "the weight stream)")


def _direct_split(T, qr, kr, vr, pr, orf, group, ms, *, n_q, n_kv, hd, chunk, chunks, min_chunk, scale, width,
                  part_o, part_ml, k_new, v_new, pos_stamp):
    """The direct form (out without arrivals): each instance attends every position of its kv head for `width` of
    the head's q heads (default: the whole group, up to ATTN_SUBGROUP) and writes their output itself, o / l, with
    no partials and no merge. One chunk per kv head, so its time grows with the context: a short context's form."""
    require(part_o is None and part_ml is None, T, "the direct form (out without arrivals) writes no partials: "
                                                   "leave part_o and part_ml out")
    require(not chunk and chunks in (None, 1), T, f"the direct form attends one chunk per kv head (chunks=1, "
                                                 f"chunk=0), got chunks={chunks!r}, chunk={chunk!r}")
    require(orf.count == n_q * hd, T, f"out has {orf.count} elements, expected n_q * hd = {n_q * hd}")
    width = ATTN_SUBGROUP if width is None else width
    require(isinstance(width, int) and not isinstance(width, bool) and 1 <= width <= ATTN_SUBGROUP, T,
            f"width (q heads per instance) must be an integer in [1, {ATTN_SUBGROUP}], got {width!r}")
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    new = new_rows(T, qr, k_new, v_new, n_kv, hd)
    stamp = pos_stamp_ref(T, pos_stamp)
    res = []
    for h in range(n_kv):
        k_ref, v_ref, rows = _kv_head(kr, vr, new, h, ms, hd)
        for g0, ng in head_subgroups(group, width):
            first = (h * group + g0) * hd
            res.append(dict(q=qr.tensor.ref(qr.offset + first, ng * hd), k_cache=k_ref, v_cache=v_ref, pos=pr,
                            part_o=None, part_ml=None, group=ng, hd=hd, chunk=0, cidx=0, nchunks=1,
                            min_chunk=min_chunk, max_seq=ms, scale=scale, out=orf.tensor.ref(orf.offset + first, ng * hd),
                            arrivals=None, tagged_out=int(orf.tensor.tagged), direct_upto=0, pos_stamp=stamp,
                            **rows))
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
    require(out is not None, T, "arrivals needs out (the fused merge: the last chunk of a kv head merges into out)")
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


def head_subgroups(group: int, width: int = ATTN_SUBGROUP) -> list[tuple[int, int]]:
    """(first q head, count) of the instances sharing one kv head: the whole group up to `width` q heads
    (ATTN_SUBGROUP, the widest the device code instantiates; the direct form may ask for fewer), else the fewest
    near-equal pieces (9 -> 5 + 4, 16 -> 8 + 8). Each piece reads the kv head's K/V itself, so groups over 8
    stream it twice."""
    n = -(-group // width)
    return [(a, b - a) for a, b in even_tiles(group, n)]


def _kv_len(pos: int, max_seq: int) -> int:
    return 0 if pos < 0 else min(pos + 1, max_seq)


def _attn_ref(p) -> None:
    import torch
    G, hd = p.group, p.hd
    kv_len = _kv_len(int(p.pos[0]), p.max_seq)
    lo, hi = chunk_range(p.chunk, p.cidx, p.nchunks, kv_len, p.min_chunk)
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


def _direct_ref(p, out) -> None:
    """The direct form's output into out: the instance's q heads over every position, o / l, as the merge of that
    one chunk alone."""
    import torch
    G, hd = p.group, p.hd
    part = SimpleNamespace(**{**vars(p), "part_o": torch.empty(G * hd, dtype=torch.float32),
                              "part_ml": torch.empty(G * 2, dtype=torch.float32), "chunk": 0, "cidx": 0,
                              "nchunks": 1, "min_chunk": 0})
    _attn_ref(part)
    _merge_ref(SimpleNamespace(out=out, part_o=part.part_o, part_ml=part.part_ml, nheads=G, group=G, hd=hd,
                               chunks=1, g0=0))


def _back(view, n: int, total: int):
    """`total` elements of view's storage starting n elements before view (a tagged out's values are every other
    half: its stride)."""
    return view.as_strided((total,), (view.stride(0),), view.storage_offset() - n * view.stride(0))


def _attn_fused_ref(p) -> None:
    """The partials, then (the fused form) the arrival: the last chunk of the kv head merges them all. The direct
    form (no partials): its one chunk's o / l. The switch (direct_upto, kv_len within it): chunk c < group writes q
    head c's output as the direct form; no partials, no arrival."""
    if p.part_o is None:
        _direct_ref(p, p.out)
        return
    if getattr(p, "direct_upto", 0) and _kv_len(int(p.pos[0]), p.max_seq) <= p.direct_upto:
        if p.cidx < p.group:
            G, hd, c = p.group, p.hd, p.cidx
            head = _back(p.out, out_claim(G * hd, p.nchunks, c)[0], G * hd)[c * hd:(c + 1) * hd]
            _direct_ref(SimpleNamespace(**{**vars(p), "group": 1, "q": p.q.reshape(-1)[c * hd:(c + 1) * hd]}), head)
        return
    _attn_ref(p)
    if p.arrivals is None:
        return
    p.arrivals[0] += 1
    if int(p.arrivals[0]) != p.nchunks:
        return
    p.arrivals[0] = 0
    G, hd, C = p.group, p.hd, p.nchunks
    # (only the chunks holding positions, as the device with MEGART_MERGE_ACTIVE: the empty ones' partials add
    # exactly nothing, so merging all of them, as the device without it, gives the same values)
    kv_len = _kv_len(int(p.pos[0]), p.max_seq)
    active = C if p.chunk else active_chunks(C, kv_len, p.min_chunk)
    _merge_ref(SimpleNamespace(out=_back(p.out, out_claim(G * hd, C, p.cidx)[0], G * hd),
                               part_o=_back(p.part_o, p.cidx * G * hd, active * G * hd),
                               part_ml=_back(p.part_ml, p.cidx * G * 2, active * G * 2),
                               nheads=G, group=G, hd=hd, chunks=active, g0=0))


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


def body_defines(hd: int, group: int, width: int = ATTN_SUBGROUP) -> dict:
    """Macros that compile only the attention_decode bodies one shape runs: its head size and the instance
    widths its GQA group splits into at `width` q heads per instance at most (head_subgroups; the models'
    kernels and the benches that stand in for them)."""
    mask = sum(1 << n for n in {n for _, n in head_subgroups(group, width)})
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


def _attn_macros(params, threads) -> dict:
    """The forms the graph's instances use: tagged (k_new given), unstamped (no pos_stamp: K/V read by the body
    even where the stream carries the others') and direct (no partials: the output written by the instance); the
    fused merge only where an instance merges (arrivals given)."""
    out = {}
    if any(p.get("k_new") is not None for p in params):
        out["MEGART_ATTN_TAGGED"] = 1
    if any(p.get("pos_stamp") is None for p in params):
        out["MEGART_ATTN_UNSTAMPED"] = 1
    if any(p.get("part_o") is None for p in params):
        out["MEGART_ATTN_DIRECT"] = 1
    if any(p.get("direct_upto") for p in params):
        out["MEGART_ATTN_SWITCH"] = 1
    out["MEGART_ATTN_FUSED_MERGE"] = int(any(p.get("arrivals") is not None for p in params))
    return out


register(TaskType(
    name="attention_decode", id=65, hostsim=True, tol=1e-2, gate="megart.faithful.decode_gates:attention_decode",
    params=(ptr("q", "bf16", "in", tagged=True), ptr("k_cache", "bf16", "in"), ptr("v_cache", "bf16", "in"),
            ptr("pos", "i32", "in"), ptr("part_o", "f32", "out", optional=True),
            ptr("part_ml", "f32", "out", optional=True),
            scalar("group"), scalar("hd"), scalar("chunk"), scalar("cidx"), scalar("nchunks"), scalar("min_chunk"),
            scalar("max_seq"),
            scalar("scale", "f32"), ptr("out", "bf16", "out", optional=True, tagged=True),
            ptr("arrivals", "i32", "sync", optional=True), scalar("tagged_out"), scalar("direct_upto"),
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
    ms = cache_len(T, kr, vr, n_kv, hd, max_seq)
    require(pr.count == 1, T, f"pos must be a single i32 element, has {pr.count}")
    return [dict(**tagged_rows(T, k_new, v_new, n_kv, hd), k_cache=kr, v_cache=vr, pos=pr, n=n_kv * hd, hd=hd,
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
