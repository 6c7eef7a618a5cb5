// qkv_rope_append: fused (optional RMSNorm) + Q/K/V projection + RoPE + KV-cache append, M = 1, bf16 weights.
// The body is megart_attn's qkv_body (tasks/qkv_common.cuh, with the mode bits and the instance layout).
template <class P>
__device__ __forceinline__ auto plan_qkv_rope_append(const P& p) {
  return qkv_plan(p);
}
template <class P>
__device__ __forceinline__ void megart_task_qkv_rope_append(const P& p, char* smem) {
  qkv_body(p, smem);
}
__device__ __forceinline__ void megart_prefetch_qkv_rope_append(const megart_params_qkv_rope_append& p) {
  qkv_prefetch(p);
}
