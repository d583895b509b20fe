// CUDA face of moe_gemm_direct's fragment helpers, the same names as mma_direct_metal.h, after mma_cuda.h.
// kernels.header() appends this file only to the kernels that call lily_df_: MLX hashes each launch's source.
#ifndef LILY_MMA_DIRECT_CUDA_H
#define LILY_MMA_DIRECT_CUDA_H

// Direct fragments (moe_gemm_direct): a 64-wide k slice whose fragments come from registers the body filled straight
// from global memory, k permuted inside the slice (a product's sum is the same in any k order while A and B agree).
// Lane (g = lane / 4, c = lane % 4) holds k 16c .. 16c + 15 of A rows g and g + 8 (8 words of T pairs each) and
// the codes of k 16c .. 16c + 15 of B column g; MMA step s of 4 takes k 16c + 4s .. 16c + 4s + 3 of them.
#define LILY_DF_STEPS 4  // MMAs a 64-wide slice
#define LILY_DF_A_ROWS 2  // A rows a lane holds a fragment, 16 values each
#define LILY_DF_B_COLS 1  // B columns (weight rows) a lane holds a fragment
#define LILY_DF_B_RUN 16  // codes a B column, contiguous in k
LILY_INLINE int lily_df_a_row(int lane, int h) { return (lane >> 2) + 8 * h; }
LILY_INLINE int lily_df_a_k(int lane) { return 16 * (lane & 3); }
LILY_INLINE int lily_df_b_col(int lane, int) { return lane >> 2; }
LILY_INLINE int lily_df_b_k(int lane) { return 16 * (lane & 3); }
// xa: the lane's A rows, 8 words each.
template <typename T> LILY_INLINE void lily_df_a(lily_mma_a<T>& a, const uint32_t* xa, int s) {
  a.r[0] = xa[2 * s];
  a.r[1] = xa[8 + 2 * s];
  a.r[2] = xa[2 * s + 1];
  a.r[3] = xa[8 + 2 * s + 1];
}
// codes: the lane's B column, 16 codes of BITS low bits first; each dequantized as moe_gemm does (float, then T).
template <typename T, int BITS>
LILY_INLINE void lily_df_b(lily_mma_b<T>& b, const uint32_t* codes, const float* scale, const float* bias, int s) {
  float v[4];
  LILY_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int q = 4 * s + i;
    const uint32_t code = (codes[q * BITS / 32] >> ((q * BITS) % 32)) & ((1u << BITS) - 1u);
    v[i] = LILY_FMA(scale[0], static_cast<float>(code), bias[0]);
  }
  b.r[0] = lily_pack2<T>(v[0], v[1]);
  b.r[1] = lily_pack2<T>(v[2], v[3]);
}

#endif
