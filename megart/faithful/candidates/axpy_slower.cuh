// Planted SLOWER axpy candidate (machinery test on any GPU): one extra pass over x before the
// in-tree body. Same result, more bytes read: the gate must call it REGRESS.
// megart-faithful: include-baseline as=megart_task_axpy_in_tree
__device__ __forceinline__ void megart_task_axpy(const megart_params_axpy& p, char* smem) {
  float acc = 0.f;
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) acc += p.x[i];
  if (__float_as_uint(acc) == 0x7fa00001u) p.y[0] = acc;   // never true: keeps the loads alive
  megart_task_axpy_in_tree(p, smem);
}
