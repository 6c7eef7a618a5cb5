"""attention_decode's K/V ring: how many bytes a kernel gives it and its geometry (positions per stage, stages).
Computed here only; tasks/attention_decode.cuh takes them as macros, megart/stream.py and the models size
around them."""
from __future__ import annotations

LOW_REG_THREADS = 512     # threads x CTAs per SM from which the bodies budget <= 128 registers (kLowRegs)
ATTN_RING = 64 * 1024     # attention_decode's K/V ring (MEGART_ATTN_RING_BYTES), any thread count


def attn_ring_bytes(cfg) -> int:
    """attention_decode's K/V ring in a kernel built with `cfg` (codegen.KernelConfig): MEGART_ATTN_RING_BYTES
    when given (0 turns the ring off), else ATTN_RING with one CTA per SM and under LOW_REG_THREADS threads
    (the body's !kLowRegs case), 0 otherwise (the register path, as before the ring). The Llama model asks
    for 32 KB where its chunks are short, for a sixth weight slot per warp (megart/models/llama.py
    attention_ring_default). Where K/V come through the weight stream (config.kv_streamed) the ring is off:
    an instance the stream does not carry (no pos_stamp) reads its rows through registers."""
    from ..config import caller_macros, kv_streamed
    forced = caller_macros(cfg).get("MEGART_ATTN_RING_BYTES")
    if forced is not None:
        return int(forced)
    if kv_streamed(cfg):
        return 0
    return ATTN_RING if cfg.min_blocks == 1 and cfg.threads < LOW_REG_THREADS else 0


def ring_geometry(ring_bytes: int, threads: int) -> tuple[int, int]:
    """attention_decode's K/V ring of `ring_bytes` per CTA at `threads` threads: (positions per thread in one
    stage, which is one batch of the online softmax; stages). A position takes 32 bytes per thread (its K and
    V vectors); at most 4 stages. No room for two stages (the ring off included) means the register path."""
    def largest(positions):  # the most positions per stage that still leaves 4 stages (1 below 8)
        return 4 if positions >= 16 else 2 if positions >= 8 else 1

    positions = ring_bytes // (threads * 32)
    # A smaller ring keeps the default ring's batch where two stages of it fit: the body then needs no other
    # position order (at 32 KB and 256 threads, one position per stage spilled registers).
    default_u = largest(ATTN_RING // (threads * 32))
    per_stage = largest(positions)
    if per_stage < default_u and positions >= 2 * default_u:
        per_stage = default_u
    return per_stage, min(4, positions // per_stage)


def ring_defines(cfg) -> dict:
    """attention_decode's ring macros for a kernel built with `cfg` (its TaskType.defines_for)."""
    # ORDER_U: the batches of the ring at its default size, whose position order the streamed K/V path keeps,
    # bit for bit. The ring geometries are computed here only (tasks/attention_decode.cuh takes them as given).
    ring_u, ring_stages = ring_geometry(attn_ring_bytes(cfg), cfg.threads)
    return {"MEGART_ATTN_RING_BYTES": attn_ring_bytes(cfg), "MEGART_ATTN_RING_U": ring_u,
            "MEGART_ATTN_RING_STAGES": ring_stages, "MEGART_ATTN_ORDER_U": ring_geometry(ATTN_RING, cfg.threads)[0]}
