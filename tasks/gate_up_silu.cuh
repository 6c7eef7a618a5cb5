// gate_up_silu: h[n] = silu(Wg x) * (Wu x); a group is (gate row r, up row r)
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
template <class P>
struct GateUpRows {
  const P& p;
  __device__ __forceinline__ void operator()(int g, const void* (&w)[2]) const {
    w[0] = p.w_gate + (size_t)g * p.k;
    w[1] = p.w_up + (size_t)g * p.k;
  }
  __device__ __forceinline__ megart::dense::StreamRows stream_rows() const {  // (the weight stream)
    return {reinterpret_cast<const char*>(p.w_gate), reinterpret_cast<const char*>(p.w_up), 2ll * p.k, p.n};
  }
};

template <class P>
__device__ __forceinline__ auto plan_gate_up_silu(const P& p) {
  return megart::dense::MatvecPlan<GateUpRows<P>>{p.n, p.k >> 3, GateUpRows<P>{p}};
}

template <class P>
__device__ __forceinline__ void megart_task_gate_up_silu(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem));
  const int lane = threadIdx.x & 31;
  matvec_prewaited<false, P>(plan_gate_up_silu(p), xs, scratch_of(smem), [&](int g, float gate, float up) {
    if (lane == 0) p.h[g] = __float2bfloat16_rn(silu(gate) * up);
  }, smem);
}
