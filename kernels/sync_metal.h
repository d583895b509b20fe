// Metal face of sync_cuda.h: the same lily_sync_* with Metal's relaxed device atomics and device-scope fences (as
// MLX's own fence kernels use; Metal 3.2), kept out of the prelude so that no other kernel needs them. The counters
// must be over 8 elements: MLX puts smaller inputs in the read-only constant address space.
#ifndef LILY_SYNC_METAL_H
#define LILY_SYNC_METAL_H

#define LILY_SYNC_PTR(p) ((device atomic_int*)(p))
#define LILY_DEVICE_BARRIER() threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup)
LILY_INLINE void lily_device_fence() {
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
}
LILY_INLINE int lily_sync_ticket(const device int* sync) {
  return atomic_fetch_add_explicit(LILY_SYNC_PTR(sync), 1, memory_order_relaxed);
}
LILY_INLINE int lily_sync_arrive(const device int* sync, int slot) {
  lily_device_fence();
  return atomic_fetch_add_explicit(LILY_SYNC_PTR(sync) + slot, 1, memory_order_relaxed);
}
LILY_INLINE void lily_sync_wait(const device int* sync, int slot, int count) {
  while (atomic_load_explicit(LILY_SYNC_PTR(sync) + slot, memory_order_relaxed) < count) {
  }
  lily_device_fence();
}
LILY_INLINE void lily_sync_reset(const device int* sync, int slots) {
  for (int i = 0; i < slots; ++i) atomic_store_explicit(LILY_SYNC_PTR(sync) + i, 0, memory_order_relaxed);
}

// sync_cuda.h's trace hooks: Metal has no global timer to read, so nothing is recorded.
#define LILY_TRACE_DECL
#define LILY_TRACE_BEGIN() ((void)0)
#define LILY_TRACE_TICKETED() ((void)0)
#define LILY_TRACE_WAITED() ((void)0)
#define LILY_TRACE_MARK() ((void)0)
#define LILY_TRACE_END(vb, phase) ((void)0)

#endif
