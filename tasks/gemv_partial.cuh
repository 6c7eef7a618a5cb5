// gemv_partial: y[n] = W[n,k] @ x in f32, unrounded: a row-parallel rank's share of a sum that tp_sum_f32
// finishes, so the tensor-parallel result is rounded to bf16 once, as on one GPU. With `peer`, every row
// is also stored into the peer GPU's slot (NVLink) and each thread fences at system scope, so the
// instance's peer signal after the CTA barrier publishes the rows. (tasks/dense_common.cuh)
template <class P>
__device__ __forceinline__ auto plan_gemv_partial(const P& p) {
  return megart::dense::pair_plan<false>(p.w, p.n, p.k);
}

// Not inlined into the dispatch switch: a kernel holding every built-in type (tests/test_compile.py, 512
// threads = 128 registers) spilled 8 bytes with a second inlined matvec engine beside gemv_m1's.
template <class P>
__device__ __noinline__ void megart_task_gemv_partial(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  uint4* xs = xs_of(smem);
  stage_x(p.x, nullptr, p.k, false, 0.f, xs, scratch_of(smem));
  const int lane = threadIdx.x & 31;
  matvec_prewaited<false, P>(plan_gemv_partial(p), xs, scratch_of(smem), [&](int g, float a, float b) {
    const int r = 2 * g + lane;
    if (lane < 2 && r < p.n) {
      const float v = lane ? b : a;
      p.y[r] = v;
      if (p.peer) p.peer[r] = v;
    }
  }, smem);
#ifdef __CUDA_ARCH__
  if (p.peer) asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}
