// pos_advance: the step-start bookkeeping of a decode loop kept on the device.
// pos[0] = pos_next[0]; pos_next[0] += 1. One thread; the runtime's release/acquire events publish it.
// pos_stamp (optional, one tagged word) is stored after a fence, with this step's tag: the weight stream's
// producer, which waits on no event, polls it before it reads pos (tasks/attention_decode.cuh).
__device__ __forceinline__ void megart_task_pos_advance(const megart_params_pos_advance& p, char*) {
  if (threadIdx.x == 0) {
    const int v = *reinterpret_cast<volatile const int*>(p.pos_next);
    p.pos[0] = v;
    p.pos_next[0] = v + 1;
    if (p.pos_stamp != nullptr) {
      __threadfence();  // pos before the stamp, for a reader that sees the stamp
      megart::st_tagged(p.pos_stamp, 0, __float2bfloat16(0.f));
    }
  }
}
