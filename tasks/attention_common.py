"""What the attention task types share (tasks/qkv.py: qkv_rope_append and its fp8 form; tasks/attention.py:
attention_decode, attention_merge, kv_commit): the head sizes and group widths the device code instantiates,
qkv's mode bits, the constants emitted into tasks/attention_common.cuh, and the checks of q, the caches and
the tagged new rows."""
from __future__ import annotations

from ..registry import header_constants
from ..tensors import as_ref
from .attention_ring import LOW_REG_THREADS
from .shapes import check_shape
from .tiling import require

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
ATTENTION_HEADERS = ("tasks/attention_common.cuh",)
# declared here, emitted into the kernel as megart_attn::k* before tasks/attention_common.cuh
header_constants(ATTENTION_HEADERS[0], "megart_attn", {
    "kModeRope": MODE_ROPE, "kModeNorm": MODE_NORM, "kModeCache": MODE_CACHE, "kModeHeadNorm": MODE_HEAD_NORM,
    "kModeTaggedX": MODE_TAGGED_X, "kModeTaggedOut": MODE_TAGGED_OUT, "kModeParts": MODE_PARTS,
    "kQkvMaxD": QKV_MAX_D, "kQkvMaxRows": QKV_MAX_ROWS, "kAttnStageWarps": ATTN_STAGE_WARPS,
    "kLowRegThreads": LOW_REG_THREADS})


def aligned16(ref, name, task):
    require(ref.byte_range[0] % 16 == 0, task, f"{name} must start on a 16-byte boundary (16-byte vector loads)")


def check_q_and_caches(T, qr, kr, vr, n_q, n_kv, hd, max_seq) -> int:
    """q holds n_q heads, the caches n_kv heads of max_seq positions each (as declared, if declared): the
    cache length."""
    require(qr.count == n_q * hd, T, f"q has {qr.count} elements, expected n_q * hd = {n_q * hd}")
    return cache_len(T, kr, vr, n_kv, hd, max_seq)


def cache_len(T, kr, vr, n_kv, hd, max_seq) -> int:
    """The caches hold n_kv heads of max_seq positions each (as declared, if declared): the cache length."""
    require(kr.count == vr.count and kr.count % (n_kv * hd) == 0, T,
            f"k_cache/v_cache must both hold n_kv * max_seq * hd elements (got {kr.count}, {vr.count})")
    ms = kr.count // (n_kv * hd)
    check_caches(T, kr, vr, n_kv, ms, hd)
    require(max_seq is None or max_seq == ms, T, f"max_seq={max_seq} but the caches hold {ms} positions")
    return ms


def check_caches(task, kr, vr, n_kv, ms, hd):
    for r, name in ((kr, "k_cache"), (vr, "v_cache")):
        check_shape(task, r, name, (n_kv, ms, hd), "[n_kv, max_seq, hd]")


def tagged_rows(T, k_new, v_new, n_kv, hd) -> dict:
    """k_new and v_new as refs ({"k_new": ref, "v_new": ref}): tagged tensors of n_kv * hd elements each."""
    out = {}
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        r = as_ref(t, name)
        require(r.tensor.tagged, T, f"{name} must be a tagged tensor (pk.tensor(..., tagged=True))")
        require(r.count == n_kv * hd, T, f"{name} has {r.count} elements, expected n_kv * hd = {n_kv * hd}")
        out[name] = r
    return out


def new_rows(T, qr, k_new, v_new, n_kv, hd):
    """The tagged form's [n_kv, hd] buffers of this step's new k and v rows ({"k": ref, "v": ref}), or None.
    q, k_new and v_new are tagged tensors together or not at all: qkv writes them as tagged words instead of
    appending to the caches, and attention_decode polls them (kv_commit appends the rows later in the step)."""
    if k_new is None and v_new is None and not qr.tensor.tagged:
        return None
    require(k_new is not None and v_new is not None and qr.tensor.tagged, T,
            "the tagged form takes q, k_new and v_new as tagged tensors, all three (pk.tensor(..., tagged=True))")
    rows = tagged_rows(T, k_new, v_new, n_kv, hd)
    for name, r in rows.items():
        aligned16(r, name, T)
    return {"k": rows["k_new"], "v": rows["v_new"]}
