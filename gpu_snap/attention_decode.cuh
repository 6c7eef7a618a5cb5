// attention_decode: one query token against the KV cache of one kv head, over one chunk of positions
// (flash-decoding partials). Instance (kv head h, chunk c) covers positions [lo, hi) of kv_len = pos + 1
// (read from device memory) for the `group` q heads of h, and writes per q head the running max m (natural
// units of the scaled score), the sum l = sum exp(s - m) and the unnormalised o = sum exp(s - m) v (fp32).
// An empty chunk writes m = -inf, l = 0, o = 0.
//
// chunk > 0: static chunks, [c * chunk, min((c + 1) * chunk, kv_len)).
// chunk == 0: dynamic chunks of ceil(kv_len / nchunks) positions, so every instance has work at any length.
//
// Layout: a K/V row (hd bf16) is read by HD/VEC lanes, VEC bf16 each (VEC = 8: 16-byte loads; group 8 uses
// VEC = 4, 8-byte loads, to halve its q/o registers); a warp covers 32/(HD/VEC) positions per load and each
// of these "slots" streams U = 8 positions per batch (2U loads in flight per thread). Each slot keeps its own online softmax (base-2 exponent, scale * log2(e) folded into q); the
// slots are merged across lanes with shuffles, then across warps in shared memory.
// (shared helpers: tasks/attention_common.cuh)

namespace megart_attn {
constexpr int kAttnStageWarps = 8;  // warps merged per shared-memory round

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
    asm volatile("ld.global.cg.L2::128B.v2.u32 {%0, %1}, [%2];" : "=r"(r.u[0]), "=r"(r.u[1]) : "l"(p) : "memory");
  }
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

template <int HD, int G>
__device__ __forceinline__ void attention_decode_body(const megart_params_attention_decode& p, char* smem, int lo,
                                                      int hi) {
  constexpr int NT = MEGART_THREADS, NWARP = NT / 32;
  constexpr int VEC = G >= 8 ? 4 : 8;  // bf16 per lane per row
  constexpr int LPR = HD / VEC;        // lanes per K/V row
  constexpr int RPW = 32 / LPR;        // rows (positions) per warp per load
  constexpr int SLOTS = NWARP * RPW;   // positions per CTA per load
  constexpr int U = kLowRegs ? (G >= 4 ? 2 : 4) : (G >= 8 ? 4 : 8);  // positions per slot per batch
  constexpr float NEG = -3.402823466e38f;  // finite "minus infinity" keeps exp2(m_old - m_new) NaN-free
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % LPR, rw = lane / LPR, slot = warp * RPW + rw;

  float q[G][VEC];
  const float qscale = p.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    unpack_kvec<VEC>(ld_kvec<VEC>(p.q + g * HD + sub * VEC), q[g]);
#pragma unroll
    for (int e = 0; e < VEC; ++e) q[g][e] *= qscale;
  }
  float m[G], l[G], o[G][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = NEG;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[g][e] = 0.f;
  }

  const __nv_bfloat16* kb = p.k_cache + sub * VEC;
  const __nv_bfloat16* vb = p.v_cache + sub * VEC;
  for (int b = lo; b < hi; b += SLOTS * U) {
    KVec<VEC> kv[U], vv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = b + u * SLOTS + slot;
      if (t < hi) {
        kv[u] = ld_kvec<VEC>(kb + (long long)t * HD);
        vv[u] = ld_kvec<VEC>(vb + (long long)t * HD);
      } else {
#pragma unroll
        for (int i = 0; i < VEC / 2; ++i) kv[u].u[i] = vv[u].u[i] = 0u;
      }
    }
    float s[U][G];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      unpack_kvec<VEC>(kv[u], kf);
      const bool valid = b + u * SLOTS + slot < hi;
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
      const float alpha = exp2f(m[g] - mb);
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
        const float pu = exp2f(s[u][g] - m[g]);  // 0 for masked positions (s = -inf, m finite)
        l[g] += pu;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[g][e] = fmaf(pu, vf[e], o[g][e]);
      }
    }
  }

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
}  // namespace megart_attn

__device__ __forceinline__ void megart_task_attention_decode(const megart_params_attention_decode& p, char* smem) {
  const int pos = megart_attn::ld_in_i32(p.pos);
  const int kv_len = pos < 0 ? 0 : (pos >= p.max_seq ? p.max_seq : pos + 1);
  int lo, hi;
  if (p.chunk > 0) {
    lo = p.cidx * p.chunk;
    hi = lo + p.chunk;
  } else {
    const int cl = (kv_len + p.nchunks - 1) / p.nchunks;
    lo = p.cidx * cl;
    hi = lo + cl;
  }
  if (hi > kv_len) hi = kv_len;
  if (hi < lo) hi = lo;
  const int key = p.hd * 16 + p.group;
  switch (key) {
    case 64 * 16 + 1: megart_attn::attention_decode_body<64, 1>(p, smem, lo, hi); break;
    case 64 * 16 + 2: megart_attn::attention_decode_body<64, 2>(p, smem, lo, hi); break;
    case 64 * 16 + 4: megart_attn::attention_decode_body<64, 4>(p, smem, lo, hi); break;
    case 64 * 16 + 8: megart_attn::attention_decode_body<64, 8>(p, smem, lo, hi); break;
    case 128 * 16 + 1: megart_attn::attention_decode_body<128, 1>(p, smem, lo, hi); break;
    case 128 * 16 + 2: megart_attn::attention_decode_body<128, 2>(p, smem, lo, hi); break;
    case 128 * 16 + 4: megart_attn::attention_decode_body<128, 4>(p, smem, lo, hi); break;
    case 128 * 16 + 8: megart_attn::attention_decode_body<128, 8>(p, smem, lo, hi); break;
    default: break;  // the splitter refuses other (hd, group)
  }
}
