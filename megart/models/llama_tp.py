"""A Llama decoder split over the GPUs of one host (tensor parallel, Megatron style; docs/TP.md).

Every rank runs its own persistent megakernel over its shard, one launch per step; the ranks exchange
partial sums inside the kernels through peer events (no host work, no NCCL call per step):

    qkv_rope_append, attention, merge       this rank's q heads and kv heads (column-parallel by heads); with
                                            attn_chunks="match" each kv head in TP=1's KV chunks (same bits)
    o_proj gemv_partial -> slot r           row-parallel: a d-sized f32 partial in this rank's slot; at TP=2
                                            each instance also stores its rows into the peer's slot r and
                                            signals the peer event there (system scope)
    peer_copy slot r -> each peer's slot r  (TP > 2) then signals the peer event on that peer
    tp_sum_f32 (waits the peer event)       x = residual + slot 0 + ... + slot tp-1, one bf16 rounding
                                            (same bits on every rank)
    gate_up_silu                            this rank's ffn columns (column-parallel)
    down gemv_partial / peer_copy / tp_sum_f32   as o_proj
    lm_head_argmax on vocab rows [r V/tp, (r+1) V/tp), partials to every peer, tp_argmax_reduce (global id)

The embedding table is replicated (one row is read per step); every rank feeds the same argmax back.

    peers = HostPeers(2)                                  # CPU: both ranks in this process
    group = LlamaTPGroup(cfg, world=2, nw=16)             # seeded weights, sharded; emulated jointly
    logits, token = group.step(token=7)

On GPUs each process builds its rank: LlamaTPRank(cfg, W, kv, peers=SymmetricPeers()) (scripts/tp_run.sh).
"""
from __future__ import annotations

import torch

from ..errors import GraphError
from .llama import LlamaModel, default_tiles
from .llama_config import LlamaConfig, LlamaWeights, make_kv_cache, make_weights


def shard_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """One rank's layer shapes (heads and ffn split; d, vocab of the embedding and max_seq kept)."""
    for what, n in (("n_kv (kv heads)", cfg.n_kv), ("ffn", cfg.ffn), ("vocab", cfg.vocab)):
        if n % world:
            raise GraphError(f"tensor parallel over {world} ranks needs {what} = {n} divisible by {world}")
    if cfg.block:
        raise GraphError("tensor parallel needs an LM (vocab > 0); a bare block has no head to split")
    if cfg.wdtype != "bf16":
        raise GraphError(f"tensor parallel runs bf16 weights; {cfg.wdtype!r} is not split yet")
    return cfg.with_(name=f"{cfg.name}_tp{world}", n_q=cfg.n_q // world, n_kv=cfg.n_kv // world,
                     ffn=cfg.ffn // world)


def shard_weights(W: LlamaWeights, rank: int, world: int) -> LlamaWeights:
    """Rank `rank`'s slices (contiguous copies) of the full weights: q/k/v rows of its heads, o_proj columns
    of its q heads, gate/up rows and down columns of its ffn slice, LM-head rows of its vocab slice."""
    c = W.cfg
    lc = shard_config(c, world)
    hq, hk, f, v = lc.n_q * c.hd, lc.n_kv * c.hd, lc.ffn, c.vocab // world
    out = LlamaWeights(lc)
    for L in W.layers:
        q0, k0, v0 = rank * hq, c.n_q * c.hd + rank * hk, (c.n_q + c.n_kv) * c.hd + rank * hk
        wqkv = L["wqkv"]
        S = {k: t for k, t in L.items() if k in ("in_norm", "post_norm", "q_norm", "k_norm")}
        S["wqkv"] = torch.cat([wqkv[q0:q0 + hq], wqkv[k0:k0 + hk], wqkv[v0:v0 + hk]]).contiguous()
        S["wo"] = L["wo"][:, rank * hq:(rank + 1) * hq].contiguous()
        S["wg"] = L["wg"][rank * f:(rank + 1) * f].contiguous()
        S["wu"] = L["wu"][rank * f:(rank + 1) * f].contiguous()
        S["wd"] = L["wd"][:, rank * f:(rank + 1) * f].contiguous()
        out.layers.append(S)
    out.final_norm = W.final_norm
    out.embed = W.embed                                   # replicated
    out.head = W.head[rank * v:(rank + 1) * v].contiguous()
    return out


def empty_shard(cfg: LlamaConfig, world: int, device="cpu") -> tuple:
    """Unfilled shard-shaped weights and KV cache (compile-only builds of a full-size rank on a CPU)."""
    lc = shard_config(cfg, world)
    W = make_weights(lc, init="empty", device=device)
    W.head = W.head[:cfg.vocab // world]
    return W, make_kv_cache(lc, device=device, init="empty")


ATTN_CHUNKS = ("local", "match")


def rank_attention_chunks(cfg: LlamaConfig, world: int, nw: int, how: str = "match") -> int:
    """KV chunks per kv head of a rank's attention. "match" (the default): as many as the single-GPU model
    of the full shape uses on nw workers (nw // n_kv), so each kv head's chunks cover the same positions and
    merge in the same f32 order as at TP=1 (the same bits from the same q and cache). "local": nw // the
    rank's kv heads, every worker busy in attention, but twice the chunks to merge. On 2 H200s (8B shape)
    "match" measured 3,118.5 us per TP=2 step against "local"'s 3,283.1 (bench/RESULTS.md)."""
    if how not in ATTN_CHUNKS:
        raise GraphError(f"attn_chunks must be one of {ATTN_CHUNKS}, got {how!r}")
    return default_tiles(cfg if how == "match" else shard_config(cfg, world), nw)["attn_chunks"]


def shard_kv(kv: list, cfg: LlamaConfig, rank: int, world: int) -> list:
    h = cfg.n_kv // world
    return [(k[rank * h:(rank + 1) * h].clone(), vv[rank * h:(rank + 1) * h].clone()) for k, vv in kv]


FOLDS = ("o", "down")   # the all-reduces a rank can sum in its next weight-bound call's x staging


def fold_set(fold_sums) -> tuple:
    """LlamaTPRank(fold_sums=): True (both, the default), False (neither) or a collection of FOLDS. "o":
    o_proj's all-reduce summed by gate_up; "down": down's summed by the next layer's qkv (the last layer's
    stays a tp_sum_f32 call before the LM head)."""
    if fold_sums is True or fold_sums is False:
        return FOLDS if fold_sums else ()
    if isinstance(fold_sums, str) or not all(isinstance(f, str) for f in fold_sums) or not set(fold_sums) <= set(FOLDS):
        raise GraphError(f"fold_sums takes True, False or a collection of {FOLDS}, got {fold_sums!r}")
    return tuple(f for f in FOLDS if f in fold_sums)


class LlamaTPRank(LlamaModel):
    """Rank `peers.rank` of a tensor-parallel decoder. `weights` / `kv` are the FULL model's (sharded here;
    the shards are copies, so the caller may free the full ones); cfg is the full config. step() returns
    this rank's logits slice (vocab rows [rank V/world, (rank+1) V/world)) and the shared token.
    attn_chunks: "match" or "local" (rank_attention_chunks); tiles={"attn_chunks": n} overrides both."""

    # the weight stream, as for the single-GPU model ("auto"): on 2 H200s (8B shape, "match" chunks) a TP=2
    # step measured 2,960.0 us with it against 3,118.5 with registers (bench/RESULTS.md)
    stream_slots_default = LlamaModel.stream_slots_default
    short_attn_ring_default = False   # (attention's 32 KB ring for short chunks was measured on one GPU only)
    direct_upto_default = 0           # (so was attention's switch to the direct form at short contexts)
    # (a rank's graph adds its vectors as plain bf16 tensors and sums partials into them: not tagged yet)
    tagged_default = False
    # each launch waits for the previous one: overlapped launches (LlamaModel.overlap_steps) have not run on two
    # GPUs yet (the two-GPU machine was not lent since they were built)
    overlap_steps = False

    def __init__(self, cfg: LlamaConfig, weights: LlamaWeights, kv: list, *, peers, device=None,
                 nw: int | None = None, tiles: dict | None = None, attn_chunks: str = "match", fold_sums=True,
                 **kw):
        if kw.get("deps", "explicit") != "explicit" or kw.get("kv_refs", "partition") != "partition":
            raise GraphError("LlamaTPRank builds explicit dependencies only (deps='explicit')")
        if kw.get("tagged"):
            raise GraphError("LlamaTPRank does not take tagged=True: a rank's vectors are plain bf16 (docs/TP.md)")
        self.full_cfg, self.rank, self.world, self.peers = cfg, peers.rank, peers.world, peers
        self.fold_sums = fold_set(fold_sums)
        lc = shard_config(cfg, self.world)
        rank_attention_chunks(cfg, self.world, 1, attn_chunks)          # (refuses an unknown mode early)
        self.attn_chunks = attn_chunks if "attn_chunks" not in (tiles or {}) else "tiles"
        if (tiles or {}).get("gate_up_parts", 1) != 1:
            raise ValueError("tiles['gate_up_parts'] applies to the one-GPU model; a rank's gate_up folds the all-reduce")
        if (tiles or {}).get("gate_up_rounds", 0) != 0:
            raise ValueError("tiles['gate_up_rounds'] applies to the one-GPU model; a rank's gate_up folds the all-reduce")
        # already this rank's shards (empty_shard, or a loader that shards on the way in): taken as they are
        W = weights if weights.cfg == lc else shard_weights(weights, self.rank, self.world)
        shard = kv if kv[0][0].shape[0] == lc.n_kv else shard_kv(kv, cfg, self.rank, self.world)
        kw["deps"] = "explicit"  # (LlamaModel infers by default; a rank graph declares its edges)
        super().__init__(lc, W, shard, device=device, nw=nw, tiles=tiles, peers=peers, **kw)

    @property
    def vocab_slice(self) -> tuple:
        v = self.full_cfg.vocab // self.world
        return self.rank * v, (self.rank + 1) * v

    # --- buffers ------------------------------------------------------------------------------------
    def _alloc(self):
        if self.attn_chunks != "tiles":    # (self.nw is known only now: LlamaModel asks the kernel)
            self.tiles["attn_chunks"] = rank_attention_chunks(self.full_cfg, self.world, self.nw, self.attn_chunks)
        super()._alloc()
        c, P = self.cfg, self.peers
        self.tiles = {"put": max(1, min(8, c.d // 512)), "sum": max(1, min(self.nw, c.d // 256)),
                      **self.tiles}
        v = c.vocab // self.world
        self.n_parts = min(self.tiles["lm"], v)
        self.logits = torch.zeros(v, dtype=torch.float32, device=self.device)
        for l in range(c.layers):
            for k in ("o", "down"):
                P.declare(f"L{l}.{k}", self.world * c.d, torch.float32)
        P.declare("lm", self.world * 2 * self.n_parts, torch.int32)
        P.allocate()

    # --- graph --------------------------------------------------------------------------------------
    def _build(self):
        c, W, T, tl = self.cfg, self.weights, self.pk.tensor, self.tiles
        eps, r = c.eps, self.rank
        pos = T(self.pos, "pos")
        g_pos = self._pos_advance(pos)
        cos, sin = T(self.cos, "rope_cos"), T(self.sin, "rope_sin")
        xs = [T(t, f"x{i}") for i, t in enumerate(self.xs)]
        token = T(self.token, "token")
        g_prev = self._task("embedding", "embedding", [], y=xs[0], table=T(W.embed, "embed"), token=token,
                            tiles=tl["embedding"])
        down = None     # layer l-1's down partial when this layer's qkv sums it: (exchange buffer, call, event, xm)
        for l in range(c.layers):
            L = W.layers[l]
            p = f"L{l}."
            if down is None:
                a, g_mrg = self._attention(l, g_prev, g_pos, xs[l], pos, cos, sin)
            else:   # qkv stages xm + the ranks' down partials and stores that sum, x_{l}, piece by piece
                red, g_dn, ev, xm_prev = down
                a, g_mrg = self._attention(l, g_dn, g_pos, xm_prev, pos, cos, sin,
                                           fold=dict(parts=red, tp=self.world, x_out=xs[l], waits=[ev]))
            xm = T(self.xm[l], p + "xm")
            h = T(self.h[l], p + "h")
            gate_up = dict(h=h, w_gate=T(L["wg"], p + "wg"), w_up=T(L["wu"], p + "wu"),
                           norm_weight=T(L["post_norm"], p + "post_norm"), eps=eps, tiles=tl["gate_up"])
            if "o" in self.fold_sums:   # o_proj's all-reduce summed in gate_up's x staging: one call fewer
                red, g_mv, ev = self._partials(p + "o", T(L["wo"], p + "wo"), a, [g_mrg], tl["o"])
                g_gu = self._task(p + "gate_up", "gate_up_silu", [g_mv], waits=[ev], x=xs[l], parts=red,
                                  tp=self.world, x_out=xm, **gate_up)
            else:
                g_o = self._all_reduce(p + "o", T(L["wo"], p + "wo"), a, xs[l], xm, [g_mrg], tl["o"])
                g_gu = self._task(p + "gate_up", "gate_up_silu", [g_o], x=xm, **gate_up)
            if "down" in self.fold_sums and l + 1 < c.layers:
                red, g_dn, ev = self._partials(p + "down", T(L["wd"], p + "wd"), h, [g_gu], tl["down"])
                down = (red, g_dn, ev, xm)
            else:
                g_prev = self._all_reduce(p + "down", T(L["wd"], p + "wd"), h, xm, xs[l + 1], [g_gu], tl["down"])
                down = None
        # vocab-parallel head: this rank's rows, its partials to every peer, the argmax over all of them
        n, words = self.n_parts, 2 * self.n_parts
        lm = self.peers.local("lm")
        lm_w, lm_f = T(lm, "lm_parts"), T(lm.view(torch.float32), "lm_parts_f32")
        g_lm = self._task("lm_head", "lm_head_argmax", [g_prev], w=T(W.head, "lm_head"), x=xs[-1],
                          part_val=lm_f.ref(r * words, n), part_idx=lm_w.ref(r * words + n, n),
                          norm_weight=T(W.final_norm, "final_norm"), eps=eps, tiles=tl["lm"],
                          **(dict(logits=T(self.logits, "logits")) if self.with_logits else {}))
        ev = self.pk.peer_event("lm")
        for q in self._peers():
            dst = T(self.peers.remote(q, "lm"), f"lm_parts@{q}")
            self._task(f"lm_put{q}", "peer_copy", [g_lm], dst=dst.ref(r * words, words),
                       src=lm_w.ref(r * words, words), signals=[ev.to(q)], tiles=1)
        g_am = self._task("argmax", "tp_argmax_reduce", [g_lm], waits=[ev], token=token, parts=lm_w, n=n,
                          tp=self.world, vocab_per_rank=self.full_cfg.vocab // self.world)
        self._task("token_record", "token_record", [g_am],
                   history=T(self.history, "history"), token=token, pos=pos)

    def _peers(self):
        return [q for q in range(self.world) if q != self.rank]

    def _partials(self, key, w, x, after, tiles):
        """This rank's f32 partial W_rank x_rank into its slot of the exchange buffer, and the slot copied into
        every peer's buffer (then the peer event there). Returns (the exchange buffer, the partial's call,
        the peer event): the sum may run once that call is done and the event counts every peer's slot."""
        d, r, T = self.cfg.d, self.rank, self.pk.tensor
        buf = self.peers.local(key)
        red = T(buf, key + ".red")
        ev = self.pk.peer_event(key)
        if self.world == 2:       # the GEMV pushes its rows to the one peer itself and signals it there
            q = self._peers()[0]
            dst = T(self.peers.remote(q, key), f"{key}.red@{q}")
            g_mv = self._task(key, "gemv_partial", after, y=red.ref(r * d, d), peer=dst.ref(r * d, d), w=w, x=x,
                              tiles=tiles, signals=[ev.to(q)])
            return red, g_mv, ev
        words = T(buf.view(torch.int32), key + ".red_w")
        g_mv = self._task(key, "gemv_partial", after, y=red.ref(r * d, d), w=w, x=x, tiles=tiles)
        for q in self._peers():
            dst = T(self.peers.remote(q, key).view(torch.int32), f"{key}.red@{q}")
            self._task(f"{key}.put{q}", "peer_copy", [g_mv], dst=dst.ref(r * d, d),
                       src=words.ref(r * d, d), signals=[ev.to(q)], tiles=self.tiles["put"])
        return red, g_mv, ev

    def _all_reduce(self, key, w, x, residual, out, after, tiles):
        """out = residual + sum over ranks of W_rank x_rank: the partials (above), then the sum, rounded to bf16
        once, when every peer's slot has landed here."""
        red, g_mv, ev = self._partials(key, w, x, after, tiles)
        return self._task(key + ".sum", "tp_sum_f32", [g_mv], waits=[ev], y=out, parts=red, residual=residual,
                          tp=self.world, tiles=self.tiles["sum"])

    # --- run ----------------------------------------------------------------------------------------
    def _run_one(self) -> None:
        if not self.on_gpu:
            raise GraphError("a CPU rank runs only with its peers: LlamaTPGroup.step() emulates them together")
        super()._run_one()

    def bytes_per_step(self, pos: int | None = None) -> int:
        """Bytes this rank reads per step: its weight shards (the head's vocab slice) and its kv heads."""
        c, fc = self.cfg, self.full_cfg
        per_layer = (c.qkv_rows * c.d + c.d * c.n_q * c.hd + 3 * c.ffn * c.d) * 2 + 2 * c.d * 2
        head = fc.vocab // self.world * c.d * 2 + c.d * 2
        return c.layers * per_layer + head + c.kv_bytes(pos)


def reset_group(model: LlamaTPRank) -> None:
    """After a HangError on any rank: every rank calls this (collective). Waits until no rank's kernel
    still runs, then zeroes this rank's counters and step, so every rank starts again from step 1 together."""
    model.peers.barrier()
    model.pk._rt.reset_after_abort()
    model.peers.barrier()


class LlamaTPGroup:
    """Every rank of a tensor-parallel decoder in one process, on the CPU: built over HostPeers and run by
    the joint emulator (megart.emulate.ranks). step() returns the whole vocabulary's logits (the ranks'
    slices in order) and the token all ranks agreed on."""

    def __init__(self, cfg: LlamaConfig, world: int, weights: LlamaWeights | None = None, kv: list | None = None,
                 *, nw: int = 16, seed: int = 0, kv_seed: int = 1, tiles: dict | None = None, **kw):
        from ..peer_memory import HostPeers
        from ..verify import verify_ranks
        weights = weights if weights is not None else make_weights(cfg, seed)
        kv = kv if kv is not None else make_kv_cache(cfg, kv_seed)
        self.cfg, self.world = cfg, world
        self.peers = HostPeers(world)
        self.ranks = [LlamaTPRank(cfg, weights, kv, peers=self.peers.rank(r), device="cpu", nw=nw,
                                  tiles=tiles, **kw) for r in range(world)]
        verify_ranks([m.pk.schedule for m in self.ranks])
        self._steps = 0

    def step(self, token: int | None = None):
        from ..emulate.ranks import emulate_ranks
        if token is not None:
            for m in self.ranks:
                m.token.fill_(int(token))
        emulate_ranks([m.pk for m in self.ranks], 1, seed=self._steps)
        for m in self.ranks:
            m._pos_next_host += 1
            m._steps += 1
        self._steps += 1
        tok = self.ranks[0].token
        for m in self.ranks[1:]:
            if not torch.equal(m.token, tok):
                raise AssertionError(f"ranks disagree on the token: {[int(x.token) for x in self.ranks]}")
        return torch.cat([m.logits for m in self.ranks]), tok
