// attention_merge: log-sum-exp combine of the attention_decode chunk partials into out (bf16, or tagged words).
// Instance = q heads [i0, i0 + nheads); part_o / part_ml point at (kv head i0 / group, chunk 0, q slot
// i0 % group). For q head i = (h, g) and chunk c: M = max_c m_c, w_c = exp(m_c - M), L = sum w_c l_c,
// out = sum_c w_c o_c / L (0 when every chunk is empty). One thread per (head, dim).
// The arithmetic is megart_attn::merge_point (tasks/attention_common.cuh), which attention_decode's
// fused form (out / arrivals given: the last chunk of a kv head merges) runs too, so both give the same bits.
// (shared helpers: tasks/attention_common.cuh)

__device__ __forceinline__ void megart_task_attention_merge(const megart_params_attention_merge& p, char*) {
  const int G = p.group, HD = p.hd, C = p.chunks, g0 = p.g0;
  const int n = p.nheads * HD;
  for (int t = threadIdx.x; t < n; t += MEGART_THREADS) {
    const int k = t / HD, dd = t - k * HD;
    const int kk = g0 + k, dh = kk / G, g = kk - dh * G;
    const long long head = (long long)dh * C * G + (g - g0);  // (kv head, chunk 0, q slot) relative
    const float* ml = p.part_ml + head * 2;
    const float* po = p.part_o + head * HD + dd;
    const __nv_bfloat16 v = __float2bfloat16_rn(megart_attn::merge_point(ml, po, C, G, HD));
    if (p.tagged_out) megart::st_tagged(p.out, t, v);
    else p.out[t] = v;
  }
}
