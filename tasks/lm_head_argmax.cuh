// lm_head_argmax: logits of vocab rows [row0, row0 + n), partial argmax
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_lm_head_argmax(const P& p) {
  using namespace megart::dense;
  return MatvecPlan<PairRows>{(p.n + 1) >> 1, p.k >> 3, PairRows{reinterpret_cast<const char*>(p.w), p.n, 2ll * p.k}};
}

template <class P>
__device__ __forceinline__ void megart_task_lm_head_argmax(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem));
  const bool store = p.flags & kFlagLogits;
  const int lane = threadIdx.x & 31;
  float bv = neg_inf();
  int bi = kNoIndex;
  matvec_prewaited<false, P>(plan_lm_head_argmax(p), xs, scratch_of(smem), [&](int g, float a, float b) {
    const int r = 2 * g;
    if (store && lane < 2 && r + lane < p.n) p.logits[r + lane] = lane ? b : a;
    a = nan_low(a);
    if (better(a, p.row0 + r, bv, bi)) { bv = a; bi = p.row0 + r; }
    if (r + 1 < p.n) {
      b = nan_low(b);
      if (better(b, p.row0 + r + 1, bv, bi)) { bv = b; bi = p.row0 + r + 1; }
    }
  }, smem);
  block_argmax(bv, bi, scratch_of(smem));
  if (threadIdx.x == 0) {
    p.part_val[0] = bv;
    p.part_idx[0] = bi;
  }
}
