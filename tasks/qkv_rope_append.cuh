// qkv_rope_append: fused (optional RMSNorm) + Q/K/V projection + RoPE + KV-cache append, M = 1.
//
// One instance = one head of w_qkv (q, k or v) restricted to the rotate-half pairs
// [pair0, pair0 + npairs): rows pair0 + j and half + pair0 + j of the head (w points at the first).
// Every thread owns the column vectors c = tid + k * MEGART_THREADS of the row (16-byte, 8 bf16), keeps the
// (normalised, bf16-rounded) x for those columns in fp32 registers, streams U rows x KV vectors of W per
// batch (16 loads of 16 bytes in flight per thread), reduces each row across the warp and then across warps
// in shared memory. The epilogue (one thread per pair) applies RoPE in fp32 and rounds to bf16.
//
// mode bits: 1 = RoPE (q, k heads), 2 = fused RMSNorm of x (norm_weight valid), 4 = destination is a cache
// head (row `pos`, stride 2 * half) rather than q, 8 = RMSNorm of the head's own fp32 dots with the gain
// head_norm [hd] before RoPE (Qwen3's q_norm / k_norm; the splitter then gives the instance the whole head). dst gets the low half of each pair, dst2 the high half
// (q: dst2 points at it; cache: dst2 == dst and the high half is + half).
// (shared helpers: tasks/attention_common.cuh)

namespace megart_attn {
// kQkvMaxRows (2 * half; hd <= 128), kQkvMaxD and the kMode* bits: generated from tasks/attention.py

// Pair j's two dot products (rows j and np + j): the per-warp partials in `red`, summed in warp order.
__device__ __forceinline__ void pair_dots(const float* red, int j, int np, float& lo, float& hi) {
  constexpr int NWARP = MEGART_THREADS / 32;
  lo = 0.f;
  hi = 0.f;
#pragma unroll
  for (int w = 0; w < NWARP; ++w) {
    lo += red[j * NWARP + w];
    hi += red[(np + j) * NWARP + w];
  }
}

template <int KV>
__device__ __forceinline__ void qkv_rope_append_body(const megart_params_qkv_rope_append& p, char* smem, int pos) {
  constexpr int NT = MEGART_THREADS, NWARP = NT / 32;
  // rows per batch: U * KV 16-byte loads in flight per thread (32 = 512 B; 8 under kLowRegs)
  constexpr int U = (kLowRegs ? 8 : 32) / KV > 0 ? (kLowRegs ? 8 : 32) / KV : 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int d = p.d, nvec = d >> 3, np = p.npairs, half = p.half, rows = 2 * np;
  float* red = reinterpret_cast<float*>(smem);  // [rows][NWARP] per-warp partial dot products
  float* scratch = red + kQkvMaxRows * NWARP;   // block_sum scratch (NWARP floats)

  // x for this thread's columns, fp32 (exact from bf16); with the fused RMSNorm, x * inv_rms * w in fp32
  // rounded to bf16, so the dots see the same bf16 activation an unfused rmsnorm task would write.
  float xf[KV][8];
#pragma unroll
  for (int k = 0; k < KV; ++k) {
    const int c = tid + k * NT;
    if (c < nvec) {
      unpack8(ld_in16(p.x + 8 * c), xf[k]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[k][e] = 0.f;
    }
  }
  if (p.mode & kModeNorm) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < KV; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) ss = fmaf(xf[k][e], xf[k][e], ss);
    ss = megart::block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)d + p.eps);
#pragma unroll
    for (int k = 0; k < KV; ++k) {
      const int c = tid + k * NT;
      if (c < nvec) {
        float wf[8];
        unpack8(ld_weight16(p.norm_weight + 8 * c), wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) xf[k][e] = round_bf16(xf[k][e] * inv * wf[e]);
      }
    }
  }

  for (int r0 = 0; r0 < rows; r0 += U) {
    uint4 wv[U][KV];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = r0 + u;
      const long long off = (long long)(r < np ? r : r - np + half) * d;
#pragma unroll
      for (int k = 0; k < KV; ++k) {
        const int c = tid + k * NT;
        if (r < rows && c < nvec) {
          wv[u][k] = ld_weight16(p.w + off + 8 * c);
        } else {
          wv[u][k] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < KV; ++k) {
        float wf[8];
        unpack8(wv[u][k], wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xf[k][e], acc);
      }
      acc = megart::warp_sum(acc);
      if (lane == 0 && r0 + u < rows) red[(r0 + u) * NWARP + warp] = acc;
    }
  }
  __syncthreads();

  // per-head RMSNorm (mode 8): the mean square over all 2 * np == hd dots of the head, fp32
  float head_inv = 1.f;
  if (p.mode & kModeHeadNorm) {  // uniform over the CTA, so every thread reaches block_sum
    float ss = 0.f;
    for (int j = tid; j < np; j += NT) {
      float lo, hi;
      pair_dots(red, j, np, lo, hi);
      ss = fmaf(lo, lo, fmaf(hi, hi, ss));
    }
    ss = megart::block_sum(ss, scratch);
    head_inv = rsqrtf(ss / (float)rows + p.eps);
  }

  for (int j = tid; j < np; j += NT) {
    float lo, hi;
    pair_dots(red, j, np, lo, hi);
    if (p.mode & kModeHeadNorm) {
      lo = lo * head_inv * __bfloat162float(p.head_norm[p.pair0 + j]);
      hi = hi * head_inv * __bfloat162float(p.head_norm[half + p.pair0 + j]);
    }
    float out_lo = lo, out_hi = hi;
    if (p.mode & kModeRope) {  // rotate-half RoPE on the pair (j, j + half), fp32
      const long long t = (long long)pos * half + p.pair0 + j;
      const float c = p.cos[t], s = p.sin[t];
      out_lo = lo * c - hi * s;
      out_hi = hi * c + lo * s;
    }
    const long long row = (p.mode & kModeCache) ? (long long)pos * 2 * half : 0;
    const int hoff = (p.mode & kModeCache) ? half : 0;
    p.dst[row + j] = __float2bfloat16_rn(out_lo);
    p.dst2[row + hoff + j] = __float2bfloat16_rn(out_hi);
  }
}
}  // namespace megart_attn

__device__ __forceinline__ void megart_task_qkv_rope_append(const megart_params_qkv_rope_append& p, char* smem) {
  const int pos = megart_attn::ld_in_i32(p.pos);
  if (pos < 0 || pos >= p.max_seq) return;  // out-of-range position: the instance writes nothing
  // column vectors per thread; only the counts d <= 8192 can need at this thread count are instantiated
  constexpr int kMaxPerThread = (megart_attn::kQkvMaxD / 8 + MEGART_THREADS - 1) / MEGART_THREADS;
  const int per_thread = ((p.d >> 3) + MEGART_THREADS - 1) / MEGART_THREADS;
  if (per_thread <= 1) {
    megart_attn::qkv_rope_append_body<1>(p, smem, pos);
  } else if (per_thread <= 2) {
    if constexpr (kMaxPerThread >= 2) megart_attn::qkv_rope_append_body<2>(p, smem, pos);
  } else if (per_thread <= 4) {
    if constexpr (kMaxPerThread >= 3) megart_attn::qkv_rope_append_body<4>(p, smem, pos);
  } else if (per_thread <= 8) {
    if constexpr (kMaxPerThread >= 5) megart_attn::qkv_rope_append_body<8>(p, smem, pos);
  } else {
    __trap();  // d > 64 * MEGART_THREADS: the splitter refuses d > 8192, so only < 128 threads get here
  }
}

// Before the instance's waits: pull this instance's W rows (both halves of its pairs) and the norm gain
// into L2. None of them depends on another task.
__device__ __forceinline__ void megart_prefetch_qkv_rope_append(const megart_params_qkv_rope_append& p) {
  if (threadIdx.x == 0) {
    const unsigned long long bytes = (unsigned long long)p.npairs * (unsigned long long)p.d * 2ull;
    megart::prefetch_l2(p.w, bytes);
    megart::prefetch_l2(p.w + (long long)p.half * p.d, bytes);
    if (p.mode & megart_attn::kModeNorm) megart::prefetch_l2(p.norm_weight, (unsigned long long)p.d * 2ull);
  }
}
