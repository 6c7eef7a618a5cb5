// attention_decode: one query token against the KV cache of one kv head, over one chunk of positions
// (flash-decoding partials). Instance (kv head h, chunk c) covers positions [lo, hi) of kv_len = pos + 1
// (read from device memory) for the `group` q heads of h, and writes per q head the running max m (natural
// units of the scaled score), the sum l = sum exp(s - m) and the unnormalised o = sum exp(s - m) v (fp32).
// An empty chunk writes m = -inf, l = 0, o = 0. With out and arrivals (the fused form), the last instance
// of a kv head to finish also merges the head's partials into out (merge_if_last), as attention_merge would.
// With out alone (the direct form: one chunk, no part_o / part_ml) the instance writes o / l to out itself.
//
// chunk > 0: static chunks, [c * chunk, min((c + 1) * chunk, kv_len)).
// chunk == 0: dynamic chunks of ceil(kv_len / nchunks) positions, so every instance has work at any length.
//
// Layout: a K/V row (hd bf16) is read by HD/VEC lanes, VEC bf16 each (VEC = 8: 16-byte loads; the register
// path of groups 5..8 uses VEC = 4, 8-byte loads, to halve its q/o registers); a warp covers 32/(HD/VEC) positions per load and each
// of these "slots" takes U positions per batch. Each slot keeps its own online softmax (base-2 exponent,
// scale * log2(e) folded into q); the slots are merged across lanes with shuffles, then across warps in
// shared memory.
// An instance holds G <= 8 q heads (any G in 1..8, each its own instantiation); larger GQA groups are split
// over several instances by the splitter.
// Streaming: every group with the full register budget copies K/V through a per-thread shared-memory ring
// (cp.async, RS stages of RU positions, RS - 1 stages in flight while one is computed; the first stages
// are issued before q is read). The low-register builds and a ring of 0 bytes (two CTAs per SM, 512+
// threads, or MEGART_ATTN_RING_BYTES=0) load K/V into registers, U positions per batch.
// (shared helpers: tasks/attention_common.cuh; this type's building blocks: tasks/attention_decode_blocks.cuh)

namespace megart_attn {

template <int HD, int G, int VEC, bool kOneHead = false>
__device__ __forceinline__ void store_partials(const megart_params_attention_decode& p, char* smem, float (&m)[G],
                                               float (&l)[G], float (&o)[G][VEC]);

// kOneHead (the switch, below): q head cidx of the instance's group alone (G = 1), its output written directly.
template <int HD, int G, bool kOneHead = false>
__device__ __forceinline__ void attention_decode_body(const megart_params_attention_decode& p, char* smem, int lo,
                                                      int hi) {
  constexpr int NT = MEGART_THREADS, NWARP = NT / 32;
  // Ring geometry (see "Ring" below); it depends only on the thread count and the ring size.
  constexpr int RU = kRingU, RS = kRingStages;
  constexpr bool kRing = !kLowRegs && G <= 8 && RS >= 2;
  if constexpr (kAttnMark0 == 1) megart::span_mark(0);
  // bf16 per lane per row. The ring path keeps 16-byte vectors for every G (5..8 included: its few
  // positions per batch leave the registers for q and o; G = 8 joined it when the register path's 8-byte
  // vectors, a whole warp per hd-128 row, measured 0.22 of the KV floor). The register path of G >= 5
  // uses 8-byte vectors, halving q and o.
  constexpr int VEC = kRing ? 8 : (G > 4 ? 4 : 8);
  constexpr int LPR = HD / VEC;        // lanes per K/V row
  constexpr int RPW = 32 / LPR;        // rows (positions) per warp per load
  constexpr int SLOTS = NWARP * RPW;   // positions per CTA per load
  constexpr int U = kLowRegs ? (G >= 4 ? 2 : 4) : (G > 4 ? 4 : 8);  // register path: positions per slot per batch
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % LPR, rw = lane / LPR, slot = warp * RPW + rw;
  const __nv_bfloat16* kb = p.k_cache + sub * VEC;
  const __nv_bfloat16* vb = p.v_cache + sub * VEC;
  // The tagged form (k_new given): q and the head's new K/V row are tagged words qkv stores this step; the
  // cache's row pos is not written until kv_commit, so position pos takes its vectors from k_new / v_new.
  const bool tnew = kAttnTagged && p.k_new != nullptr;
  int tpos = -1;  // position pos, when this chunk holds it in the tagged form
  if (tnew) {
    const int at = ld_in_i32(p.pos);
    if (at >= lo && at < hi) tpos = at;
  }

  // Ring: every thread copies (cp.async) exactly the K and V vectors it reads back later, so its own
  // wait_group makes them visible and the loop needs no barrier. Vector (ring slot s, position u, K/V kv)
  // of thread tid is at ring + ((s * RU + u) * 2 + kv) * NT * 16 + tid * 16: a warp's LDS.128 reads 512
  // contiguous bytes. Stage j (positions lo + j * BATCH + u * SLOTS + slot) lives in ring slot j % RS.
  // 256 threads, 64 KB: RS = 4 stages of RU = 2 positions, 48 KB in flight per CTA while one is computed.
  constexpr int BATCH = SLOTS * RU;
  constexpr unsigned VSTRIDE = NT * 16;  // bytes between consecutive vectors of one thread
  const unsigned ring = shared_addr(smem) + tid * 16;
  const int nst = (hi - lo + BATCH - 1) / BATCH;  // stages (0: empty chunk)
  auto issue = [&](int j) {
    if (!kDiagNoKv && j < nst) {
      const unsigned d = ring + ((unsigned)j % RS) * (RU * 2 * VSTRIDE);
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        const int t = lo + j * BATCH + u * SLOTS + slot;
        const bool valid = t < hi;
        const long long off = (long long)(valid ? t : lo) * HD;  // past hi: zero-fill, from row lo (< hi)
        cp_async16(d + (2 * u) * VSTRIDE, kb + off, valid ? 16 : 0);
        cp_async16(d + (2 * u + 1) * VSTRIDE, vb + off, valid ? 16 : 0);
      }
    }
    cp_async_commit();  // (empty past the last stage: the group count per iteration stays uniform)
  };
  if constexpr (kRing) {
    static_assert(VEC == 8 && RS * RU * 32 * NT <= kAttnRingBytes, "ring layout");
#pragma unroll
    for (int j = 0; j < RS - 1; ++j) issue(j);  // before q: the q and K/V round trips overlap
  }
  if (tnew) poll_tagged_inputs<HD, G>(p, smem, tpos);
  float q[G][VEC], m[G], l[G], o[G][VEC];
  load_q<HD, G, VEC>(p, tnew, sub, q, m, l, o, kOneHead ? p.cidx * HD : 0);
  if constexpr (kAttnMark0 == 2) {  // q used before the stamp (a branch on it), so thread 0 has waited for q's loads
    float qs = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g) qs += q[g][0];
    if (qs == 12345.f) asm volatile("" ::: "memory");
    megart::span_mark(0);
  }

  if constexpr (kRing) {
    // The tagged form: the stage and vector of position pos, if this thread holds it (its ring copy is of the
    // stale cache row: the staged new row is stored over it once the copy has landed).
    // (one register: the (stage, vector) pair as j * RU + u, since BATCH = RU * SLOTS)
    const int tsel = tpos >= 0 && (tpos - lo) % SLOTS == slot ? (tpos - lo) / SLOTS : -RU;
    for (int j = 0; j < nst; ++j) {
      issue(j + RS - 1);       // into slot (j - 1) % RS, whose data iteration j - 1 has consumed
      cp_async_wait<RS - 1>();  // groups 0..j (this thread's copies of stage j) have landed
      if constexpr (kAttnMark0 == 3) if (j == 0) megart::span_mark(0);
      const unsigned d = ring + ((unsigned)j % RS) * (RU * 2 * VSTRIDE);
      if ((unsigned)(tsel - j * RU) < (unsigned)RU) {
        const int tu = tsel - j * RU;
        st_shared16(d + (2 * tu) * VSTRIDE, new_row(smem, 0)[sub]);
        st_shared16(d + (2 * tu + 1) * VSTRIDE, new_row(smem, 1)[sub]);
      }
      KVec<VEC> kv[RU], vv[RU];
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        const uint4 a = ld_shared16(d + (2 * u) * VSTRIDE), c = ld_shared16(d + (2 * u + 1) * VSTRIDE);
        kv[u].u[0] = a.x, kv[u].u[1] = a.y, kv[u].u[2] = a.z, kv[u].u[3] = a.w;
        vv[u].u[0] = c.x, vv[u].u[1] = c.y, vv[u].u[2] = c.z, vv[u].u[3] = c.w;
      }
      attend_batch<VEC, LPR, G, RU, true>(q, m, l, o, kv, vv, lo + j * BATCH + slot, SLOTS, hi);
      if constexpr (kAttnMark0 == 6) if (j == 0) megart::span_mark(0);
    }
    if constexpr (kAttnMark0 == 4) megart::span_mark(0);
    cp_async_wait<0>();  // (nothing real is left: copies past the last stage are never issued)
    __syncthreads();     // the merge below reuses the ring's shared memory other warps may still read
  } else {
    for (int b = lo; b < hi; b += SLOTS * U) {
      KVec<VEC> kv[U], vv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = b + u * SLOTS + slot;
        if (t == tpos) {
          kv[u] = new_row_kvec<VEC>(smem, 0, sub);
          vv[u] = new_row_kvec<VEC>(smem, 1, sub);
        } else if (!kDiagNoKv && t < hi) {
          kv[u] = ld_kvec<VEC>(kb + (long long)t * HD);
          vv[u] = ld_kvec<VEC>(vb + (long long)t * HD);
        } else {
#pragma unroll
          for (int i = 0; i < VEC / 2; ++i) kv[u].u[i] = vv[u].u[i] = 0u;
        }
      }
      attend_batch<VEC, LPR, G, U, false>(q, m, l, o, kv, vv, b + slot, SLOTS, hi);
    }
  }

  store_partials<HD, G, VEC, kOneHead>(p, smem, m, l, o);
}

// The instance's result from every lane's softmax state: the RPW slots of each warp merged across lanes, the
// warps merged through shared memory, then m (natural units), l and o stored per q head.
template <int HD, int G, int VEC, bool kOneHead>
__device__ __forceinline__ void store_partials(const megart_params_attention_decode& p, char* smem, float (&m)[G],
                                               float (&l)[G], float (&o)[G][VEC]) {
  constexpr int NT = MEGART_THREADS, NWARP = NT / 32, LPR = HD / VEC;
  constexpr float NEG = -3.402823466e38f;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, sub = lane % LPR, rw = lane / LPR;
  // merge the RPW slots of this warp (lanes sub, sub + LPR, ...) into lanes 0..LPR-1
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo_ = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float a = exp2f(m[g] - mn), bb = exp2f(mo - mn);
      l[g] = a * l[g] + bb * lo_;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float oo = __shfl_xor_sync(0xffffffffu, o[g][e], off);
        o[g][e] = a * o[g][e] + bb * oo;
      }
      m[g] = mn;
    }
  }

  if constexpr (kAttnMark0 == 0) megart::span_mark(0);  // (profiled builds: K/V read and attended)

  // merge across warps: rounds of kAttnStageWarps warps through shared memory [w][g][HD + 2]
  constexpr int STRIDE = HD + 2;
  constexpr int OUTS = (G * HD + NT - 1) / NT;  // outputs (g, d) per thread
  float* st = reinterpret_cast<float*>(smem);
  float rm[OUTS], rl[OUTS], ro[OUTS];
#pragma unroll
  for (int k = 0; k < OUTS; ++k) {
    rm[k] = NEG;
    rl[k] = 0.f;
    ro[k] = 0.f;
  }
  for (int wb = 0; wb < NWARP; wb += kAttnStageWarps) {
    if (warp >= wb && warp < wb + kAttnStageWarps && rw == 0) {
      float* w_st = st + (warp - wb) * G * STRIDE;
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) w_st[g * STRIDE + sub * VEC + e] = o[g][e];
        if (sub == 0) {
          w_st[g * STRIDE + HD] = m[g];
          w_st[g * STRIDE + HD + 1] = l[g];
        }
      }
    }
    __syncthreads();
    const int nw_round = NWARP - wb < kAttnStageWarps ? NWARP - wb : kAttnStageWarps;
#pragma unroll
    for (int k = 0; k < OUTS; ++k) {
      const int idx = tid + k * NT;
      if (idx < G * HD) {
        const int g = idx / HD, dd = idx % HD;
        for (int w = 0; w < nw_round; ++w) {
          const float* e = st + w * G * STRIDE + g * STRIDE;
          const float mo = e[HD], lo_ = e[HD + 1], oo = e[dd];
          const float mn = fmaxf(rm[k], mo);
          const float a = exp2f(rm[k] - mn), bb = exp2f(mo - mn);
          rl[k] = a * rl[k] + bb * lo_;
          ro[k] = a * ro[k] + bb * oo;
          rm[k] = mn;
        }
      }
    }
    __syncthreads();
  }
  if (kOneHead || (kAttnDirect && p.part_o == nullptr)) {  // the direct form: one chunk holds every position, so o / l is the output itself
    // (the switch: q head cidx's outputs, from this instance's claim at cidx * group * HD / nchunks: out_claim)
    const int at = kOneHead ? p.cidx * HD - p.cidx * p.group * HD / p.nchunks : 0;
#pragma unroll
    for (int k = 0; k < OUTS; ++k) {
      const int idx = tid + k * NT;
      if (idx < G * HD) {
        const __nv_bfloat16 v = __float2bfloat16_rn(rl[k] > 0.f ? ro[k] / rl[k] : 0.f);
        if (p.tagged_out) megart::st_tagged(reinterpret_cast<unsigned*>(p.out) + at, idx, v);
        else p.out[at + idx] = v;
      }
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < OUTS; ++k) {
    const int idx = tid + k * NT;
    if (idx < G * HD) {
      const int g = idx / HD, dd = idx % HD;
      const bool empty = !(rl[k] > 0.f);
      p.part_o[idx] = empty ? 0.f : ro[k];
      if (dd == 0) {
        p.part_ml[2 * g] = empty ? megart_attn::neg_inf() : rm[k] * kLn2;
        p.part_ml[2 * g + 1] = empty ? 0.f : rl[k];
      }
    }
  }
}


// Width dispatch for one head size: body(Width<G>{}) for the instance's group G. MEGART_ATTN_HD_ONLY (a head size)
// and MEGART_ATTN_GROUP_MASK (bit g set: width g is run) let a model that knows its shape keep only the bodies it
// runs, which shortens the NVRTC compile; by default both head sizes and all widths 1..8 are instantiated. Every
// width is its own instantiation, so q, o and the softmax state are sized exactly: group 3 or 7 pays for 3 or 7.
#ifndef MEGART_ATTN_GROUP_MASK
#define MEGART_ATTN_GROUP_MASK 0x1fe
#endif
template <int G>
struct Width {
  static constexpr int value = G;
};
// Whether the kernel compiles the bodies of head size HD.
template <int HD>
#ifdef MEGART_ATTN_HD_ONLY
constexpr bool kHdOn = HD == MEGART_ATTN_HD_ONLY;
#else
constexpr bool kHdOn = true;
#endif
template <int HD, class Body>
__device__ __forceinline__ void for_width(int group, Body body) {
  if constexpr (kHdOn<HD>) switch (group) {
#define MEGART_ATTN_WIDTH_CASE(G)                               \
  case G:                                                       \
    if constexpr ((MEGART_ATTN_GROUP_MASK >> G) & 1) body(Width<G>{}); \
    break;
    MEGART_ATTN_WIDTH_CASE(1) MEGART_ATTN_WIDTH_CASE(2) MEGART_ATTN_WIDTH_CASE(3) MEGART_ATTN_WIDTH_CASE(4)
    MEGART_ATTN_WIDTH_CASE(5) MEGART_ATTN_WIDTH_CASE(6) MEGART_ATTN_WIDTH_CASE(7) MEGART_ATTN_WIDTH_CASE(8)
#undef MEGART_ATTN_WIDTH_CASE
    default: break;  // the splitter gives no instance more than 8 q heads
  }
}
// The two bodies as for_width's callees (functors: NVRTC takes a generic lambda's call operator for a host one).
template <int HD>
struct DecodeBody {
  const megart_params_attention_decode& p;
  char* smem;
  int lo, hi;
  template <int G>
  __device__ __forceinline__ void operator()(Width<G>) const {
    attention_decode_body<HD, G>(p, smem, lo, hi);
  }
};

// The switch (an instance with direct_upto > 0: the fused form; megart_task_attention_decode below).
#ifndef MEGART_ATTN_SWITCH
#define MEGART_ATTN_SWITCH 0
#endif
constexpr bool kAttnSwitch = MEGART_ATTN_SWITCH != 0;

#if MEGART_STREAM_SLOTS > 0 && defined(MEGART_STREAM_KV) && MEGART_STREAM_KV != 0
// ---- K/V through the weight stream (csrc/weight_stream.cuh's "kv" stage format) ------------------------
// The cache rows below pos are read-only within a step, so the producer loads them ahead, like weights,
// while the calls before attention run. Every lane slot (warp w, row rw) attends the positions the ring path
// gives it, in the same batches, so both give the same bits: positions lo + s + k * SLOTS (s = w * RPW + rw,
// SLOTS = warps x RPW), k in batches of RU, RU being the ring's at its default size (MEGART_ATTN_ORDER_U). A
// stage of warp w holds UB consecutive k: for each, the warp's RPW consecutive rows (K in the slot's first
// half, V in its second). The chunk [lo, hi) depends on this step's pos, which the producer (waiting on
// no event) reads once pos_advance's stamp carries this step's tag. Row pos itself is written by this step's
// qkv (or staged from k_new in the tagged form), so the body reads that row after its wait instead.
constexpr bool kStreamKv = megart::StreamOn<megart_params_attention_decode>::value;
#ifndef MEGART_ATTN_ORDER_U
#error "the streamed K/V path needs MEGART_ATTN_ORDER_U from tasks/attention_ring.py"
#endif
constexpr int kKvRu = MEGART_ATTN_ORDER_U;
template <int HD>
constexpr int kKvRpw = 32 / (HD / 8);  // rows per warp per load (16-byte vectors)
template <int HD>
constexpr int kKvUb = megart::kStreamSlotBytes / 2 / (2 * HD) / kKvRpw<HD>;  // k steps per stage

struct KvStreamState {
  const char* k;  // the chunk's first K row
  const char* v;  // and V row
  int n;          // positions in the chunk
  int first;      // the warp's next stage's first row (from lo)
  int rpw;        // rows per warp per k step
  int slots;      // rows per k step (all warps)
  int ub;         // k steps per stage
  int row_bytes;  // HD * 2
};
static_assert(sizeof(KvStreamState) <= sizeof(megart::WarpStream::cursor), "KvStreamState does not fit WarpStream::cursor");

// Producer lane, once per (warp, entry): kOpenLater until pos_advance has stamped this step's pos.
__device__ __forceinline__ int kv_stream_open(const megart_params_attention_decode& p, megart::WarpStream& ws, int warp) {
  if (p.pos_stamp == nullptr || (p.hd != 64 && p.hd != 128)) return megart::kOpenNone;  // (the body reads its rows)
  // (the bodies this kernel compiles, as for_width: an instance with none reads no stage)
#ifdef MEGART_ATTN_HD_ONLY
  if (p.hd != MEGART_ATTN_HD_ONLY) return megart::kOpenNone;
#endif
  if (p.group < 1 || p.group > 8 || !((MEGART_ATTN_GROUP_MASK >> p.group) & 1)) return megart::kOpenNone;
  int pos = ws.pos;  // (read once per launch and pos tensor: it is this step's for every entry)
  if (ws.pos_at != p.pos) {
    const unsigned stamp = megart::ld_relaxed_u32(reinterpret_cast<const unsigned*>(p.pos_stamp));
#ifdef __CUDA_ARCH__
    if (((stamp ^ megart::step_tag_bits(megart::s_stream.gen)) >> 16) != 0) return megart::kOpenLater;
    __threadfence();  // the stamp before pos (pos_advance stored pos, a fence, then the stamp)
#else
    if (((stamp ^ megart::s_poll.tag) >> 16) != 0) return megart::kOpenLater;
#endif
    pos = *reinterpret_cast<volatile const int*>(p.pos);
    ws.pos = pos;
    ws.pos_at = p.pos;
  }
  int lo, hi;
  chunk_range(p, pos, lo, hi);
  KvStreamState& s = *reinterpret_cast<KvStreamState*>(ws.cursor);
  s.row_bytes = 2 * p.hd;
  s.rpw = p.hd == 64 ? kKvRpw<64> : kKvRpw<128>;
  s.ub = p.hd == 64 ? kKvUb<64> : kKvUb<128>;
  s.slots = megart::kStreamWarps * s.rpw;
  s.n = hi - lo;
  s.first = warp * s.rpw;
  s.k = reinterpret_cast<const char*>(p.k_cache) + (long long)lo * s.row_bytes;
  s.v = reinterpret_cast<const char*>(p.v_cache) + (long long)lo * s.row_bytes;
  return s.first < s.n ? megart::kOpenStages : megart::kOpenNone;
}

// Producer lane: the warp's next stage into `slot`: UB k steps of its RPW rows (fewer past the chunk's end).
__device__ __forceinline__ bool kv_stage_next(megart::WarpStream& ws, int warp, int slot) {
  KvStreamState& s = *reinterpret_cast<KvStreamState*>(ws.cursor);
  if (s.first >= s.n) return false;
  unsigned rows = 0;
  for (int kk = 0; kk < s.ub; ++kk) rows += (unsigned)max(0, min(s.rpw, s.n - (s.first + kk * s.slots)));
  char* dst = megart::stream_slot(warp, slot);
  unsigned long long* b = megart::stream_full(warp, slot);
  megart::mbar_expect(b, 2u * rows * (unsigned)s.row_bytes);
  for (int kk = 0; kk < s.ub; ++kk) {
    const int r0 = s.first + kk * s.slots, cnt = min(s.rpw, s.n - r0);
    if (cnt <= 0) break;
    const long long off = (long long)r0 * s.row_bytes;
    const int at = kk * s.rpw * s.row_bytes;
    megart::bulk_load(dst + at, s.k + off, (unsigned)(cnt * s.row_bytes), b);
    megart::bulk_load(dst + megart::kStreamSlotBytes / 2 + at, s.v + off, (unsigned)(cnt * s.row_bytes), b);
  }
  s.first += s.ub * s.slots;
  return true;
}

// The body of a streamed instance: the ring path's softmax (16-byte vectors, MUFU exponent, batches of RU
// positions per lane slot) over the warp's stages as they land.
template <int HD, int G>
__device__ __forceinline__ void attention_stream_body(const megart_params_attention_decode& p, char* smem, int lo,
                                                      int hi, int pos) {
  constexpr int NWARP = MEGART_THREADS / 32, VEC = 8, LPR = HD / VEC, RPW = kKvRpw<HD>, SLOTS = NWARP * RPW;
  constexpr int UB = kKvUb<HD>, RU = kKvRu;
  static_assert(UB >= RU && UB % RU == 0, "a K/V stage holds whole batches of the ring's order (MEGART_STREAM_STAGE)");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane % LPR, rw = lane / LPR;
  const int slot_pos = warp * RPW + rw;
  const bool tnew = kAttnTagged && p.k_new != nullptr;
  const int fresh = pos >= lo && pos < hi ? pos : -1;  // row pos, written this step (hi <= kv_len: pos < max_seq)
  if (tnew) poll_tagged_inputs<HD, G>(p, smem, fresh);
  float q[G][VEC], m[G], l[G], o[G][VEC];
  load_q<HD, G, VEC>(p, tnew, sub, q, m, l, o);
  if (!tnew && fresh >= 0) {  // qkv's store of row pos (this instance's wait made it visible), staged as the
    const long long row = (long long)fresh * HD;  // tagged form stages k_new / v_new: its loads overlap q's
    stage_new_row<HD>(smem, [&](int i) { return ld_in16(p.k_cache + row + i); },  // (uniform over the CTA)
                            [&](int i) { return ld_in16(p.v_cache + row + i); });
    __syncthreads();
  }
  unsigned j = megart::stream_read_begin(warp);
  for (int k0 = 0; lo + k0 * SLOTS + warp * RPW < hi; k0 += UB) {  // (the producer's stages, kv_stage_next)
    const char* stage = megart::stream_acquire(warp, j);
#pragma unroll 1
    for (int i = 0; i < UB / RU; ++i) {
      KVec<VEC> kv[RU], vv[RU];
#pragma unroll
      for (int u = 0; u < RU; ++u) {
        const int kk = i * RU + u, t = lo + (k0 + kk) * SLOTS + slot_pos;
        if (t == fresh) {  // (staged above: the streamed copy of row pos may predate qkv's store)
          kv[u] = new_row_kvec<VEC>(smem, 0, sub);
          vv[u] = new_row_kvec<VEC>(smem, 1, sub);
        } else if (t < hi) {
          const uint4* r = reinterpret_cast<const uint4*>(stage + ((kk * RPW + rw) * HD + sub * VEC) * 2);
          const uint4 a = r[0], c = r[megart::kStreamSlotBytes / 2 / 16];
          kv[u].u[0] = a.x, kv[u].u[1] = a.y, kv[u].u[2] = a.z, kv[u].u[3] = a.w;
          vv[u].u[0] = c.x, vv[u].u[1] = c.y, vv[u].u[2] = c.z, vv[u].u[3] = c.w;
        } else {
#pragma unroll
          for (int e = 0; e < VEC / 2; ++e) kv[u].u[e] = vv[u].u[e] = 0u;
        }
      }
      if (i == UB / RU - 1) megart::stream_release(warp, j);  // (the stage's last rows are in registers)
      attend_batch<VEC, LPR, G, RU, true>(q, m, l, o, kv, vv, lo + (k0 + i * RU) * SLOTS + slot_pos, SLOTS, hi);
    }
    ++j;
  }
  megart::stream_read_end(warp, j);
  store_partials<HD, G, VEC>(p, smem, m, l, o);
}

template <int HD>
struct StreamBody {
  const megart_params_attention_decode& p;
  char* smem;
  int lo, hi, pos;
  template <int G>
  __device__ __forceinline__ void operator()(Width<G>) const {
    attention_stream_body<HD, G>(p, smem, lo, hi, pos);
  }
};
#endif  // MEGART_STREAM_SLOTS > 0
}  // namespace megart_attn

__device__ __forceinline__ void megart_task_attention_decode(const megart_params_attention_decode& p, char* smem) {
  namespace at = megart_attn;
  if constexpr (at::kAttnMark0 == 5) megart::span_mark(0);
  const int pos = at::ld_in_i32(p.pos);
  // The switch: while kv_len <= direct_upto the call runs as the direct form. Chunk c < group of each kv head
  // attends every position for q head c alone (width 1, kOneHead) and writes that head's output itself, o / l: no
  // partials, no arrival, no merge; the other chunks have nothing to do. One hop instead of chunks and a merge is
  // shorter where the context is short (tasks/attention.py). The splitter gives such instances no pos_stamp, so
  // the weight stream never carries their K/V.
  if constexpr (at::kAttnSwitch) {
    const int kv_len = at::kv_length(p, pos);
    if (p.direct_upto > 0 && kv_len <= p.direct_upto) {
      if (p.cidx < p.group) {
        if (p.hd == 64) {
          if constexpr (at::kHdOn<64>) at::attention_decode_body<64, 1, true>(p, smem, 0, kv_len);
        } else if (p.hd == 128) {
          if constexpr (at::kHdOn<128>) at::attention_decode_body<128, 1, true>(p, smem, 0, kv_len);
        }
      }
      return;
    }
  }
  int lo, hi;
  at::chunk_range(p, pos, lo, hi);
  // p.group <= 8: the splitter gives a larger GQA group several instances per kv head (for_width).
#if MEGART_STREAM_SLOTS > 0 && defined(MEGART_STREAM_KV) && MEGART_STREAM_KV != 0
  // The instances the stream carries (at::kv_stream_open): all of them unless the graph has one without
  // pos_stamp (MEGART_ATTN_UNSTAMPED), so the other path's code is compiled in only then.
  if (at::kStreamKv && (!at::kAttnUnstamped || p.pos_stamp != nullptr)) {
    if (p.hd == 64) {
      at::for_width<64>(p.group, at::StreamBody<64>{p, smem, lo, hi, pos});
    } else if (p.hd == 128) {
      at::for_width<128>(p.group, at::StreamBody<128>{p, smem, lo, hi, pos});
    }
    if (at::kAttnFusedMerge && p.arrivals != nullptr) at::merge_if_last(p, smem, pos);
    return;
  }
#endif
  if (p.hd == 64) {
    at::for_width<64>(p.group, at::DecodeBody<64>{p, smem, lo, hi});
  } else if (p.hd == 128) {
    at::for_width<128>(p.group, at::DecodeBody<128>{p, smem, lo, hi});
  }  // the splitter refuses other head sizes
  if (at::kAttnFusedMerge && p.arrivals != nullptr) at::merge_if_last(p, smem, pos);
}
