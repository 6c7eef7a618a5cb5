// qkv_rope_append_fp8: qkv_rope_append over e4m3 rows with one f32 scale per row (gemv_m1_fp8's format; each
// dot times its row's scale before the head norm and RoPE). Body: qkv_body (tasks/qkv_common.cuh).
template <class P>
__device__ __forceinline__ auto plan_qkv_rope_append_fp8(const P& p) {
  return qkv_plan(p);
}
template <class P>
__device__ __forceinline__ void megart_task_qkv_rope_append_fp8(const P& p, char* smem) {
  qkv_body(p, smem);
}
__device__ __forceinline__ void megart_prefetch_qkv_rope_append_fp8(const megart_params_qkv_rope_append_fp8& p) {
  qkv_prefetch(p);
}
