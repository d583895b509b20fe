// CUDA face of the kernel prelude: the names every kernels/*.inc body uses (see prelude_metal.h).
// MLX's cuda_kernel puts this header before the generated __global__ function (NVRTC, sm_90a).
#ifndef LILY_PRELUDE_CUDA_H
#define LILY_PRELUDE_CUDA_H

#define LILY_CUDA 1
#define LILY_INLINE __device__ __forceinline__
#define LILY_SHARED __shared__
#define LILY_UNROLL _Pragma("unroll")
#define LILY_THREAD  // pointers to a thread's own registers/arrays (Metal's `thread`)
#define LILY_TG_PTR  // shared-memory pointers (Metal's `threadgroup` address space)
#define LILY_GLOBAL  // pointers into a kernel's inputs (Metal's `device` address space)

// Global memory as seen by a kernel body; vector loads through the read-only path.
#define LILY_LDG_U4(ptr, idx) __ldg(reinterpret_cast<const uint4*>(ptr) + (idx))
#define LILY_LDG_U2(ptr, idx) __ldg(reinterpret_cast<const uint2*>(ptr) + (idx))
// A hint that the L2 fetch the 128-byte line holding addr (no value is read; sm_80+).
#define LILY_PREFETCH_L2(addr) asm volatile("prefetch.global.L2 [%0];" ::"l"(addr))
#define LILY_U4_ZERO make_uint4(0u, 0u, 0u, 0u)
#define LILY_U4(a, b, c, d) make_uint4((a), (b), (c), (d))
#define LILY_F4(a, b, c, d) make_float4((a), (b), (c), (d))
#define LILY_AS_FLOAT(u) __uint_as_float(u)
#define LILY_AS_UINT(f) __float_as_uint(f)

// The float (mant's bits of u) | 1.0f's bits: a code at the top of the mantissa as 1 + q / 2^BITS (lily_qdot16). As
// C++ ptxas spends two LOP3s on it, its two constants not fitting one instruction; with 1.0f's bits in a register one
// does (an instruction fewer a code: 4 -> 3 with the shift and the FFMA; the chained step 3.31 -> 3.00 ms on the H100,
// 2026-12-05). LILY_CODE_LOP3=0 (an experiment define) builds the plain C++.
#ifndef LILY_CODE_LOP3
#define LILY_CODE_LOP3 1
#endif
template <uint32_t MANT>
LILY_INLINE float lily_code_float(uint32_t u) {
#if LILY_CODE_LOP3
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(u), "n"(MANT), "r"(0x3F800000u));  // (a & b) | c
  return __uint_as_float(r);
#else
  return __uint_as_float(0x3F800000u | (u & MANT));
#endif
}
#define LILY_FMA(a, b, c) __fmaf_rn((a), (b), (c))

// Block-wide barrier over shared memory; xor shuffle inside one warp of 32 lanes.
#define LILY_BARRIER() __syncthreads()
LILY_INLINE float lily_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
LILY_INLINE int lily_shfl_xor(int v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
LILY_INLINE float lily_shfl(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
LILY_INLINE uint32_t lily_shfl(uint32_t v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }

LILY_INLINE float lily_warp_sum(float v) {
  LILY_UNROLL
  for (int off = 16; off > 0; off >>= 1) v += lily_shfl_xor(v, off);
  return v;
}

// The largest v over the warp's 32 lanes, on every lane: one redux.sync from sm_80 on.
LILY_INLINE uint32_t lily_warp_max_u32(uint32_t v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
  LILY_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
#endif
}

LILY_INLINE float lily_float(float v) { return v; }
LILY_INLINE float lily_float(__half v) { return __half2float(v); }
LILY_INLINE float lily_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> LILY_INLINE T lily_cast(float v) { return static_cast<T>(v); }
template <> LILY_INLINE __half lily_cast<__half>(float v) { return __float2half_rn(v); }
template <> LILY_INLINE __nv_bfloat16 lily_cast<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// A loaded value held as it is, its load issued here: NVCC otherwise sinks a load to its first use, and moved the
// norm weight's past the staging's barrier, where it came back behind the block's weight burst (lily_load4).
LILY_INLINE void lily_pin(float& v) { asm volatile("" : "+f"(v)); }
LILY_INLINE void lily_pin(__half& v) { asm volatile("" : "+h"(*reinterpret_cast<unsigned short*>(&v))); }
LILY_INLINE void lily_pin(__nv_bfloat16& v) { asm volatile("" : "+h"(*reinterpret_cast<unsigned short*>(&v))); }

LILY_INLINE int lily_min(int a, int b) { return a < b ? a : b; }

// Float math at full precision (the DeltaNet gates and norms).
LILY_INLINE float lily_exp(float v) { return expf(v); }
LILY_INLINE float lily_log(float v) { return logf(v); }
LILY_INLINE float lily_rsqrt(float v) { return rsqrtf(v); }
LILY_INLINE float lily_exp2(float v) { return exp2f(v); }
LILY_INLINE float lily_cos(float v) { return cosf(v); }
LILY_INLINE float lily_sin(float v) { return sinf(v); }

// Shared-memory counters (moe_sort): atomicAdd on a plain int here, atomic_int on Metal.
typedef int lily_atomic_int;
LILY_INLINE int lily_atomic_add(lily_atomic_int* p, int v) { return atomicAdd(p, v); }
LILY_INLINE int lily_atomic_load(const lily_atomic_int* p) { return *p; }
LILY_INLINE void lily_atomic_store(lily_atomic_int* p, int v) { *p = v; }

// Lanes of one warp meet (shared-memory writes by one lane visible to the others).
#define LILY_WARP_SYNC() __syncwarp()

#endif
