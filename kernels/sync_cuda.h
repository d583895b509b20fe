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

#endif
