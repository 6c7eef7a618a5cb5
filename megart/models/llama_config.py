"""Llama-style decoder shapes, seeded random weights and prefilled KV caches.

Everything here is plain torch and shared by the megakernel build (megart.models.llama) and the
PyTorch reference (megart.models.reference), so both read the very same bytes.

Weights are seeded random, scaled randn(out, in) / sqrt(in) (unscaled randn diverges over depth);
RMSNorm gains are 1 + 0.1 randn so a kernel that ignores them is caught. The fp8 variant ships
PRE-QUANTISED e4m3 weights with one f32 scale per output channel, each scale rounded onto the bf16
grid; the reference dequantises those same bytes (docs/METHOD.md, Inputs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..geometry.dense import FP8_MAX  # the e4m3 format the fp8 tasks read


@dataclass(frozen=True)
class LlamaConfig:
    """One decoder. `vocab == 0` means a bare block (no embedding, no LM head): step(x, pos) -> x."""
    name: str
    layers: int
    d: int
    ffn: int
    n_q: int
    n_kv: int
    hd: int
    vocab: int = 0
    tied: bool = True             # LM head = embedding table; False: a separate head matrix
    eps: float = 1e-5
    theta: float = 500000.0
    prefill: int = 2048           # KV rows [0, prefill) hold a seeded random prefix; decode starts at pos=prefill
    max_seq: int = 3072           # cache capacity (rows); pos < max_seq always
    wdtype: str = "bf16"          # "bf16" | "fp8" (e4m3 + per-output-channel f32 scale)
    # Llama 3.1 / 3.2 RoPE frequency scaling ("llama3"): (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); () = none
    rope_llama3: tuple = ()
    qk_norm: bool = False         # Qwen3: RMSNorm per head on q and k (gains [hd]) before RoPE
    # fp8 only: "fused" = gate_up_silu_fp8 (gate and up in fp32, never stored; one call fewer per layer);
    # "split" = one gemv_m1_fp8 over the stacked gate|up rows (bf16 out) then silu_mul. Fused is the default:
    # measured 897.2 vs 916.4 us/step on the 1B shape (H200, bench/RESULTS.md, issue 9), and a lower relerr
    fp8_gate_up: str = "fused"
    # fp8 only: the LM head as e4m3 + per-row f32 scales (lm_head_argmax_fp8; a tied table keeps its bf16
    # copy for the embedding lookup). Timed at 879.3 us/step with the fused gate/up (1b_fp8_all, against
    # 1b_fp8's 897.2), but quantising the LM head is a precision choice the user makes: off by default.
    fp8_head: bool = False
    # fp8 only: the fused QKV projection as e4m3 + per-row f32 scales (qkv_rope_append_fp8); with fp8_head,
    # every matrix the step streams is e4m3 ("1b_fp8_all")
    fp8_qkv: bool = False

    def __post_init__(self):
        if self.wdtype not in ("bf16", "fp8"):
            raise ValueError(f"wdtype must be 'bf16' or 'fp8', got {self.wdtype!r}")
        if self.fp8_gate_up not in ("split", "fused"):
            raise ValueError(f"fp8_gate_up must be 'split' or 'fused', got {self.fp8_gate_up!r}")
        if self.fp8_head and self.wdtype != "fp8":
            raise ValueError("fp8_head needs wdtype='fp8'")
        if self.fp8_qkv and self.wdtype != "fp8":
            raise ValueError("fp8_qkv needs wdtype='fp8'")
        if self.n_q % self.n_kv:
            raise ValueError(f"n_q={self.n_q} must be a multiple of n_kv={self.n_kv}")
        if self.hd % 2:
            raise ValueError("head_dim must be even (rotate-half RoPE)")
        if not 0 <= self.prefill < self.max_seq:
            raise ValueError(f"need 0 <= prefill ({self.prefill}) < max_seq ({self.max_seq})")
        if self.rope_llama3 and len(self.rope_llama3) != 4:
            raise ValueError(f"rope_llama3 must be (factor, low_freq_factor, high_freq_factor, original_max_position"
                             f"_embeddings), got {self.rope_llama3!r}")

    @property
    def block(self) -> bool:
        return self.vocab == 0

    @property
    def group(self) -> int:
        return self.n_q // self.n_kv

    @property
    def qkv_rows(self) -> int:
        return (self.n_q + 2 * self.n_kv) * self.hd

    def layer_params(self) -> int:
        return (self.qkv_rows * self.d + self.d * self.n_q * self.hd + 3 * self.ffn * self.d)

    @property
    def head_separate(self) -> bool:
        """An LM head of its own (untied): the embedding table and the head are two matrices."""
        return not self.block and not self.tied

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step streams (norm gains included; the embedding row ignored).
        fp8: e4m3 o/gate/up/down + f32 scales; QKV stays bf16 unless fp8_qkv, the LM head unless fp8_head."""
        qkv, rest = self.qkv_rows * self.d, self.layer_params() - self.qkv_rows * self.d
        if self.wdtype == "fp8":
            qkv_bytes = qkv + self.qkv_rows * 4 if self.fp8_qkv else qkv * 2
            per_layer = qkv_bytes + rest + (self.d + 2 * self.ffn + self.d) * 4
        else:
            per_layer = (qkv + rest) * 2
        per_layer += 2 * self.d * 2
        head_row = self.d + 4 if self.fp8_head else self.d * 2      # (e4m3 + an f32 scale, or bf16)
        head = 0 if self.block else self.vocab * head_row + self.d * 2
        return self.layers * per_layer + head

    def kv_bytes(self, pos: int | None = None) -> int:
        """KV bytes one step at `pos` reads (default: the first decode step, pos = prefill)."""
        length = (self.prefill if pos is None else pos) + 1
        return self.layers * 2 * self.n_kv * length * self.hd * 2

    def bytes_per_step(self, pos: int | None = None) -> int:
        return self.weight_bytes() + self.kv_bytes(pos)

    def with_(self, **kw) -> "LlamaConfig":
        return replace(self, **kw)


def _max_seq(context: int, headroom: int) -> int:
    return context + headroom


def llama_1b(context: int = 2048, headroom: int = 1024, wdtype: str = "bf16") -> LlamaConfig:
    """Llama-3.2-1B shape: 16 layers, d 2048, ffn 8192, 32/8 heads, hd 64, vocab 128256, tied head.
    `context` tokens are prefilled; `headroom` more rows are allocated for decoding (1,000-step runs)."""
    tag = "" if context == 2048 else f"_{context // 1024}k" if context % 1024 == 0 else f"_{context}"
    return LlamaConfig(name=f"llama1b{'_fp8' if wdtype == 'fp8' else ''}{tag}", layers=16, d=2048, ffn=8192,
                       n_q=32, n_kv=8, hd=64, vocab=128256, eps=1e-5, theta=500000.0, prefill=context,
                       max_seq=_max_seq(context, headroom), wdtype=wdtype)


def llama_1b_fp8(context: int = 2048, headroom: int = 1024) -> LlamaConfig:
    return llama_1b(context, headroom, wdtype="fp8")


def block_8b(prefill: int = 4096, max_seq: int = 4224) -> LlamaConfig:
    """Two layers of an 8B-class model: d 4096, ffn 14336, 32/8 heads, hd 128, no
    embedding / LM head, a 4096-token prefix, cache capacity 4224."""
    return LlamaConfig(name="block8b", layers=2, d=4096, ffn=14336, n_q=32, n_kv=8, hd=128, vocab=0,
                       eps=1e-5, theta=500000.0, prefill=prefill, max_seq=max_seq)


def small(layers: int = 24, context: int = 2048, headroom: int = 1024) -> LlamaConfig:
    """A small model as a new user would try one: d 1024, ffn 4096, 16/8 heads x 64, 24 layers, the
    Llama-3 vocabulary (tied). Few bytes per layer, so a fixed cost per layer shows."""
    return LlamaConfig(name=f"small{layers}", layers=layers, d=1024, ffn=4096, n_q=16, n_kv=8, hd=64,
                       vocab=128256, eps=1e-5, theta=500000.0, prefill=context,
                       max_seq=_max_seq(context, headroom))


def tiny(layers: int = 2, d: int = 256, ffn: int = 512, n_q: int = 4, n_kv: int = 2, hd: int = 64,
         vocab: int = 1000, prefill: int = 40, max_seq: int = 64, wdtype: str = "bf16") -> LlamaConfig:
    """The reduced shape the CPU emulator tests run."""
    return LlamaConfig(name=f"tiny{'_block' if vocab == 0 else ''}{'_fp8' if wdtype == 'fp8' else ''}",
                       layers=layers, d=d, ffn=ffn, n_q=n_q, n_kv=n_kv, hd=hd, vocab=vocab,
                       prefill=prefill, max_seq=max_seq, wdtype=wdtype)


def llama_3b(context: int = 2048, headroom: int = 1024) -> LlamaConfig:
    """Llama-3.2-3B shape: 28 layers, d 3072, ffn 8192, 24/8 heads (GQA group 3), hd 128, tied head, llama3 RoPE."""
    return LlamaConfig(name="llama3b", layers=28, d=3072, ffn=8192, n_q=24, n_kv=8, hd=128, vocab=128256,
                       prefill=context, max_seq=_max_seq(context, headroom), rope_llama3=(32.0, 1.0, 4.0, 8192))


def llama_8b(context: int = 2048, headroom: int = 1024) -> LlamaConfig:
    """Llama-3.1-8B shape: 32 layers, d 4096, ffn 14336, 32/8 heads, hd 128, UNTIED head, llama3 RoPE."""
    return LlamaConfig(name="llama8b", layers=32, d=4096, ffn=14336, n_q=32, n_kv=8, hd=128, vocab=128256,
                       tied=False, prefill=context, max_seq=_max_seq(context, headroom),
                       rope_llama3=(8.0, 1.0, 4.0, 8192))


def qwen3(size: str = "0.6b", context: int = 2048, headroom: int = 1024) -> LlamaConfig:
    """Qwen3-0.6B (28 layers, d 1024, ffn 3072, 16/8 heads, tied) or Qwen3-8B (36 layers, d 4096, ffn 12288,
    32/8 heads, untied): hd 128, per-head q/k norm, theta 1e6, eps 1e-6, vocab 151936."""
    shape = {"0.6b": dict(layers=28, d=1024, ffn=3072, n_q=16, n_kv=8, tied=True),
             "8b": dict(layers=36, d=4096, ffn=12288, n_q=32, n_kv=8, tied=False)}[size]
    return LlamaConfig(name=f"qwen3_{size}", hd=128, vocab=151936, eps=1e-6, theta=1e6, qk_norm=True,
                       prefill=context, max_seq=_max_seq(context, headroom), **shape)


def llama_g7(context: int = 2048, headroom: int = 1024) -> LlamaConfig:
    """A GQA group-7 Llama (LlamaForCausalLM, no biases) with Qwen2.5-7B's heads and width: 28 layers, d 3584,
    28/4 heads, hd 128, vocab 152064, untied head, theta 1e6; ffn 14336 (Qwen2.5-7B's 18944 is over the
    GEMVs' longest input, MAX_K = 16384, which config_from_hf refuses)."""
    return LlamaConfig(name="llama_g7", layers=28, d=3584, ffn=14336, n_q=28, n_kv=4, hd=128, vocab=152064,
                       tied=False, eps=1e-6, theta=1e6, prefill=context, max_seq=_max_seq(context, headroom))


CONFIGS = {
    "1b": lambda: llama_1b(2048),
    "1b_32k": lambda: llama_1b(32768),
    "1b_128": lambda: llama_1b(128),      # the short context Hazy Research's Llama-1B megakernel was timed at
    "1b_fp8": lambda: llama_1b_fp8(),     # the fused fp8 gate/up (the default)
    "1b_fp8_split": lambda: llama_1b_fp8().with_(name="llama1b_fp8_split", fp8_gate_up="split"),
    "1b_fp8_all": lambda: llama_1b_fp8().with_(name="llama1b_fp8_all", fp8_gate_up="fused", fp8_head=True,
                                               fp8_qkv=True),
    # (1b_fp8_all before fp8 QKV existed: bf16 QKV, e4m3 everything else)
    "1b_fp8_head": lambda: llama_1b_fp8().with_(name="llama1b_fp8_head", fp8_gate_up="fused", fp8_head=True),
    "block8b": block_8b,
    "small": small,
    "3b": llama_3b,
    "8b": llama_8b,
    "qwen3_0.6b": lambda: qwen3("0.6b"),
    "qwen3_8b": lambda: qwen3("8b"),
    "g7_7b": llama_g7,
    "tiny": tiny,
    "tiny_fp8": lambda: tiny(wdtype="fp8"),
    "tiny_fp8_split": lambda: tiny(wdtype="fp8").with_(name="tiny_fp8_split", fp8_gate_up="split"),
    "tiny_fp8_all": lambda: tiny(wdtype="fp8").with_(name="tiny_fp8_all", fp8_gate_up="fused", fp8_head=True,
                                                     fp8_qkv=True),
    "tiny_block": lambda: tiny(vocab=0),
}


def config(name: str) -> LlamaConfig:
    try:
        return CONFIGS[name]()
    except KeyError:
        raise KeyError(f"unknown config {name!r}; known: {sorted(CONFIGS)}") from None


# --- weights -----------------------------------------------------------------------------------------
LINEARS = ("wqkv", "wo", "wg", "wu", "wd")
# Matrices the fp8 variant quantises; the fused QKV projection too with cfg.fp8_qkv (qkv_rope_append_fp8),
# the LM head with cfg.fp8_head.
FP8_LINEARS = ("wo", "wg", "wu", "wd")


@dataclass
class LlamaWeights:
    """layers[i]: in_norm, post_norm (bf16 [d]); wqkv (rows: q heads, k heads, v heads), wo, wg, wu, wd
    in bf16; fp8: wo, wg, wu, wd (and wqkv with cfg.fp8_qkv) in e4m3 with an f32 per-row scale under
    `s<name>` (e.g. `swo`), and
    wg / wu are the two halves of one [2 ffn, d] matrix `wgu` (scales `swgu`).
    embed / head: bf16 [vocab, d], the same tensor when tied, two when not; with cfg.fp8_head the head is
    e4m3 with per-row f32 scales `shead` (tied: quantised from the bf16 table, which stays the embedding).
    qk_norm configs: layers[i] also hold q_norm, k_norm (bf16 [hd])."""
    cfg: LlamaConfig
    layers: list = field(default_factory=list)
    embed: torch.Tensor | None = None
    head: torch.Tensor | None = None
    shead: torch.Tensor | None = None
    final_norm: torch.Tensor | None = None

    def linear(self, layer: int | None, name: str, dtype=torch.bfloat16) -> torch.Tensor:
        """The matrix the model multiplies by, in `dtype` (fp8: dequantised from the same bytes, each call)."""
        if layer is None:
            w, s = self.head, self.shead
        else:
            L = self.layers[layer]
            w, s = L[name], L.get("s" + name)
        return dequant(w, s, dtype) if s is not None else w.to(dtype)

    def nbytes(self) -> int:
        ts = [t for L in self.layers for k, t in L.items() if k not in ("wgu", "swgu")]
        ts += [t for t in (self.final_norm, self.head, self.shead) if t is not None]
        if self.embed is not None and self.embed is not self.head:
            ts.append(self.embed)
        return sum(t.numel() * t.element_size() for t in ts)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3 quantisation; scales rounded onto the bf16 grid (exact in bf16/f32)."""
    amax = w.float().abs().amax(dim=1).clamp_min(1e-12)
    scale = (amax / FP8_MAX).to(torch.bfloat16).float()
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequant(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def make_weights(cfg: LlamaConfig, seed: int = 0, device="cpu", init: str = "random") -> LlamaWeights:
    """Seeded weights on `device`. init="empty" allocates without filling (compile-only builds of the
    full-size graph on a CPU: the pages are never touched)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bf = torch.bfloat16

    def mat(rows, cols, fp8):
        if init == "empty":
            if fp8:
                return (torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
                        torch.ones(rows, dtype=torch.float32, device=device))
            return torch.empty(rows, cols, dtype=bf, device=device), None
        w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
        w.mul_(1.0 / math.sqrt(cols))
        if fp8:
            return quantize_fp8(w)
        return w.to(bf), None

    def gain(n):
        if init == "empty":
            return torch.ones(n, dtype=bf, device=device)
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device)).to(bf)

    W = LlamaWeights(cfg)
    for _ in range(cfg.layers):
        L = {"in_norm": gain(cfg.d), "post_norm": gain(cfg.d)}
        if cfg.qk_norm:
            L["q_norm"], L["k_norm"] = gain(cfg.hd), gain(cfg.hd)
        for name, (r, c) in (("wqkv", (cfg.qkv_rows, cfg.d)), ("wo", (cfg.d, cfg.n_q * cfg.hd)),
                             ("wg", (cfg.ffn, cfg.d)), ("wu", (cfg.ffn, cfg.d)), ("wd", (cfg.d, cfg.ffn))):
            w, s = mat(r, c, cfg.wdtype == "fp8" and (name in FP8_LINEARS or (name == "wqkv" and cfg.fp8_qkv)))
            L[name] = w
            if s is not None:
                L["s" + name] = s
        if cfg.wdtype == "fp8":
            # gate and up in one [2 ffn, d] e4m3 matrix (one GEMV call streams both); wg / wu are views
            L["wgu"] = torch.cat([L["wg"], L["wu"]])
            L["swgu"] = torch.cat([L["swg"], L["swu"]])
            L["wg"], L["wu"] = L["wgu"][:cfg.ffn], L["wgu"][cfg.ffn:]
            L["swg"], L["swu"] = L["swgu"][:cfg.ffn], L["swgu"][cfg.ffn:]
        W.layers.append(L)
    if not cfg.block:
        W.final_norm = gain(cfg.d)
        W.head, W.shead = mat(cfg.vocab, cfg.d, False)
        W.embed = mat(cfg.vocab, cfg.d, False)[0] if cfg.head_separate else W.head
        if cfg.fp8_head:      # (the same draws as the bf16 head, then quantised: the embedding stays bf16)
            W.head, W.shead = (torch.empty(cfg.vocab, cfg.d, dtype=torch.float8_e4m3fn, device=device),
                               torch.ones(cfg.vocab, dtype=torch.float32, device=device)) if init == "empty" \
                else quantize_fp8(W.head)
    return W


def make_kv_cache(cfg: LlamaConfig, seed: int = 1, device="cpu", init: str = "random") -> list:
    """Per layer (k, v), each (n_kv, max_seq, hd) bf16: rows [0, prefill) seeded randn, the rest zero."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = []
    for _ in range(cfg.layers):
        pair = []
        for _ in range(2):
            if init == "empty":
                pair.append(torch.empty(cfg.n_kv, cfg.max_seq, cfg.hd, dtype=torch.bfloat16, device=device))
                continue
            t = torch.zeros(cfg.n_kv, cfg.max_seq, cfg.hd, dtype=torch.bfloat16, device=device)
            t[:, :cfg.prefill] = torch.randn(cfg.n_kv, cfg.prefill, cfg.hd, generator=gen, device=device)
            pair.append(t)
        out.append(tuple(pair))
    return out


def clone_kv(kv: list) -> list:
    return [(k.clone(), v.clone()) for k, v in kv]


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """f64 inverse frequencies theta ** (-2i / hd), i < hd / 2, with the llama3 scaling when configured:
    wavelengths longer than original / low_freq_factor are slowed by `factor`, those shorter than
    original / high_freq_factor kept, and the band between interpolated linearly in original / wavelength."""
    half = cfg.hd // 2
    inv = cfg.theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / cfg.hd)
    if not cfg.rope_llama3:
        return inv
    factor, low, high, original = (float(v) for v in cfg.rope_llama3)
    wavelen = 2 * math.pi / inv
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)   # 0: long waves, 1: short waves
    scaled = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen < original / high, inv, torch.where(wavelen > original / low, inv / factor, scaled))


def rope_tables(cfg: LlamaConfig, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """f32 cos, sin tables of shape (max_seq, hd // 2): angle[p, i] = p * inv_freq[i] (rope_inv_freq), computed
    once on the host in f64. Rotate-half RoPE: out[:h] = x[:h] cos - x[h:] sin, out[h:] = x[h:] cos + x[:h] sin
    (h = hd / 2)."""
    inv = rope_inv_freq(cfg)
    ang = torch.arange(cfg.max_seq, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device).contiguous(), ang.sin().float().to(device).contiguous()


def make_inputs(cfg: LlamaConfig, steps: int, seed: int = 2, device="cpu"):
    """First token (LM) or a (steps, d) bf16 stack of fresh residual inputs (block), seeded."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    if cfg.block:
        return torch.randn(steps, cfg.d, generator=gen).to(torch.bfloat16).to(device)
    return int(torch.randint(0, cfg.vocab, (1,), generator=gen))


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Full-tensor relative error ||out - ref|| / ||ref|| in fp32 (the correctness metric)."""
    o = out.detach().float().reshape(-1)
    r = ref.detach().float().reshape(-1).to(o.device)
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
