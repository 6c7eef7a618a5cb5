"""Schedule/tiling variants of the Llama-1B megakernel, timed in one process on shared weights and KV.
Before timing, each variant's logits after one step from the same state are checked against the first
variant's: bit for bit where the variant only reorders independent work (exact=True), within the
model's 3e-2 relative-error gate where it changes a reduction order (chunking, threads). A variant
that fails is reported as WRONG and not timed.

    PYTHONPATH=. python bench/llama_variants.py [--steps 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from megart.bandwidth import read_floor, time_ms
from megart.models import llama
from megart.models.llama_config import make_kv_cache, make_weights

VARIANTS = {  # name -> (LlamaModel keyword arguments, exact)
    "attention merges its own partials (default)": (dict(attn_merge="fused"), True),
    "attention_merge as its own call": (dict(attn_merge="call"), True),
    "explicit deps (call-level events)": (dict(deps="explicit"), True),
    "inferred deps (subset events)": (dict(deps="infer"), True),
    "inferred deps, 8 KV chunks/head": (dict(deps="infer", tiles=dict(attn_chunks=8)), False),
    "inferred deps, 32 KV chunks/head": (dict(deps="infer", tiles=dict(attn_chunks=32)), False),
    "inferred deps, 512 threads": (dict(deps="infer", threads=512), False),
}
TOL = 3e-2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("llama_variants needs a CUDA device", file=sys.stderr)
        return 2
    floor = read_floor()
    cfg = llama.llama_1b()
    W, kv = make_weights(cfg, device="cuda"), make_kv_cache(cfg, device="cuda")
    floor_us = cfg.bytes_per_step() / floor["floor_bw"] * 1e6
    ref_logits, rows = None, []
    for name, (kw, exact) in VARIANTS.items():
        try:
            m = llama.LlamaModel(cfg, W, kv, **kw)
            m.reset(cfg.prefill, 3)
            logits, _ = m.step()
            m.sync()
            logits = logits.clone()
            if ref_logits is None:
                ref_logits = logits
            err = llama.relerr(logits, ref_logits)
            same = torch.equal(logits, ref_logits) if exact else err <= TOL
            us = None
            if same:
                def one():
                    if m.next_pos >= cfg.max_seq - 1:
                        m.reset(cfg.prefill, 3)
                    m.step()
                us = 1e3 * statistics.median(time_ms(one, iters=args.steps, warmup=5))
                m.sync()
            rows.append(dict(variant=name, us=us, x_floor=us / floor_us if us else None, correct=same,
                             exact=exact, relerr_vs_first=err))
        except Exception as exc:  # a variant that cannot build (e.g. registers) is reported, not fatal
            rows.append(dict(variant=name, us=None, error=f"{type(exc).__name__}: {exc}"[:200]))
        print(rows[-1], flush=True)
    print(f"\nLlama-1B bf16 2k, floor {floor_us:.0f} us at {floor['floor_bw'] / 1e12:.2f} TB/s")
    for r in rows:
        us = f"{r['us']:8.1f} us  {r['x_floor']:.3f} x floor" if r.get("us") else ("WRONG (logits differ)"
                                                                                  if "correct" in r else r["error"])
        print(f"  {r['variant']:<40} {us}")
    if args.json:
        json.dump(dict(floor=floor, rows=rows), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
