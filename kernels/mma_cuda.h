// CUDA face of the tensor-core tile helpers (moe_gemm, deltanet_chunk), the same names as mma_metal.h.
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
// Accumulator element el of fragment (i, j) of a warp tile at (t0, t1): its row and column in the tile's matrix.
LILY_INLINE int lily_mma_el_row(int t0, int i, int lane, int el) { return t0 + i * LILY_MMA_M + lily_mma_c_row(lane, el / 2); }
LILY_INLINE int lily_mma_el_col(int t1, int j, int lane, int el) { return t1 + j * LILY_MMA_N + lily_mma_c_col(lane, el / 2) + el % 2; }
// ldmatrix: each group of 8 lanes names the 8 rows (16 bytes each) of one 8 x 8 matrix; matrix i lands in r[i].
LILY_INLINE uint32_t lily_smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
template <typename T> LILY_INLINE void lily_mma_load_a(lily_mma_a<T>& a, const T* s, int ld, int lane) {
  // matrices: rows 0-7 and 8-15 at k 0, then the same rows at k 8 (the a0..a3 register order)
  const uint32_t addr = lily_smem_addr(s + (lane & 15) * ld + (lane >> 4) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3]) : "r"(addr) : "memory");
}
template <typename T> LILY_INLINE void lily_mma_load_b(lily_mma_b<T>& b, const T* s, int ld, int lane) {
  // matrices: n rows 0-7 at k 0, then at k 8 (lanes 16-31 name no row for .x2)
  const uint32_t addr = lily_smem_addr(s + (lane & 7) * ld + ((lane >> 3) & 1) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(b.r[0]), "=r"(b.r[1]) : "r"(addr) : "memory");
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

// Float32 tiles (deltanet_chunk): m16n8k8 on TF32 with each operand split into a high and a low TF32 part and
// three MMAs per product (lo*hi + hi*lo + hi*hi; lo*lo is below float32's rounding), so about float32's accuracy.
// The body fills fragments itself, element i of a lane at the coordinates below (A [m][k], B [k][n]), from
// whichever memory and layout the operand lives in.
#define LILY_MMA_KF 8
#define LILY_MMA_AF 4  // A elements per lane
#define LILY_MMA_BF 2  // B elements per lane
struct lily_mma_af { uint32_t hi[4], lo[4]; };
struct lily_mma_bf { uint32_t hi[2], lo[2]; };
LILY_INLINE int lily_mma_af_row(int lane, int i) { return (lane >> 2) + 8 * (i & 1); }
LILY_INLINE int lily_mma_af_col(int lane, int i) { return (lane & 3) + 4 * (i >> 1); }
LILY_INLINE int lily_mma_bf_k(int lane, int i) { return (lane & 3) + 4 * i; }
LILY_INLINE int lily_mma_bf_n(int lane, int) { return lane >> 2; }
LILY_INLINE void lily_tf32_split(float v, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(v));
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
}
LILY_INLINE void lily_mma_set_af(lily_mma_af& a, int i, float v) { lily_tf32_split(v, a.hi[i], a.lo[i]); }
LILY_INLINE void lily_mma_set_bf(lily_mma_bf& b, int i, float v) { lily_tf32_split(v, b.hi[i], b.lo[i]); }
LILY_INLINE void lily_mma_set(lily_mma_c& c, int i, float v) { c.r[i] = v; }
LILY_INLINE void lily_mma_tf32(lily_mma_c& c, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
LILY_INLINE void lily_mma_f32(lily_mma_c& c, const lily_mma_af& a, const lily_mma_bf& b) {
  lily_mma_tf32(c, a.lo, b.hi);
  lily_mma_tf32(c, a.hi, b.lo);
  lily_mma_tf32(c, a.hi, b.hi);
}

// Attention tiles (flash_attn): A from 16-bit pairs the body reads itself (element pair i of a lane: row, first of
// two columns), P's A fragments straight from S's accumulators (two n8 accumulators make one k16 operand),
// B from a [k][n] tile by ldmatrix.trans, and a row's reduction over the 4 lanes that share it.
#define LILY_MMA_A16 4  // 16-bit pairs per lane in an A fragment
#define LILY_MMA_C_PER_A 2  // accumulator fragments per A fragment along k
LILY_INLINE int lily_mma_a16_row(int lane, int i) { return (lane >> 2) + 8 * (i & 1); }
LILY_INLINE int lily_mma_a16_col(int lane, int i) { return 2 * (lane & 3) + 8 * (i >> 1); }
template <typename T> LILY_INLINE void lily_mma_set_a16(lily_mma_a<T>& a, int i, float lo, float hi) { a.r[i] = lily_pack2<T>(lo, hi); }
template <typename T> LILY_INLINE void lily_mma_a_from_c(lily_mma_a<T>& a, const lily_mma_c* c) {
  a.r[0] = lily_pack2<T>(c[0].r[0], c[0].r[1]);
  a.r[1] = lily_pack2<T>(c[0].r[2], c[0].r[3]);
  a.r[2] = lily_pack2<T>(c[1].r[0], c[1].r[1]);
  a.r[3] = lily_pack2<T>(c[1].r[2], c[1].r[3]);
}
template <typename T> LILY_INLINE void lily_mma_load_b_kn(lily_mma_b<T>& b, const T* s, int ld, int lane) {
  // matrices: k rows 0-7, then 8-15, each at the tile's n 0-7; .trans hands each lane its (k pair, n) elements
  const uint32_t addr = lily_smem_addr(s + (lane & 15) * ld);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b.r[0]), "=r"(b.r[1]) : "r"(addr) : "memory");
}
LILY_INLINE float lily_mma_row_max(float v) {
  v = fmaxf(v, lily_shfl_xor(v, 1));
  return fmaxf(v, lily_shfl_xor(v, 2));
}
LILY_INLINE float lily_mma_row_sum(float v) {
  v += lily_shfl_xor(v, 1);
  return v + lily_shfl_xor(v, 2);
}

// Asynchronous copies global -> shared (moe_gemm's stages): cp.async of N bytes (4, 8 or 16; both addresses
// N-aligned), grouped by lily_copy_commit; lily_copy_wait<P> returns once at most P of this thread's groups are
// in flight. Other threads' copies are visible after the barrier that follows the wait.
template <int N, typename D, typename S> LILY_INLINE void lily_copy_async(D* dst, const S* src) {
  if (N == 16)  // .cg: the codes stream through L2 only, keeping L1 for the rest
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(lily_smem_addr(dst)), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(lily_smem_addr(dst)), "l"(src), "n"(N) : "memory");
}
LILY_INLINE void lily_copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int P> LILY_INLINE void lily_copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(P) : "memory"); }
// Dynamic shared memory: the launch asks for the bytes (kernels.call's shared_memory); too few traps.
LILY_INLINE uint32_t lily_dynamic_smem() {
  uint32_t v;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(v));
  return v;
}
#define LILY_SHARED_DYNAMIC(type, name, count) \
  extern __shared__ type name[];               \
  if (lily_dynamic_smem() < sizeof(type) * (count)) __trap()

#endif
