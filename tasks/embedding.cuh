// embedding: y[n] = table[token[0], col0 : col0 + n] (token clamped into [0, vocab))
// (helpers: tasks/dense_common.cuh)
template <class P>
__device__ __forceinline__ void megart_task_embedding(const P& p, char*) {
  using namespace megart;
  using namespace megart::dense;
  int tok = p.token[0];
  tok = tok < 0 ? 0 : (tok >= p.vocab ? p.vocab - 1 : tok);
  const __nv_bfloat16* src = p.table + (size_t)tok * p.d + p.col0;
  for (int c = threadIdx.x; c < (p.n >> 3); c += MEGART_THREADS)
    *reinterpret_cast<uint4*>(p.y + 8 * c) = ld_weight(src + 8 * c);
}
