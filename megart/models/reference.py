"""Plain PyTorch reference of the Llama-style decoder megart.models.llama builds, also the torch baseline.

Three numerics, one model:

* precision="bf16" (default: the reference the megakernel is gated against): bf16 weights (fp8: the same
  e4m3 bytes and per-row f32 scales, the scale applied to the fp32 dot as every fp8 task does, never
  folded into the weights first: e4m3 x scale is not exact in fp32, so the two orders differ by ulps that
  can flip a bf16 rounding), every GEMV accumulated in fp32 with an fp32 result, RMSNorm / RoPE / softmax
  in fp32, and bf16 rounding exactly where a value is stored in bf16: the normalised x, q/k/v after RoPE
  (the cache), the attention output, silu(g) * u, and the residual stream after each add (fp8
  "split" also rounds gate|up, which that graph stores; "fused" keeps them in fp32). Logits stay f32.
  This is "bf16 weights, fp32 accumulation, bf16 residual stream" with the rounding points of a fused
  implementation.
* precision="torch": the straightforward bf16 torch model (every `F.linear` in bf16 with a bf16 result,
  fp8 weights dequantised to bf16 once): what the torch baselines run (eager, CUDA-graphed, compiled),
  and an independent correct implementation for E.
* precision="fp32": everything in fp32 (fp32 residual, fp32 cache copy, hand-written attention): the
  other independent implementation for E.

Feature drops for D (docs/MODEL.md): skip_layers={i}, residual=False.

Two step entry points:
* `step(inp, pos)` with a Python int pos: attention over exactly pos + 1 cache rows; returns f32 logits
  (LM) or the residual stream (block). Appends this position's K/V to the reference's own caches.
* `decode_step_(token, pos)` with device tensors: the graph-capturable greedy step the torch baselines
  time (eager, CUDA-graphed, torch.compile): masked attention over the whole cache, argmax written back
  into `token`, `pos` advanced by one, all on the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .llama_config import LlamaConfig, LlamaWeights, clone_kv, rope_tables

__all__ = ["Reference"]


class Reference:
    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, kv: list, *, precision: str = "bf16",
                 skip_layers=(), residual: bool = True, copy_kv: bool = True):
        if precision not in ("bf16", "torch", "fp32"):
            raise ValueError(f"precision must be 'bf16', 'torch' or 'fp32', got {precision!r}")
        self.cfg = cfg
        self.precision = precision
        self.skip = set(skip_layers)
        self.residual = residual
        self.dt = torch.float32 if precision == "fp32" else torch.bfloat16
        dev = weights.layers[0]["wqkv"].device
        self.device = dev
        # the "split" fp8 graph stores gate|up in bf16 before silu_mul ("fused", gate_up_silu_fp8, keeps them
        # in fp32 registers: _lin's fp32 s * (W8 h), never rounded)
        self.fp8_storage = precision == "bf16" and cfg.wdtype == "fp8" and cfg.fp8_gate_up == "split"
        # the matrices as this precision multiplies them (bf16 tensors are shared, never copied, in
        # "bf16"/"torch"; "bf16" keeps fp8 as (bytes, scales) and scales each call's fp32 dots)
        self.layers = []
        for i, L in enumerate(weights.layers):
            lw = {n: self._weight(weights, i, n) for n in ("wqkv", "wo", "wg", "wu", "wd")}
            lw["in_norm"], lw["post_norm"] = L["in_norm"].float(), L["post_norm"].float()
            if cfg.qk_norm:
                lw["q_norm"], lw["k_norm"] = L["q_norm"].float(), L["k_norm"].float()
            self.layers.append(lw)
        if not cfg.block:
            self.final_norm = weights.final_norm.float()
            self.head = self._weight(weights, None, "head")
            self.embed = weights.embed.to(self.dt)
        if precision == "fp32":
            self.kv = [(k.float(), v.float()) for k, v in kv]
        else:
            self.kv = clone_kv(kv) if copy_kv else kv
        self.cos, self.sin = rope_tables(cfg, dev)
        self.scale = cfg.hd ** -0.5
        self._arange = torch.arange(cfg.max_seq, device=dev)

    def _weight(self, weights: LlamaWeights, layer, name):
        if layer is None:
            w, s = weights.head, weights.shead
        else:
            w, s = weights.layers[layer][name], weights.layers[layer].get("s" + name)
        if self.precision == "fp32":
            return weights.linear(layer, name, torch.float32)
        if self.precision == "torch":
            return weights.linear(layer, name, torch.bfloat16)
        return (w, s)

    def _lin(self, x: torch.Tensor, w) -> torch.Tensor:
        """y = W x. "bf16": fp32 dots of the exact bf16 (or e4m3) weights, fp32 result; fp8: y = s * (W8 x), the
        per-row scale after the dot, as gemv_m1_fp8 / gate_up_silu_fp8 / lm_head_argmax_fp8 apply it."""
        if self.precision != "bf16":
            return F.linear(x, w)
        w, s = w
        y = F.linear(x.float(), w.float())
        return y if s is None else y * s

    # --- pieces -------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * w).to(self.dt)

    def _head_norm(self, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        return tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * w

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """t (heads, hd) -> fp32 rotate-half RoPE at one position (cos/sin (hd/2,) fp32)."""
        h = self.cfg.hd // 2
        tf = t.float()
        a, b = tf[:, :h], tf[:, h:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _qkv(self, lw, x, cos, sin):
        c = self.cfg
        h = self._norm(x, lw["in_norm"])
        qkv = self._lin(h, lw["wqkv"])
        q = qkv[: c.n_q * c.hd].view(c.n_q, c.hd)
        k = qkv[c.n_q * c.hd:(c.n_q + c.n_kv) * c.hd].view(c.n_kv, c.hd)
        v = qkv[(c.n_q + c.n_kv) * c.hd:].view(c.n_kv, c.hd)
        if c.qk_norm:       # Qwen3: per-head RMSNorm of the fp32 projections, before RoPE
            q, k = self._head_norm(q, lw["q_norm"]), self._head_norm(k, lw["k_norm"])
        q = self._rope(q, cos, sin).to(self.dt)
        k = self._rope(k, cos, sin).to(self.dt)
        return q, k, v.to(self.dt)

    def _mlp_and_residuals(self, lw, x, a):
        """x + Wo a, then + Wd (silu(Wg h) * Wu h) with h = norm(x); the residual kept in self.dt."""
        o = self._lin(a, lw["wo"])
        x = (x.float() + o.float()).to(self.dt) if self.residual else o.to(self.dt)
        h = self._norm(x, lw["post_norm"])
        g, u = self._lin(h, lw["wg"]).float(), self._lin(h, lw["wu"]).float()
        if self.fp8_storage:        # the split fp8 graph stores gate|up in bf16 before silu_mul
            g, u = g.to(torch.bfloat16).float(), u.to(torch.bfloat16).float()
        m = (F.silu(g) * u).to(self.dt)
        dn = self._lin(m, lw["wd"])
        return (x.float() + dn.float()).to(self.dt) if self.residual else dn.to(self.dt)

    def _attend_exact(self, q, K, V):
        """q (n_q, hd), K/V (n_kv, L, hd) -> (n_q * hd,)."""
        c = self.cfg
        if self.precision != "torch":       # fp32 scores, softmax and weighted sum
            qg = q.float().view(c.n_kv, c.group, c.hd)
            s = torch.einsum("kgd,kld->kgl", qg, K.float()) * self.scale
            p = torch.softmax(s, dim=-1)
            return torch.einsum("kgl,kld->kgd", p, V.float()).reshape(-1).to(self.dt)
        o = F.scaled_dot_product_attention(q[None, :, None, :], K[None], V[None], scale=self.scale,
                                           enable_gqa=True)
        return o.reshape(-1).to(self.dt)

    def _attend_masked(self, q, K, V, pos_t):
        """Graph-capturable: whole cache, rows > pos masked out. Scores via bf16 matmul, fp32 softmax."""
        c = self.cfg
        qg = q.view(c.n_kv, c.group, c.hd)
        s = torch.matmul(qg, K.transpose(1, 2)).float() * self.scale          # (n_kv, g, max_seq)
        s = s.masked_fill((self._arange > pos_t)[None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(self.dt)
        return torch.matmul(p, V).reshape(-1)

    # --- exact step (the correctness reference) ------------------------------------------------------
    @torch.no_grad()
    def step(self, inp, pos: int) -> torch.Tensor:
        """One decode step at position `pos` (an int). `inp`: token id (int or 1-element tensor) for an LM,
        the residual stream (d,) / (1, d) for a block. Returns f32 logits (vocab,) or the block output (d,)
        in self.dt. Appends K/V at row `pos` of every layer's cache."""
        c = self.cfg
        pos = int(pos)
        if not 0 <= pos < c.max_seq:
            raise ValueError(f"pos {pos} outside [0, {c.max_seq})")
        if c.block:
            x = inp.reshape(-1).to(self.device, self.dt)
        else:
            x = self.embed[int(inp)].clone()
        cos, sin = self.cos[pos], self.sin[pos]
        for i, lw in enumerate(self.layers):
            kc, vc = self.kv[i]
            if i in self.skip:
                continue
            q, k, v = self._qkv(lw, x, cos, sin)
            kc[:, pos] = k.to(kc.dtype)
            vc[:, pos] = v.to(vc.dtype)
            a = self._attend_exact(q, kc[:, : pos + 1], vc[:, : pos + 1])
            x = self._mlp_and_residuals(lw, x, a)
        if c.block:
            return x
        h = self._norm(x, self.final_norm)
        return self._lin(h, self.head).float()

    # --- device-state greedy step (the torch baselines) ----------------------------------------------
    @torch.no_grad()
    def decode_step_(self, token: torch.Tensor, pos: torch.Tensor, x_in: torch.Tensor | None = None):
        """token: int64 (1,) device tensor (LM), updated in place to the argmax; pos: int64 (1,) device
        tensor, advanced by one. Block: x_in (d,) is the input; returns the output. No host sync."""
        c = self.cfg
        x = x_in if c.block else F.embedding(token, self.embed).reshape(-1)
        cos = self.cos.index_select(0, pos).reshape(-1)
        sin = self.sin.index_select(0, pos).reshape(-1)
        for i, lw in enumerate(self.layers):
            kc, vc = self.kv[i]
            q, k, v = self._qkv(lw, x, cos, sin)
            kc.index_copy_(1, pos, k[:, None, :])
            vc.index_copy_(1, pos, v[:, None, :])
            a = self._attend_masked(q, kc, vc, pos)
            x = self._mlp_and_residuals(lw, x, a)
        pos.add_(1)
        if c.block:
            return x
        h = self._norm(x, self.final_norm)
        return self._pick_token_(self._lin(h, self.head), token)

    def _pick_token_(self, logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """token <- argmax(logits), on the device; returns the logits decode_step_ returns. (The tensor-parallel
        baseline overrides it: its logits are a vocabulary slice, the argmax is over every rank's.)"""
        token.copy_(torch.argmax(logits, dim=-1, keepdim=True))
        return logits
