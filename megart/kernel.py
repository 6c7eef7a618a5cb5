"""PersistentKernel: build a task graph, then compile it into one persistent megakernel and run it.

    pk = megart.PersistentKernel(nw=132)
    x = pk.tensor(torch_or_cupy_array)
    pk.task("axpy", y=y, x=x, a=2.0, tiles=132)
    pk.compile()          # schedule -> verify -> codegen -> NVRTC (cached) -> load, co-residency check
    pk()                  # one launch = one step; call again for the next step, no reset launch
    pk.profile().by_task("axpy")
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import codegen, config, occupancy, options, registry, stream
from .compile import Compiled, compile_source
from .emulate import emulate as _emulate
from .errors import DeviceError, GraphError, HangError
from .graph import Graph
from .layout import CTRL, SPAN_WORDS
from .nvtx_ranges import ranged
from .schedule import Schedule, build
from .verify import verify as _verify

DEFAULT_ARCH = "sm_90a"
DEFAULT_CPU_SMS = 132   # the H200 this project targets, used when there is no GPU to ask


class PersistentKernel:
    """A graph of task instances run by `nw` co-resident worker CTAs in one launch per step."""

    def __init__(self, nw: int | None = None, *, device=None, arch: str | None = None, threads: int = 256,
                 profile: bool = False, profile_steps: int = 16, watchdog_s: float | None = None,
                 source_overrides: dict | None = None, sm_count: int | None = None, defines: dict | None = None,
                 peers=None):
        """peers: this kernel's rank of a tensor-parallel group (megart.peer_memory): its graph may then
        declare peer events (peer_event) that other ranks count up (docs/TP.md)."""
        sm_count = options.check_sm_count(sm_count)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError("device='cuda' but no CUDA device is visible")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            props = torch.cuda.get_device_properties(self.device)
            self.sm_count = props.multi_processor_count
            self.arch = arch or f"sm_{props.major}{props.minor}" + ("a" if props.major >= 9 else "")
        elif self.device.type == "cpu":
            self.sm_count = sm_count or DEFAULT_CPU_SMS
            self.arch = arch or DEFAULT_ARCH
        else:
            raise DeviceError(f"unsupported device {device!r}: use 'cuda' (or 'cpu' for emulation only)")
        self.nw = self.sm_count if nw is None else nw
        if not isinstance(self.nw, int) or self.nw < 1:
            raise GraphError(f"nw must be a positive int, got {nw!r}")
        if threads % 32 or not 32 <= threads <= 1024:
            raise GraphError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
        if profile_steps < 1:
            raise GraphError(f"profile_steps must be >= 1, got {profile_steps}")
        self.threads = threads
        self.profiling = profile
        self.profile_steps = profile_steps
        self.watchdog_s = options.watchdog_default() if watchdog_s is None else float(watchdog_s)
        if not 0 < self.watchdog_s < 3600:
            raise GraphError(f"watchdog_s must be in (0, 3600), got {self.watchdog_s}")
        self.source_overrides = options.check_overrides(source_overrides or {})
        self.defines = options.check_defines(defines or {})   # tuning macros (see codegen.env_defines)
        self.stream_declined = None   # why MEGART_STREAM_SLOTS=auto fell back to registers (compile), or None
        self.stream_shallower = None  # the slots "auto" settled on when its first depth did not fit (compile)
        self.queue_bounds_smem = False  # "auto" kept the worker's queue bounds in shared memory to stream (compile)
        codegen.env_defines()                # a malformed MEGART_DEFINES fails here, naming itself
        self.peers = peers
        rank, world = (peers.rank, peers.world) if peers is not None else (0, 1)
        self.graph = Graph(self.nw, self.device, rank, world)
        self.schedule: Schedule | None = None
        self.compiled: Compiled | None = None
        self.source = None
        self.occupancy: occupancy.Occupancy | None = None
        self._rt = None
        self._overlap_ok = False   # a launch may overlap only one of this kernel's own (order_next_launch)

    # --- graph building (delegates to Graph, refused once compiled) -------------------------------
    def _building(self):
        if self.schedule is not None:
            raise GraphError("the kernel is compiled; build a new PersistentKernel to change the graph")
        return self.graph

    def tensor(self, obj, name: str | None = None, tagged: bool = False):
        """Add an array the tasks may read or write (tagged=True: see megart/tagged.py)."""
        return self._building().tensor(obj, name, tagged)

    def event(self, name: str | None = None):
        return self._building().event(name)

    def task(self, task, **kw):
        return self._building().task(task, **kw)

    def barrier(self):
        return self._building().barrier()

    def peer_event(self, name: str):
        return self._building().peer_event(name)

    # --- compile ----------------------------------------------------------------------------------
    @property
    def task_types(self) -> list:
        return sorted({i.type.id: i.type for i in self.graph.instances}.values(), key=lambda t: t.id)

    def kernel_config(self) -> codegen.KernelConfig:
        """What the generated source is specialised on (CTA size, CTAs per SM, profiling, macros)."""
        defines = self.defines
        if self.stream_declined or self.stream_shallower is not None:
            defines = {**defines, "MEGART_STREAM_SLOTS": "0" if self.stream_declined else str(self.stream_shallower)}
        if self.queue_bounds_smem:
            defines = {**defines, "MEGART_QUEUE_BOUNDS_SMEM": 1}
        defines = {**self._instance_macros(), **defines}
        cfg = codegen.KernelConfig(threads=self.threads, profile=self.profiling,
                                   min_blocks=max(1, math.ceil(self.nw / self.sm_count)), defines=defines,
                                   tp=self.graph.world if self.graph.peer_events else 1)
        if config.macro_on(cfg, "MEGART_SPECIALIZE"):   # (opt-in: see docs/ARCHITECTURE.md)
            skip = options.specialize_skip(config.caller_macros(cfg).get("MEGART_SPECIALIZE_SKIP", ""))
            cfg.constants = {t: {k: v for k, v in c.items() if t not in skip and f"{t}.{k}" not in skip}
                             for t, c in self._uniform_scalars().items()}
        return cfg

    def _params_by_type(self) -> list:
        """[(task type, [params of each of the graph's instances of it, in program order])], by type id."""
        by_id = {}
        for i in self.graph.instances:
            by_id.setdefault(i.type.id, (i.type, []))[1].append(i.params)
        return [by_id[k] for k in sorted(by_id)]

    def _uniform_scalars(self) -> dict:
        """{type name: {scalar: value}} for each scalar param every instance of the type gives one value."""
        out = {}
        for t, insts in self._params_by_type():
            same = {}
            for p in t.params:
                if p.kind == "ptr":
                    continue
                vals = {i.get(p.name) for i in insts}
                if len(vals) == 1 and None not in vals:
                    same[p.name] = vals.pop()
            if same:
                out[t.name] = same
        return out

    def _instance_macros(self) -> dict:
        """The macros the graph's instances ask their types for (TaskType.macros_for); where two types ask for
        one macro, the larger value (each is a code path some instance needs: 1 = compiled in)."""
        out = {}
        for t, insts in self._params_by_type():
            if t.macros_for:
                for name, value in t.macros_for(insts, self.threads).items():
                    out[name] = max(out.get(name, value), value)
        return out

    def stream_layout(self) -> stream.StreamLayout:
        """The weight stream's ring in this kernel (megart/stream.py): slots per warp, offset, types."""
        return stream.layout(self.task_types, self.kernel_config(), self.source_overrides)

    def smem_bytes(self) -> int:
        """Dynamic shared memory: the largest instance's, then the weight stream's ring."""
        cfg = self.kernel_config()
        per_instance = max([t.shared_bytes(cfg) for t in self.task_types] + [0])
        lay = self.stream_layout()
        return lay.offset + lay.ring_bytes(self.threads) if lay.slots else per_instance

    @ranged("megart.compile")
    def compile(self, verify: bool = True) -> "PersistentKernel":
        """Schedule, verify (unless told not to: tests of the watchdog), generate, compile and, on a
        GPU, load and check co-residency. Raises before any launch if anything would fail."""
        schedule = build(self.graph)
        if verify:
            _verify(schedule)
        self.stream_declined = self.stream_shallower = None
        self.queue_bounds_smem = False
        cfg = self.kernel_config()
        self.source = codegen.generate(self.task_types, cfg, self.source_overrides)
        self.compiled = compile_source(self.source, self.arch)
        auto = stream.chosen_automatically(self.task_types, cfg, self.source_overrides)
        if auto and self.compiled.report.spill_bytes and "MEGART_QUEUE_BOUNDS_SMEM" not in config.caller_macros(cfg):
            # what such a build spills first is the worker's queue bounds, held in registers across every body (36
            # bytes at the 168-register cap): kept in shared memory instead (before the ring's depth is settled:
            # they add static shared memory), the small, 3b and qwen3_0.6b models stream with no spill
            # (bench/RESULTS.md, thirty-seventh session)
            self.queue_bounds_smem = True
            self.source = codegen.generate(self.task_types, self.kernel_config(), self.source_overrides)
            self.compiled = compile_source(self.source, self.arch)
        while auto and self.compiled.report.smem_bytes + self.smem_bytes() > stream.SMEM_PER_BLOCK:
            # "auto" sized the ring against an estimate of the static shared memory; a build whose static
            # memory came out larger gets one slot fewer (down to the least depth auto streams with)
            slots = self.stream_layout().slots - 1
            if slots < stream.MIN_AUTO_SLOTS:
                break
            self.stream_shallower = slots
            self.source = codegen.generate(self.task_types, self.kernel_config(), self.source_overrides)
            self.compiled = compile_source(self.source, self.arch)
        if self.compiled.report.spill_bytes and auto:
            # "auto" streams only a kernel that compiles without spills: the compute warps' share of the
            # registers beside the producer warpgroup (232) can spill a kernel the register engine does not
            self.queue_bounds_smem = False
            self.stream_declined = f"the stream build spilled {self.compiled.report.spill_bytes} bytes"
            self.source = codegen.generate(self.task_types, self.kernel_config(), self.source_overrides)
            self.compiled = compile_source(self.source, self.arch)
        r = self.compiled.report
        smem = self.smem_bytes()
        block = self.stream_layout().block_threads(self.threads)   # + the producer warp, with a stream
        self.occupancy = occupancy.blocks_per_sm(r.registers, block, r.smem_bytes + smem,
                                                 occupancy.limits_for(self.arch, self.sm_count))
        occupancy.check(self.nw, self.occupancy, self.sm_count)
        self.schedule = schedule
        if self.device.type == "cuda":
            from .launch import DeviceRuntime
            events, bases = (None, ())
            if self.graph.peer_events:     # counters the peers count up live in peer-mapped memory
                events, bases = self.peers.event_buffer(len(schedule.events), self.device)
            self._rt = DeviceRuntime(self.compiled.cubin, schedule, self.device, block, smem, events, bases)
            driver_fit = self._rt.driver_blocks_per_sm(block)
            if driver_fit < self.occupancy.per_sm:
                self.occupancy = occupancy.Occupancy(driver_fit, self.occupancy.limiter + " (driver)",
                                                     self.occupancy.detail)
            occupancy.check(self.nw, self.occupancy, self.sm_count)
            if self.profiling:
                self._rt.set_span_buffer(self.profile_steps, 1)
        return self

    @property
    def report(self):
        """ptxas resource report of the compiled kernel (registers, spills, stack, shared memory)."""
        self._need_compiled()
        return self.compiled.report

    def _need_compiled(self):
        if self.schedule is None:
            raise GraphError("call compile() first")

    def _need_gpu(self):
        self._need_compiled()
        if self._rt is None:
            raise DeviceError("this kernel was built without a CUDA device: it can compile, verify and "
                              "emulate(), but running it needs a GPU")

    # --- run ----------------------------------------------------------------------------------------
    @ranged("megart.launch")
    def launch(self, overlap: bool = False) -> None:
        """Enqueue one step on the current torch stream and return at once (no error check). overlap=True lets
        the step start while the work before it on the stream finishes (programmatic dependent launch): its
        weight stream begins early and everything else waits for that work to end, so the caller promises that
        the work before it writes no weight this kernel streams (a previous step of it never does)."""
        self._need_gpu()
        self._rt.launch(int(self.watchdog_s * 1e9), overlap and self._overlap_ok)
        self._overlap_ok = True

    def order_next_launch(self) -> None:
        """The next launch waits for everything before it on the stream, even if asked to overlap: call it after
        writing a weight the kernel streams (LlamaModel.reset does)."""
        self._overlap_ok = False

    @ranged("megart.check")
    def check(self) -> int:
        """Wait for enqueued steps (bounded), raise HangError if a watchdog fired; return the step count."""
        self._need_gpu()
        ctrl = self._rt.wait(timeout_s=self.watchdog_s * 2 + 10)
        if ctrl[CTRL["abort"]]:
            rec = self._hang_record(ctrl)
            self._rt.reset_after_abort()
            self._overlap_ok = False   # (the reset's writes, which the producer's abort check reads, come first)
            peer = ""
            if rec["peer"]:
                peer = (f" It is a peer event: rank {self.graph.rank}'s peers count it up, so a peer died, stalled or "
                        "never launched this step. Reset every rank (megart.models.llama_tp.reset_group) before "
                        "the next step.")
            raise HangError(
                f"watchdog: worker {rec['worker']} waited over {self.watchdog_s:g} s at queue position "
                f"{rec['queue_pos']} ({rec['task']}#{rec['instance']}) on event {rec['event']} "
                f"{rec['event_name']!r}: have {rec['have']}, need {rec['need']}. All workers returned; "
                "the counters were reset, so the next launch starts from step 1." + peer, record=rec)
        return int(ctrl[CTRL["step"]])

    def __call__(self, steps: int = 1) -> int:
        """Run `steps` steps (one launch each, each after the first overlapping the previous one's end), then
        check; returns the number of completed steps."""
        for i in range(steps):
            self.launch(overlap=i > 0)
        return self.check()

    def _hang_record(self, ctrl: np.ndarray) -> dict:
        ev = int(ctrl[CTRL["hang_event"]])
        tid = int(ctrl[CTRL["hang_type"]])
        try:
            name = registry.get(tid).name
        except Exception:
            name = f"task{tid}"
        events = self.schedule.events
        return dict(worker=int(ctrl[CTRL["hang_worker"]]), queue_pos=int(ctrl[CTRL["hang_queue_pos"]]),
                    task=name, task_id=tid, instance=int(ctrl[CTRL["hang_instance"]]), event=ev,
                    event_name=events[ev].name if 0 <= ev < len(events) else stream.hang_site(ev),
                    peer=bool(0 <= ev < len(events) and events[ev].peer),
                    have=int(ctrl[CTRL["hang_have"]]), need=int(ctrl[CTRL["hang_need"]]))

    @property
    def step(self) -> int:
        """Completed steps (read from the device)."""
        self._need_gpu()
        return int(self._rt.ctrl[CTRL["step"]].item())

    # --- emulate / profile --------------------------------------------------------------------------
    @ranged("megart.emulate")
    def emulate(self, steps: int = 1, seed: int = 0, host: dict | None = None) -> dict:
        """Run the compiled schedule on the CPU with each task's reference; {tensor name: CPU tensor}."""
        self._need_compiled()
        return _emulate(self.schedule, steps, seed, host)

    def emulated_profile(self, **model):
        """A Profile of one step of this schedule on a timing model (no GPU needed; labelled EMULATED, never
        measured): see megart.emulated_spans for the model and its knobs."""
        from .emulated_spans import emulated_profile
        return emulated_profile(self, **model)

    def reset_profile(self, steps: int | None = None) -> None:
        """Record the next `steps` steps (default profile_steps) into a cleared span buffer."""
        self._need_gpu()
        if not self.profiling:
            raise GraphError("profiling is compiled out; build the kernel with profile=True")
        torch.cuda.synchronize(self.device)
        self.profile_steps = steps or self.profile_steps
        self._rt.set_span_buffer(self.profile_steps, self.step + 1)

    @ranged("megart.profile_readback")
    def profile(self):
        """Spans of the recorded steps as a megart.profile.Profile (per task type by numeric id). Needs a
        GPU; without one, emulated_profile() gives modelled (never measured) spans of the same schedule."""
        from .profile import Profile
        self._need_compiled()
        if self._rt is None:
            raise DeviceError("profile() reads the spans a GPU recorded, and this kernel has no GPU; "
                              "emulated_profile() gives modelled spans of the same schedule, labelled as emulated")
        if not self.profiling:
            raise GraphError("profiling is compiled out; build the kernel with profile=True")
        self.check()
        recs = self._rt.spans.view(-1, SPAN_WORDS).cpu().numpy()
        overflow = int(self._rt.ctrl[CTRL["span_overflow"]].item())
        waits = config.macro_on(self.kernel_config(), "MEGART_STREAM_WAITS")   # (mark words hold counts)
        return Profile(recs, registry.names_by_id(), overflow=overflow, nw=self.nw, timed_marks=not waits)
