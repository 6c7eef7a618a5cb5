"""Runtime overheads on the GPU: per-task dispatch, event signal-to-wake, grid barrier latency at
several worker counts, and the span profiler's cost. Prints a table; --json writes the figures.

    PYTHONPATH=. python bench/runtime_bench.py [--json out/runtime.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import megart
from megart.bandwidth import time_ms


def launch_ms(pk, iters=30) -> float:
    t = statistics.median(time_ms(pk.launch, iters=iters, warmup=5))
    pk.check()
    return t


def dispatch_overhead(nw=132, per_worker=(1, 257)) -> float:
    """ns per empty task on one worker (difference of two queue lengths cancels the launch)."""
    times = []
    for m in per_worker:
        pk = megart.PersistentKernel(nw=nw)
        pk.task("noop", tiles=nw * m)
        pk.compile()
        times.append(launch_ms(pk))
    return (times[1] - times[0]) * 1e6 / (per_worker[1] - per_worker[0])


def signal_to_wake(hops=(2, 402)) -> float:
    """ns per hop of a chain of empty tasks alternating between two workers, each waiting on the last."""
    times = []
    for n in hops:
        pk = megart.PersistentKernel(nw=2)
        prev = None
        for i in range(n):
            prev = pk.task("noop", worker=i % 2, after=[prev] if prev else [])
        pk.compile()
        times.append(launch_ms(pk))
    return (times[1] - times[0]) * 1e6 / (hops[1] - hops[0])


def barrier_latency(nw, counts=(1, 501)) -> float:
    """us per grid barrier at `nw` workers."""
    times = []
    for k in counts:
        pk = megart.PersistentKernel(nw=nw)
        for _ in range(k):
            pk.barrier()
        pk.compile()
        times.append(launch_ms(pk))
    return (times[1] - times[0]) * 1e3 / (counts[1] - counts[0])


def profiler_overhead(nw=132) -> tuple[float, float]:
    """Step time (ms) of a memory-bound graph (40 calls x nw tiles of 256 KiB copies) without and with spans."""
    out = []
    for prof in (False, True):
        pk = megart.PersistentKernel(nw=nw, profile=prof, profile_steps=64)
        n = nw * 64 * 1024
        bufs = [pk.tensor(torch.randn(n, device="cuda"), f"b{i}") for i in range(4)]
        for c in range(40):
            pk.task("copy", dst=bufs[(c + 1) % 4], src=bufs[c % 4], tiles=nw)
        pk.compile()
        out.append(launch_ms(pk, iters=50))
    return out[0], out[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("runtime_bench needs a CUDA device", file=sys.stderr)
        return 2
    res = {"device": torch.cuda.get_device_name(), "dispatch_ns_per_task": dispatch_overhead(),
           "signal_to_wake_ns": signal_to_wake()}
    for nw in (8, 64, 132):
        res[f"barrier_us_nw{nw}"] = barrier_latency(nw)
    off, on = profiler_overhead()
    res.update(profiler_off_ms=off, profiler_on_ms=on, profiler_overhead_pct=100 * (on - off) / off)
    rows = [("dispatch per empty task", f"{res['dispatch_ns_per_task']:.0f} ns",
             f"{1e3 / res['dispatch_ns_per_task']:.2f} tasks/worker/us"),
            ("signal-to-wake (chain hop)", f"{res['signal_to_wake_ns']:.0f} ns", "")]
    for nw in (8, 64, 132):
        ref = {8: 0.63, 64: 0.90, 132: 0.96}[nw]
        b = res[f"barrier_us_nw{nw}"]
        rows.append((f"grid barrier nw={nw}", f"{b:.2f} us", f"{b / ref:.2f}x calibration {ref} us"))
    rows.append(("profiler overhead", f"{res['profiler_overhead_pct']:.2f} %",
                 f"{off:.3f} ms off, {on:.3f} ms on"))
    print("\nmegart runtime overheads")
    for r in rows:
        print(f"  {r[0]:<30} {r[1]:>12}  {r[2]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
