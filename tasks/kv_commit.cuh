// kv_commit: the tagged form's cache append. qkv_rope_append's tagged form stores this step's new k and v rows
// as tagged words ([n_kv, hd] each) instead of writing the caches, so attention_decode polls them and waits on
// no event; this task, after every attention instance that reads the caches, appends them at row pos.
// One instance per call: n = n_kv * hd values of each, one thread per value.

__device__ __forceinline__ void megart_task_kv_commit(const megart_params_kv_commit& p, char*) {
  const int pos = megart_attn::ld_in_i32(p.pos);
  if (pos < 0 || pos >= p.max_seq) return;  // out of range: qkv wrote nothing either
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) {
    const int h = i / p.hd, e = i - h * p.hd;
    const long long at = ((long long)h * p.max_seq + pos) * p.hd + e;
    p.k_cache[at] = __float2bfloat16_rn(__uint_as_float(megart::ld_tagged(p.k_new, i) << 16));   // (exact)
    p.v_cache[at] = __float2bfloat16_rn(__uint_as_float(megart::ld_tagged(p.v_new, i) << 16));
  }
}
