// Standalone timing of the qmv variants (llm.c style): each kernels/scratch/qmv_vN.inc body (and the
// promoted ../qmv.inc) wrapped in the signature MLX's cuda_kernel writes, checked against a float64
// host reference with NaN-poisoned outputs, then timed with CUDA events over graph replays that
// rotate through enough weight copies to defeat the 60 MB L2. Prints one markdown row per run.
// Build: nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o qmv_bench qmv_bench.cu   (see run.sh)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../prelude_cuda.h"
#include "../prelude_common.h"

// v7: two 4-bit codes (bits 0-3 and 16-19 of u) as the bf16 pair 128 + q, one LOP3 with the constant in a register.
__device__ __forceinline__ uint32_t lily_code_pair(uint32_t u) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(u), "n"(0x000F000Fu), "r"(0x43004300u));  // (a & b) | c
  return r;
}

#define CK(call)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

struct Shape {  // what MLX passes as w_shape (cuda::std::array<int32_t, MAX_NDIM>)
  int32_t v[10];
  __device__ int32_t operator[](int i) const { return v[i]; }
};
typedef __nv_bfloat16 bf16;

#define QMV_TPARAMS typename T_, int BITS_, int GS_, int M_, int K_, int LANES_, int RPS_, int WARPS_
#define QMV_ARGS const T_* x, const uint32_t* w, const bf16* scales, const bf16* biases, \
                 const __grid_constant__ Shape w_shape, T_* y
#define QMV_CONSTS using T = T_; constexpr int BITS = BITS_, GS = GS_, M = M_, K = K_, LANES = LANES_, \
                   RPS = RPS_, WARPS = WARPS_;

template <QMV_TPARAMS> __global__ void qmv_v1(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v1.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v2(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v2.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v3(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v3.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v4(QMV_ARGS) {  // the promoted body, no norm or residual
  QMV_CONSTS
  constexpr bool NORM = false, RES = false;
  constexpr uint32_t EPS_BITS = 0;
  const T* nw = x;
  const T* res = x;
  const int x_ndim = 2;
  const int32_t x_shape[2] = {M, K};
#include "../entry_cuda.inc"
#include "../qmv.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v7(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v7.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v8(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v8.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v5(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v5.inc"
}
template <QMV_TPARAMS> __global__ void qmv_v6(QMV_ARGS) {
  QMV_CONSTS
#include "../entry_cuda.inc"
#include "qmv_v6.inc"
}

typedef void (*KernelFn)(const bf16*, const uint32_t*, const bf16*, const bf16*, Shape, bf16*);

// Read-bandwidth ceiling: every byte of a large buffer once, 16 bytes per load.
__global__ void read_peak(const uint4* p, size_t n, uint32_t* out) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads alive
}

struct Problem {
  int M, K, N, bits, gs, copies;
  size_t wwords, ngroups;
  std::vector<uint32_t> hw;
  std::vector<bf16> hs, hb, hx;
  std::vector<double> ref;
  uint32_t* dw;
  bf16 *ds, *db, *dx, *dy;
  double bytes;  // w + scales + biases + x + y, one call
};

static float bf(bf16 v) { return __bfloat162float(v); }

static Problem make_problem(int M, int K, int N, int bits, int gs, std::mt19937& rng) {
  Problem p{M, K, N, bits, gs};
  p.wwords = (size_t)N * K * bits / 32;
  p.ngroups = (size_t)N * (K / gs);
  p.bytes = p.wwords * 4.0 + p.ngroups * 4.0 + M * K * 2.0 + M * N * 2.0;
  p.copies = std::min(64, std::max(1, (int)std::ceil(240e6 / p.bytes)));  // > 4x the L2 where it can be
  p.hw.resize(p.wwords);
  p.hs.resize(p.ngroups);
  p.hb.resize(p.ngroups);
  p.hx.resize((size_t)M * K);
  std::uniform_int_distribution<uint32_t> u32;
  std::normal_distribution<float> nd;
  for (auto& v : p.hw) v = u32(rng);
  for (size_t i = 0; i < p.ngroups; ++i) {
    p.hs[i] = __float2bfloat16(0.01f + 0.002f * std::fabs(nd(rng)));
    p.hb[i] = __float2bfloat16(-0.08f + 0.01f * nd(rng));
  }
  for (auto& v : p.hx) v = __float2bfloat16(nd(rng));
  p.ref.assign((size_t)M * N, 0.0);
  const int cpw = 32 / bits, wpr = K / cpw;
  for (int n = 0; n < N; ++n)
    for (int m = 0; m < M; ++m) {
      double acc = 0;
      for (int wi = 0; wi < wpr; ++wi) {
        const uint32_t q = p.hw[(size_t)n * wpr + wi];
        const size_t g = (size_t)n * (K / gs) + (size_t)wi * cpw / gs;
        const double s = bf(p.hs[g]), b = bf(p.hb[g]);
        for (int c = 0; c < cpw; ++c)
          acc += (s * ((q >> (bits * c)) & ((1u << bits) - 1)) + b) * bf(p.hx[(size_t)m * K + wi * cpw + c]);
      }
      p.ref[(size_t)m * N + n] = acc;
    }
  CK(cudaMalloc(&p.dw, p.wwords * 4 * p.copies));
  CK(cudaMalloc(&p.ds, p.ngroups * 2 * p.copies));
  CK(cudaMalloc(&p.db, p.ngroups * 2 * p.copies));
  CK(cudaMalloc(&p.dx, p.hx.size() * 2));
  CK(cudaMalloc(&p.dy, (size_t)M * N * 2 * p.copies));
  for (int c = 0; c < p.copies; ++c) {
    CK(cudaMemcpy(p.dw + c * p.wwords, p.hw.data(), p.wwords * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.ds + c * p.ngroups, p.hs.data(), p.ngroups * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.db + c * p.ngroups, p.hb.data(), p.ngroups * 2, cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(p.dx, p.hx.data(), p.hx.size() * 2, cudaMemcpyHostToDevice));
  return p;
}

static void free_problem(Problem& p) {
  CK(cudaFree(p.dw));
  CK(cudaFree(p.ds));
  CK(cudaFree(p.db));
  CK(cudaFree(p.dx));
  CK(cudaFree(p.dy));
}

static double g_peak = 0;

// Check one launch against the reference, then time graph replays; returns microseconds per call.
static void run(const char* variant, const char* config, KernelFn fn, Problem& p, int blocks, int threads) {
  Shape shp{};
  shp.v[0] = p.N;
  shp.v[1] = p.K * p.bits / 32;
  CK(cudaMemset(p.dy, 0xff, (size_t)p.M * p.N * 2));  // bf16 0xffff is NaN: unwritten outputs show
  fn<<<blocks, threads>>>(p.dx, p.dw, p.ds, p.db, shp, p.dy);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<bf16> hy((size_t)p.M * p.N);
  CK(cudaMemcpy(hy.data(), p.dy, hy.size() * 2, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  bool nan = false;
  for (size_t i = 0; i < hy.size(); ++i) {
    const double v = bf(hy[i]);
    nan |= std::isnan(v);
    num += (v - p.ref[i]) * (v - p.ref[i]);
    den += p.ref[i] * p.ref[i];
  }
  const double err = nan ? NAN : std::sqrt(num / den);

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int reps = std::max(p.copies, 40);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < reps; ++r) {
    const int c = r % p.copies;
    fn<<<blocks, threads, 0, st>>>(p.dx, p.dw + c * p.wwords, p.ds + c * p.ngroups, p.db + c * p.ngroups, shp,
                                    p.dy + (size_t)c * p.M * p.N);
  }
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaGraphLaunch(exec, st));  // warm-up
  std::vector<float> ts;
  for (int i = 0; i < 7; ++i) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  const double us = ts[ts.size() / 2] * 1e3 / reps;
  const double tbs = p.bytes / (us * 1e-6) / 1e12;
  std::printf("| %dx%d->%d b%d g%d | %s | %s | %d x %d | %.2f | %.2f | %.0f%% | %.1e |\n", p.M, p.K, p.N, p.bits, p.gs,
              variant, config, blocks, threads, us, tbs, 100 * tbs / g_peak, err);
  std::fflush(stdout);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(st));
}

static int cdiv(int a, int b) { return (a + b - 1) / b; }

// Production planning, as lily_mlx/ops/qmv.py plan(): rows per block and a capped persistent grid.
template <int BITS, int GS, int M, int K, int LANES, int RPS, int WARPS>
static void run_v(const char* variant, KernelFn fn, Problem& p, int cap) {
  const int rows_block = WARPS * (32 / LANES) * RPS;
  const int blocks = std::min(cdiv(p.N, rows_block), cap);
  char cfg[96];
  std::snprintf(cfg, sizeof cfg, "L%d R%d W%d cap%d", LANES, RPS, WARPS, cap);
  run(variant, cfg, fn, p, blocks, 32 * WARPS);
}

// v7's shape: 16-row tiles (RPS a warp), its WARPS splitting K.
template <int BITS, int GS, int M, int K, int RPS, int WARPS>
static void run_v7(KernelFn fn, Problem& p, int cap) {
  const int blocks = std::min(cdiv(p.N, 16 * RPS), cap);
  char cfg[96];
  std::snprintf(cfg, sizeof cfg, "T16x%d KS%d cap%d", RPS, WARPS, cap);
  run("v7", cfg, fn, p, blocks, 32 * WARPS);
}

#define V(name, B, G, MM, KK, L, R, W) \
  (KernelFn) qmv_##name<bf16, B, G, MM, KK, L, R, W>

template <int BITS, int GS, int M, int K, int LANES, int RPS, int WARPS>
static void all_variants(Problem& p, int cap) {
  {  // v1: one warp per row, 8 warps per block, every row its own warp
    const int blocks = cdiv(p.N, 8);
    run("v1", "warp/row W8", V(v1, BITS, GS, M, K, LANES, RPS, 8), p, blocks, 256);
  }
  run_v<BITS, GS, M, K, LANES, RPS, WARPS>("v2", V(v2, BITS, GS, M, K, LANES, RPS, WARPS), p, 1 << 30);
  run_v<BITS, GS, M, K, LANES, RPS, WARPS>("v3", V(v3, BITS, GS, M, K, LANES, RPS, WARPS), p, 1 << 30);
  run_v<BITS, GS, M, K, LANES, RPS, WARPS>("v4", V(v4, BITS, GS, M, K, LANES, RPS, WARPS), p, 1 << 30);
  if (cap < (1 << 30)) run_v<BITS, GS, M, K, LANES, RPS, WARPS>("v4", V(v4, BITS, GS, M, K, LANES, RPS, WARPS), p, cap);
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  {  // read ceiling over 4 GiB, and a device-to-device copy for reference
    const size_t bytes = 4ull << 30;
    uint4* buf;
    uint32_t* sink;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(buf, 1, bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float best = 1e9;
    for (int i = 0; i < 6; ++i) {
      CK(cudaEventRecord(e0));
      read_peak<<<prop.multiProcessorCount * 8, 512>>>(buf, bytes / 16, sink);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i) best = std::min(best, ms);
    }
    g_peak = bytes / (best * 1e-3) / 1e12;
    float cbest = 1e9;
    for (int i = 0; i < 4; ++i) {
      CK(cudaEventRecord(e0));
      CK(cudaMemcpyAsync(buf, reinterpret_cast<char*>(buf) + bytes / 2, bytes / 2, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i) cbest = std::min(cbest, ms);
    }
    std::printf("read peak %.2f TB/s (4 GiB, 16-byte loads); D2D copy %.2f TB/s (read+write)\n", g_peak,
                bytes / (cbest * 1e-3) / 1e12);
    CK(cudaFree(buf));
    CK(cudaFree(sink));
  }
  std::printf("\n| shape | variant | config | grid | us | TB/s | %% peak | rel err |\n|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(0);
  // Round 1 (v1..v4, sweeps) is in NOTES.md; round 2 compares v3..v6 where it matters.
#define RV(name, B, G, MM, KK, L, R, W, cap) run_v<B, G, MM, KK, L, R, W>(#name, V(name, B, G, MM, KK, L, R, W), p, cap)
  const int ALL = 1 << 30;
  if (std::getenv("QMV_ROUND1")) {
    Problem p = make_problem(1, 2048, 8192, 4, 64, rng);
    all_variants<4, 64, 1, 2048, 32, 4, 8>(p, ALL);
    free_problem(p);
  }
  if (std::getenv("QMV_ROUND2")) {  // round 2 (NOTES.md): v3..v6
    {
      Problem p = make_problem(1, 2048, 8192, 4, 64, rng);
      RV(v3, 4, 64, 1, 2048, 32, 4, 8, ALL);
      RV(v4, 4, 64, 1, 2048, 32, 4, 8, ALL);
      RV(v5, 4, 64, 1, 2048, 32, 4, 8, ALL);
      RV(v6, 4, 64, 1, 2048, 32, 4, 8, 132);
      RV(v6, 4, 64, 1, 2048, 32, 4, 8, 264);
      RV(v6, 4, 64, 1, 2048, 32, 2, 8, 264);
      RV(v6, 4, 64, 1, 2048, 32, 4, 4, 264);
      RV(v6, 4, 64, 1, 2048, 32, 2, 4, 396);
      free_problem(p);
    }
    {
      Problem p = make_problem(1, 2048, 248320, 4, 64, rng);
      RV(v4, 4, 64, 1, 2048, 32, 4, 8, 528);
      RV(v4, 4, 64, 1, 2048, 32, 4, 4, 1056);
      RV(v5, 4, 64, 1, 2048, 32, 4, 8, 528);
      RV(v5, 4, 64, 1, 2048, 32, 4, 4, 1056);
      RV(v6, 4, 64, 1, 2048, 32, 4, 8, 264);
      RV(v6, 4, 64, 1, 2048, 32, 4, 8, 528);
      RV(v6, 4, 64, 1, 2048, 32, 4, 4, 528);
      RV(v6, 4, 64, 1, 2048, 32, 4, 4, 1056);
      RV(v6, 4, 64, 1, 2048, 32, 2, 4, 1056);
      free_problem(p);
    }
    {
      Problem p = make_problem(1, 4096, 2048, 4, 64, rng);
      RV(v4, 4, 64, 1, 4096, 32, 1, 8, ALL);
      RV(v5, 4, 64, 1, 4096, 32, 1, 8, ALL);
      RV(v6, 4, 64, 1, 4096, 32, 1, 8, 132);
      RV(v6, 4, 64, 1, 4096, 32, 1, 4, 264);
      free_problem(p);
    }
    {
      Problem p = make_problem(1, 512, 2048, 4, 64, rng);
      RV(v4, 4, 64, 1, 512, 16, 1, 4, ALL);
      RV(v5, 4, 64, 1, 512, 16, 1, 4, ALL);
      free_problem(p);
    }
    {
      Problem p = make_problem(1, 2048, 512, 4, 64, rng);
      RV(v4, 4, 64, 1, 2048, 32, 1, 4, ALL);
      RV(v5, 4, 64, 1, 2048, 32, 1, 4, ALL);
      RV(v5, 4, 64, 1, 2048, 32, 1, 2, ALL);
      free_problem(p);
    }
    {
      Problem p = make_problem(1, 2048, 1, 8, 64, rng);
      RV(v4, 8, 64, 1, 2048, 32, 1, 2, ALL);
      RV(v5, 8, 64, 1, 2048, 32, 1, 2, ALL);
      free_problem(p);
    }
  }
  // Round 3: v4 (the promoted body, plan()'s shape) against v7 (tensor cores) at the 35B decode shapes.
#define R7(B, G, MM, KK, R, W, cap) run_v7<B, G, MM, KK, R, W>(V(v7, B, G, MM, KK, 4, R, W), p, cap)
  {
    Problem p = make_problem(1, 2048, 8192, 4, 64, rng);
    RV(v4, 4, 64, 1, 2048, 32, 4, 8, ALL);
    R7(4, 64, 1, 2048, 1, 4, ALL);
    R7(4, 64, 1, 2048, 2, 4, ALL);
    R7(4, 64, 1, 2048, 1, 8, ALL);
    R7(4, 64, 1, 2048, 1, 2, ALL);
    RV(v8, 4, 64, 1, 2048, 32, 4, 8, ALL);
    RV(v8, 4, 64, 1, 2048, 32, 2, 8, ALL);
    free_problem(p);
  }
  {
    Problem p = make_problem(1, 2048, 12352, 4, 64, rng);
    RV(v4, 4, 64, 1, 2048, 32, 4, 8, ALL);
    R7(4, 64, 1, 2048, 1, 4, ALL);
    R7(4, 64, 1, 2048, 2, 4, ALL);
    R7(4, 64, 1, 2048, 1, 8, ALL);
    RV(v8, 4, 64, 1, 2048, 32, 4, 8, ALL);
    free_problem(p);
  }
  {
    Problem p = make_problem(1, 4096, 2048, 4, 64, rng);
    RV(v4, 4, 64, 1, 4096, 32, 1, 8, ALL);
    R7(4, 64, 1, 4096, 1, 4, ALL);
    R7(4, 64, 1, 4096, 1, 8, ALL);
    R7(4, 64, 1, 4096, 1, 16, ALL);
    RV(v8, 4, 64, 1, 4096, 32, 2, 4, ALL);
    RV(v8, 4, 64, 1, 4096, 32, 2, 8, ALL);
    free_problem(p);
  }
  {
    Problem p = make_problem(1, 2048, 512, 4, 64, rng);
    RV(v4, 4, 64, 1, 2048, 32, 1, 4, ALL);
    R7(4, 64, 1, 2048, 1, 4, ALL);
    R7(4, 64, 1, 2048, 1, 8, ALL);
    RV(v8, 4, 64, 1, 2048, 32, 2, 2, ALL);
    RV(v8, 4, 64, 1, 2048, 32, 2, 4, ALL);
    free_problem(p);
  }
  {
    Problem p = make_problem(1, 512, 2048, 4, 64, rng);
    RV(v4, 4, 64, 1, 512, 16, 1, 4, ALL);
    R7(4, 64, 1, 512, 1, 4, ALL);
    R7(4, 64, 1, 512, 1, 2, ALL);
    RV(v8, 4, 64, 1, 512, 32, 2, 4, ALL);
    free_problem(p);
  }
  {
    Problem p = make_problem(1, 2048, 8192, 4, 32, rng);
    R7(4, 32, 1, 2048, 1, 4, ALL);
    free_problem(p);
    p = make_problem(1, 2048, 8192, 4, 128, rng);
    R7(4, 128, 1, 2048, 1, 4, ALL);
    free_problem(p);
  }
  {
    Problem p = make_problem(1, 2048, 248320, 4, 64, rng);
    RV(v4, 4, 64, 1, 2048, 32, 4, 8, 528);
    RV(v4, 4, 64, 1, 2048, 32, 4, 4, 1056);
    R7(4, 64, 1, 2048, 1, 4, 528);
    R7(4, 64, 1, 2048, 1, 4, 1056);
    R7(4, 64, 1, 2048, 2, 4, 528);
    R7(4, 64, 1, 2048, 1, 8, 528);
    RV(v8, 4, 64, 1, 2048, 32, 4, 8, 528);
    RV(v8, 4, 64, 1, 2048, 32, 4, 4, 1056);
    free_problem(p);
  }
  {  // rows of x: v7's MMAs are the same for M <= 8 (B's columns)
    Problem p = make_problem(2, 2048, 8192, 4, 64, rng);
    RV(v4, 4, 64, 2, 2048, 32, 4, 8, ALL);
    R7(4, 64, 2, 2048, 1, 4, ALL);
    free_problem(p);
    p = make_problem(4, 2048, 8192, 4, 64, rng);
    RV(v4, 4, 64, 4, 2048, 32, 2, 8, ALL);
    R7(4, 64, 4, 2048, 1, 4, ALL);
    free_problem(p);
    p = make_problem(8, 2048, 8192, 4, 64, rng);
    R7(4, 64, 8, 2048, 1, 4, ALL);
    free_problem(p);
  }
  return 0;
}
