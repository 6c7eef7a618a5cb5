"""Dense and MoE decode geometry (M = 1): seeded, scaled random weights (randn(out, in) / sqrt(in),
never zeros), fp8 pre-quantisation, and whole-op PyTorch references in fp32 on upcast inputs (the
independent implementation each dense task is measured against; see docs/TASKS.md)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["dense_m1", "norm_weight", "quantize_fp8_per_channel", "moe_m1", "ref_rmsnorm", "ref_gemv",
           "ref_gemv_fp8", "ref_gate_up_silu", "ref_silu_mul", "ref_group_gemm_m1", "ref_lm_head",
           "ref_embedding", "relerr", "cosine", "EXPERT_ROWS", "FP8_MAX"]

EXPERT_ROWS = 128      # rows per expert tile in the group GEMM; row 0 of each active expert is live
FP8_MAX = 448.0        # largest finite e4m3 (fn) magnitude


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def dense_m1(n: int, k: int, seed: int, dtype=torch.bfloat16, device="cpu"):
    """w[n, k] = randn / sqrt(k) and x[k] = randn (one decode token), seeded; returns (w, x)."""
    g = _gen(seed)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    x = torch.randn(k, generator=g).to(dtype)
    return w.to(device), x.to(device)


def norm_weight(k: int, seed: int, spread: float = 0.25, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """An RMSNorm gain 1 + spread * randn: far enough from 1 that forgetting it is a visible error."""
    g = _gen(seed)
    return (1.0 + spread * torch.randn(k, generator=g)).to(dtype).to(device)


def quantize_fp8_per_channel(w: torch.Tensor):
    """Per-output-channel e4m3 quantisation: scale[n] = amax(|w[n]|) / 448 rounded onto the bf16 grid
    (f32 storage), w8 = clamp(w / scale) in e4m3. Returns (w8, scale). The reference dequantises w8."""
    wf = w.float()
    amax = wf.abs().amax(dim=1).clamp(min=1e-12)
    scale = (amax / FP8_MAX).to(torch.bfloat16).float()
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def moe_m1(num_experts: int, active, n: int, k: int, seed: int, dtype=torch.bfloat16, device="cpu"):
    """Routed-expert decode geometry: w[E, n, k] (randn / sqrt(k), every expert, active or not),
    a[E*128, k] zero except the live row expert*128 of each active expert (randn), and the live row
    indices. Returns (w, a, rows)."""
    g = _gen(seed)
    w = (torch.randn(num_experts, n, k, generator=g) / math.sqrt(k)).to(dtype)
    a = torch.zeros(num_experts * EXPERT_ROWS, k, dtype=dtype)
    rows = torch.tensor([int(e) * EXPERT_ROWS for e in active], dtype=torch.long)
    a[rows] = torch.randn(len(rows), k, generator=g).to(dtype)
    return w.to(device), a.to(device), rows.to(device)


# ---- whole-op references: fp32 math on upcast inputs, no intermediate rounding -----------------------
def ref_rmsnorm(x, w, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean() + eps) * w.float()


def _xin(x, norm_weight, eps):
    return x.float() if norm_weight is None else ref_rmsnorm(x, norm_weight, eps)


def ref_gemv(w, x, residual=None, norm_weight=None, eps: float = 1e-5) -> torch.Tensor:
    """y = W @ rmsnorm?(x) (+ residual), fp32."""
    y = w.float() @ _xin(x, norm_weight, eps)
    return y if residual is None else y + residual.float()


def ref_gemv_fp8(w8, scale, x, residual=None, norm_weight=None, eps: float = 1e-5) -> torch.Tensor:
    """y = (W8.float() * scale[:, None]) @ rmsnorm?(x) (+ residual): dequantises the same bytes."""
    y = (w8.float() * scale.float()[:, None]) @ _xin(x, norm_weight, eps)
    return y if residual is None else y + residual.float()


def ref_gate_up_silu(w_gate, w_up, x, norm_weight=None, eps: float = 1e-5) -> torch.Tensor:
    xin = _xin(x, norm_weight, eps)
    return F.silu(w_gate.float() @ xin) * (w_up.float() @ xin)


def ref_silu_mul(g, u) -> torch.Tensor:
    return F.silu(g.float()) * u.float()


def ref_group_gemm_m1(w, a, active) -> torch.Tensor:
    """The live rows only: out[j] = W[e_j] @ a[e_j * 128] for e_j in active; [len(active), N] fp32."""
    return torch.stack([w[e].float() @ a[int(e) * EXPERT_ROWS].float() for e in active])


def ref_lm_head(w, x, norm_weight=None, eps: float = 1e-5) -> torch.Tensor:
    """Full fp32 logits W @ rmsnorm?(x)."""
    return w.float() @ _xin(x, norm_weight, eps)


def ref_embedding(table, token) -> torch.Tensor:
    return table[int(token)].float()


# ---- gates -----------------------------------------------------------------------------------------
def relerr(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp64 (the full-output relative error gate)."""
    o, r = out.double().flatten().cpu(), ref.double().flatten().cpu()
    return float((o - r).norm() / r.norm().clamp(min=1e-300))


def cosine(out, ref) -> float:
    o, r = out.double().flatten().cpu(), ref.double().flatten().cpu()
    return float(F.cosine_similarity(o, r, dim=0))
