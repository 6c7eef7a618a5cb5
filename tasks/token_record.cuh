// token_record: history[pos[0]] = token[0] when 0 <= pos[0] < n (greedy decoding's output log).
__device__ __forceinline__ void megart_task_token_record(const megart_params_token_record& p, char*) {
  if (threadIdx.x == 0) {
    const int at = p.pos[0];
    if (at >= 0 && at < p.n) p.history[at] = p.token[0];
  }
}
