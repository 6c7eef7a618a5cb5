// group_gemm_m1: the live row of one active expert, rows [n) of its W[e]
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ void megart_task_group_gemm_m1(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  stage_x(p.a, nullptr, p.k, false, 0.f, xs, scratch_of(smem));
  const int lane = threadIdx.x & 31;
  matvec<false>((p.n + 1) >> 1, p.k >> 3, xs, scratch_of(smem),
                PairRows{reinterpret_cast<const char*>(p.w), p.n, 2ll * p.k}, [&](int g, float a, float b) {
                  const int r = 2 * g + lane;
                  if (lane < 2 && r < p.n) p.y[r] = __float2bfloat16_rn(lane ? b : a);
                });
}
