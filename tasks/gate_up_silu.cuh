// gate_up_silu: h[n] = silu(Wg x) * (Wu x); a group is (gate row r, up row r)
// (helpers and the body, dense::gate_up_body: tasks/dense_bodies.cuh; prefetch/prewait/drain: generated from
// the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_gate_up_silu(const P& p) {
  return megart::dense::gate_up_plan<false>(p);
}

template <class P>
__device__ __forceinline__ void megart_task_gate_up_silu(const P& p, char* smem) {
  megart::dense::gate_up_body<false, P>(p, plan_gate_up_silu(p), nullptr, nullptr, smem);
}
