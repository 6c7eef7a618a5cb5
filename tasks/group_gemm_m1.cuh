// group_gemm_m1: the live row of one active expert, rows [n) of its W[e]
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
// The active experts are a build-time list, so each instance's weight rows are known before its wait and
// stream like gemv_m1's.
template <class P>
__device__ __forceinline__ auto plan_group_gemm_m1(const P& p) {
  return megart::dense::pair_plan<false>(p.w, p.n, p.k);
}

template <class P>
__device__ __forceinline__ void megart_task_group_gemm_m1(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  stage_x(p.a, nullptr, p.k, false, 0.f, xs, scratch_of(smem));
  const int lane = threadIdx.x & 31;
  matvec_prewaited<false, P>(plan_group_gemm_m1(p), xs, scratch_of(smem), [&](int g, float a, float b) {
    const int r = 2 * g + lane;
    if (lane < 2 && r < p.n) p.y[r] = __float2bfloat16_rn(lane ? b : a);
  }, smem);
}
