// Helpers shared by the attention task types (qkv_rope_append, attention_decode, attention_merge):
// coherent and non-coherent 16-byte loads, bf16 unpacking, register-budget switches. Declared as a
// shared header of those task types (TaskType.headers), so codegen emits it once per kernel.
#pragma once
namespace megart_attn {
#ifdef __CUDA_ARCH__
// 16 bytes of a weight (read-only for the whole kernel): non-coherent path, no L1 allocation.
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// 16 bytes of data another task of this launch may have written: coherent, cached in L2 only.
__device__ __forceinline__ uint4 ld_in16(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_in_i32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float ld_in_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
#else
// Host simulation (megart/emulate/hostsim.py): one CTA, instances one at a time, so every load is plain.
inline uint4 ld_weight16(const void* p) {
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline uint4 ld_in16(const void* p) { return ld_weight16(p); }
inline int ld_in_i32(const int* p) { return *p; }
inline float ld_in_f32(const float* p) { return *p; }
#endif
// 8 bf16 (one 16-byte vector) to fp32, exactly.
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
// Loads in flight per thread. When __launch_bounds__ leaves 128 registers or fewer per thread (512+ threads,
// or 2+ CTAs per SM if codegen defines MEGART_MIN_BLOCKS), the bodies keep fewer loads in flight so they do
// not spill.
#ifdef MEGART_MIN_BLOCKS
constexpr bool kLowRegs = MEGART_THREADS * MEGART_MIN_BLOCKS >= kLowRegThreads;
#else
constexpr bool kLowRegs = MEGART_THREADS >= kLowRegThreads;
#endif
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
}  // namespace megart_attn
