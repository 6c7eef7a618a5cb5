// axpy: y[i] = a * x[i] + y[i]. Rounded multiply then rounded add (no FMA contraction) so the CPU
// reference reproduces it exactly.
__device__ __forceinline__ void megart_task_axpy(const megart_params_axpy& p, char*) {
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) p.y[i] = __fadd_rn(__fmul_rn(p.a, p.x[i]), p.y[i]);
}
