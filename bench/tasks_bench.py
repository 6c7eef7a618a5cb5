"""Each decode task inside the megakernel at the production grid, next to the read floor measured in
this run and next to the torch/cuBLAS op doing the same work captured in a CUDA graph.

    PYTHONPATH=. python bench/tasks_bench.py [--steps 20] [--json out.json]

megart: the task's profiled wall span (median over --steps steps) per call; the weights of several
calls are rotated through >= 120 MB so no call reads another's bytes from L2. Two megart figures:
"chained" (each call waits for the previous one, as consecutive ops of a decode step do and as kernels
on one stream run; the figure comparable with torch) and "overlapped" (the calls are independent, so
one call's ramp-down overlaps the next one's start: throughput). torch: the same calls (F.linear, or
SDPA with GQA over the first kv_len positions) captured once in a CUDA graph and replayed, CUDA events
around each replay, median. Targets (issue 3): gemv_m1 8192x2048 and 2048x8192 >= 0.85 of the
floor by wall, the 128256x2048 LM head >= 0.90, attention >= 0.80 of its KV-bytes floor.

GQA groups (issue 10, `--only gqa`): attention (decode + merge, chained) at groups 3, 4, 7 and 8 over the
same KV bytes (8 kv heads x hd 128, so 24 / 32 / 56 / 64 q heads) at each of GQA_CONTEXTS, each kernel
built with the bodies a model of that shape compiles (megart.tasks.attention.body_defines): its fraction
of the KV-bytes floor, and groups 3 and 7 against 4 and 8.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

import megart
from megart.bandwidth import read_floor, time_ms
from megart.geometry.attention import attention_m1, attention_scratch, ref_attention_decode
from megart.geometry.attention import attention_chunks
from megart.tasks.attention import body_defines

GEMV_CASES = [("gemv_m1", 8192, 2048, 0.85), ("gemv_m1", 2048, 8192, 0.85), ("lm_head_argmax", 128256, 2048, 0.90)]
ATTN_CASES = [(2048, 0.80), (32768, 0.80)]          # kv_len; Llama-1B heads: 32 q / 8 kv, hd 64
GQA_GROUPS, GQA_KV, GQA_HD, GQA_CONTEXTS = (3, 4, 7, 8), 8, 128, (2048, 32768)


def _copies(nbytes: int) -> int:
    return max(1, -(-(120 << 20) // nbytes))


def _graph_ms(calls, steps: int) -> float:
    """Median ms of one replay of a CUDA graph holding `calls` (each a no-argument torch op)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for c in calls:          # warm up outside the capture (cuBLAS handles, workspaces)
            c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for c in calls:
            c()
    return statistics.median(time_ms(g.replay, iters=steps, warmup=3))


def gemv_case(task: str, n: int, k: int, steps: int) -> dict:
    chained, ws, x, copies = _gemv_megart(task, n, k, steps, chained=True)
    overlapped, *_ = _gemv_megart(task, n, k, steps, chained=False)
    xs = x.view(1, k)
    torch_ms = _graph_ms([lambda w=w: F.linear(xs, w) for w in ws], steps) / copies
    return dict(case=f"{task} {n}x{k}", bytes=n * k * 2, megart_us=chained, overlapped_us=overlapped,
                torch_us=torch_ms * 1e3, copies=copies)


def _gemv_megart(task: str, n: int, k: int, steps: int, chained: bool):
    copies = _copies(n * k * 2)
    pk = megart.PersistentKernel(profile=True, profile_steps=steps)
    nw = pk.nw
    x = torch.randn(k, device="cuda").to(torch.bfloat16)
    X = pk.tensor(x, "x")
    ws, ys, prev = [], [], ()
    for c in range(copies):
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        ws.append(w)
        W = pk.tensor(w, f"w{c}")
        if task == "gemv_m1":
            ys.append(torch.zeros(n, dtype=torch.bfloat16, device="cuda"))
            call = pk.task(task, y=pk.tensor(ys[-1], f"y{c}"), w=W, x=X, tiles=nw, after=prev)
        else:
            call = pk.task(task, w=W, x=X, part_val=pk.tensor(torch.zeros(nw, device="cuda"), f"pv{c}"),
                           part_idx=pk.tensor(torch.zeros(nw, dtype=torch.int32, device="cuda"), f"pi{c}"),
                           tiles=nw, after=prev)
        prev = (call,) if chained else ()
    pk.compile()
    pk(3)
    if task == "gemv_m1":       # correct before timed
        ref = (ws[0].float() @ x.float())
        err = float((ys[0].float() - ref).norm() / ref.norm())
        assert err < 1e-2, f"{task} {n}x{k}: relerr {err}"
    pk.reset_profile(steps)
    pk(steps)
    return pk.profile().by_task(task).wall.median / copies / 1e3, ws, x, copies


def attention_case(kv_len: int, steps: int) -> dict:
    n_q, n_kv, hd = 32, 8, 64                   # Llama-3.2-1B heads
    chained, caches, copies = _attention_megart(kv_len, steps, n_q, n_kv, hd, chained=True)
    overlapped, *_ = _attention_megart(kv_len, steps, n_q, n_kv, hd, chained=False)
    calls = [lambda q=q, k=k, v=v: _sdpa(q, k, v, n_q, n_kv, hd, kv_len) for q, k, v in caches]
    torch_ms = _graph_ms(calls, steps) / copies
    return dict(case=f"attention kv {kv_len}", bytes=2 * n_kv * kv_len * hd * 2, megart_us=chained,
                overlapped_us=overlapped, torch_us=torch_ms * 1e3, copies=copies)


def _sdpa(q, k, v, n_q, n_kv, hd, kv_len):
    return F.scaled_dot_product_attention(q.view(1, n_q, 1, hd), k[..., :kv_len, :].reshape(1, n_kv, kv_len, hd),
                                          v[..., :kv_len, :].reshape(1, n_kv, kv_len, hd), enable_gqa=True)


def gqa_case(group: int, kv_len: int, steps: int) -> dict:
    """Attention at GQA `group` over GQA_KV kv heads of GQA_HD (the same KV bytes for every group), chained,
    in a kernel with the bodies a model of this shape compiles."""
    n_q, n_kv, hd = group * GQA_KV, GQA_KV, GQA_HD
    us, caches, copies = _attention_megart(kv_len, steps, n_q, n_kv, hd, chained=True,
                                           defines=body_defines(hd, group))
    calls = [lambda q=q, k=k, v=v: _sdpa(q, k, v, n_q, n_kv, hd, kv_len) for q, k, v in caches]
    torch_ms = _graph_ms(calls, steps) / copies
    return dict(case=f"gqa group {group} kv {kv_len}", group=group, n_q=n_q, n_kv=n_kv, hd=hd, kv_len=kv_len,
                bytes=2 * n_kv * kv_len * hd * 2, megart_us=us, torch_us=torch_ms * 1e3, copies=copies)


def _attention_megart(kv_len: int, steps: int, n_q: int, n_kv: int, hd: int, chained: bool,
                      defines: dict | None = None):
    max_seq = kv_len
    copies = _copies(2 * n_kv * kv_len * hd * 2)
    pk = megart.PersistentKernel(profile=True, profile_steps=steps, defines=defines)
    chunks = attention_chunks(n_kv, max_seq, pk.nw)
    pos = pk.tensor(torch.full((1,), kv_len - 1, dtype=torch.int32, device="cuda"), "pos")
    caches, outs, prev = [], [], ()
    for c in range(copies):
        q, k, v = (t.cuda() for t in attention_m1(n_q, n_kv, hd, kv_len, max_seq, seed=c))
        caches.append((q, k, v))
        po, pm = attention_scratch(n_q, n_kv, hd, chunks, device="cuda")
        Q, K, V = pk.tensor(q, f"q{c}"), pk.tensor(k, f"k{c}"), pk.tensor(v, f"v{c}")
        PO, PM = pk.tensor(po, f"po{c}"), pk.tensor(pm, f"pm{c}")
        pk.task("attention_decode", q=Q, k_cache=K, v_cache=V, pos=pos, part_o=PO, part_ml=PM, n_q=n_q, n_kv=n_kv,
                hd=hd, max_seq=max_seq, chunks=chunks, tiles=chunks * n_kv, after=prev)
        outs.append(torch.zeros(n_q * hd, dtype=torch.bfloat16, device="cuda"))
        merge = pk.task("attention_merge", out=pk.tensor(outs[-1], f"o{c}"),
                part_o=PO, part_ml=PM, n_q=n_q, n_kv=n_kv, hd=hd, chunks=chunks, tiles=n_q)
        prev = (merge,) if chained else ()
    pk.compile()
    pk(3)
    q, k, v = caches[0]             # correct before timed
    ref = ref_attention_decode(q, k, v, kv_len).to(outs[0].device)
    err = float((outs[0].float() - ref).norm() / ref.norm())
    assert err < 2e-2, f"attention kv {kv_len}: relerr {err}"
    pk.reset_profile(steps)
    pk(steps)
    prof = pk.profile()
    # decode and merge calls interleave, so the step wall (less nothing else: the graph holds only these)
    # is their combined time
    return float(np.median(prof.step_walls())) / copies / 1e3, caches, copies


def gqa_table(gqa: list, bw: float) -> str:
    """Adds floor_us / of_floor to each row; the table, with groups 3 and 7 against 4 and 8 at each context."""
    for r in gqa:
        r["floor_us"] = r["bytes"] / bw * 1e6
        r["of_floor"] = r["floor_us"] / r["megart_us"]
        r["torch_of_floor"] = r["floor_us"] / r["torch_us"]
    frac = {(r["group"], r["kv_len"]): r["of_floor"] for r in gqa}
    lines = [f"\nattention (decode + merge) by GQA group, {GQA_KV} kv heads x hd {GQA_HD}; of floor = KV-bytes floor "
             "/ time", f"{'group':>5s} {'kv_len':>6s} {'MB':>6s} {'floor us':>8s} {'megart us':>9s} {'of floor':>8s} "
             f"{'torch us':>8s} {'of floor':>8s} {'vs group':>8s}"]
    for r in gqa:
        ref = {3: 4, 7: 8}.get(r["group"])
        rel = frac.get((ref, r["kv_len"]))
        r["vs_group"] = None if rel is None else dict(group=ref, ratio=r["of_floor"] / rel)
        lines.append(f"{r['group']:5d} {r['kv_len']:6d} {r['bytes'] / 1e6:6.1f} {r['floor_us']:8.1f} "
                     f"{r['megart_us']:9.1f} {r['of_floor']:8.2f} {r['torch_us']:8.1f} {r['torch_of_floor']:8.2f} "
                     + (f"{r['of_floor'] / rel:7.2f}x{ref}" if rel else f"{'-':>8s}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--only", default="", help="comma list of case-name prefixes to run (e.g. gemv,lm_head)")
    args = ap.parse_args(argv)
    want = lambda name: not args.only or any(name.startswith(p) for p in args.only.split(","))  # noqa: E731
    if not torch.cuda.is_available():
        print("tasks_bench needs a CUDA device", file=sys.stderr)
        return 2
    floor = read_floor()
    bw = floor["floor_bw"]
    rows = [dict(gemv_case(t, n, k, args.steps), target=tg) for t, n, k, tg in GEMV_CASES if want(t)]
    rows += [dict(attention_case(L, args.steps), target=tg) for L, tg in ATTN_CASES if want("attention")]
    gqa = [gqa_case(g, L, args.steps) for L in GQA_CONTEXTS for g in GQA_GROUPS] if want("gqa") else []
    print(f"\nread floor {bw / 1e12:.2f} TB/s ({floor['floor_method']}); per call, medians")
    print(f"{'case':28s} {'MB':>7s} {'floor us':>8s} {'megart us':>9s} {'of floor':>8s} {'overlapped':>10s} "
          f"{'of floor':>8s} {'torch graph us':>14s} {'of floor':>8s} {'target':>6s}")
    for r in rows:
        f_us = r["bytes"] / bw * 1e6
        r.update(floor_us=f_us, megart_of_floor=f_us / r["megart_us"], overlapped_of_floor=f_us / r["overlapped_us"],
                 torch_of_floor=f_us / r["torch_us"])
        print(f"{r['case']:28s} {r['bytes'] / 1e6:7.1f} {f_us:8.1f} {r['megart_us']:9.1f} {r['megart_of_floor']:8.2f} "
              f"{r['overlapped_us']:10.1f} {r['overlapped_of_floor']:8.2f} {r['torch_us']:14.1f} "
              f"{r['torch_of_floor']:8.2f} {r['target']:6.2f}")
    if gqa:
        print(gqa_table(gqa, bw))
    if args.json:
        json.dump(dict(floor=floor, rows=rows, gqa=gqa), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
