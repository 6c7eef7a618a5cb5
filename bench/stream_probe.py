"""How fast can one SM's share of HBM be streamed into shared memory, and does a stream that runs ahead
across grid-wide waits keep HBM busy? A probe outside the megakernel (issue 9): the same bytes read by
the engines megart could use, in isolation, with a bf16 dot product's worth of work per 16 bytes.

Engines (one CTA per SM, 8 compute warps; `calls` grid-wide waits split the read into dependent parts,
like chained GEMV calls):
  reg        each warp loads its 8 KB stages straight into registers (16 x 16 B per lane in flight),
             as the register engine does; it cannot load across a wait.
  warp       a per-warp ring of `slots` stages in shared memory, fed by a producer warp whose lane w walks
             warp w's stages ahead (through the waits), as csrc/weight_stream.cuh does.
  inline     the same ring, but lane 0 of each compute warp issues its own next stages.
  cta        one ring of `slots` pages for the whole CTA, fed by one producer thread; every compute warp
             reads its eighth of each page and the page is freed once all eight have read it.

Usage (on a GPU): python bench/stream_probe.py [--gib 2] [--calls 1,12] [--json out.json]
Prints GB/s and the fraction of the read floor measured in the same process."""
from __future__ import annotations

import argparse
import json
import statistics
import sys

WARPS = 8

SRC = r"""
#include <cuda_bf16.h>
#define W 8
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(unsigned long long* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void mb_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mb_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory"); }
__device__ __forceinline__ bool mb_test(unsigned long long* b, unsigned par) {
  unsigned d;
  asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
               : "=r"(d) : "r"(sa(b)), "r"(par) : "memory");
  return d != 0; }
__device__ __forceinline__ void mb_wait(unsigned long long* b, unsigned par) { while (!mb_test(b, par)) {} }
__device__ __forceinline__ void copy(void* dst, const void* src, unsigned bytes, unsigned long long* b, int hint) {
  if (hint) {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    asm volatile("fence.proxy.async.shared::cta;\n\tcp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 ::"r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(b)), "l"(pol) : "memory");
  } else {
    asm volatile("fence.proxy.async.shared::cta;\n\tcp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(b)) : "memory");
  }
}
__device__ __forceinline__ uint4 ldw(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v; }
// a bf16 dot product's work on 16 bytes
__device__ __forceinline__ float dot8(uint4 v, float a) {
  float s = 0.f;
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) s = fmaf(__uint_as_float(u[i] << 16), a, fmaf(__uint_as_float(u[i] & 0xffff0000u), a, s));
  return s; }
// compute threads only (named barrier 1): the producer never waits for a call
__device__ __forceinline__ void grid_wait(unsigned* ctr, unsigned target) {
  asm volatile("bar.sync 1, 256;" ::: "memory");
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr, 1u);
    unsigned v;
    do { asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory"); } while ((int)(v - target) < 0);
  }
  asm volatile("bar.sync 1, 256;" ::: "memory");
}
// Stage j of warp w (its global order): part c = j / per, then stage (j % per) * W + w of that part.
struct Walk {
  const char* base; long long part; int stage, per;  // per: stages of one warp in one part
  __device__ const char* at(int w, int j) const {
    return base + (long long)(j / per) * part + (long long)((j % per) * W + w) * stage; }
};

extern "C" __global__ void __launch_bounds__(288, 1)
probe(const char* src, long long cta_bytes, int mode, int slots, int stage, int cpy, int hint, int calls,
      unsigned* ctr, unsigned ctr_base, float* out) {
  extern __shared__ __align__(128) char smem[];
  __shared__ unsigned long long full[W * 16], empty[W * 16];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long part = cta_bytes / calls;
  const int per = (int)(part / stage / W);  // stages per warp per part
  const int total = per * calls;
  const Walk wk{src + blockIdx.x * cta_bytes, part, stage, per};
  const float a = 1.0f + 1e-7f * tid;
  float acc = 0.f;
  const int vec = stage / 16 / 32;  // 16-byte loads per lane per stage
  if (mode == 0) {  // registers
    if (warp < W) {
      for (int j = 0; j < total; ++j) {
        if (j && j % per == 0) grid_wait(ctr, ctr_base + (unsigned)(j / per) * gridDim.x);
        const uint4* p = reinterpret_cast<const uint4*>(wk.at(warp, j)) + lane;
        uint4 v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) if (i < vec) v[i] = ldw(p + 32 * i);
#pragma unroll
        for (int i = 0; i < 16; ++i) if (i < vec) acc += dot8(v[i], a);
      }
    }
  } else if (mode == 1 || mode == 2) {  // per-warp ring: producer warp (1) or inline lane 0 (2)
    if (tid < W * 32 ? lane == 0 && mode == 2 : mode == 1 && lane < W) {
      const int w = mode == 1 ? lane : warp;
      for (int s = 0; s < slots; ++s) { mb_init(&full[w * 16 + s], 1); mb_init(&empty[w * 16 + s], 1); }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int w, int j) {
      const int s = j % slots;
      char* dst = smem + (size_t)(w * slots + s) * stage;
      const char* g = wk.at(w, j);
      mb_expect(&full[w * 16 + s], stage);
      for (int o = 0; o < stage; o += cpy) copy(dst + o, g + o, cpy, &full[w * 16 + s], hint);
    };
    if (tid >= W * 32) {  // producer warp (mode 1): converged rounds, lane w for warp w
      if (mode == 1) {
        int issued = 0;
        for (;;) {
          bool live = lane < W && issued < total, did = false;
          if (live && (issued < slots || mb_test(&empty[lane * 16 + issued % slots], ((issued / slots) - 1) & 1))) {
            issue(lane, issued++);
            did = true;
          }
          if (!__any_sync(~0u, live)) break;
          if (!__any_sync(~0u, did)) __nanosleep(64);
        }
      }
    } else {
      int issued = 0;
      if (mode == 2 && lane == 0) for (; issued < slots && issued < total; ++issued) issue(warp, issued);
      for (int j = 0; j < total; ++j) {
        if (j && j % per == 0) grid_wait(ctr, ctr_base + (unsigned)(j / per) * gridDim.x);
        const int s = j % slots;
        mb_wait(&full[warp * 16 + s], (j / slots) & 1);
        const uint4* p = reinterpret_cast<const uint4*>(smem + (size_t)(warp * slots + s) * stage) + lane;
        for (int i = 0; i < vec; ++i) acc += dot8(p[32 * i], a);
        __syncwarp();
        if (lane == 0) {
          if (mode == 1) mb_arrive(&empty[warp * 16 + s]);
          else if (issued < total) issue(warp, issued++);
        }
        __syncwarp();
      }
    }
  } else {  // mode 3: one CTA-wide ring of pages (stage = page bytes), one producer thread
    const int pages_per_part = (int)(part / stage);
    const int npages = pages_per_part * calls;
    if (tid == W * 32) {
      for (int s = 0; s < slots; ++s) { mb_init(&full[s], 1); mb_init(&empty[s], W); }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (tid >= W * 32) {
      if (tid == W * 32) {
        for (int p = 0; p < npages; ++p) {
          const int s = p % slots;
          if (p >= slots) mb_wait(&empty[s], ((p / slots) - 1) & 1);
          const char* g = src + blockIdx.x * cta_bytes + (long long)p * stage;
          mb_expect(&full[s], stage);
          for (int o = 0; o < stage; o += cpy) copy(smem + (size_t)s * stage + o, g + o, cpy, &full[s], hint);
        }
      }
    } else {
      const int pv = stage / 16 / W / 32;  // loads per lane per page
      for (int p = 0; p < npages; ++p) {
        if (p && p % pages_per_part == 0) grid_wait(ctr, ctr_base + (unsigned)(p / pages_per_part) * gridDim.x);
        const int s = p % slots;
        mb_wait(&full[s], (p / slots) & 1);
        const uint4* q = reinterpret_cast<const uint4*>(smem + (size_t)s * stage) + warp * (pv * 32) + lane;
        for (int i = 0; i < pv; ++i) acc += dot8(q[32 * i], a);
        __syncwarp();
        if (lane == 0) mb_arrive(&empty[s]);
      }
    }
  }
  if (acc == 123.456f) out[blockIdx.x] = acc;  // keeps the work; practically never stores
}
"""

# (engine, slots, stage or page bytes, bytes per bulk copy, evict-first hint)
CONFIGS = [("reg", 0, 8192, 0, 0)] + [
    ("warp", s, 8192, 4096, 1) for s in (2, 3)] + [
    ("warp", 3, 8192, 8192, 1), ("warp", 3, 8192, 4096, 0), ("warp", 6, 4096, 4096, 1), ("warp", 4, 4096, 4096, 1),
    ("inline", 3, 8192, 4096, 1)] + [
    ("cta", s, p, c, 1) for s, p, c in ((12, 16384, 16384), (6, 32768, 32768), (6, 32768, 8192), (3, 65536, 16384),
                                        (24, 8192, 8192), (4, 32768, 32768))]
MODES = {"reg": 0, "warp": 1, "inline": 2, "cta": 3}


def smem_bytes(engine: str, slots: int, stage: int) -> int:
    return {"reg": 0, "warp": WARPS * slots * stage, "inline": WARPS * slots * stage, "cta": slots * stage}[engine]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes read per launch, GiB")
    ap.add_argument("--calls", default="1,48", help="grid-wide waits + 1 per launch, comma-separated")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    from cuda.bindings import driver
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, Stream, launch
    from megart.bandwidth import read_floor, time_ms
    from megart.compile import include_paths
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    arch = "sm_" + "".join(map(str, torch.cuda.get_device_capability()))
    opts = ProgramOptions(arch=arch, std="c++17", include_path=include_paths())
    kernel = Program(SRC, "c++", opts).compile("cubin").get_kernel("probe")
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, 200 * 1024, kernel.handle, dev.device_id)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    floor = read_floor()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    unit = 65536 * WARPS * 12  # every stage and page size divides every part
    cta_bytes = int(args.gib * 2**30) // sms // unit * unit
    buf = torch.randint(-2**15, 2**15, (sms * cta_bytes // 2,), dtype=torch.int16, device="cuda")
    ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.zeros(sms, dtype=torch.float32, device="cuda")
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    base = [0]
    rows = []
    print(f"read floor {floor['floor_bw'] / 1e12:.3f} TB/s; {sms} CTAs x {cta_bytes / 2**20:.1f} MiB", flush=True)
    for calls in [int(c) for c in args.calls.split(",")]:
        for engine, slots, stage, cpy, hint in CONFIGS:
            shm = smem_bytes(engine, slots, stage)
            cfg = LaunchConfig(grid=sms, block=288, shmem_size=shm)

            def go():
                launch(stream, cfg, kernel, buf.data_ptr(), np.int64(cta_bytes), np.int32(MODES[engine]),
                       np.int32(slots), np.int32(stage), np.int32(max(cpy, 16)), np.int32(hint), np.int32(calls),
                       ctr.data_ptr(), np.uint32(base[0] & 0xffffffff), out.data_ptr())
                base[0] += (calls - 1) * sms
            times = time_ms(go, iters=args.iters)
            ms = statistics.median(times)
            bw = sms * cta_bytes / (ms * 1e-3)
            row = dict(engine=engine, slots=slots, stage=stage, copy=cpy, hint=hint, calls=calls,
                       us=round(ms * 1e3, 1), tb_s=round(bw / 1e12, 3), of_floor=round(bw / floor["floor_bw"], 3),
                       us_per_wait=None)
            rows.append(row)
            print(f"calls {calls:3d} {engine:6s} slots {slots:2d} stage {stage:6d} copy {cpy:6d} hint {hint}: "
                  f"{row['us']:9.1f} us {row['tb_s']:.3f} TB/s = {row['of_floor']:.3f} of floor", flush=True)
    torch.cuda.synchronize()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(floor=floor, cta_bytes=cta_bytes, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
