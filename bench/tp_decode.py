"""Tensor-parallel decode of the Llama-3.1-8B shape on the GPUs of one host (docs/TP.md).

    scripts/tp_run.sh bench/tp_decode.py --out bench/results/tp_decode.json     (one process per GPU)
    scripts/tp_run.sh bench/tp_decode.py --profile --out ...                     (+ where the time goes)

All in one run, every figure measured here:
* tp1_us     single-GPU megart step (rank 0's GPU, the others idle), median us/step
* tp2_us     TP=2 megart step: each rank one launch per step, all-reduces as peer events inside the kernels
* floor_us_per_gpu  bytes one rank reads per step (its weight shards + its KV heads) / the HBM read
             bandwidth measured on that GPU in this run (the larger over ranks)
* torch_tp2_graphed_us  the same sharded model in PyTorch, each rank's step one CUDA graph with NCCL
             all-reduces (o_proj, down) and an all-gather of the LM-head argmax partials
* allreduce_inkernel_us / allreduce_nccl_graphed_us  one all-reduce of a d-sized bf16 vector: a chain of
             R all-reduces (peer_copy + tp_sum) in one megakernel launch / R NCCL all-reduces in one graph
* relerr     TP=2 logits vs single-GPU megart, max over a 100-step greedy run (the single-GPU run's tokens
             are fed to both, so every step compares the same input); token_agreement counts the steps whose
             TP=2 argmax equals the single-GPU token
* relerr_tp1_ref / relerr_tp2_ref  TP=1 and TP=2 logits, each against the PyTorch reference fed the same
             tokens (megart.models.reference, "bf16" precision: what the single-GPU gate of 3e-2 is measured
             against); each relerr also has its _median, and relerr_per_step lists all three per step
* tp2_unfolded_us  (--compare-unfolded) the TP=2 step again with the all-reduces as tp_sum_f32 calls of their
             own (LlamaTPRank(fold_sums=False)) instead of summed in the next call's x staging (the default:
             o_proj's in gate_up's, down's in the next layer's qkv's)
* tp2_folds_us  (--compare-folds "o;down;") the TP=2 step with each listed fold set (comma-separated FOLDS
             names; empty: none), keyed by the set
* kv_chunks_per_head  a rank's attention chunks (--attn-chunks match: TP=1's, the default; local: the old split)
* profile    (--profile, last, after every timed figure, in builds of their own) per rank, the profiled TP step per
             call kind summed over layers (wall, slowCTA, sumCTA, wait; bytes and their floor), and rank 0's
             profiled TP=1 step the same way; `profile.table` lines them up. --spans DIR keeps the raw records.
Only rank 0 writes the JSON (--out); figures are printed by every rank to stderr.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_decode import Timer, hbm_bandwidth, profiled_steps, run_chunked  # noqa: E402

import megart  # noqa: E402
from megart.models import llama  # noqa: E402
from megart.models.llama_config import clone_kv  # noqa: E402
from megart.models.llama_tp import ATTN_CHUNKS, LlamaTPRank, shard_config, shard_kv, shard_weights  # noqa: E402
from megart.models.reference import Reference  # noqa: E402
from megart.peer_memory import SymmetricPeers, init_process_group  # noqa: E402

RANK = 0


def log(*a):
    print(f"[rank {RANK}]", *a, file=sys.stderr, flush=True)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


# --- megart -------------------------------------------------------------------------------------------
def time_model(m, timer, n) -> list[float]:
    room = m.cfg.max_seq - m.cfg.prefill
    return run_chunked(timer, m.step, n, room, lambda: m.reset(m.cfg.prefill, 3), warmup=5)


def time_tp(m, timer, n) -> list[float]:
    def before():
        m.reset(m.cfg.prefill, 3)
        m.peers.barrier()
    out = []
    room = m.cfg.max_seq - m.cfg.prefill
    while len(out) < n:
        k = min(room - 5, n - len(out))
        out += timer.steps(m.step, k, warmup=5, before=before)
    m.sync()
    return out


# --- all-reduce of one d-sized bf16 vector -------------------------------------------------------------
def allreduce_chain(d, rounds, dev, nw):
    """One kernel: x_{i+1} = all-reduce(x_i), R times; each round peer_copy + tp_sum into the next slot."""
    peers = SymmetricPeers(device=dev)
    for i in range(rounds + 1):
        peers.declare(f"r{i}", peers.world * d, torch.bfloat16)
    peers.allocate()
    pk = megart.PersistentKernel(nw=nw, device=dev, peers=peers)
    r, half = peers.rank, d // 2
    peers.local("r0").fill_(1.0 / 1024)
    tensors = {}

    def T(name, t):
        if name not in tensors:
            tensors[name] = pk.tensor(t, name)
        return tensors[name]

    prev = None
    for i in range(rounds):
        buf = peers.local(f"r{i}")
        red, words = T(f"r{i}", buf), T(f"r{i}w", buf.view(torch.int32))
        ev = pk.peer_event(f"r{i}")
        after = [prev] if prev is not None else []
        for q in range(peers.world):
            if q != r:
                dst = T(f"r{i}@{q}", peers.remote(q, f"r{i}").view(torch.int32))
                pk.task("peer_copy", infer=False, after=after, dst=dst.ref(r * half, half),
                        src=words.ref(r * half, half), signals=[ev.to(q)], tiles=8)
        y = T(f"r{i + 1}", peers.local(f"r{i + 1}")).ref(r * d, d)
        prev = pk.task("tp_sum", infer=False, after=after, waits=[ev], y=y, parts=red, tp=peers.world, tiles=16)
    pk.compile()
    return pk


def time_kernel(pk, timer, n) -> list[float]:
    return timer.steps(pk.launch, n, warmup=5)


def time_nccl_allreduce(d, rounds, dev, timer, n) -> float:
    x = torch.full((d,), 1.0 / 1024, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):   # (NCCL's watchdog thread polls events)
        for _ in range(rounds):
            dist.all_reduce(x)
    dist.barrier()
    out = timer.steps(g.replay, n, warmup=3)
    return med(out) / rounds


# --- torch TP=2 baseline ------------------------------------------------------------------------------
class TorchTP(Reference):
    """The rank's shard in PyTorch ("torch" precision), NCCL all-reduce after o_proj and down, argmax over
    ranks by an all-gather of (max, index) partials. decode_step_ is graph-capturable."""

    def __init__(self, lc, W, kv, world, vocab_per_rank, rank):
        super().__init__(lc, W, kv, precision="torch")
        self.world, self.vpr, self.rank = world, vocab_per_rank, rank

    def _mlp_and_residuals(self, lw, x, a):
        o = self._lin(a, lw["wo"])
        dist.all_reduce(o)
        x = (x.float() + o.float()).to(self.dt)
        h = self._norm(x, lw["post_norm"])
        m = (F.silu(self._lin(h, lw["wg"]).float()) * self._lin(h, lw["wu"]).float()).to(self.dt)
        dn = self._lin(m, lw["wd"])
        dist.all_reduce(dn)
        return (x.float() + dn.float()).to(self.dt)

    def _pick_token_(self, logits, token):
        logits = logits.float()
        val, idx = logits.max(dim=-1, keepdim=True)
        part = torch.stack([val, (idx + self.rank * self.vpr).float()])   # (exact: ids < 2^24)
        parts = torch.empty(self.world * 2, 1, device=part.device)
        dist.all_gather_into_tensor(parts, part)
        parts = parts.view(self.world, 2)
        best = torch.argmax(parts[:, 0], dim=0, keepdim=True)        # (no host sync: capturable)
        token.copy_(parts[:, 1].index_select(0, best).long())
        return logits


def time_torch_tp(cfg, lc, Ws, kvs, world, rank, timer, n) -> float:
    dev = Ws.layers[0]["wqkv"].device
    ref = TorchTP(lc, Ws, kvs, world, cfg.vocab // world, rank)
    pos = torch.tensor([cfg.prefill], dtype=torch.int64, device=dev)
    token = torch.tensor([3], dtype=torch.int64, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            ref.decode_step_(token, pos)
    torch.cuda.current_stream().wait_stream(s)
    pos.fill_(cfg.prefill)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):   # (NCCL's watchdog thread polls events)
        ref.decode_step_(token, pos)

    def reset():
        pos.fill_(cfg.prefill)
        torch.cuda.synchronize()
        dist.barrier()
    out = run_chunked(timer, g.replay, n, cfg.max_seq - cfg.prefill, reset)
    del g
    return med(out)


# --- correctness over a greedy run --------------------------------------------------------------------
REF_GATE = 3e-2     # the single-GPU gate against the reference (tests/gpu/test_llama_gpu.py TOL, "bf16" precision)


def greedy_tp1(one, ref, cfg, start, steps, budget=None):
    """The single-GPU model greedily from token `start` at cfg.prefill; the reference (or None) fed the same
    tokens at the same positions. `budget` ({name: Reference}): the error budget's implementations, fed the same
    tokens. Returns (each step's input token, TP=1's tokens, its logits, the reference's, {name: each step's
    relerr of that implementation against the reference}, empty without a budget)."""
    one.reset(cfg.prefill, start, clear_kv=True)
    ins, toks, l1, lr = [], [], [], []
    errs = {k: [] for k in (budget or {})}
    t = start
    for s in range(steps):
        lg, tok = one.step(t)
        l1.append(lg.clone())
        if ref is not None:
            lr.append(ref.step(t, cfg.prefill + s).float())
            for k, r in (budget or {}).items():
                errs[k].append(llama.relerr(r.step(t, cfg.prefill + s).float(), lr[-1]))
        ins.append(t)
        t = int(tok)
        toks.append(t)
    return ins, toks, l1, lr, errs


def error_budget_refs(cfg, weights, kv) -> dict:
    """E and D at this shape (docs/MODEL.md "Tolerances: E and D"): two independent correct implementations
    (all-fp32; plain bf16 torch) and the cheapest feature drop (skip the last layer), each against the bf16
    reference over the same greedy tokens. They say how far apart correct implementations of this shape end,
    which is what a relerr between TP=2 and TP=1 is to be read against."""
    return {"E_fp32": Reference(cfg, weights, kv, precision="fp32"),
            "E_torch_bf16": Reference(cfg, weights, kv, precision="torch"),
            "D_skip_last_layer": Reference(cfg, weights, kv, skip_layers={cfg.layers - 1})}


def budget_report(errs: dict) -> dict:
    """Per implementation: worst and median relerr against the reference over the run (E: the worst is the
    spread; D: the smallest is the drop's least visible step)."""
    out = {}
    for k, v in errs.items():
        out[k] = {"max": round(max(v), 5), "median": round(med(v), 5), "min": round(min(v), 5),
                  "per_step": [round(e, 5) for e in v]} if v else None
    return out


def feed(step, ins):
    """step(token) -> (full logits, token) over the given inputs: (each step's logits, its tokens)."""
    logits, toks = [], []
    for t in ins:
        lg, tok = step(t)
        logits.append(lg.clone())
        toks.append(int(tok))
    return logits, toks


def _max_median(key, errs) -> dict:
    return {key: max(errs) if errs else None, key + "_median": med(errs) if errs else None}


def relerr_report(l1, lr, l2, toks1, toks2) -> dict:
    """The greedy run's JSON fields: relerr (TP=2 vs TP=1 megart, as before), relerr_tp1_ref and
    relerr_tp2_ref (each against the reference), each with its _median; token agreements; per-step lists."""
    n = len(l1)
    e12 = [llama.relerr(b, a) for a, b in zip(l1, l2)]
    e1r = [llama.relerr(a, r) for a, r in zip(l1, lr)]
    e2r = [llama.relerr(b, r) for b, r in zip(l2, lr)]
    out = {**_max_median("relerr", e12), **_max_median("relerr_tp1_ref", e1r), **_max_median("relerr_tp2_ref", e2r)}
    out["token_agreement"] = f"{sum(a == b for a, b in zip(toks1, toks2))}/{n}"
    if lr:
        out["token_agreement_ref"] = f"{sum(int(torch.argmax(r)) == a for r, a in zip(lr, toks1))}/{n}"
        out["relerr_ref_gate"] = REF_GATE
    out["relerr_per_step"] = {k: [round(e, 5) for e in v] for k, v in
                              (("tp2_tp1", e12), ("tp1_ref", e1r), ("tp2_ref", e2r)) if v}
    return out


def greedy_relerr(one, tp, cfg, world, rank, steps, dev, error_budget=False) -> dict:
    """Rank 0 runs the single-GPU model greedily and the reference ("bf16" precision, the single-GPU gate's)
    on its tokens; the inputs are broadcast and fed to the TP model."""
    start = 11
    ins = torch.zeros(steps, dtype=torch.int64, device=dev)
    toks1 = l1 = lr = errs = None
    if rank == 0:
        ref = Reference(cfg, one.weights, one.kv)      # (its own copy of the prefilled caches)
        budget = error_budget_refs(cfg, one.weights, one.kv) if error_budget else None
        got, toks1, l1, lr, errs = greedy_tp1(one, ref, cfg, start, steps, budget)
        ins.copy_(torch.tensor(got, dtype=torch.int64))
        del ref, budget
        torch.cuda.empty_cache()
    dist.broadcast(ins, 0)
    lo, hi = tp.vocab_slice

    def step_full(t):
        lg, tok = tp.step(t)
        parts = [torch.empty(hi - lo, dtype=torch.float32, device=dev) for _ in range(world)]
        dist.all_gather(parts, lg)
        return torch.cat(parts), tok
    tp.reset(cfg.prefill, start, clear_kv=True)
    l2, toks2 = feed(step_full, ins.tolist())
    tp.sync()
    if rank != 0:
        return dict(greedy_steps=steps)
    out = dict(greedy_steps=steps, **relerr_report(l1, lr, l2, toks1, toks2))
    if errs:
        out["error_budget"] = budget_report(errs)
    return out


# --- where the time goes: profiled builds (after every timed figure; their own kernels) ------------------
SUMMED = ("calls", "instances", "wall_us", "slow_cta_us", "sum_cta_us", "wait_us", "wait_share")


def _kind(kind: str) -> str:
    """'lm_put1' -> 'lm_put', 'o.put3' -> 'o.put': a peer copy's label names its peer, which differs by rank."""
    return re.sub(r"put\d+$", "put", kind)


def call_summary(m, prof, bw: float = float("nan")) -> dict:
    """m.call_breakdown(prof) (per call kind, summed over layers; medians over steps, us), peer copies to every
    peer as one kind, with each kind's bytes (its calls' cost models) and floor_us (those bytes at bw B/s)."""
    nbytes, rows = {}, {}
    for lb, g in m.groups.items():
        c = g.cost()
        k = _kind(m.call_kind(lb))
        nbytes[k] = nbytes.get(k, 0) + (int(c.bytes) if c is not None else 0)
    for row in m.call_breakdown(prof):
        k = _kind(row["kind"])
        acc = rows.setdefault(k, dict(kind=k, **{f: 0 for f in SUMMED}))
        for f in SUMMED:
            acc[f] += row[f]
    calls = []
    for k, row in rows.items():
        b = nbytes.get(k, 0)
        calls.append({**{f: round(v, 4 if f == "wait_share" else 2) if isinstance(v, float) else v
                         for f, v in row.items()},
                      "bytes": b, "floor_us": round(b / bw * 1e6, 2) if bw == bw and bw > 0 else None})
    walls = list(prof.step_walls() / 1e3)
    return dict(rank=getattr(m, "rank", 0), steps=len(prof.steps), source=prof.source,
                step_wall_us=round(med(walls), 1), calls=calls)


def compare_table(summaries: dict) -> str:
    """One line per call kind: wall / slowCTA / wait (us) of each summary (name -> call_summary), then the floor of
    the first TP rank's bytes; kinds in first-seen order."""
    kinds = list(dict.fromkeys(c["kind"] for s in summaries.values() for c in s["calls"]))
    by = {n: {c["kind"]: c for c in s["calls"]} for n, s in summaries.items()}
    names = list(summaries)
    floor_of = next((n for n in names if n != "tp1"), names[0])
    head = ["kind"] + [f"{n} wall/slowCTA/wait" for n in names] + [f"{floor_of} floor"]
    rows = [["step"] + [f"{summaries[n]['step_wall_us']:.1f}" for n in names] + [""]]
    for k in kinds:
        cell = lambda n: ("/".join(f"{by[n][k][f]:.1f}" for f in ("wall_us", "slow_cta_us", "wait_us"))  # noqa
                          if k in by[n] else "-")
        fl = by[floor_of].get(k, {}).get("floor_us")
        rows.append([k] + [cell(n) for n in names] + [f"{fl:.1f}" if fl is not None else "-"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])  # noqa
    return "\n".join(["per call kind, summed over layers, medians over the profiled steps (us; profiled builds)",
                      fmt(head)] + [fmt(r) for r in rows])


def _save_spans(m, prof, path: Path) -> None:
    import numpy as np
    from megart.profile import INSTANCE
    labels, call_of = m.call_index(int(prof.records[:, INSTANCE].max()) + 1 if len(prof.records) else 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, records=prof.records, call_of=call_of, labels=np.array(labels))


def profile_tp(cfg, Ws, kvs, dev, nw, steps, attn_chunks, bw, spans: Path | None = None) -> dict:
    """Every rank: a profiled TP build (fresh peer buffers, a copy of the caches), 3 warm-up steps, `steps`
    recorded steps in lockstep; this rank's call_summary."""
    m = LlamaTPRank(cfg, Ws, clone_kv(kvs), peers=SymmetricPeers(device=dev), device=dev, nw=nw, profile=True,
                    profile_steps=steps, attn_chunks=attn_chunks)
    m.reset(cfg.prefill, 3)
    m.peers.barrier()
    for _ in range(3):
        m.step()
    m.sync()
    m.pk.reset_profile(steps)
    m.peers.barrier()
    for _ in range(steps):
        m.step()
    m.sync()
    prof = m.pk.profile()
    if spans is not None:
        _save_spans(m, prof, spans / f"tp{m.world}_rank{m.rank}.npz")
    return call_summary(m, prof, bw)


def profile_tp1(cfg, one, nw, steps, bw, spans: Path | None = None) -> dict:
    m, prof = profiled_steps(cfg, one.weights, clone_kv(one.kv), nw, steps)
    if spans is not None:
        _save_spans(m, prof, spans / "tp1.npz")
    return call_summary(m, prof, bw)


def profile_all(args, cfg, one, Ws, kvs, nw, bw, rank, world, dev) -> dict:
    """--profile: every rank's profiled TP build, rank 0's TP=1 build; printed by rank 0, returned for the JSON."""
    spans = Path(args.spans) if args.spans else None
    dist.barrier()
    mine = profile_tp(cfg, Ws, kvs, dev, nw, args.profile_steps, args.attn_chunks, bw, spans)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    out = dict(steps=args.profile_steps, note="profiled builds (span records on): figures a little above the timed "
               "ones; calls overlap, so walls do not add up to the step", tp2=ranks)
    if rank == 0:
        try:
            out["tp1"] = profile_tp1(cfg, one, nw, args.profile_steps, bw, spans)
        except Exception as exc:
            out["tp1_error"] = f"{type(exc).__name__}: {exc}"[:500]
        table = compare_table({**({"tp1": out["tp1"]} if "tp1" in out else {}),
                               **{f"rank{s['rank']}": s for s in ranks}})
        out["table"] = table
        print(table, file=sys.stderr, flush=True)
    dist.barrier()
    return out


def main(argv=None):
    global RANK
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per measure")
    ap.add_argument("--greedy", type=int, default=100, help="steps of the relerr run")
    ap.add_argument("--error-budget", action="store_true",
                    help="rank 0 also runs E (all-fp32, plain bf16 torch) and D (last layer skipped) references on "
                         "the greedy run's tokens (JSON error_budget)")
    ap.add_argument("--rounds", type=int, default=64, help="all-reduces per timed chain")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--attn-chunks", default="match", choices=ATTN_CHUNKS,
                    help="a rank's KV chunks per kv head: match TP=1's (default) or nw // its kv heads (the old split)")
    ap.add_argument("--compare-unfolded", action="store_true",
                    help="also time the TP=2 step with the all-reduces as tp_sum_f32 calls (tp2_unfolded_us)")
    ap.add_argument("--compare-folds", default=None,
                    help='also time these fold sets, ";"-separated, each a comma list of "o", "down" (tp2_folds_us)')
    ap.add_argument("--profile", action="store_true",
                    help="after the timed figures: profiled TP and TP=1 builds, per call kind (JSON 'profile')")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--spans", default="", help="with --profile: a folder for each build's raw span records (.npz)")
    ap.add_argument("--commit", default=os.environ.get("MEGART_COMMIT", ""))
    args = ap.parse_args(argv)
    rank, world, dev = init_process_group()
    RANK = rank
    res = dict(date=datetime.date.today().isoformat(), commit=args.commit, world=world,
               gpu=torch.cuda.get_device_name(dev), torch=torch.__version__, steps=args.steps)
    cfg = llama.config("8b").with_(layers=args.layers)
    res["config"] = dict(name=cfg.name, layers=cfg.layers, d=cfg.d, ffn=cfg.ffn, n_q=cfg.n_q, n_kv=cfg.n_kv,
                         hd=cfg.hd, vocab=cfg.vocab, tied=cfg.tied, prefill=cfg.prefill)
    timer = Timer(dev)
    t0 = time.time()
    W, kv = llama.make_weights(cfg, 0, dev), llama.make_kv_cache(cfg, 1, dev)
    torch.cuda.synchronize()
    log(f"weights {W.nbytes() / 1e9:.1f} GB in {time.time() - t0:.1f} s")
    one = llama.LlamaModel(cfg, W, clone_kv(kv), device=dev) if rank == 0 else None
    lc = shard_config(cfg, world)
    Ws, kvs = shard_weights(W, rank, world), shard_kv(kv, cfg, rank, world)
    del W, kv
    tp = LlamaTPRank(cfg, Ws, kvs, peers=SymmetricPeers(device=dev), device=dev, attn_chunks=args.attn_chunks)
    log(f"built + compiled in {time.time() - t0:.1f} s; {tp.describe()}")
    res.update(attn_chunks=args.attn_chunks, kv_chunks_per_head=tp.chunks)
    bw, how = hbm_bandwidth(dev)
    mid = cfg.prefill + args.steps // 2
    floors = [torch.tensor([tp.bytes_per_step(mid) / bw * 1e6], device=dev) for _ in range(world)]
    dist.all_gather(floors, floors[0].clone())
    res.update(hbm_read_tb_s=round(bw / 1e12, 3), bandwidth_how=how,
               floor_us_per_gpu=round(max(float(f) for f in floors), 1),
               bytes_per_gpu_step=tp.bytes_per_step(mid), bytes_tp1_step=cfg.bytes_per_step(mid))
    if rank == 0:
        res["tp1_floor_us"] = round(cfg.bytes_per_step(mid) / bw * 1e6, 1)
        res["tp1_us"] = round(med(time_model(one, timer, args.steps)), 1)
        one.sync()
        log(f"TP=1 {res['tp1_us']} us/step (floor {res['tp1_floor_us']})")
    dist.barrier()
    tp2 = time_tp(tp, timer, args.steps)
    both = [torch.zeros(1, device=dev) for _ in range(world)]
    dist.all_gather(both, torch.tensor([med(tp2)], device=dev))
    res["tp2_us_per_rank"] = [round(float(b), 1) for b in both]
    res["tp2_us"] = round(max(float(b) for b in both), 1)
    log(f"TP=2 {res['tp2_us']} us/step (per rank {res['tp2_us_per_rank']}), floor {res['floor_us_per_gpu']}")
    res["fold_sums"] = list(tp.fold_sums)

    def time_folds(folds) -> float:
        tp.sync()
        other = LlamaTPRank(cfg, Ws, kvs, peers=SymmetricPeers(device=dev), device=dev, attn_chunks=args.attn_chunks,
                            fold_sums=folds)
        dist.barrier()
        t = torch.tensor([med(time_tp(other, timer, args.steps))], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        other.sync()
        del other
        return round(float(t), 1)
    if args.compare_unfolded:
        res["tp2_unfolded_us"] = time_folds(False)
        log(f"TP=2 with the all-reduces as calls of their own: {res['tp2_unfolded_us']} us/step")
    if args.compare_folds is not None:
        res["tp2_folds_us"] = {}
        for spec in args.compare_folds.split(";"):
            folds = tuple(f.strip() for f in spec.split(",") if f.strip())
            res["tp2_folds_us"][",".join(folds)] = time_folds(folds)
            log(f"TP=2 folding {folds or 'nothing'}: {res['tp2_folds_us'][','.join(folds)]} us/step")
    try:
        res.update(greedy_relerr(one, tp, cfg, world, rank, args.greedy, dev, args.error_budget))
        if rank == 0:
            e = lambda k: "-" if res.get(k) is None else f"{res[k]:.3e}"  # noqa: E731
            log(f"relerr vs TP=1 max {e('relerr')} median {e('relerr_median')}, tokens {res['token_agreement']}; "
                f"vs reference (gate {REF_GATE}): TP=1 max {e('relerr_tp1_ref')} median {e('relerr_tp1_ref_median')}, "
                f"TP=2 max {e('relerr_tp2_ref')} median {e('relerr_tp2_ref_median')}")
            if res.get("error_budget"):
                log(f"error budget vs the reference (max / median / min over the run): {res['error_budget']}")
    except Exception as exc:   # recorded, not hidden: the JSON says what failed
        res["relerr_error"] = f"{type(exc).__name__}: {exc}"[:500]
        log("greedy relerr failed:", res["relerr_error"])
    try:
        pk = allreduce_chain(cfg.d, args.rounds, dev, tp.nw)
        dist.barrier()
        chain = med(time_kernel(pk, timer, 50))
        pk.check()
        pk1 = allreduce_chain(cfg.d, 1, dev, tp.nw)
        dist.barrier()
        single = med(time_kernel(pk1, timer, 50))
        pk1.check()
        res["allreduce_inkernel_us"] = round(chain / args.rounds, 2)
        res["allreduce_kernel_1_us"] = round(single, 2)
        res["allreduce_nccl_graphed_us"] = round(time_nccl_allreduce(cfg.d, args.rounds, dev, timer, 20), 2)
        log(f"all-reduce d={cfg.d} bf16: in-kernel {res['allreduce_inkernel_us']} us (chain of {args.rounds}), "
            f"NCCL graphed {res['allreduce_nccl_graphed_us']} us")
    except Exception as exc:
        res["allreduce_error"] = f"{type(exc).__name__}: {exc}"[:500]
        log("all-reduce bench failed:", res["allreduce_error"])
    if not args.profile:
        del one
    tp.sync()
    try:
        res["torch_tp2_graphed_us"] = round(time_torch_tp(cfg, lc, Ws, kvs, world, rank, timer, args.steps), 1)
        log(f"torch TP=2 graphed {res['torch_tp2_graphed_us']} us/step")
    except Exception as exc:
        res["torch_tp2_error"] = f"{type(exc).__name__}: {exc}"[:500]
        log("torch TP=2 failed:", res["torch_tp2_error"])
    if args.profile:     # last: every figure above is timed before any profiled build exists
        try:
            res["profile"] = profile_all(args, cfg, one, Ws, kvs, tp.nw, bw, rank, world, dev)
        except Exception as exc:
            res["profile_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log("profile failed:", res["profile_error"])
    if rank == 0:
        if res.get("tp1_us"):
            res["tp2_over_tp1"] = round(res["tp2_us"] / res["tp1_us"], 3)
        res["tp2_over_floor"] = round(res["tp2_us"] / res["floor_us_per_gpu"], 3)
        if res.get("torch_tp2_graphed_us"):
            res["tp2_vs_torch"] = round(res["tp2_us"] / res["torch_tp2_graphed_us"], 3)
        print("RESULT " + json.dumps(res), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
