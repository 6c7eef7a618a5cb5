"""Prompt prefill as batched torch on the megakernel's own weights, writing megart's KV cache layout.

All prompt positions go through each layer at once (bf16 GEMMs, SDPA with GQA and a causal mask), with the
decode step's storage points: bf16 normalised x, q / k / v after RoPE (fp32 RoPE on the host tables, Qwen3's
per-head norm in fp32 first), the attention output, silu(g) * u and the residual stream. The only extra
roundings are the bf16 GEMM outputs; the tests gate prefill against the decode path. Rows
[start, start + n) of every layer's (n_kv, max_seq, hd) caches are written; nothing else is touched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .llama_config import LlamaConfig, LlamaWeights

__all__ = ["prefill_logits"]

HEAD_ROWS = 16384     # LM-head rows multiplied in fp32 at a time (bounds the fp32 copy of a 128k x d head)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t (n, heads, hd) fp32, cos / sin (n, hd/2): rotate-half RoPE."""
    h = t.shape[-1] // 2
    a, b = t[..., :h], t[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


@torch.no_grad()
def prefill_logits(cfg: LlamaConfig, W: LlamaWeights, kv: list, cos: torch.Tensor, sin: torch.Tensor,
                   tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Run `tokens` (1-D int, on the weights' device) at positions [start, start + n), append their K/V to
    `kv`, and return the f32 logits of the last position. Attention sees cache rows [0, start + n)."""
    c = cfg
    n = tokens.numel()
    bf = torch.bfloat16
    x = W.embed[tokens.long()]                                        # (n, d) bf16
    cs, sn = cos[start:start + n], sin[start:start + n]
    end = start + n
    # causal over the whole visible range: query i (position start + i) sees rows <= start + i
    mask = None
    if start:
        mask = torch.arange(end, device=x.device)[None, :] <= (torch.arange(n, device=x.device)[:, None] + start)
    for i, L in enumerate(W.layers):
        h = _norm(x, L["in_norm"], c.eps).to(bf)
        qkv = F.linear(h, W.linear(i, "wqkv"))
        q = qkv[:, :c.n_q * c.hd].view(n, c.n_q, c.hd).float()
        k = qkv[:, c.n_q * c.hd:(c.n_q + c.n_kv) * c.hd].view(n, c.n_kv, c.hd).float()
        v = qkv[:, (c.n_q + c.n_kv) * c.hd:].view(n, c.n_kv, c.hd)
        if c.qk_norm:
            q, k = _norm(q, L["q_norm"], c.eps), _norm(k, L["k_norm"], c.eps)
        q, k = _rope(q, cs, sn).to(bf), _rope(k, cs, sn).to(bf)
        kc, vc = kv[i]
        kc[:, start:end] = k.transpose(0, 1)
        vc[:, start:end] = v.transpose(0, 1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :end], vc[None, :, :end],
                                           attn_mask=mask, is_causal=mask is None, scale=c.hd ** -0.5,
                                           enable_gqa=True)               # (1, n_q, n, hd)
        a = a[0].transpose(0, 1).reshape(n, c.n_q * c.hd).to(bf)
        x = (x.float() + F.linear(a, W.linear(i, "wo")).float()).to(bf)
        h = _norm(x, L["post_norm"], c.eps).to(bf)
        g, u = F.linear(h, W.linear(i, "wg")).float(), F.linear(h, W.linear(i, "wu")).float()
        m = (F.silu(g) * u).to(bf)
        x = (x.float() + F.linear(m, W.linear(i, "wd")).float()).to(bf)
    h = _norm(x[-1], W.final_norm, c.eps).to(bf).float()
    def rows(r):      # (an e4m3 head, cfg.fp8_head: its per-row scales after the dot, as the device does)
        out = W.head[r:r + HEAD_ROWS].float() @ h
        return out if W.shead is None else out * W.shead[r:r + HEAD_ROWS]
    return torch.cat([rows(r) for r in range(0, c.vocab, HEAD_ROWS)])
