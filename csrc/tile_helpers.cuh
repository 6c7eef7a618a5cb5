// Helpers task bodies share: vector loads, warp/block reductions, L2 prefetch. The host simulation
// (megart/tasks/dense_hostsim.py) compiles this same file with g++: the reductions as they are, over its
// fibers' shuffles and barriers; the PTX-only pieces have host forms below (#ifndef __CUDA_ARCH__).
#pragma once
namespace megart {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole CTA; `scratch` needs one float per warp. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarp = MEGART_THREADS >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[wid] = v;
  __syncthreads();
  v = lane < nwarp ? scratch[lane] : 0.f;
  return warp_sum(v);
}

#ifdef __CUDA_ARCH__
// L2 cache policies (sm_80+): evict-first for data streamed once, evict-last for data fetched ahead.
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ unsigned long long l2_evict_last() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// Ask the copy engine to pull [p, p + bytes) into L2 ahead of use (sm_90 bulk prefetch, 16-byte units).
// With MEGART_L2_HINTS the lines are kept evict-last until the body reads them.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned long long bytes) {
  const char* c = static_cast<const char*>(p);
  while (bytes >= 16) {
    const unsigned chunk = bytes > (1u << 20) ? (1u << 20) : (unsigned)(bytes & ~15ull);
#ifdef MEGART_L2_HINTS
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(c), "r"(chunk),
                 "l"(l2_evict_last()) : "memory");
#else
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(chunk) : "memory");
#endif
    c += chunk;
    bytes -= chunk;
  }
}
// Ask L1 for the line of p (a read-only operand a body will load later, e.g. an fp8 row scale).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
#else
inline void prefetch_l1(const void*) {}
__device__ __forceinline__ unsigned long long l2_evict_first() { return 0; }
__device__ __forceinline__ unsigned long long l2_evict_last() { return 0; }
// Host simulation: what the last instance's prefetch asked for (tests check the cap and the slice head).
inline unsigned long long prefetched = 0;
inline void prefetch_l2(const void*, unsigned long long bytes) { prefetched += bytes & ~15ull; }
#endif

}  // namespace megart
