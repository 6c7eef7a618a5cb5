// Planted SLOWER gemv_m1 candidate (megart.faithful's own test): after the in-tree body runs, the CTA
// makes one extra full pass over its instance's weight rows. Same result, strictly more bytes read, so
// the gate must call it REGRESS. Used by tests/gpu/test_faithful_gpu.py.
// The pass comes after the body on purpose: placed before it, in a model context it ran while the
// instance would otherwise poll for its tagged input, so the wait hid it and the gate rightly said NULL.
// megart-faithful: include-baseline
__device__ __forceinline__ void megart_task_gemv_m1(const megart_params_gemv_m1& p, char* smem) {
  using namespace megart::dense;
  megart_task_gemv_m1<megart_params_gemv_m1>(p, smem);   // the in-tree template body
  const long long chunks = (long long)p.n * p.k / 8;   // 16-byte chunks of this instance's rows
  float acc = 0.f;
  for (long long c = threadIdx.x; c < chunks; c += MEGART_THREADS) {
    float f[8];
    unpack8(ld_weight(p.w + 8 * c), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += f[i];
  }
  // Keeps the loads alive: arithmetic never yields this signalling-NaN bit pattern.
  if (__float_as_uint(acc) == 0x7fa00001u) p.y[0] = __float2bfloat16_rn(acc);
}
