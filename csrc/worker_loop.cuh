// The persistent worker: CTA w walks its queue of task descriptors. For each instance, thread 0
// waits on the instance's events (acquire), the whole CTA runs the body, then thread 0 counts the
// instance's events up (release). Included after the generated megart_dispatch/megart_prefetch.
//
// With the weight stream on (csrc/weight_stream.cuh) the CTA has one more warp, the producer, which
// streams every compute warp's weight stages across instance boundaries; it leaves the loop below to
// the MEGART_THREADS compute threads and meets them again at the end.
//
// A task type with a prewait (dense GEMVs: weights into a shared-memory ring) starts loads that need no
// input before the wait, and drains them after its body, so the next instance finds shared memory idle.
//
// Descriptors rotate through three shared-memory slots: while instance i runs, instance i+1 is
// already staged (its weights were handed to the L2 prefetcher before i's wait) and instance i+2's
// descriptor is in flight from global memory, so no body and no wait starts on a global load.
#pragma once
namespace megart {

__device__ __forceinline__ void signal_all(const TaskDesc& d, unsigned* events, const long long* ctrl) {
  // A release at gpu scope after the CTA barrier publishes every thread's writes (CUTLASS's pattern): one
  // fence for all of the instance's signals (system scope if one goes to a peer), then relaxed adds; or,
  // with MEGART_LEAN_SYNC=0, a red.release per signal.
  const int n = d.hdr[kHdr_n_signal];
  if (kLeanSync && n > 0) {
    bool peer = false;
#ifdef MEGART_TP
    for (int k = 0; k < n; ++k) peer |= d.hdr[kHdr_signal_event + k] < 0;
#endif
    if (peer) fence_release<true>();
    else fence_release<false>();
  }
  for (int k = 0; k < n; ++k) {
    const int ev = d.hdr[kHdr_signal_event + k];
#ifdef MEGART_TP
    if (ev < 0) {  // a peer event on another rank (system scope)
      if (kLeanSync) signal_peer_relaxed(ctrl, ev);
      else signal_peer(ctrl, ev);
      continue;
    }
#endif
    if (kLeanSync) signal_event_relaxed(events, ev);
    else signal_event(events, ev);
  }
  (void)ctrl;
}

// One 8-byte descriptor word, global -> shared, asynchronously (cp.async: the copy joins whatever group a body
// commits next, which only makes that group wait a little longer); copy_desc_wait() before it is read.
__device__ __forceinline__ void copy_desc_word(unsigned long long* dst, const unsigned long long* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void copy_desc_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void stage_words(TaskDesc& dst, const TaskDesc& src) {
  for (int k = threadIdx.x; k < kDescWords; k += MEGART_THREADS)
    reinterpret_cast<unsigned long long*>(&dst)[k] = reinterpret_cast<const unsigned long long*>(&src)[k];
}

// MEGART_QUEUE_BOUNDS_SMEM (default 0): see compute().
#ifndef MEGART_QUEUE_BOUNDS_SMEM
#define MEGART_QUEUE_BOUNDS_SMEM 0
#endif

// The compute threads' whole launch: worker w's queue [q0, q1).
__device__ __forceinline__ void compute(const TaskDesc* __restrict__ descs, const int* __restrict__ queue_start,
                                        unsigned* events, long long* ctrl, long long* spans, long long watchdog_ns,
                                        char* smem, int w, int q0, int q1) {
  static_assert(kDescWords <= MEGART_THREADS, "one thread stages one descriptor word");
  __shared__ long long s_gen;
  __shared__ int s_go;
  __shared__ TaskDesc s_desc[3];
  if (q0 < q1) stage_words(s_desc[0], descs[q0]);  // (descriptors: no step writes them)
  if (q0 + 1 < q1) stage_words(s_desc[1], descs[q0 + 1]);
  grid_dependency_wait();  // an overlapped launch: the previous step has ended (ctrl, events, activations)
#if MEGART_QUEUE_BOUNDS_SMEM
  // The queue's bounds re-read from shared memory where used, so no register holds them across the bodies: at
  // the register cap they are what a kernel spills first (the small model's stream build: 36 bytes).
  __shared__ int s_bounds[2];
  if (threadIdx.x == 0) {
    s_bounds[0] = q0;
    s_bounds[1] = q1;
  }
  auto lo = [&] { return *reinterpret_cast<volatile int*>(&s_bounds[0]); };
  auto hi = [&] { return *reinterpret_cast<volatile int*>(&s_bounds[1]); };
#else
  auto lo = [&] { return q0; };
  auto hi = [&] { return q1; };
#endif
  if (threadIdx.x == 0) {
    s_gen = ld_relaxed(ctrl + kCtrl_step) + 1;
    s_poll.ctrl = ctrl;  // (polled reads of tagged words: csrc/tagged.cuh)
    s_poll.watchdog_ns = watchdog_ns;
    s_poll.worker = w;
    s_poll.tag = step_tag_bits(s_gen);
  }
  __syncthreads();
  const long long gen = s_gen;
#ifdef MEGART_PROFILE
  const SpanSink sink = span_sink(spans, ctrl, gen, queue_start[gridDim.x], lo(), hi());
#endif
  if (q0 < q1) megart_prefetch(s_desc[0]);
  bool ok = true;
  int cur = 0;
  for (int i = lo(); i < hi(); ++i) {
    const int nxt = cur == 2 ? 0 : cur + 1, nxt2 = nxt == 2 ? 0 : nxt + 1;
    const TaskDesc& d = s_desc[cur];
    if (i + 1 < hi()) megart_prefetch(s_desc[nxt]);
    megart_prewait(d, smem);  // loads that need no input (weights into shared memory) start before the wait
    if (threadIdx.x == 0) {
#ifdef MEGART_PROFILE
      s_span_t[0] = globaltimer();  // (wait start and body begin sit in shared memory, not in registers held
      //                               across the body: at the register cap they were spilled around it)
#endif
      if (d.hdr[kHdr_flags] & kFlagSignalFirst) signal_all(d, events, ctrl);
      const WaitSite site{w, i - lo(), d.hdr[kHdr_type], d.hdr[kHdr_instance]};
#if MEGART_STREAM_SLOTS > 0
      stream_note(site.queue_pos, site.type, site.instance);
#endif
      s_poll.queue_pos = site.queue_pos;
      s_poll.type = site.type;
      s_poll.instance = site.instance;
      int go = 1;
      for (int k = 0; k < d.hdr[kHdr_n_wait] && go; ++k) {
        const unsigned need = (unsigned)((long long)d.hdr[kHdr_wait_count + k] * gen);
        const int ev = d.hdr[kHdr_wait_event + k];
#ifdef MEGART_TP
        // A peer event: other ranks count it up (system scope). It gives up at half the limit, so a dead
        // or stalled peer is recorded here, not at a local wait that queued up behind this one.
        if (ev < 0) {
          go = wait_event<true>(events, -1 - ev, need, ctrl, watchdog_ns >> 1, site);
          continue;
        }
#endif
        go = wait_event(events, ev, need, ctrl, watchdog_ns, site);
      }
      s_go = go;
    }
    __syncthreads();
    if (!s_go) {
      megart_drain(d, smem);  // no copy may still be landing in shared memory when the CTA exits
      ok = false;
      break;
    }
    // Descriptor i+2 lands in its slot while the body runs: an asynchronous copy, so no register holds it across
    // the body (a held word was spilled around the bodies at the register cap). Not before the barrier above:
    // the slot is instance i-1's, whose signals thread 0 reads at the end of the previous iteration.
    if (threadIdx.x < kDescWords && i + 2 < hi())
      copy_desc_word(reinterpret_cast<unsigned long long*>(&s_desc[nxt2]) + threadIdx.x,
                     reinterpret_cast<const unsigned long long*>(descs + i + 2) + threadIdx.x);
#ifdef MEGART_PROFILE
    if (threadIdx.x == 0) {
      s_span_t[1] = globaltimer();
      s_span_mark[0] = s_span_mark[1] = kStreamWaits ? 0ull : s_span_t[1];
      if (kWarpSpreadMarks) s_span_mark[0] = ~0ull;  // (the first warp's time: an atomicMin)
#if MEGART_STREAM_SLOTS > 0
      stream_waits_begin();
#endif
    }
#endif
    megart_dispatch(d, smem);
    megart_drain(d, smem);
    copy_desc_wait();
    __syncthreads();
    if (threadIdx.x == 0) {
#ifdef MEGART_PROFILE
      const unsigned long long t_end = globaltimer();
#endif
      if (!(d.hdr[kHdr_flags] & kFlagSignalFirst)) signal_all(d, events, ctrl);
#ifdef MEGART_PROFILE
#if MEGART_STREAM_SLOTS > 0
      stream_waits_finish(s_span_t[1]);
#endif
      if (kWarpSpreadMarks && s_span_mark[0] == ~0ull) s_span_mark[0] = s_span_mark[1] = s_span_t[1];
      span_record(sink, i - lo(), d.hdr[kHdr_type], d.hdr[kHdr_instance], w, s_span_t[0], s_span_t[1], t_end, gen);
#endif
    }
    cur = nxt;
  }
#if MEGART_STREAM_SLOTS > 0
  if (!kProducerWarp) stream_end();  // after an abort, stages may still be landing: none may outlive the CTA
#endif
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

__device__ __forceinline__ void worker(const TaskDesc* __restrict__ descs, const int* __restrict__ queue_start,
                                       unsigned* events, long long* ctrl, long long* spans, long long watchdog_ns,
                                       char* smem) {
  const int w = blockIdx.x;
  const int q0 = queue_start[w], q1 = queue_start[w + 1];
  grid_allow_dependents();  // the next step may take this SM once this CTA exits (an overlapped launch only)
#if MEGART_STREAM_SLOTS > 0
  stream_begin(descs, q0, q1, w, ctrl, watchdog_ns, smem);  // every thread (barrier 0)
  // One if/else with a role per branch, so that the register hand-over (setmaxnreg) takes effect. No
  // barrier after it: the producer waits for its own copies to land before its threads exit, so none
  // outlives the CTA. In an overlapped launch the producer streams the first weights while the previous
  // step still runs; the compute threads wait for it to end (compute: grid_dependency_wait).
  if (kProducerWarp && threadIdx.x >= MEGART_THREADS) {
    stream_producer_role();
  } else {
    stream_compute_regs();
    compute(descs, queue_start, events, ctrl, spans, watchdog_ns, smem, w, q0, q1);
  }
#else
  compute(descs, queue_start, events, ctrl, spans, watchdog_ns, smem, w, q0, q1);
#endif
}

}  // namespace megart
