"""Command line of the faithful per-task gate (docs/FAITHFUL.md).

    python -m megart.faithful --task gemv_m1 [--shape NxK] [--num-workers 132] [--baseline | --kernel cand.cuh]
                              [--decode-m1] [--context isolated|MODEL] [--iters N]
                              [--sweep-workers 8,64,68,128,132] [--json out.jsonl]
    python -m megart.faithful compare BASE.jsonl CAND.jsonl
    python -m megart.faithful --list
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from . import codes
from .codes import GateError
from .jsonsafe import dumps as json_line

PROG = "python -m megart.faithful"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one paragraph and exit code USAGE (2), never a traceback."""

    def error(self, message):
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error (exit {codes.USAGE}, usage): {message}. See --help.\n")
        raise SystemExit(codes.USAGE)


def _epilog() -> str:
    return ("exit codes:\n" + codes.table_text() + "\n\nOn a machine without a GPU the command compiles (NVRTC, "
            "sm_90a), verifies and emulates, prints the ptxas report and exits 0; timing needs a GPU (--iters, "
            "--require-gpu exit 7 there). --json and --sweep-workers work on a CPU and record emulated results.")


def gate_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Faithful per-task gate: compile one task type INTO a persistent "
                 "megakernel at the production grid, check it against PyTorch, time it with the in-kernel "
                 "profiler (slowCTA / wall / sumCTA).", epilog=_epilog(),
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", help="task type name (see --list)")
    ap.add_argument("--shape", help="shape, dimensions joined by 'x' (e.g. 8192x2048 = NxK for gemv_m1); "
                    "default: the task's production decode shape")
    ap.add_argument("--num-workers", "--nw", dest="nw", type=int, default=None,
                    help="persistent grid size (worker CTAs); default: the GPU's SM count (132 on an H200)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--baseline", action="store_true", help="time the in-tree body (the default)")
    g.add_argument("--kernel", metavar="CAND.cuh", help="candidate body for the task, overlaid through "
                   "source_overrides (the tree is never written); a bare name finds a packaged candidate")
    ap.add_argument("--decode-m1", action="store_true", help="routed MoE GEMM: one live row per active expert")
    ap.add_argument("--context", default="isolated", help="'isolated' (only this call at the production grid) "
                    "or a model (e.g. llama_1b): the task inside the whole model's megakernel")
    ap.add_argument("--iters", type=int, default=None, help="profiled steps to time (default 50). Needs a GPU: "
                    "without one it exits 7")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before the profiled ones (default 5; GPU "
                    "only)")
    ap.add_argument("--repeats", type=int, default=3, help="independent timed runs, each over freshly allocated "
                    "buffers (default 3): their medians' spread is the recorded run-to-run noise (GPU only)")
    ap.add_argument("--sweep-workers", metavar="LIST", help="comma-separated worker counts, e.g. 8,64,68,128,132 "
                    "(128 runs first). GPU: times each and writes a PNG of the metrics against nw; CPU: the "
                    "compile/verify/emulate check at each nw, no plot")
    ap.add_argument("--plot", metavar="PNG", help="where --sweep-workers writes its plot (GPU only: it plots timings)")
    ap.add_argument("--json", metavar="OUT.jsonl", help="append each result as one JSON line (for compare). On a "
                    "CPU the lines are the emulated results: \"emulated\": true, no timings, so compare refuses them")
    ap.add_argument("--tiles", type=int, default=None, help="instances of the call (default: the spec's "
                    "production tiling for the worker count)")
    ap.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    ap.add_argument("--l2", choices=("cold", "warm"), default="cold", help="cold (default): read 256 MiB between "
                    "steps so weights come from HBM as in a real decode step; warm: no flush (GPU only)")
    ap.add_argument("--engine", choices=("registers", "stream"), default=None,
                    help="isolated context: the weights through registers or through the launch-wide stream the "
                         "decode models ship with (default: as MEGART_DEFINES says, else registers). A candidate's "
                         "own type is never streamed, so with 'stream' it runs against the streamed baseline")
    ap.add_argument("--lock-timeout", type=float, default=600.0, help="seconds to wait for the GPU lock (600; "
                    "GPU only)")
    ap.add_argument("--lock-file", help="lock path, an empty file of its own (default $MEGART_LOCK_DIR/"
                    "megart-faithful.lock or /tmp/megart-faithful.lock; a non-empty file is refused; GPU only)")
    ap.add_argument("--require-gpu", action="store_true", help="fail (exit 7) instead of the CPU path without a GPU")
    ap.add_argument("--cpu", action="store_true", help="take the CPU path (compile, verify, emulate) even with a GPU")
    ap.add_argument("--sm-count", type=int, default=None, help="CPU path: SMs assumed for co-residency (132)")
    ap.add_argument("--list", action="store_true", help="list tasks with a gate, packaged candidates, contexts")
    return ap


def compare_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=f"{PROG} compare", description="Ratio and verdict (WIN / NULL / REGRESS / SLOUGHING) per "
                 "(task, shape, nw, context), judged on slowCTA AND wall AND sumCTA with the recorded run-to-run "
                 "spread as the noise band. Both files must hold GPU-timed results: emulated (CPU) lines are read "
                 "but refused with exit 13.", epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="baseline results (JSONL, or a log with FAITHFUL_RESULT lines)")
    ap.add_argument("cand", help="candidate results")
    ap.add_argument("--band", choices=("noise", "spread"), default="noise",
                    help="noise band per metric: noise = (p90-p10)/median (default) or spread = (max-min)/median")
    ap.add_argument("--min-band", type=float, default=None, help="smallest band as a fraction in [0, 1) "
                    "(default 0.01)")
    ap.add_argument("--json", metavar="OUT.jsonl", help="append the verdicts as JSON lines")
    return ap


# ------------------------------------------------------------------------------------------------
def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def _append_json(path: str, rec: dict) -> None:
    try:
        with open(path, "a") as f:
            f.write(json_line(rec) + "\n")
    except OSError as exc:
        raise GateError(codes.USAGE, f"--json {path}: cannot write: {exc}") from None


def _parse_workers(text: str) -> list[int]:
    try:
        ws = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise GateError(codes.USAGE, f"--sweep-workers {text!r}: write comma-separated positive integers, e.g. "
                                     "8,64,68,128,132.") from None
    if not ws or any(w < 1 for w in ws):
        raise GateError(codes.USAGE, f"--sweep-workers {text!r}: write comma-separated positive integers.")
    ws = list(dict.fromkeys(ws))
    return ([128] + [w for w in ws if w != 128]) if 128 in ws else ws


def do_list() -> int:
    from .. import registry
    from . import candidate, context, gates
    _say("tasks with a faithful gate (name, id, default shape, decode-m1):")
    for name in gates.available():
        s = gates.get(name)
        _say(f"  {name:16s} id {registry.get(name).id:<4d} {'x'.join(s.dims):8s} default "
             f"{s.shape_str(s.default_shape):14s} decode-m1: {s.decode_m1}")
    _say("packaged candidates (--kernel NAME):")
    for p in candidate.packaged():
        _say(f"  {p.stem:24s} {p}")
    _say("contexts: isolated" + "".join(f", {c}" for c in context.known()))
    return codes.OK


def run_gate(args) -> int:
    from .run import GateConfig, prepare
    if not args.task:
        raise GateError(codes.USAGE, "--task is required (see --list for the tasks with a gate).")
    cfg = GateConfig(task=args.task, shape=args.shape, nw=args.nw, kernel=args.kernel, decode_m1=args.decode_m1,
                     context=args.context, iters=50 if args.iters is None else args.iters, warmup=args.warmup,
                     repeats=args.repeats,
                     tiles=args.tiles, seed=args.seed, l2=args.l2, sm_count=args.sm_count, engine=args.engine)
    if cfg.nw is not None and cfg.nw < 1:
        raise GateError(codes.USAGE, f"--num-workers must be >= 1 (got {cfg.nw}).")
    _check_lock_vs_json(args)
    workers = _parse_workers(args.sweep_workers) if args.sweep_workers else None
    p = prepare(cfg)
    try:                                 # from here on the candidate may hold a temporary directory
        return _run_prepared(args, p, workers)
    finally:
        p.cand.close()


def _check_lock_vs_json(args) -> None:
    from .lock import default_path
    if args.json:
        lock = Path(args.lock_file) if args.lock_file else default_path()
        if lock.resolve() == Path(args.json).resolve():
            raise GateError(codes.USAGE, f"--lock-file and --json are the same file ({args.json}): the lock file "
                                         "must be a file of its own, results go to --json.")


def _run_prepared(args, p, workers) -> int:
    from . import context as ctxmod
    from .run import gpu_usable
    cfg = p.cfg
    ctx = ctxmod.get(cfg.context)
    why_not = "--cpu was given" if args.cpu else gpu_usable()
    timing_only = [f for f, on in (("--iters", args.iters is not None), ("--require-gpu", args.require_gpu)) if on]
    if why_not and timing_only:
        raise GateError(codes.NO_GPU, f"timing was asked ({', '.join(timing_only)}) but it needs a GPU: {why_not}. "
                                      "Run without those flags for the CPU check (compile, verify, emulate; --json "
                                      "and --sweep-workers work there too), or run on a GPU machine.")
    shape = (f"shape {p.shape_str} ({'x'.join(p.spec.dims)})" if ctx is None or cfg.shape is not None
             else f"every {cfg.task} call of the model (one result per shape)")
    _say(f"megart.faithful: task {cfg.task} (task id {p.ttype.id}), {shape}, context {cfg.context}; "
         f"{p.cand.describe()}")
    for n in p.notes:
        _say(f"note: {n}")
    if why_not:
        return _cpu_runs(args, p, ctx, workers, why_not)
    return _gpu_runs(args, p, ctx, workers)


def _cpu_runs(args, p, ctx, workers, why_not: str) -> int:
    """Compile, verify and emulate at each worker count; results are marked emulated, with no timings."""
    from .run import cpu_point, summary_json
    cfg = p.cfg
    points = workers or [cfg.nw or cfg.sm_count or 132]
    _say(f"no GPU ({why_not}): CPU check at nw {', '.join(map(str, points))}")
    for nw in points:
        if workers:
            _say(f"--- {cfg.task} {cfg.context} nw {nw} (emulated) ---")
        try:
            rec = ctx.cpu_point(p, nw, _say) if ctx is not None else cpu_point(p, nw, _say)
        except GateError as exc:         # a failing check still leaves its record in --json
            if getattr(exc, "record", None) and args.json:
                _append_json(args.json, summary_json(exc.record))
            raise
        line = summary_json(rec)
        _say("FAITHFUL_CPU " + json_line(line))
        if args.json:
            _append_json(args.json, line)
    if workers:
        _say("sweep plot skipped: it plots timings, which need a GPU")
    _say("TIMING NEEDS A GPU: compiled, verified and emulated only; no slowCTA / wall / sumCTA were "
         "measured. Run the same command on a GPU machine to time it."
         + (f" --json {args.json} holds the emulated results (\"emulated\": true, no timings)." if args.json else ""))
    return codes.OK


def _gpu_runs(args, p, ctx, workers) -> int:
    import torch
    from ..bandwidth import read_floor
    from .lock import GpuLock, other_gpu_processes
    from .run import format_table, gpu_points
    cfg = p.cfg
    dev_index = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev_index).multi_processor_count
    points = workers or [cfg.nw or sms]
    results = []
    with GpuLock(args.lock_file, timeout=args.lock_timeout) as lock:
        if lock.waited > 1:
            _say(f"waited {lock.waited:.1f} s for the GPU lock {lock.path}")
        others = other_gpu_processes(dev_index)
        if others:
            _warn("other processes are using this GPU while the gate times (numbers may be disturbed): "
                  + "; ".join(f"pid {o['pid']} {o['name']} ({o['used_memory_mib']} MiB)" for o in others))
        try:
            floor = read_floor()
            _say(f"read floor: {floor['floor_bw'] / 1e12:.3f} TB/s ({floor['floor_method']}, spread "
                 f"{floor['floor_spread'] * 100:.1f}%)")
        except Exception as exc:          # e.g. not enough free memory for the 4 GiB buffer
            floor = {}
            _warn(f"the read floor could not be measured ({type(exc).__name__}: {exc}); results carry no x floor")
        bar = _progress(points, workers is not None)
        for nw in bar:
            _say(f"--- {cfg.task} {cfg.context} nw {nw} ---")
            try:
                recs = gpu_points(p, nw, floor, _say, context=ctx)
            except GateError as exc:     # a failing candidate: its correctness is recorded, with no timing
                for rec in getattr(exc, "records", None) or ([exc.record] if getattr(exc, "record", None) else []):
                    _emit(args, rec)
                raise
            for rec in recs:
                rec["other_gpu_processes"] = others or []
                if len(recs) > 1:
                    _say(f"shape {rec['shape']} ({', '.join(rec.get('calls_under_test', []))}):")
                _say(format_table(rec))
                _emit(args, rec)
            results.extend(recs)
    if workers:
        from .sweep import plot_sweep, sweep_table
        _say(sweep_table(results))
        out = args.plot or _default_plot(args, p)
        path = plot_sweep(results, out)
        _say(f"sweep plot: {path}" if path else "sweep plot skipped: matplotlib is not installed")
    return codes.OK


def _emit(args, rec: dict) -> None:
    from .run import summary_json
    line = summary_json(rec)
    _say("FAITHFUL_RESULT " + json_line(line))
    if args.json:
        _append_json(args.json, line)


def _default_plot(args, p) -> str:
    if args.json:
        return str(Path(args.json).with_suffix("")) + ".sweep.png"
    stem = "baseline" if p.cand.is_baseline else Path(p.cand.label).stem
    return f"faithful_{p.cfg.task}_{p.shape_str}_{stem}_sweep.png"


def _progress(points, show: bool):
    if not show:
        return points
    try:
        from tqdm import tqdm
    except ImportError:
        return points
    return tqdm(points, desc="sweep nw", unit="point", file=sys.stderr)


def run_compare(args) -> int:
    from .compare import MIN_BAND, compare, load, table
    base, cand = load(args.base), load(args.cand)
    verdicts, notes = compare(base, cand, args.band, MIN_BAND if args.min_band is None else args.min_band)
    _say(table(verdicts))
    for n in notes:
        _say(f"note: {n}")
    for v in verdicts:
        _say("FAITHFUL_VERDICT " + json_line(v.to_dict()))
        if args.json:
            _append_json(args.json, v.to_dict())
    return codes.OK


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so every `finally` (the candidate's temporary directory,
    the GPU lock) runs as it does for Ctrl-C."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _sigterm_handler():
    """Install the SIGTERM handler (main thread only); return what to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = _sigterm_handler()
    try:
        return _main(argv)
    except _Terminated:
        sys.stderr.write("megart.faithful: terminated (SIGTERM); temporary files removed\n")
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    try:
        if argv and argv[0] == "compare":
            return run_compare(compare_parser().parse_args(argv[1:]))
        args = gate_parser().parse_args(argv)
        if args.list:
            return do_list()
        return run_gate(args)
    except SystemExit as exc:          # argparse (--help: 0, errors: USAGE)
        return int(exc.code or 0) if not isinstance(exc.code, str) else codes.USAGE
    except GateError as exc:
        _report(exc)
        return exc.code
    except KeyboardInterrupt:
        sys.stderr.write("megart.faithful: interrupted\n")
        return 130
    except Exception as exc:           # anything else is a bug: one paragraph, traceback on request
        from .run import classify
        err = classify(exc)
        if os.environ.get("MEGART_FAITHFUL_DEBUG"):
            traceback.print_exc()
        elif err.code == codes.INTERNAL:
            err.message += " This is a megart bug; rerun with MEGART_FAITHFUL_DEBUG=1 for the traceback."
        _report(err)
        return err.code


def _report(exc: GateError) -> None:
    sys.stderr.write(f"megart.faithful: error (exit {exc.code}): {exc.message}\n")
    if exc.detail:
        sys.stderr.write(exc.detail.rstrip("\n") + "\n")
    sys.stderr.flush()
