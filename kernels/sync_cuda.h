// CUDA face of the phases of one launch ordered across its blocks (moe_chain); kernels.header adds it to a body that
// calls lily_sync_*. The counters are int32 in device memory, zero at launch: an input the kernel writes (const only
// in MLX's signature). A block's ticket is its place in the order blocks start in, so a block only ever waits on
// blocks that started before it (no co-residency assumed).
#ifndef LILY_SYNC_CUDA_H
#define LILY_SYNC_CUDA_H

// How long a waiting block's thread 0 sleeps between polls of its counter: up to ~500 blocks poll one line while
// the phase before runs. A constant an experiment may set (kernels.experiment_defines).
#ifndef LILY_SYNC_SLEEP_NS
#define LILY_SYNC_SLEEP_NS 64
#endif

// A block-wide barrier that also orders its threads' device-memory accesses (__syncthreads does on CUDA).
#define LILY_DEVICE_BARRIER() __syncthreads()
LILY_INLINE int lily_sync_ticket(const int* sync) { return atomicAdd(const_cast<int*>(sync), 1); }
// The block's writes (ordered before this by a barrier) made visible device-wide, then counted.
LILY_INLINE int lily_sync_arrive(const int* sync, int slot) {
  __threadfence();
  return atomicAdd(const_cast<int*>(sync) + slot, 1);
}
LILY_INLINE void lily_sync_wait(const int* sync, int slot, int count) {
  const volatile int* p = sync + slot;
  while (*p < count) __nanosleep(LILY_SYNC_SLEEP_NS);
  __threadfence();
}
LILY_INLINE void lily_sync_reset(const int* sync, int slots) {
  for (int i = 0; i < slots; ++i) atomicExch(const_cast<int*>(sync) + i, 0);
}

// Experiment define LILY_CHAIN_TRACE=n (bench/chain_trace.py): thread 0 of each of the first n tickets records, after
// the LILY_SYNC_SLOTS counters, its SM | phase << 16 and, by %globaltimer (ns), when it started, then how long after
// that its ticket came back, it resumed from the wait for the phase before, it passed its phase's mark (the x row
// staged, or a GEMV's weight loads issued; its resume where a phase has none) and it ended. Else the macros are
// nothing.
#define LILY_SYNC_SLOTS 16  // kernels.SYNC_SLOTS
#define LILY_TRACE_FIELDS 6  // kernels.TRACE_FIELDS
#ifdef LILY_CHAIN_TRACE
LILY_INLINE unsigned lily_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<unsigned>(t);
}
LILY_INLINE void lily_trace_record(const int* sync, int vb, int phase, unsigned t0, unsigned tk, unsigned tw,
                                   unsigned tm) {
  if (vb >= LILY_CHAIN_TRACE) return;
  const unsigned te = lily_globaltimer();
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  int* r = const_cast<int*>(sync) + LILY_SYNC_SLOTS + LILY_TRACE_FIELDS * vb;
  r[0] = static_cast<int>(sm | (static_cast<unsigned>(phase) << 16));
  r[1] = static_cast<int>(t0);
  r[2] = static_cast<int>(tk - t0);
  r[3] = static_cast<int>(tw - t0);
  r[4] = static_cast<int>((tm ? tm : tw) - t0);
  r[5] = static_cast<int>(te - t0);
}
// BEGIN, TICKETED and WAITED run in thread 0 only; MARK in every thread (thread 0's is recorded).
#define LILY_TRACE_DECL unsigned lily_trace_t0 = 0, lily_trace_tk = 0, lily_trace_tw = 0, lily_trace_tm = 0;
#define LILY_TRACE_BEGIN() (lily_trace_t0 = lily_trace_tk = lily_trace_tw = lily_globaltimer())
#define LILY_TRACE_TICKETED() (lily_trace_tk = lily_trace_tw = lily_globaltimer())
#define LILY_TRACE_WAITED() (lily_trace_tw = lily_globaltimer())
#define LILY_TRACE_MARK() (lily_trace_tm = lily_globaltimer())
#define LILY_TRACE_END(vb, phase) \
  lily_trace_record(sync, vb, phase, lily_trace_t0, lily_trace_tk, lily_trace_tw, lily_trace_tm)
#else
#define LILY_TRACE_DECL
#define LILY_TRACE_BEGIN() ((void)0)
#define LILY_TRACE_TICKETED() ((void)0)
#define LILY_TRACE_WAITED() ((void)0)
#define LILY_TRACE_MARK() ((void)0)
#define LILY_TRACE_END(vb, phase) ((void)0)
#endif

#endif
