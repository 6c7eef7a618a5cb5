// silu_mul: h = bf16(silu(g) * u), elementwise
// (helpers: tasks/dense_common.cuh)
template <class P>
__device__ __forceinline__ void megart_task_silu_mul(const P& p, char*) {
  using namespace megart;
  using namespace megart::dense;
  const int nc = p.n >> 3;
  for (int c = threadIdx.x; c < nc; c += MEGART_THREADS) {
    float g[8], u[8];
    unpack8(ld_act(p.g + 8 * c), g);
    unpack8(ld_act(p.u + 8 * c), u);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = silu(g[i]) * u[i];
    *reinterpret_cast<uint4*>(p.h + 8 * c) = pack8(g);
  }
  for (int i = 8 * nc + threadIdx.x; i < p.n; i += MEGART_THREADS)
    p.h[i] = __float2bfloat16_rn(silu(__bfloat162float(p.g[i])) * __bfloat162float(p.u[i]));
}
