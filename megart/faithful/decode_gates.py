"""Gate specs of the decode task types, at production decode geometry (docs/METHOD.md):

* dense projections (gemv_m1, gemv_m1_fp8, gate_up_silu): M = 1, one activation row;
* routed MoE group GEMM (group_gemm_m1): one live token per ACTIVE expert (8 of them); the other
  127 rows of each expert's 128-row tile are zero padding; cosine is judged on the live rows only;
* attention (qkv_rope_append, attention_decode, attention_merge): one query token against the real
  KV length (Llama-3.2-1B: 32 q / 8 kv heads, head_dim 64, 2048 cached positions).

Inputs and whole-op references come from megart.geometry (seeded randn(out, in) / sqrt(in) weights,
generated on the CPU so every machine builds the same bytes; fp32 references on upcast inputs). The
whole-op reference is independent of the per-instance CPU references the emulator runs, so the CPU
check also tests each task's split. The default shapes are the Llama-3.2-1B decode shapes the
models in megart.models run, except group_gemm_m1 (a DeepSeek-V3-like expert GEMM, the routed MoE
case). Each task type names its adapter here in its declaration (TaskType.gate, tasks/*.py).
"""
from __future__ import annotations

import torch

from ..geometry import attention as ga
from ..geometry import dense as gd
from ..geometry.attention import attention_chunks, chunk_range
from .gate_spec import GateInputs, GateSpec, generator

BF16 = torch.bfloat16
LLAMA_1B = dict(d=2048, ffn=8192, n_q=32, n_kv=8, hd=64, ctx=2048, headroom=1024)


def _multiple(what: str, v: int, m: int) -> None:
    if v % m:
        raise ValueError(f"{what}={v} must be a multiple of {m} (16-byte vector loads)")


def _rows_by_k(model, insts) -> tuple:
    """A dense M = 1 call's (N, K) in a model: its tiles' output rows summed, and their common K."""
    return (sum(i.params["n"] for i in insts), insts[0].params["k"])


# ---- gemv_m1 -------------------------------------------------------------------------------------
def _gemv_build(shape, *, device, seed, decode_m1=False, nw=None):
    n, k = shape
    w, x = gd.dense_m1(n, k, seed)
    expected = gd.ref_gemv(w, x)
    tens = {"y": torch.zeros(n, dtype=BF16, device=device), "w": w.to(device), "x": x.to(device)}
    return GateInputs(tensors=tens, call=dict(tens), output="y", expected=expected,
                      live_desc=f"all {n} outputs (M = 1)",
                      note="decode geometry: M = 1 (one activation row), y = W x, bf16 in/out, fp32 reference")


def gemv_m1() -> GateSpec:
    # default: Llama-3.2-1B's widest dense projection shape (ffn x d = 8192 x 2048, 32 MiB of bf16)
    return GateSpec(task="gemv_m1", model_tiles=("o", "down"), dims=("N", "K"), default_shape=(LLAMA_1B["ffn"], LLAMA_1B["d"]),
                    build=_gemv_build, tiles=lambda shape, nw: nw, cpu_shape=(2048, 2048), cpu_max_elems=1 << 25, cpu_keep=("K",),
                    decode_m1="native", check_shape=lambda s: _multiple("K", s[1], 8),
                    model_shape=_rows_by_k, extra={"elements": lambda s: s[0] * s[1]},
                    doc="y[N] = W[N,K] x[K], M = 1; one tile of output rows per worker")


# ---- gemv_m1_fp8 ---------------------------------------------------------------------------------
def _gemv_fp8_build(shape, *, device, seed, decode_m1=False, nw=None):
    n, k = shape
    w, x = gd.dense_m1(n, k, seed, dtype=torch.float32)
    w8, scale = gd.quantize_fp8_per_channel(w)       # pre-quantised: the reference reads the same bytes
    x = x.to(BF16)
    expected = gd.ref_gemv_fp8(w8, scale, x)
    tens = {"y": torch.zeros(n, dtype=BF16, device=device), "w": w8.to(device), "scale": scale.to(device),
            "x": x.to(device)}
    return GateInputs(tensors=tens, call=dict(tens), output="y", expected=expected,
                      live_desc=f"all {n} outputs (M = 1)",
                      note="decode geometry: M = 1; pre-quantised e4m3 weights + per-channel scales")


def gemv_m1_fp8() -> GateSpec:
    return GateSpec(task="gemv_m1_fp8", model_tiles=("o", "down", "gate_up"), dims=("N", "K"), default_shape=(LLAMA_1B["ffn"], LLAMA_1B["d"]),
                    build=_gemv_fp8_build, tiles=lambda shape, nw: nw, cpu_shape=(2048, 2048),
                    cpu_max_elems=1 << 25, cpu_keep=("K",), decode_m1="native", check_shape=lambda s: _multiple("K", s[1], 16),
                    model_shape=_rows_by_k, extra={"elements": lambda s: s[0] * s[1]},
                    doc="fp8 e4m3 GEMV, per-channel scales, M = 1")


# ---- gate_up_silu --------------------------------------------------------------------------------
def _gate_up_build(shape, *, device, seed, decode_m1=False, nw=None):
    f, k = shape
    wg, x = gd.dense_m1(f, k, seed)
    wu, _ = gd.dense_m1(f, k, seed + 1)
    expected = gd.ref_gate_up_silu(wg, wu, x)
    tens = {"h": torch.zeros(f, dtype=BF16, device=device), "w_gate": wg.to(device), "w_up": wu.to(device),
            "x": x.to(device)}
    return GateInputs(tensors=tens, call=dict(tens), output="h", expected=expected,
                      live_desc=f"all {f} outputs (M = 1)", note="decode geometry: M = 1, h = silu(Wg x) * (Wu x)")


def gate_up_silu() -> GateSpec:
    return GateSpec(task="gate_up_silu", model_tiles=("gate_up",), dims=("F", "K"), default_shape=(LLAMA_1B["ffn"], LLAMA_1B["d"]),
                    build=_gate_up_build, tiles=lambda shape, nw: nw, cpu_shape=(2048, 2048),
                    cpu_max_elems=1 << 25, cpu_keep=("K",), decode_m1="native", check_shape=lambda s: _multiple("K", s[1], 8),
                    model_shape=_rows_by_k, extra={"elements": lambda s: 2 * s[0] * s[1]},
                    doc="fused gate/up projection + SiLU, M = 1")


# ---- group_gemm_m1 -------------------------------------------------------------------------------
ACTIVE_EXPERTS = 8      # bs = 1, top-8 routing: ~4-8 active experts per rank


def _active(e: int, seed: int) -> list[int]:
    g = generator(seed + 7919)
    return sorted(int(i) for i in torch.randperm(e, generator=g)[:min(ACTIVE_EXPERTS, e)])


def _group_build(shape, *, device, seed, decode_m1=True, nw=None):
    e, n, k = shape
    act = _active(e, seed)
    w, a, rows = gd.moe_m1(e, act, n, k, seed)
    ref = gd.ref_group_gemm_m1(w, a, act)               # [len(act), N], the live rows only
    expected = torch.zeros(e * gd.EXPERT_ROWS, n, dtype=torch.float32)
    expected[rows] = ref
    tens = {"y": torch.zeros(e * gd.EXPERT_ROWS, n, dtype=BF16, device=device), "w": w.to(device),
            "a": a.to(device)}
    rows = rows.cpu()
    return GateInputs(tensors=tens, call={"y": tens["y"], "w": tens["w"], "a": tens["a"], "active": act},
                      output="y", expected=expected, live=lambda t: t[rows],
                      live_desc=f"the {len(act)} live rows (expert*{gd.EXPERT_ROWS} + 0 of experts {act})",
                      note=f"decode-m1 geometry: {len(act)} active experts {act} of {e}, one live row each; "
                           "the other 127 rows of each expert tile are zero padding")


def group_gemm_m1() -> GateSpec:
    # DeepSeek-V3-like expert GEMM on one rank: 32 local experts, N = 2048 (moe_inter), K = 7168 (hidden)
    return GateSpec(task="group_gemm_m1", dims=("E", "N", "K"), default_shape=(32, 2048, 7168),
                    build=_group_build, tiles=lambda shape, nw: nw, cpu_shape=(16, 256, 1024),
                    cpu_max_elems=1 << 25, cpu_keep=("K",), decode_m1="native", check_shape=lambda s: _multiple("K", s[2], 8),
                    extra={"elements": lambda s: s[0] * s[1] * s[2]},
                    doc="routed MoE expert GEMM, one live row per active expert (8 active), cos on live rows")


# ---- attention: qkv_rope_append ----------------------------------------------------------------------
def _qkv_build(shape, *, device, seed, decode_m1=False, nw=None):
    d, n_q, n_kv, hd, L = shape
    max_seq = L + LLAMA_1B["headroom"]
    pos = L                                             # the first decode step after an L-token prefill
    w, x, nwt = ga.qkv_m1(n_q, n_kv, hd, d, seed)
    cos, sin = ga.rope_tables(max_seq, hd, theta=500000.0)
    _, kc, vc = ga.attention_m1(n_q, n_kv, hd, L, max_seq, seed + 1)
    q_ref, k_ref, v_ref = ga.ref_qkv_rope_append(x, w, cos, sin, pos, n_q, n_kv, hd, norm_weight=nwt)
    expected = torch.cat([q_ref, k_ref.reshape(-1), v_ref.reshape(-1)])
    tens = {"q": torch.zeros(n_q * hd, dtype=BF16, device=device), "k_cache": kc.to(device),
            "v_cache": vc.to(device), "w_qkv": w.to(device), "x": x.to(device), "norm_weight": nwt.to(device),
            "cos": cos.to(device), "sin": sin.to(device),
            "pos": torch.tensor([pos], dtype=torch.int32, device=device)}
    call = {k: tens[k] for k in ("q", "k_cache", "v_cache", "w_qkv", "x", "cos", "sin", "pos", "norm_weight")}
    call.update(n_q=n_q, n_kv=n_kv, hd=hd)

    def result(t):
        return torch.cat([t["q"].reshape(-1).cpu(), t["k_cache"][:, pos].reshape(-1).cpu(),
                          t["v_cache"][:, pos].reshape(-1).cpu()])
    return GateInputs(tensors=tens, call=call, output="q", result=result, expected=expected,
                      live_desc=f"q ({n_q}x{hd}) and the appended k/v rows at pos {pos}",
                      note=f"decode geometry: one token at pos {pos}, fused RMSNorm + QKV + RoPE + cache append")


def qkv_rope_append() -> GateSpec:
    c = LLAMA_1B
    return GateSpec(task="qkv_rope_append", model_tiles=("qkv",), dims=("d", "Hq", "Hkv", "D", "L"),
                    default_shape=(c["d"], c["n_q"], c["n_kv"], c["hd"], c["ctx"]), build=_qkv_build,
                    tiles=lambda shape, nw: nw, cpu_shape=(512, 8, 2, 64, 64), cpu_max_elems=1 << 25,
                    cpu_keep=("d", "D"),
                    decode_m1="native",
                    model_shape=lambda m, _: (m.cfg.d, m.cfg.n_q, m.cfg.n_kv, m.cfg.hd, m.cfg.prefill),
                    extra={"elements": lambda s: (s[1] + 2 * s[2]) * s[3] * (s[0] + 2 * (s[4] + 1024))},
                    doc="RMSNorm + QKV projection + RoPE + KV append for one token at pos L")


# ---- attention: attention_decode -------------------------------------------------------------------
def _partials_merge(part_o, part_ml, n_kv, chunks, G, hd):
    """PyTorch merge of attention_decode's partials into [n_q * hd] (the whole-op check's view)."""
    o = part_o.detach().double().cpu().view(n_kv, chunks, G, hd)
    ml = part_ml.detach().double().cpu().view(n_kv, chunks, G, 2)
    m, l = ml[..., 0], ml[..., 1]
    M = m.max(dim=1, keepdim=True).values
    w = torch.exp(m - M)
    w = torch.where(torch.isfinite(m), w, torch.zeros_like(w))
    num = (w[..., None] * o).sum(dim=1)
    den = (w * l).sum(dim=1)[..., None]
    return (num / den).reshape(-1)


def _attn_build(shape, *, device, seed, decode_m1=False, nw=None, tiles=None):
    n_q, n_kv, hd, L = shape
    max_seq = L + LLAMA_1B["headroom"]
    pos = L - 1                                          # kv_len = pos + 1 = L real positions
    q, kc, vc = ga.attention_m1(n_q, n_kv, hd, L, max_seq, seed)
    chunks = attention_chunks(n_kv, max_seq, nw or 132, tiles=tiles or nw or 132)
    po, pm = ga.attention_scratch(n_q, n_kv, hd, chunks)
    expected = ga.ref_attention_decode(q, kc, vc, L)
    tens = {"q": q.to(device), "k_cache": kc.to(device), "v_cache": vc.to(device),
            "pos": torch.tensor([pos], dtype=torch.int32, device=device), "part_o": po.to(device),
            "part_ml": pm.to(device)}
    call = dict(tens, n_q=n_q, n_kv=n_kv, hd=hd)
    G = n_q // n_kv
    return GateInputs(tensors=tens, call=call, output="part_o", expected=expected,
                      result=lambda t: _partials_merge(t["part_o"], t["part_ml"], n_kv, chunks, G, hd),
                      live_desc=f"the {n_q}x{hd} attention output (partials of {chunks} chunks merged in PyTorch)",
                      note=f"decode geometry: one query token against kv_len {L} (of {max_seq} cache rows), "
                           f"{chunks} KV chunks per kv head")


def attention_decode() -> GateSpec:
    c = LLAMA_1B
    return GateSpec(task="attention_decode", model_tiles=("attn_chunks",), dims=("Hq", "Hkv", "D", "L"),
                    default_shape=(c["n_q"], c["n_kv"], c["hd"], c["ctx"] + 1), build=_attn_build,
                    tiles=lambda shape, nw: nw, cpu_shape=(8, 2, 64, 256), cpu_max_elems=1 << 25, cpu_keep=("D",),
                    decode_m1="native", extra={"elements": lambda s: 2 * s[1] * (s[3] + 1024) * s[2]},
                    model_shape=lambda m, _: (m.cfg.n_q, m.cfg.n_kv, m.cfg.hd, m.cfg.prefill + 1),  # L = kv_len
                    doc="flash-decoding partials of one query token over the real KV length L")


# ---- attention: attention_merge ----------------------------------------------------------------------
def _merge_build(shape, *, device, seed, decode_m1=False, nw=None):
    n_q, n_kv, hd, C = shape
    L = LLAMA_1B["ctx"] + 1
    q, kc, vc = ga.attention_m1(n_q, n_kv, hd, L, L, seed)
    G = n_q // n_kv
    po = torch.zeros(n_kv, C, G, hd, dtype=torch.float32)
    pm = torch.zeros(n_kv, C, G, 2, dtype=torch.float32)
    qf = q.float().view(n_kv, G, hd)
    scale = hd ** -0.5
    for h in range(n_kv):
        for c in range(C):                      # the partials attention_decode would write
            lo, hi = chunk_range(0, c, C, L)
            if hi <= lo:
                pm[h, c, :, 0], pm[h, c, :, 1] = float("-inf"), 0.0
                continue
            s = (qf[h] @ kc[h, lo:hi].float().T) * scale
            m = s.max(dim=1).values
            e = torch.exp(s - m[:, None])
            po[h, c] = e @ vc[h, lo:hi].float()
            pm[h, c, :, 0], pm[h, c, :, 1] = m, e.sum(dim=1)
    expected = ga.ref_attention_decode(q, kc, vc, L)
    tens = {"out": torch.zeros(n_q * hd, dtype=BF16, device=device), "part_o": po.to(device),
            "part_ml": pm.to(device)}
    return GateInputs(tensors=tens, call=dict(tens, n_q=n_q, n_kv=n_kv, hd=hd, chunks=C), output="out",
                      expected=expected, live_desc=f"the {n_q}x{hd} merged attention output",
                      note=f"merge of {C} chunk partials per kv head (kv_len {L}), against whole attention")


def attention_merge() -> GateSpec:
    c = LLAMA_1B
    return GateSpec(task="attention_merge", model_tiles=("merge",), dims=("Hq", "Hkv", "D", "C"),
                    default_shape=(c["n_q"], c["n_kv"], c["hd"], 16), build=_merge_build,
                    tiles=lambda shape, nw: nw, cpu_shape=None, decode_m1="native",
                    model_shape=lambda m, _: (m.cfg.n_q, m.cfg.n_kv, m.cfg.hd, m.chunks),
                    doc="log-sum-exp merge of attention_decode's chunk partials (16 chunks = 132 // 8)")
