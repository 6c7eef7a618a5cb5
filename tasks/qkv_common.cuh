// The shared code of qkv_rope_append and qkv_rope_append_fp8: fused (optional RMSNorm) + Q/K/V projection +
// RoPE + KV-cache append, M = 1. A shared task header (TaskType.headers), emitted once per kernel after
// tasks/attention_common.cuh and tasks/dense_common.cuh; each type's file holds its entry points.
//
// One instance = one head of w_qkv (q, k or v) restricted to the rotate-half pairs
// [pair0, pair0 + npairs): rows pair0 + j and half + pair0 + j of the head (w points at the first).
// The dots come from the dense matvec engine (tasks/dense_engines.cuh): x staged in shared memory (with
// the fused RMSNorm, rounded to bf16 like an unfused rmsnorm task's output), one warp per row pair
// (j, half + j), so the weights can come through the launch-wide weight stream like any dense GEMV's.
// The epilogue (one thread per pair) applies the optional per-head RMSNorm and RoPE in fp32 and rounds to bf16.
//
// mode bits: 1 = RoPE (q, k heads), 2 = fused RMSNorm of x (norm_weight valid), 4 = destination is a cache
// head (row `pos`, stride 2 * half) rather than q, 8 = RMSNorm of the head's own fp32 dots with the gain
// head_norm [hd] before RoPE (Qwen3's q_norm / k_norm; the splitter then gives the instance the whole head),
// 16 = x is a tagged tensor, 32 = the outputs are tagged words (tdst, tdst2: q, or the new k/v row of a head
// in a tagged [n_kv, hd] buffer, never the cache; attention then polls them instead of waiting on an event).
// dst (tdst) gets the low half of each pair, dst2 (tdst2) the high half (q: dst2 points at it; cache: dst2 ==
// dst and the high half is + half).
#ifndef MEGART_TASKS_QKV_COMMON_CUH
#define MEGART_TASKS_QKV_COMMON_CUH

namespace megart_attn {
// kQkvMaxRows (2 * half; hd <= 128), kQkvMaxD and the kMode* bits: generated from tasks/attention_common.py

// Pair j of the instance: rows j and half + j after w.
struct QkvRows {
  const char* w;
  long long row_bytes;
  int half;
  __device__ __forceinline__ void operator()(int g, const void* (&p)[2]) const {
    p[0] = w + g * row_bytes;
    p[1] = w + (half + g) * row_bytes;
  }
  __device__ __forceinline__ megart::dense::StreamRows stream_rows() const {
    return megart::dense::StreamRows{w, w + half * row_bytes, row_bytes, 0x7fffffff};
  }
};
}  // namespace megart_attn

// The plan of either form: bf16 rows (qkv_rope_append) or e4m3 rows (qkv_rope_append_fp8, 16 weights a chunk).
template <class P>
__device__ __forceinline__ auto qkv_plan(const P& p) {
  constexpr bool kFp8 = sizeof(p.w[0]) == 1;
  return megart::dense::MatvecPlan<megart_attn::QkvRows>{
      p.npairs, p.d >> (kFp8 ? 4 : 3),
      megart_attn::QkvRows{reinterpret_cast<const char*>(p.w), (kFp8 ? 1ll : 2ll) * p.d, p.half}};
}

// The body of both forms. fp8: each row's dot times its f32 scale (scale points at the instance's first row,
// as w does), before the head norm and RoPE, as gemv_m1_fp8 scales before its epilogue.
template <class P>
__device__ __forceinline__ void qkv_body(const P& p, char* smem) {
  namespace dn = megart::dense;
  namespace at = megart_attn;
  constexpr bool kFp8 = sizeof(p.w[0]) == 1;
  const int pos = at::ld_in_i32(p.pos);
  const int np = p.npairs, half = p.half, lane = threadIdx.x & 31;
  uint4* xs = dn::xs_of(smem);
  float* scratch = dn::scratch_of(smem);
  float* dots = reinterpret_cast<float*>(smem + dn::kScratchBytes + 2 * at::kQkvMaxD);  // [np] lo, then [np] hi
  // Pair j = threadIdx.x's cos / sin (every pair's where np <= threads, as in every splitter's instance) are
  // loaded before x is staged: their round trip then overlaps x's, not the epilogue's (bench/RESULTS.md).
  float c_first = 1.f, s_first = 0.f;
  if ((p.mode & at::kModeRope) && (int)threadIdx.x < np && pos >= 0 && pos < p.max_seq) {
    const long long t = (long long)pos * half + p.pair0 + threadIdx.x;
    c_first = p.cos[t];
    s_first = p.sin[t];
  }
  dn::PartsSum sum;  // a folded all-reduce: x + the ranks' partials is staged, this instance's piece stored
  if (p.mode & at::kModeParts) sum = dn::PartsSum{p.parts, p.tp, p.x_out, p.x_lo, p.x_hi};
  dn::stage_x(p.x, p.norm_weight, p.d, (p.mode & at::kModeNorm) != 0, p.eps, xs, scratch, sum,
              (p.mode & at::kModeTaggedX) != 0);
  // (an out-of-range position still reads its weights: a streamed type consumes every stage it declared)
  auto epi = [&](int g, float lo, float hi) {
    if constexpr (kFp8) {
      lo *= __ldg(p.scale + g);
      hi *= __ldg(p.scale + half + g);
    }
    if (lane == 0) {
      dots[g] = lo;
      dots[np + g] = hi;
    }
  };
  dn::matvec_streamed<kFp8, P>(qkv_plan(p), xs, scratch, epi, [&](int g) {
    if constexpr (kFp8) {
      megart::prefetch_l1(p.scale + g);
      megart::prefetch_l1(p.scale + half + g);
    }
  });
  __syncthreads();
  if (pos < 0 || pos >= p.max_seq) return;  // out-of-range position: the instance writes nothing

  // per-head RMSNorm (mode 8): the mean square over all 2 * np == hd dots of the head, fp32
  float head_inv = 1.f;
  if (p.mode & at::kModeHeadNorm) {  // uniform over the CTA, so every thread reaches block_sum
    float ss = 0.f;
    for (int j = threadIdx.x; j < np; j += MEGART_THREADS) ss = fmaf(dots[j], dots[j], fmaf(dots[np + j], dots[np + j], ss));
    ss = megart::block_sum(ss, scratch);
    head_inv = rsqrtf(ss / (float)(2 * np) + p.eps);
  }

  for (int j = threadIdx.x; j < np; j += MEGART_THREADS) {
    float lo = dots[j], hi = dots[np + j];
    if (p.mode & at::kModeHeadNorm) {
      lo = lo * head_inv * __bfloat162float(p.head_norm[p.pair0 + j]);
      hi = hi * head_inv * __bfloat162float(p.head_norm[half + p.pair0 + j]);
    }
    float out_lo = lo, out_hi = hi;
    if (p.mode & at::kModeRope) {  // rotate-half RoPE on the pair (j, j + half), fp32
      const long long t = (long long)pos * half + p.pair0 + j;
      const bool first = j == (int)threadIdx.x;
      const float c = first ? c_first : p.cos[t], s = first ? s_first : p.sin[t];
      out_lo = lo * c - hi * s;
      out_hi = hi * c + lo * s;
    }
    if (p.mode & at::kModeTaggedOut) {
      megart::st_tagged(p.tdst, j, __float2bfloat16_rn(out_lo));
      megart::st_tagged(p.tdst2, j, __float2bfloat16_rn(out_hi));
      continue;
    }
    const long long row = (p.mode & at::kModeCache) ? (long long)pos * 2 * half : 0;
    const int hoff = (p.mode & at::kModeCache) ? half : 0;
    p.dst[row + j] = __float2bfloat16_rn(out_lo);
    p.dst2[row + hoff + j] = __float2bfloat16_rn(out_hi);
  }
}

// Before the instance's waits: pull this instance's W rows (both halves of its pairs) and the norm gain
// into L2. None of them depends on another task.
template <class P>
__device__ __forceinline__ void qkv_prefetch(const P& p) {
  if (threadIdx.x == 0) {
    const unsigned long long bytes = (unsigned long long)p.npairs * (unsigned long long)p.d * sizeof(p.w[0]);
    megart::prefetch_l2(p.w, bytes);
    megart::prefetch_l2(p.w + (long long)p.half * p.d, bytes);
    if (p.mode & megart_attn::kModeNorm) megart::prefetch_l2(p.norm_weight, (unsigned long long)p.d * 2ull);
  }
}

#endif  // MEGART_TASKS_QKV_COMMON_CUH
