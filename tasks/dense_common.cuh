// Helpers shared by the dense decode task bodies (M = 1): vector loads (weights through the
// non-coherent path, activations coherent), bf16/fp8 unpacking, x staging with the fused RMSNorm
// prologue, the warp-per-row-pair matvec engine, block argmax. Declared as the shared header of every
// dense task type (TaskType.headers), so codegen emits it once per kernel, before the bodies.
//
// Each body (tasks/<name>.cuh) is a template on its params struct: the generated dispatch switch calls
// megart_task_<name>(const megart_params_<name>&, char*) and instantiates it there. A non-template body
// of the same name (a candidate passed through source_overrides after the in-tree one) wins overload
// resolution over the template.
//
// Conventions: bf16 activations, fp32 accumulation, one bf16 rounding per output (after the
// epilogue), normalised x rounded to bf16 before the dot (like torch's bf16 RMSNorm output).
// Weights ("weight" params) are read with ld.global.nc; activations ("in" params) with plain loads.
#ifndef MEGART_TASKS_DENSE_COMMON_CUH
#define MEGART_TASKS_DENSE_COMMON_CUH

namespace megart {
namespace dense {

// kFlagResidual (gemv_m1 / gemv_m1_fp8: y = W x + residual), kFlagNorm (RMSNorm prologue on x with
// norm_weight), kFlagLogits (lm_head_argmax: also store the f32 logits) and kScratchBytes (block
// reductions: 32 floats + 32 ints; x is staged after it) come from tasks/dense_common.py, emitted
// just before this header.
constexpr int kWarps = MEGART_THREADS / 32;
static_assert(kScratchBytes >= 32 * 4 + 32 * 4, "block reductions need 32 floats + 32 ints");
constexpr int kUnroll = 8;          // 16-byte weight loads in flight per row per lane
constexpr int kNoIndex = 0x7fffffff;
// L2 prefetch budget per instance. A whole slice is not prefetched: 132 workers x (current + next
// instance) x a large slice (gate_up of Llama-1B: 500 KB; an LM-head tile: 4 MB) overflows the 60 MB
// L2, and lines evicted before use would be read from HBM twice. 64 KB is ~2 us of one SM's share of
// HBM bandwidth: enough to cover a dependency wait; the body's own loads stream the rest.
// MEGART_PREFETCH_KB overrides it for tuning sweeps (PersistentKernel(defines=...) or MEGART_DEFINES).
#ifdef MEGART_PREFETCH_KB
constexpr unsigned long long kPrefetchBytes = (unsigned long long)MEGART_PREFETCH_KB << 10;
#else
constexpr unsigned long long kPrefetchBytes = 64ull << 10;
#endif
static_assert(kWarps <= 32, "dense tasks assume at most 32 warps");

// ---- loads ----------------------------------------------------------------------------------
// Read-only weights: non-coherent path, no L1 allocation (streamed once), 256-byte L2 sectors.
// (Without __CUDA_ARCH__ this is the host simulation of megart/emulate/hostsim.py: a plain load.)
// With MEGART_L2_HINTS the streamed weights are marked evict-first in L2, so they do not push out the
// lines the L2 prefetcher brought in (evict-last) for the next instance.
__device__ __forceinline__ uint4 ld_weight(const void* p) {
#ifdef __CUDA_ARCH__
  uint4 v;
#ifdef MEGART_L2_HINTS
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(megart::l2_evict_first()));
#else
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
#endif
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

// Activations another task of this launch may have written: a plain (coherent) load.
__device__ __forceinline__ uint4 ld_act(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// ---- bf16 / fp8 packing ---------------------------------------------------------------------
__device__ __forceinline__ float bf_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  f[0] = bf_lo(v.x); f[1] = bf_hi(v.x); f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
  f[4] = bf_lo(v.z); f[5] = bf_hi(v.z); f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

__device__ __forceinline__ float dot8(const uint4& w, const float (&x)[8], float acc) {
  acc = fmaf(bf_lo(w.x), x[0], acc); acc = fmaf(bf_hi(w.x), x[1], acc);
  acc = fmaf(bf_lo(w.y), x[2], acc); acc = fmaf(bf_hi(w.y), x[3], acc);
  acc = fmaf(bf_lo(w.z), x[4], acc); acc = fmaf(bf_hi(w.z), x[5], acc);
  acc = fmaf(bf_lo(w.w), x[6], acc); acc = fmaf(bf_hi(w.w), x[7], acc);
  return acc;
}

// 4 e4m3 bytes -> 4 floats (exact: every e4m3 value is an f16 value).
__device__ __forceinline__ void fp8x4(unsigned v, float* f) {
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v >> 16), __NV_E4M3);
  const float2 fa = __half22float2(__half2(a)), fb = __half22float2(__half2(b));
  f[0] = fa.x; f[1] = fa.y; f[2] = fb.x; f[3] = fb.y;
}

__device__ __forceinline__ float dot16_fp8(const uint4& w, const uint4& x0, const uint4& x1, float acc) {
  float wf[16], xf[8];
  fp8x4(w.x, wf); fp8x4(w.y, wf + 4); fp8x4(w.z, wf + 8); fp8x4(w.w, wf + 12);
  unpack8(x0, xf);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(wf[i], xf[i], acc);
  unpack8(x1, xf);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(wf[8 + i], xf[i], acc);
  return acc;
}

// Prefetch the first min(bytes, cap) bytes of a weight slice into L2 (16-byte units; call from one thread).
__device__ __forceinline__ void prefetch_head(const void* p, unsigned long long bytes,
                                              unsigned long long cap = kPrefetchBytes) {
  megart::prefetch_l2(p, bytes < cap ? bytes : cap);
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// ---- x staging (+ fused RMSNorm prologue) ------------------------------------------------------
// A tensor-parallel all-reduce folded into the staging (kFlagParts): x becomes bf16(x + parts[0] + ... +
// parts[tp - 1]), the f32 slots k elements apart summed in rank order and rounded once (tp_sum_f32's
// arithmetic, so every rank stages the same bits), and this instance stores elements [out_lo, out_hi) of
// that sum to out (the residual stream's next value; multiples of 8).
struct PartsSum {
  const float* parts = nullptr;  // nullptr: x is staged as it is
  int tp = 0;
  __nv_bfloat16* out = nullptr;  // element out_lo of the sum is out[0]
  int out_lo = 0, out_hi = 0;
};

// xs[0:k) = x (or the sum above), or bf16(x * rsqrt(mean(x^2) + eps) * g) when `norm`. k % 8 == 0, x and
// g 16-byte aligned. Every CTA reduces the whole x itself (no grid barrier before the GEMV). Ends synced.
// `tagged`: x holds tagged words (csrc/tagged.cuh), polled until they carry this step's tag.
__device__ __forceinline__ void stage_x(const __nv_bfloat16* x, const __nv_bfloat16* g, int k, bool norm,
                                        float eps, uint4* xs, float* scratch, const PartsSum& sum = PartsSum{},
                                        bool tagged = false) {
  const int kc = k >> 3;
  float ss = 0.f;
  for (int c = threadIdx.x; c < kc; c += MEGART_THREADS) {
    uint4 v = tagged ? ld_tagged8(x, 8 * c) : ld_act(x + 8 * c);
    if (sum.parts != nullptr) {
      float f[8];
      unpack8(v, f);
      for (int r = 0; r < sum.tp; ++r) {
        const float* s = sum.parts + (long long)r * k + 8 * c;
        const uint4 a = ld_act(s), b = ld_act(s + 4);
        f[0] += __uint_as_float(a.x); f[1] += __uint_as_float(a.y); f[2] += __uint_as_float(a.z);
        f[3] += __uint_as_float(a.w); f[4] += __uint_as_float(b.x); f[5] += __uint_as_float(b.y);
        f[6] += __uint_as_float(b.z); f[7] += __uint_as_float(b.w);
      }
      v = pack8(f);
      if (8 * c >= sum.out_lo && 8 * c < sum.out_hi) reinterpret_cast<uint4*>(sum.out)[c - (sum.out_lo >> 3)] = v;
    }
    xs[c] = v;
    if (norm) {
      float f[8];
      unpack8(v, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
    }
  }
  if (norm) {
    const float rstd = rsqrtf(block_sum(ss, scratch) / (float)k + eps);
    for (int c = threadIdx.x; c < kc; c += MEGART_THREADS) {
      float f[8], h[8];
      unpack8(xs[c], f);
      unpack8(ld_weight(g + 8 * c), h);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = f[i] * rstd * h[i];
      xs[c] = pack8(f);
    }
  }
  __syncthreads();
  span_mark(0);  // (profiled builds: x staged)
}

// ---- warp dot products ---------------------------------------------------------------------------
// acc[r] += this lane's share of w_r[c0:c1) . xs[c0:c1) (in 16-byte weight chunks; warp_sum after).
// Both rows share each staged x chunk; 2 * kUnroll 16-byte weight loads per lane are in flight
// before the first FMA. Past c1 the weights load as zero against a valid x chunk (no branches).
template <bool FP8>
__device__ __forceinline__ void dot2(const void* const (&w)[2], const uint4* xs, int c0, int c1, float (&acc)[2]) {
  const int lane = threadIdx.x & 31;
  const uint4* w0 = static_cast<const uint4*>(w[0]);
  const uint4* w1 = static_cast<const uint4*>(w[1]);
  for (int c = c0 + lane; c < c1; c += 32 * kUnroll) {
    uint4 wa[kUnroll], wb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool live = c + 32 * u < c1;
      wa[u] = live ? ld_weight(w0 + c + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
      wb[u] = live ? ld_weight(w1 + c + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int cx = min(c + 32 * u, c1 - 1);
      if constexpr (FP8) {  // one chunk = 16 e4m3 weights = two staged bf16 x chunks
        const uint4 x0 = xs[2 * cx], x1 = xs[2 * cx + 1];
        acc[0] = dot16_fp8(wa[u], x0, x1, acc[0]);
        acc[1] = dot16_fp8(wb[u], x0, x1, acc[1]);
      } else {
        float xf[8];
        unpack8(xs[cx], xf);
        acc[0] = dot8(wa[u], xf, acc[0]);
        acc[1] = dot8(wb[u], xf, acc[1]);
      }
    }
  }
}

// Split-K tail of a matvec (groups < kWarps): every warp's summed partials go to `red`, then warp
// g < groups adds the kWarps / groups partials of its group in a fixed order and runs epi. Ends synced.
template <class Epi>
__device__ __forceinline__ void combine_split(const float (&s)[2], int groups, float* red, Epi epi) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, split = kWarps / groups;
  if (lane == 0) {
    red[2 * warp] = s[0];
    red[2 * warp + 1] = s[1];
  }
  __syncthreads();
  if (warp < groups) {
    float a = 0.f, b = 0.f;
    for (int q = 0; q < split; ++q) {
      a += red[2 * (warp * split + q)];
      b += red[2 * (warp * split + q) + 1];
    }
    epi(warp, a, b);
  }
  __syncthreads();
}

// ---- weight ring: TMA bulk copies of weight stages into shared memory -----------------------------
// With MEGART_DENSE_RING_SLOTS > 0 (a kernel macro, off by default: see tasks/dense_common.py
// for the measurements) a task that declares a prewait streams its weights through a per-warp ring
// instead of registers. The prewait (run by the worker BEFORE the instance's dependency wait: weights
// never depend on it) fills every warp's first slots, so the copies of instance i+1 are in flight while
// the producer of its input is still finishing; the body
// consumes stage j from slot j % slots and refills the slot with stage j + slots. A stage is one row
// pair's next kStageChunks 16-byte chunks (the same chunks, in the same order, as dot2's registers, so
// both paths give bit-identical sums for finite x). Ring region (at MEGART_DENSE_RING_OFFSET, after x
// staging; Python computes every size here and passes it in, these asserts only check the C++ agrees):
// kWarps x slots mbarriers (8-byte aligned: first), issued[kWarps] (stages issued this instance), padding
// to MEGART_DENSE_RING_HEAD_BYTES, then the slots of MEGART_DENSE_RING_SLOT_BYTES.
#ifndef MEGART_DENSE_RING_SLOTS
#define MEGART_DENSE_RING_SLOTS 0
#endif
constexpr int kRingSlots = MEGART_DENSE_RING_SLOTS;
// Per row per stage: one register batch of dot2, or fewer with the weight stream (MEGART_STREAM_STAGE,
// megart/stream.py). Each lane still reads its chunks in dot2's order, so every size gives the same sums.
#ifdef MEGART_STREAM_STAGE_CHUNKS
constexpr int kStageChunks = MEGART_STREAM_STAGE_CHUNKS;
#else
constexpr int kStageChunks = 32 * kUnroll;
#endif
static_assert(kStageChunks % 32 == 0 && kStageChunks <= 32 * kUnroll, "a stage is 1..kUnroll chunks per lane");
constexpr int kStageUnroll = kStageChunks / 32;    // chunks per lane per row in one stage
constexpr int kSlotBytes = 2 * kStageChunks * 16;  // a row pair's stage
#if MEGART_DENSE_RING_SLOTS > 0
#if !defined(MEGART_DENSE_RING_OFFSET) || !defined(MEGART_DENSE_RING_HEAD_BYTES) || !defined(MEGART_DENSE_RING_SLOT_BYTES)
#error "MEGART_DENSE_RING_SLOTS needs the ring layout from tasks/dense_common.py (defines_for): declare the task type with it"
#endif
static_assert(MEGART_DENSE_RING_SLOT_BYTES == kSlotBytes, "dense_common.py SLOT_BYTES disagrees with kSlotBytes");
static_assert(MEGART_DENSE_RING_OFFSET % 128 == 0, "the ring starts 128-byte aligned");
static_assert(MEGART_DENSE_RING_HEAD_BYTES >= kWarps * kRingSlots * 8 + kWarps * 4 &&
              MEGART_DENSE_RING_HEAD_BYTES % 128 == 0, "ring head too small");
constexpr int kRingOffset = MEGART_DENSE_RING_OFFSET, kRingHeadBytes = MEGART_DENSE_RING_HEAD_BYTES;
#else
constexpr int kRingOffset = 0, kRingHeadBytes = 0;
#endif

__device__ __forceinline__ unsigned long long* ring_bar(char* smem, int warp, int slot) {
  return reinterpret_cast<unsigned long long*>(smem + kRingOffset) + warp * kRingSlots + slot;
}
__device__ __forceinline__ int* ring_issued(char* smem) {
  return reinterpret_cast<int*>(smem + kRingOffset + kWarps * kRingSlots * 8);
}
__device__ __forceinline__ const uint4* ring_slot(char* smem, int warp, int slot) {
  return reinterpret_cast<const uint4*>(smem + kRingOffset + kRingHeadBytes + (size_t)(warp * kRingSlots + slot) * kSlotBytes);
}

// The k-th (row pair, chunk range) segment warp `warp` owns in a matvec over `groups` pairs of kc chunks:
// whole pairs g = warp, warp + kWarps, ... when groups >= kWarps, else one K slice (see matvec).
struct Segment {
  int g, c0, c1;
};
__device__ __forceinline__ bool warp_segment(int groups, int kc, int warp, int k, Segment& s) {
  if (groups >= kWarps) {
    s = Segment{warp + k * kWarps, 0, kc};
    return s.g < groups;
  }
  const int split = kWarps / groups, g = warp / split, part = warp - g * split;
  s = Segment{g, (int)((long long)kc * part / split), (int)((long long)kc * (part + 1) / split)};
  return k == 0 && g < groups;
}

// Walks a warp's stages in order: segment k, chunk c (stage = [c, min(c + kStageChunks, c1))).
struct StageCursor {
  int groups, kc, warp, k;
  Segment s;
  int c;
  bool live;
  __device__ __forceinline__ StageCursor(int groups_, int kc_, int warp_) : groups(groups_), kc(kc_), warp(warp_), k(0) {
    live = warp_segment(groups, kc, warp, 0, s);
    c = s.c0;
    skip_empty();
  }
  __device__ __forceinline__ void skip_empty() {
    while (live && c >= s.c1) {  // an empty K slice (kc < split) has no stage
      live = warp_segment(groups, kc, warp, ++k, s);
      c = s.c0;
    }
  }
  __device__ __forceinline__ void next() {
    c += kStageChunks;
    skip_empty();
  }
};

// The segment walk of the shared-memory engines (ring and stream): whole row pairs per warp, epi per
// pair, or one K slice per warp combined across warps, as matvec does. consume_segment(acc) adds the
// cursor's current segment (its stages, in order) to acc and leaves the cursor on the next one.
template <class Epi, class Consume>
__device__ __forceinline__ void walk_segments(const StageCursor& st, int groups, float* red, Epi epi,
                                              Consume consume_segment) {
  if (groups >= kWarps) {
    while (st.live) {
      const int g = st.s.g;
      float s[2] = {0.f, 0.f};
      consume_segment(s);
      epi(g, warp_sum(s[0]), warp_sum(s[1]));
    }
    return;
  }
  float s[2] = {0.f, 0.f};
  if (st.live) consume_segment(s);  // one K slice per warp; empty when kc < split
  s[0] = warp_sum(s[0]);
  s[1] = warp_sum(s[1]);
  combine_split(s, groups, red, epi);
}

// Lane 0 of the warp: issue the cursor's stage into slot `slot`.
template <class Rows>
__device__ __forceinline__ void ring_issue(const StageCursor& st, const Rows& rows, char* smem, int warp, int slot) {
  const void* w[2];
  rows(st.s.g, w);
  const int n = min(kStageChunks, st.s.c1 - st.c);
  unsigned long long* b = ring_bar(smem, warp, slot);
  const uint4* dst = ring_slot(smem, warp, slot);
  mbar_expect(b, 2u * 16u * (unsigned)n);
  bulk_load(dst, static_cast<const uint4*>(w[0]) + st.c, 16u * n, b);
  bulk_load(dst + kStageChunks, static_cast<const uint4*>(w[1]) + st.c, 16u * n, b);
}

// Prewait: every warp's lane 0 initialises its slots' barriers and issues its first stages.
template <class Rows>
__device__ __forceinline__ void ring_fill(int groups, int kc, const Rows& rows, char* smem) {
  if constexpr (kRingSlots > 0) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) != 0) return;
    for (int sl = 0; sl < kRingSlots; ++sl) mbar_init(ring_bar(smem, warp, sl));
    mbar_init_fence();
    StageCursor st(groups, kc, warp);
    int j = 0;
    for (; j < kRingSlots && st.live; ++j, st.next()) ring_issue(st, rows, smem, warp, j);
    ring_issued(smem)[warp] = j;
  }
}

// After the body (or instead of it, when the wait was aborted): each warp's lane 0 waits for the last
// stage it issued into every slot, so no copy is in flight when the shared memory is reused, and
// invalidates the barriers. Bodies that consumed every stage pass straight through.
__device__ __forceinline__ void ring_drain(char* smem) {
  if constexpr (kRingSlots > 0) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) != 0) return;
    const int issued = ring_issued(smem)[warp];
    for (int sl = 0; sl < kRingSlots; ++sl) {
      unsigned long long* b = ring_bar(smem, warp, sl);
      if (sl < issued) mbar_wait(b, (unsigned)(((issued - 1 - sl) / kRingSlots) & 1));
      mbar_inval(b);
    }
  }
}

// acc[] += the lane's share of one stage (chunks [c, c + n) of both rows, staged in `slot`). kPartial: n may
// be short of kStageChunks, so each chunk is guarded. An fp8 stage that is full has no branch between its
// chunks, so its shared-memory loads can be in flight together (guarded, each chunk's loads wait behind the
// previous chunk's branch): 1b_fp8_all -4 us. The bf16 stages keep the guarded form, which measured 6 us
// faster on the 1B step than the branch-free one (bench/RESULTS.md, thirteenth session).
template <bool FP8, bool kPartial>
__device__ __forceinline__ void dot2_stage_chunks(const uint4* slot, const uint4* xs, int c, int n, float (&acc)[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kStageUnroll; ++u) {
    const int i = lane + 32 * u;
    if (!kPartial || i < n) {
      const uint4 wa = slot[i], wb = slot[kStageChunks + i];
      if constexpr (FP8) {
        const uint4 x0 = xs[2 * (c + i)], x1 = xs[2 * (c + i) + 1];
        acc[0] = dot16_fp8(wa, x0, x1, acc[0]);
        acc[1] = dot16_fp8(wb, x0, x1, acc[1]);
      } else {
        float xf[8];
        unpack8(xs[c + i], xf);
        acc[0] = dot8(wa, xf, acc[0]);
        acc[1] = dot8(wb, xf, acc[1]);
      }
    }
  }
}
template <bool FP8>
__device__ __forceinline__ void dot2_stage(const uint4* slot, const uint4* xs, int c, int n, float (&acc)[2]) {
  if (FP8 && n == kStageChunks)
    dot2_stage_chunks<FP8, false>(slot, xs, c, n, acc);
  else
    dot2_stage_chunks<FP8, true>(slot, xs, c, n, acc);
}

// matvec (below) with the weights coming through the ring the prewait started (same work split, same
// sums). `st` walks the stages being consumed; `ahead` runs kRingSlots stages in front: when stage j
// has been read out of slot j % kRingSlots, lane 0 refills that slot with stage j + kRingSlots.
template <bool FP8, class Rows, class Epi>
__device__ __forceinline__ void matvec_ring(int groups, int kc, const uint4* xs, float* red, Rows rows, Epi epi,
                                            char* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  StageCursor st(groups, kc, warp), ahead(groups, kc, warp);
  for (int a = 0; a < kRingSlots && ahead.live; ++a) ahead.next();  // the prewait issued these
  int j = 0;
  auto consume_segment = [&](float (&acc)[2]) {
    const int k = st.k;
    while (st.live && st.k == k) {
      const int slot = j % kRingSlots;
      mbar_wait(ring_bar(smem, warp, slot), (unsigned)((j / kRingSlots) & 1));
      dot2_stage<FP8>(ring_slot(smem, warp, slot), xs, st.c, min(kStageChunks, st.s.c1 - st.c), acc);
      __syncwarp();
      if (ahead.live) {
        if (lane == 0) {
          ring_issue(ahead, rows, smem, warp, slot);
          ++ring_issued(smem)[warp];
        }
        ahead.next();
      }
      ++j;
      st.next();
    }
  };
  walk_segments(st, groups, red, epi, consume_segment);
}

// Matrix-vector over `groups` row pairs: rows(g, ptr) names the two weight rows of group g (the same
// row twice for an odd tail), kc = 16-byte chunks per row, epi(g, dot0, dot1) runs on every lane of
// one warp with full fp32 sums (bit-identical across lanes: butterfly sums commute).
// groups >= warps: each warp owns whole groups (g = warp, warp + kWarps, ...). Fewer groups than
// warps: the idle warps split K instead (kWarps / groups warps per group, partial sums combined in
// `red`, 2 floats per warp, in a fixed order), so a small instance still has every warp streaming.
template <bool FP8, class Rows, class Epi>
__device__ __forceinline__ void matvec(int groups, int kc, const uint4* xs, float* red, Rows rows, Epi epi) {
  const int warp = threadIdx.x >> 5;
  if (groups >= kWarps) {
    for (int g = warp; g < groups; g += kWarps) {
      const void* w[2];
      rows(g, w);
      float s[2] = {0.f, 0.f};
      dot2<FP8>(w, xs, 0, kc, s);
      epi(g, warp_sum(s[0]), warp_sum(s[1]));
    }
    return;
  }
  const int split = kWarps / groups, g = warp / split, part = warp - g * split;  // (warp_segment's split)
  float s[2] = {0.f, 0.f};
  if (g < groups) {
    const void* w[2];
    rows(g, w);
    dot2<FP8>(w, xs, (int)((long long)kc * part / split), (int)((long long)kc * (part + 1) / split), s);
    s[0] = warp_sum(s[0]);
    s[1] = warp_sum(s[1]);
  }
  combine_split(s, groups, red, epi);
}

// A plan's rows as the weight stream's producer caches them: group g's two rows start at a + g * step and
// (g < pair_end ? b + g * step : the first row again).
struct StreamRows {
  const char* a;
  const char* b;
  long long step;
  int pair_end;
};

// ---- the weight stream's dense stage format (csrc/weight_stream.cuh) ------------------------------
// A streamed dense type's stream is its MatvecPlan walked by StageCursor: for each warp, the same stages
// in the same order as the ring above and dot2's registers, so every engine gives the same sums. The
// cursor between two calls lives in the warp's WarpStream (the producer is lane 0 of the warp).
#if MEGART_STREAM_SLOTS > 0
static_assert(kStreamSlotBytes == kSlotBytes, "megart/stream.py SLOT_BYTES disagrees with the dense stage size");

// What the producer keeps of an open entry: the warp's stage cursor and its rows (StreamRows, above).
struct DenseStreamState {
  StreamRows rows;
  StageCursor st;
};
static_assert(sizeof(DenseStreamState) <= sizeof(WarpStream::cursor), "DenseStreamState does not fit WarpStream::cursor");

// Producer lane, once per (warp, entry): the plan's rows and the warp's first stage.
template <class Plan>
__device__ __forceinline__ bool stream_open(const Plan& plan, WarpStream& ws, int warp) {
  DenseStreamState& s = *reinterpret_cast<DenseStreamState*>(ws.cursor);
  s.rows = plan.rows.stream_rows();
  s.st = StageCursor(plan.groups, plan.kc, warp);
  return s.st.live;
}
}  // namespace dense

// Producer lane: issue compute warp `warp`'s next stage of the open entry into `slot` (evict-first in L2:
// each weight byte is read once).
__device__ __forceinline__ bool stream_format_next(WarpStream& ws, int warp, int slot) {
  dense::DenseStreamState& s = *reinterpret_cast<dense::DenseStreamState*>(ws.cursor);
  dense::StageCursor& st = s.st;
  if (!st.live) return false;
  const long long off = (long long)st.s.g * s.rows.step;
  const char* r0 = s.rows.a + off;
  const char* r1 = st.s.g < s.rows.pair_end ? s.rows.b + off : r0;
  const int n = min(dense::kStageChunks, st.s.c1 - st.c);
  unsigned long long* b = stream_full(warp, slot);
  const uint4* dst = reinterpret_cast<const uint4*>(stream_slot(warp, slot));
  mbar_expect(b, 2u * 16u * (unsigned)n);
#ifdef __CUDA_ARCH__
  const unsigned long long pol = l2_evict_first();
#else
  const unsigned long long pol = 0;
#endif
  bulk_load_hint(dst, reinterpret_cast<const uint4*>(r0) + st.c, 16u * n, b, pol);
  bulk_load_hint(dst + dense::kStageChunks, reinterpret_cast<const uint4*>(r1) + st.c, 16u * n, b, pol);
  st.next();
  return true;
}
namespace dense {

// matvec (below) with the weights coming from the stream: same work split, same sums.
template <bool FP8, class Epi>
__device__ __forceinline__ void matvec_stream(int groups, int kc, const uint4* xs, float* red, Epi epi) {
  const int warp = threadIdx.x >> 5;
  StageCursor st(groups, kc, warp);
  auto consume_segment = [&](float (&acc)[2]) {
    const int k = st.k;
    while (st.live && st.k == k) {
      const uint4* slot = reinterpret_cast<const uint4*>(stream_acquire(warp));
      dot2_stage<FP8>(slot, xs, st.c, min(kStageChunks, st.s.c1 - st.c), acc);
      stream_release(warp);
      st.next();
    }
  };
  walk_segments(st, groups, red, epi, consume_segment);
}
#endif  // MEGART_STREAM_SLOTS > 0

// A matvec's work: `groups` row pairs of `kc` 16-byte chunks each, rows named by `rows`. A task with a
// prewait builds it once (plan_<name>) for both the prewait's ring_fill and the body.
template <class Rows>
struct MatvecPlan {
  int groups, kc;
  Rows rows;
};
template <class Rows>
__device__ __forceinline__ void ring_fill(const MatvecPlan<Rows>& m, char* smem) {
  ring_fill(m.groups, m.kc, m.rows, smem);
}
// Epilogue operands. An epilogue that loads a read-only operand per group (an fp8 row's scale) would stall
// its warp for a memory round trip after every group's dots, behind the weight stream's traffic; at one
// stage per group (k = 2048 in fp8) that round trip cost more than the stage. `pre(g)` asks L1 for group g's
// operands; every group the warp will finish is asked for before its first stage. NoPre: none.
struct NoPre {
  __device__ __forceinline__ void operator()(int) const {}
};
template <class Pre>
__device__ __forceinline__ void prefetch_epilogues(int groups, Pre pre) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (groups >= kWarps) {  // whole pairs: warp w finishes groups w, w + kWarps, ...
    for (int g = warp + kWarps * lane; g < groups; g += 32 * kWarps) pre(g);
  } else if (lane == 0) {  // one K slice per warp: group warp / split
    const int split = kWarps / groups;
    if (warp % split == 0 && warp / split < groups) pre(warp / split);
  }
}
__device__ __forceinline__ void prefetch_epilogues(int, NoPre) {}

// The engine of a matvec: the launch-wide stream when the type is streamed (P, its params struct, says so),
// else the per-instance ring its prewait filled (kRing: the type has a prewait, and the kernel a ring), else
// registers.
template <bool FP8, class P, bool kRing, class Rows, class Epi>
__device__ __forceinline__ void matvec_engines(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                               char* smem) {
#if MEGART_STREAM_SLOTS > 0
  if constexpr (StreamOn<P>::value) {
    matvec_stream<FP8>(m.groups, m.kc, xs, red, epi);
    span_mark(1);
    return;
  }
#endif
  if constexpr (kRing && kRingSlots > 0)
    matvec_ring<FP8>(m.groups, m.kc, xs, red, m.rows, epi, smem);
  else
    matvec<FP8>(m.groups, m.kc, xs, red, m.rows, epi);
  span_mark(1);  // (profiled builds: the dots and their epilogues done, on warp 0)
}
// Before the engine: ask for the epilogues' operands (pre).
template <bool FP8, class P, bool kRing, class Rows, class Epi, class Pre>
__device__ __forceinline__ void matvec_entry(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                             char* smem, Pre pre) {
  prefetch_epilogues(m.groups, pre);
  matvec_engines<FP8, P, kRing>(m, xs, red, epi, smem);
}

// The body side of a task with a prewait: weights from the stream, from the ring the prewait filled, or through
// registers when this kernel has neither (MEGART_DENSE_RING_SLOTS == 0: the prewait did nothing).
template <bool FP8, class P, class Rows, class Epi, class Pre = NoPre>
__device__ __forceinline__ void matvec_prewaited(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                                 char* smem, Pre pre = Pre{}) {
  matvec_entry<FP8, P, true>(m, xs, red, epi, smem, pre);
}

// The body side of a type without a prewait (qkv_rope_append): weights from the launch-wide stream when
// the type is streamed, else through registers (the per-instance ring needs a prewait to fill it).
template <bool FP8, class P, class Rows, class Epi, class Pre = NoPre>
__device__ __forceinline__ void matvec_streamed(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                                Pre pre = Pre{}) {
  matvec_entry<FP8, P, false>(m, xs, red, epi, nullptr, pre);
}

// Row pairs (2g, 2g + 1) of a row-major W with n rows of `row_bytes`.
struct PairRows {
  const char* w;
  int n;
  long long row_bytes;
  __device__ __forceinline__ void operator()(int g, const void* (&p)[2]) const {
    const int r = 2 * g, r1 = r + 1 < n ? r + 1 : r;
    p[0] = w + r * row_bytes;
    p[1] = w + r1 * row_bytes;
  }
  // The same rows for the weight stream: 2g + 1 < n exactly when g < n / 2.
  __device__ __forceinline__ StreamRows stream_rows() const { return StreamRows{w, w + row_bytes, 2 * row_bytes, n / 2}; }
};

// The plan of a row-major W with n rows of k elements (bf16, or e4m3 with FP8): row pairs (2g, 2g + 1).
template <bool FP8>
__device__ __forceinline__ MatvecPlan<PairRows> pair_plan(const void* w, int n, int k) {
  return MatvecPlan<PairRows>{(n + 1) >> 1, k >> (FP8 ? 4 : 3),
                              PairRows{reinterpret_cast<const char*>(w), n, (FP8 ? 1ll : 2ll) * k}};
}

// gate_up_silu / gate_up_silu_fp8: group g is (gate row g, up row g), rows of k elements (bf16 or e4m3).
template <bool FP8, class P>
struct GateUpRows {
  const P& p;
  static constexpr long long kElem = FP8 ? 1 : 2;
  __device__ __forceinline__ void operator()(int g, const void* (&w)[2]) const {
    w[0] = reinterpret_cast<const char*>(p.w_gate) + (size_t)g * p.k * kElem;
    w[1] = reinterpret_cast<const char*>(p.w_up) + (size_t)g * p.k * kElem;
  }
  __device__ __forceinline__ StreamRows stream_rows() const {  // (the weight stream)
    return {reinterpret_cast<const char*>(p.w_gate), reinterpret_cast<const char*>(p.w_up), kElem * p.k, p.n};
  }
};
template <bool FP8, class P>
__device__ __forceinline__ MatvecPlan<GateUpRows<FP8, P>> gate_up_plan(const P& p) {
  return MatvecPlan<GateUpRows<FP8, P>>{p.n, p.k >> (FP8 ? 4 : 3), GateUpRows<FP8, P>{p}};
}

__device__ __forceinline__ uint4* xs_of(char* smem) { return reinterpret_cast<uint4*>(smem + kScratchBytes); }
__device__ __forceinline__ float* scratch_of(char* smem) { return reinterpret_cast<float*>(smem); }

// (v, i) beats (bv, bi): larger value, ties to the lower index. NaN is treated as -inf by callers.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float nan_low(float v) { return v != v ? neg_inf() : v; }

// Block-wide (value, index) argmax; thread 0 gets the answer. `scratch` holds 32 floats + 32 ints.
__device__ __forceinline__ void block_argmax(float& bv, int& bi, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  int* sidx = reinterpret_cast<int*>(scratch + 32);
  __syncthreads();
  if (lane == 0) { scratch[warp] = bv; sidx[warp] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w)
      if (better(scratch[w], sidx[w], bv, bi)) { bv = scratch[w]; bi = sidx[w]; }
  }
}

// Output r of a GEMV (gemv_m1, gemv_m1_fp8) from its fp32 dot v: y[r] = bf16(v (+ residual[r])), residual and
// y as plain bf16 or tagged words as the flags say.
template <class P>
__device__ __forceinline__ void gemv_store(const P& p, int r, float v) {
  if (p.flags & kFlagResidual)
    v += (p.flags & kFlagTaggedRes) ? __uint_as_float(ld_tagged(p.residual, r) << 16) : __bfloat162float(p.residual[r]);
  const __nv_bfloat16 y = __float2bfloat16_rn(v);
  if (p.flags & kFlagTaggedOut) st_tagged(p.y, r, y);
  else p.y[r] = y;
}

// The gate/up body (gate_up_silu, gate_up_silu_fp8): h[g] = bf16(silu(gate) * up) in fp32 (FP8: each dot
// times its row's scale first).
template <bool FP8, class P, class Rows>
__device__ __forceinline__ void gate_up_body(const P& p, const MatvecPlan<Rows>& plan, const float* s_gate,
                                             const float* s_up, char* smem) {
  uint4* xs = xs_of(smem);
  PartsSum sum;
  if (p.flags & kFlagParts) sum = PartsSum{p.parts, p.tp, p.x_out, p.x_lo, p.x_hi};
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem), sum, p.flags & kFlagTaggedX);
  const int lane = threadIdx.x & 31;
  const bool tag_out = p.flags & kFlagTaggedOut;
  auto epi = [&](int g, float gate, float up) {
    if constexpr (FP8) {
      gate *= __ldg(s_gate + g);
      up *= __ldg(s_up + g);
    }
    const __nv_bfloat16 h = __float2bfloat16_rn(silu(gate) * up);
    if (lane == 0) {
      if (tag_out) st_tagged(p.h, g, h);
      else p.h[g] = h;
    }
  };
  matvec_prewaited<FP8, P>(plan, xs, scratch_of(smem), epi, smem, [&](int g) {
    if constexpr (FP8) {
      prefetch_l1(s_gate + g);
      prefetch_l1(s_up + g);
    }
  });
}

// The LM head's body (lm_head_argmax, lm_head_argmax_fp8): the logits of the instance's rows (FP8: times
// the row's scale after the fp32 dot), stored when kFlagLogits, and the instance's (max, row) partial.
template <bool FP8, class P, class Rows>
__device__ __forceinline__ void lm_head_body(const P& p, const MatvecPlan<Rows>& plan, const float* scale, char* smem) {
  uint4* xs = xs_of(smem);
  stage_x(p.x, p.norm_weight, p.k, p.flags & kFlagNorm, p.eps, xs, scratch_of(smem), PartsSum{},
          p.flags & kFlagTaggedX);
  const bool store = p.flags & kFlagLogits;
  const int lane = threadIdx.x & 31;
  float bv = neg_inf();
  int bi = kNoIndex;
  auto epi = [&](int g, float a, float b) {
    const int r = 2 * g;
    if constexpr (FP8) {
      a *= __ldg(scale + r);
      if (r + 1 < p.n) b *= __ldg(scale + r + 1);
    }
    if (store && lane < 2 && r + lane < p.n) p.logits[r + lane] = lane ? b : a;
    a = nan_low(a);
    if (better(a, p.row0 + r, bv, bi)) { bv = a; bi = p.row0 + r; }
    if (r + 1 < p.n) {
      b = nan_low(b);
      if (better(b, p.row0 + r + 1, bv, bi)) { bv = b; bi = p.row0 + r + 1; }
    }
  };
  matvec_prewaited<FP8, P>(plan, xs, scratch_of(smem), epi, smem, [&](int g) {
    if constexpr (FP8) prefetch_l1(scale + 2 * g);
  });
  block_argmax(bv, bi, scratch_of(smem));
  if (threadIdx.x == 0) {
    p.part_val[0] = bv;
    p.part_idx[0] = bi;
  }
}

}  // namespace dense
}  // namespace megart

#endif  // MEGART_TASKS_DENSE_COMMON_CUH
