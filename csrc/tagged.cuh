// Tagged words (megart/tagged.py): a bf16 value in the low 16 bits of a 32-bit word and the writing step's
// tag in the high 16. A writer stores whole words with relaxed gpu-scope stores (value and tag land
// together); a reader polls them with relaxed gpu-scope loads until every word carries this step's tag. The
// read needs no event wait and the write, when nothing else waits on its instance, no release fence: the
// tagged word itself is the signal. Also compiled by the host simulation (megart/emulate/hostsim.py), where
// instances run one at a time in a legal order, so a word without this step's tag is a fault there.
#pragma once
namespace megart {

// Who is polling (for the watchdog's hang record) and this step's tag, set by the worker loop.
struct PollState {
  long long* ctrl;
  long long watchdog_ns;
  int worker, queue_pos, type, instance;
  unsigned tag;  // (kTagMark | (generation & kTagMask)) << 16: the high half of every word of this step
};
__shared__ PollState s_poll;

__device__ __forceinline__ unsigned step_tag_bits(long long gen) {
  return (kTagMark | ((unsigned)gen & kTagMask)) << 16;
}

// bf16 bits -> this step's word.
__device__ __forceinline__ unsigned tag_word(unsigned bits) { return (bits & 0xffffu) | s_poll.tag; }

// Two words (lo, hi) -> their bf16 values packed as one 32-bit pair.
__device__ __forceinline__ unsigned untag2(unsigned lo, unsigned hi) { return (lo & 0xffffu) | (hi << 16); }

__device__ __forceinline__ bool tags_match(const uint4& a, const uint4& b, unsigned tag) {
  return (((a.x ^ tag) | (a.y ^ tag) | (a.z ^ tag) | (a.w ^ tag) | (b.x ^ tag) | (b.y ^ tag) | (b.z ^ tag) |
           (b.w ^ tag)) >> 16) == 0;
}

#ifdef __CUDA_ARCH__
// (No "memory" clobber on these: a tagged word orders nothing but itself, and a clobber in an epilogue made
// the compiler spill around it.)
// The hang record of a poll (event kHangPoll, have = the tag seen, need = this step's). Out of line, with one
// argument: a WaitSite built at each polling site would sit on every caller's stack.
__device__ __noinline__ void raise_poll_hang(unsigned seen_tag) {
  raise_hang(s_poll.ctrl, WaitSite{s_poll.worker, s_poll.queue_pos, s_poll.type, s_poll.instance}, kHangPoll,
             seen_tag, s_poll.tag >> 16);
}

__device__ __forceinline__ uint4 ld_relaxed_v4(const unsigned* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned ld_relaxed_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_relaxed_u32(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v));
}

// MEGART_POLL_SLEEP_NS: a pause between two reads of words not yet tagged (a tuning macro): every thread of a
// polling CTA reads, so the spin is L2 traffic on the very lines the writers are storing.
#ifndef MEGART_POLL_SLEEP_NS
#define MEGART_POLL_SLEEP_NS 0
#endif
__device__ __forceinline__ void poll_pause() {
  if constexpr (MEGART_POLL_SLEEP_NS > 0) __nanosleep(MEGART_POLL_SLEEP_NS);
}

// The slow path of a poll: spin until the 8 words at w carry this step's tag, leave once any watchdog fired,
// and past the watchdog record a hang (event kHangPoll, have = a tag seen, need = this step's tag). The
// caller reads the words again after it (by value: a reference would put them on the stack of every caller).
__device__ __forceinline__ void poll_spin8(const unsigned* w) {
  const unsigned long long start = globaltimer();
  for (unsigned iter = 1;; ++iter) {
    poll_pause();
    const uint4 a = ld_relaxed_v4(w), b = ld_relaxed_v4(w + 4);
    if (tags_match(a, b, s_poll.tag)) return;
    if ((iter & 31) == 0 && !spin_on(s_poll.ctrl, start, s_poll.watchdog_ns, [&]() {
          const unsigned w8[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
          unsigned seen = w8[0];
          for (int k = 7; k >= 0; --k)
            if ((w8[k] ^ s_poll.tag) >> 16) seen = w8[k];  // (the first word still without this step's tag)
          raise_poll_hang(seen >> 16);
        }))
      return;
  }
}
__device__ __forceinline__ unsigned poll_spin1(const unsigned* w) {
  const unsigned long long start = globaltimer();
  for (unsigned iter = 1;; ++iter) {
    poll_pause();
    const unsigned v = ld_relaxed_u32(w);
    if (((v ^ s_poll.tag) >> 16) == 0) return v;
    if ((iter & 31) == 0 && !spin_on(s_poll.ctrl, start, s_poll.watchdog_ns, [&]() { raise_poll_hang(v >> 16); }))
      return v;
  }
}
#else
inline unsigned poll_spin1(const unsigned* w) {
  megart_host_fault("a polled read found a tagged word without this step's tag (read before its writer ran, "
                    "or the writer stored a plain value)");
  return *w;
}
inline uint4 ld_relaxed_v4(const unsigned* p) { return *reinterpret_cast<const uint4*>(p); }
inline unsigned ld_relaxed_u32(const unsigned* p) { return *p; }
inline void st_relaxed_u32(unsigned* p, unsigned v) { *p = v; }
inline void poll_spin8(const unsigned*) {
  megart_host_fault("a polled read found tagged words without this step's tag (read before their writer ran, "
                    "or the writer stored plain values)");
}
#endif

// MEGART_DIAG_NO_WAIT bit 1 (a timing diagnostic, device builds only; see csrc/runtime.cuh): polls pass at once.
#if defined(__CUDA_ARCH__) && defined(MEGART_DIAG_NO_WAIT)
constexpr bool kDiagNoPoll = (MEGART_DIAG_NO_WAIT & 2) != 0;
#else
constexpr bool kDiagNoPoll = false;
#endif

// Values [i, i + 8) of tagged vector `x` (i % 8 == 0), as 8 bf16 packed in a uint4, once they carry this step's
// tag, in two halves, so that several reads can be in flight before the first is checked: issue the words' loads,
// then (after the caller has issued its others) check them, spinning only where they are not yet this step's.
struct Tagged8 {
  uint4 a, b;
};
__device__ __forceinline__ Tagged8 ld_tagged8_issue(const void* x, int i) {
  const unsigned* w = static_cast<const unsigned*>(x) + i;
  return Tagged8{ld_relaxed_v4(w), ld_relaxed_v4(w + 4)};
}
__device__ __forceinline__ uint4 ld_tagged8_finish(const void* x, int i, Tagged8 t) {
  if (!kDiagNoPoll && !tags_match(t.a, t.b, s_poll.tag)) {
    const unsigned* w = static_cast<const unsigned*>(x) + i;
    poll_spin8(w);
    t.a = ld_relaxed_v4(w);
    t.b = ld_relaxed_v4(w + 4);
  }
  return make_uint4(untag2(t.a.x, t.a.y), untag2(t.a.z, t.a.w), untag2(t.b.x, t.b.y), untag2(t.b.z, t.b.w));
}
// ... both halves at once.
__device__ __forceinline__ uint4 ld_tagged8(const void* x, int i) {
  return ld_tagged8_finish(x, i, ld_tagged8_issue(x, i));
}

// Value i of tagged vector `x` (its bf16 bits), once it carries this step's tag.
__device__ __forceinline__ unsigned ld_tagged(const void* x, int i) {
  const unsigned* w = static_cast<const unsigned*>(x) + i;
  unsigned v = ld_relaxed_u32(w);
  if (!kDiagNoPoll && ((v ^ s_poll.tag) >> 16) != 0) v = poll_spin1(w);
  return v & 0xffffu;
}

// Store bf16 value v as element i of tagged vector `y`.
__device__ __forceinline__ void st_tagged(void* y, int i, __nv_bfloat16 v) {
  st_relaxed_u32(static_cast<unsigned*>(y) + i, tag_word(*reinterpret_cast<const unsigned short*>(&v)));
}

}  // namespace megart
