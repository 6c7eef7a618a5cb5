// gate_up_silu_fp8: h[n] = silu(s_gate[n] * (Wg8 x)) * (s_up[n] * (Wu8 x)); a group is (gate row r, up row r),
// e4m3 rows of k bytes with per-row f32 scales. The fp8 form of gate_up_silu: gate and up stay in fp32
// (never stored), so the fp8 model needs no silu_mul call after a stacked gate|up GEMV.
// (helpers: tasks/dense_common.cuh; prefetch/prewait/drain: generated from the declaration, dense_common.wrappers)
template <class P>
struct GateUpRows8 {
  const P& p;
  __device__ __forceinline__ void operator()(int g, const void* (&w)[2]) const {
    w[0] = reinterpret_cast<const char*>(p.w_gate) + (size_t)g * p.k;
    w[1] = reinterpret_cast<const char*>(p.w_up) + (size_t)g * p.k;
  }
  __device__ __forceinline__ megart::dense::StreamRows stream_rows() const {  // (the weight stream)
    return {reinterpret_cast<const char*>(p.w_gate), reinterpret_cast<const char*>(p.w_up), (long long)p.k, p.n};
  }
};

template <class P>
__device__ __forceinline__ auto plan_gate_up_silu_fp8(const P& p) {
  return megart::dense::MatvecPlan<GateUpRows8<P>>{p.n, p.k >> 4, GateUpRows8<P>{p}};
}

template <class P>
__device__ __forceinline__ void megart_task_gate_up_silu_fp8(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem));
  const int lane = threadIdx.x & 31;
  matvec_prewaited<true, P>(plan_gate_up_silu_fp8(p), xs, scratch_of(smem), [&](int g, float gate, float up) {
    if (lane == 0) p.h[g] = __float2bfloat16_rn(silu(gate * __ldg(p.s_gate + g)) * (up * __ldg(p.s_up + g)));
  }, smem);
}
