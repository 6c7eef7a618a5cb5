// pos_advance: the step-start bookkeeping of a decode loop kept on the device.
// pos[0] = pos_next[0]; pos_next[0] += 1. One thread; the runtime's release/acquire events publish it.
__device__ __forceinline__ void megart_task_pos_advance(const megart_params_pos_advance& p, char*) {
  if (threadIdx.x == 0) {
    const int v = *reinterpret_cast<volatile const int*>(p.pos_next);
    p.pos[0] = v;
    p.pos_next[0] = v + 1;
  }
}
