// rmsnorm: y[n] = bf16(x[off + i] * rsqrt(mean(x^2) + eps) * w[i]), x reduced whole
// (helpers: tasks/dense_common.cuh)
template <class P>
__device__ __forceinline__ void megart_task_rmsnorm(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  float ss = 0.f;
  for (int c = threadIdx.x; c < (p.k >> 3); c += MEGART_THREADS) {
    float f[8];
    unpack8(ld_act(p.x + 8 * c), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
  }
  const float rstd = rsqrtf(block_sum(ss, scratch_of(smem)) / (float)p.k + p.eps);
  for (int c = threadIdx.x; c < (p.n >> 3); c += MEGART_THREADS) {
    float f[8], h[8];
    unpack8(ld_act(p.x + p.off + 8 * c), f);
    unpack8(ld_weight(p.w + 8 * c), h);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = f[i] * rstd * h[i];
    *reinterpret_cast<uint4*>(p.y + 8 * c) = pack8(f);
  }
}
