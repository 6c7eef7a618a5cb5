"""The Llama decode step under several kernel macro sets (weight engines), one process, one floor.

    PYTHONPATH=. python bench/stream_bench.py [--configs 1b] [--contexts 192,512] [--steps 200]
        [--phases | --waits | --occupancy] [--json out.json]
        [--variants "default;MEGART_STREAM_SLOTS=0;MEGART_STREAM_SLOTS=0,MEGART_DENSE_RING_SLOTS=3"]

Per config the weights and the KV prefix are made once; per variant (a MEGART_DEFINES-style list, or
`default` for none) the model is built with those macros, checked once against the reference, timed
(median us/step over --steps, CUDA events, after a warm-up) and then profiled (a second build with the
span recorder): per call kind, the wall, busiest-worker body time and the time workers waited before it;
with --phases the profiled build also stamps the phase marks (MEGART_PHASE_MARKS=1: its walls run a little
longer) and the body of each call's last-ending instance is split at them (dense types: x staged / dots
done; attention: K/V attended / partials stored and arrival counted; summed over layers; a variant with
MEGART_PHASE_MARKS=2 splits it at the first and the last compute warp to finish its dots instead); with
--waits it splits each streamed call's body by where the compute warps spent it instead
(MEGART_STREAM_WAITS=1): before their first weight stage (x staging, the input's wait), waiting for stages,
reading them (dots), the rest; with --occupancy (MEGART_STREAM_WAITS=2) it counts the stages each compute warp's
ring held, landed and issued, when the warp began reading each streamed instance (how far the stream ran ahead).
That per-call table is how the engines are compared: which calls got slower or faster, and whether the
difference is in the body (bytes arriving) or in the wait (the producer of the input). With --spans DIR the
profiled build's raw span records are saved there and bench/spans_report.py's tables printed (per worker, one
layer's calls, a layer's hops along the dependency chain). Model options beside the macros: deps, attn_merge
(auto, fused, call, direct), attn_chunks, tagged, tagged_attn, threads, tiles_<call> (instances of a call, e.g.
tiles_o=128; tiles_attn_width=2: q heads per instance of the direct form; e.g. --variants
"default;threads=384;attn_chunks=8").
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import spans_report  # noqa: E402
from llama_decode import (Timer, check_once, hbm_bandwidth, log, median, profiled_steps, time_megart,  # noqa: E402
                          time_megart_runs)
from megart.models import llama  # noqa: E402
from megart.models.llama_config import clone_kv  # noqa: E402


def parse_variant(text: str) -> dict:
    """"A=1,B" -> {A: "1", B: "1"}: MEGART_* names are kernel macros; `deps` (explicit / infer) is the
    model's dependency mode."""
    if text.strip() in ("", "default"):
        return {}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        out[name.strip()] = value.strip() or "1"
    return out


# attn_chunks: the model's tiles["attn_chunks"]; overlap=0: LlamaModel.overlap_steps off (each launch waits for the last)
MODEL_OPTIONS = ("deps", "attn_merge", "attn_chunks", "tagged", "tagged_attn", "threads", "overlap")
TILES_PREFIX = "tiles_"   # tiles_<call>=N: the model's tiles[<call>] (llama.default_tiles' keys, e.g. tiles_o=128)


def split_variant(variant: dict) -> tuple[dict, dict]:
    """(kernel macros, LlamaModel keyword options)."""
    keys = set(llama.default_tiles(llama.config("1b"), 132))
    tiles = {k[len(TILES_PREFIX):]: int(v) for k, v in variant.items() if k.startswith(TILES_PREFIX)}
    unknown = [k for k in variant if not k.startswith(("MEGART_", TILES_PREFIX)) and k not in MODEL_OPTIONS]
    unknown += [TILES_PREFIX + k for k in tiles if k not in keys]
    if unknown:
        raise SystemExit(f"stream_bench: {unknown} are neither MEGART_* macros nor model options {MODEL_OPTIONS} "
                         f"nor {TILES_PREFIX}<call> for a call in {sorted(keys)}")
    model = {k: v for k, v in variant.items() if k in MODEL_OPTIONS}
    if "threads" in model:
        model["threads"] = int(model["threads"])
    if "attn_chunks" in model:
        tiles["attn_chunks"] = int(model.pop("attn_chunks"))
    if tiles:
        model["tiles"] = tiles
    for k in ("tagged", "tagged_attn", "overlap"):   # tagged=1 / tagged_attn=0: the model's tagged vectors (megart/tagged.py)
        if k in model:
            model[k] = model[k] not in ("0", "false", "False")
    return {k: v for k, v in variant.items() if k.startswith("MEGART_")}, model


def records_by_kind(m, prof) -> tuple:
    """(the profile's records of the model's calls, each record's call kind)."""
    from megart.profile import INSTANCE
    rec = prof.records
    labels, call_of = m.call_index(int(rec[:, INSTANCE].max()) + 1 if len(rec) else 0)
    ci = call_of[rec[:, INSTANCE]]
    rec, ci = rec[ci >= 0], ci[ci >= 0]
    return rec, np.array([m.call_kind(labels[c]) for c in ci])


def stream_waits(m, prof) -> list:
    """Per call kind of a MEGART_STREAM_WAITS build, per step (summed over layers), us: the weight stages
    read, and the mean worker's body time split by its mean compute warp into before its first stage
    request (x staging, the input's wait), waiting for stages to land, reading them (dots), and the rest
    (epilogues, the end barrier)."""
    from megart.profile import BODY_BEGIN, BODY_END, stream_wait_parts
    rec, kinds = records_by_kind(m, prof)
    parts = stream_wait_parts(rec)
    body = rec[:, BODY_END] - rec[:, BODY_BEGIN]
    n_steps = max(1, len(prof.steps))
    per = n_steps * m.nw * (m.pk.threads // 32) * 1e3   # ns summed -> us per step for the mean warp of the mean worker
    out = []
    for kind in dict.fromkeys(kinds):
        sel = kinds == kind
        wait, read, before, stages = parts[sel].sum(axis=0)
        if stages == 0:
            continue
        b = body[sel].sum() / n_steps / m.nw / 1e3
        out.append(dict(kind=str(kind), stages=int(stages) / n_steps, body_per_worker_us=b,
                        before_first_us=before / per, stage_wait_us=wait / per, read_us=read / per,
                        rest_us=b - (before + wait + read) / per))
    return out


def stream_occupancy(m, prof) -> list:
    """Per call kind of a MEGART_STREAM_WAITS=2 build: what each compute warp's ring held when the warp began
    reading the instance's stages (csrc/weight_stream.cuh stream_read_begin), mean over warps and instances:
    stages already landed, and stages issued and not yet read (landed or in flight)."""
    from megart.profile import stream_wait_parts
    rec, kinds = records_by_kind(m, prof)
    landed, _, pending, warps = stream_wait_parts(rec).T
    out = []
    for kind in dict.fromkeys(kinds):
        sel = kinds == kind
        n = warps[sel].sum()
        if n:
            out.append(dict(kind=str(kind), warps=int(n), landed_per_warp=landed[sel].sum() / n,
                            issued_unread_per_warp=pending[sel].sum() / n))
    return out


def profile_calls(cfg, W, prefix, nw, defines, steps=6, spans: Path | None = None, model_kw=None) -> tuple:
    m, prof = profiled_steps(cfg, W, clone_kv(prefix), nw, steps, defines, **(model_kw or {}))
    if spans is not None:  # the raw records, with each instance's call label, for offline timelines
        labels, call_of = m.call_index()
        np.savez_compressed(spans, records=prof.records, call_of=call_of, labels=np.array(labels))
    mode = int(defines.get("MEGART_STREAM_WAITS", 0) or 0)
    waits = stream_waits(m, prof) if mode == 1 else stream_occupancy(m, prof) if mode == 2 else []
    return m.call_breakdown(prof), median(list(prof.step_walls() / 1e3)), waits


def at_context(cfg, context: int | None):
    """The config with `context` prefilled positions (None: as it is), keeping its decode headroom (max_seq -
    prefill): how a short-context form is swept across lengths (--contexts)."""
    if context is None:
        return cfg
    if context < 1:
        raise SystemExit(f"stream_bench: a context of {context} positions; give at least 1")
    return cfg.with_(name=f"{cfg.name}_ctx{context}", prefill=context, max_seq=context + cfg.max_seq - cfg.prefill)


def run_variant(cfg, W, prefix, nw, variant, steps, bw, profile=True, spans: Path | None = None,
                phases: bool = False, waits: int = 0) -> dict:
    defines, model_kw = split_variant(variant)
    overlap = model_kw.pop("overlap", True)
    timer = Timer(torch.device("cuda"))
    m = llama.LlamaModel(cfg, W, clone_kv(prefix), nw=nw, defines=defines, **model_kw)
    m.overlap_steps = overlap
    lay = m.pk.stream_layout()
    rec = dict(defines=defines, model=model_kw, registers=m.pk.report.registers, spill_bytes=m.pk.report.spill_bytes,
               smem_bytes=m.pk.smem_bytes(), stream_slots=lay.slots, stream_types=list(lay.types))
    rec["relerr_first_step"] = check_once(cfg, m, W, prefix)
    us = time_megart(m, timer, steps)
    m.sync()
    rec["megart_us"] = median(us)
    rec["megart_run_us"] = median(time_megart_runs(m, timer, min(steps, 100)))   # (no event between launches)
    m.sync()
    rec["floor_us"] = cfg.bytes_per_step(cfg.prefill + steps // 2) / bw * 1e6
    rec["x_floor"] = rec["megart_us"] / rec["floor_us"]
    del m
    if profile:
        marks = ({"MEGART_PHASE_MARKS": defines.get("MEGART_PHASE_MARKS", 1)} if phases
                 else {"MEGART_STREAM_WAITS": waits} if waits else {})
        rec["calls"], rec["profiled_step_wall_us"], rec["stream_waits"] = profile_calls(
            cfg, W, prefix, nw, {**defines, **marks}, spans=spans, model_kw={**model_kw, "overlap": overlap})
    torch.cuda.empty_cache()
    return rec


def calls_text(rec, phases: bool = False) -> str:
    head = "   last instance: to mark0 / to mark1 / to end" if phases else ""
    rows = [f"  {'kind':10s} {'wall':>8s} {'slowCTA':>8s} {'wait':>9s}{head}"]
    for c in rec.get("calls", []):
        ph = "   " + " / ".join(f"{x:6.1f}" for x in c.get("last_phases_us", ())) if phases else ""
        rows.append(f"  {c['kind']:10s} {c['wall_us']:8.1f} {c['slow_cta_us']:8.1f} {c['wait_us'] / 1:9.0f}{ph}")
    return "\n".join(rows)


def occupancy_text(rec) -> str:
    return "\n".join([f"  {'kind':10s} {'landed':>8s} {'unread':>8s}   (stages per warp as its reads begin)"] + [
        f"  {c['kind']:10s} {c['landed_per_warp']:8.2f} {c['issued_unread_per_warp']:8.2f}"
        for c in rec.get("stream_waits", [])])


def waits_text(rec) -> str:
    rows = [f"  {'kind':10s} {'stages':>7s} {'body/wkr':>9s} {'before':>8s} {'st.wait':>8s} {'dots':>8s} {'rest':>8s}"]
    for c in rec.get("stream_waits", []):
        rows.append(f"  {c['kind']:10s} {c['stages']:7.0f} {c['body_per_worker_us']:9.1f} {c['before_first_us']:8.1f} "
                    f"{c['stage_wait_us']:8.1f} {c['read_us']:8.1f} {c['rest_us']:8.1f}")
    return "\n".join(rows)


def spans_file(folder, name: str, variant: dict) -> Path:
    """The .npz for one config's variant in `folder`: letters, digits, '.', '_' and '-' only (a context's '@'
    and a macro's '=' become '-'), so copying tools that refuse other characters in names carry it."""
    tag = "_".join(f"{k}-{v}" for k, v in variant.items()) or "default"
    return Path(folder) / (re.sub(r"[^A-Za-z0-9._-]", "-", f"{name}_{tag}") + ".npz")


def run_logged(name, cfg, W, prefix, v, args, bw) -> dict:
    """One variant of one config, timed (and profiled unless --no-profile), its tables logged: its record."""
    variant = parse_variant(v)
    spans = None
    if args.spans:
        Path(args.spans).mkdir(parents=True, exist_ok=True)
        spans = spans_file(args.spans, name, variant)
    try:
        rec = run_variant(cfg, W, prefix, args.nw, variant, args.steps, bw, not args.no_profile, spans,
                          args.phases, 2 if args.occupancy else int(args.waits))
    except Exception as exc:   # one variant that does not build or run must not hide the others
        log(f"[{name}] {v or 'default'}: {type(exc).__name__}: {exc}")
        return dict(config=name, variant=variant, error=f"{type(exc).__name__}: {exc}")
    rec["config"] = name
    log(f"[{name}] {v or 'default'}: {rec['megart_us']:.1f} us/step ({rec['megart_run_us']:.1f} in runs "
        f"of back-to-back steps), {rec['x_floor']:.3f} x floor "
        f"(floor {rec['floor_us']:.0f}), relerr {rec['relerr_first_step']:.4f}, stream slots "
        f"{rec['stream_slots']}, {rec['registers']} regs")
    log(calls_text(rec, args.phases))
    if args.waits:
        log(waits_text(rec))
    if args.occupancy:
        log(occupancy_text(rec))
    if spans is not None and spans.is_file():   # per worker, one layer, a layer's hops (bench/spans_report.py)
        log(spans_report.report(spans))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1b")
    ap.add_argument("--variants", default="default;MEGART_STREAM_SLOTS=0")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--nw", type=int, default=None)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--phases", action="store_true",
                    help="profile with the phase marks on and print each call's last instance split at them")
    ap.add_argument("--waits", action="store_true",
                    help="profile with MEGART_STREAM_WAITS=1 and print each streamed call's body split by where the "
                         "compute warps spent it")
    ap.add_argument("--occupancy", action="store_true",
                    help="profile with MEGART_STREAM_WAITS=2 and print how many of each warp's weight stages had "
                         "landed (and were issued) when it began reading each streamed call's instance")
    ap.add_argument("--contexts", default=None,
                    help="prefilled positions to run each config at, e.g. 192,256,512 (default: the config's own)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--spans", default=None, help="folder for each variant's raw span records (.npz)")
    args = ap.parse_args(argv)
    if args.phases + args.waits + args.occupancy > 1:
        ap.error("--phases, --waits and --occupancy all use the span records' mark words: choose one")
    if not torch.cuda.is_available():
        log("stream_bench times the GPU; no CUDA device here")
        return 2
    bw, how = hbm_bandwidth(torch.device("cuda"))
    log(f"HBM read bandwidth {bw / 1e12:.3f} TB/s ({how})")
    out = dict(bandwidth=bw, bandwidth_how=how, results=[])
    try:
        contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [None]
    except ValueError:
        ap.error(f"--contexts takes positions, e.g. 192,256,512; got {args.contexts!r}")
    for config_name in args.configs.split(","):
        W = None   # (one shape's weights serve every context)
        for context in contexts:
            cfg = at_context(llama.config(config_name), context)
            W = W if W is not None else llama.make_weights(cfg, 0, torch.device("cuda"))
            prefix = llama.make_kv_cache(cfg, 1, torch.device("cuda"))
            name = config_name if context is None else f"{config_name}@{context}"
            for v in args.variants.split(";"):
                out["results"].append(run_logged(name, cfg, W, prefix, v, args, bw))
            del prefix
        del W
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
