"""Thread-block clusters for the persistent grid: do 1-CTA-per-SM workers stay co-resident in clusters, and what
does a hand-off between two SMs cost through distributed shared memory against global memory?

    PYTHONPATH=. python bench/cluster_probe.py [--smem BYTES]

Per cluster size (1, 2, 4, 8, 16) it launches one CTA per SM with `--smem` bytes of dynamic shared memory (as
megart's workers take) in clusters of that size, each CTA counting itself in and waiting (at most 200 ms) for
all the others, and prints whether every CTA saw all of them, on how many distinct SMs, and the driver's
maximum of active clusters. Then three latencies, one thread per CTA: a flag ping-pong between cluster ranks 0
and 1 through distributed shared memory (st.release / ld.acquire at cluster scope), the same between two CTAs
through global memory (gpu scope, as megart's events and tagged words hand off), and a cluster barrier.
Results: bench/RESULTS.md (twenty-eighth session).
"""
from __future__ import annotations

import argparse

KERNELS = r'''
extern "C" __device__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ unsigned smid() { unsigned s; asm volatile("mov.u32 %0, %smid;" : "=r"(s)); return s; }
__device__ unsigned crank() { unsigned s; asm volatile("mov.u32 %0, %cluster_ctarank;" : "=r"(s)); return s; }
extern "C" __global__ void coresident(unsigned* count, int total, int* out) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) {
    smem[0] = 1;
    out[blockIdx.x * 3] = smid(); out[blockIdx.x * 3 + 1] = crank();
    atomicAdd(count, 1u);
    unsigned long long t0 = gt(); int ok = 0;
    while (gt() - t0 < 200000000ull) { if (*(volatile unsigned*)count >= (unsigned)total) { ok = 1; break; } }
    out[blockIdx.x * 3 + 2] = ok;
  }
}
// One side of a flag ping-pong: the first side puts round i and waits for the other's i; the second waits, then
// puts. Returns the ns the n rounds took.
template <class Put, class Wait>
__device__ unsigned long long pingpong(bool first, int n, Put put, Wait wait) {
  const unsigned long long t0 = gt();
  for (int i = 1; i <= n; ++i) {
    if (first) put((unsigned)i);
    wait((unsigned)i);
    if (!first) put((unsigned)i);
  }
  return gt() - t0;
}
// Between cluster ranks 0 and 1 (one thread each) through distributed shared memory: each writes the round into
// the other's flag and waits for its own. out[0] = ns for n rounds.
extern "C" __global__ void pingpong_dsmem(int n, unsigned long long* out) {
  __shared__ unsigned flag;
  if (threadIdx.x == 0) flag = 0;
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  const unsigned r = crank();
  if (threadIdx.x == 0 && r < 2) {
    unsigned local = (unsigned)__cvta_generic_to_shared(&flag), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r ^ 1u));
    const unsigned long long ns = pingpong(r == 0, n,
      [&](unsigned i) { asm volatile("st.release.cluster.shared::cluster.u32 [%0], %1;" :: "r"(remote), "r"(i) : "memory"); },
      [&](unsigned i) { unsigned v; do { asm volatile("ld.acquire.cluster.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(local) : "memory"); } while (v != i); });
    if (r == 0) out[blockIdx.x / 2] = ns;
  }
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same through global memory (blocks 0 and 1, gpu scope), as megart's events and tagged words hand off.
extern "C" __global__ void pingpong_global(int n, unsigned* flags, unsigned long long* out) {
  const unsigned b = blockIdx.x;
  if (threadIdx.x == 0 && b < 2) {
    unsigned* mine = flags + 32 * b; unsigned* other = flags + 32 * (b ^ 1);
    const unsigned long long ns = pingpong(b == 0, n,
      [&](unsigned i) { asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(other), "r"(i) : "memory"); },
      [&](unsigned i) { unsigned v; do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory"); } while (v != i); });
    if (b == 0) out[0] = ns;
  }
}
// A cluster barrier's cost: n arrive/wait rounds by every thread of every CTA of the cluster.
extern "C" __global__ void cluster_barrier(int n, unsigned long long* out) {
  unsigned long long t0 = gt();
  for (int i = 0; i < n; ++i)
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x == 0 && crank() == 0) out[blockIdx.x] = gt() - t0;
}
'''


def compile_probe(arch: str = "sm_90a"):
    """The probe's kernels as a cuda.core ObjectCode (compiles without a GPU)."""
    from cuda.core import Program, ProgramOptions
    return Program(KERNELS, "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin")


def _max_active_clusters(kernel, total: int, cluster: int, smem: int):
    from cuda.bindings import driver
    lc = driver.CUlaunchConfig()
    lc.gridDimX, lc.gridDimY, lc.gridDimZ = total, 1, 1
    lc.blockDimX, lc.blockDimY, lc.blockDimZ = 128, 1, 1
    lc.sharedMemBytes = smem
    a = driver.CUlaunchAttribute()
    a.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster, 1, 1
    lc.attrs, lc.numAttrs = [a], 1
    err, n = driver.cuOccupancyMaxActiveClusters(kernel.handle, lc)
    return n if err == driver.CUresult.CUDA_SUCCESS else f"({err})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smem", type=int, default=200 * 1024, help="dynamic shared memory per CTA (bytes)")
    ap.add_argument("--rounds", type=int, default=20000)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("cluster_probe times a GPU; no CUDA device here")
        return 2
    from cuda.bindings import driver
    from cuda.core import Device, LaunchConfig, launch
    dev = Device(0)
    dev.set_current()
    mod = compile_probe()
    stream = dev.create_stream()
    k = mod.get_kernel("coresident")
    for attr, value in ((driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, args.smem),
                        (driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)):
        (err,) = driver.cuKernelSetAttribute(attr, value, k.handle, dev.device_id)
        if err != driver.CUresult.CUDA_SUCCESS:
            print(f"cannot set {attr}: {err}")
            return 1
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{nsm} SMs, {args.smem} B of dynamic shared memory per CTA")
    for c in (1, 2, 4, 8, 16):
        total = (nsm // c) * c
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        out = torch.full((total * 3,), -1, dtype=torch.int32, device="cuda")
        cfg = (LaunchConfig(grid=total // c, cluster=c, block=128, shmem_size=args.smem) if c > 1
               else LaunchConfig(grid=total, block=128, shmem_size=args.smem))
        launch(stream, cfg, k, count.data_ptr(), total, out.data_ptr())
        stream.sync()
        o = out.view(-1, 3).cpu()
        most = _max_active_clusters(k, total, c, args.smem) if c > 1 else "-"
        print(f"clusters of {c:2d}: {total} CTAs, {int((o[:, 2] == 1).sum())} saw every other one, on "
              f"{len(set(o[:, 0].tolist()))} distinct SMs; at most {most} clusters active")
    n = args.rounds
    out = torch.zeros(64, dtype=torch.int64, device="cuda")
    launch(stream, LaunchConfig(grid=1, cluster=2, block=32), mod.get_kernel("pingpong_dsmem"), n, out.data_ptr())
    stream.sync()
    print(f"ping-pong through distributed shared memory (a cluster of 2): {out[0].item() / n:.0f} ns per round trip")
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    for grid in (2, nsm):
        flags.zero_()
        out.zero_()
        launch(stream, LaunchConfig(grid=grid, block=32), mod.get_kernel("pingpong_global"), n, flags.data_ptr(),
               out.data_ptr())
        stream.sync()
        print(f"ping-pong through global memory (CTAs 0 and 1 of {grid}): {out[0].item() / n:.0f} ns per round trip")
    for c in (2, 4, 8):
        out.zero_()
        launch(stream, LaunchConfig(grid=1, cluster=c, block=256), mod.get_kernel("cluster_barrier"), n, out.data_ptr())
        stream.sync()
        print(f"cluster barrier, {c} CTAs of 256 threads: {out[0].item() / n:.0f} ns per arrive and wait")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
