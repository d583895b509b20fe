// CUDA face of the tensor-core tile helpers (moe_gemm), the same names as mma_metal.h.
// kernels.header() appends this file only to the kernels that call lily_mma: MLX hashes each launch's source.
#ifndef LILY_MMA_CUDA_H
#define LILY_MMA_CUDA_H

// Two floats rounded to a 16-bit T, packed low then high (a staged operand tile's pair).
template <typename T> LILY_INLINE uint32_t lily_pack2(float lo, float hi);
template <> LILY_INLINE uint32_t lily_pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> LILY_INLINE uint32_t lily_pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Tensor-core tiles (moe_gemm): one warp's mma.sync m16n8k16 with float32 accumulators. A comes from an [m][k]
// tile, B from an [n][k] tile, both 16-bit T in shared memory with ld values per row; the fragments' lane
// layouts are the PTX ISA's (lane = 4 * group + t: A and C rows group and group + 8, k/n pairs from 2 * t).
#define LILY_MMA_M 16
#define LILY_MMA_N 8
#define LILY_MMA_K 16
#define LILY_MMA_C_PAIRS 2  // accumulator pairs per lane: rows group and group + 8
template <typename T> struct lily_mma_a { uint32_t r[4]; };
template <typename T> struct lily_mma_b { uint32_t r[2]; };
struct lily_mma_c { float r[4]; };
LILY_INLINE void lily_mma_zero(lily_mma_c& c) { c.r[0] = c.r[1] = c.r[2] = c.r[3] = 0.0f; }
LILY_INLINE float lily_mma_get(const lily_mma_c& c, int i) { return c.r[i]; }
LILY_INLINE int lily_mma_c_row(int lane, int pair) { return (lane >> 2) + 8 * pair; }
LILY_INLINE int lily_mma_c_col(int lane, int) { return 2 * (lane & 3); }
template <typename T> LILY_INLINE uint32_t lily_smem_pair(const T* s) { return *reinterpret_cast<const uint32_t*>(s); }
template <typename T> LILY_INLINE void lily_mma_load_a(lily_mma_a<T>& a, const T* s, int ld, int lane) {
  const T* p = s + (lane >> 2) * ld + 2 * (lane & 3);
  a.r[0] = lily_smem_pair(p);
  a.r[1] = lily_smem_pair(p + 8 * ld);
  a.r[2] = lily_smem_pair(p + 8);
  a.r[3] = lily_smem_pair(p + 8 * ld + 8);
}
template <typename T> LILY_INLINE void lily_mma_load_b(lily_mma_b<T>& b, const T* s, int ld, int lane) {
  const T* p = s + (lane >> 2) * ld + 2 * (lane & 3);
  b.r[0] = lily_smem_pair(p);
  b.r[1] = lily_smem_pair(p + 8);
}
LILY_INLINE void lily_mma(lily_mma_c& c, const lily_mma_a<__nv_bfloat16>& a, const lily_mma_b<__nv_bfloat16>& b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
LILY_INLINE void lily_mma(lily_mma_c& c, const lily_mma_a<__half>& a, const lily_mma_b<__half>& b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}

#endif
