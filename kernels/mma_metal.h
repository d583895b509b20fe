// Metal face of the tensor-core tile helpers (moe_gemm, deltanet_chunk), the same names as mma_cuda.h.
// kernels.header() appends this file only to the kernels that call lily_mma: MLX hashes each launch's source.
#ifndef LILY_MMA_METAL_H
#define LILY_MMA_METAL_H

// Two floats rounded to a 16-bit T, packed low then high (a staged operand tile's pair).
template <typename T> LILY_INLINE uint32_t lily_pack2(float lo, float hi) {
  return static_cast<uint32_t>(as_type<ushort>(static_cast<T>(lo))) | (static_cast<uint32_t>(as_type<ushort>(static_cast<T>(hi))) << 16);
}

// Simdgroup matrix tiles (moe_gemm): 8 x 8 x 8 with float32 accumulators, each lane holding two neighbours of
// row fm, columns fn and fn + 1 (the layout of MLX's steel GEMM, mlx/backend/metal/kernels/steel/gemm/mma.h).
// A comes from an [m][k] tile, B from an [n][k] tile, both 16-bit T in threadgroup memory with ld values per row.
#define LILY_MMA_M 8
#define LILY_MMA_N 8
#define LILY_MMA_K 8
#define LILY_MMA_C_PAIRS 1
template <typename T> using lily_mma_a = float2;
template <typename T> using lily_mma_b = float2;
typedef float2 lily_mma_c;
LILY_INLINE int lily_mma_fm(int lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
LILY_INLINE int lily_mma_fn(int lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }
LILY_INLINE void lily_mma_zero(LILY_THREAD float2& c) { c = float2(0.0f); }
LILY_INLINE float lily_mma_get(float2 c, int i) { return c[i]; }
LILY_INLINE int lily_mma_c_row(int lane, int) { return lily_mma_fm(lane); }
LILY_INLINE int lily_mma_c_col(int lane, int) { return lily_mma_fn(lane); }
// Accumulator element el of fragment (i, j) of a warp tile at (t0, t1): its row and column in the tile's matrix.
LILY_INLINE int lily_mma_el_row(int t0, int i, int lane, int el) { return t0 + i * LILY_MMA_M + lily_mma_c_row(lane, el / 2); }
LILY_INLINE int lily_mma_el_col(int t1, int j, int lane, int el) { return t1 + j * LILY_MMA_N + lily_mma_c_col(lane, el / 2) + el % 2; }
template <typename T> LILY_INLINE void lily_mma_load_a(LILY_THREAD float2& a, const LILY_TG_PTR T* s, int ld, int lane) {
  const LILY_TG_PTR T* p = s + lily_mma_fm(lane) * ld + lily_mma_fn(lane);
  a = float2(static_cast<float>(p[0]), static_cast<float>(p[1]));
}
template <typename T> LILY_INLINE void lily_mma_load_b(LILY_THREAD float2& b, const LILY_TG_PTR T* s, int ld, int lane) {
  const LILY_TG_PTR T* p = s + lily_mma_fn(lane) * ld + lily_mma_fm(lane);  // B[k = fm][n = fn, fn + 1]
  b = float2(static_cast<float>(p[0]), static_cast<float>(p[ld]));
}
LILY_INLINE void lily_mma(LILY_THREAD float2& c, float2 a, float2 b) {
  simdgroup_matrix<float, 8, 8> A, B, C;
  A.thread_elements()[0] = a[0];
  A.thread_elements()[1] = a[1];
  B.thread_elements()[0] = b[0];
  B.thread_elements()[1] = b[1];
  C.thread_elements()[0] = c[0];
  C.thread_elements()[1] = c[1];
  simdgroup_multiply_accumulate(C, A, B, C);
  c = float2(C.thread_elements()[0], C.thread_elements()[1]);
}

// Float32 tiles (deltanet_chunk): simdgroup float matrices, 8 x 8 x 8. The body fills fragments itself, element i
// of a lane at the coordinates below (A [m][k], B [k][n]), from whichever memory and layout the operand lives in.
#define LILY_MMA_KF 8
#define LILY_MMA_AF 2  // A elements per lane
#define LILY_MMA_BF 2  // B elements per lane
struct lily_mma_af { float r[2]; };
struct lily_mma_bf { float r[2]; };
LILY_INLINE int lily_mma_af_row(int lane, int) { return lily_mma_fm(lane); }
LILY_INLINE int lily_mma_af_col(int lane, int i) { return lily_mma_fn(lane) + i; }
LILY_INLINE int lily_mma_bf_k(int lane, int) { return lily_mma_fm(lane); }
LILY_INLINE int lily_mma_bf_n(int lane, int i) { return lily_mma_fn(lane) + i; }
LILY_INLINE void lily_mma_set_af(LILY_THREAD lily_mma_af& a, int i, float v) { a.r[i] = v; }
LILY_INLINE void lily_mma_set_bf(LILY_THREAD lily_mma_bf& b, int i, float v) { b.r[i] = v; }
LILY_INLINE void lily_mma_set(LILY_THREAD float2& c, int i, float v) { c[i] = v; }
LILY_INLINE void lily_mma_f32(LILY_THREAD float2& c, lily_mma_af a, lily_mma_bf b) {
  lily_mma(c, float2(a.r[0], a.r[1]), float2(b.r[0], b.r[1]));
}

// Attention tiles (flash_attn): A from 16-bit pairs the body reads itself (one pair per lane: row, first of two
// columns), P's A fragment straight from S's accumulator (the same lane layout), B from a [k][n] tile, and a
// row's reduction over the 4 lanes that share it (lane bits 0 and 3).
#define LILY_MMA_A16 1
#define LILY_MMA_C_PER_A 1
LILY_INLINE int lily_mma_a16_row(int lane, int) { return lily_mma_fm(lane); }
LILY_INLINE int lily_mma_a16_col(int lane, int) { return lily_mma_fn(lane); }
template <typename T> LILY_INLINE void lily_mma_set_a16(LILY_THREAD float2& a, int, float lo, float hi) {
  a = float2(static_cast<float>(static_cast<T>(lo)), static_cast<float>(static_cast<T>(hi)));
}
template <typename T> LILY_INLINE void lily_mma_a_from_c(LILY_THREAD float2& a, const LILY_THREAD float2* c) {
  a = float2(static_cast<float>(static_cast<T>(c[0][0])), static_cast<float>(static_cast<T>(c[0][1])));
}
template <typename T> LILY_INLINE void lily_mma_load_b_kn(LILY_THREAD float2& b, const LILY_TG_PTR T* s, int ld, int lane) {
  const LILY_TG_PTR T* p = s + lily_mma_fm(lane) * ld + lily_mma_fn(lane);  // B[k = fm][n = fn, fn + 1]
  b = float2(static_cast<float>(p[0]), static_cast<float>(p[1]));
}
LILY_INLINE float lily_mma_row_max(float v) {
  v = metal::max(v, lily_shfl_xor(v, 1));
  return metal::max(v, lily_shfl_xor(v, 8));
}
LILY_INLINE float lily_mma_row_sum(float v) {
  v += lily_shfl_xor(v, 1);
  return v + lily_shfl_xor(v, 8);
}

// Copies global -> threadgroup with the names of CUDA's cp.async (moe_gemm's stages): plain N-byte copies here,
// complete when they return, so commit and wait have nothing to do; the barrier after the wait publishes them.
template <int N> struct lily_copy_unit;
template <> struct lily_copy_unit<4> { typedef uint type; };
template <> struct lily_copy_unit<8> { typedef uint2 type; };
template <> struct lily_copy_unit<16> { typedef uint4 type; };
template <int N, typename D, typename S> LILY_INLINE void lily_copy_async(LILY_TG_PTR D* dst, const device S* src) {
  typedef typename lily_copy_unit<N>::type U;
  *reinterpret_cast<LILY_TG_PTR U*>(dst) = *reinterpret_cast<const device U*>(src);
}
LILY_INLINE void lily_copy_commit() {}
template <int P> LILY_INLINE void lily_copy_wait() {}
// Threadgroup memory is sized in the source on Metal (32 KB at most).
#define LILY_SHARED_DYNAMIC(type, name, count) threadgroup type name[count]

#endif
