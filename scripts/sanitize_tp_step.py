"""A few tensor-parallel decode steps for compute-sanitizer, one process per GPU (scripts/sanitize_tp.sh runs
it under torchrun inside memcheck and racecheck). Llama-3.1-8B layers, --layers of them (the tools slow the
kernels 10-1000x), random weights; every rank checks that the ranks agree on each step's token."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megart.models import llama  # noqa: E402
from megart.models.llama_tp import LlamaTPRank  # noqa: E402
from megart.peer_memory import SymmetricPeers, init_process_group  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--fold", default="o,down", help='the all-reduces summed in the next call\'s staging ("" for none)')
    args = ap.parse_args(argv)
    rank, world, dev = init_process_group()
    cfg = llama.config("8b").with_(name=f"llama8b_{args.layers}l", layers=args.layers, prefill=256, max_seq=320)
    W, kv = llama.make_weights(cfg, 0, dev), llama.make_kv_cache(cfg, 1, dev)
    folds = tuple(f for f in args.fold.split(",") if f)
    tp = LlamaTPRank(cfg, W, kv, peers=SymmetricPeers(device=dev), device=dev, fold_sums=folds, watchdog_s=60)
    del W, kv
    torch.cuda.synchronize()
    torch.distributed.barrier()
    tok = 11
    for s in range(args.steps):
        _, t = tp.step(tok)
        mine = torch.tensor([int(t)], device=dev)
        both = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(both, mine)
        if len({int(b) for b in both}) != 1:
            raise SystemExit(f"sanitize_tp_step: step {s}: the ranks disagree on the token {both}")
        tok = int(t)
    tp.sync()
    torch.distributed.barrier()
    print(f"sanitize_tp_step: rank {rank}/{world}, {cfg.layers} layers, {args.steps} steps, folds {folds}: ok",
          flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
