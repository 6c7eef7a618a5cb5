// The dense matvec engines (after tasks/dense_common.cuh): the warp-per-row-pair dot products through
// registers, the per-instance weight ring (MEGART_DENSE_RING_SLOTS), the weight stream's dense stage format
// (csrc/weight_stream.cuh), and the dispatch a body calls (matvec_prewaited / matvec_streamed). Every engine
// gives the same sums: the same chunks per lane, in the same order.
#ifndef MEGART_TASKS_DENSE_ENGINES_CUH
#define MEGART_TASKS_DENSE_ENGINES_CUH

namespace megart {
namespace dense {

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

// Whole row pairs per warp (g = warp, warp + kWarps, ...) where a matvec has more pairs than half the warps;
// fewer: one K slice per warp, combined across warps (matvec, below). Between half and all the warps the split
// would be 1 (the same segments, the spare warps idle) and its combine through `red` behind two barriers made
// those instances end last in the 1B step (o_proj and down dealt 7 pairs to some instances): whole pairs there.
constexpr int kWholePairsFrom = kWarps / 2 + 1;
// The K-split path costs ~80 KB of code in a kernel of every dense type (it is inlined into each engine);
// codegen compiles it in only where an instance has fewer pairs (MEGART_DENSE_KSPLIT, set from the graph by
// tasks/dense_common.py's matvec_macros). Without it every instance deals whole pairs: the same results up
// to the order of the sums, with some warps idle.
#ifndef MEGART_DENSE_KSPLIT
#define MEGART_DENSE_KSPLIT 1
#endif
__device__ __forceinline__ bool whole_pairs(int groups) {
  return MEGART_DENSE_KSPLIT == 0 || groups >= kWholePairsFrom;
}
// K slice `part` of `split` over kc chunks: [slice_begin(part), slice_begin(part + 1)).
__device__ __forceinline__ int slice_begin(int kc, int part, int split) {
  return (int)((long long)kc * part / split);
}

// Split-K tail of a matvec (groups < kWholePairsFrom): every warp's summed partials go to `red`, then warp
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
// whole pairs g = warp, warp + kWarps, ... when groups >= kWholePairsFrom, else one K slice (see matvec).
struct Segment {
  int g, c0, c1;
};
__device__ __forceinline__ bool warp_segment(int groups, int kc, int warp, int k, Segment& s) {
  if (whole_pairs(groups)) {
    s = Segment{warp + k * kWarps, 0, kc};
    return s.g < groups;
  }
  const int split = kWarps / groups, g = warp / split, part = warp - g * split;
  s = Segment{g, slice_begin(kc, part, split), slice_begin(kc, part + 1, split)};
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
  if (whole_pairs(groups)) {
    while (st.live) {
      const int g = st.s.g;
      float s[2] = {0.f, 0.f};
      consume_segment(s);
#ifdef __CUDA_ARCH__
      if constexpr ((MEGART_DIAG_NO_WAIT & 16) != 0) {  // bit 4 (timing only, wrong results): no warp sums
        epi(g, s[0], s[1]);
        continue;
      }
#endif
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
#ifdef __CUDA_ARCH__
  if constexpr ((MEGART_DIAG_NO_WAIT & 8) != 0) {  // bit 3 (timing only, wrong results): one read, no dots
    acc[0] += __uint_as_float(slot[threadIdx.x & 31].x & 0x007fffffu);
    return;
  }
#endif
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
// groups >= kWholePairsFrom: each warp owns whole groups (g = warp, warp + kWarps, ...). At most half as
// many groups as warps: the idle warps split K instead (kWarps / groups warps per group, partial sums
// combined in `red`, 2 floats per warp, in a fixed order), so a small instance still has every warp streaming.
template <bool FP8, class Rows, class Epi>
__device__ __forceinline__ void matvec(int groups, int kc, const uint4* xs, float* red, Rows rows, Epi epi) {
  const int warp = threadIdx.x >> 5;
  if (whole_pairs(groups)) {
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
    dot2<FP8>(w, xs, slice_begin(kc, part, split), slice_begin(kc, part + 1, split), s);
    s[0] = warp_sum(s[0]);
    s[1] = warp_sum(s[1]);
  }
  combine_split(s, groups, red, epi);
}

// Where group g's rows lie: g itself, or with rows dealt in rounds (tasks/tiling.py round_rows; compiled in only
// where an instance has them: MEGART_DENSE_ROW_ROUNDS = the round width W, which tasks/dense_common.py checks every
// such instance of the kernel shares; a constant, so the division is a multiply) g < full at (g / W) * stride + first
// + g % W and later ones at tail + g - full.
// The map is 16-bit (tasks/dense_matvec.py refuses rows past 65,535) so the stream's cursor keeps its size.
#ifndef MEGART_DENSE_ROW_ROUNDS
#define MEGART_DENSE_ROW_ROUNDS 0
#endif
#if MEGART_DENSE_ROW_ROUNDS
constexpr unsigned kRoundWidth = MEGART_DENSE_ROW_ROUNDS;
struct RowMap {
  unsigned short first, stride, full, tail;  // (all zero: g)
  __device__ __forceinline__ int operator()(int g) const {
    const unsigned u = (unsigned)g;
    return u < full ? (int)((u / kRoundWidth) * stride + first + u % kRoundWidth) : (int)(tail + u - full);
  }
};
template <class P>
__device__ __forceinline__ RowMap row_map(const P& p) {
  return RowMap{(unsigned short)p.row_first, (unsigned short)p.row_stride, (unsigned short)p.row_full,
                (unsigned short)p.row_tail};
}
#else
struct RowMap {
  __device__ __forceinline__ int operator()(int g) const { return g; }
};
template <class P>
__device__ __forceinline__ RowMap row_map(const P&) {
  return RowMap{};
}
#endif

// A plan's rows as the weight stream's producer caches them: group g's two rows start at a + map(g) * step and
// (g < pair_end ? b + map(g) * step : the first row again). (With rows in rounds the step is 32-bit, so the map fits
// the 8 bytes the 64-bit step's struct leaves as padding.)
#if MEGART_DENSE_ROW_ROUNDS
struct StreamRows {
  const char* a;
  const char* b;
  int step;
  int pair_end;
  RowMap map;
  StreamRows() = default;
  __device__ __forceinline__ StreamRows(const char* a_, const char* b_, long long step_, int pair_end_,
                                        RowMap map_ = RowMap{})
      : a(a_), b(b_), step((int)step_), pair_end(pair_end_), map(map_) {}
  __device__ __forceinline__ long long offset(int g) const { return (long long)map(g) * step; }
};
static_assert(sizeof(StreamRows) == 32, "rows in rounds keep the stream's cursor size");
#else
struct StreamRows {
  const char* a;
  const char* b;
  long long step;
  int pair_end;
  __device__ __forceinline__ long long offset(int g) const { return (long long)g * step; }
};
#endif

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
// each weight byte is read once). The "dense" format of the generated stream_format_next().
__device__ __forceinline__ bool dense_stage_next(WarpStream& ws, int warp, int slot) {
  dense::DenseStreamState& s = *reinterpret_cast<dense::DenseStreamState*>(ws.cursor);
  dense::StageCursor& st = s.st;
  if (!st.live) return false;
  const long long off = s.rows.offset(st.s.g);
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

// matvec (below) with the weights coming from the stream: same work split, same sums. xw(c): x's chunks from c on,
// as far as the stage reads, are staged (XPieces below; NoXWait: all of x was staged before).
template <bool FP8, class Epi, class XW>
__device__ __forceinline__ void matvec_stream(int groups, int kc, const uint4* xs, float* red, Epi epi, XW xw) {
  const int warp = threadIdx.x >> 5;
  // A K slice starts anywhere, so its stages can straddle two pieces of x: such a matvec waits for all of x.
  if (!whole_pairs(groups)) xw.all(kc);
  StageCursor st(groups, kc, warp);
  unsigned j = stream_read_begin(warp);  // (the warp's stages read so far: its next stage's number)
  auto consume_segment = [&](float (&acc)[2]) {
    const int k = st.k;
    while (st.live && st.k == k) {
      xw(st.c);
      const uint4* slot = reinterpret_cast<const uint4*>(stream_acquire(warp, j));
      dot2_stage<FP8>(slot, xs, st.c, min(kStageChunks, st.s.c1 - st.c), acc);
      stream_release(warp, j);
      ++j;
      st.next();
    }
  };
  walk_segments(st, groups, red, epi, consume_segment);
  stream_read_end(warp, j);
}
#endif  // MEGART_STREAM_SLOTS > 0

// x staged whole before the matvec: nothing to wait for.
struct NoXWait {
  __device__ __forceinline__ void operator()(int) const {}
  __device__ __forceinline__ void all(int) const {}
};
// x staged in pieces of one stage's chunks (MEGART_DENSE_X_PIECES, tasks/gemv_m1.cuh): piece i is complete once the
// warps that stage its chunks have arrived on bars[i]; the stage at weight chunk c waits for piece c / kStageChunks
// (its x: kXPieceChunks below).
struct XPieces {
  unsigned long long* bars;
  __device__ __forceinline__ void operator()(int c) const { mbar_wait_cta(bars + c / kStageChunks, 0); }
  __device__ __forceinline__ void all(int kc) const {
    for (int c = 0; c < kc; c += kStageChunks) (*this)(c);
  }
};
// x's chunks in one piece: one stage's worth (an e4m3 chunk holds 16 weights, so its stage reads twice the x).
template <bool FP8>
constexpr int kXPieceChunks = FP8 ? 2 * kStageChunks : kStageChunks;

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
  if (whole_pairs(groups)) {  // whole pairs: warp w finishes groups w, w + kWarps, ...
    for (int g = warp + kWarps * lane; g < groups; g += 32 * kWarps) pre(g);
  } else if (lane == 0) {  // one K slice per warp: group warp / split
    const int split = kWarps / groups;
    if (warp % split == 0 && warp / split < groups) pre(warp / split);
  }
}
__device__ __forceinline__ void prefetch_epilogues(int, NoPre) {}

// The engine of a matvec: the launch-wide stream when the type is streamed (P, its params struct, says so),
// else the per-instance ring its prewait filled (kRing: the type has a prewait, and the kernel a ring), else
// registers. x in pieces (xw): the stream waits for each stage's piece, the other engines for all of them.
template <bool FP8, class P, bool kRing, class Rows, class Epi, class XW>
__device__ __forceinline__ void matvec_engines(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                               char* smem, XW xw) {
#if MEGART_STREAM_SLOTS > 0
  if constexpr (StreamOn<P>::value) {
    matvec_stream<FP8>(m.groups, m.kc, xs, red, epi, xw);
    span_mark(1);
    return;
  }
#endif
  xw.all(m.kc);
  if constexpr (kRing && kRingSlots > 0)
    matvec_ring<FP8>(m.groups, m.kc, xs, red, m.rows, epi, smem);
  else
    matvec<FP8>(m.groups, m.kc, xs, red, m.rows, epi);
  span_mark(1);  // (profiled builds: the dots and their epilogues done, on warp 0)
}
// Before the engine: ask for the epilogues' operands (pre).
template <bool FP8, class P, bool kRing, class Rows, class Epi, class Pre, class XW>
__device__ __forceinline__ void matvec_entry(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                             char* smem, Pre pre, XW xw) {
  prefetch_epilogues(m.groups, pre);
  matvec_engines<FP8, P, kRing>(m, xs, red, epi, smem, xw);
}

// The body side of a task with a prewait: weights from the stream, from the ring the prewait filled, or through
// registers when this kernel has neither (MEGART_DENSE_RING_SLOTS == 0: the prewait did nothing).
template <bool FP8, class P, class Rows, class Epi, class Pre = NoPre, class XW = NoXWait>
__device__ __forceinline__ void matvec_prewaited(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                                 char* smem, Pre pre = Pre{}, XW xw = XW{}) {
  matvec_entry<FP8, P, true>(m, xs, red, epi, smem, pre, xw);
}

// The body side of a type without a prewait (qkv_rope_append): weights from the launch-wide stream when
// the type is streamed, else through registers (the per-instance ring needs a prewait to fill it).
template <bool FP8, class P, class Rows, class Epi, class Pre = NoPre>
__device__ __forceinline__ void matvec_streamed(const MatvecPlan<Rows>& m, const uint4* xs, float* red, Epi epi,
                                                Pre pre = Pre{}) {
  matvec_entry<FP8, P, false>(m, xs, red, epi, nullptr, pre, NoXWait{});
}

}  // namespace dense
}  // namespace megart

#endif  // MEGART_TASKS_DENSE_ENGINES_CUH
