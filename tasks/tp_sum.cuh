// tp_sum: y = residual + parts[0] + ... + parts[tp-1] (each slot `stride` apart), summed in f32 in rank
// order and rounded to bf16 once, so every rank of the group computes the same bits.
__device__ __forceinline__ void megart_task_tp_sum(const megart_params_tp_sum& p, char*) {
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) {
    float acc = (p.flags & 1) ? __bfloat162float(p.residual[i]) : 0.f;
    for (int r = 0; r < p.tp; ++r) acc += __bfloat162float(p.parts[(long long)r * p.stride + i]);
    p.y[i] = __float2bfloat16_rn(acc);
  }
}
