"""Compile several megakernels at once, one process each, into megart's disk cache (MEGART_CACHE_DIR,
default ~/.cache/megart), so a bench or test run that builds them one after another finds them compiled.

    PYTHONPATH=. python bench/warm_cache.py --configs 1b,3b,8b [--attention] [--gqa] [--jobs 6] [--sm-count 132]

A kernel's source depends only on its task types and kernel settings (threads, CTAs per SM, profiling,
macros), not on tensor shapes or the device, so the CPU build (init="empty": no weights are drawn) with
the GPU's SM count compiles the very source the GPU build will look up. --attention adds the profiled
attention_decode + attention_merge kernel that bench/tasks_bench.py builds, --gqa the ones of its GQA-group
cases (`--only gqa`: one per group, with that shape's bodies only). Prints one line per kernel
(compile seconds, or the error); exits 0 either way: a miss later only costs the compile again.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _build(job: tuple[str, int, dict | None]) -> str:
    what, sm, defines = job
    t = time.time()
    try:
        if what.startswith("attention"):
            _attention_kernel(sm, defines)
        else:
            from megart.models import llama
            llama.LlamaModel(llama.config(what), device="cpu", init="empty", nw=sm, sm_count=sm)
        return f"{what}: compiled in {time.time() - t:.1f} s"
    except Exception as exc:    # reported, not fatal: the run that needs it compiles it itself
        return f"{what}: failed ({type(exc).__name__}: {exc})"


def _attention_kernel(sm: int, defines: dict | None) -> None:
    """The task types of tasks_bench's attention kernels, built on the CPU (shapes do not matter)."""
    import torch

    import megart
    from megart.geometry.attention import attention_chunks, attention_m1, attention_scratch
    n_q, n_kv, hd, L = 32, 8, 64, 64
    pk = megart.PersistentKernel(profile=True, profile_steps=4, device="cpu", sm_count=sm, defines=defines)
    chunks = attention_chunks(n_kv, L, pk.nw)
    q, k, v = attention_m1(n_q, n_kv, hd, L, L)
    po, pm = attention_scratch(n_q, n_kv, hd, chunks)
    PO, PM = pk.tensor(po, "po"), pk.tensor(pm, "pm")
    pk.task("attention_decode", q=pk.tensor(q, "q"), k_cache=pk.tensor(k, "k"), v_cache=pk.tensor(v, "v"),
            pos=pk.tensor(torch.full((1,), L - 1, dtype=torch.int32), "pos"), part_o=PO, part_ml=PM, n_q=n_q,
            n_kv=n_kv, hd=hd, max_seq=L, chunks=chunks, tiles=chunks * n_kv)
    pk.task("attention_merge", out=pk.tensor(torch.zeros(n_q * hd, dtype=torch.bfloat16), "o"), part_o=PO,
            part_ml=PM, n_q=n_q, n_kv=n_kv, hd=hd, chunks=chunks, tiles=n_q)
    pk.compile()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="", help="comma list of megart.models.llama config names")
    ap.add_argument("--attention", action="store_true", help="also tasks_bench's attention kernel")
    ap.add_argument("--gqa", action="store_true", help="also tasks_bench's GQA-group attention kernels")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--sm-count", type=int, default=132, help="the GPU's SM count (H100 / H200: 132)")
    args = ap.parse_args(argv)
    jobs = [(c, args.sm_count, None) for c in args.configs.split(",") if c]
    if args.attention:
        jobs.append(("attention", args.sm_count, None))
    if args.gqa:
        from megart.tasks.attention import body_defines
        from tasks_bench import GQA_GROUPS, GQA_HD
        jobs += [(f"attention g{g}", args.sm_count, body_defines(GQA_HD, g)) for g in GQA_GROUPS]
    t = time.time()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for line in ex.map(_build, jobs):
            print(f"[warm_cache] {line}", flush=True)
    print(f"[warm_cache] {len(jobs)} kernels in {time.time() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
