// gemv_m1_fp8: y[n] = scale[n] * (W8[n,k] @ norm?(x)) (+ residual)
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_gemv_m1_fp8(const P& p) {
  return megart::dense::pair_plan<true>(p.w, p.n, p.k);
}

template <class P>
__device__ __forceinline__ void megart_task_gemv_m1_fp8(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  const int lane = threadIdx.x & 31;
  auto epi = [&](int g, float a, float b) {
    const int r = 2 * g + lane;
    if (lane < 2 && r < p.n) gemv_store(p, r, (lane ? b : a) * __ldg(p.scale + r));
  };
  auto pre = [&](int g) { prefetch_l1(p.scale + 2 * g); };
#if MEGART_DENSE_X_PIECES_FP8 && MEGART_DENSE_TAGGED_X && MEGART_STREAM_SLOTS > 0
  // x in pieces as gemv_m1 stages it: a piece is one e4m3 stage's x.
  if constexpr (StreamOn<P>::value) {
    if (gemv_in_pieces<true, P>(p, plan_gemv_m1_fp8(p), epi, pre, smem)) return;
  }
#endif
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem), PartsSum{},
          p.flags & kFlagTaggedX);
  matvec_prewaited<true, P>(plan_gemv_m1_fp8(p), xs, scratch_of(smem), epi, smem, pre);
}
