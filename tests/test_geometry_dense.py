"""megart.geometry.dense: seeded, scaled decode-geometry inputs and the fp32 whole-op references."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megart.geometry import dense as geo


def test_dense_m1_is_seeded_scaled_and_nonzero():
    w, x = geo.dense_m1(512, 1024, seed=3)
    w2, x2 = geo.dense_m1(512, 1024, seed=3)
    w3, _ = geo.dense_m1(512, 1024, seed=4)
    assert w.shape == (512, 1024) and x.shape == (1024,) and w.dtype == x.dtype == torch.bfloat16
    assert torch.equal(w, w2) and torch.equal(x, x2) and not torch.equal(w, w3)
    assert abs(w.float().std().item() * math.sqrt(1024) - 1) < 0.02          # randn / sqrt(fan_in)
    assert abs(x.float().std().item() - 1) < 0.1
    assert (w.float().abs().sum(dim=1) > 0).all()
    y = w.float() @ x.float()                                                   # outputs stay O(1)
    assert 0.5 < y.std().item() < 2
    wf, _ = geo.dense_m1(8, 16, seed=0, dtype=torch.float32)
    assert wf.dtype == torch.float32


def test_norm_weight_spread():
    g = geo.norm_weight(4096, seed=1)
    assert g.dtype == torch.bfloat16 and abs(g.float().mean().item() - 1) < 0.02
    assert 0.2 < g.float().std().item() < 0.3


def test_quantize_fp8_per_channel():
    w, _ = geo.dense_m1(256, 512, seed=5)
    q, s = geo.quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (256,)
    assert torch.equal(s, s.to(torch.bfloat16).float()), "scales must sit on the bf16 grid"
    assert q.float().abs().max() <= geo.FP8_MAX
    assert torch.isfinite(q.float()).all()
    deq = q.float() * s[:, None]
    rel = (deq - w.float()).norm() / w.float().norm()
    assert rel < 0.05                                   # e4m3 keeps ~3 mantissa bits: a few percent
    # per channel: each row uses (nearly) the full e4m3 range
    assert (q.float().abs().amax(dim=1) > 300).all()


def test_moe_m1_live_rows_only():
    w, a, rows = geo.moe_m1(8, [1, 4, 6], n=64, k=32, seed=2)
    assert w.shape == (8, 64, 32) and a.shape == (8 * geo.EXPERT_ROWS, 32)
    assert rows.tolist() == [128, 512, 768]
    live = torch.zeros(a.shape[0], dtype=torch.bool)
    live[rows] = True
    assert (a[~live] == 0).all() and (a[live].float().abs().sum(dim=1) > 0).all()
    assert (w.float().abs().sum(dim=(1, 2)) > 0).all(), "every expert has weights, active or not"


def test_references_against_torch():
    torch.manual_seed(0)
    w, x = geo.dense_m1(48, 64, seed=1)
    g = geo.norm_weight(64, seed=2)
    r = torch.randn(48).to(torch.bfloat16)
    xf = x.float()
    xn = F.rms_norm(xf, (64,), weight=g.float(), eps=1e-5)
    torch.testing.assert_close(geo.ref_rmsnorm(x, g, 1e-5), xn)
    torch.testing.assert_close(geo.ref_gemv(w, x), w.float() @ xf)
    torch.testing.assert_close(geo.ref_gemv(w, x, residual=r, norm_weight=g), w.float() @ xn + r.float())
    q, s = geo.quantize_fp8_per_channel(w)
    torch.testing.assert_close(geo.ref_gemv_fp8(q, s, x), (q.float() * s[:, None]) @ xf)
    wu, _ = geo.dense_m1(48, 64, seed=3)
    torch.testing.assert_close(geo.ref_gate_up_silu(w, wu, x, norm_weight=g),
                               F.silu(w.float() @ xn) * (wu.float() @ xn))
    torch.testing.assert_close(geo.ref_silu_mul(r, r), F.silu(r.float()) * r.float())
    torch.testing.assert_close(geo.ref_lm_head(w, x, norm_weight=g), w.float() @ xn)
    assert torch.equal(geo.ref_embedding(w, 7), w[7].float())
    we, a, rows = geo.moe_m1(4, [3, 0], n=16, k=64, seed=4)
    out = geo.ref_group_gemm_m1(we, a, [3, 0])
    assert out.shape == (2, 16)
    torch.testing.assert_close(out[0], we[3].float() @ a[3 * 128].float())


def test_gates():
    ref = torch.tensor([3.0, 4.0])
    assert geo.relerr(ref, ref) == 0 and geo.cosine(ref, ref) == pytest.approx(1.0)
    assert geo.relerr(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert geo.cosine(torch.tensor([-3.0, -4.0]), ref) == pytest.approx(-1.0)
    assert geo.relerr(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), ref) == 0
