// The building blocks of attention_decode's bodies (tasks/attention_decode.cuh), a header of that type alone
// (TaskType.headers, emitted once per kernel before the bodies): the chunk's positions, cp.async and shared-memory
// access with their host-simulation forms, K/V vector loads, the tagged form's staged new row, one batch of the
// online softmax (attend_batch), the fused merge (merge_if_last), the tagged inputs' poll and q's load. Those
// that read the instance's params are templates on them (P: megart_params_attention_decode, which is
// generated after the headers).
#ifndef MEGART_TASKS_ATTENTION_DECODE_BLOCKS_CUH
#define MEGART_TASKS_ATTENTION_DECODE_BLOCKS_CUH

namespace megart_attn {
// kAttnStageWarps: warps merged per shared-memory round (generated from tasks/attention_common.py)
// K/V ring per CTA, set by tasks/attention_ring.py (attn_ring_bytes; 0: the register path for every group).
#ifndef MEGART_ATTN_RING_BYTES
#define MEGART_ATTN_RING_BYTES 0
#endif
constexpr int kAttnRingBytes = MEGART_ATTN_RING_BYTES;
// The ring's geometry (attention_decode_body), computed in tasks/attention_ring.py (ring_geometry): positions per
// stage per thread (RU; a batch of the online softmax) and stages (RS); fewer than 2 stages: no ring.
#if !defined(MEGART_ATTN_RING_U) || !defined(MEGART_ATTN_RING_STAGES)
#error "attention_decode needs its ring geometry from tasks/attention_ring.py (the type's defines_for)"
#endif
constexpr int kRingU = MEGART_ATTN_RING_U, kRingStages = MEGART_ATTN_RING_STAGES;
// MEGART_ATTN_MARK0 (a timing diagnostic of phase-marked builds, megart/options.py): where attention_decode
// stamps its mark 0. 0, the default: the lanes' softmax states merged (K/V read and attended); 1: the body's
// start (pos read, the chunk's range known); 2: q loaded and used; 3: the ring's first stage landed; 4: the
// ring's last stage attended; 5: the task's entry, before pos is read; 6: the ring's first stage attended.
// The same instances timed to each point, one build each, take the chunk's body apart.
#ifndef MEGART_ATTN_MARK0
#define MEGART_ATTN_MARK0 0
#endif
constexpr int kAttnMark0 = megart::kPhaseStamps ? MEGART_ATTN_MARK0 : 0;  // (no stamps: the macro changes nothing)
// MEGART_DIAG_NO_WAIT bit 2 (a timing diagnostic, device builds only; csrc/runtime.cuh): attention reads no
// K/V from the cache (the ring copies nothing, the register path takes zeros). The step computes garbage; its
// time against the default says what attention's K/V reads cost the step.
#ifdef __CUDA_ARCH__
constexpr bool kDiagNoKv = (MEGART_DIAG_NO_WAIT & 4) != 0;
#else
constexpr bool kDiagNoKv = false;
#endif

// MEGART_MERGE_ACTIVE=1 (the Llama model's choice where decoding starts below min_chunk x nchunks positions):
// the fused merge reads only the partials of the chunks that hold positions. Compiled in only there: at a 2k
// context, where it changes nothing, the 1B step measured ~6 us slower with it (bench/RESULTS.md).
#ifndef MEGART_MERGE_ACTIVE
#define MEGART_MERGE_ACTIVE 0
#endif
// Positions per dynamic chunk at kv_len: ceil(kv_len / nchunks), at least min_chunk (geometry/attention.py's
// chunk_length): at a short context fewer chunks hold positions and the merge reads only theirs.
template <class P>
__device__ __forceinline__ int kv_length(const P& p, int pos) {  // pos + 1, within [0, max_seq]
  return pos < 0 ? 0 : (pos >= p.max_seq ? p.max_seq : pos + 1);
}
template <class P>
__device__ __forceinline__ int chunk_length(const P& p, int kv_len) {
  const int cl = (kv_len + p.nchunks - 1) / p.nchunks;
  return cl > p.min_chunk ? cl : p.min_chunk;
}

// Positions [lo, hi) of the instance's chunk at this step's pos (kv_len = pos + 1, capped at max_seq): the
// body's, and the weight stream producer's when it loads the chunk's rows ahead (kv_stream_open).
template <class P>
__device__ __forceinline__ void chunk_range(const P& p, int pos, int& lo, int& hi) {
  const int kv_len = kv_length(p, pos);
  if (p.chunk > 0) {
    lo = p.cidx * p.chunk;
    hi = lo + p.chunk;
  } else {
    const int cl = chunk_length(p, kv_len);
    lo = p.cidx * cl;
    hi = lo + cl;
  }
  if (hi > kv_len) hi = kv_len;
  if (hi < lo) hi = lo;
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned shared_addr(char* smem) { return (unsigned)__cvta_generic_to_shared(smem); }
// 16 bytes global -> shared, asynchronously; n = 0 reads nothing and writes 16 zero bytes.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int n) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint4 ld_shared16(unsigned a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared16(unsigned a, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

#else
// Host simulation: a shared address is an offset into the simulated CTA's shared memory (one CTA runs at a
// time, so one base serves every fiber); a copy lands at once, so the waits have nothing to wait for.
inline char* host_smem = nullptr;
inline unsigned shared_addr(char* smem) {
  host_smem = smem;
  return 0;
}
inline void cp_async16(unsigned dst, const void* src, int n) {
  std::memset(host_smem + dst, 0, 16);
  std::memcpy(host_smem + dst, src, n);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
inline uint4 ld_shared16(unsigned a) {
  uint4 v;
  std::memcpy(&v, host_smem + a, 16);
  return v;
}
inline void st_shared16(unsigned a, uint4 v) { std::memcpy(host_smem + a, &v, 16); }
#endif

// VEC bf16 per lane (8: one 16-byte load; 4: one 8-byte load, which halves the q and o registers).
template <int VEC>
struct KVec {
  unsigned u[VEC / 2];
};
template <int VEC>
__device__ __forceinline__ KVec<VEC> ld_kvec(const __nv_bfloat16* p) {
  KVec<VEC> r;
  if constexpr (VEC == 8) {
    const uint4 v = ld_in16(p);
    r.u[0] = v.x;
    r.u[1] = v.y;
    r.u[2] = v.z;
    r.u[3] = v.w;
  } else {
#ifdef __CUDA_ARCH__
    asm volatile("ld.global.cg.L2::128B.v2.u32 {%0, %1}, [%2];" : "=r"(r.u[0]), "=r"(r.u[1]) : "l"(p) : "memory");
#else
    std::memcpy(r.u, p, 8);
#endif
  }
  return r;
}
// The tagged form (k_new given) is compiled in only where an instance uses it: MEGART_ATTN_TAGGED, which the
// kernel gets from its graph (TaskType.macros_for). Its polls and the new row cost the widest bodies the one
// register they had left.
#ifndef MEGART_ATTN_TAGGED
#define MEGART_ATTN_TAGGED 0
#endif
constexpr bool kAttnTagged = MEGART_ATTN_TAGGED != 0;
// MEGART_ATTN_UNSTAMPED (from the graph too): an instance without pos_stamp, whose K/V the weight stream does
// not carry, so it reads them itself; otherwise a kernel that streams K/V has no such path.
#ifndef MEGART_ATTN_UNSTAMPED
#define MEGART_ATTN_UNSTAMPED 0
#endif
constexpr bool kAttnUnstamped = MEGART_ATTN_UNSTAMPED != 0;
// MEGART_ATTN_DIRECT (from the graph): an instance of the direct form (out without partials), compiled in only there.
#ifndef MEGART_ATTN_DIRECT
#define MEGART_ATTN_DIRECT 0
#endif
constexpr bool kAttnDirect = MEGART_ATTN_DIRECT != 0;
// MEGART_ATTN_FUSED_MERGE (from the graph; 1 when unset): merge_if_last, compiled out where no instance merges.
#ifndef MEGART_ATTN_FUSED_MERGE
#define MEGART_ATTN_FUSED_MERGE 1
#endif
constexpr bool kAttnFusedMerge = MEGART_ATTN_FUSED_MERGE != 0;

// The new K (kv = 0) and V (kv = 1) row of the instance's kv head, bf16 (hd <= 128: 16 vectors of 8), staged
// in the instance's shared memory at MEGART_ATTN_NEW_ROW_OFFSET: past the K/V ring and the merge scratch of
// the compiled shapes, so it is neither overwritten while the ring is read nor live when the merge writes
// (tasks/attention.py new_row_offset; a static array here cost the weight stream its sixth slot per warp).
// new_row_kvec reads lane sub's VEC values.
#ifndef MEGART_ATTN_NEW_ROW_OFFSET
#error "attention_decode needs MEGART_ATTN_NEW_ROW_OFFSET from tasks/attention.py (the type's defines_for)"
#endif
constexpr int kNewRowOffset = MEGART_ATTN_NEW_ROW_OFFSET;
static_assert(kNewRowOffset % 16 == 0, "the staged new row is read as 16-byte vectors");
__device__ __forceinline__ uint4* new_row(char* smem, int kv) {
  return reinterpret_cast<uint4*>(smem + kNewRowOffset) + kv * 16;
}
template <int VEC>
__device__ __forceinline__ KVec<VEC> new_row_kvec(char* smem, int kv, int sub) {
  const unsigned* w = reinterpret_cast<const unsigned*>(new_row(smem, kv)) + sub * (VEC / 2);
  KVec<VEC> r;
#pragma unroll
  for (int k = 0; k < VEC / 2; ++k) r.u[k] = w[k];
  return r;
}
template <int VEC>
__device__ __forceinline__ void unpack_kvec(const KVec<VEC>& v, float* f) {
#pragma unroll
  for (int i = 0; i < VEC / 2; ++i) {
    f[2 * i] = __uint_as_float(v.u[i] << 16);
    f[2 * i + 1] = __uint_as_float(v.u[i] & 0xffff0000u);
  }
}

// VEC values of a tagged vector (4 or 8 words at w, already polled) unpacked to f.
template <int VEC>
__device__ __forceinline__ void ld_tagged_values(const unsigned* w, float* f) {
  KVec<VEC> v;
  const uint4 a = megart::ld_relaxed_v4(w);
  v.u[0] = megart::untag2(a.x, a.y);
  v.u[1] = megart::untag2(a.z, a.w);
  if constexpr (VEC == 8) {
    const uint4 b = megart::ld_relaxed_v4(w + 4);
    v.u[2] = megart::untag2(b.x, b.y);
    v.u[3] = megart::untag2(b.z, b.w);
  }
  unpack_kvec<VEC>(v, f);
}

// 2^x. kFtz: one MUFU.EX2 without exp2f's subnormal fix-ups; a result under 2^-126 flushes to 0 (such a
// weight vanishes anyway against the slot's largest, 1, and every x here is <= 0).
template <bool kFtz>
__device__ __forceinline__ float exp2_(float x) {
  if constexpr (kFtz) {
#ifdef __CUDA_ARCH__
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    const float y = exp2f(x);  // (host: exact, where MUFU.EX2 is within 2 ulp; subnormals flush as there)
    return y < 1.17549435e-38f ? 0.f : y;
#endif
  } else {
    return exp2f(x);
  }
}

// One batch of U positions t0 + u * step of a slot (positions >= hi are masked: score -inf, weight 0)
// into the slot's online softmax (m, l, o).
template <int VEC, int LPR, int G, int U, bool kFtz>
__device__ __forceinline__ void attend_batch(const float (&q)[G][VEC], float (&m)[G], float (&l)[G],
                                             float (&o)[G][VEC], const KVec<VEC> (&kv)[U],
                                             const KVec<VEC> (&vv)[U], int t0, int step, int hi) {
  float s[U][G];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float kf[VEC];
    unpack_kvec<VEC>(kv[u], kf);
    const bool valid = t0 + u * step < hi;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float a = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) a = fmaf(q[g][e], kf[e], a);
#pragma unroll
      for (int off = LPR / 2; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
      s[u][g] = valid ? a : megart_attn::neg_inf();
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float mb = m[g];
#pragma unroll
    for (int u = 0; u < U; ++u) mb = fmaxf(mb, s[u][g]);
    const float alpha = exp2_<kFtz>(m[g] - mb);
    m[g] = mb;
    l[g] *= alpha;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[g][e] *= alpha;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float vf[VEC];
    unpack_kvec<VEC>(vv[u], vf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float pu = exp2_<kFtz>(s[u][g] - m[g]);  // 0 for masked positions (s = -inf, m finite)
      l[g] += pu;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[g][e] = fmaf(pu, vf[e], o[g][e]);
    }
  }
}

// The fused form (out and arrivals given; the splitter keeps every q head of a kv head in one instance):
// the last of the kv head's nchunks instances to arrive merges all their partials into out, with the
// arithmetic of attention_merge, so o_proj waits on this call alone. The instance's pointers sit at its own
// chunk: chunk 0's partials lie cidx * G slots back, and its claim on out starts cidx * G * HD / nchunks
// elements into the head's G * HD outputs (tasks/attention.py, out_claim; each instance claims a disjoint
// piece, so a reader of out waits for all of them).
// One copy for every head size and width, run after the body (a copy inside each instantiation spilled the
// kernel that holds every built-in type; a called function did too).
template <class P>
__device__ __forceinline__ void merge_if_last(const P& p, char* smem, int pos) {
  int* s_last = reinterpret_cast<int*>(smem);  // (the partials' staging rounds are over)
  __syncthreads();                             // every thread's partial stores are issued
  if (threadIdx.x == 0) *s_last = arrive_last(p.arrivals, p.nchunks);
  __syncthreads();
  megart::span_mark(1);  // (profiled builds: partials stored, arrival counted)
  if (!*s_last) return;
  const int G = p.group, HD = p.hd, n = G * HD;  // (32-bit offsets: n * nchunks < 2^31)
  // MEGART_MERGE_ACTIVE: only the chunks that hold positions (where kv_len <= min_chunk x nchunks); an empty
  // one's partials (m = -inf, l = o = 0) add exactly nothing, so the bits are the same.
  int C = p.nchunks;
  if (MEGART_MERGE_ACTIVE && p.chunk == 0) {
    const int kv_len = kv_length(p, pos);
    if (p.min_chunk > 0 && kv_len <= p.min_chunk * C) {
      const int active = (kv_len + p.min_chunk - 1) / p.min_chunk;
      if (active < C) C = active > 0 ? active : 1;
    }
  }
#if defined(MEGART_MERGE_C) && MEGART_MERGE_C > 0
  // The model's one attention shape (MEGART_MERGE_G / _HD / _C): strides as immediates, and with
  // MEGART_MERGE_ACTIVE off no chunk guard (C is nchunks).
  constexpr int FG = MEGART_MERGE_G, FHD = MEGART_MERGE_HD, FC = MEGART_MERGE_C, FN = FG * FHD;
  if (FC <= kMergeBatch && p.group == FG && p.hd == FHD && p.nchunks == FC) {
    const float* fml = p.part_ml - p.cidx * FG * 2;
    const float* fpo = p.part_o - p.cidx * FN;
    const int fback = p.cidx * FN / FC;
    const int fc = MEGART_MERGE_ACTIVE ? C : FC;
#pragma unroll
    for (int t0 = 0; t0 < FN; t0 += MEGART_THREADS) {
      const int t = t0 + threadIdx.x;
      if (FN % MEGART_THREADS == 0 || t < FN) {
        const __nv_bfloat16 v = __float2bfloat16_rn(merge_point_fixed<FC, FG, FHD>(fml + (t / FHD) * 2, fpo + t, fc));
        if (p.tagged_out) megart::st_tagged(reinterpret_cast<unsigned*>(p.out) - fback, t, v);
        else (p.out - fback)[t] = v;
      }
    }
    return;
  }
#endif
  const float* ml = p.part_ml - p.cidx * G * 2;
  const float* po = p.part_o - p.cidx * n;
  const int back = p.cidx * n / p.nchunks;  // (elements: 2-byte values, or 4-byte tagged words)
  for (int t = threadIdx.x; t < n; t += MEGART_THREADS) {
    const int g = t / HD;
    const __nv_bfloat16 v = __float2bfloat16_rn(merge_point(ml + g * 2, po + t, C, G, HD));
    if (p.tagged_out) megart::st_tagged(reinterpret_cast<unsigned*>(p.out) - back, t, v);
    else (p.out - back)[t] = v;
  }
}

// The new row into new_row(smem, .): element i.. of K (from thread i / 8) and of V (the next HD / 8 threads),
// each 8 bf16 from its loader (load_k(i), load_v(i)). No barrier: the caller's comes after.
template <int HD, class LoadK, class LoadV>
__device__ __forceinline__ void stage_new_row(char* smem, LoadK load_k, LoadV load_v) {
  const int tid = threadIdx.x;
  if (tid < HD / 8) new_row(smem, 0)[tid] = load_k(8 * tid);
  else if (tid < HD / 4) new_row(smem, 1)[tid - HD / 8] = load_v(8 * (tid - HD / 8));
}

// The tagged form polls before q and the softmax state are live (a spin beside them spilled): the CTA's
// threads together wait until every word of the instance's q carries this step's tag, and stage the new
// row (tpos >= 0: this chunk holds position pos). After the barrier each thread reads its q words as plain
// values: a word is final once tagged.
template <int HD, int G, class P>
__device__ __forceinline__ void poll_tagged_inputs(const P& p, char* smem, int tpos) {
  constexpr int NT = MEGART_THREADS;
  const int tid = threadIdx.x;
#pragma unroll 1
  for (int c = tid; c < G * HD / 8; c += NT) (void)megart::ld_tagged8(p.q, 8 * c);
  if (tpos >= 0)
    stage_new_row<HD>(smem, [&](int i) { return megart::ld_tagged8(p.k_new, i); },
                            [&](int i) { return megart::ld_tagged8(p.v_new, i); });
  __syncthreads();
}

// Lane `sub`'s VEC values of each of the G q heads (from q_off elements into q), scaled for the base-2 softmax, and
// the empty softmax state.
template <int HD, int G, int VEC, class P>
__device__ __forceinline__ void load_q(const P& p, bool tnew, int sub, float (&q)[G][VEC], float (&m)[G],
                                       float (&l)[G], float (&o)[G][VEC], int q_off = 0) {
  constexpr float NEG = -3.402823466e38f;  // finite "minus infinity" keeps exp2(m_old - m_new) NaN-free
  const float qscale = p.scale * kLog2e;
  if (tnew) {  // q's tagged words, known to carry this step's tag (polled before)
    const unsigned* qw = reinterpret_cast<const unsigned*>(p.q) + sub * VEC;
#pragma unroll
    for (int g = 0; g < G; ++g) ld_tagged_values<VEC>(qw + g * HD, q[g]);
  } else {
#pragma unroll
    for (int g = 0; g < G; ++g) unpack_kvec<VEC>(ld_kvec<VEC>(p.q + q_off + g * HD + sub * VEC), q[g]);
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[g][e] *= qscale;
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = NEG;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[g][e] = 0.f;
  }
}
}  // namespace megart_attn

#endif  // MEGART_TASKS_ATTENTION_DECODE_BLOCKS_CUH
