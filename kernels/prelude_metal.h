// Metal face of the kernel prelude: the same names as prelude_cuda.h, so one body serves both.
// MLX's metal_kernel puts this header (after its own utils: metal_stdlib, bfloat16_t, float16_t)
// before the generated [[kernel]] function. simdgroup = 32 lanes on Apple GPUs, like a CUDA warp.
#ifndef LILY_PRELUDE_METAL_H
#define LILY_PRELUDE_METAL_H

#define LILY_METAL 1
#define LILY_INLINE inline
#define LILY_SHARED threadgroup
#define LILY_UNROLL _Pragma("clang loop unroll(full)")
#define LILY_THREAD thread  // pointers to a thread's own registers/arrays
#define LILY_GLOBAL device  // pointers into a kernel's inputs
#ifndef LILY_TG_PTR  // pointers into threadgroup memory; the CPU emulator (tests/metal_shim) sets its own
#define LILY_TG_PTR threadgroup
#endif

#define LILY_LDG_U4(ptr, idx) (reinterpret_cast<const device uint4*>(ptr)[(idx)])
#define LILY_LDG_U2(ptr, idx) (reinterpret_cast<const device uint2*>(ptr)[(idx)])
// Metal has no L2 prefetch hint: nothing is issued (values never depend on it).
#define LILY_PREFETCH_L2(addr) ((void)(addr))
#define LILY_U4_ZERO uint4(0u)
#define LILY_U4(a, b, c, d) uint4((a), (b), (c), (d))
#define LILY_F4(a, b, c, d) float4((a), (b), (c), (d))
#define LILY_AS_FLOAT(u) as_type<float>(u)
#define LILY_AS_UINT(f) as_type<uint32_t>(f)
// The float (MANT's bits of u) | 1.0f's bits (lily_qdot16; see prelude_cuda.h).
template <uint32_t MANT>
LILY_INLINE float lily_code_float(uint32_t u) { return as_type<float>(0x3F800000u | (u & MANT)); }
#define LILY_FMA(a, b, c) metal::fma((a), (b), (c))

#define LILY_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
LILY_INLINE float lily_shfl_xor(float v, int mask) { return simd_shuffle_xor(v, static_cast<ushort>(mask)); }
LILY_INLINE int lily_shfl_xor(int v, int mask) { return simd_shuffle_xor(v, static_cast<ushort>(mask)); }
LILY_INLINE float lily_shfl(float v, int lane) { return simd_shuffle(v, static_cast<ushort>(lane)); }
LILY_INLINE uint32_t lily_shfl(uint32_t v, int lane) { return simd_shuffle(v, static_cast<ushort>(lane)); }

LILY_INLINE float lily_warp_sum(float v) { return simd_sum(v); }
LILY_INLINE uint32_t lily_warp_max_u32(uint32_t v) { return simd_max(v); }

LILY_INLINE float lily_float(float v) { return v; }
LILY_INLINE float lily_float(half v) { return static_cast<float>(v); }
LILY_INLINE float lily_float(bfloat16_t v) { return static_cast<float>(v); }

template <typename T> LILY_INLINE T lily_cast(float v) { return static_cast<T>(v); }
template <typename V> LILY_INLINE void lily_pin(thread V&) {}  // prelude_cuda.h's: no such sinking to undo here

LILY_INLINE int lily_min(int a, int b) { return a < b ? a : b; }

// exp and rsqrt precise whatever the fast-math setting (DeltaNet gates and norms); log only sees [1, 2].
LILY_INLINE float lily_exp(float v) { return metal::precise::exp(v); }
LILY_INLINE float lily_log(float v) { return metal::log(v); }
LILY_INLINE float lily_rsqrt(float v) { return metal::precise::rsqrt(v); }
LILY_INLINE float lily_exp2(float v) { return metal::precise::exp2(v); }
LILY_INLINE float lily_cos(float v) { return metal::precise::cos(v); }
LILY_INLINE float lily_sin(float v) { return metal::precise::sin(v); }

#define LILY_WARP_SYNC() simdgroup_barrier(mem_flags::mem_threadgroup)

// Threadgroup counters (moe_sort): Metal's atomic_int, relaxed (a barrier orders them against other accesses).
typedef atomic_int lily_atomic_int;
LILY_INLINE int lily_atomic_add(LILY_TG_PTR lily_atomic_int* p, int v) {
  return atomic_fetch_add_explicit(p, v, memory_order_relaxed);
}
LILY_INLINE int lily_atomic_load(LILY_TG_PTR lily_atomic_int* p) { return atomic_load_explicit(p, memory_order_relaxed); }
LILY_INLINE void lily_atomic_store(LILY_TG_PTR lily_atomic_int* p, int v) { atomic_store_explicit(p, v, memory_order_relaxed); }

#endif
