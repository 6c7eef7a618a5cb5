// peer_copy: dst[i] = src[i] over 32-bit words; dst may be a peer GPU's memory (an NVLink mapping).
// Every thread fences at system scope after its stores, so the release that signals the peer after the
// CTA barrier publishes all of them across the GPUs.
__device__ __forceinline__ void megart_task_peer_copy(const megart_params_peer_copy& p, char*) {
  const bool vec = ((reinterpret_cast<unsigned long long>(p.dst) | reinterpret_cast<unsigned long long>(p.src)) & 15) == 0;
  int i0 = 0;
  if (vec) {
    const int n4 = p.n >> 2;
    for (int i = threadIdx.x; i < n4; i += MEGART_THREADS)
      reinterpret_cast<int4*>(p.dst)[i] = reinterpret_cast<const int4*>(p.src)[i];
    i0 = n4 << 2;
  }
  for (int i = i0 + threadIdx.x; i < p.n; i += MEGART_THREADS) p.dst[i] = p.src[i];
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
