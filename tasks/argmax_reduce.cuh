// argmax_reduce: token = part_idx of the largest part_val (ties: lowest index); with history, also
// history[pos[0]] = token (when 0 <= pos[0] < n_history)
// (helpers: tasks/dense_common.cuh)
template <class P>
__device__ __forceinline__ void megart_task_argmax_reduce(const P& p, char* smem) {
  using namespace megart;
  using namespace megart::dense;
  float bv = neg_inf();
  int bi = kNoIndex;
  for (int i = threadIdx.x; i < p.n; i += MEGART_THREADS) {
    const float v = nan_low(p.part_val[i]);
    const int id = p.part_idx[i];
    if (better(v, id, bv, bi)) { bv = v; bi = id; }
  }
  block_argmax(bv, bi, scratch_of(smem));
  if (threadIdx.x == 0) {
    p.token[0] = bi;
    if (p.history != nullptr) {
      const int at = p.pos[0];
      if (at >= 0 && at < p.n_history) p.history[at] = bi;
    }
  }
}
