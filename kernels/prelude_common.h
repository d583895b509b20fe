// Backend-neutral helpers for kernel bodies, written only in the prelude's names. kernels.header()
// puts after prelude_<backend>.h the blocks (separated by blank lines) that a kernel's body calls.

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
      a = LILY_FMA(xr[wi * CPW + c], lily_code_float<MANT>(u), a);
    }
  }
  return a;
}

// Asks the L2 for bytes [part * n / parts, (part + 1) * n / parts) of the input p, a 128-byte line a thread at a time,
// so a later phase of the launch reads them from L2 instead of DRAM. A hint only: no value depends on it.
template <typename TP>
LILY_INLINE void lily_prefetch_part(TP p, int64_t n_bytes, int part, int parts, int tid, int nthreads) {
  const int64_t lo = n_bytes * part / parts;
  const int64_t hi = n_bytes * (part + 1) / parts;
  for (int64_t b = lo - lo % 128 + 128 * static_cast<int64_t>(tid); b < hi; b += 128 * static_cast<int64_t>(nthreads))
    LILY_PREFETCH_L2(reinterpret_cast<const LILY_GLOBAL char*>(p) + b);
}

// lily_prefetch_part of a quantized weight [rows, k] (BITS-bit codes w, scales s and biases b per group of GS).
template <int BITS, int GS, typename TW, typename TS>
LILY_INLINE void lily_prefetch_weight_part(TW w, TS s, TS b, int64_t rows, int64_t k, int part, int parts, int tid,
                                           int nthreads) {
  lily_prefetch_part(w, rows * k * BITS / 8, part, parts, tid, nthreads);
  lily_prefetch_part(s, rows * (k / GS) * static_cast<int64_t>(sizeof(s[0])), part, parts, tid, nthreads);
  lily_prefetch_part(b, rows * (k / GS) * static_cast<int64_t>(sizeof(b[0])), part, parts, tid, nthreads);
}

// XOR swizzle of a staged chunk's F4C float4s: lanes reading consecutive chunks hit distinct banks.
template <int F4C>
LILY_INLINE int lily_swizzle(int chunk) { return F4C >= 8 ? (chunk & 7) : ((chunk >> 1) & 3); }

// rinv[m] = rsqrt(ss[m] / K + eps) in every thread of a block of WARPS warps, ss[m] being each thread's share of row
// m's sum of squares; red is shared scratch of M * WARPS floats, free again after the caller's next barrier.
template <int M, int K, int WARPS>
LILY_INLINE void lily_rsqrt_of_sums(LILY_THREAD float* ss, float eps, LILY_TG_PTR float* red, LILY_THREAD float* rinv,
                                    int tid) {
  LILY_UNROLL
  for (int m = 0; m < M; ++m) {
    const float s = lily_warp_sum(ss[m]);
    if ((tid & 31) == 0) red[m * WARPS + (tid >> 5)] = s;
  }
  LILY_BARRIER();
  LILY_UNROLL
  for (int m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int w = 0; w < WARPS; ++w) s += red[m * WARPS + w];
    rinv[m] = lily_rsqrt(s / static_cast<float>(K) + eps);
  }
}

// rinv[m] = rsqrt(mean(x[m, :K]^2) + eps) for the first mrows <= M rows of x (rows past them read nothing),
// every thread of a block of WARPS warps taking part; red is shared scratch of M * WARPS floats. Ends with
// a barrier (red may be reused after).
template <int M, int K, int WARPS, typename TX>
LILY_INLINE void lily_row_rsqrt_ms(TX x, int mrows, float eps, LILY_TG_PTR float* red, LILY_THREAD float* rinv,
                                   int tid) {
  float ss[M];
  LILY_UNROLL
  for (int m = 0; m < M; ++m) {
    ss[m] = 0.0f;
    for (int k = tid; m < mrows && k < K; k += 32 * WARPS) {
      const float v = lily_float(x[m * K + k]);
      ss[m] = LILY_FMA(v, v, ss[m]);
    }
  }
  lily_rsqrt_of_sums<M, K, WARPS>(ss, eps, red, rinv, tid);
  LILY_BARRIER();
}

// An element as loaded, in its own type (not yet a float): what decltype(lily_value(p[0])) names.
template <typename V>
LILY_INLINE V lily_value(V v) { return v; }

// Elements i .. i + 3 of p as floats.
template <typename TP>
LILY_INLINE float4 lily_float4(TP p, int i) {
  return LILY_F4(lily_float(p[i]), lily_float(p[i + 1]), lily_float(p[i + 2]), lily_float(p[i + 3]));
}

// Elements i .. i + 3 of p as loaded (V: decltype(lily_value(p[0]))), their loads issued here and not where they are
// first used (lily_pin): a value wanted only past a barrier, loaded before a block's weights, comes back before them.
template <typename V>
struct lily_raw4 {
  V v[4];
};

template <typename V, typename TP>
LILY_INLINE lily_raw4<V> lily_load4(TP p, int i) {
  lily_raw4<V> r;
  LILY_UNROLL
  for (int j = 0; j < 4; ++j) {
    r.v[j] = p[i + j];
    lily_pin(r.v[j]);
  }
  return r;
}

template <typename V>
LILY_INLINE float4 lily_float4_of(LILY_THREAD const lily_raw4<V>& r) {
  return LILY_F4(lily_float(r.v[0]), lily_float(r.v[1]), lily_float(r.v[2]), lily_float(r.v[3]));
}

// A float4's sum of squares, in the order every staging that normalises takes it.
LILY_INLINE float lily_sum_sq4(float4 v) {
  return LILY_FMA(v.w, v.w, LILY_FMA(v.z, v.z, LILY_FMA(v.y, v.y, v.x * v.x)));
}

// One element of mx.fast.rms_norm's output, as it rounds: T(w * T(x * rinv)), returned as float.
template <typename T, typename TW>
LILY_INLINE float lily_normed(float x, float rinv, TW w) {
  return lily_float(lily_cast<T>(lily_float(w) * lily_float(lily_cast<T>(x * rinv))));
}

// v RMS-normalised by rinv and the norm weights w, as lily_normed rounds each element.
template <typename T>
LILY_INLINE float4 lily_normed4(float4 v, float rinv, float4 w) {
  return LILY_F4(lily_normed<T>(v.x, rinv, w.x), lily_normed<T>(v.y, rinv, w.y), lily_normed<T>(v.z, rinv, w.z),
                 lily_normed<T>(v.w, rinv, w.w));
}

// One token's row x [H] as lily_stage_row reads it: a thread's float4s of x (and with NORM of nw) in registers, so a
// caller can send these loads before others (lily_load_row) and stage them later (lily_stage_loaded_row).
template <int H, int WARPS>
struct lily_row_regs {
  static constexpr int ITERS = (H / 4 + 32 * WARPS - 1) / (32 * WARPS);
  float4 v[ITERS];
  float4 w[ITERS];
};

template <int H, int WARPS, bool NORM, typename TX, typename TN>
LILY_INLINE void lily_load_row(TX x, TN nw, int tid, LILY_THREAD lily_row_regs<H, WARPS>& r) {
  LILY_UNROLL
  for (int it = 0; it < lily_row_regs<H, WARPS>::ITERS; ++it) {
    const int e = it * 32 * WARPS + tid;  // float4 index into the row
    r.v[it] = r.w[it] = LILY_F4(0.0f, 0.0f, 0.0f, 0.0f);
    if (e < H / 4) {
      r.v[it] = lily_float4(x, e * 4);
      if (NORM) r.w[it] = lily_float4(nw, e * 4);
    }
  }
}

// The row (with NORM, RMS-normalised by nw as mx.fast.rms_norm rounds it) staged as floats for 16-byte chunks of CPC
// codes: xs4 holds chunk c's CPC/4 float4s swizzled (lily_swizzle), xsum[c] their sum. Every thread of a block of
// WARPS warps takes part; red is WARPS floats of scratch. Ends with a barrier.
template <typename T, int H, int CPC, int WARPS, bool NORM>
LILY_INLINE void lily_stage_loaded_row(LILY_THREAD const lily_row_regs<H, WARPS>& r, float eps,
                                       LILY_TG_PTR float4* xs4, LILY_TG_PTR float* xsum, LILY_TG_PTR float* red,
                                       int tid) {
  constexpr int F4C = CPC / 4;
  constexpr int C = H / CPC;
  constexpr int ITERS = lily_row_regs<H, WARPS>::ITERS;
  float ss[1] = {0.0f};  // the norm's sum of squares from the registers: x read once
  LILY_UNROLL
  for (int it = 0; it < ITERS; ++it) {
    if (NORM && it * 32 * WARPS + tid < H / 4) ss[0] += lily_sum_sq4(r.v[it]);
  }
  float rinv[1] = {0.0f};
  if (NORM) lily_rsqrt_of_sums<1, H, WARPS>(ss, eps, red, rinv, tid);
  LILY_UNROLL
  for (int it = 0; it < ITERS; ++it) {
    const int e = it * 32 * WARPS + tid;
    const int cl = e / F4C;
    const int f = e - cl * F4C;
    const bool ok = cl < C;
    const float4 u = NORM && ok ? lily_normed4<T>(r.v[it], rinv[0], r.w[it]) : r.v[it];
    float part = (u.x + u.y) + (u.z + u.w);
    LILY_UNROLL
    for (int off = 1; off < F4C; off <<= 1) part += lily_shfl_xor(part, off);  // the chunk's sum
    if (ok) {
      xs4[cl * F4C + (f ^ lily_swizzle<F4C>(cl))] = u;
      if (f == 0) xsum[cl] = part;
    }
  }
  LILY_BARRIER();
}

// lily_load_row, then lily_stage_loaded_row.
template <typename T, int H, int CPC, int WARPS, bool NORM, typename TX, typename TN>
LILY_INLINE void lily_stage_row(TX x, TN nw, float eps, LILY_TG_PTR float4* xs4, LILY_TG_PTR float* xsum,
                                LILY_TG_PTR float* red, int tid) {
  lily_row_regs<H, WARPS> r;
  lily_load_row<H, WARPS, NORM>(x, nw, tid, r);
  lily_stage_loaded_row<T, H, CPC, WARPS, NORM>(r, eps, xs4, xsum, red, tid);
}

// The router's logits (an RBITS-bit affine [LS, H] matrix wr, sr, br) against x' staged by lily_stage_row for
// chunks of CPC codes, rounded to T as the router's GEMV rounds them. A warp takes RR rows at a time, its lanes over
// their 16-byte chunks: lily_router_load fetches rows r0.. of them into a lily_router_regs, lily_router_dot reduces
// them against x' into out[r] (for r < end), so a caller can issue a warp's first loads before it stages x'.
template <int H, int RBITS, int RGS>
struct lily_router_shape {
  static constexpr int RCPC = 128 / RBITS;         // router codes per 16-byte chunk
  static constexpr int RC = H / RCPC;              // chunks per router row
  static constexpr int RNG = H / RGS;
  static constexpr int RCL = (RC + 31) / 32;       // chunks per lane of a router row
  static constexpr int RR = RCL >= 4 ? 1 : 4 / RCL;  // router rows in flight per warp
};
// SV: the router's scale type; its scales and biases are kept as loaded and made floats in lily_router_dot, past the
// caller's staging (made floats at the load, they would hold x's loads back until they came).
template <int H, int RBITS, int RGS, typename SV>
struct lily_router_regs {
  typedef lily_router_shape<H, RBITS, RGS> S;
  uint4 q[S::RR][S::RCL];
  SV s[S::RR][S::RCL], b[S::RR][S::RCL];
};

template <int H, int RBITS, int RGS, int LS, typename TW, typename TS, typename SV>
LILY_INLINE void lily_router_load(TW wr, TS sr, TS br, int r0, int lane,
                                  LILY_THREAD lily_router_regs<H, RBITS, RGS, SV>& g) {
  typedef lily_router_shape<H, RBITS, RGS> S;
  static_assert(RBITS == 4 || RBITS == 8, "router: RBITS must be 4 or 8");
  static_assert(H % RGS == 0 && RGS % S::RCPC == 0, "router: a chunk must lie inside one group");
  LILY_UNROLL
  for (int i = 0; i < S::RR; ++i) {
    const int r = lily_min(r0 + i, LS - 1);
    LILY_UNROLL
    for (int j = 0; j < S::RCL; ++j) {
      const int kc = j * 32 + lane;
      if (kc < S::RC) {
        const int grp = r * S::RNG + (kc * S::RCPC) / RGS;
        g.q[i][j] = LILY_LDG_U4(wr, r * S::RC + kc);
        g.s[i][j] = sr[grp];
        g.b[i][j] = br[grp];
      }
    }
  }
}

template <typename T, int H, int CPC, int RBITS, int RGS, typename TO, typename SV>
LILY_INLINE void lily_router_dot(LILY_TG_PTR const float4* xs4, LILY_THREAD const lily_router_regs<H, RBITS, RGS, SV>& g,
                                 int r0, int end, TO out, int lane) {
  typedef lily_router_shape<H, RBITS, RGS> S;
  constexpr float RQSCALE = static_cast<float>(1 << RBITS);
  constexpr int F4C = CPC / 4;
  constexpr int RF4 = S::RCPC / 4;  // float4s of x' per router chunk
  float racc[S::RR];
  LILY_UNROLL
  for (int i = 0; i < S::RR; ++i) racc[i] = 0.0f;
  LILY_UNROLL
  for (int j = 0; j < S::RCL; ++j) {
    const int kc = j * 32 + lane;
    if (kc < S::RC) {
      float xr[S::RCPC];
      float xs = 0.0f;
      LILY_UNROLL
      for (int t = 0; t < RF4; ++t) {
        const int e4 = kc * RF4 + t;  // float4 index into x'
        const int cl = e4 / F4C;
        const float4 v = xs4[cl * F4C + ((e4 - cl * F4C) ^ lily_swizzle<F4C>(cl))];
        xr[4 * t] = v.x;
        xr[4 * t + 1] = v.y;
        xr[4 * t + 2] = v.z;
        xr[4 * t + 3] = v.w;
        xs += (v.x + v.y) + (v.z + v.w);
      }
      LILY_UNROLL
      for (int i = 0; i < S::RR; ++i) {
        const float sc = RQSCALE * lily_float(g.s[i][j]);
        racc[i] = LILY_FMA(sc, lily_qdot16<RBITS>(g.q[i][j], xr), LILY_FMA(lily_float(g.b[i][j]) - sc, xs, racc[i]));
      }
    }
  }
  LILY_UNROLL
  for (int i = 0; i < S::RR; ++i) {
    const float v = lily_warp_sum(racc[i]);
    if (lane == 0 && r0 + i < end) out[r0 + i] = lily_cast<T>(v);
  }
}

// Rows [first, end) of the router's logits into out, x' staged; warp w of a block of WARPS takes rows first + w * RR,
// then every WARPS * RR rows on.
template <typename T, int H, int CPC, int RBITS, int RGS, int LS, int WARPS, typename TW, typename TS, typename TO>
LILY_INLINE void lily_router_rows(TW wr, TS sr, TS br, LILY_TG_PTR const float4* xs4, int first, int end, TO out,
                                  int warp, int lane) {
  constexpr int RR = lily_router_shape<H, RBITS, RGS>::RR;
  for (int r0 = first + warp * RR; r0 < end; r0 += WARPS * RR) {
    lily_router_regs<H, RBITS, RGS, decltype(lily_value(sr[0]))> g;
    lily_router_load<H, RBITS, RGS, LS>(wr, sr, br, r0, lane, g);
    lily_router_dot<T, H, CPC, RBITS, RGS>(xs4, g, r0, end, out, lane);
  }
}

// One attention head vector, RMS-normalised then rotated (RoPE, rotate-half, the first ROPE dims at
// position pos), by one warp, with the reference's roundings to T (mx.fast.rms_norm, mx.fast.rope):
// src[0, D) any float pointer, nw [D] the norm weight; dst [D] shared floats, written by lanes
// (lane holds dims lane, lane + 32, ...).
template <typename T, int D, int ROPE, typename TS, typename TW>
LILY_INLINE void lily_norm_rope(TS src, TW nw, float eps, int pos, float log2_base, LILY_TG_PTR float* dst, int lane) {
  constexpr int DPL = D / 32;
  constexpr int HALF = ROPE / 2;
  float v[DPL];
  float ss = 0.0f;
  LILY_UNROLL
  for (int j = 0; j < DPL; ++j) {
    v[j] = lily_float(src[j * 32 + lane]);
    ss = LILY_FMA(v[j], v[j], ss);
  }
  const float r = lily_rsqrt(lily_warp_sum(ss) / static_cast<float>(D) + eps);
  LILY_UNROLL
  for (int j = 0; j < DPL; ++j) dst[j * 32 + lane] = lily_normed<T>(v[j], r, nw[j * 32 + lane]);
  LILY_WARP_SYNC();
  LILY_UNROLL
  for (int j = 0; j < DPL; ++j) {
    const int d = j * 32 + lane;
    v[j] = dst[d];
    if (d < ROPE) {
      const int i = d < HALF ? d : d - HALF;  // the pair (i, i + HALF) turns by angle pos * base^(-i / HALF)
      const float theta = static_cast<float>(pos) * lily_exp2(-(static_cast<float>(i) / static_cast<float>(HALF)) * log2_base);
      const float c = lily_cos(theta);
      const float s = lily_sin(theta);
      const float x1 = dst[i];
      const float x2 = dst[i + HALF];
      v[j] = lily_float(lily_cast<T>(d < HALF ? x1 * c - x2 * s : x1 * s + x2 * c));
    }
  }
  LILY_WARP_SYNC();
  LILY_UNROLL
  for (int j = 0; j < DPL; ++j) dst[j * 32 + lane] = v[j];
  LILY_WARP_SYNC();
}

LILY_INLINE float lily_sigmoid(float v) { return 1.0f / (1.0f + lily_exp(-v)); }

// A gated attention output element as the reference rounds it, T(T(o) * T(sigmoid(gate))), returned as float:
// attn_decode.inc, attn_combine.inc and qmv.inc's qmv_attn variant all end with it.
template <typename T, typename TG>
LILY_INLINE float lily_gated(float o, TG gate) {
  return lily_float(lily_cast<T>(lily_float(lily_cast<T>(o)) * lily_float(lily_cast<T>(lily_sigmoid(lily_float(gate))))));
}

LILY_INLINE float lily_nan() { return LILY_AS_FLOAT(0x7FC00000u); }
LILY_INLINE float lily_neg_inf() { return LILY_AS_FLOAT(0xFF800000u); }

// One step of an online softmax over N new scores s (masked ones -inf): the running max m, sum l and a lane's DPL
// accumulated outputs rescaled to the new max, and s turned into the new rows' weights (0 where masked).
template <int N, int DPL>
LILY_INLINE void lily_softmax_step(LILY_THREAD float* s, LILY_THREAD float& m, LILY_THREAD float& l, LILY_THREAD float* acc) {
  float mt = m;
  LILY_UNROLL
  for (int t = 0; t < N; ++t) mt = s[t] > mt ? s[t] : mt;
  const float c = lily_exp(m - mt);  // m = -inf on the first rows: c = 0 scales nothing that exists
  l *= c;
  LILY_UNROLL
  for (int j = 0; j < DPL; ++j) acc[j] *= c;
  LILY_UNROLL
  for (int t = 0; t < N; ++t) {
    s[t] = s[t] > lily_neg_inf() ? lily_exp(s[t] - mt) : 0.0f;
    l += s[t];
  }
  m = mt;
}

// The largest v over the 32 lanes of a warp, on every lane.
LILY_INLINE float lily_warp_max(float v) {
  LILY_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    const float o = lily_shfl_xor(v, off);
    v = o > v ? o : v;
  }
  return v;
}

// A chained kernel's block waits until `count` blocks have arrived at counter `slot` (the phase before): thread 0
// polls, then the whole block passes a barrier that orders the reads after it.
#define LILY_PHASE_WAIT(sync, slot, count) \
  if (lily_tid == 0) {                     \
    lily_sync_wait(sync, slot, count);     \
    LILY_TRACE_WAITED();                   \
  }                                        \
  LILY_DEVICE_BARRIER();

// attn_decode.inc's stage of cached K/V rows in shared memory, in the space of its REP query heads' D floats: ROWS
// rows of K then ROWS of V as 16-byte words (ROW_WORDS a row), at most WPT words a thread of its NT. No stage (ROWS
// 0) where one row of each does not fit there, or REP is 0.
template <typename TC, int D, int REP>
struct lily_kv_stage {
  static constexpr int DIM = D;
  static constexpr int ROW_WORDS = D * static_cast<int>(sizeof(TC)) / 16;
  static constexpr int FIT = 2 * REP / static_cast<int>(sizeof(TC));
  static constexpr int ROWS = FIT > 16 ? 16 : FIT;
  static constexpr int WORDS = 2 * ROWS * ROW_WORDS;
  static constexpr int NT = 32 * REP;
  static constexpr int WPT = WORDS > 0 ? (WORDS + NT - 1) / NT : 1;
  static_assert(D * sizeof(TC) % 16 == 0, "lily_kv_stage: a cache row must be whole 16-byte words");
};

// This thread's words of the stage of rows [p, p + ROWS) (KVS: a lily_kv_stage), loads only: they are used later.
template <typename KVS, typename TP>
LILY_INLINE void lily_kv_stage_load(TP keys, TP values, int64_t row0, int p, int tid, LILY_THREAD uint4* wv) {
  LILY_UNROLL
  for (int k = 0; k < KVS::WPT; ++k) {
    const int wi = k * KVS::NT + tid;
    const int r = wi / KVS::ROW_WORDS;  // K rows first
    const bool key = r < KVS::ROWS;
    const int64_t at = row0 + static_cast<int64_t>(p + (key ? r : r - KVS::ROWS)) * KVS::DIM;
    if (wi < KVS::WORDS) wv[k] = LILY_LDG_U4((key ? keys : values) + at, wi - r * KVS::ROW_WORDS);
  }
}

// An argmax candidate (value v, index i) against the best so far: the larger value wins, a tie goes to the smaller
// index (the first maximum, as MLX's argmax), a NaN never wins.
template <typename I>
LILY_INLINE bool lily_beats(float v, I i, float bv, I bi) { return v > bv || (v == bv && i < bi); }

// The first maximum (v, i) over the 32 lanes of a warp, on every lane (i a float or an int index).
template <typename I>
LILY_INLINE void lily_warp_argmax(LILY_THREAD float& v, LILY_THREAD I& i) {
  LILY_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = lily_shfl_xor(v, off);
    const I oi = lily_shfl_xor(i, off);
    if (lily_beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// The router's top-K of one row of E logits, computed by one warp (every lane ends with the same
// answer): ids[j] in descending logit order, ties to the lower id; weights[j] the softmax
// probabilities, renormalised over the K chosen when NORMTOPK (exp(l_j - l_0) / sum_K), else over
// all E. A row with fewer than K comparable logits (NaN) yields id E for the missing ones.
// 16-bit logits pick by one warp max of packed keys: as float32 a 16-bit float leaves its low 13 bits zero, so its
// bits made monotonic (sign flipped, or all flipped if negative) hold 8191 - id there; -inf and NaN key 0 (never
// picked) and -0 keys as +0, so the picks equal the float comparisons'. 32-bit logits compare (value, id) pairs.
template <int E, int K, bool NORMTOPK, typename TL>
LILY_INLINE void lily_topk(TL row, int lane, LILY_THREAD int* ids, LILY_THREAD float* weights) {
  constexpr int PL = (E + 31) / 32;  // logits per lane: lane holds ids lane, lane + 32, ...
  constexpr uint32_t IDS = 0x1FFFu;
  float v[PL];
  LILY_UNROLL
  for (int i = 0; i < PL; ++i) v[i] = i * 32 + lane < E ? lily_float(row[i * 32 + lane]) : lily_neg_inf();
  float top = lily_neg_inf();
  if (sizeof(row[0]) == 2) {
    static_assert(E < IDS, "lily_topk: E must fit the packed keys' 13 bits");
    uint32_t key[PL];
    LILY_UNROLL
    for (int i = 0; i < PL; ++i) {
      const uint32_t u = v[i] == 0.0f ? 0u : LILY_AS_UINT(v[i]);
      const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
      key[i] = v[i] > lily_neg_inf() ? ((ord & ~IDS) | (IDS - static_cast<uint32_t>(i * 32 + lane))) : 0u;
    }
    LILY_UNROLL
    for (int j = 0; j < K; ++j) {
      uint32_t best = 0u;
      LILY_UNROLL
      for (int i = 0; i < PL; ++i) best = key[i] > best ? key[i] : best;
      best = lily_warp_max_u32(best);
      const uint32_t ord = best & ~IDS;
      const float bv = best == 0u ? lily_neg_inf()
                                  : LILY_AS_FLOAT((ord & 0x80000000u) ? (ord & 0x7FFFFFFFu) : (~ord & ~IDS));
      if (j == 0) top = bv;
      ids[j] = best == 0u ? E : static_cast<int>(IDS - (best & IDS));
      weights[j] = bv;
      LILY_UNROLL
      for (int i = 0; i < PL; ++i) key[i] = key[i] == best ? 0u : key[i];
    }
  } else {
    LILY_UNROLL
    for (int j = 0; j < K; ++j) {
      float bv = lily_neg_inf();
      int bi = E;
      LILY_UNROLL
      for (int i = 0; i < PL; ++i) {
        if (v[i] > bv) {  // strict: the lowest id of equal logits in this lane
          bv = v[i];
          bi = i * 32 + lane;
        }
      }
      lily_warp_argmax(bv, bi);
      if (j == 0) top = bv;
      ids[j] = bi;
      weights[j] = bv;
      LILY_UNROLL
      for (int i = 0; i < PL; ++i) {
        if (i * 32 + lane == bi) v[i] = lily_neg_inf();
      }
    }
  }
  float denom = 0.0f;
  if (NORMTOPK) {
    LILY_UNROLL
    for (int j = 0; j < K; ++j) denom += lily_exp(weights[j] - top);
  } else {
    LILY_UNROLL
    for (int i = 0; i < PL; ++i) {
      if (i * 32 + lane < E) denom += lily_exp(lily_float(row[i * 32 + lane]) - top);
    }
    denom = lily_warp_sum(denom);
  }
  LILY_UNROLL
  for (int j = 0; j < K; ++j) weights[j] = lily_exp(weights[j] - top) / denom;
}

// A packed quantized weight (lily_mlx/ops/packing.py): codes, scales, biases, each block starting at a multiple of
// 4 words. A packed or bundled variant's preamble (kernels.packed_preamble) points W, S and B into the block at P of
// ROWS rows, WROW code words and SROW scales of type ST a row: one short line, as MLX hashes the source every launch.
LILY_INLINE size_t lily_pw_round(size_t words) { return (words + 3) & ~static_cast<size_t>(3); }
#define LILY_PACKED_WEIGHT(P, ROWS, WROW, SROW, ST, W, S, B) \
  const LILY_GLOBAL uint32_t* W = P; \
  const LILY_GLOBAL ST* S = reinterpret_cast<const LILY_GLOBAL ST*>(P + lily_pw_round((ROWS) * (WROW))); \
  const LILY_GLOBAL ST* B = reinterpret_cast<const LILY_GLOBAL ST*>( \
      P + lily_pw_round((ROWS) * (WROW)) + lily_pw_round(((ROWS) * (SROW) * sizeof(ST) + 3) / 4))
