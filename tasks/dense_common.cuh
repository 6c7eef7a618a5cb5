// Helpers shared by the dense decode task bodies (M = 1), first of three headers (tasks/dense_common.py
// HEADERS, in this order): vector loads (weights through the non-coherent path, activations coherent),
// bf16/fp8 unpacking and dot forms, x staging with the fused RMSNorm prologue. tasks/dense_engines.cuh
// holds the matvec engines (registers, the per-instance ring, the weight stream), tasks/dense_bodies.cuh
// the row plans, epilogues and the bodies several types share. Declared as the shared headers of every
// dense task type (TaskType.headers), so codegen emits them once per kernel, before the bodies.
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
  // The gain's first chunk per thread (all of it at k <= 8 * threads) is loaded before x, so its round trip
  // overlaps x's instead of following the sum of squares (the 1B step: -5 us, bench/RESULTS.md).
  const uint4 g_first = norm && (int)threadIdx.x < kc ? ld_weight(g + 8 * threadIdx.x) : make_uint4(0u, 0u, 0u, 0u);
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
      unpack8(c == (int)threadIdx.x ? g_first : ld_weight(g + 8 * c), h);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = f[i] * rstd * h[i];
      xs[c] = pack8(f);
    }
  }
  __syncthreads();
  span_mark(0);  // (profiled builds: x staged)
}

// x in pieces (MEGART_DENSE_X_PIECES, on by default; 0 stages x whole; tasks/gemv_m1.cuh): a tagged x with no norm
// is staged as stage_x does, chunk c by thread c mod MEGART_THREADS, but no barrier ends it. Each warp stages 32
// consecutive chunks at a time, all in one piece of `piece` chunks (one weight stage's), and arrives on the
// piece's mbarrier once its lanes have stored them; a stage's dots wait for their piece alone (XPieces), so a
// matvec begins on the pieces that have landed while the last writer of x is still finishing. The mbarriers lie
// in the scratch's upper half (the K-split combine uses its lower half). Ends with them initialised and every
// arrival issued.
#ifndef MEGART_DENSE_X_PIECES
#define MEGART_DENSE_X_PIECES 1  // (H200, one process: the 1B step -17 us at 2k, -22 at 128 tokens)
#endif
#ifndef MEGART_DENSE_X_PIECES_FP8
#define MEGART_DENSE_X_PIECES_FP8 1  // the same for gemv_m1_fp8 (H200, one process: 1b_fp8 -20 us, 1b_fp8_all -11)
#endif
// Whether an instance of the kernel reads a tagged x (set from the graph: tasks/dense_common.py's matvec_macros);
// only those take the pieces paths, so a kernel without one compiles none of them.
#ifndef MEGART_DENSE_TAGGED_X
#define MEGART_DENSE_TAGGED_X 1
#endif
// Who completes a piece: lane 0 once the warp's stores are done (__syncwarp orders them before its release; the
// default), every lane after its own store (MEGART_DENSE_X_ARRIVE_ALL=1: each arrive releases that lane's store,
// which racecheck follows; it reports the default form as a race; measured 10-23 us slower). (A third form, the
// stores completing the piece through st.async, ended in an illegal instruction on the H200 and was removed.)
#ifndef MEGART_DENSE_X_ARRIVE_ALL
#define MEGART_DENSE_X_ARRIVE_ALL 0
#endif
constexpr int kXArrive = MEGART_DENSE_X_ARRIVE_ALL;
// How many of a stager thread's chunks of a bf16 GEMV's x are read at once (MEGART_DENSE_X_BATCH): 1 reads,
// checks and stores one chunk before reading the next, so an x of kc chunks takes kc / MEGART_THREADS dependent
// round trips (4 for the 1B step's down); N issues N chunks' loads before checking the first. (The e4m3 GEMV
// stays at 1: with more, the fp8 configs' stream builds no longer fit their register budget.)
#ifndef MEGART_DENSE_X_BATCH
#define MEGART_DENSE_X_BATCH 1
#endif
constexpr int kXBatch = MEGART_DENSE_X_BATCH;
static_assert(kXBatch >= 1 && kXBatch <= 8, "MEGART_DENSE_X_BATCH is 1..8");
static_assert(kXArrive == 0 || kXArrive == 1, "MEGART_DENSE_X_ARRIVE_ALL is 0 or 1");
// The arrivals a piece's mbarrier expects per phase.
template <int kPiece>
constexpr unsigned kXPieceArrivals = kXArrive == 0 ? kPiece / 32 : kPiece;
constexpr int kMaxXPieces = kScratchBytes / 2 / 8;
__device__ __forceinline__ unsigned long long* x_piece_bars(float* scratch) {
  return reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(scratch) + kScratchBytes / 2);
}
// Whether x of k elements can be staged in pieces of `piece` chunks: whole pieces, at most kMaxXPieces.
__device__ __forceinline__ bool x_in_pieces(int k, int piece) {
  const int kc = k >> 3;
  return (k & 7) == 0 && kc % piece == 0 && kc / piece <= kMaxXPieces;
}
template <int kPiece, int kBatch = 1>
__device__ __forceinline__ void stage_x_pieces(const __nv_bfloat16* x, int k, uint4* xs, float* scratch) {
  static_assert(kPiece % 32 == 0, "a warp's 32 chunks lie in one piece");
  const int kc = k >> 3, lane = threadIdx.x & 31;
  unsigned long long* bars = x_piece_bars(scratch);
  if ((int)threadIdx.x < kc / kPiece) mbar_init<kXPieceArrivals<kPiece>>(bars + threadIdx.x);
  __syncthreads();  // (initialised before any arrival)
  // A thread's next kBatch chunks are read at once, then checked, stored and arrived for in order.
  for (int c0 = threadIdx.x - lane; c0 < kc; c0 += kBatch * MEGART_THREADS) {
    Tagged8 t[kBatch];
#pragma unroll
    for (int r = 0; r < kBatch; ++r)
      if (c0 + r * MEGART_THREADS < kc) t[r] = ld_tagged8_issue(x, 8 * (c0 + r * MEGART_THREADS + lane));
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      const int c = c0 + r * MEGART_THREADS;  // (kc is whole warps: a piece is)
      if (c >= kc) continue;
      xs[c + lane] = ld_tagged8_finish(x, 8 * (c + lane), t[r]);
      if constexpr (kXArrive == 1) {
        mbar_arrive(bars + c / kPiece);
      } else {
        __syncwarp();
        if (lane == 0) mbar_arrive(bars + c / kPiece);
      }
    }
  }
  span_mark(0);  // (profiled builds: thread 0's chunks of x staged)
}
// After every warp's last wait: the pieces' mbarriers back to plain shared memory.
__device__ __forceinline__ void x_pieces_done(int k, int piece, float* scratch) {
  __syncthreads();
  if ((int)threadIdx.x < (k >> 3) / piece) mbar_inval(x_piece_bars(scratch) + threadIdx.x);
}

}  // namespace dense
}  // namespace megart

#endif  // MEGART_TASKS_DENSE_COMMON_CUH
