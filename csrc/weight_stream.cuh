// The weight stream: each compute warp's weight stages flow through a shared-memory ring that lives for
// the whole launch and runs ahead across instance boundaries, fed by a producer warp.
//
// Weights are read-only for the launch, so loading them never waits for an event. Every compute warp w
// owns kStreamSlots slots of kStreamSlotBytes, each with a "full" mbarrier (the bulk copies land) and an
// "empty" one (warp w has read it). The warp's *stream* is the concatenation, in queue order, of its
// stages in every instance of a streamed task type (declared stream=True; the other entries contribute
// nothing and are stepped over). Extra warps beside the MEGART_THREADS compute threads are the
// producer: one lane per compute warp w walks the worker's queue ahead for warp w, waits for a free slot and issues the
// next stage, which may belong to an instance several entries ahead (during an attention call the slots
// already hold o_proj's first weights). Descriptor reads and copy issue are off the compute warps'
// path: they wait only for bytes to land. The ring is never re-initialised between instances; the bytes
// issued but not yet read are capped by the ring itself, those issued but not yet landed by a smaller cap
// (MEGART_STREAM_INFLIGHT_STAGES per warp). The producer never joins the compute threads'
// barriers (task bodies synchronise with cta_sync(), barrier 1); all threads meet at barrier 0 once at
// launch start and once at the end.
//
// What a stage is belongs to the stream format: the dense matvec stage of tasks/dense_engines.cuh (one
// row pair x up to 256 16-byte chunks), or attention's block of K/V rows (tasks/attention_decode.cuh). The
// generated megart_stream_open() switch asks the task type of queue entry q where warp w's stages are,
// once, and sets the format that issues them from then on (the generated stream_format_next() switch).
// Python (megart/stream.py) sizes the ring and passes its layout in MEGART_STREAM_SLOTS / _OFFSET /
// _SLOT_BYTES; these headers only static_assert it.
#pragma once
namespace megart {

// ---- mbarrier and bulk-copy primitives (the host simulation copies at once and never waits) ----------
#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
template <unsigned kArrivals = 1>
__device__ __forceinline__ void mbar_init(unsigned long long* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "n"(kArrivals) : "memory");
}
__device__ __forceinline__ void mbar_inval(unsigned long long* b) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
// Every thread of the CTA, the producer warp included (task bodies use cta_sync(): compute threads only).
__device__ __forceinline__ void cta_sync_all() { asm volatile("bar.sync 0;" ::: "memory"); }
__device__ __forceinline__ bool mbar_test(unsigned long long* b, unsigned parity) {
  unsigned done;
  asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
               : "=r"(done) : "r"(smem_addr(b)), "r"(parity) : "memory");
  return done != 0;
}
// Non-blocking: try_wait above may suspend the thread until the phase completes or a time limit passes,
// which in the producer's converged rounds holds every lane up behind one slot that is still being read.
__device__ __forceinline__ bool mbar_poll(unsigned long long* b, unsigned parity) {
  unsigned done;
  asm volatile("{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
               : "=r"(done) : "r"(smem_addr(b)), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  while (!mbar_test(b, parity)) {
  }
}
// A wait on arrivals of the CTA's own threads (not a copy's bytes): the same wait on the device.
__device__ __forceinline__ void mbar_wait_cta(unsigned long long* b, unsigned parity) { mbar_wait(b, parity); }
// The slot was last read through the generic proxy; order those reads before the async-proxy write.
__device__ __forceinline__ void bulk_load(const void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  asm volatile("fence.proxy.async.shared::cta;\n\t"
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)) : "memory");
}
// Same, with an L2 policy (streamed weights are read once: evict-first).
__device__ __forceinline__ void bulk_load_hint(const void* dst, const void* src, unsigned bytes, unsigned long long* b,
                                               unsigned long long policy) {
  asm volatile("fence.proxy.async.shared::cta;\n\t"
               "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)), "l"(policy) : "memory");
}
#else
// Host simulation: a copy lands at once, so the low 32 bits of *b count the barrier's completed phases
// (bits 32-47: this phase's arrivals so far, 48-63: the arrivals a phase expects); a wait on a phase that
// has not completed would block forever on the device, and is reported (megart_host_fault).
template <unsigned kArrivals = 1>
inline void mbar_init(unsigned long long* b) {
  if (reinterpret_cast<uintptr_t>(b) % 8) megart_host_fault("mbarrier not 8-byte aligned");
  *b = (unsigned long long)kArrivals << 48;
}
inline void mbar_inval(unsigned long long* b) { *b = ~0ull; }
inline void mbar_init_fence() {}
inline void mbar_expect(unsigned long long* b, unsigned) {
  if (*b == ~0ull) megart_host_fault("arrive on an invalidated mbarrier");
  const unsigned long long expected = *b >> 48, arrived = ((*b >> 32) & 0xffffull) + 1, phases = *b & 0xffffffffull;
  *b = arrived == expected ? (expected << 48) | ((phases + 1) & 0xffffffffull)
                           : (expected << 48) | (arrived << 32) | phases;
}
inline void mbar_arrive(unsigned long long* b) { mbar_expect(b, 0); }
inline void cta_sync_all() { __syncthreads(); }  // (the host simulation runs the compute threads only)
inline bool mbar_test(unsigned long long* b, unsigned parity) {
  if (*b == ~0ull) megart_host_fault("wait on an invalidated mbarrier");
  return (*b & 1) != (parity & 1);
}
inline bool mbar_poll(unsigned long long* b, unsigned parity) { return mbar_test(b, parity); }
inline void mbar_wait(unsigned long long* b, unsigned parity) {
  if (!mbar_test(b, parity)) megart_host_fault("mbarrier wait on a phase that never completes");
}
// The CTA's own threads complete it: the fiber lets them run until they have (a phase they never complete
// leaves every fiber waiting, which the simulation reports as stuck).
inline void mbar_wait_cta(unsigned long long* b, unsigned parity) {
  while (!mbar_test(b, parity) && !megart_hs_fault) hostsim::yield();
  ++hostsim::progress;
}
inline void bulk_load(const void* dst, const void* src, unsigned bytes, unsigned long long*) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16 || bytes % 16 || !bytes)
    megart_host_fault("bulk copy address or size not a 16-byte multiple");
  std::memcpy(const_cast<void*>(dst), src, bytes);
}
inline void bulk_load_hint(const void* dst, const void* src, unsigned bytes, unsigned long long* b, unsigned long long) {
  bulk_load(dst, src, bytes, b);
}
#endif

// StreamOn<params struct>::value: this type's body reads its weights from the stream. Codegen specialises
// it for each streamed type of a kernel with a ring; a type overridden by a candidate body is not streamed.
template <class P>
struct StreamOn {
  static constexpr bool value = false;
};

#ifndef MEGART_STREAM_SLOTS
#define MEGART_STREAM_SLOTS 0
#endif
constexpr int kStreamSlots = MEGART_STREAM_SLOTS;
constexpr int kStreamWarps = MEGART_THREADS / 32;

// Producer state of compute warp w (kept by producer lane w) and the warp's read count (kept by warp w).
struct WarpStream {
  int q;          // queue entry (global descriptor index) whose stages are being issued
  short fresh;    // 1: `cursor` not yet set up for entry q
  short format;   // the open entry's stream format (codegen numbers them: STREAM_FORMATS)
  unsigned issued;    // stages issued since the launch began (slot = n % kStreamSlots)
  unsigned consumed;  // stages warp w has read (written by the warp; read at the end)
  unsigned long long cursor[9];  // the stream format's state for entry q (opaque here): where the
                                 // warp is in it and what its rows are, so no stage re-reads descriptors
#if defined(MEGART_STREAM_KV) && MEGART_STREAM_KV != 0
  const int* pos_at;  // attention's K/V: the pos tensor this lane read this step (null: none yet), and its value
  int pos;            // (megart/stream.py's static_reserve counts these 16 bytes per warp)
#endif
};

#if MEGART_STREAM_SLOTS > 0
#if !defined(MEGART_STREAM_OFFSET) || !defined(MEGART_STREAM_SLOT_BYTES) || !defined(MEGART_STREAM_HANG_FREE) || \
    !defined(MEGART_STREAM_INFLIGHT_STAGES)
#error "MEGART_STREAM_SLOTS needs the ring layout from megart/stream.py"
#endif
static_assert(MEGART_STREAM_OFFSET % 128 == 0, "the stream ring starts 128-byte aligned");
static_assert(kStreamWarps <= 32, "one producer lane per compute warp");
constexpr int kStreamOffset = MEGART_STREAM_OFFSET, kStreamSlotBytes = MEGART_STREAM_SLOT_BYTES;
// Who produces: a producer warp beside the compute warps (MEGART_STREAM_PRODUCER=1, the default), or
// lane 0 of each compute warp, inline, each time the warp frees a slot (0; always so in the host
// simulation, which runs the compute threads only).
#if !defined(__CUDA_ARCH__)
constexpr bool kProducerWarp = false;
#elif defined(MEGART_STREAM_PRODUCER)
constexpr bool kProducerWarp = MEGART_STREAM_PRODUCER != 0;
#else
constexpr bool kProducerWarp = true;
#endif
// Hang records name the ring: event -1 - slot for a stage that never landed, kHangSlotFree - slot for a
// slot the producer waited on and that was never read.
constexpr int kHangSlotFree = MEGART_STREAM_HANG_FREE;  // (megart/stream.py decodes it)

// Launch-wide state, one per CTA (static shared memory): where the queue is, what the watchdog needs,
// each warp's producer state and its slots' mbarriers.
struct StreamShared {
  unsigned long long full[kStreamWarps * kStreamSlots];
  unsigned long long empty[kStreamWarps * kStreamSlots];
  const TaskDesc* descs;
  char* smem;  // the dynamic shared memory (the slots start at kStreamOffset)
  int q1;  // end of this worker's queue
  int worker, queue_pos, type, instance;  // the instance running now (for a hang record)
  long long* ctrl;
  long long watchdog_ns;
#if defined(MEGART_STREAM_KV) && MEGART_STREAM_KV != 0
  long long gen;  // this launch's step (the worker loop's generation; 0 in the host simulation)
#endif
  WarpStream warp[kStreamWarps];
};
__shared__ StreamShared s_stream;
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
// MEGART_STREAM_WAITS (lane 0 of each compute warp): when the warp first asked for a stage in this instance
// (0: not yet), and when it got the stage it is reading.
constexpr int kStampWarps = kStreamTimes ? kStreamWarps : 1;  // (megart/stream.py reserves them)
__shared__ unsigned long long s_sw_first[kStampWarps], s_sw_got[kStampWarps];
#endif
// Thread 0 at an instance's body begin / after its closing barrier (MEGART_STREAM_WAITS builds): clear the
// warps' first requests; add to mark word 1 the time from the body's begin to each warp's first request.
__device__ __forceinline__ void stream_waits_begin() {
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
  if constexpr (kStreamTimes)
    for (int w = 0; w < kStreamWarps; ++w) s_sw_first[w] = 0;
#endif
}
__device__ __forceinline__ void stream_waits_finish(unsigned long long body_begin) {
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
  if constexpr (kStreamTimes)
    for (int w = 0; w < kStreamWarps; ++w)
      if (s_sw_first[w]) s_span_mark[1] += s_sw_first[w] - body_begin;
#else
  (void)body_begin;
#endif
}

// Generated after the task bodies (codegen): sets ws.cursor and ws.format up for entry d from its type's
// plan. Returns kOpenStages, kOpenNone (no stages for compute warp `warp`, or its type has no stream) or
// kOpenLater (where the stages are is not known yet: attention's chunk needs this step's pos).
enum : int { kOpenLater = -1, kOpenNone = 0, kOpenStages = 1 };
__device__ int megart_stream_open(const TaskDesc& d, WarpStream& ws, int warp);
// Generated too, one case per format: issue the next stage of the open entry into `slot`; false when the
// entry has no more stages for the warp.
__device__ bool stream_format_next(WarpStream& ws, int warp, int slot);

__device__ __forceinline__ unsigned long long* stream_full(int warp, int slot) {
  return &s_stream.full[warp * kStreamSlots + slot];
}
__device__ __forceinline__ unsigned long long* stream_empty(int warp, int slot) {
  return &s_stream.empty[warp * kStreamSlots + slot];
}
#ifdef __CUDA_ARCH__
// The kernel's dynamic shared memory (declared again in the kernel: every extern __shared__ array starts
// there). Slots addressed from it are known to be shared memory, so their reads compile to LDS; through
// the pointer kept in s_stream they were generic loads (LD), which wait on the long scoreboard.
extern __shared__ __align__(MEGART_SMEM_ALIGN) char megart_smem[];
__device__ __forceinline__ char* stream_slot(int warp, int slot) {
  return megart_smem + kStreamOffset + (size_t)(warp * kStreamSlots + slot) * kStreamSlotBytes;
}
#else
inline char* stream_slot(int warp, int slot) {
  return s_stream.smem + kStreamOffset + (size_t)(warp * kStreamSlots + slot) * kStreamSlotBytes;
}
#endif

// Compute warp: spin until phase `parity` of barrier b completes. Bounded: leaves (false) once any watchdog
// fired, and past the watchdog records a hang (event `ev`, have = the warp's stage number, need = the warp).
__device__ __forceinline__ bool stream_wait(unsigned long long* b, unsigned parity, int ev, int warp, unsigned stage) {
  if (mbar_test(b, parity)) return true;
#ifdef __CUDA_ARCH__
  const unsigned long long start = globaltimer();
  for (unsigned iter = 1;; ++iter) {
    if (mbar_test(b, parity)) return true;
    if ((iter & 63) == 0 && !spin_on(s_stream.ctrl, start, s_stream.watchdog_ns, [&]() {
          if ((threadIdx.x & 31) == 0)
            raise_hang(s_stream.ctrl, WaitSite{s_stream.worker, s_stream.queue_pos, s_stream.type, s_stream.instance},
                       ev, stage, (unsigned)warp);
        }))
      return false;
  }
#else
  (void)ev; (void)warp; (void)stage;
  megart_host_fault("weight stream: a wait on a phase that never completes (consumers and producer disagree)");
  return false;
#endif
}

// How a warp tells the producer a slot is free: every lane arrives on the slot's "empty" mbarrier, which
// expects 32 arrivals (MEGART_STREAM_FREE=2, the default: each lane's own reads of the stage are released by
// its own arrive, the PTX memory model's plain form; measured no slower than one arrive), lane 0 arrives
// after __syncwarp() (0: its arrive releases the others' reads through the __syncwarp), or (1) a release
// store of the warp's read count that the producer acquires. Inline production needs none on the device
// (the warp itself issues); the host simulation keeps the barrier to check the phases.
#ifndef MEGART_STREAM_FREE
#define MEGART_STREAM_FREE 2
#endif
constexpr bool kFreeAllLanes = MEGART_STREAM_FREE == 2;
#if !defined(__CUDA_ARCH__)
constexpr bool kFreeByBarrier = true;
#elif MEGART_STREAM_FREE == 1
constexpr bool kFreeByBarrier = false;
#else
constexpr bool kFreeByBarrier = kProducerWarp;
#endif
constexpr unsigned kEmptyArrivals = kFreeAllLanes && kFreeByBarrier ? 32u : 1u;
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void st_release_shared(unsigned* p, unsigned v) {
  asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(smem_addr(p)), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_shared(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
  return v;
}
#else
inline void st_release_shared(unsigned* p, unsigned v) { *p = v; }
inline unsigned ld_acquire_shared(const unsigned* p) { return *p; }
#endif
// Producer: is warp w's next slot free (its previous stage, `kStreamSlots` back, read)? A poll that never
// suspends (MEGART_STREAM_POLL=0 uses the suspending try_wait instead, for comparison).
#if defined(MEGART_STREAM_POLL) && MEGART_STREAM_POLL == 0
constexpr bool kProducerPolls = false;
#else
constexpr bool kProducerPolls = true;
#endif
__device__ __forceinline__ bool stream_slot_free(const WarpStream& ws, int w) {
  const unsigned use = ws.issued / kStreamSlots;
  unsigned long long* empty = stream_empty(w, (int)(ws.issued % kStreamSlots));
  if (kFreeByBarrier) return kProducerPolls ? mbar_poll(empty, (use - 1) & 1u) : mbar_test(empty, (use - 1) & 1u);
  return ld_acquire_shared(&ws.consumed) + kStreamSlots > ws.issued;
}

// Producer: may warp w issue another stage under the in-flight cap? N = MEGART_STREAM_INFLIGHT_STAGES > 0 (below
// the slot count; megart/stream.py sets it) lets at most N of the warp's stages be issued and not yet landed;
// landed stages still fill the ring. Bytes in flight set how long every other load of the SM (attention's
// K/V, a body's input) queues behind the stream: the queue drains at the SM's share of HBM. Landed bytes are
// what hide a wait. 0: the ring alone caps.
__device__ __forceinline__ bool stream_inflight_ok(const WarpStream& ws, int w) {
  constexpr unsigned cap = MEGART_STREAM_INFLIGHT_STAGES;
  if constexpr (cap == 0 || cap >= (unsigned)kStreamSlots) {
    return true;
  } else {
    if (ws.issued < cap) return true;
    const unsigned j = ws.issued - cap;  // its slot is not reused before stage j + kStreamSlots > issued
    return mbar_test(stream_full(w, (int)(j % kStreamSlots)), (j / kStreamSlots) & 1u);
  }
}

// One producer step for warp w: issue its next stage into the next slot, or step over an entry with no
// (more) stages for it. The caller has made sure the slot is free. Returns kStepMoved, kStepLater (the
// entry cannot open yet: try again) or kStepEnd (the end of the queue).
enum : int { kStepEnd = 0, kStepMoved = 1, kStepLater = 2 };
__device__ __forceinline__ int stream_step(WarpStream& ws, int warp) {
  if (ws.q >= s_stream.q1) return kStepEnd;
  if (ws.fresh) {  // the only descriptor read: once per (warp, entry), and again while it opens later
    const int open = megart_stream_open(s_stream.descs[ws.q], ws, warp);
    if (open == kOpenLater) return kStepLater;
    if (open == kOpenNone) {
      ++ws.q;
      return kStepMoved;
    }
    ws.fresh = 0;
  }
  if (stream_format_next(ws, warp, (int)(ws.issued % kStreamSlots))) {
    ++ws.issued;
  } else {
    ++ws.q;
    ws.fresh = 1;
  }
  return kStepMoved;
}

// Inline production (no producer warp): lane 0 of warp w runs the producer's steps as far ahead as the
// ring allows. A slot is reused only after its previous stage was read (the empty barrier's phase).
__device__ __forceinline__ void stream_inline_produce(WarpStream& ws, int warp) {
  while (ws.issued - ws.consumed < (unsigned)kStreamSlots && ws.q < s_stream.q1) {
#ifndef __CUDA_ARCH__
    const unsigned use = ws.issued / kStreamSlots;
    if (use > 0 && !mbar_test(stream_empty(warp, (int)(ws.issued % kStreamSlots)), (use - 1) & 1u))
      megart_host_fault("weight stream: the producer reuses a slot whose stage was never read");
#endif
    if (stream_step(ws, warp) == kStepLater) return;  // (the warp's next release or acquire tries again)
  }
}

// Launch start, every thread of the CTA (barrier 0, which the producer warp joins too): producer lane w
// initialises warp w's barriers and producer state. (Host simulation: lane 0 of warp w plays producer
// lane w, and fills the ring at once.)
__device__ __forceinline__ void stream_begin(const TaskDesc* descs, int q0, int q1, int worker, long long* ctrl,
                                             long long watchdog_ns, char* smem) {
  if (threadIdx.x == 0) {
    s_stream.descs = descs;
    s_stream.smem = smem;
    s_stream.q1 = q1;
    s_stream.worker = worker;
    s_stream.ctrl = ctrl;
    s_stream.watchdog_ns = watchdog_ns;
#if defined(MEGART_STREAM_KV) && MEGART_STREAM_KV != 0
#ifdef __CUDA_ARCH__
    grid_dependency_wait();  // (an overlapped launch: the previous step has published its count)
    s_stream.gen = ld_relaxed(ctrl + kCtrl_step) + 1;  // (as the worker loop's generation)
#else
    s_stream.gen = 0;  // (the host simulation's step tag is s_poll's)
#endif
#endif
    s_stream.queue_pos = s_stream.type = s_stream.instance = -1;
  }
  cta_sync_all();
  const int lane = threadIdx.x & 31;
  const bool producer =
      kProducerWarp ? threadIdx.x >= MEGART_THREADS && threadIdx.x < MEGART_THREADS + kStreamWarps : lane == 0;
  const int w = kProducerWarp ? lane : (int)(threadIdx.x >> 5);
  if (producer) {
    for (int s = 0; s < kStreamSlots; ++s) {
      mbar_init(stream_full(w, s));
      mbar_init<kEmptyArrivals>(stream_empty(w, s));
    }
    mbar_init_fence();
    WarpStream& ws = s_stream.warp[w];
    ws.q = q0;
    ws.fresh = 1;
    ws.format = 0;
#if defined(MEGART_STREAM_KV) && MEGART_STREAM_KV != 0
    ws.pos_at = nullptr;
#endif
    ws.issued = ws.consumed = 0;
    if (!kProducerWarp) stream_inline_produce(ws, w);
  }
  cta_sync_all();
}

// A producer warp's whole launch: each lane streams one compute warp's stages (producer_lane_warp). The
// lanes stay converged: each round, every lane whose next slot is free (warp w has read the slot's previous stage:
// the empty barrier's phase) issues into it, and a round in which no lane could issue backs off briefly.
// (Lanes spinning apart on their own barriers would be scheduled one path at a time.) Leaves at the end of
// the queue, or once any watchdog fired; a slot that stays taken for twice the watchdog is recorded as a
// hang, so a consumer's own wait (which names the event it is stuck on) is reported first.
#ifndef MEGART_PRODUCER_THREADS
#define MEGART_PRODUCER_THREADS 32
#endif
// Producer warps that issue: every warp of the producer's threads, or MEGART_STREAM_PRODUCER_WARPS of them
// (1 for comparison; megart/stream.py checks the value). Producer warp p serves compute warps p,
// p + kProducerWarps, ... (lane l: warp p + kProducerWarps * l), so each issues a share of the copies.
#ifdef MEGART_STREAM_PRODUCER_WARPS
constexpr int kProducerWarps = MEGART_STREAM_PRODUCER_WARPS;
#else
constexpr int kProducerWarps = MEGART_PRODUCER_THREADS / 32;
#endif
static_assert(kProducerWarps >= 1 && kProducerWarps * 32 <= MEGART_PRODUCER_THREADS, "producer warps");
__device__ __forceinline__ int producer_lane_warp() {
  return (int)((threadIdx.x - MEGART_THREADS) >> 5) + kProducerWarps * (int)(threadIdx.x & 31);
}
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void stream_produce() {
  const int w = producer_lane_warp(), lane = threadIdx.x & 31;
  WarpStream* ws = w < kStreamWarps ? &s_stream.warp[w] : nullptr;
  unsigned long long since = globaltimer();  // last time any lane of this warp issued
  for (unsigned round = 1;; ++round) {
    bool live = false, issued = false;
    if (ws && ws->q < s_stream.q1) {
      live = true;
      const unsigned use = ws->issued / kStreamSlots;
      if ((use == 0 || stream_slot_free(*ws, w)) && stream_inflight_ok(*ws, w))
        issued = stream_step(*ws, w) == kStepMoved;
    }
    if (!__any_sync(0xffffffffu, live)) return;
    if (__any_sync(0xffffffffu, issued)) {
      since = globaltimer();
      continue;
    }
    __nanosleep(64);
    if ((round & 63) == 0) {
      int stop = 0;
      if (lane == 0) {
        if (ld_relaxed(s_stream.ctrl + kCtrl_abort) != 0) {
          stop = 1;
        } else if ((long long)(globaltimer() - since) > 2 * s_stream.watchdog_ns) {
          const WarpStream& h = s_stream.warp[w < kStreamWarps ? w : 0];  // (stands for the stuck ring)
          raise_hang(s_stream.ctrl, WaitSite{s_stream.worker, s_stream.queue_pos, s_stream.type, s_stream.instance},
                     kHangSlotFree - (int)(h.issued % kStreamSlots), h.issued, (unsigned)w);
          stop = 1;
        }
      }
      if (__shfl_sync(0xffffffffu, stop, 0)) return;
    }
  }
}
#endif  // __CUDA_ARCH__

// Before the producer of warp w leaves (the launch's end, or an abort): wait until every copy it issued
// has landed, so none writes shared memory after the CTA exits. Only the last use of each slot can still
// be in flight (earlier ones were read). Bounded by the watchdog, and not cut short by an abort.
__device__ __forceinline__ void stream_drain(const WarpStream& ws, int w) {
#ifdef __CUDA_ARCH__
  const unsigned first = ws.issued > (unsigned)kStreamSlots ? ws.issued - kStreamSlots : 0u;
  const unsigned long long start = globaltimer();
  for (unsigned j = first; j != ws.issued; ++j) {
    unsigned long long* b = stream_full(w, (int)(j % kStreamSlots));
    while (!mbar_test(b, (j / kStreamSlots) & 1u) && (long long)(globaltimer() - start) <= s_stream.watchdog_ns) {
    }
  }
#else
  (void)ws; (void)w;
#endif
}

// Registers. A CTA of MEGART_THREADS + 32 threads puts 3 warps on one of the SM's four register-file
// quarters, which caps every thread at 168 registers. So where the compute threads are whole warpgroups
// the producer is a warpgroup of its own (MEGART_PRODUCER_THREADS = 128; one warp of it works), which
// gives registers back (setmaxnreg.dec) that the compute warpgroups take (setmaxnreg.inc).
__device__ __forceinline__ void stream_compute_regs() {
#if defined(MEGART_COMPUTE_REGS) && defined(__CUDA_ARCH__)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MEGART_COMPUTE_REGS));
#endif
}
__device__ __forceinline__ void stream_producer_role() {
#if defined(MEGART_PRODUCER_REGS) && defined(__CUDA_ARCH__)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MEGART_PRODUCER_REGS));
#endif
#ifdef __CUDA_ARCH__
  if (threadIdx.x < MEGART_THREADS + 32 * kProducerWarps) {
    stream_produce();
    const int w = producer_lane_warp();
    if (w < kStreamWarps) stream_drain(s_stream.warp[w], w);
  }
#endif
}

// Thread 0, before the instance's wait: who is running, for a hang record naming the ring slot.
__device__ __forceinline__ void stream_note(int queue_pos, int type, int instance) {
  s_stream.queue_pos = queue_pos;
  s_stream.type = type;
  s_stream.instance = instance;
}

// The warp's count of stages read (launch-wide) lives in its WarpStream between two matvecs and in a register
// of every lane during one (stream_read_begin / stream_read_end around the stages; j below): with a producer
// warp and every lane arriving on the "empty" barrier, nothing else reads it meanwhile, so a stage costs no
// shared-memory count and no __syncwarp. Otherwise (inline production, the host simulation, one arrive)
// stream_release keeps the shared count per stage as well.
constexpr bool kCountInRegister = kProducerWarp && kFreeByBarrier && kEmptyArrivals == 32u;
__device__ __forceinline__ unsigned stream_read_begin(int warp) {
  const unsigned j = s_stream.warp[warp].consumed;
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
  if constexpr (kStreamOccupancy) {  // (MEGART_STREAM_WAITS=2: the warp's ring as its reads begin)
    if ((threadIdx.x & 31) == 0) {
      const unsigned issued = *reinterpret_cast<volatile unsigned*>(&s_stream.warp[warp].issued);
      unsigned long long landed = 0;
      for (unsigned k = j; k != issued; ++k) landed += mbar_poll(stream_full(warp, (int)(k % kStreamSlots)), (k / kStreamSlots) & 1u);
      atomicAdd(&s_span_mark[0], landed);
      atomicAdd(&s_span_mark[1], (unsigned long long)(issued - j) + (1ull << kMarkHighShift));
    }
  }
#endif
  return j;
}
__device__ __forceinline__ void stream_read_end(int warp, unsigned j) {
  if constexpr (kCountInRegister) {
    __syncwarp();  // every lane has read the count (stream_read_begin) before lane 0 overwrites it: a warp
                   // that had no stage has nothing else ordering its lanes (racecheck warned, 32 per instance)
    if ((threadIdx.x & 31) == 0) s_stream.warp[warp].consumed = j;
    __syncwarp();
  }
}

// Compute warp side, all 32 lanes: the warp's stage j, once it has landed. After an abort the bytes may
// be stale; the body runs on and the worker leaves at its next wait.
__device__ __forceinline__ const char* stream_acquire(int warp, unsigned j) {
  const int slot = (int)(j % kStreamSlots);
  if constexpr (!kProducerWarp) {  // inline production stopped at an entry that could not open yet: retry
    if ((threadIdx.x & 31) == 0 && j >= s_stream.warp[warp].issued) stream_inline_produce(s_stream.warp[warp], warp);
    __syncwarp();
  }
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
  const unsigned long long t0 = kStreamTimes ? globaltimer() : 0ull;  // (lane 0 times the wait; stream_release the read)
#endif
  stream_wait(stream_full(warp, slot), (j / kStreamSlots) & 1u, -1 - slot, warp, j);
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
  if (kStreamTimes && (threadIdx.x & 31) == 0) {
    const unsigned long long t1 = globaltimer();
    if (s_sw_first[warp] == 0) s_sw_first[warp] = t0;
    s_sw_got[warp] = t1;
    atomicAdd(&s_span_mark[0], t1 - t0);
  }
#endif
  return stream_slot(warp, slot);
}

// The warp has read its stage j: every lane arrives on the slot's "empty" barrier (each arrive releases that
// lane's own reads), or lane 0 after __syncwarp; the shared count advances unless it is in a register (above);
// with inline production lane 0 also issues the next stages here.
__device__ __forceinline__ void stream_release(int warp, unsigned j) {
#if defined(MEGART_PROFILE) && defined(__CUDA_ARCH__)
  if constexpr (kStreamTimes) {
    if ((threadIdx.x & 31) == 0) {
      atomicAdd(&s_span_mark[0], (globaltimer() - s_sw_got[warp]) << kMarkHighShift);
      atomicAdd(&s_span_mark[1], 1ull << kMarkHighShift);  // (a stage read)
    }
  }
#endif
  if constexpr (kCountInRegister) {
    mbar_arrive(stream_empty(warp, (int)(j % kStreamSlots)));
    return;
  }
  __syncwarp();
  if (kEmptyArrivals == 32u) {
    mbar_arrive(stream_empty(warp, (int)(j % kStreamSlots)));
    __syncwarp();  // every lane has arrived before lane 0 advances the count
  }
  if ((threadIdx.x & 31) == 0) {  // (j is the shared count here: it advances per stage in these forms)
    WarpStream& ws = s_stream.warp[warp];
    if (kFreeByBarrier && kEmptyArrivals == 1u) mbar_arrive(stream_empty(warp, (int)(j % kStreamSlots)));
    // The producer learns of the free slot from the barrier; the count is then the warp's own (its lanes read
    // it after the __syncwarp below), and a release store would put a CTA fence (MEMBAR) on every stage.
    if (kFreeByBarrier)
      ws.consumed = j + 1;
    else
      st_release_shared(&ws.consumed, j + 1);
    if (!kProducerWarp) stream_inline_produce(ws, warp);
  }
  __syncwarp();
}

// Launch end (inline production only; the producer warp drains its own): lane 0 of each warp waits for
// what it issued, as stream_drain does.
__device__ __forceinline__ void stream_end() {
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) stream_drain(s_stream.warp[warp], warp);
}
#endif  // MEGART_STREAM_SLOTS > 0

}  // namespace megart
