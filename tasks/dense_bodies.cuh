// Row plans, epilogues and the bodies several dense types share (after tasks/dense_engines.cuh).
#ifndef MEGART_TASKS_DENSE_BODIES_CUH
#define MEGART_TASKS_DENSE_BODIES_CUH

namespace megart {
namespace dense {

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

// gate_up_silu / gate_up_silu_fp8: group g is (gate row r, up row r) and h[r], r = row(g) (g itself, or the
// instance's rows dealt in rounds: RowMap), rows of k elements (bf16 or e4m3).
template <bool FP8, class P>
struct GateUpRows {
  const P& p;
  static constexpr long long kElem = FP8 ? 1 : 2;
  __device__ __forceinline__ int row(int g) const { return row_map(p)(g); }
  __device__ __forceinline__ void operator()(int g, const void* (&w)[2]) const {
    w[0] = reinterpret_cast<const char*>(p.w_gate) + (size_t)row(g) * p.k * kElem;
    w[1] = reinterpret_cast<const char*>(p.w_up) + (size_t)row(g) * p.k * kElem;
  }
  __device__ __forceinline__ StreamRows stream_rows() const {  // (the weight stream)
#if MEGART_DENSE_ROW_ROUNDS
    return StreamRows(reinterpret_cast<const char*>(p.w_gate), reinterpret_cast<const char*>(p.w_up), kElem * p.k,
                      p.n, row_map(p));
#else
    return {reinterpret_cast<const char*>(p.w_gate), reinterpret_cast<const char*>(p.w_up), kElem * p.k, p.n};
#endif
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

// A streamed gemv of a tagged x with no norm, x in pieces (gemv_m1 and gemv_m1_fp8: MEGART_DENSE_X_PIECES and
// _FP8, dense_common.cuh): stages x and runs the matvec. False, having done nothing, when the instance's x does
// not qualify (the caller then stages it whole).
template <bool FP8, class P, class Rows, class Epi, class Pre>
__device__ __forceinline__ bool gemv_in_pieces(const P& p, const MatvecPlan<Rows>& plan, Epi epi, Pre pre,
                                               char* smem) {
  constexpr int kPiece = kXPieceChunks<FP8>;
  if ((p.flags & (kFlagTaggedX | kFlagNorm)) != kFlagTaggedX || !x_in_pieces(p.k, kPiece)) return false;
  float* scratch = scratch_of(smem);
  stage_x_pieces<kPiece, FP8 ? 1 : kXBatch>(p.x, p.k, xs_of(smem), scratch);
  matvec_prewaited<FP8, P>(plan, xs_of(smem), scratch, epi, smem, pre, XPieces{x_piece_bars(scratch)});
  x_pieces_done(p.k, kPiece, scratch);
  return true;
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
    const int r = plan.rows.row(g);
    if constexpr (FP8) {
      gate *= __ldg(s_gate + r);
      up *= __ldg(s_up + r);
    }
    const __nv_bfloat16 h = __float2bfloat16_rn(silu(gate) * up);
    if (lane == 0) {
      if (tag_out) st_tagged(p.h, r, h);
      else p.h[r] = h;
    }
  };
  matvec_prewaited<FP8, P>(plan, xs, scratch_of(smem), epi, smem, [&](int g) {
    if constexpr (FP8) {
      prefetch_l1(s_gate + plan.rows.row(g));
      prefetch_l1(s_up + plan.rows.row(g));
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

#endif  // MEGART_TASKS_DENSE_BODIES_CUH
