// Backend-neutral helpers for kernel bodies, written only in the prelude's names; kernels.header()
// puts this after prelude_<backend>.h.
#ifndef LILY_PRELUDE_COMMON_H
#define LILY_PRELUDE_COMMON_H

// One 16-byte chunk of MLX affine codes (128/BITS codes of one group, low bits first) against its
// x values xr: a = sum_c xr[c] * (1 + q_c / 2^BITS), code c OR-ed into the mantissa of 1.0f (no
// int->float conversion). With xs = sum(xr): s*sum(q*x) + b*xs = (2^BITS s) a + (b - 2^BITS s) xs.
template <int BITS>
LILY_INLINE float lily_qdot16(uint4 q, const LILY_THREAD float* xr) {
  constexpr int CPW = 32 / BITS;
  constexpr uint32_t MANT = ((1u << BITS) - 1u) << (23 - BITS);
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  float a = 0.0f;
  LILY_UNROLL
  for (int wi = 0; wi < 4; ++wi) {
    LILY_UNROLL
    for (int c = 0; c < CPW; ++c) {
      const int sh = (23 - BITS) - BITS * c;  // moves code c to the top of the mantissa
      const uint32_t u = sh >= 0 ? (words[wi] << (sh & 31)) : (words[wi] >> ((-sh) & 31));
      a = LILY_FMA(xr[wi * CPW + c], LILY_AS_FLOAT(0x3F800000u | (u & MANT)), a);
    }
  }
  return a;
}

// XOR swizzle of a staged chunk's F4C float4s: lanes reading consecutive chunks hit distinct banks.
template <int F4C>
LILY_INLINE int lily_swizzle(int chunk) { return F4C >= 8 ? (chunk & 7) : ((chunk >> 1) & 3); }

// rinv[m] = rsqrt(mean(x[m, :K]^2) + eps) for the M rows of x, every thread of a block of WARPS warps
// taking part; red is shared scratch of M * WARPS floats. Ends with a barrier (red may be reused after).
template <int M, int K, int WARPS, typename TX>
LILY_INLINE void lily_row_rsqrt_ms(TX x, float eps, LILY_TG_PTR float* red, LILY_THREAD float* rinv, int tid) {
  LILY_UNROLL
  for (int m = 0; m < M; ++m) {
    float ss = 0.0f;
    for (int k = tid; k < K; k += 32 * WARPS) {
      const float v = lily_float(x[m * K + k]);
      ss = LILY_FMA(v, v, ss);
    }
    ss = lily_warp_sum(ss);
    if ((tid & 31) == 0) red[m * WARPS + (tid >> 5)] = ss;
  }
  LILY_BARRIER();
  LILY_UNROLL
  for (int m = 0; m < M; ++m) {
    float ss = 0.0f;
    for (int w = 0; w < WARPS; ++w) ss += red[m * WARPS + w];
    rinv[m] = lily_rsqrt(ss / static_cast<float>(K) + eps);
  }
  LILY_BARRIER();
}

// One element of mx.fast.rms_norm's output, as it rounds: T(w * T(x * rinv)), returned as float.
template <typename T, typename TW>
LILY_INLINE float lily_normed(float x, float rinv, TW w) {
  return lily_float(lily_cast<T>(lily_float(w) * lily_float(lily_cast<T>(x * rinv))));
}

LILY_INLINE float lily_sigmoid(float v) { return 1.0f / (1.0f + lily_exp(-v)); }

LILY_INLINE float lily_nan() { return LILY_AS_FLOAT(0x7FC00000u); }

#endif
