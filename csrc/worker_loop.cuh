// The persistent worker: CTA w walks its queue of task descriptors. For each instance, thread 0
// waits on the instance's events (acquire), the whole CTA runs the body, then thread 0 counts the
// instance's events up (release). Included after the generated megart_dispatch/megart_prefetch.
#pragma once
namespace megart {

__device__ __forceinline__ void signal_all(const TaskDesc& d, unsigned* events) {
  __threadfence();
  for (int k = 0; k < d.hdr[kHdr_n_signal]; ++k) signal_event(events, d.hdr[kHdr_signal_event + k]);
}

__device__ __forceinline__ void worker(const TaskDesc* __restrict__ descs, const int* __restrict__ queue_start,
                                       unsigned* events, long long* ctrl, long long* spans, long long watchdog_ns,
                                       char* smem) {
  __shared__ long long s_gen;
  __shared__ int s_go;
  const int w = blockIdx.x;
  if (threadIdx.x == 0) s_gen = ld_relaxed(ctrl + kCtrl_step) + 1;
  __syncthreads();
  const long long gen = s_gen;
  const int q0 = queue_start[w], q1 = queue_start[w + 1];
#ifdef MEGART_PROFILE
  const SpanSink sink = span_sink(spans, ctrl, gen, queue_start[gridDim.x], q0, q1);
#endif
  for (int i = q0; i < q0 + MEGART_LOOKAHEAD && i < q1; ++i) megart_prefetch(descs[i]);
  bool ok = true;
  for (int i = q0; i < q1; ++i) {
    const TaskDesc& d = descs[i];
    if (i + MEGART_LOOKAHEAD < q1) megart_prefetch(descs[i + MEGART_LOOKAHEAD]);
    unsigned long long t_wait = 0, t_begin = 0;
    if (threadIdx.x == 0) {
      t_wait = globaltimer();
      const int flags = d.hdr[kHdr_flags];
      if (flags & kFlagSignalFirst) signal_all(d, events);
      const WaitSite site{w, i - q0, d.hdr[kHdr_type], d.hdr[kHdr_instance]};
      int go = 1;
      for (int k = 0; k < d.hdr[kHdr_n_wait] && go; ++k) {
        const unsigned need = (unsigned)((long long)d.hdr[kHdr_wait_count + k] * gen);
        go = wait_event(events, d.hdr[kHdr_wait_event + k], need, ctrl, watchdog_ns, site);
      }
      s_go = go;
    }
    __syncthreads();
    if (!s_go) {
      ok = false;
      break;
    }
    if (threadIdx.x == 0) t_begin = globaltimer();
    megart_dispatch(d, smem);
    __syncthreads();
    if (threadIdx.x == 0) {
      if (!(d.hdr[kHdr_flags] & kFlagSignalFirst)) signal_all(d, events);
#ifdef MEGART_PROFILE
      span_record(sink, i - q0, d.hdr[kHdr_type], d.hdr[kHdr_instance], w, t_wait, t_begin, globaltimer(), gen);
#endif
    }
  }
  // The last worker to finish publishes the step, so the next launch runs step + 1 with no host upload.
  if (threadIdx.x == 0 && ok) {
    __threadfence();
    const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(ctrl + kCtrl_done), 1ull);
    if (old == (unsigned long long)gen * gridDim.x - 1) {
      __threadfence();
      atomicExch(reinterpret_cast<unsigned long long*>(ctrl + kCtrl_step), (unsigned long long)gen);
    }
  }
}

}  // namespace megart
