"""megart.geometry.attention: RoPE tables, seeded inputs, and the whole-op fp32 references checked against
independent formulations (torch SDPA with expanded GQA heads, complex-number RoPE)."""
from __future__ import annotations

import math

import pytest
import torch

from megart.geometry.attention import (attention_m1, attention_scratch, qkv_m1, ref_attention_decode,
                                       ref_qkv_rope_append, ref_rmsnorm, rope_tables)


def test_rope_tables():
    cs, sn = rope_tables(4096, 128, 500000.0)
    assert cs.shape == sn.shape == (4096, 64) and cs.dtype == sn.dtype == torch.float32
    assert torch.all(cs[0] == 1) and torch.all(sn[0] == 0)
    torch.testing.assert_close(cs * cs + sn * sn, torch.ones_like(cs), rtol=0, atol=1e-6)
    # angle(p, i) = p * theta^(-2i/hd): column 0 turns by one radian per position
    torch.testing.assert_close(cs[:, 0].double(), torch.cos(torch.arange(4096.0, dtype=torch.float64)),
                               rtol=0, atol=1e-7)
    f = 500000.0 ** (-2 * 5 / 128)
    assert abs(sn[1000, 5].item() - math.sin(1000 * f)) < 1e-6
    with pytest.raises(ValueError):
        rope_tables(16, 63)


def test_attention_m1_seeded_never_zero():
    q, k, v = attention_m1(32, 8, 64, 100, 256, seed=3)
    q2, k2, v2 = attention_m1(32, 8, 64, 100, 256, seed=3)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert q.shape == (32 * 64,) and k.shape == v.shape == (8, 256, 64)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    assert not torch.equal(attention_m1(32, 8, 64, 100, 256, seed=4)[1], k)
    for t in (q, k, v):
        assert (t != 0).float().mean() > 0.99
    assert k[:, 200:].abs().sum() > 0     # beyond kv_len too: reading past kv_len is never silently zero
    with pytest.raises(ValueError):
        attention_m1(4, 1, 64, 300, 256)


def test_qkv_m1_scaled():
    w, x, nw = qkv_m1(32, 8, 64, 2048, seed=0)
    assert w.shape == (48 * 64, 2048) and x.shape == nw.shape == (2048,)
    assert abs(w.float().std().item() * math.sqrt(2048) - 1) < 0.02      # randn / sqrt(fan_in)
    assert abs(x.float().pow(2).mean().sqrt().item() - 2) < 0.1


def test_scratch_is_nan():
    po, pm = attention_scratch(32, 8, 64, 16)
    assert po.shape == (8, 16, 4, 64) and pm.shape == (8, 16, 4, 2)
    assert torch.isnan(po).all() and torch.isnan(pm).all()


def test_ref_attention_matches_sdpa():
    n_q, n_kv, hd = 32, 8, 64
    q, k, v = attention_m1(n_q, n_kv, hd, 0, 300, seed=1)
    for kv_len in (1, 7, 300):
        got = ref_attention_decode(q, k, v, kv_len)
        G = n_q // n_kv
        kk = k[:, :kv_len].float().repeat_interleave(G, 0)
        vv = v[:, :kv_len].float().repeat_interleave(G, 0)
        want = torch.nn.functional.scaled_dot_product_attention(q.float().view(n_q, 1, hd), kk, vv).reshape(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one position: the output is that position's v of each head's kv head
    one = ref_attention_decode(q, k, v, 1).view(n_kv, 4, hd)
    torch.testing.assert_close(one, v[:, 0].float()[:, None, :].expand(n_kv, 4, hd))
    assert not ref_attention_decode(q, k, v, 0).any()


def test_ref_qkv_matches_complex_rope():
    n_q, n_kv, hd, d = 4, 2, 64, 256
    w, x, nw = qkv_m1(n_q, n_kv, hd, d, seed=2)
    cs, sn = rope_tables(64, hd, 10000.0)
    pos = 13
    q, k, v = ref_qkv_rope_append(x, w, cs, sn, pos, n_q, n_kv, hd, nw, 1e-5)
    y = w.double() @ ref_rmsnorm(x, nw, 1e-5).double()
    half = hd // 2
    ang = pos * 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
    rot = torch.polar(torch.ones(half, dtype=torch.float64), ang)

    def rope(t):  # rotate-half == complex multiply of (t[:half] + i t[half:])
        z = torch.complex(t[..., :half], t[..., half:]) * rot
        return torch.cat([z.real, z.imag], -1)
    qr = rope(y[:n_q * hd].view(n_q, hd)).reshape(-1)
    kr = rope(y[n_q * hd:(n_q + n_kv) * hd].view(n_kv, hd))
    vr = y[(n_q + n_kv) * hd:].view(n_kv, hd)
    torch.testing.assert_close(q.double(), qr, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k.double(), kr, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v.double(), vr, rtol=1e-4, atol=1e-4)
    # RoPE keeps every pair's norm; at position 0 it is the identity
    q0 = ref_qkv_rope_append(x, w, cs, sn, 0, n_q, n_kv, hd, nw)[0]
    qn = ref_qkv_rope_append(x, w, cs, sn, 0, n_q, n_kv, hd, nw, rope=False)[0]
    torch.testing.assert_close(q0, qn)
    pairs = lambda t: t.view(-1, 2, half).pow(2).sum(1)
    torch.testing.assert_close(pairs(q), pairs(ref_qkv_rope_append(x, w, cs, sn, pos, n_q, n_kv, hd, nw,
                                                                   rope=False)[0]), rtol=1e-4, atol=1e-5)


def test_ref_rmsnorm():
    x = torch.randn(512).to(torch.bfloat16)
    wt = torch.ones(512, dtype=torch.bfloat16)
    y = ref_rmsnorm(x, wt, 1e-5)
    assert abs(y.pow(2).mean().item() - 1) < 1e-3
