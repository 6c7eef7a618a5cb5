"""Attention decode geometry: RoPE tables, seeded QKV weights and prefilled KV caches (randn, never zeros),
whole-op fp32 PyTorch references for qkv_rope_append and attention_decode (+ attention_merge), and the
KV chunking (how many chunks per kv head, which positions a chunk covers) the task, models and benches share.

Conventions: w_qkv rows are q heads, then k heads, then v heads ([(n_q + 2 n_kv) * hd, d]); caches are
[n_kv, max_seq, hd]; q head i attends with kv head i // (n_q // n_kv); RoPE is rotate-half (pairs (i, i + hd/2)).
"""
from __future__ import annotations

import math

import torch

__all__ = ["rope_tables", "attention_m1", "qkv_m1", "attention_scratch", "ref_rmsnorm", "ref_qkv_rope_append",
           "ref_attention_decode"]


def rope_tables(max_seq: int, hd: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin f32 [max_seq, hd/2]: angle(p, i) = p * theta^(-2i/hd), computed in fp64 then rounded."""
    if hd % 2 or hd < 2 or max_seq < 1:
        raise ValueError(f"rope_tables: need even hd >= 2 and max_seq >= 1, got hd={hd}, max_seq={max_seq}")
    inv = theta ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2.0 / hd)
    ang = torch.arange(max_seq, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float().contiguous(), torch.sin(ang).float().contiguous()


def attention_m1(n_q: int, n_kv: int, hd: int, kv_len: int, max_seq: int, seed: int = 0):
    """q [n_q * hd] and k_cache, v_cache [n_kv, max_seq, hd], bf16, seeded randn everywhere (positions at and
    beyond kv_len hold randn too, so a kernel that reads past kv_len is caught, never silently zero)."""
    if not 0 <= kv_len <= max_seq:
        raise ValueError(f"attention_m1: kv_len {kv_len} must be in [0, max_seq={max_seq}]")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q * hd, generator=g).to(torch.bfloat16)
    k = torch.randn(n_kv, max_seq, hd, generator=g).to(torch.bfloat16)
    v = torch.randn(n_kv, max_seq, hd, generator=g).to(torch.bfloat16)
    return q, k, v


def qkv_m1(n_q: int, n_kv: int, hd: int, d: int, seed: int = 0):
    """w_qkv [(n_q + 2 n_kv) * hd, d] = randn / sqrt(d), x [d] = 2 randn (rms 2, so a dropped RMSNorm shows),
    norm_weight [d] = 1 + 0.1 randn; bf16."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn((n_q + 2 * n_kv) * hd, d, generator=g) / math.sqrt(d)).to(torch.bfloat16)
    x = (2.0 * torch.randn(d, generator=g)).to(torch.bfloat16)
    nw = (1.0 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
    return w, x, nw


def attention_scratch(n_q: int, n_kv: int, hd: int, chunks: int, device="cpu"):
    """Partial buffers for attention_decode / attention_merge: part_o [n_kv, chunks, group, hd] and
    part_ml [n_kv, chunks, group, 2], f32, filled with NaN so an unwritten slot shows."""
    G = n_q // n_kv
    po = torch.full((n_kv, chunks, G, hd), float("nan"), dtype=torch.float32, device=device)
    pm = torch.full((n_kv, chunks, G, 2), float("nan"), dtype=torch.float32, device=device)
    return po, pm


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.double()
    return (xf * torch.rsqrt((xf * xf).mean() + eps) * weight.double()).float()


def ref_qkv_rope_append(x, w_qkv, cos, sin, pos: int, n_q: int, n_kv: int, hd: int, norm_weight=None,
                        eps: float = 1e-5, rope: bool = True, q_norm=None, k_norm=None):
    """Whole-op reference in fp32 (no intermediate bf16 rounding): returns q [n_q * hd], k [n_kv, hd],
    v [n_kv, hd] (fp32) for position pos: what qkv_rope_append writes to q and to the cache rows at pos.
    q_norm / k_norm: per-head RMSNorm gains [hd] applied before RoPE (Qwen3).
    rope=False gives the feature drop used to calibrate the tolerance."""
    xf = ref_rmsnorm(x, norm_weight, eps) if norm_weight is not None else x.float()
    y = w_qkv.float().cpu() @ xf.cpu()
    half = hd // 2
    q = y[:n_q * hd].view(n_q, hd)
    k = y[n_q * hd:(n_q + n_kv) * hd].view(n_kv, hd)
    v = y[(n_q + n_kv) * hd:].view(n_kv, hd)
    if q_norm is not None:
        q = torch.stack([ref_rmsnorm(h, q_norm.cpu(), eps) for h in q])
        k = torch.stack([ref_rmsnorm(h, k_norm.cpu(), eps) for h in k])
    if rope:
        c, s = cos[pos].float().cpu(), sin[pos].float().cpu()

        def rot(t):
            lo, hi = t[:, :half], t[:, half:]
            return torch.cat([lo * c - hi * s, hi * c + lo * s], dim=1)
        q, k = rot(q), rot(k)
    return q.reshape(-1).contiguous(), k.contiguous(), v.contiguous()


def ref_attention_decode(q, k_cache, v_cache, kv_len: int, scale: float | None = None) -> torch.Tensor:
    """Whole-op reference in fp32: out [n_q * hd] = softmax(q k^T * scale) v over positions [0, kv_len) of
    each q head's kv head (GQA). kv_len = 0 gives zeros."""
    n_kv, _, hd = k_cache.shape
    n_q = q.numel() // hd
    G = n_q // n_kv
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if kv_len <= 0:
        return torch.zeros(n_q * hd, dtype=torch.float32)
    qf = q.float().cpu().view(n_kv, G, hd)
    k = k_cache[:, :kv_len].float().cpu()
    v = v_cache[:, :kv_len].float().cpu()
    s = torch.einsum("hgd,htd->hgt", qf, k) * scale
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hgt,htd->hgd", p, v).reshape(-1).contiguous()


# ---- KV chunking (sizing helpers the task declaration, the models and the benches share) -------------------
def auto_tiles(tiles, nw):
    """tiles <= 1 (the default) means: spread over the grid (nw instances)."""
    return nw if tiles is None or tiles <= 1 else int(tiles)


def attention_chunks(n_kv: int, max_seq: int, nw: int, chunk: int = 0, chunks: int | None = None,
                     tiles: int = 1) -> int:
    """The number of KV chunks per kv head attention_decode uses for these arguments (size the partial
    buffers [n_kv, chunks, group, hd] and [n_kv, chunks, group, 2] with it)."""
    if chunk:
        return -(-max_seq // chunk)
    if chunks:
        return int(chunks)
    return max(1, auto_tiles(tiles, nw) // n_kv)


def chunk_length(nchunks: int, kv_len: int, min_chunk: int = 0) -> int:
    """Positions per dynamic chunk at this kv_len: ceil(kv_len / nchunks), but at least min_chunk, so a short
    context keeps fewer chunks busy (the rest are empty) and the merge reads fewer partials."""
    return max(-(-kv_len // nchunks), int(min_chunk))


def active_chunks(nchunks: int, kv_len: int, min_chunk: int = 0) -> int:
    """Dynamic chunks that hold a position at this kv_len (at least 1: the merge's count): the rest are empty."""
    cl = chunk_length(nchunks, kv_len, min_chunk)
    return max(1, min(nchunks, -(-kv_len // cl) if cl else 1))


def chunk_range(chunk: int, cidx: int, nchunks: int, kv_len: int, min_chunk: int = 0) -> tuple[int, int]:
    """Positions [lo, hi) chunk `cidx` covers at this kv_len (static when chunk > 0, else dynamic, of
    chunk_length positions)."""
    if chunk > 0:
        lo, hi = cidx * chunk, cidx * chunk + chunk
    else:
        cl = chunk_length(nchunks, kv_len, min_chunk)
        lo, hi = cidx * cl, cidx * cl + cl
    hi = min(hi, kv_len)
    return lo, max(lo, hi)
