"""Llama decode step: megart's one-launch megakernel against torch (eager, CUDA-graphed, torch.compile) and
the HBM floor, all measured in this one process (the floor and torch.compile run as said below).

    PYTHONPATH=. python bench/llama_decode.py [--configs 1b,1b_128,1b_fp8,1b_fp8_all,1b_32k,block8b] [--steps 300]
                                              [--out out/llama_decode] [--compile-modes max-autotune]

fp8: 1b_fp8 is the fused gate/up (the default), 1b_fp8_all adds the fp8 LM head and fp8 QKV (1b_fp8_head: the head only); --configs 1b_fp8_split
times the older split gate/up (gemv_m1_fp8 + silu_mul) for comparison.

Checkpoint shapes (issue 10): --configs 3b,8b,qwen3_0.6b,qwen3_8b,g7_7b (Llama-3.2-3B: GQA group 3;
Llama-3.1-8B: untied head; Qwen3-0.6B / 8B: per-head q/k norm; g7_7b: a Qwen2.5-7B-sized Llama, 28/4 heads,
GQA group 7), each one launch per step like the others.

Per config, on seeded random weights with a prefilled KV cache:
* floor     = bytes one step must read (weights + KV at the timed positions) / the HBM read bandwidth
              measured at the start of this run (megart.bandwidth: 16-byte loads over 4 GiB; torch.sum
              fallback);
* eager     = the straightforward bf16 torch model's device-state greedy step (megart/models/reference.py,
              precision="torch", decode_step_: token and pos on the device, argmax fed back), CUDA events;
* graphed   = the same step captured once with torch.cuda.graph and replayed;
* compiled  = torch.compile of the same step, each mode in a child process under a time limit (skipped,
              with the reason, if it fails or runs out of time; only the first config by default);
* megart    = LlamaModel.step(): one launch per step, back to back, CUDA events around each launch;
              us/step is the median over --steps steps (after a warm-up), tok/s = 1e6 / us, x floor;
* b2b       = back to back: runs of up to 100 steps (graph replays for "graphed") with CUDA events around each
              whole run only, us/step = run time / steps, the median of 7 runs. An event between two launches
              keeps a launch from overlapping the previous step's end (LlamaModel.overlap_steps), so only this
              figure shows what a decode loop (generate()) gets from it;
* breakdown = a second build with the in-kernel profiler: pk.profile().table() per task type, the
              per-call-kind breakdown (wall / slowCTA / sumCTA / wait, summed over layers), and a PNG
              timeline of one step (megart.trace.plot_timeline) and of its calls, layer 0 zoomed, with body vs
              wait per call kind (megart.trace_calls.plot_calls).
Writes <out>/llama_decode.json, <out>/timeline_<config>.png, <out>/calls_<config>.png, <out>/profile_<config>.txt; the summary
table is printed last. --device cpu runs a smoke test of the bookkeeping on the reduced configs: its
figures are the emulator's and torch-on-CPU times, labelled EMULATED, never GPU timings.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megart.models import llama  # noqa: E402
from megart.models.llama_config import clone_kv  # noqa: E402
from megart.models.reference import Reference  # noqa: E402

DEFAULT_CONFIGS = "1b,1b_128,1b_fp8,1b_fp8_all,1b_32k,block8b"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --- timing -------------------------------------------------------------------------------------------
class Timer:
    """Per-step times of `fn` (us): CUDA events around each call on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.gpu = device.type == "cuda"

    def _warm(self, fn, warmup: int, before) -> None:
        """`before`, `warmup` calls, a sync, then `before` again: the timed calls start from the same state."""
        if before:
            before()
        for _ in range(warmup):
            fn()
        self.sync()
        if before:
            before()

    def steps(self, fn, n: int, warmup: int = 3, before=None) -> list[float]:
        self._warm(fn, warmup, before)
        if not self.gpu:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e6)
            return out
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        self.sync()
        return [a.elapsed_time(b) * 1e3 for a, b in ev]

    def runs(self, fn, n: int, runs: int, warmup: int = 3, before=None) -> list[float]:
        """Per-step us of `runs` runs of `n` calls back to back, CUDA events around each whole run only, so no
        event sits between two launches (an overlapped launch overlaps only its stream neighbour)."""
        out = []
        for _ in range(runs):
            self._warm(fn, warmup, before)
            if not self.gpu:
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                out.append((time.perf_counter() - t) * 1e6 / n)
                continue
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                fn()
            b.record()
            self.sync()
            out.append(a.elapsed_time(b) * 1e3 / n)
        return out

    def sync(self):
        if self.gpu:
            torch.cuda.synchronize()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def run_chunked(timer, fn, n, room, reset, warmup=3) -> list[float]:
    """`n` timed steps in runs of at most `room` (the cache headroom), `reset` before each run."""
    out = []
    while len(out) < n:
        k = min(room - warmup, n - len(out))
        out += timer.steps(fn, k, warmup=warmup, before=reset)
    return out


# --- bandwidth ----------------------------------------------------------------------------------------
def hbm_bandwidth(device) -> tuple[float, str]:
    if device.type != "cuda":
        return float("nan"), "none (cpu)"
    try:
        from megart.bandwidth import read_bandwidth
        return read_bandwidth(), "read kernel, 16-byte loads, 4 GiB"
    except Exception as exc:  # fall back to a torch reduction
        log(f"megart.bandwidth failed ({type(exc).__name__}: {exc}); using torch.sum")
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).uniform_()
    t = Timer(device)
    ms = median(t.steps(lambda x=x: x.sum(), 10)) / 1e3
    bw = x.numel() * 2 / (ms * 1e-3)
    del x
    return bw, "torch.sum of 2 GiB bf16"


# --- torch baselines ----------------------------------------------------------------------------------
class TorchStep:
    """The reference's device-state greedy step with static inputs (capturable)."""

    def __init__(self, cfg, W, kv):
        dev = W.layers[0]["wqkv"].device
        self.cfg = cfg
        self.ref = Reference(cfg, W, kv, precision="torch")
        self.pos = torch.tensor([cfg.prefill], dtype=torch.int64, device=dev)
        self.token = torch.tensor([3], dtype=torch.int64, device=dev)
        self.x = llama.make_inputs(cfg, 1, device=dev)[0].clone() if cfg.block else None

    def __call__(self):
        return self.ref.decode_step_(self.token, self.pos, self.x)

    def reset(self):
        self.pos.fill_(self.cfg.prefill)


def time_eager(ts: TorchStep, timer, n) -> list[float]:
    room = ts.cfg.max_seq - ts.cfg.prefill
    return run_chunked(timer, ts, n, room, ts.reset, warmup=2)


def time_graphed(ts: TorchStep, timer, n) -> list[float]:
    ts.reset()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            ts()
    torch.cuda.current_stream().wait_stream(s)
    ts.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ts()
    room = ts.cfg.max_seq - ts.cfg.prefill
    out = run_chunked(timer, g.replay, n, room, ts.reset)
    runs = timer.runs(g.replay, min(n, room - 5, 100), 7, warmup=5, before=ts.reset)
    del g
    return out, runs


def compile_worker(cfg_name: str, mode: str, steps: int) -> None:
    """Child process: torch.compile the step, time it, print one RESULT line."""
    cfg = llama.config(cfg_name)
    dev = torch.device("cuda")
    W, kv = llama.make_weights(cfg, 0, dev), llama.make_kv_cache(cfg, 1, dev)
    ts = TorchStep(cfg, W, kv)
    fn = torch.compile(ts.ref.decode_step_, mode=mode)
    call = lambda: fn(ts.token, ts.pos, ts.x)  # noqa: E731
    t0 = time.time()
    for _ in range(3):
        ts.reset()
        call()
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    timer = Timer(dev)
    us = run_chunked(timer, call, steps, cfg.max_seq - cfg.prefill, ts.reset)
    print("RESULT " + json.dumps(dict(us=median(us), compile_s=compile_s)), flush=True)


def time_compiled(cfg_name: str, mode: str, steps: int, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_compile-worker", cfg_name, mode, str(steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)       # the child and its inductor compile workers
        except ProcessLookupError:
            pass
        p.communicate()
        return dict(mode=mode, status=f"skipped: over the {timeout:.0f} s limit")
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return dict(mode=mode, status="ok", wall_s=round(time.time() - t0, 1), **json.loads(line[7:]))
    tail = (err or out).strip().splitlines()[-1:] or ["no output"]
    return dict(mode=mode, status=f"failed (rc {p.returncode}): {tail[0][:200]}")


# --- megart -------------------------------------------------------------------------------------------
def time_megart(m, timer, n) -> list[float]:
    room = m.cfg.max_seq - m.cfg.prefill
    tok = None if m.cfg.block else 3
    return run_chunked(timer, m.step, n, room, lambda: m.reset(m.cfg.prefill, tok), warmup=5)


def time_megart_runs(m, timer, n, runs=7) -> list[float]:
    """Per-step us of runs of n steps back to back (events around each run; see Timer.runs)."""
    room = m.cfg.max_seq - m.cfg.prefill
    tok = None if m.cfg.block else 3
    return timer.runs(m.step, min(n, room - 5), runs, warmup=5, before=lambda: m.reset(m.cfg.prefill, tok))


def check_once(cfg, m, W, prefix) -> float:
    """One step from the prefix against the reference (a sanity figure; the gates are in the tests)."""
    ref = Reference(cfg, W, prefix)
    m.reset(cfg.prefill, None if cfg.block else 3, clear_kv=True)
    inp = llama.make_inputs(cfg, 1, device=m.device)[0] if cfg.block else 3
    out = m.step(inp)
    out = out if cfg.block else out[0]
    m.sync()
    return llama.relerr(out, ref.step(inp, cfg.prefill))


def profiled_steps(cfg, W, kv, nw, steps: int, defines: dict | None = None, overlap: bool = True, **model_kw):
    """A profiled build run for `steps` steps after 3 warm-up steps: (model, its Profile)."""
    m = llama.LlamaModel(cfg, W, kv, nw=nw, profile=True, profile_steps=steps, defines=defines, **model_kw)
    m.overlap_steps = overlap
    m.reset(cfg.prefill, None if cfg.block else 3)
    for _ in range(3):
        m.step()
    m.sync()
    m.pk.reset_profile(steps)
    for _ in range(steps):
        m.step()
    m.sync()
    return m, m.pk.profile()


def profile_megart(cfg, W, kv, nw, out_dir: Path, steps: int = 8) -> dict:
    from megart.trace import plot_timeline
    from megart.trace_calls import calls_of, plot_calls
    m, prof = profiled_steps(cfg, W, kv, nw, steps)
    table = prof.table()
    calls = m.call_breakdown(prof)
    walls = prof.step_walls() / 1e3
    png = out_dir / f"timeline_{cfg.name}.png"
    calls_png = out_dir / f"calls_{cfg.name}.png"
    try:
        plot_timeline(prof, png, title=f"megart {cfg.name}: one decode step")
        plot_calls(prof, calls_of(m.pk), calls_png, zoom="L0.", title=f"megart {cfg.name}: calls of one decode step")
    except Exception as exc:
        log(f"timeline plot failed: {exc}")
        png = calls_png = None
    lines = [table, "", _calls_table(calls, median(list(walls)))]
    (out_dir / f"profile_{cfg.name}.txt").write_text("\n".join(lines) + "\n")
    return dict(task_table=table, calls=calls, step_wall_us=median(list(walls)),
                timeline=str(png) if png else None, calls_plot=str(calls_png) if calls_png else None)


def _calls_table(calls, step_wall) -> str:
    head = ("call", "calls", "inst", "wall", "slowCTA", "sumCTA", "wait", "wait%")
    rows = [(c["kind"], str(c["calls"]), str(c["instances"]), f"{c['wall_us']:.1f}", f"{c['slow_cta_us']:.1f}",
             f"{c['sum_cta_us']:.0f}", f"{c['wait_us']:.0f}", f"{100 * c['wait_share']:.1f}") for c in calls]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])  # noqa
    return "\n".join([f"per call kind (summed over layers; medians over steps, us; step wall {step_wall:.1f} us; "
                      "wait% = share of all worker-time)", fmt(head)] + [fmt(r) for r in rows])


# --- one config ---------------------------------------------------------------------------------------
def bench_config(name: str, args, bw: float, device, out_dir: Path, compile_left: list) -> dict:
    cfg = llama.config(name)
    timer = Timer(device)
    res = dict(config=name, shape=dict(layers=cfg.layers, d=cfg.d, ffn=cfg.ffn, n_q=cfg.n_q, n_kv=cfg.n_kv,
                                       hd=cfg.hd, vocab=cfg.vocab, wdtype=cfg.wdtype, prefill=cfg.prefill))
    t0 = time.time()
    W = llama.make_weights(cfg, 0, device)
    prefix = llama.make_kv_cache(cfg, 1, device)
    mid = cfg.prefill + min(args.steps, cfg.max_seq - cfg.prefill) // 2
    res["bytes_per_step"] = cfg.bytes_per_step(mid)
    res["floor_us"] = cfg.bytes_per_step(mid) / bw * 1e6 if bw == bw else float("nan")
    log(f"[{name}] weights {cfg.weight_bytes() / 1e9:.3f} GB, KV {cfg.kv_bytes(mid) / 1e9:.3f} GB, "
        f"floor {res['floor_us']:.0f} us ({time.time() - t0:.1f} s)")

    # torch baselines
    ts = TorchStep(cfg, W, prefix)
    res["eager_us"] = median(time_eager(ts, timer, args.eager_steps))
    where = "" if device.type == "cuda" else " (torch on the CPU)"
    log(f"[{name}] eager {res['eager_us']:.0f} us/step{where}")
    if device.type == "cuda":
        try:
            per_launch, runs = time_graphed(ts, timer, args.steps)
            res["graphed_us"], res["graphed_run_us"] = median(per_launch), median(runs)
            log(f"[{name}] CUDA-graphed {res['graphed_us']:.0f} us/step ({res['graphed_run_us']:.0f} back to back)")
        except Exception as exc:
            res["graphed_us"] = float("nan")
            res["graphed_error"] = f"{type(exc).__name__}: {exc}"
            log(f"[{name}] CUDA graph failed: {exc}")
    del ts
    res["compiled"] = []
    if device.type == "cuda" and compile_left and name in args.compile_configs:
        for mode in args.compile_modes:
            left = args.compile_budget - compile_left[0]
            if left < 30:
                res["compiled"].append(dict(mode=mode, status="skipped: compile budget spent"))
                continue
            t = time.time()
            r = time_compiled(name, mode, args.steps, min(args.compile_timeout, left))
            compile_left[0] += time.time() - t
            res["compiled"].append(r)
            log(f"[{name}] torch.compile({mode}): {r}")
    ok = [r["us"] for r in res["compiled"] if r.get("status") == "ok"]
    res["compiled_us"] = min(ok) if ok else float("nan")
    torch.cuda.empty_cache() if device.type == "cuda" else None

    # megart
    t = time.time()
    m = llama.LlamaModel(cfg, W, clone_kv(prefix), nw=args.nw, device=device)
    res["megart_build_s"] = round(time.time() - t, 1)
    res["model"] = m.describe()
    res["kernel"] = dict(registers=m.pk.report.registers, spill_bytes=m.pk.report.spill_bytes,
                         instances=len(m.pk.graph.instances), events=len(m.pk.schedule.events),
                         cache_hit=m.pk.compiled.cache_hit)
    log(f"[{name}] {m.describe()} (built in {res['megart_build_s']} s)")
    res["relerr_first_step"] = check_once(cfg, m, W, prefix)
    n = args.steps if device.type == "cuda" else 2
    us = time_megart(m, timer, n)
    m.sync()
    # back to back (no event between two launches, so each launch overlaps the previous step's end)
    res["megart_run_us"] = median(time_megart_runs(m, timer, min(n, 100), 7 if device.type == "cuda" else 1))
    res["x_floor_run"] = res["megart_run_us"] / res["floor_us"]
    m.sync()
    res["megart_us"] = median(us)
    res["megart_us_min"] = min(us)
    res["megart_us_p90"] = sorted(us)[int(0.9 * (len(us) - 1))]
    res["tok_s"] = 1e6 / res["megart_us"]
    res["x_floor"] = res["megart_us"] / res["floor_us"]
    res["achieved_tb_s"] = res["bytes_per_step"] / (res["megart_us"] * 1e-6) / 1e12
    g = res.get("graphed_us", float("nan"))
    res["vs_graphed"] = g / res["megart_us"] if g == g else None      # > 1: megart is faster
    if device.type == "cuda":
        log(f"[{name}] megart {res['megart_us']:.1f} us/step, {res['x_floor']:.3f} x floor; back to back "
            f"{res['megart_run_us']:.1f} us/step, {res['x_floor_run']:.3f} x floor")
    else:
        log(f"[{name}] megart EMULATED on the CPU: {res['megart_us']:.1f} us per emulated step (not a GPU timing)")
    res["timing"] = "gpu" if device.type == "cuda" else "cpu-emulated"
    del m
    if device.type == "cuda" and not args.no_profile:
        try:
            res["profile"] = profile_megart(cfg, W, clone_kv(prefix), args.nw, out_dir)
            log(res["profile"]["task_table"])
            log(_calls_table(res["profile"]["calls"], res["profile"]["step_wall_us"]))
        except Exception as exc:
            res["profile"] = dict(error=f"{type(exc).__name__}: {exc}")
            log(f"[{name}] profile failed: {exc}")
    del W, prefix
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def fixed_cost(name: str, args, bw: float, device) -> dict:
    """Fixed cost per layer: the same shape at L and 2L layers, megart only.
    (t(2L) - t(L) - (bytes(2L) - bytes(L)) / bandwidth) / L: what a layer costs beyond its bytes."""
    import dataclasses
    base = llama.config(name)
    timer = Timer(device)
    rows = []
    for layers in (base.layers, 2 * base.layers):
        cfg = dataclasses.replace(base, layers=layers, name=f"{base.name}_L{layers}")
        W = llama.make_weights(cfg, 0, device)
        prefix = llama.make_kv_cache(cfg, 1, device)
        m = llama.LlamaModel(cfg, W, prefix, nw=args.nw, device=device)
        us = median(time_megart(m, timer, args.steps))
        mid = cfg.prefill + min(args.steps, cfg.max_seq - cfg.prefill) // 2
        rows.append(dict(layers=layers, megart_us=us, bytes_per_step=cfg.bytes_per_step(mid)))
        del m, W, prefix
        torch.cuda.empty_cache()
    (a, b), L = rows, base.layers
    fixed = (b["megart_us"] - a["megart_us"] - (b["bytes_per_step"] - a["bytes_per_step"]) / bw * 1e6) / L
    log(f"[{name}] fixed cost per layer {fixed:.1f} us ({a['layers']} layers {a['megart_us']:.1f} us, "
        f"{b['layers']} layers {b['megart_us']:.1f} us)")
    return dict(config=name, fixed_us_per_layer=fixed, runs=rows)


def timing_label(device) -> str:
    """What the us/step figures are: GPU timings, or (on a CPU) emulator and CPU-torch wall times."""
    if torch.device(device).type == "cuda":
        return "us/step medians (CUDA events)"
    return ("EMULATED on the CPU, not GPU timings: megart = the CPU emulator, eager = torch on the CPU "
            "(perf_counter medians, us/step); tok/s and x floor are not meaningful here")


def summary(results: list, bw: float, bw_how: str, device="cuda") -> str:
    f = lambda v, p=0: "-" if v is None or v != v else f"{v:,.{p}f}"  # noqa: E731
    head = ("config", "floor us", "eager", "graphed", "compiled", "megart us", "tok/s", "x floor", "vs graph",
            "b2b graphed", "b2b megart", "b2b x floor", "relerr")
    rows = []
    for r in results:
        g = r.get("graphed_us", float("nan"))
        rows.append((r["config"], f(r["floor_us"]), f(r["eager_us"]), f(g), f(r.get("compiled_us")),
                     f(r["megart_us"], 1), f(r["tok_s"]), f(r["x_floor"], 3),
                     f(g / r["megart_us"], 2) + "x" if g == g else "-", f(r.get("graphed_run_us")),
                     f(r.get("megart_run_us"), 1), f(r.get("x_floor_run"), 3), f"{r['relerr_first_step']:.4f}"))
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])])  # noqa
    lines = [f"HBM read bandwidth {bw / 1e12:.3f} TB/s ({bw_how}); floor = bytes/step / bandwidth; "
             + timing_label(device), fmt(head)] + [fmt(r) for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help=f"comma list (default {DEFAULT_CONFIGS}; cpu: tiny,tiny_block)")
    ap.add_argument("--steps", type=int, default=300, help="timed megart / graphed steps per config")
    ap.add_argument("--eager-steps", type=int, default=30)
    ap.add_argument("--nw", type=int, default=None, help="workers (default: the SM count)")
    ap.add_argument("--out", default="out/llama_decode")
    ap.add_argument("--device", default=None)
    ap.add_argument("--compile-modes", default="max-autotune",
                    help="comma list of torch.compile modes to try ('' for none), e.g. max-autotune,reduce-overhead")
    ap.add_argument("--compile-configs", default="1b", help="configs torch.compile runs on")
    ap.add_argument("--compile-timeout", type=float, default=150.0, help="seconds per torch.compile mode")
    ap.add_argument("--compile-budget", type=float, default=170.0, help="seconds for all torch.compile runs")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--fixed-cost", default="1b,small",
                    help="configs whose fixed cost per layer is measured (L vs 2L layers; '' for none; GPU only)")
    ap.add_argument("--_compile-worker", nargs=3, metavar=("CONFIG", "MODE", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._compile_worker:
        c, mode, steps = args._compile_worker
        return compile_worker(c, mode, int(steps))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        if args.nw is None:
            args.nw = 8
    args.configs = (args.configs or (DEFAULT_CONFIGS if device.type == "cuda" else "tiny,tiny_block")).split(",")
    args.compile_modes = [m for m in args.compile_modes.split(",") if m]
    args.compile_configs = set(args.compile_configs.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    bw, bw_how = hbm_bandwidth(device)
    log(f"HBM read bandwidth {bw / 1e12:.3f} TB/s ({bw_how})")
    results, compile_used, fixed = [], [0.0], []

    def save():
        (out_dir / "llama_decode.json").write_text(json.dumps(dict(
            bandwidth=bw, bandwidth_how=bw_how, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            torch=torch.__version__, results=results, fixed_cost=fixed), indent=1, default=str))
    for name in args.configs:
        results.append(bench_config(name, args, bw, device, out_dir, compile_used))
        save()
    if device.type == "cuda":
        for name in filter(None, args.fixed_cost.split(",")):
            fixed.append(fixed_cost(name, args, bw, device))
            for r in results:
                if r["config"] == name:
                    r["fixed_us_per_layer"] = fixed[-1]["fixed_us_per_layer"]
            save()
    log(f"total {time.time() - t0:.0f} s; results in {out_dir}")
    print(summary(results, bw, bw_how, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
