// lm_head_argmax_fp8: logits of vocab rows [row0, row0 + n) from an e4m3 head with per-row f32 scales
// (gemv_m1_fp8's format), partial argmax; lm_head_argmax otherwise
// (helpers and the body, dense::lm_head_body: tasks/dense_bodies.cuh; prefetch/prewait/drain: generated from
// the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_lm_head_argmax_fp8(const P& p) {
  return megart::dense::pair_plan<true>(p.w, p.n, p.k);
}

template <class P>
__device__ __forceinline__ void megart_task_lm_head_argmax_fp8(const P& p, char* smem) {
  megart::dense::lm_head_body<true, P>(p, plan_lm_head_argmax_fp8(p), p.scale, smem);
}
