// spin: one thread waits p.ns nanoseconds on %globaltimer, so its span length is known.
__device__ __forceinline__ void megart_task_spin(const megart_params_spin& p, char*) {
  if (threadIdx.x == 0) {
    const unsigned long long start = megart::globaltimer();
    while (megart::globaltimer() - start < (unsigned long long)p.ns) {
    }
  }
}
