// Metal face of moe_gemm_direct's fragment helpers, the same names as mma_direct_cuda.h, after mma_metal.h.
// kernels.header() appends this file only to the kernels that call lily_df_: MLX hashes each launch's source.
#ifndef LILY_MMA_DIRECT_METAL_H
#define LILY_MMA_DIRECT_METAL_H

// Direct fragments (moe_gemm_direct): a 64-wide k slice whose fragments come from registers the body filled straight
// from global memory, k permuted inside the slice (a product's sum is the same in any k order while A and B agree).
// Lane (fm, fn) holds k 8fn .. 8fn + 15 of A row fm (8 words of T pairs) and the codes of k 8fm .. 8fm + 7 of B
// columns fn and fn + 1; MMA step s of 8 takes A's k 8fn + s and 8fn + 8 + s, B's k 8fm + s.
#define LILY_DF_STEPS 8
#define LILY_DF_A_ROWS 1
#define LILY_DF_B_COLS 2
#define LILY_DF_B_RUN 8
LILY_INLINE int lily_df_a_row(int lane, int) { return lily_mma_fm(lane); }
LILY_INLINE int lily_df_a_k(int lane) { return 8 * lily_mma_fn(lane); }
LILY_INLINE int lily_df_b_col(int lane, int h) { return lily_mma_fn(lane) + h; }
LILY_INLINE int lily_df_b_k(int lane) { return 8 * lily_mma_fm(lane); }
template <typename T> LILY_INLINE float lily_df_value(const LILY_THREAD uint32_t* words, int i) {
  return static_cast<float>(as_type<T>(static_cast<ushort>(words[i / 2] >> (16 * (i % 2)))));
}
template <typename T> LILY_INLINE void lily_df_a(LILY_THREAD float2& a, const LILY_THREAD uint32_t* xa, int s) {
  a = float2(lily_df_value<T>(xa, s), lily_df_value<T>(xa, 8 + s));
}
// codes: the lane's two B columns, BITS / 4 words each.
template <typename T, int BITS>
LILY_INLINE void lily_df_b(LILY_THREAD float2& b, const LILY_THREAD uint32_t* codes, const LILY_THREAD float* scale,
                           const LILY_THREAD float* bias, int s) {
  float v[2];
  for (int h = 0; h < 2; ++h) {
    const uint32_t code = (codes[h * BITS / 4 + s * BITS / 32] >> ((s * BITS) % 32)) & ((1u << BITS) - 1u);
    v[h] = static_cast<float>(static_cast<T>(LILY_FMA(scale[h], static_cast<float>(code), bias[h])));
  }
  b = float2(v[0], v[1]);
}

#endif
