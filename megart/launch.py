"""The GPU side: descriptor packing, device buffers, the cooperative launch on the caller's torch
stream, and reading back the control block (watchdog record, span overflow, step)."""
from __future__ import annotations

import struct
import time

import numpy as np
import torch

from .codegen import KERNEL_NAME
from .errors import DeviceError, HangError
from .layout import (CTRL, CTRL_WORDS, DESC_WORDS, HEADER_INTS, SPAN_WORDS, header_offsets, peer_signal_word,
                     peer_wait_word)
from .schedule import Schedule
from .tensors import TensorRef


def pack_descriptors(s: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors in queue-major order (worker 0's queue, then worker 1's, ...) and the nw+1 queue starts."""
    total = s.total_instances
    desc = np.zeros((total, DESC_WORDS), dtype=np.int64)
    hdr = desc[:, : HEADER_INTS // 2].view(np.int32)
    params = desc[:, HEADER_INTS // 2:]
    off = header_offsets()
    starts = np.zeros(s.nw + 1, dtype=np.int32)
    row = 0
    for w, q in enumerate(s.queues):
        starts[w] = row
        for pos, uid in enumerate(q):
            inst = s.instances[uid]
            h = hdr[row]
            h[off["type"]] = inst.type.id
            h[off["instance"]] = uid
            h[off["flags"]] = s.flags(uid)
            h[off["queue_pos"]] = pos
            waits = s.waits[uid]
            signals = s.signals[uid] + [peer_signal_word(e, q) for e, q in s.peer_signals.get(uid, ())]
            h[off["n_wait"]], h[off["n_signal"]] = len(waits), len(signals)
            for k, e in enumerate(waits):
                h[off["wait_event"] + k] = peer_wait_word(e) if s.events[e].peer else e
                h[off["wait_count"] + k] = s.events[e].count
            for k, e in enumerate(signals):
                h[off["signal_event"] + k] = e
            for j, p in enumerate(inst.type.params):
                v = inst.params[p.name]
                if isinstance(v, TensorRef):
                    params[row, j] = v.address
                elif v is None:
                    params[row, j] = 0        # absent optional pointer
                elif p.kind == "f32":
                    params[row, j] = struct.unpack("<i", struct.pack("<f", v))[0]
                else:
                    params[row, j] = v
            row += 1
    starts[s.nw] = row
    return desc, starts


class DeviceRuntime:
    """Owns the loaded module and the device buffers of one compiled kernel."""

    def __init__(self, cubin: bytes, schedule: Schedule, device: torch.device, threads: int, smem_bytes: int,
                 events: torch.Tensor | None = None, peer_bases: tuple = ()):
        """`events` / `peer_bases`: a tensor-parallel rank's counters in peer-mapped memory and the address
        of each rank's counters as mapped here (megart.peer_memory); they go after the control block."""
        from cuda.core import Device, LaunchConfig, ObjectCode
        self.device = device
        self.dev = Device(device.index or 0)
        self.dev.set_current()
        self.kernel = ObjectCode.from_cubin(cubin).get_kernel(KERNEL_NAME)
        self.nw = schedule.nw
        self.smem_bytes = smem_bytes
        if smem_bytes > 48 * 1024:
            self._raise_smem_limit(smem_bytes)
        self.config = LaunchConfig(grid=self.nw, block=threads, shmem_size=smem_bytes, is_cooperative=True)
        # An overlapped launch (programmatic dependent launch): its CTAs may start on the SMs the previous kernel
        # on the stream leaves, before it has ended; the kernel reads nothing a step writes until its
        # griddepcontrol.wait (csrc/runtime.cuh), so only its weight stream runs early. Not cooperative: a
        # cooperative launch waits for the previous kernel to end (the H200 measured no overlap with it). The
        # grid is the one a cooperative launch of this kernel already placed whole (the first launch, and
        # every launch after order_next_launch, is cooperative), so its CTAs are co-resident again.
        self.config_overlap = LaunchConfig(grid=self.nw, block=threads, shmem_size=smem_bytes,
                                           programmatic_stream_serialization=True)
        desc, starts = pack_descriptors(schedule)
        self.total = int(starts[-1])
        self.desc = torch.from_numpy(desc).to(device)
        self.starts = torch.from_numpy(starts).to(device)
        if events is None:
            events = torch.zeros(max(len(schedule.events), 1), dtype=torch.int32, device=device)
        elif events.numel() < len(schedule.events) or events.dtype != torch.int32:
            raise DeviceError(f"the event buffer holds {events.numel()} {events.dtype}, the schedule needs "
                              f"{len(schedule.events)} int32")
        self.events = events
        self.sync_words = [t.data for t in schedule.graph.sync_tensors()]
        # tagged words an aborted step wrote: the next launch runs step 1 again, whose tag they may carry. Zeroed
        # here too: this kernel's steps count from 1, and words another kernel's step 1 wrote would pass for its
        tagged = [t.data for t in schedule.graph.tagged_tensors()]
        for t in tagged:
            t.zero_()
        self.sync_words += tagged
        self.peer_bases = tuple(int(b) for b in peer_bases)
        self.ctrl = torch.zeros(CTRL_WORDS + len(self.peer_bases), dtype=torch.int64, device=device)
        self._set_peer_bases()
        self.spans: torch.Tensor | None = None
        self._streams = {}

    def _set_peer_bases(self) -> None:
        if self.peer_bases:
            self.ctrl[CTRL_WORDS:] = torch.tensor(self.peer_bases, dtype=torch.int64)

    def driver_blocks_per_sm(self, threads: int) -> int:
        return self.kernel.occupancy.max_active_blocks_per_multiprocessor(threads, self.smem_bytes)

    def _raise_smem_limit(self, nbytes: int) -> None:
        from cuda.bindings import driver
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, self.kernel.handle, self.dev.device_id)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cannot raise the kernel's dynamic shared memory to {nbytes} B: {err}")

    def set_span_buffer(self, steps: int, first_step: int) -> None:
        n = steps * self.total * SPAN_WORDS
        if self.spans is None or self.spans.numel() != n:
            self.spans = torch.zeros(max(n, SPAN_WORDS), dtype=torch.int64, device=self.device)
        else:
            self.spans.zero_()
        self.ctrl[CTRL["span_base"]] = first_step
        self.ctrl[CTRL["span_cap"]] = steps
        self.ctrl[CTRL["span_overflow"]] = 0

    def _stream(self):
        from cuda.core import Stream
        ts = torch.cuda.current_stream(self.device)
        key = ts.cuda_stream
        if key not in self._streams:
            self._streams[key] = Stream.from_handle(key)
        return self._streams[key]

    def launch(self, watchdog_ns: int, overlap: bool = False) -> None:
        """overlap: the kernel may start before the previous work on the stream has ended (its weights, which
        it reads early, must not be written by that work)."""
        from cuda.core import launch
        spans = self.spans.data_ptr() if self.spans is not None else 0
        launch(self._stream(), self.config_overlap if overlap else self.config, self.kernel, self.desc.data_ptr(),
               self.starts.data_ptr(), self.events.data_ptr(), self.ctrl.data_ptr(), spans, np.int64(watchdog_ns))

    def wait(self, timeout_s: float) -> np.ndarray:
        """Wait (bounded) for the stream's work, then return the control block."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        while not ev.query():
            if time.monotonic() > deadline:
                raise HangError(f"the kernel has not finished after {timeout_s:.1f} s and no watchdog fired: a task "
                                "body itself is not returning. The CUDA context may be unusable.")
            time.sleep(0.0005)
        return self.ctrl.cpu().numpy()

    def reset_after_abort(self) -> None:
        """Counters are left mid-step by an abort; start again from step 0 (a recovery path, not per step)."""
        torch.cuda.synchronize(self.device)
        self.events.zero_()
        for t in self.sync_words:       # arrival counters an abort may have left mid-count, and tagged words
            t.zero_()
        keep = {k: int(self.ctrl[CTRL[k]]) for k in ("span_base", "span_cap")}
        self.ctrl.zero_()
        for k, v in keep.items():
            self.ctrl[CTRL[k]] = v
        self._set_peer_bases()
