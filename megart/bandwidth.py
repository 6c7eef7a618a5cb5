"""The HBM read floor, measured in the same run as whatever it is compared with (docs/METHOD.md):
a read-only kernel with 16-byte loads over a buffer far larger than L2, median of several runs."""
from __future__ import annotations

import statistics

_SRC = r"""
extern "C" __global__ void megart_read_bw(const uint4* __restrict__ p, unsigned long long n, unsigned* sink) {
  unsigned acc = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never stores
}
"""


def time_ms(fn, iters: int = 20, warmup: int = 3) -> list[float]:
    """CUDA-event times (ms) of `fn()` on the current stream, one per iteration, after a warm-up."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def read_bandwidth(nbytes: int = 4 << 30, iters: int = 10, ctas: int | None = None) -> float:
    """Bytes per second of a pure read of `nbytes` of random data (never zeros)."""
    return read_floor(nbytes, iters, ctas)["floor_bw"]


def read_floor(nbytes: int = 4 << 30, iters: int = 10, ctas: int | None = None) -> dict:
    """The floor with its spread and a description of the method, for results files."""
    import numpy as np
    import torch
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, Stream, launch
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    arch = "sm_" + "".join(map(str, torch.cuda.get_device_capability()))
    kernel = Program(_SRC, "c++", ProgramOptions(arch=arch)).compile("cubin").get_kernel("megart_read_bw")
    buf = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    n = buf.numel() // 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = LaunchConfig(grid=ctas or sms * 16, block=256)
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    times = time_ms(lambda: launch(stream, cfg, kernel, buf.data_ptr(), np.uint64(n), sink.data_ptr()), iters)
    buf = None  # free the 4 GiB before returning
    torch.cuda.empty_cache()
    ms = statistics.median(times)
    return {"floor_bw": nbytes / (ms * 1e-3), "floor_spread": (max(times) - min(times)) / ms,
            "floor_method": f"16-byte vector loads over {nbytes / 2**30:g} GiB of random data, "
                            f"{cfg.grid[0] if isinstance(cfg.grid, tuple) else cfg.grid} CTAs, median of {iters}"}
