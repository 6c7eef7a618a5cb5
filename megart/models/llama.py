"""A Llama-style decoder as ONE persistent megakernel per decode step.

    from megart.models import llama
    m = llama.LlamaModel(llama.llama_1b())          # seeded weights + prefilled KV cache, compiled
    logits, token = m.step(token=1234, pos=m.cfg.prefill)
    tokens = m.generate(100)                        # greedy: token and pos stay on the device

Graph, per step (every call spread over ~nw workers; dependencies are events or polls of tagged words, no
grid barrier):

    pos_advance                           pos = pos_next; pos_next += 1          (1 instance)
    embedding                             x[0] = table[token]                    (LM only)
    per layer l:
      qkv_rope_append  (fused in-norm)    q_l, K/V row pos of layer l's caches
      attention_decode                    per (kv head, chunk) partials, ~nw instances; the last chunk
                                          of each kv head to finish merges them: a_l (attn_merge="fused")
      [attention_merge                    a_l, as its own call (attn_merge="call")]
                                          (attn_merge="direct": one instance per q head over the whole
                                          context writes a_l itself, no partials; short contexts only)
      gemv_m1 o_proj   (fused residual)   xm_l = x_l + Wo a_l
      gate_up_silu     (fused post-norm)  h_l = silu(Wg n(xm_l)) * Wu n(xm_l)
      gemv_m1 down     (fused residual)   x_{l+1} = xm_l + Wd h_l
    lm_head_argmax (fused final norm) -> argmax_reduce (token, fed back; history[pos])

The residual stream is written in single-assignment form (one bf16 buffer per layer and half-layer), so
no call ever overwrites what another call of the same step still reads: every dependency is a
read-after-write on one producer call, i.e. one event per wait, and nothing needs a barrier. `pos` is
written once, first (pos_advance), so its dozens of readers depend on one tiny instance instead of a
step-end write that would have to wait for all of them.

With tagged=True (the default on one GPU) the residual stream after the embedding, attention's merged output
and h are tagged tensors (megart/tagged.py): o_proj, gate_up, down and the LM head poll the words they read
instead of waiting on their writers' events, so of each layer's edges only qkv -> attention is an event.
With tagged_attn=True that edge goes too: qkv stores q and the new k/v rows as tagged words instead of
appending to the caches, attention polls them (the cache rows below pos were written by earlier launches),
and kv_commit appends the rows after the LM head, once every attention instance of the layer has read the
caches. (Off by default until it is measured on the GPU.)

Dependencies are inferred from the byte ranges each call reads and writes (deps="infer", the default,
about a second for the 1B graph): its subset events let attention for a kv head start once that head's
QKV instances land, and o_proj once every chunk has arrived. deps="explicit" declares them instead
(`after=`, the transitive reduction of the data flow: call-level events). tests/test_llama.py checks on
the reduced model that every inferred dependency is implied by the explicit ones and that both produce
the same bits; on the H200 the inferred graph measured 1.2-1.6% faster per step (bench/RESULTS.md).
"""
from __future__ import annotations

import math

import torch

from .. import PersistentKernel
from ..config import kv_streamed
from ..options import check_defines
from .. import tagged as tagged_words
from ..geometry.attention import attention_chunks
from .call_breakdown import call_breakdown, call_index, call_kind
from .llama_defaults import (ATTN_DIRECT_UPTO, ATTN_MERGE, ATTN_MIN_CHUNK, DIRECT_WIDTH, SHORT_ATTN_RING,  # noqa: F401
                             STREAM_DEFAULT, attention_defines, attention_ring_default, default_threads, default_tiles,
                             gate_up_rounds_default,
                             gate_up_part_align, merge_active_default, merge_fused, merge_shape_defines,
                             stream_default)
from .llama_config import (CONFIGS, LlamaConfig, LlamaWeights, block_8b, clone_kv, config, llama_1b,  # noqa: F401
                           llama_1b_fp8, make_inputs, make_kv_cache, make_weights, relerr, rope_tables, tiny)

__all__ = ["LlamaModel", "LlamaConfig", "llama_1b", "llama_1b_fp8", "block_8b", "tiny", "config", "CONFIGS",
           "make_weights", "make_kv_cache", "default_tiles", "default_threads", "relerr"]


def _check_input(cfg: LlamaConfig, inp, n=None) -> None:
    """Refuse what the kernel would otherwise clamp, truncate or broadcast: a token id outside
    [0, vocab) or not an integer, a block input that is not d values, a step count below 0. (The value
    of a token already on a GPU is not read back: that would cost a sync per step.)"""
    import numbers
    from ..errors import InputError
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0):
        raise InputError(f"generate(n): n must be an int >= 0, got {n!r}")
    if inp is None:
        return
    if cfg.block:
        if not isinstance(inp, torch.Tensor) or inp.numel() != cfg.d or inp.dim() not in (1, 2):
            what = f"shape {tuple(inp.shape)}" if isinstance(inp, torch.Tensor) else type(inp).__name__
            raise InputError(f"block input must be a ({cfg.d},) tensor, got {what}")
        return
    tok = inp
    if isinstance(inp, torch.Tensor):
        if inp.numel() != 1 or inp.is_floating_point() or inp.is_complex() or inp.dtype == torch.bool:
            raise InputError(f"token must be one integer element, got a {inp.dtype} tensor of shape {tuple(inp.shape)}")
        if inp.device.type != "cpu":
            return
        tok = int(inp.reshape(-1)[0])
    elif isinstance(inp, bool) or not isinstance(inp, numbers.Integral):
        raise InputError(f"token must be an int id in [0, {cfg.vocab}), got {inp!r}")
    if not 0 <= int(tok) < cfg.vocab:
        raise InputError(f"token id {int(tok)} is outside the vocabulary [0, {cfg.vocab})")


class LlamaModel:
    """Weights, KV caches, device state (token, pos) and the compiled megakernel of one decoder.

    weights / kv: pass them to share with a reference (the kernel appends to `kv` in place); else they
    are generated from `seed` / `kv_seed` on `device`. init="empty" allocates without filling (compile-only
    builds of the full-size graph on a CPU). On a CPU the kernel still compiles for sm_90a, and step()
    runs the schedule in megart's emulator (each task's CPU reference, a random legal interleaving).
    """

    stream_slots_default = STREAM_DEFAULT   # MEGART_STREAM_SLOTS when the caller leaves it unset
    direct_upto_default = ATTN_DIRECT_UPTO  # tiles["attn_direct_upto"] when the caller leaves it unset
    short_attn_ring_default = True          # attention_ring_default applies (the tensor-parallel ranks: not measured)
    # the vectors between the weight-bound calls are tagged words, polled by their readers: on the H200 the
    # 1B step measured 922.5 / 923.2 us against 944.4 / 940.4 with event waits (bench/RESULTS.md)
    tagged_default = True
    # a step's launch overlaps the previous step's end (programmatic dependent launch: its weight stream starts
    # on the SMs the last step leaves, all else waits for that step). So weights stay read-only between steps
    # too: after writing one in place, call reset() before the next step (or set this False).
    overlap_steps = True

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights | None = None, kv: list | None = None, *,
                 device=None, nw: int | None = None, seed: int = 0, kv_seed: int = 1, init: str = "random",
                 tiles: dict | None = None, deps: str = "infer", kv_refs: str = "partition",
                 logits: bool = True, profile: bool = False, profile_steps: int = 16, threads: int | None = None,
                 watchdog_s: float | None = None, compile: bool = True, sm_count: int | None = None,
                 defines: dict | None = None, peers=None, attn_merge: str = "auto", tagged: bool | None = None,
                 tagged_attn: bool = False):
        if deps not in ("explicit", "infer"):
            raise ValueError(f"deps must be 'explicit' or 'infer', got {deps!r}")
        if attn_merge not in ATTN_MERGE:
            raise ValueError(f"attn_merge must be one of {ATTN_MERGE}, got {attn_merge!r}")
        width = (tiles or {}).get("attn_width")
        if width is not None and attn_merge != "direct":
            raise ValueError(f"tiles['attn_width'] (q heads per attention instance) applies to attn_merge='direct' "
                             f"only; attn_merge is {attn_merge!r}")
        if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
            raise ValueError(f"tiles['attn_width'] must be a positive integer (q heads per attention instance), "
                             f"got {width!r}")
        self.attn_width = min(DIRECT_WIDTH if width is None else width, cfg.group)   # (the direct form's)
        tagged = self.tagged_default if tagged is None else tagged
        if not isinstance(tagged, bool):
            raise ValueError(f"tagged must be True or False, got {tagged!r}")
        self.tagged = tagged
        if not isinstance(tagged_attn, bool):
            raise ValueError(f"tagged_attn must be True or False, got {tagged_attn!r}")
        if tagged_attn and not tagged:
            raise ValueError("tagged_attn=True needs tagged=True (q and the new k/v rows are tagged words)")
        self.tagged_attn = tagged_attn
        if device is None:
            device = weights.layers[0]["wqkv"].device if weights is not None else (
                "cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cfg = cfg
        self.weights = weights if weights is not None else make_weights(cfg, seed, self.device, init)
        self.kv = kv if kv is not None else make_kv_cache(cfg, kv_seed, self.device, init)
        self.pk = PersistentKernel(nw=nw, device=self.device, profile=profile, profile_steps=profile_steps,
                                   threads=default_threads(cfg) if threads is None else threads,
                                   watchdog_s=watchdog_s, sm_count=sm_count,
                                   defines={**attention_defines(cfg, attn_merge, self.attn_width),
                                            **stream_default(defines, self.stream_slots_default),
                                            **(defines or {})}, peers=peers)
        self.nw = self.pk.nw
        self.tiles = {**default_tiles(cfg, self.nw), "gate_up_rounds": gate_up_rounds_default(cfg, self.pk.threads),
                      **(tiles or {})}
        parts, most = self.tiles["gate_up_parts"], cfg.ffn // gate_up_part_align(cfg)
        if not isinstance(parts, int) or isinstance(parts, bool) or not 1 <= parts <= most:
            raise ValueError(f"tiles['gate_up_parts'] must be an integer in [1, {most}] (parts of h of "
                             f"{gate_up_part_align(cfg)}-row multiples), got {parts!r}")
        if parts > 1 and cfg.wdtype == "fp8":
            raise ValueError("tiles['gate_up_parts'] applies to the bf16 gate_up_silu; this model's weights are fp8")
        rounds = self.tiles["gate_up_rounds"]
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
            raise ValueError(f"tiles['gate_up_rounds'] must be 0 (contiguous tiles) or h's rows per gate_up instance "
                             f"per round (>= 1), got {rounds!r}")
        self.deps = deps
        self.kv_refs = kv_refs
        self.attn_merge = attn_merge
        self.with_logits = logits and not cfg.block
        self.groups: dict = {}
        self._attn_calls: list = []   # (each layer's attention call, its cache tensors): for kv_commit
        self._alloc()
        # (the chunk count _alloc sized the partials with; a macro read at compile only)
        ring = attention_ring_default(cfg, self.chunks, self.pk.kernel_config(), direct=self.attn_merge == "direct") \
            if self.short_attn_ring_default else {}
        merge = {} if self.attn_merge == "direct" else {
            **merge_shape_defines(cfg, self.chunks), **merge_active_default(cfg, self.chunks, self.tiles["attn_min_chunk"])}
        self.pk.defines = {**self.pk.defines, **check_defines({**ring, **merge}), **check_defines(defines or {})}
        self.attn_ring_short = bool(ring)   # (compile() drops it where it would not build clean)
        self._build()
        self._host = None
        self._pos_next_host = cfg.prefill      # what pos_next holds on the device (tracked, never read back)
        self._steps = 0
        if compile:
            self.compile()

    # --- buffers ------------------------------------------------------------------------------------
    def _alloc(self):
        c, dev = self.cfg, self.device
        bf, i32, f32 = torch.bfloat16, torch.int32, torch.float32
        z = lambda *shape, dtype=bf: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.pos = z(1, dtype=i32)
        self.pos_next = torch.full((1,), c.prefill, dtype=i32, device=dev)
        # stamped by pos_advance once pos is written: the weight stream's producer polls it before it loads
        # attention's K/V rows ahead (tasks/attention_decode.cuh)
        self.pos_stamp = tagged_words.empty(1, dev)
        self.cos, self.sin = rope_tables(c, dev)
        direct = self.attn_merge == "direct"   # one chunk per kv head, each q head's output written by its instance
        self.chunks = 1 if direct else attention_chunks(c.n_kv, c.max_seq, self.nw, chunks=self.tiles["attn_chunks"])
        # single-assignment residual stream: xs[l] enters layer l, xm[l] is after its attention
        # tagged (megart/tagged.py): the vectors passed between the weight-bound calls are tagged words, which
        # their readers poll instead of waiting on the writer's event; not x_in / x_out (the caller's) or the
        # embedding's output (tagged, layer 0's qkv instances all poll it from the step's start: 8 us slower on
        # the H200, bench/RESULTS.md), nor h when silu_mul writes it (fp8 "split" gate/up)
        tv = lambda n: tagged_words.empty(n, dev) if self.tagged else z(n)  # noqa: E731
        self.xs = [z(c.d) if i == 0 or (c.block and i == c.layers) else tv(c.d) for i in range(c.layers + 1)]
        self.xm = [tv(c.d) for _ in range(c.layers)]
        ta = lambda n: tagged_words.empty(n, dev) if self.tagged_attn else z(n)  # noqa: E731
        self.q = [ta(c.n_q * c.hd) for _ in range(c.layers)]
        self.kv_new = [(ta(c.n_kv * c.hd), ta(c.n_kv * c.hd)) for _ in range(c.layers)] if self.tagged_attn else None
        self.attn = [tv(c.n_q * c.hd) for _ in range(c.layers)]
        split_fp8 = c.wdtype == "fp8" and c.fp8_gate_up != "fused"
        self.h = [z(c.ffn) if split_fp8 else tv(c.ffn) for _ in range(c.layers)]
        new_rows = [t for pair in self.kv_new or () for t in pair]
        self._tagged_ptrs = {t.data_ptr() for t in (*self.xs, *self.xm, *self.attn, *self.h, *self.q, *new_rows)
                             if t.dtype == torch.int32}
        self.part_o = None if direct else [z(c.n_kv, self.chunks, c.group, c.hd, dtype=f32) for _ in range(c.layers)]
        self.part_ml = None if direct else [z(c.n_kv, self.chunks, c.group, 2, dtype=f32) for _ in range(c.layers)]
        self.merge_fused = not direct and merge_fused(self.attn_merge, c, self.chunks)
        self.arrivals = [z(c.n_kv, dtype=i32) for _ in range(c.layers)] if self.merge_fused else None
        if c.block:
            self.x_in = self.xs[0]
            self.x_out = self.xs[-1]
        else:
            self.token = z(1, dtype=i32)
            self.history = torch.full((c.max_seq,), -1, dtype=i32, device=dev)
            n_parts = min(self.tiles["lm"], c.vocab)
            self.part_val = z(n_parts, dtype=f32)
            self.part_idx = z(n_parts, dtype=i32)
            self.logits = z(c.vocab, dtype=f32)

    # --- graph --------------------------------------------------------------------------------------
    def _task(self, key: str, name: str, after: list, **kw):
        if self.deps == "explicit":
            g = self.pk.task(name, infer=False, after=[a for a in after if a is not None], label=key, **kw)
        else:
            g = self.pk.task(name, label=key, **kw)
        self.groups[key] = g
        return g

    def _tensor(self, t: torch.Tensor, name: str):
        """pk.tensor, with the word buffers _alloc made for the tagged vectors added as tagged."""
        return self.pk.tensor(t, name, tagged=t.data_ptr() in self._tagged_ptrs)

    def _build(self):
        c, W, T, tl = self.cfg, self.weights, self._tensor, self.tiles
        eps = c.eps
        pos = T(self.pos, "pos")
        g_pos = self._pos_advance(pos)
        cos, sin = T(self.cos, "rope_cos"), T(self.sin, "rope_sin")
        xs = [T(t, f"x{i}") for i, t in enumerate(self.xs)]
        if c.block:
            g_prev = None
        else:
            token = T(self.token, "token")
            table = T(W.embed, "embed")      # tied: the LM head streams this same table
            head = T(W.head, "lm_head") if c.head_separate or c.fp8_head else table
            g_prev = self._task("embedding", "embedding", [], y=xs[0], table=table, token=token,
                                tiles=tl["embedding"])
        fp8 = c.wdtype == "fp8"
        for l in range(c.layers):
            L = W.layers[l]
            p = f"L{l}."
            a, g_mrg = self._attention(l, g_prev, g_pos, xs[l], pos, cos, sin)
            xm = T(self.xm[l], p + "xm")
            # o_proj: xm = x + Wo a. The residual x was produced before qkv, so attention implies it.
            g_o = self._gemv(p + "o", L, "wo", y=xm, x=a, residual=xs[l], after=[g_mrg], tiles=tl["o"], fp8=fp8)
            h = T(self.h[l], p + "h")
            if fp8:
                g_gu = [self._gate_up_fp8(p, L, h, xm, g_o)]
            else:
                g_gu = self._gate_up_parts(p, L, h, xm, g_o, eps)
            # down: x_{l+1} = xm + Wd h. xm came from o_proj, which gate_up already waited for.
            g_prev = self._gemv(p + "down", L, "wd", y=xs[l + 1], x=h, residual=xm, after=g_gu, tiles=tl["down"],
                                fp8=fp8)
        if not c.block:
            pv, pi = T(self.part_val, "part_val"), T(self.part_idx, "part_idx")
            extra = dict(logits=T(self.logits, "logits")) if self.with_logits else {}
            if c.fp8_head:
                extra["scale"] = T(W.shead, "lm_head_scale")
            g_lm = self._task("lm_head", "lm_head_argmax_fp8" if c.fp8_head else "lm_head_argmax", [g_prev], w=head,
                              x=xs[-1], part_val=pv, part_idx=pi, norm_weight=T(W.final_norm, "final_norm"), eps=eps,
                              tiles=tl["lm"], **extra)
        self._kv_commits(pos)
        if not c.block:
            # token is read by the embedding at the step's start: that write-after-read is implied here
            # (and history[pos] = token: token_record's write, without a hop of its own at the step's end)
            self._task("argmax", "argmax_reduce", [g_lm], token=token, part_val=pv, part_idx=pi,
                       history=T(self.history, "history"), pos=pos)

    def _pos_advance(self, pos):
        """The step's first task: pos = pos_next, pos_next + 1, and pos_stamp stamped where attention's K/V come
        through the weight stream (its producer is the stamp's one reader; self._stamp, for attention)."""
        self._stamp = self.pk.tensor(self.pos_stamp, "pos_stamp", tagged=True) \
            if kv_streamed(self.pk.kernel_config()) else None
        return self._task("pos_advance", "pos_advance", [], pos=pos,
                          pos_next=self.pk.tensor(self.pos_next, "pos_next"), pos_stamp=self._stamp)

    def _kv_commits(self, pos):
        """tagged_attn: each layer's new k/v rows appended to its caches, after the layer's attention call (which
        read the caches) and off the step's critical path (after the LM head, or the last layer of a block)."""
        if not self.tagged_attn:
            return
        c = self.cfg
        for l, (g_att, caches) in enumerate(self._attn_calls):
            self._task(f"L{l}.kv_commit", "kv_commit", [g_att], **caches, pos=pos, n_kv=c.n_kv, hd=c.hd,
                       max_seq=c.max_seq)

    def _attention(self, l, g_prev, g_pos, x, pos, cos, sin, fold: dict | None = None):
        """Layer l's attention half up to its merged output: qkv (fused norm, RoPE, KV append) after g_prev
        and g_pos, attention chunks, their merge (in the attention call when fused, else a call of its own).
        Returns (the merged output, the call that writes it).
        fold (tensor parallel): qkv's x staging also sums the previous layer's down all-reduce (parts, tp,
        x_out, waits; docs/TP.md)."""
        c, L, T, tl, p = self.cfg, self.weights.layers[l], self._tensor, self.tiles, f"L{l}."
        kc, vc = self.kv[l]
        q = T(self.q[l], p + "q")
        kct, vct = T(kc, p + "k_cache"), T(vc, p + "v_cache")
        qk_norm = dict(q_norm=T(L["q_norm"], p + "q_norm"), k_norm=T(L["k_norm"], p + "k_norm")) if c.qk_norm else {}
        fp8 = dict(scale=T(L["swqkv"], p + "swqkv")) if c.fp8_qkv else {}
        new = {}
        if self.tagged_attn:   # q and the new rows as tagged words; the caches are appended by kv_commit
            kn, vn = self.kv_new[l]
            new = dict(k_new=T(kn, p + "k_new"), v_new=T(vn, p + "v_new"))
        g_qkv = self._task(p + "qkv", "qkv_rope_append_fp8" if c.fp8_qkv else "qkv_rope_append", [g_prev, g_pos],
                           q=q, k_cache=kct, v_cache=vct, w_qkv=T(L["wqkv"], p + "wqkv"), x=x, **fp8, **new,
                           norm_weight=T(L["in_norm"], p + "in_norm"), eps=c.eps, cos=cos, sin=sin, pos=pos,
                           n_q=c.n_q, n_kv=c.n_kv, hd=c.hd, kv_refs=self.kv_refs, tiles=tl["qkv"], **qk_norm,
                           **(fold or {}))
        a = T(self.attn[l], p + "attn")
        if self.attn_merge == "direct":
            g_att = self._task(p + "attn", "attention_decode", [g_qkv], q=q, k_cache=kct, v_cache=vct, pos=pos,
                               n_q=c.n_q, n_kv=c.n_kv, hd=c.hd, max_seq=c.max_seq, chunks=1, out=a,
                               width=self.attn_width, pos_stamp=self._stamp, **new)
            self._attn_calls.append((g_att, dict(k_cache=kct, v_cache=vct, **new)))
            return a, g_att
        po, pm = T(self.part_o[l], p + "part_o"), T(self.part_ml[l], p + "part_ml")
        fused = dict(out=a, arrivals=T(self.arrivals[l], p + "arrivals")) if self.merge_fused else {}
        g_att = self._task(p + "attn", "attention_decode", [g_qkv],
                           q=q, k_cache=kct, v_cache=vct, pos=pos, part_o=po, part_ml=pm, n_q=c.n_q,
                           n_kv=c.n_kv, hd=c.hd, max_seq=c.max_seq, chunks=self.chunks,
                           min_chunk=self.tiles["attn_min_chunk"], tiles=self.chunks * c.n_kv,
                           pos_stamp=self._stamp, direct_upto=self._direct_upto(), **fused, **new)
        self._attn_calls.append((g_att, dict(k_cache=kct, v_cache=vct, **new)))
        if self.merge_fused:
            return a, g_att
        g_mrg = self._task(p + "merge", "attention_merge", [g_att], out=a, part_o=po, part_ml=pm,
                           n_q=c.n_q, n_kv=c.n_kv, hd=c.hd, chunks=self.chunks, tiles=tl["merge"])
        return a, g_mrg

    def _direct_upto(self) -> int:
        """The fused attention call's switch to the direct form at short contexts: tiles["attn_direct_upto"] as
        given (0: off), else, for attn_merge="auto", direct_upto_default where the call can take it (a fused merge,
        a chunk per q head, the caches read by the body: not tagged_attn, not K/V through the stream)."""
        upto = self.tiles["attn_direct_upto"]
        if upto is not None:
            return upto
        # (groups under 4: their attention body pushes the stream build past the register cap, which "auto" declines
        # unless MEGART_QUEUE_BOUNDS_SMEM=1; the switch is not measured there)
        fits = (self.attn_merge == "auto" and self.merge_fused and not self.tagged_attn and self._stamp is None
                and 4 <= self.cfg.group <= self.chunks)
        return min(self.direct_upto_default, self.cfg.max_seq) if fits else 0

    def _attention_instances(self):
        return (inst for inst in self.pk.graph.instances if inst.type.name == "attention_decode")

    @property
    def direct_upto_auto(self) -> bool:
        """Whether the graph's attention takes the default switch (not one the caller set), which compile() may
        take back."""
        return self.tiles["attn_direct_upto"] is None and any(
            inst.params["direct_upto"] for inst in self._attention_instances())

    def _set_direct_upto(self, upto: int) -> None:
        """Every attention instance's switch length (compile()'s fallback: 0, the chunks at every length)."""
        for inst in self._attention_instances():
            inst.params["direct_upto"] = upto

    def _gemv(self, key, L, name, *, y, x, residual, after, tiles, fp8):
        p = key.rsplit(".", 1)[0] + "."
        w = self.pk.tensor(L[name], p + name)
        if fp8:
            return self._task(key, "gemv_m1_fp8", after, y=y, w=w, scale=self.pk.tensor(L["s" + name], p + "s" + name),
                              x=x, residual=residual, tiles=tiles)
        return self._task(key, "gemv_m1", after, y=y, w=w, x=x, residual=residual, tiles=tiles)

    def _gate_up_parts(self, p, L, h, xm, g_o, eps):
        """gate_up_silu as tiles["gate_up_parts"] calls over consecutive parts of h, in order (a list of the calls).
        More than one lets down begin on the first parts' pieces of h while the last part is computed, for the cost
        of staging and normalising x once more per part."""
        c, tl, T = self.cfg, self.tiles, self._tensor
        from ..tasks.tiling import even_tiles
        parts = even_tiles(c.ffn, tl["gate_up_parts"], align=gate_up_part_align(c))
        wg, wu, g = T(L["wg"], p + "wg"), T(L["wu"], p + "wu"), T(L["post_norm"], p + "post_norm")
        calls, rotate = [], 0
        for i, (lo, hi) in enumerate(parts):
            calls.append(self._task(p + ("gate_up" if i == 0 else f"gate_up{i}"), "gate_up_silu", [g_o],
                                    h=h.ref(lo, hi - lo), w_gate=wg.ref(lo * c.d, (hi - lo) * c.d),
                                    w_up=wu.ref(lo * c.d, (hi - lo) * c.d), x=xm, norm_weight=g, eps=eps,
                                    tiles=tl["gate_up"], **({"rotate": rotate} if rotate else {}), **self._rounds()))
            # the next part's larger tiles begin where this part's end, so no worker takes a row more in every part
            rotate = (rotate + (hi - lo) % tl["gate_up"]) % tl["gate_up"]
        return calls

    def _rounds(self) -> dict:
        """gate_up's row dealing: tiles["gate_up_rounds"] rows per instance per round, or contiguous tiles."""
        return {"rounds": self.tiles["gate_up_rounds"]} if self.tiles["gate_up_rounds"] else {}

    def _gate_up_fp8(self, p, L, h, xm, g_o):
        """cfg.fp8_gate_up "split": one gemv_m1_fp8 over the stacked [2 ffn, d] gate|up matrix (fused
        post-attention norm) into gu, then silu_mul(h, gu[:ffn], gu[ffn:]); "fused": gate_up_silu_fp8 over the
        same rows and scales (gate and up in fp32, never stored)."""
        c, T = self.cfg, self.pk.tensor
        if c.fp8_gate_up == "fused":
            wgu, swgu = T(L["wgu"], p + "wgu"), T(L["swgu"], p + "swgu")
            return self._task(p + "gate_up", "gate_up_silu_fp8", [g_o], h=h, w_gate=wgu.ref(0, c.ffn * c.d),
                              w_up=wgu.ref(c.ffn * c.d, c.ffn * c.d), s_gate=swgu.ref(0, c.ffn),
                              s_up=swgu.ref(c.ffn, c.ffn), x=xm, norm_weight=T(L["post_norm"], p + "post_norm"),
                              eps=c.eps, tiles=self.tiles["gate_up"], **self._rounds())
        gu = torch.zeros(2 * c.ffn, dtype=torch.bfloat16, device=self.device)
        self.gu = getattr(self, "gu", []) + [gu]
        gut = T(gu, p + "gu")
        g_gu = self._task(p + "gate_up_gemv", "gemv_m1_fp8", [g_o], y=gut, w=T(L["wgu"], p + "wgu"),
                          scale=T(L["swgu"], p + "swgu"), x=xm, norm_weight=T(L["post_norm"], p + "post_norm"),
                          eps=c.eps, tiles=self.tiles["gate_up"])
        return self._task(p + "gate_up", "silu_mul", [g_gu], h=h, g=gut.ref(0, c.ffn), u=gut.ref(c.ffn, c.ffn),
                          tiles=self.tiles["silu_mul"])

    # --- compile / run ------------------------------------------------------------------------------
    def compile(self) -> "LlamaModel":
        self.pk.compile()
        if self.direct_upto_auto and (self.pk.stream_declined or self.pk.stream_shallower is not None):
            # the switch compiles a second attention body (one q head) beside the chunks' and their merge, which can
            # tip a kernel at the edge of its registers into a spill that even "auto"'s retry with the queue bounds in
            # shared memory keeps (1b_fp8_split's 36 bytes no longer do): there the weight stream is worth more
            self._set_direct_upto(0)
            self.pk.compile()
        if self.attn_ring_short and (self.pk.stream_declined or self.pk.stream_shallower is not None):
            # the 32 KB attention ring is there to buy a deeper weight ring; where that build spilled or did
            # not fit, the default ring (and the stream "auto" sizes beside it) is the better kernel
            self.pk.defines = {k: v for k, v in self.pk.defines.items() if k != "MEGART_ATTN_RING_BYTES"}
            self.attn_ring_short = False
            self.pk.compile()
        if self.device.type == "cpu":
            self._host = {name: t.data for name, t in self.pk.graph.tensors.items()}
        return self

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def reset(self, pos: int | None = None, token: int | None = None, clear_kv: bool = False) -> None:
        """Set the device state: the next step runs at `pos` (default: cfg.prefill) with input `token`.
        clear_kv zeroes every cache row >= pos (rows a previous run appended)."""
        pos = self.cfg.prefill if pos is None else int(pos)
        if not 0 <= pos < self.cfg.max_seq:
            raise ValueError(f"pos {pos} outside [0, {self.cfg.max_seq})")
        if self.on_gpu:
            self.pk.order_next_launch()   # (weights written before a reset are streamed after it)
        self.pos_next.fill_(pos)
        self._pos_next_host = pos
        if token is not None and not self.cfg.block:
            self.token.fill_(int(token))
        if clear_kv:
            for k, v in self.kv:
                k[:, pos:].zero_()
                v[:, pos:].zero_()

    @property
    def next_pos(self) -> int:
        return self._pos_next_host

    def _run_one(self) -> None:
        if self._pos_next_host >= self.cfg.max_seq:
            raise ValueError(f"the KV cache is full: pos {self._pos_next_host} >= max_seq {self.cfg.max_seq}")
        if self.on_gpu:
            self.pk.launch(overlap=self.overlap_steps)
        else:
            self.pk.emulate(1, seed=self._steps, host=self._host)
        self._pos_next_host += 1
        self._steps += 1

    def step(self, inp=None, pos: int | None = None):
        """One decode step: ONE kernel launch, nothing else when `inp` is None (the LM then reads the token
        the previous step fed back; a block reads `x_in` as it is) and `pos` is None or the position the
        device is at. LM: inp is a token id (int or tensor); returns (logits f32 [vocab], token i32 [1]),
        the kernel's own buffers (overwritten by the next step). Block: inp is x (d,) bf16 (copied into
        x_in unless it is x_in); returns x_out (d,) bf16 (also a kernel buffer). No host sync on a GPU:
        call sync() (or read a result) to wait and to surface a watchdog error."""
        c = self.cfg
        _check_input(c, inp)
        if pos is not None and int(pos) != self._pos_next_host:
            self.reset(pos)
        if inp is not None:
            if c.block:
                x = inp.reshape(-1)
                if x.data_ptr() != self.x_in.data_ptr():
                    self.x_in.copy_(x)
            elif isinstance(inp, torch.Tensor):
                self.token.copy_(inp.reshape(-1)[:1].to(self.token.dtype))
            else:
                self.token.fill_(int(inp))
        self._run_one()
        if c.block:
            return self.x_out
        return (self.logits if self.with_logits else None), self.token

    def generate(self, n: int, token: int | None = None, pos: int | None = None) -> torch.Tensor:
        """Greedy decoding of n steps: n launches back to back (the kernel advances pos and feeds the
        argmax back itself), one sync at the end. Returns the n generated token ids (i32, on the device)."""
        if self.cfg.block:
            raise ValueError("generate() needs an LM head; a block has step(x, pos) only")
        _check_input(self.cfg, token, n=n)
        if pos is not None or token is not None:
            self.reset(self._pos_next_host if pos is None else pos, token)
        start = self._pos_next_host
        if start + n > self.cfg.max_seq:
            raise ValueError(f"{n} steps from pos {start} overrun max_seq {self.cfg.max_seq}")
        for _ in range(n):
            self._run_one()
        self.sync()
        return self.history[start:start + n]

    def sync(self) -> None:
        if self.on_gpu:
            self.pk.check()

    # --- introspection ------------------------------------------------------------------------------
    def bytes_per_step(self, pos: int | None = None) -> int:
        return self.cfg.bytes_per_step(pos)

    def instances(self) -> dict:
        """Instances per call label (one step)."""
        return {k: len(g.uids) for k, g in self.groups.items()}

    def call_kind(self, label: str) -> str:
        """'L3.gate_up' -> 'gate_up' (the per-layer calls of one kind are summed in breakdowns)."""
        return call_kind(label)

    def call_index(self, n_uid: int = 0):
        """(the call labels, in graph order; an int64 array mapping an instance uid to its call's position in
        them, -1 for an instance of no call), covering uids below max(n_uid, the graph's instance count)."""
        return call_index(self.groups, len(self.pk.graph.instances), n_uid)

    def call_breakdown(self, prof) -> list:
        """Per call kind, summed over layers, medians over the profiled steps (megart/models/call_breakdown.py)."""
        return call_breakdown(self.groups, self.nw, prof)

    def describe(self) -> str:
        c = self.cfg
        n = len(self.pk.graph.instances)
        return (f"{c.name}: {c.layers} layers, d {c.d}, ffn {c.ffn}, {c.n_q}/{c.n_kv} heads x {c.hd}, "
                f"vocab {c.vocab or '-'}, {c.wdtype}; nw {self.nw}, {n} instances/step, "
                f"{self.chunks} KV chunks/head, {math.ceil(c.bytes_per_step() / 1e6)} MB/step")
