// Span recorder: one record per executed task instance, 64-bit %globaltimer ns, written by thread 0
// after the body's block barrier. Compiled only when MEGART_PROFILE is defined.
#pragma once
namespace megart {

struct SpanSink {
  long long* out;  // this worker's first record for this step, or nullptr when the step is not recorded
};

// The buffer holds span_cap steps of `total` records each, starting at step span_base. A step past the
// buffer is counted in span_overflow instead of written.
__device__ __forceinline__ SpanSink span_sink(long long* spans, long long* ctrl, long long gen, int total, int q0,
                                              int q1) {
  SpanSink s{nullptr};
  if (spans == nullptr) return s;
  const long long base = ctrl[kCtrl_span_base], cap = ctrl[kCtrl_span_cap];
  const long long slot = gen - base;
  if (slot >= 0 && slot < cap) {
    s.out = spans + ((slot * total) + q0) * kSpanWords;
  } else if (cap > 0 && slot >= cap && threadIdx.x == 0 && q1 > q0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(ctrl + kCtrl_span_overflow), (unsigned long long)(q1 - q0));
  }
  return s;
}

__device__ __forceinline__ void span_record(const SpanSink& s, int k, int type, int instance, int worker,
                                            unsigned long long t_wait, unsigned long long t_begin,
                                            unsigned long long t_end, long long gen) {
  if (s.out == nullptr) return;
  long long* r = s.out + (long long)k * kSpanWords;
  r[kSpan_type_id] = type;
  r[kSpan_instance] = instance;
  r[kSpan_worker] = worker;
  r[kSpan_smid] = smid();
  r[kSpan_wait_start] = (long long)t_wait;
  r[kSpan_body_begin] = (long long)t_begin;
  r[kSpan_body_end] = (long long)t_end;
  r[kSpan_step] = gen;
#ifdef MEGART_PROFILE
  r[kSpan_mark0] = (long long)s_span_mark[0];  // (thread 0's own stamps, before the body's last barrier)
  r[kSpan_mark1] = (long long)s_span_mark[1];
#endif
}

}  // namespace megart
