"""Run a few Llama decode steps (1B shape) for compute-sanitizer: scripts/sanitize.sh runs this under
memcheck, racecheck and synccheck. --layers trims the model (the tools slow the kernel 10-1000x)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megart.models import llama  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="1b")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the config's)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--defines", default="", help="kernel macros, NAME=VALUE,...")
    ap.add_argument("--tagged-attn", action="store_true",
                    help="the tagged qkv -> attention edge (LlamaModel(tagged_attn=True), off by default)")
    ap.add_argument("--attn-merge", default="auto", help="LlamaModel(attn_merge=...): auto, fused, call, direct")
    ap.add_argument("--tiles", default="", help="LlamaModel(tiles=...) entries, NAME=INT,... (e.g. gate_up_rounds=8)")
    args = ap.parse_args(argv)
    cfg = llama.config(args.config)
    if args.layers:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    defines = dict(x.split("=", 1) for x in args.defines.split(",") if x)
    tiles = {k: int(v) for k, v in (x.split("=", 1) for x in args.tiles.split(",") if x)}
    m = llama.LlamaModel(cfg, device="cuda", defines=defines, watchdog_s=60, tagged_attn=args.tagged_attn,
                         attn_merge=args.attn_merge, tiles=tiles)
    for _ in range(args.steps):
        m.step()
    m.sync()
    print(f"sanitize_step: {cfg.name} {cfg.layers} layers, {args.steps} steps, defines {defines}, "
          f"tiles {tiles}, tagged_attn {args.tagged_attn}, attn_merge {m.attn_merge}: ok, "
          f"stream slots {m.pk.stream_layout().slots}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
