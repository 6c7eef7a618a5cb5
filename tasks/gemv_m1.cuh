// gemv_m1: y[n] = W[n,k] @ norm?(x) (+ residual)
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_gemv_m1(const P& p) {
  return megart::dense::pair_plan<false>(p.w, p.n, p.k);
}

template <class P>
__device__ __forceinline__ void megart_task_gemv_m1(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  const int lane = threadIdx.x & 31;
  auto epi = [&](int g, float a, float b) {
    const int r = 2 * g + lane;
    if (lane < 2 && r < p.n) gemv_store(p, r, (lane ? b : a));
  };
#if MEGART_DENSE_X_PIECES && MEGART_DENSE_TAGGED_X && MEGART_STREAM_SLOTS > 0
  // A streamed matvec of a tagged x with no norm: its stages' dots begin as their pieces of x land (dense_common.cuh).
  if constexpr (StreamOn<P>::value) {
    if (gemv_in_pieces<false, P>(p, plan_gemv_m1(p), epi, NoPre{}, smem)) return;
  }
#endif
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem), PartsSum{},
          p.flags & kFlagTaggedX);
  matvec_prewaited<false, P>(plan_gemv_m1(p), xs, scratch_of(smem), epi, smem);
}
