"""The Llama decode model's build defaults, each with the measurement that chose it: compute threads per
worker, instances per call (tiles), the weight stream, attention's K/V ring, the fused merge's compiled shape and
which attention bodies are compiled. megart/models/llama.py applies them; a caller's tiles, defines or
MEGART_DEFINES win."""
from __future__ import annotations

from ..config import kv_streamed
from .llama_config import LlamaConfig


def default_threads(cfg: LlamaConfig) -> int:
    """Compute threads per worker. Every streamed matrix in e4m3: 384 (12 compute warps, 3 weight-stream slots
    each): the fp8 dot loops bound that step and more warps hide their latency (1b_fp8_all 741-745 -> 735-737
    us/step). Any bf16 matrix streamed: 256 (8 warps, 5 slots), whose deeper ring the bf16 calls need (1b 869 ->
    916 us/step at 384, 1b_fp8 with bf16 QKV and LM head 780-784 -> 791-793). bench/RESULTS.md, fifteenth session."""
    all_fp8 = cfg.wdtype == "fp8" and cfg.fp8_qkv and (cfg.fp8_head or cfg.block)
    return 384 if all_fp8 else 256


# Positions a dynamic attention chunk holds at least. At a 128-token context the 1B step's 16 chunks per kv
# head hold 8-9 positions each and the merging instance reads 16 partials; with 64 three chunks hold them all
# and the merge reads three (1b_128 797 -> ~789 us/step; at 2k every chunk is longer than 64 anyway).
# bench/RESULTS.md, twenty-sixth session.
ATTN_MIN_CHUNK = 64
# attention's switch to the direct form (tiles["attn_direct_upto"]): while the context holds at most this many
# positions, chunk c < group of each kv head attends q head c over the whole context and writes its output, with
# no partials and no merge; past it the chunks and their fused merge run. The 1B step on the H200, the direct form
# against the chunks: -29 us at 128 positions, -25 at 256, -16 at 384, -6 to -9 at 512, +2 at 640, +13 at 768; with
# the switch at 128 positions 720.8 against 748.8 us, at 2k level (bench/RESULTS.md, thirty-second session).
ATTN_DIRECT_UPTO = 576


def default_tiles(cfg: LlamaConfig, nw: int) -> dict:
    """Instances per call. Weight-streaming calls get ~nw instances (one slice per worker); attention
    gets nw // n_kv chunks per kv head, each of at least attn_min_chunk positions (so below 16 x 64 positions
    fewer chunks hold any); the LM head nw instances (~V/nw rows each)."""
    return dict(
        embedding=max(1, min(8, cfg.d // 256)),
        qkv=nw,
        attn_chunks=max(1, nw // cfg.n_kv),
        attn_min_chunk=min(ATTN_MIN_CHUNK, cfg.max_seq),
        attn_width=min(DIRECT_WIDTH, cfg.group),   # q heads per attention instance of the direct form
        attn_direct_upto=None,   # None: ATTN_DIRECT_UPTO where the fused call can switch (LlamaModel._direct_upto)
        merge=min(cfg.n_q, nw),
        o=nw,
        gate_up=nw,
        gate_up_parts=1,   # gate_up_silu as this many calls over h's consecutive parts (bf16; an experiment)
        # gate_up_rounds: LlamaModel sets it from the CTA's warps (gate_up_rounds_default) unless tiles name it
        down=nw,
        lm=nw if cfg.vocab >= nw else cfg.vocab,
        silu_mul=max(1, min(nw, cfg.ffn // 256)),
    )


def gate_up_rounds_default(cfg: LlamaConfig, threads: int) -> int:
    """tiles["gate_up_rounds"] unless the caller names it: gate_up deals h's rows in rounds of one row per compute
    warp (gate_up_silu's rounds), so the call completes h front to back and down begins on its first pieces early
    (H100, one process: 1b -8.5 us/step at 2k, -10.5 at 128 tokens, -8.3 at 32k, block8b -3.8, small level;
    bench/RESULTS.md, thirty-eighth session). 0 (contiguous tiles) for fp8 weights (1b_fp8_all, 12 warps in rounds
    of 8: +2 to +3 us; rounds of 12 not measured) or past the row map's 65,535 rows."""
    if cfg.wdtype == "fp8" or cfg.ffn >= 1 << 16:
        return 0
    return threads // 32


def gate_up_part_align(cfg: LlamaConfig) -> int:
    """Rows of h a part of gate_up (tiles["gate_up_parts"]) is a multiple of: 1,024 where the width allows (a
    piece of down's x at the default 4 KB weight stage, so a part completes whole pieces), else 8."""
    return 1024 if cfg.ffn % 1024 == 0 else 8


STREAM_DEFAULT = "auto"   # the decode step streams its weights (bench/RESULTS.md: 966.9 vs 1,010.0 us at 1B)


def stream_default(defines: dict | None, default=STREAM_DEFAULT) -> dict:
    """MEGART_STREAM_SLOTS=`default` for a model's kernel, unless the caller's defines or MEGART_DEFINES choose."""
    from ..config import env_defines
    chosen = "MEGART_STREAM_SLOTS" in (defines or {}) or "MEGART_STREAM_SLOTS" in env_defines()
    return {} if chosen else {"MEGART_STREAM_SLOTS": default}


SHORT_ATTN_RING = 32 * 1024   # attention's K/V ring where its chunks are short (attention_ring_default)


def attention_ring_default(cfg: LlamaConfig, chunks: int, kcfg, direct: bool = False) -> dict:
    """attention_decode's K/V ring when the caller leaves MEGART_ATTN_RING_BYTES unset: 32 KB instead of the
    default 64 KB where a chunk's K/V rows, at the cache's full length, fit the default ring anyway and the
    kernel streams its weights in 4 KB stages at 8 compute warps or fewer, so that the 32 KB given back is
    one more weight slot per warp (6 instead of 5 at 8 warps). On the H200 (bench/RESULTS.md, nineteenth
    session) 1b 864.5 -> 852.8 us, 1b_128 823.2 -> 812.9, 1b_fp8 level; where chunks are long it loses
    (1b_32k +17 us), and block8b (chunks of 135 KB) is level. The direct form (`direct`: one chunk per kv head,
    the whole context) was measured with the 32 KB ring from 128 to 768 positions, so it takes it at any
    length. `{}` means: leave the ring to tasks/attention.py."""
    from ..config import caller_macros, stream_requested
    from ..errors import GraphError
    from ..stream import slot_bytes, stage_chunks
    from ..tasks.attention_ring import ATTN_RING
    if "MEGART_ATTN_RING_BYTES" in caller_macros(kcfg) or not stream_requested(kcfg) or kv_streamed(kcfg):
        return {}
    if cfg.group < 4:   # (smaller GQA groups: their stream build spills, which "auto" declines; not measured here)
        return {}
    try:
        stage = stage_chunks(kcfg)
    except GraphError:   # (a value the stream does not take: its own GraphError names it at compile)
        return {}
    if (kcfg.threads // 32) * slot_bytes(stage) > ATTN_RING - SHORT_ATTN_RING:
        return {}
    chunk_rows = -(-cfg.max_seq // max(1, chunks))
    if not direct and chunk_rows * cfg.hd * 2 * 2 > ATTN_RING:   # (a kv head's K and V rows, bf16)
        return {}
    return {"MEGART_ATTN_RING_BYTES": SHORT_ATTN_RING}


ATTN_MERGE = ("auto", "fused", "call", "direct")


def merge_shape_defines(cfg: LlamaConfig, chunks: int) -> dict:
    """The fused merge's shape compiled in (group, head size, chunks per kv head: strides as immediates, no
    per-chunk guard); an instance of another shape takes the general merge."""
    return {"MEGART_MERGE_G": cfg.n_q // cfg.n_kv, "MEGART_MERGE_HD": cfg.hd, "MEGART_MERGE_C": chunks}


def merge_active_default(cfg: LlamaConfig, chunks: int, min_chunk: int) -> dict:
    """MEGART_MERGE_ACTIVE=1 where decoding starts at a context below min_chunk x chunks positions: there the
    fused merge reads only the partials of the chunks holding positions (1b_128: 798 -> 779 us/step), while
    at a 2k context, where it would change nothing, the 1B step measured ~6 us slower with it compiled in
    (bench/RESULTS.md, twenty-sixth session). Any pos runs correctly either way."""
    return {"MEGART_MERGE_ACTIVE": 1} if min_chunk and cfg.prefill + 1 <= min_chunk * chunks else {}


def merge_fused(how: str, cfg: LlamaConfig, chunks: int) -> bool:
    """Whether the attention call merges its own partials (the last chunk of a kv head to finish does):
    "fused", "call" (attention_merge, one call more per layer) or "auto" (fused where the attention
    splitter allows it: a whole GQA group per instance and no more chunks than a kv head has outputs).
    Fused measured faster on the H200 (bench/RESULTS.md)."""
    from ..tasks.attention import fused_merge_fits
    if how != "auto":
        return how == "fused"
    return fused_merge_fits(cfg.group, cfg.hd, chunks)


# The direct form's q heads per attention instance (attn_merge="direct"; tiles["attn_width"])
DIRECT_WIDTH = 1


def attention_defines(cfg: LlamaConfig, attn_merge: str = "auto", width: int = DIRECT_WIDTH) -> dict:
    """Compile only the attention_decode bodies this shape runs (its head size, its instance widths; the direct
    form's instances hold at most `width` q heads)."""
    from ..tasks.attention import body_defines
    return body_defines(cfg.hd, cfg.group, width) if attn_merge == "direct" else body_defines(cfg.hd, cfg.group)
