// megart device runtime primitives: timers, acquire/release event counters, the watchdog.
// Plain functions only; the worker loop that uses them is csrc/worker_loop.cuh.
#pragma once
namespace megart {

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Phase marks (profiled builds with MEGART_PHASE_MARKS=1): a body stamps up to two points of its instance
// with span_mark(0) and span_mark(1) (thread 0's time of reaching them); the span record keeps both. A mark
// never stamped reads as the body's begin, and mark 1 as mark 0 when only mark 0 was stamped (a body
// without a second phase, such as attention without the fused merge), so no phase comes out negative. Opt-in because the stamps cost: reading the timer inside
// the body made the weight-bound calls' instances 1-2 us longer on the H200, which a faithful per-task
// number must not carry. Otherwise span_mark compiles to nothing.
#ifdef MEGART_PROFILE
__shared__ unsigned long long s_span_mark[2];
__shared__ unsigned long long s_span_t[2];  // the instance's wait start and body begin (thread 0, worker loop)
#endif
// Stream-wait accounting (profiled builds with MEGART_STREAM_WAITS=1, a diagnostic): the two mark words
// carry, instead of times, where the compute warps' time went in a streamed instance (csrc/weight_stream.cuh,
// lane 0 of each warp, ns summed over warps): word 0 the time waiting for weight stages to land, plus (the
// time reading them: dots, from a stage's landing to its release) << kMarkHighShift; word 1 the time from the
// body's begin to each warp's first stage request (x staging and the input's wait), plus (stages read) <<
// kMarkHighShift (megart/layout.py MARK_HIGH_SHIFT). MEGART_STREAM_WAITS=2 counts what the ring holds instead,
// when each warp first reads the instance's stages (stream_read_begin): word 0 the warp's stages already landed,
// word 1 its stages issued and not yet read, plus 1 << kMarkHighShift per warp (summed over warps).
#if defined(MEGART_PROFILE) && defined(MEGART_STREAM_WAITS) && MEGART_STREAM_WAITS
#if defined(MEGART_PHASE_MARKS) && MEGART_PHASE_MARKS
#error "MEGART_STREAM_WAITS and MEGART_PHASE_MARKS both use the span records' mark words: set one"
#endif
constexpr bool kStreamWaits = true;  // (either mode: the mark words hold counts, not times)
constexpr bool kStreamTimes = MEGART_STREAM_WAITS == 1;
constexpr bool kStreamOccupancy = MEGART_STREAM_WAITS == 2;
#else
constexpr bool kStreamWaits = false;
constexpr bool kStreamTimes = false;
constexpr bool kStreamOccupancy = false;
#endif
// MEGART_PHASE_MARKS=2 (a diagnostic) stamps the warps' spread instead: mark 1 is reached by every compute
// warp (a dense body's dots and epilogues done), and the record keeps the first warp's time as mark 0 and the
// last one's as mark 1 (lane 0 of each warp, the warp's index in the time's low 4 bits; mark-0 calls are
// ignored). An instance whose body never reaches mark 1 records both at its begin (csrc/worker_loop.cuh).
// kPhaseStamps: span_mark(i) stamps thread 0's time (MEGART_PHASE_MARKS=1), so where a body calls it is what
// its marks measure (attention_decode's MEGART_ATTN_MARK0 moves its mark 0 only then).
#if defined(MEGART_PROFILE) && defined(MEGART_PHASE_MARKS) && MEGART_PHASE_MARKS == 2
constexpr bool kWarpSpreadMarks = true, kPhaseStamps = false;
static_assert(MEGART_THREADS <= 512, "MEGART_PHASE_MARKS=2 keeps a warp index in 4 bits");
__device__ __forceinline__ void span_mark(int i) {
  if (i == 1 && (threadIdx.x & 31) == 0) {  // (the warp's index in the low 4 bits: which warp came first / last)
    const unsigned long long t = (globaltimer() & ~0xfull) | (threadIdx.x >> 5);
    atomicMin(&s_span_mark[0], t);
    atomicMax(&s_span_mark[1], t);
  }
}
#elif defined(MEGART_PROFILE) && defined(MEGART_PHASE_MARKS) && MEGART_PHASE_MARKS
constexpr bool kWarpSpreadMarks = false, kPhaseStamps = true;
__device__ __forceinline__ void span_mark(int i) {
  if (threadIdx.x == 0) {
    const unsigned long long t = globaltimer();
    s_span_mark[i] = t;
    if (i == 0) s_span_mark[1] = t;
  }
}
#else
constexpr bool kWarpSpreadMarks = false, kPhaseStamps = false;
__device__ __forceinline__ void span_mark(int) {}
#endif

// Overlapped step launches (programmatic dependent launch: the host launches a step with
// programmatic_stream_serialization, megart/launch.py). Every CTA allows the next launch at its start, so the
// next step's CTAs take each SM this step's CTAs leave; they run until grid_dependency_wait(), which returns
// once the previous grid has ended and its writes are visible. What may run before it reads only what no
// step writes: the descriptors and the weights. In a launch without the attribute both are no-ops.
__device__ __forceinline__ void grid_allow_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ unsigned smid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Peer events (tensor-parallel builds) are counted up by another GPU over NVLink: the waiter's acquire
// and the signaller's release are then at system scope, so the peer's stores before its signal are seen.
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ long long ld_relaxed(const long long* p) {
  long long v;
  asm volatile("ld.relaxed.gpu.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Counting an event up publishes everything the CTA wrote before the preceding __syncthreads().
__device__ __forceinline__ void signal_event(unsigned* events, int ev) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(events + ev) : "memory");
}

// (the diagnostic bits are described with wait_event, below)
#ifndef MEGART_DIAG_NO_WAIT
#define MEGART_DIAG_NO_WAIT 0
#endif

// MEGART_LEAN_SYNC (default 1): an instance's signals share one release fence, then relaxed adds (each
// red.release fences again, and a fence waits for the adds before it to be acknowledged, so an instance's
// second signal left a memory round trip after its first). 0 keeps one red.release per signal.
#ifndef MEGART_LEAN_SYNC
#define MEGART_LEAN_SYNC 1
#endif
constexpr bool kLeanSync = MEGART_LEAN_SYNC != 0;
template <bool kSys>
__device__ __forceinline__ void fence_release() {
  if constexpr ((MEGART_DIAG_NO_WAIT & 64) != 0) return;  // bit 6 (timing only, unordered signals)
  if constexpr (kSys) asm volatile("fence.acq_rel.sys;" ::: "memory");
  else asm volatile("fence.acq_rel.gpu;" ::: "memory");
}
// After fence_release (the fence makes the add a release).
__device__ __forceinline__ void signal_event_relaxed(unsigned* events, int ev) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(events + ev) : "memory");
}

#ifdef MEGART_TP
// A peer signal word (megart/layout.py) counts event e up on rank q; ctrl[kCtrlWords + q] is the address,
// mapped on this GPU, of rank q's counters.
__device__ __forceinline__ unsigned* peer_counter(const long long* ctrl, int word) {
  const unsigned v = (unsigned)(-1 - word);
  unsigned* base = reinterpret_cast<unsigned*>(ctrl[kCtrlWords + (v >> kPeerRankShift)]);
  return base + (v & ((1u << kPeerRankShift) - 1));
}
__device__ __forceinline__ void signal_peer(const long long* ctrl, int word) {
  asm volatile("red.release.sys.global.add.u32 [%0], 1;" ::"l"(peer_counter(ctrl, word)) : "memory");
}
// The same after fence_release<true>().
__device__ __forceinline__ void signal_peer_relaxed(const long long* ctrl, int word) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(peer_counter(ctrl, word)) : "memory");
}
#endif

// The CTA's compute threads (MEGART_THREADS) synchronise here. With the weight stream a producer warp
// runs beside them and never joins: barrier 1 counts the compute threads only, and codegen maps
// __syncthreads() onto this in such kernels, so task bodies need not know. Bodies size their loops by
// MEGART_THREADS, never blockDim.x (which counts the producer warp).
__device__ __forceinline__ void cta_sync() {
#if defined(MEGART_STREAM_SLOTS) && MEGART_STREAM_SLOTS > 0
  asm volatile("bar.sync 1, %0;" ::"n"(MEGART_THREADS) : "memory");
#else
  __syncthreads();
#endif
}

struct WaitSite {
  int worker, queue_pos, type, instance;
};

// The first watchdog to fire records who waited on what; every other spinner sees `abort` and leaves.
__device__ __noinline__ void raise_hang(long long* ctrl, const WaitSite& s, int ev, unsigned have, unsigned need) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(ctrl + kCtrl_abort), 0ull, 1ull) == 0ull) {
    ctrl[kCtrl_hang_worker] = s.worker;
    ctrl[kCtrl_hang_queue_pos] = s.queue_pos;
    ctrl[kCtrl_hang_type] = s.type;
    ctrl[kCtrl_hang_instance] = s.instance;
    ctrl[kCtrl_hang_event] = ev;
    ctrl[kCtrl_hang_have] = have;
    ctrl[kCtrl_hang_need] = need;
    ctrl[kCtrl_abort_time] = (long long)globaltimer();
    __threadfence();
  }
}

// The check every bounded spin makes each so many tries (event waits, tagged polls, ring stages): false (leave)
// once any watchdog fired (ctrl's abort word) or, past watchdog_ns since `start`, after `hang()` recorded this one.
template <class Hang>
__device__ __forceinline__ bool spin_on(long long* ctrl, unsigned long long start, const long long& watchdog_ns,
                                        const Hang& hang) {
  if (ld_relaxed(ctrl + kCtrl_abort) != 0) return false;
  if ((long long)(globaltimer() - start) > watchdog_ns) {
    hang();
    return false;
  }
  return true;
}

// MEGART_DIAG_NO_WAIT (a measurement aid, never a default): bit 0 makes every event wait pass at once, bit 1
// every tagged poll. The step then computes garbage, but streams the same bytes through the same instances,
// so its time is what the partition and the bodies cost without the dependency chain. Bit 2 keeps the chain
// and drops attention's K/V reads instead (tasks/attention_decode.cuh). Bit 3 keeps chain and stream and
// drops the streamed dots' arithmetic (tasks/dense_engines.cuh): what a consumer faster than HBM would give.
// Bit 4 drops the warp sums after each row pair of the shared-memory engines (the epilogues' shuffles).
// Bit 5 makes attention's arrival count relaxed (tasks/attention_common.cuh), bit 6 drops the release fence
// before an instance's signals (fence_release): what those two memory orderings cost the chain.

// Spin until events[ev] reaches `need` (counters only grow; compared modulo 2^32). Returns false if
// the watchdog fired here or anywhere else. The timer is read only on the slow path. kSys: a peer event.
template <bool kSys = false>
__device__ __forceinline__ bool wait_event(unsigned* events, int ev, unsigned need, long long* ctrl,
                                           long long watchdog_ns, const WaitSite& site) {
  if constexpr ((MEGART_DIAG_NO_WAIT & 1) != 0) return true;  // a timing diagnostic only: wrong results
  const unsigned* p = events + ev;
  unsigned have = kSys ? ld_acquire_sys(p) : ld_acquire(p);
  if ((int)(have - need) >= 0) return true;
  const unsigned long long start = globaltimer();
  for (unsigned iter = 1;; ++iter) {
    have = kSys ? ld_acquire_sys(p) : ld_acquire(p);
    if ((int)(have - need) >= 0) return true;
    if ((iter & 31) == 0) {
      if (!spin_on(ctrl, start, watchdog_ns, [&]() { raise_hang(ctrl, site, ev, have, need); })) return false;
      if (iter > 4096) __nanosleep(128);  // long waits back off so spinners do not crowd the L2 slice
    }
  }
}

}  // namespace megart
