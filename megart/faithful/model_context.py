"""--context llama_<config>: the task under test inside the whole Llama decode megakernel
(megart.models.llama), with all its co-resident tasks, at the model's own tiling for the worker count.

* The model is built with compile=False, the candidate body is overlaid for the task type under test
  (pk.source_overrides), and then compiled: one kernel, every other task in-tree.
* The calls under test are the model's calls of that task type (a model calls gemv_m1 for o_proj and
  down_proj: two shapes). --shape picks one; without it every shape present gets its own result.
* Correctness, two checks, both must pass (cosine >= 0.99):
  1. in context: after the first step, every instance of the calls under test is recomputed on the CPU
     with the task's reference from the very buffers the GPU step read (the model's residual stream is
     single-assignment, so inputs are intact after the step) and compared on exactly the elements it
     writes. This catches a wrong candidate directly, where its error cannot be absorbed downstream.
  2. the model's output (logits, or a block's residual stream) against the PyTorch reference model
     (megart.models.reference), reported with the full-output relative error.
* Timing: `iters` steps, each at the same position (pos is reset between launches, so the attention
  length does not creep), L2 flushed between steps like the isolated gate; spans are matched by the
  task's numeric id and by the instance ids of the calls under test; one sample per (step, call).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from .. import tagged
from ..errors import GraphError
from ..tensors import TensorRef
from .codes import BAD_SHAPE, DEVICE, INCORRECT, GateError
from .context_names import llama_configs, unknown

COS_MIN = 0.99


def resolve(name: str):
    if not name.startswith("llama_"):
        raise unknown(name, "not 'isolated' and not a known model (llama_<config>)")
    key = name[len("llama_"):]
    configs = llama_configs()
    if key not in configs:
        raise unknown(name, f"no Llama config {key!r} (configs: {', '.join(sorted(configs)) or 'none'})")
    return LlamaContext(name, key)


class LlamaContext:
    def __init__(self, name: str, key: str):
        self.name = name
        self.key = key

    def config(self):
        from ..models.llama_config import config
        return config(self.key)

    # --- building -------------------------------------------------------------------------------
    def _tiles(self, p, cfg, nw: int) -> dict:
        from ..models.llama import default_tiles
        base = default_tiles(cfg, nw)
        out = {}
        for k in p.spec.model_tiles:
            if k not in base:
                continue
            prod = p.cfg.tiles if p.cfg.tiles is not None else base[k]
            out[k] = p.cand.tiles(prod)
        return out

    def build_model(self, p, nw: int, iters: int, device: str, cfg=None, init: str = "random"):
        from ..models.llama import LlamaModel
        cfg = cfg or self.config()
        try:
            m = LlamaModel(cfg, device=device, nw=nw, seed=p.cfg.seed, init=init, tiles=self._tiles(p, cfg, nw),
                           profile=True, profile_steps=max(1, iters), compile=False,
                           sm_count=p.cfg.sm_count if device == "cpu" else None)
        except (GraphError, ValueError) as exc:
            raise GateError(BAD_SHAPE, f"{self.name} cannot be built at nw={nw} with the tiling asked: {exc}") from None
        # LlamaModel takes no source_overrides: set them on its kernel before compiling (the tree is never
        # written; the overlay only changes what codegen reads for this task type)
        m.pk.source_overrides = {**m.pk.source_overrides, **p.cand.overrides()}
        from .run import compile_kernel
        compile_kernel(p, SimpleNamespace(pk=m.pk))
        if device == "cpu":
            m._host = {name: t.data for name, t in m.pk.graph.tensors.items()}
        return m

    def calls_by_shape(self, p, m) -> dict:
        """{shape tuple: [(label, group), ...]} of the model's calls of the task under test."""
        out: dict = {}
        for label, g in m.groups.items():
            if g.type.name != p.cfg.task:
                continue
            out.setdefault(self.call_shape(p, m, g), []).append((label, g))
        if not out:
            raise GateError(BAD_SHAPE, f"{self.name} has no calls of task {p.cfg.task!r}; its calls use: "
                                       f"{', '.join(sorted({g.type.name for g in m.groups.values()}))}.")
        if p.cfg.shape is not None:
            want = p.shape
            if want not in out:
                have = "; ".join(f"{p.spec.shape_str(s)} ({len(v)} calls: {v[0][0]}, ...)" for s, v in out.items())
                raise GateError(BAD_SHAPE, f"{self.name} has no {p.cfg.task} call of shape {p.shape_str}; it has "
                                           f"{have}. Pass one of those with --shape, or none for all.")
            out = {want: out[want]}
        return out

    def call_shape(self, p, m, g) -> tuple:
        """The gate spec's shape of one model call (GateSpec.model_shape); the requested shape without one."""
        if p.spec.model_shape is None:
            return tuple(p.shape)
        return tuple(int(v) for v in p.spec.model_shape(m, [m.pk.graph.instances[u] for u in g.uids]))

    def call_bytes(self, p, m, groups, pos: int) -> int | None:
        """Bytes one call of `groups` moves, from the task type's cost model (its call's own arguments).
        Attention's model reads the KV length from the device pos, so this runs after the timed steps, when
        pos holds the position they ran at; it is checked rather than assumed. Calls of one shape move the
        same bytes in a Llama graph; were they to differ, the figure is their mean."""
        if p.ttype.cost is None:
            return None
        at = int(m.pos.reshape(-1)[0].item())
        if at != pos:
            raise RuntimeError(f"{self.name}: the device pos is {at}, not the timed position {pos}: the "
                               "cost model would count another KV length")
        costs = [int(g.cost().bytes) for _, g in groups]
        return round(sum(costs) / len(costs))

    # --- correctness --------------------------------------------------------------------------------
    def incontext_check(self, p, m, uids) -> dict:
        """Recompute every instance of the calls under test from the buffers the step read (see module doc)."""
        ttype = p.ttype
        insts = [m.pk.graph.instances[u] for u in uids]
        pristine, sentinel = {}, {}

        def host(t):   # (a tagged tensor's values: the references read and write values, never tags)
            if t.name not in pristine:
                data = tagged.values(t.data.detach()) if t.tagged else t.data.detach()
                pristine[t.name] = data.to("cpu").contiguous().clone().view(-1)
            return pristine[t.name]

        for inst in insts:
            for prm in ttype.params:
                v = inst.params[prm.name]
                if isinstance(v, TensorRef) and prm.writes:
                    if v.tensor.name not in sentinel:
                        sentinel[v.tensor.name] = host(v.tensor).clone()
                    s = sentinel[v.tensor.name]
                    if s.is_floating_point():
                        s[v.offset:v.offset + v.count] = float("nan")
        with torch.no_grad():
            for inst in insts:
                ns = {}
                for prm in ttype.params:
                    v = inst.params[prm.name]
                    if isinstance(v, TensorRef):
                        base = sentinel[v.tensor.name] if prm.writes else host(v.tensor)
                        ns[prm.name] = base[v.offset:v.offset + v.count]
                    else:
                        ns[prm.name] = v
                ttype.reference(SimpleNamespace(**ns))
        got, ref = [], []
        for name, s in sentinel.items():
            if not s.is_floating_point():
                continue
            mask = ~torch.isnan(s)
            written = torch.zeros_like(mask)
            for inst in insts:
                for prm in ttype.params:
                    v = inst.params[prm.name]
                    if isinstance(v, TensorRef) and prm.writes and v.tensor.name == name:
                        written[v.offset:v.offset + v.count] = True
            sel = mask & written
            got.append(pristine[name][sel].double())
            ref.append(s[sel].double())
        g, r = torch.cat(got), torch.cat(ref)
        return _cos_dict(g, r, f"{g.numel()} elements the {len(insts)} instances under test write, recomputed "
                               "on the CPU from the buffers the GPU step read")

    def model_check(self, m, out, cfg, inp, pos) -> dict:
        try:
            from ..models.reference import Reference
        except Exception as exc:       # the reference model is optional for the gate
            return {"available": False, "why": str(exc)}
        try:
            ref = self._reference
            got = ref.step(inp, pos)
        except Exception as exc:
            return {"available": False, "why": f"{type(exc).__name__}: {exc}"}
        d = _cos_dict(out.detach().double().cpu().reshape(-1), got.detach().double().cpu().reshape(-1),
                      "the model output (" + ("block residual stream" if cfg.block else "f32 logits") + ")")
        d["available"] = True
        return d

    # --- the two paths ------------------------------------------------------------------------------
    def gpu_points(self, p, nw: int, floor: dict, say) -> list:
        from .floor import L2Flush
        from . import run
        from .run import base_fields, kernel_info, ptxas_text
        from .stats import pool_runs, task_timings
        cfg_m = self.config()
        t0 = time.monotonic()
        m = self.build_model(p, nw, p.cfg.iters, run.BUILD_DEVICE, cfg_m)
        info = kernel_info(SimpleNamespace(pk=m.pk))
        say(f"{self.name}: {m.describe()} (built and compiled in {time.monotonic() - t0:.1f} s)")
        say(ptxas_text(info, nw))
        shapes = self.calls_by_shape(p, m)
        from ..models.llama_config import make_inputs
        inp = make_inputs(cfg_m, 1, device=m.device)
        inp = inp[0] if cfg_m.block else inp
        pos = cfg_m.prefill
        try:
            from ..models.reference import Reference
            self._reference = Reference(cfg_m, m.weights, m.kv, precision="bf16")   # copies the caches first
        except Exception as exc:
            self._reference = None
            say(f"note: the PyTorch reference model is unavailable ({type(exc).__name__}: {exc}); the in-context "
                "check still gates")
        try:
            m.reset(pos, None if cfg_m.block else int(inp))
            if cfg_m.block:
                m.x_in.copy_(inp.reshape(-1))
            m.pk.launch()                                # step 1: correctness
            m.pk.check()
            torch.cuda.synchronize(m.device)
            out = (m.x_out if cfg_m.block else m.logits).clone()
            uids = [u for groups in shapes.values() for _, g in groups for u in g.uids]
            corr = self.incontext_check(p, m, uids)
            mc = self.model_check(m, out, cfg_m, inp, pos) if self._reference is not None else \
                {"available": False}
            corr["model"] = mc
            if mc.get("available") and not mc["pass"]:
                corr["pass"] = False
            corr["where"] = "gpu, in context"
            say(f"correctness in context: cos {corr['cos']:.6f}, rel err {corr['rel_err']:.3g} on {corr['live']} "
                f"-> {'PASS' if corr['pass'] else 'FAIL'}")
            if mc.get("available"):
                say(f"model output vs PyTorch reference: cos {mc['cos']:.6f}, rel err {mc['rel_err']:.3g} "
                    f"({'PASS' if mc['pass'] else 'FAIL'})")
            recs = []
            if not corr["pass"]:
                for shape, groups in shapes.items():
                    rec = base_fields(p, nw, self.name, shape=p.spec.shape_str(shape))
                    rec.update(correctness=corr, timings=None, kernel_info=info)
                    recs.append(rec)
                err = GateError(INCORRECT, f"{p.cand.describe()} is WRONG inside {self.name}: cosine "
                                           f"{corr['cos']:.6f} (model output: {mc.get('cos', 'n/a')}) < {COS_MIN}. "
                                           "A failing candidate gets no timing.")
                err.record = recs[0]
                err.records = recs
                raise err
            flush = L2Flush(m.device) if p.cfg.l2 == "cold" else (lambda: None)
            for _ in range(p.cfg.warmup):
                m.reset(pos)
                flush()
                m.pk.launch()
            m.pk.check()
            profs = []
            for _ in range(p.cfg.repeats):      # repeats are separate timed blocks of the same kernel here
                m.pk.reset_profile(p.cfg.iters)
                for _ in range(p.cfg.iters):
                    m.reset(pos)
                    flush()
                    m.pk.launch()
                m.pk.check()
                profs.append(m.pk.profile())
        except GateError:
            raise
        except Exception as exc:
            from ..errors import HangError
            kind = "hung" if isinstance(exc, HangError) else "failed"
            raise GateError(DEVICE, f"the {self.name} megakernel {kind}: {exc}") from None
        overflow = sum(pr.overflow for pr in profs)
        if overflow:
            say(f"WARNING: {overflow} span records were dropped (profile buffer full): timings are partial")
        dev = torch.cuda.get_device_properties(m.device)
        recs = []
        for shape, groups in shapes.items():
            runs = [task_timings(pr.records, p.ttype.id, [g.uids for _, g in groups], p.cfg.task) for pr in profs]
            t = runs[-1]
            rec = base_fields(p, nw, self.name, shape=p.spec.shape_str(shape))
            tiles = [len(g.uids) for _, g in groups]
            rec.update(kernel_info=info, device=dev.name, correctness=corr, iters=p.cfg.iters,
                       warmup=p.cfg.warmup, l2=p.cfg.l2, repeats=p.cfg.repeats, floor_bw=floor.get("floor_bw"),
                       floor_method=floor.get("floor_method"), tiles=tiles[0], instances=tiles[0],
                       calls_under_test=[lab for lab, _ in groups], model=m.describe(),
                       bytes=self.call_bytes(p, m, groups, pos), timings=pool_runs(runs),
                       samples=sum(r["samples"] for r in runs), steps=sum(r["steps"] for r in runs),
                       calls=t["calls"], ctas_per_step=t["ctas_per_step"], instances_per_call=t["instances_per_call"],
                       span_overflow=overflow,
                       step_wall_us=float(np.median(np.concatenate([pr.step_walls() for pr in profs])) / 1e3))
            wall = rec["timings"]["wall"]["median"]
            if rec["bytes"] and wall > 0:
                rec["bw_wall"] = rec["bytes"] / (wall * 1e-9)
                if floor.get("floor_bw"):
                    rec["x_floor"] = (wall * 1e-9) / (rec["bytes"] / floor["floor_bw"])
            recs.append(rec)
        return recs

    def cpu_point(self, p, nw: int, say) -> dict:
        """Compile the full model's kernel with the overlay (compile-only build, no data), then emulate the
        reduced 'tiny' config and check its output against the PyTorch reference model."""
        from ..models.llama_config import config, make_inputs
        from .run import base_fields, kernel_info, ptxas_text
        cfg_m = self.config()
        t0 = time.monotonic()
        m = self.build_model(p, nw, 1, "cpu", cfg_m, init="empty")
        info = kernel_info(SimpleNamespace(pk=m.pk))
        say(f"{self.name}: {m.describe()} (compile-only build in {time.monotonic() - t0:.1f} s)")
        say(ptxas_text(info, nw))
        shapes = self.calls_by_shape(p, m)
        say("calls under test: " + "; ".join(f"{p.spec.shape_str(s)}: {len(v)} calls ({v[0][0]}, ...)"
                                               for s, v in shapes.items()))
        small = config("tiny")
        if cfg_m.name != small.name:
            say(f"emulating the REDUCED model 'tiny' ({small.layers} layers, d {small.d}): the CPU emulator would "
                f"take too long on {cfg_m.name}; the GPU run uses {cfg_m.name}.")
        mt = self.build_model(p, min(nw, 16), 1, "cpu", small)
        try:
            from ..models.reference import Reference
            self._reference = Reference(small, mt.weights, mt.kv, precision="bf16")
        except Exception as exc:
            self._reference = None
            say(f"note: the PyTorch reference model is unavailable ({type(exc).__name__}: {exc})")
        inp = make_inputs(small, 1)
        inp = inp[0] if small.block else inp
        res = mt.step(inp, small.prefill)
        out = res if small.block else res[0]
        mc = self.model_check(mt, out, small, inp, small.prefill) if self._reference is not None else \
            {"available": False}
        corr = {"where": "cpu-emulator (tiny model)", "model": mc, "pass": mc.get("pass", True),
                "cos": mc.get("cos"), "rel_err": mc.get("rel_err"), "live": mc.get("live", "model output")}
        ok_word = "PASS" if p.cand.is_baseline else "agree"
        if mc.get("available"):
            say(f"emulated tiny model vs PyTorch reference: cos {mc['cos']:.6f}, rel err {mc['rel_err']:.3g} -> "
                f"{ok_word if mc['pass'] else 'FAIL'}")
        corr.update(body_checked=False, body_why="the model context emulates the tasks' CPU references; the CUDA "
                    "bodies are only compiled into the model's kernel")
        if not p.cand.is_baseline:       # the candidate's body never ran: not a pass
            say("candidate CUDA body: NOT CHECKED in a model context on a CPU (only compiled into the model's "
                "kernel); no pass is recorded. Its numerics are checked on a GPU.")
            corr["reference_pass"] = corr["pass"]
            corr["pass"] = None if corr["pass"] else False
        rec = base_fields(p, nw, self.name, shape=";".join(p.spec.shape_str(s) for s in shapes))
        rec.update(kernel_info=info, correctness=corr, timings=None, device="cpu (emulator)", emulated=True,
                   model=m.describe())
        if corr["pass"] is False:
            err = GateError(INCORRECT, f"the emulated tiny model disagrees with the PyTorch reference (cos "
                                       f"{mc.get('cos')}).")
            err.record = rec
            raise err
        return rec


def _cos_dict(g: torch.Tensor, r: torch.Tensor, live: str) -> dict:
    finite = bool(torch.isfinite(g).all())
    ng, nr = float(g.norm()), float(r.norm())
    if not finite:
        cos = float("nan")
    elif ng == 0 and nr == 0:
        cos = 1.0
    elif ng == 0 or nr == 0:
        cos = 0.0
    else:
        cos = float(torch.dot(g, r) / (ng * nr))
    rel = float((g - r).norm() / max(nr, 1e-300)) if finite else float("nan")
    return {"cos": cos, "rel_err": rel, "max_abs_err": float((g - r).abs().max()) if finite and g.numel() else 0.0,
            "live": live, "elements": int(g.numel()), "finite": finite, "threshold": COS_MIN,
            "pass": finite and cos >= COS_MIN}
