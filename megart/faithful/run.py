"""One gate point: build the task at production decode geometry, compile it INTO a persistent
megakernel at `nw` workers with the profiler on, check correctness once (cosine >= 0.99 vs the
PyTorch whole-op reference on the live rows), then time `iters` profiled steps and extract this
task's spans by numeric task id. Without a GPU: compile (NVRTC), verify, emulate, report."""
from __future__ import annotations

import dataclasses
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import registry
from ..errors import (CompileError, DeviceError, GraphError, HangError, MegartError, RegistryError,
                      ResidencyError, ScheduleError)
from ..graph import MAX_TILES
from ..kernel import PersistentKernel
from ..nvtx_ranges import ranged
from . import candidate as candmod
from . import gates
from .jsonsafe import strict
from .correctness import COS_MIN, check_output, result_of  # noqa: F401  (also used by callers of run)
from .codes import BAD_SHAPE, COMPILE, DEVICE, INCORRECT, INTERNAL, NO_GPU, RESIDENCY, USAGE, GateError
from .stats import pool_runs, task_timings

SCHEMA = 1
BUILD_DEVICE = "cuda"   # where the timed path builds (tests swap in "cpu" with a simulated kernel)


# The isolated gate's weight engines (--engine): the macro each sets (None: the caller's MEGART_DEFINES decide,
# which leave a PersistentKernel on registers unless they ask for the stream).
ENGINES = {None: None, "registers": {"MEGART_STREAM_SLOTS": 0}, "stream": {"MEGART_STREAM_SLOTS": "auto"}}


@dataclass
class GateConfig:
    task: str
    shape: str | None = None
    nw: int | None = None
    kernel: str | None = None          # None: the in-tree body (baseline)
    decode_m1: bool = False
    context: str = "isolated"
    iters: int = 50
    warmup: int = 5
    repeats: int = 3                   # independent timed runs (fresh buffers) -> run-to-run spread
    tiles: int | None = None           # override the production instance count of the call
    seed: int = 0
    l2: str = "cold"                   # "cold": flush L2 between timed steps | "warm"
    sm_count: int | None = None        # CPU path: SMs assumed for the co-residency check (default 132)
    engine: str | None = None          # isolated gate's weights: "registers", "stream" or None (as MEGART_DEFINES says)


@dataclass
class Prepared:
    cfg: GateConfig
    spec: gates.GateSpec
    ttype: object
    cand: candmod.Candidate
    shape: tuple
    notes: list = field(default_factory=list)

    @property
    def shape_str(self) -> str:
        return self.spec.shape_str(self.shape)


@ranged("faithful.prepare")
def prepare(cfg: GateConfig) -> Prepared:
    """Everything that needs no device: the spec, the shape, the candidate. Fails fast on bad input."""
    spec = gates.get(cfg.task)
    ttype = registry.get(cfg.task)
    if cfg.decode_m1 and spec.decode_m1 == "none":
        raise GateError(BAD_SHAPE, f"task {cfg.task!r} has no one-live-row (--decode-m1) mode: it is not a routed "
                                   "MoE GEMM and has no M dimension to reduce. Drop --decode-m1.")
    shape = spec.parse_shape(cfg.shape)
    if cfg.iters < 1 or cfg.warmup < 0 or cfg.repeats < 1:
        raise GateError(USAGE, f"--iters and --repeats must be >= 1 and --warmup >= 0 (got {cfg.iters}, "
                               f"{cfg.repeats}, {cfg.warmup}).")
    if cfg.engine not in ENGINES:
        raise GateError(USAGE, f"--engine {cfg.engine!r}: expected one of {', '.join(e for e in ENGINES if e)}.")
    if cfg.engine and cfg.context != "isolated":
        raise GateError(USAGE, f"--engine {cfg.engine} with --context {cfg.context}: a model context runs the model "
                               "as it ships (its weights on the stream); --engine chooses the isolated gate's.")
    if cfg.tiles is not None and not 1 <= cfg.tiles <= MAX_TILES:
        raise GateError(USAGE, f"--tiles must be in [1, {MAX_TILES}] (got {cfg.tiles}): a call is cut into at most "
                               f"{MAX_TILES} instances.")
    cand = candmod.baseline(ttype) if cfg.kernel is None else candmod.load(cfg.kernel, ttype)
    p = Prepared(cfg, spec, ttype, cand, shape)
    if cfg.decode_m1 and spec.decode_m1 == "native":
        p.notes.append(f"--decode-m1: {cfg.task} is M = 1 by construction; the flag changes nothing")
    if cfg.engine == "stream" and not ttype.stream:
        p.notes.append(f"--engine stream: {cfg.task} declares no weight stream (TaskType.stream), so the flag "
                       "changes nothing")
    elif cfg.engine == "stream" and cfg.kernel is not None:
        p.notes.append("--engine stream: a candidate's type is never on the weight stream (its loads are its own), "
                       "so this candidate runs on registers; time the baseline with --engine stream to compare "
                       "with what ships")
    return p


# ------------------------------------------------------------------------------------------------
# building and checking
# ------------------------------------------------------------------------------------------------
@dataclass
class Built:
    pk: PersistentKernel
    inputs: gates.GateInputs
    group: object
    tiles: int
    production_tiles: int
    shape: tuple
    call_handles: dict


def fresh_inputs(gi: gates.GateInputs) -> gates.GateInputs:
    """The same inputs in freshly allocated tensors (a repeat samples another memory placement)."""
    new = {name: t.clone() for name, t in gi.tensors.items()}
    by_obj = {id(t): new[name] for name, t in gi.tensors.items()}
    call = {k: by_obj.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in gi.call.items()}
    return dataclasses.replace(gi, tensors=new, call=call)


@ranged("faithful.build")
def build(p: Prepared, nw: int, device: str, shape: tuple | None = None, profile: bool = True,
          iters: int = 1, inputs: gates.GateInputs | None = None) -> Built:
    shape = p.shape if shape is None else shape
    spec, cfg = p.spec, p.cfg
    production = spec.production_tiles(shape, nw) if cfg.tiles is None else cfg.tiles
    tiles = p.cand.tiles(production)
    try:
        gi = inputs or gates._call_kwargs(spec.build, shape=shape, device=device, seed=cfg.seed,
                                          decode_m1=cfg.decode_m1, nw=nw, tiles=tiles)
    except (GraphError, ValueError, AssertionError) as exc:
        raise GateError(BAD_SHAPE, f"task {cfg.task!r} refuses shape {spec.shape_str(shape)}: {exc}") from None
    try:
        pk = PersistentKernel(nw=nw, device=device, profile=profile, profile_steps=max(1, iters),
                              source_overrides=p.cand.overrides(), defines=ENGINES[cfg.engine],
                              sm_count=cfg.sm_count if device == "cpu" else None)
    except GraphError as exc:
        raise GateError(USAGE, f"--num-workers {nw}: {exc}") from None
    except DeviceError as exc:
        raise GateError(NO_GPU, str(exc)) from None
    handles = {name: pk.tensor(t, name) for name, t in gi.tensors.items()}
    by_obj = {id(t): handles[name] for name, t in gi.tensors.items()}
    call = {}
    for k, v in gi.call.items():
        if isinstance(v, torch.Tensor):
            if id(v) not in by_obj:
                raise GateError(INTERNAL, f"gate spec of {cfg.task!r}: call argument {k!r} is a tensor that is not "
                                          "in GateInputs.tensors")
            v = by_obj[id(v)]
        call[k] = v
    try:
        group = pk.task(cfg.task, tiles=tiles, label=f"{cfg.task}[{spec.shape_str(shape)}]", **call)
    except GraphError as exc:
        raise GateError(BAD_SHAPE, f"task {cfg.task!r} refuses shape {spec.shape_str(shape)} at tiles={tiles}, "
                                   f"nw={nw}: {exc}") from None
    return Built(pk, gi, group, tiles, production, shape, call)


@ranged("faithful.compile")
def compile_kernel(p: Prepared, b: Built) -> None:
    try:
        b.pk.compile()
    except CompileError as exc:
        text = str(exc)
        if p.cand.override is not None and p.cand.path is not None and p.cand.override != p.cand.path:
            text = text.replace(str(p.cand.override), f"{p.cand.path} (after include-baseline)")
        who = p.cand.describe() if not p.cand.is_baseline else "the in-tree kernel"
        raise GateError(COMPILE, f"{who} for task {p.cfg.task!r} failed to compile with NVRTC "
                                 f"({b.pk.arch}); nothing was run. The compiler log follows.", detail=text) from None
    except ResidencyError as exc:
        raise GateError(RESIDENCY, f"{exc}") from None
    except ScheduleError as exc:
        raise GateError(INTERNAL, f"the gate's schedule does not verify (a megart bug): {exc}") from None
    except DeviceError as exc:
        raise GateError(DEVICE, f"loading the kernel failed: {exc}") from None


def _correctness_error(p: Prepared, corr: dict, where: str) -> GateError:
    return GateError(INCORRECT, f"{p.cand.describe()} is WRONG for {p.cfg.task} {p.shape_str} ({where}): cosine "
                                f"{corr['cos']:.6f} < {COS_MIN} vs the PyTorch reference on {corr['live']} "
                                f"(relative error {corr['rel_err']:.3g}, finite={corr['finite']}). A failing "
                                "candidate gets no timing.")


def kernel_info(b: Built) -> dict:
    r = b.pk.report
    occ = b.pk.occupancy
    return {"ptxas": asdict(r), "occupancy": {"per_sm": occ.per_sm, "limiter": occ.limiter,
                                              "capacity": occ.capacity(b.pk.sm_count)},
            "arch": b.pk.arch, "sm_count": b.pk.sm_count, "threads": b.pk.threads,
            "cache_hit": b.pk.compiled.cache_hit, "engine": engine_of(b.pk)}


def engine_of(pk) -> dict:
    """The weights' engine of a built kernel: the launch-wide stream (ring slots per warp) or registers, and
    why a stream that was asked for was declined (a candidate's own type is never on it)."""
    slots = pk.stream_layout().slots
    return {"weights": "stream" if slots else "registers", "slots": slots, "declined": pk.stream_declined}


def ptxas_text(info: dict, nw: int) -> str:
    r, o = info["ptxas"], info["occupancy"]
    return (f"ptxas ({info['arch']}): {r['registers']} registers, {r['spill_stores']} B spill stores, "
            f"{r['spill_loads']} B spill loads, {r['stack_bytes']} B stack, {r['smem_bytes']} B static smem, "
            f"{r['barriers']} barriers; {o['per_sm']} CTA(s)/SM of {info['threads']} threads (limit: "
            f"{o['limiter']}) x {info['sm_count']} SMs = {o['capacity']} co-resident >= nw {nw}"
            + (" [compile cache hit]" if info.get("cache_hit") else "") + _engine_text(info["engine"]))


def _engine_text(e: dict) -> str:
    text = (f"\nweights: the launch-wide stream, {e['slots']} ring slots per warp" if e["weights"] == "stream"
            else "\nweights: registers")
    return text + (f" (the stream was declined: {e['declined']})" if e.get("declined") else "")


def _bytes(p: Prepared, b: Built) -> int | None:
    if b.inputs.bytes is not None:
        return int(b.inputs.bytes)
    if p.ttype.cost is None:
        return None
    try:
        return int(p.ttype.cost(**b.call_handles).bytes)
    except Exception:
        return None


def base_fields(p: Prepared, nw: int, context: str, shape: str | None = None) -> dict:
    c = p.cand
    return {
        "schema": SCHEMA, "task": p.cfg.task, "task_id": p.ttype.id, "shape": shape or p.shape_str,
        "nw": nw, "context": context, "kernel": c.label, "kernel_sha": c.sha,
        "kernel_path": str(c.path) if c.path else p.ttype.source, "directives": c.directives,
        "decode_m1": bool(p.cfg.decode_m1), "seed": p.cfg.seed,
        "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch": torch.__version__, "python": platform.python_version(),
    }


def base_record(p: Prepared, b: Built, nw: int, context: str) -> dict:
    rec = base_fields(p, nw, context)
    rec.update(tiles=b.tiles, production_tiles=b.production_tiles, instances=len(b.group.uids),
               bytes=_bytes(p, b), note=b.inputs.note)
    return rec


# ------------------------------------------------------------------------------------------------
# the CPU path
# ------------------------------------------------------------------------------------------------
@ranged("faithful.cpu_point")
def cpu_point(p: Prepared, nw: int, say) -> dict:
    """Compile (NVRTC, sm_90a), verify and emulate at `nw` workers; a candidate's CUDA body also runs
    through the host simulation where it can (dense tasks). No timing."""
    spec = p.spec
    shape, changed = spec.cpu_reduce(p.shape)
    b = build(p, nw, "cpu", shape=shape, profile=True)
    compile_kernel(p, b)
    info = kernel_info(b)
    say(ptxas_text(info, nw))
    if changed:
        say(f"emulating at a REDUCED shape {spec.shape_str(shape)} ({', '.join(changed)} differ from the requested "
            f"{p.shape_str}; {spec.elements(p.shape):,} elements would take too long in the CPU emulator). The same "
            "split, reference and decode geometry code run. The GPU run uses the requested shape.")
    t0 = time.monotonic()
    host = b.pk.emulate(steps=1, seed=p.cfg.seed)
    corr = check_output(result_of(b.inputs, host), b.inputs)
    corr["where"] = "cpu-emulator"
    verdict = ("PASS" if corr["pass"] else "FAIL") if p.cand.is_baseline else ("agree" if corr["pass"] else "FAIL")
    say(f"emulator ({len(b.group.uids)} instances on {nw} queues, {time.monotonic() - t0:.2f} s): the task's CPU "
        f"reference and split: cos {corr['cos']:.6f}, rel err {corr['rel_err']:.3g} vs the PyTorch whole-op "
        f"reference on {corr['live']} -> {verdict}")
    corr.update(_body_result(p, b, corr, say))
    rec = base_record(p, b, nw, p.cfg.context)
    rec.update(kernel_info=info, correctness=corr, timings=None, device="cpu (emulator)", emulated=True,
               emulated_shape=spec.shape_str(shape), reduced_shape=bool(changed), reduced_dims=changed)
    if changed:
        rec["bytes"] = None          # the cost model of the reduced call would be mistaken for production's
    if corr["pass"] is False:
        err = _correctness_error(p, corr, corr.get("failed_in", "CPU emulator"))
        err.record = rec
        raise err
    return rec


def _body_result(p: Prepared, b: Built, corr: dict, say) -> dict:
    """The correctness fields about the CUDA body. The baseline's is the in-tree body (its own tests run
    it); a candidate's runs through the host simulation, and when it cannot, the result is not a pass."""
    if p.cand.is_baseline:
        return {"body_checked": False, "body_why": "the in-tree body (run by its host-simulation and GPU tests)"}
    from .body_check import check_body
    body = check_body(p, b, say)
    out = {"body_checked": body["body_checked"], "body_why": body["body_why"], "reference_pass": corr["pass"]}
    if not corr["pass"]:
        return out
    if not body["body_checked"]:
        say(f"candidate CUDA body: NOT CHECKED on this machine ({body['body_why']}); no pass is recorded. Its "
            "numerics are checked on a GPU.")
        out["pass"] = None
        return out
    bc = body["body_correctness"]
    say(f"candidate CUDA body (host simulation): cos {bc['cos']:.6f}, rel err {bc['rel_err']:.3g} on {bc['live']} "
        f"-> {'PASS' if bc['pass'] else 'FAIL'}")
    out.update(body=bc, reference_cos=corr["cos"], cos=bc["cos"], rel_err=bc["rel_err"],
               max_abs_err=bc["max_abs_err"], finite=bc["finite"], where=bc["where"])
    out["pass"] = bc["pass"]
    if not bc["pass"]:
        out["failed_in"] = "host simulation of the CUDA body"
    return out


# ------------------------------------------------------------------------------------------------
# the GPU path
# ------------------------------------------------------------------------------------------------
def gpu_points(p: Prepared, nw: int, floor: dict, say, context=None) -> list[dict]:
    """Correctness once, then `iters` profiled steps; one result per shape under test. `context`: a
    model context (model_context.py) or None for isolated."""
    if context is not None:
        return context.gpu_points(p, nw, floor, say)
    return [gpu_point(p, nw, floor, say)]


@ranged("faithful.gpu_point")
def gpu_point(p: Prepared, nw: int, floor: dict, say) -> dict:
    """The isolated gate: only this call's instances at the production grid, `repeats` times over
    freshly allocated buffers (same bytes); the samples are pooled and the spread of the per-repeat
    medians is recorded as the run-to-run spread."""
    cfg = p.cfg
    runs, pristine, rec = [], None, None
    for r in range(cfg.repeats):
        b = build(p, nw, BUILD_DEVICE, profile=True, iters=cfg.iters,
                  inputs=None if pristine is None else fresh_inputs(pristine))
        if pristine is None and cfg.repeats > 1:
            pristine = fresh_inputs(b.inputs)    # the steps below update outputs (and inout inputs) in place
        compile_kernel(p, b)
        if rec is None:
            info = kernel_info(b)
            say(ptxas_text(info, nw))
            rec = base_record(p, b, nw, "isolated")
            rec.update(kernel_info=info, device=torch.cuda.get_device_properties(b.pk.device).name,
                       floor_bw=floor.get("floor_bw"), floor_method=floor.get("floor_method"), iters=cfg.iters,
                       warmup=cfg.warmup, l2=cfg.l2, repeats=cfg.repeats)
        runs.append(_timed_run(p, b, rec, say, first=(r == 0)))
        del b
    return _finish(rec, runs, floor)


@ranged("faithful.timed_run")
def _timed_run(p: Prepared, b: Built, rec: dict, say, first: bool) -> dict:
    from .floor import L2Flush
    cfg, pk = p.cfg, b.pk
    try:
        pk.launch()                                      # step 1: correctness, on every repeat's buffers
        pk.check()
        torch.cuda.synchronize(pk.device)
        corr = check_output(result_of(b.inputs, b.inputs.tensors), b.inputs)
        corr["where"] = "gpu"
        if first or not corr["pass"]:
            rec["correctness"] = corr
            say(f"correctness: cos {corr['cos']:.6f}, rel err {corr['rel_err']:.3g}, max abs err "
                f"{corr['max_abs_err']:.3g} on {corr['live']} -> {'PASS' if corr['pass'] else 'FAIL'}")
        if not corr["pass"]:
            rec["timings"] = None
            err = _correctness_error(p, corr, "GPU, first step")
            err.record = rec
            raise err
        flush = L2Flush(pk.device) if cfg.l2 == "cold" else (lambda: None)
        for _ in range(cfg.warmup):
            flush()
            pk.launch()
        pk.check()
        pk.reset_profile(cfg.iters)
        for _ in range(cfg.iters):
            flush()
            pk.launch()
        pk.check()
        prof = pk.profile()
    except HangError as exc:
        raise GateError(DEVICE, f"the kernel hung: {exc}") from None
    except (DeviceError, RuntimeError) as exc:
        raise GateError(DEVICE, f"the device failed while running the gate: {exc}") from None
    if prof.overflow:
        say(f"WARNING: {prof.overflow} span records were dropped (profile buffer full): timings are partial")
    t = task_timings(prof.records, p.ttype.id, [b.group.uids], p.cfg.task)
    t["span_overflow"] = prof.overflow
    return t


def _finish(rec: dict, runs: list[dict], floor: dict) -> dict:
    """Pool the repeats' samples; record each repeat's median and their spread per metric."""
    rec["timings"] = pool_runs(runs)
    last = runs[-1]
    rec.update(samples=sum(r["samples"] for r in runs), steps=sum(r["steps"] for r in runs), calls=last["calls"],
               ctas_per_step=last["ctas_per_step"], instances_per_call=last["instances_per_call"],
               span_overflow=sum(r.get("span_overflow", 0) for r in runs))
    byts = rec.get("bytes")
    wall = rec["timings"]["wall"]["median"]
    if byts and wall > 0:
        rec["bw_wall"] = byts / (wall * 1e-9)
        if floor.get("floor_bw"):
            rec["x_floor"] = (wall * 1e-9) / (byts / floor["floor_bw"])
    return rec


def gpu_usable() -> str | None:
    """None when a CUDA device can run the gate, else why not (one sentence)."""
    if os.environ.get("MEGART_FAITHFUL_FORCE_CPU", "") not in ("", "0"):
        return "MEGART_FAITHFUL_FORCE_CPU is set"
    try:
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
    except Exception as exc:      # a broken driver install
        return f"CUDA is unusable here: {exc}"
    try:
        import cuda.core  # noqa: F401
    except Exception as exc:
        return f"cuda.core cannot be imported ({exc}); megart launches through it"
    return None


def format_table(rec: dict) -> str:
    t = rec["timings"]
    lines = [f"{'metric':8s} {'median us':>10s} {'min us':>9s} {'max us':>9s} {'spread':>7s} {'noise':>7s} "
             f"{'run-to-run':>10s}"]
    for m, lab in (("slow_cta", "slowCTA"), ("wall", "wall"), ("sum_cta", "sumCTA")):
        d = t[m]
        lines.append(f"{lab:8s} {d['median'] / 1e3:10.3f} {d['min'] / 1e3:9.3f} {d['max'] / 1e3:9.3f} "
                     f"{(d['spread'] or 0) * 100:6.1f}% {(d.get('noise') or 0) * 100:6.1f}% "
                     f"{(d.get('run_spread') or 0) * 100:9.1f}%")
    lines.append(f"({rec['samples']} samples = {rec.get('repeats', 1)} repeat(s) x {rec.get('iters')} steps x "
                 f"{rec['calls']} call(s); {rec['instances_per_call']} instances per call on {rec['ctas_per_step']:g} "
                 f"CTAs; spread = (max-min)/median, noise = (p90-p10)/median over the samples, run-to-run = "
                 f"(max-min)/median of the repeats' medians; L2 {rec['l2']} between steps)")
    if rec.get("bytes"):
        bw = rec.get("bw_wall")
        fl = rec.get("floor_bw")
        s = f"bytes {rec['bytes'] / 1e6:.2f} MB/call"
        if bw:
            s += f"; achieved {bw / 1e12:.3f} TB/s on wall"
        if fl:
            s += f" vs read floor {fl / 1e12:.3f} TB/s ({rec.get('floor_method')})"
        if rec.get("x_floor"):
            s += f": {rec['x_floor']:.2f}x floor ({100 / rec['x_floor']:.0f}% of floor bandwidth)"
        lines.append(s)
    return "\n".join(lines)


def summary_json(rec: dict) -> dict:
    """The FAITHFUL_RESULT payload (the JSONL record without the bulky kernel report)."""
    out = {k: v for k, v in rec.items() if k != "kernel_info"}
    ki = rec.get("kernel_info") or {}
    if ki:
        out["ptxas"] = {k: ki["ptxas"][k] for k in ("registers", "spill_stores", "spill_loads", "stack_bytes")}
        out["occupancy"] = ki["occupancy"]
        out["engine"] = ki["engine"]
    return strict(out)       # NaN / inf -> null, with the reason under "nonfinite"


def classify(exc: BaseException) -> GateError:
    """Map a megart error escaping the steps above to its exit code."""
    if isinstance(exc, GateError):
        return exc
    if isinstance(exc, CompileError):
        return GateError(COMPILE, "the kernel failed to compile", detail=str(exc))
    if isinstance(exc, ResidencyError):
        return GateError(RESIDENCY, str(exc))
    if isinstance(exc, HangError):
        return GateError(DEVICE, f"the kernel hung: {exc}")
    if isinstance(exc, DeviceError):
        return GateError(DEVICE, str(exc))
    if isinstance(exc, RegistryError):
        return GateError(INTERNAL, f"task registry error: {exc}")
    if isinstance(exc, GraphError):
        return GateError(BAD_SHAPE, str(exc))
    if isinstance(exc, MegartError):
        return GateError(INTERNAL, f"{type(exc).__name__}: {exc}")
    return GateError(INTERNAL, f"{type(exc).__name__}: {exc}")


__all__ = ["GateConfig", "Prepared", "prepare", "build", "compile_kernel", "check_output", "cpu_point", "gpu_point",
           "gpu_points", "gpu_usable", "format_table", "summary_json"]
