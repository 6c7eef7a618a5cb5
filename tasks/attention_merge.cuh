// attention_merge: log-sum-exp combine of the attention_decode chunk partials into out (bf16).
// Instance = q heads [i0, i0 + nheads); part_o / part_ml point at (kv head i0 / group, chunk 0, q slot
// i0 % group). For q head i = (h, g) and chunk c: M = max_c m_c, w_c = exp(m_c - M), L = sum w_c l_c,
// out = sum_c w_c o_c / L (0 when every chunk is empty). One thread per (head, dim).
// With kMergeBatch > 0 and up to that many chunks (the default split: nw / n_kv = 16) every load is issued
// before the first use, so the merge costs one memory round trip instead of two dependent passes; the
// arithmetic is the same, in the same order. Measured in the Llama-1B step it did not shorten the merge
// (50 vs 51 us over 16 layers, bench/RESULTS.md). Off where registers are scarce (128-register builds,
// 128 threads): there the unrolled batch made ptxas spill.
// (shared helpers: tasks/attention_common.cuh)

namespace megart_attn {
constexpr int kMergeBatch = (kLowRegs || MEGART_THREADS < 256) ? 0 : 16;

// One (head, dim) output over C <= B chunks, all loads first.
template <int B>
__device__ __forceinline__ bool merge_batched(const float* ml, const float* po, int C, int G, int HD, float& L,
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
}  // namespace megart_attn

__device__ __forceinline__ void megart_task_attention_merge(const megart_params_attention_merge& p, char*) {
  const int G = p.group, HD = p.hd, C = p.chunks, g0 = p.g0;
  const int n = p.nheads * HD;
  for (int t = threadIdx.x; t < n; t += MEGART_THREADS) {
    const int k = t / HD, dd = t - k * HD;
    const int kk = g0 + k, dh = kk / G, g = kk - dh * G;
    const long long head = (long long)dh * C * G + (g - g0);  // (kv head, chunk 0, q slot) relative
    const float* ml = p.part_ml + head * 2;
    const float* po = p.part_o + head * HD + dd;
    float L = 0.f, O = 0.f;
    if (!megart_attn::merge_batched<megart_attn::kMergeBatch>(ml, po, C, G, HD, L, O)) {
      float M = megart_attn::neg_inf();
      for (int c = 0; c < C; ++c) M = fmaxf(M, megart_attn::ld_in_f32(ml + (long long)c * G * 2));
      if (M != megart_attn::neg_inf()) {
        for (int c = 0; c < C; ++c) {
          const float mc = megart_attn::ld_in_f32(ml + (long long)c * G * 2);
          const float w = exp2f((mc - M) * megart_attn::kLog2e);
          L = fmaf(w, megart_attn::ld_in_f32(ml + (long long)c * G * 2 + 1), L);
          O = fmaf(w, megart_attn::ld_in_f32(po + (long long)c * G * HD), O);
        }
      }
    }
    p.out[t] = __float2bfloat16_rn(L > 0.f ? O / L : 0.f);
  }
}
