// gate_up_silu_fp8: h[n] = silu(s_gate[n] * (Wg8 x)) * (s_up[n] * (Wu8 x)); a group is (gate row r, up row r),
// e4m3 rows of k bytes with per-row f32 scales. The fp8 form of gate_up_silu: gate and up stay in fp32
// (never stored), so the fp8 model needs no silu_mul call after a stacked gate|up GEMV.
// (helpers and the body, dense::gate_up_body: tasks/dense_bodies.cuh; prefetch/prewait/drain: generated from
// the declaration, dense_common.wrappers)
template <class P>
__device__ __forceinline__ auto plan_gate_up_silu_fp8(const P& p) {
  return megart::dense::gate_up_plan<true>(p);
}

template <class P>
__device__ __forceinline__ void megart_task_gate_up_silu_fp8(const P& p, char* smem) {
  megart::dense::gate_up_body<true, P>(p, plan_gate_up_silu_fp8(p), p.s_gate, p.s_up, smem);
}
