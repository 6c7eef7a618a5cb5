// copy: dst[i] = src[i] on this instance's slice (pointers arrive pre-offset).
__device__ __forceinline__ void megart_task_copy(const megart_params_copy& p, char*) {
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) p.dst[i] = p.src[i];
}
