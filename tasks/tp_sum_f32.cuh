// tp_sum_f32: y = residual + parts[0] + ... + parts[tp-1] over f32 partials (gemv_partial), summed in rank
// order and rounded to bf16 once: the same bits on every rank, one rounding as on a single GPU.
__device__ __forceinline__ void megart_task_tp_sum_f32(const megart_params_tp_sum_f32& p, char*) {
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) {
    float acc = (p.flags & 1) ? __bfloat162float(p.residual[i]) : 0.f;
    for (int r = 0; r < p.tp; ++r) acc += p.parts[(long long)r * p.stride + i];
    p.y[i] = __float2bfloat16_rn(acc);
  }
}
