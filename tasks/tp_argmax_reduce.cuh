// tp_argmax_reduce: token = global index of the largest LM-head partial over all ranks. Per rank r, parts
// holds n f32 values (as bits) then n rank-local rows; a row of rank r is r * vocab_per_rank globally.
// (helpers: tasks/dense_common.cuh)
template <class P>
__device__ __forceinline__ void megart_task_tp_argmax_reduce(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  float bv = neg_inf();
  int bi = kNoIndex;
  for (int j = threadIdx.x; j < p.tp * p.n; j += MEGART_THREADS) {
    const int r = j / p.n, k = j - r * p.n;
    const int* blk = p.parts + (long long)r * 2 * p.n;
    const float v = nan_low(__int_as_float(blk[k]));
    const int id = blk[p.n + k] + r * p.vocab_per_rank;
    if (better(v, id, bv, bi)) { bv = v; bi = id; }
  }
  block_argmax(bv, bi, scratch_of(smem));
  if (threadIdx.x == 0) p.token[0] = bi;
}
