// lm_head_argmax: logits of vocab rows [row0, row0 + n), partial argmax
// (helpers and the body, dense::lm_head_body: tasks/dense_bodies.cuh; prefetch/prewait/drain: generated from
// the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_lm_head_argmax(const P& p) {
  return megart::dense::pair_plan<false>(p.w, p.n, p.k);
}

template <class P>
__device__ __forceinline__ void megart_task_lm_head_argmax(const P& p, char* smem) {
  megart::dense::lm_head_body<false, P>(p, plan_lm_head_argmax(p), nullptr, smem);
}
