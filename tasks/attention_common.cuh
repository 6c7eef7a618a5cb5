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
// The log-sum-exp merge of one output (q head, dim) over C chunk partials: ml points at the head's
// (m, l) of chunk 0, po at its o[dim] of chunk 0; chunk c lies G * 2 and G * HD floats further on (the
// [n_kv, chunks, group, ...] layouts). M = max m_c, w_c = exp(m_c - M); returns sum w_c o_c / sum w_c l_c,
// 0 when every chunk is empty. attention_merge runs it per output, and so does attention_decode's fused
// form in the last instance of a kv head to arrive.
// With kMergeBatch > 0 and up to that many chunks (the default split: nw / n_kv = 16) every load is issued
// before the first use, so the merge costs one memory round trip instead of two dependent passes; the
// arithmetic is the same, in the same order. In the Llama-1B step the two-pass loop instead costs 12-15 us
// a step (bench/RESULTS.md, twenty-sixth session). Off where registers are scarce (128-register builds,
// 128 threads): there the unrolled batch made ptxas spill.
constexpr int kMergeBatch = (kLowRegs || MEGART_THREADS < 256) ? 0 : 16;
constexpr int kMergeSmallBatch = kMergeBatch > 4 ? 4 : kMergeBatch;  // (merge_point_fixed's few chunks)

// A shape known at compile time (merge_if_last with MEGART_MERGE_C): the strides below fold into immediates.
template <int V>
struct Fixed {
  __device__ __forceinline__ constexpr operator int() const { return V; }
};

// One (head, dim) output over C <= B chunks, all loads first. G and HD: ints, or Fixed<n>.
template <int B, class GT = int, class HT = int>
__device__ __forceinline__ bool merge_batched(const float* ml, const float* po, int C, GT G, HT HD, float& L,
                                              float& O) {
  if constexpr (B > 0) {
    if (C > B) return false;
    float mv[B], lv[B], ov[B];
#pragma unroll
    for (int c = 0; c < B; ++c) {
      if (c < C) {
        mv[c] = ld_in_f32(ml + (long long)c * G * 2);
        lv[c] = ld_in_f32(ml + (long long)c * G * 2 + 1);
        ov[c] = ld_in_f32(po + (long long)c * G * HD);
      }
    }
    float M = neg_inf();
#pragma unroll
    for (int c = 0; c < B; ++c)
      if (c < C) M = fmaxf(M, mv[c]);
    if (M != neg_inf()) {
#pragma unroll
      for (int c = 0; c < B; ++c) {
        if (c < C) {
          const float w = exp2f((mv[c] - M) * kLog2e);
          L = fmaf(w, lv[c], L);
          O = fmaf(w, ov[c], O);
        }
      }
    }
    return true;
  } else {
    return false;
  }
}

// The merge of one output with the shape (group G, head size HD, nchunks B) compiled in and C <= B chunks
// holding positions: merge_point's arithmetic, in the same order. A few chunks (a short context with
// min_chunk) take a batch of 4: the same loads and arithmetic in a quarter of the straight-line code, which a
// body run once per layer fetches cold. (Not in merge_point: the kernel of every built-in type spilled.)
template <int B, int G, int HD>
__device__ __forceinline__ float merge_point_fixed(const float* ml, const float* po, int C) {
  float L = 0.f, O = 0.f;
  if (C <= kMergeSmallBatch && kMergeSmallBatch < B)
    merge_batched<kMergeSmallBatch>(ml, po, C, Fixed<G>{}, Fixed<HD>{}, L, O);
  else
    merge_batched<B>(ml, po, C, Fixed<G>{}, Fixed<HD>{}, L, O);
  return L > 0.f ? O / L : 0.f;
}

// More chunks than kMergeBatch: two passes (the max, then the sums), unrolled by kMergeUnroll so that many
// chunks' loads are in flight together; 128-register builds take one chunk at a time (wider unrolling
// spilled the kernel that holds every built-in type once the fused merge joined it).
constexpr int kMergeUnroll = kLowRegs ? 1 : 4;

__device__ __forceinline__ float merge_point(const float* ml, const float* po, int C, int G, int HD) {
  float L = 0.f, O = 0.f;
  if (!merge_batched<kMergeBatch>(ml, po, C, G, HD, L, O)) {
    float M = neg_inf();
#pragma unroll(kMergeUnroll)
    for (int c = 0; c < C; ++c) M = fmaxf(M, ld_in_f32(ml + (long long)c * G * 2));
    if (M != neg_inf()) {
#pragma unroll(kMergeUnroll)
      for (int c = 0; c < C; ++c) {
        const float mc = ld_in_f32(ml + (long long)c * G * 2);
        const float w = exp2f((mc - M) * kLog2e);
        L = fmaf(w, ld_in_f32(ml + (long long)c * G * 2 + 1), L);
        O = fmaf(w, ld_in_f32(po + (long long)c * G * HD), O);
      }
    }
  }
  return L > 0.f ? O / L : 0.f;
}

// Arrival of one instance at a counter that `n` instances of a call count up (a "sync" parameter): true for
// the last of them, which finds every other instance's writes visible and sets the counter back to 0 (the
// next step's arrivals come in a later launch). Call it from one thread after a CTA barrier.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ bool arrive_last(int* counter, int n) {
  if (megart::kLeanSync) {
    // One acq_rel add: it releases the CTA's writes (ordered before this thread by the barrier) and, for
    // the last, acquires every other instance's. The reset needs no fence: the next arrivals come in a
    // later launch.
    int old;
    if constexpr ((MEGART_DIAG_NO_WAIT & 32) != 0)  // bit 5 (timing only, an unordered merge)
      asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    else
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    if (old != n - 1) return false;
    asm volatile("st.relaxed.gpu.global.s32 [%0], 0;" ::"l"(counter) : "memory");
    return true;
  }
  __threadfence();  // release: the CTA's writes, ordered before this thread by the barrier, come first
  if (atomicAdd(counter, 1) != n - 1) return false;
  atomicExch(counter, 0);
  __threadfence();  // acquire: the other instances' writes are read after their arrivals
  return true;
}
#else
inline bool arrive_last(int* counter, int n) {  // (host simulation: instances run one at a time)
  if ((*counter)++ != n - 1) return false;
  *counter = 0;
  return true;
}
#endif
}  // namespace megart_attn
