// A small C++ stand-in for the Metal Shading Language, enough for lily_mlx's kernels.
//
// Default: declarations for `g++ -std=c++17 -fsyntax-only` (no Apple GPU exists in CI): address
// spaces are empty macros, vectors and half/bfloat are plain structs, simd/barrier calls type-check.
// With METAL_SHIM_SIM defined (-std=c++20): a SIMT emulator, one fiber per GPU thread
// on one OS thread, threadgroups run one after another, simdgroups of 32 exchange values through a
// barrier, and `threadgroup` arrays become function statics (shared by the running threadgroup's threads).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef METAL_SHIM_SIM
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) || defined(METAL_SIM_UCONTEXT)
#include <ucontext.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
#endif

// Standard headers come first: `thread` and friends are empty macros from here on.
#define device
#define constant
#define thread
#ifdef METAL_SHIM_SIM
#define threadgroup static
#define LILY_TG_PTR  // a pointer parameter into threadgroup memory: a plain pointer here
#else
#define threadgroup
#endif

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // keep NaN a NaN
    } else {
      bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
    }
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
typedef bfloat bfloat16_t;
typedef half float16_t;

template <typename T, int N>
struct vec;

#define METAL_SHIM_VEC_OPS(N)                                                        \
  T& operator[](int i) { return (&x)[i]; }                                           \
  const T& operator[](int i) const { return (&x)[i]; }                               \
  friend vec operator+(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] += b[i]; return a; } \
  friend vec operator-(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] -= b[i]; return a; } \
  friend vec operator*(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] *= b[i]; return a; } \
  friend vec operator*(vec a, T s) { for (int i = 0; i < N; ++i) a[i] *= s; return a; }             \
  vec& operator+=(const vec& b) { for (int i = 0; i < N; ++i) (*this)[i] += b[i]; return *this; }

template <typename T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  explicit vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  METAL_SHIM_VEC_OPS(2)
};
template <typename T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  METAL_SHIM_VEC_OPS(3)
};
template <typename T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  METAL_SHIM_VEC_OPS(4)
};

#define METAL_SHIM_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;          \
  typedef vec<T, 3> name##3;          \
  typedef vec<T, 4> name##4;
METAL_SHIM_VEC_TYPES(float, float)
METAL_SHIM_VEC_TYPES(half, half)
METAL_SHIM_VEC_TYPES(bfloat, bfloat)
METAL_SHIM_VEC_TYPES(int, int)
METAL_SHIM_VEC_TYPES(uint, uint)
METAL_SHIM_VEC_TYPES(short, short)
METAL_SHIM_VEC_TYPES(ushort, ushort)
METAL_SHIM_VEC_TYPES(uchar, uchar)

template <typename To, typename From>
inline To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To r;
  std::memcpy(&r, &v, sizeof(To));
  return r;
}

// Metal's atomic_int and its explicit operations (relaxed is the only order its atomics take; fences take seq_cst).
typedef std::atomic<int> atomic_int;
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum thread_scope { thread_scope_threadgroup, thread_scope_device };
#ifdef METAL_SHIM_SIM
namespace metal_sim {
inline void atomic_written();  // the emulator's scheduler: a write is progress; a spin on a load must let others run
inline void atomic_polled();
}  // namespace metal_sim
#define METAL_SIM_HOOK(call) call
#else
#define METAL_SIM_HOOK(call)
#endif
inline int atomic_fetch_add_explicit(atomic_int* p, int v, memory_order) {
  METAL_SIM_HOOK(metal_sim::atomic_written());
  return p->fetch_add(v, std::memory_order_relaxed);
}
inline int atomic_load_explicit(atomic_int* p, memory_order) {
  METAL_SIM_HOOK(metal_sim::atomic_polled());
  return p->load(std::memory_order_relaxed);
}
inline void atomic_store_explicit(atomic_int* p, int v, memory_order) {
  METAL_SIM_HOOK(metal_sim::atomic_written());
  p->store(v, std::memory_order_relaxed);
}

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<int>(a) | static_cast<int>(b));
}
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope) { std::atomic_thread_fence(std::memory_order_seq_cst); }

namespace metal {
using std::abs;
using std::ceil;
using std::cos;
using std::exp;
using std::exp2;
using std::floor;
using std::fma;
using std::isinf;
using std::isnan;
using std::log;
using std::log2;
using std::pow;
using std::sin;
using std::sqrt;
using std::tanh;
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
template <typename T> inline T clamp(T v, T lo, T hi) { return min(max(v, lo), hi); }
inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
inline float fast_exp(float v) { return std::exp(v); }
namespace precise {
using std::cos;
using std::exp;
using std::exp2;
using std::sin;
using std::sqrt;
inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
}  // namespace precise
namespace fast {
using std::exp;
using std::sqrt;
inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
}  // namespace fast
}  // namespace metal
using namespace metal;

#ifndef METAL_SHIM_SIM

template <typename T> T simd_sum(T v) { return v; }
template <typename T> T simd_max(T v) { return v; }
template <typename T> T simd_min(T v) { return v; }
template <typename T> T simd_shuffle_xor(T v, ushort) { return v; }
template <typename T> T simd_shuffle(T v, ushort) { return v; }
template <typename T> T simd_broadcast(T v, ushort) { return v; }
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}

template <typename T, int R, int C>
struct simdgroup_matrix {
  vec<T, 2> elems;
  vec<T, 2>& thread_elements() { return elems; }
};
template <typename T>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>&, const simdgroup_matrix<T, 8, 8>&,
                                   const simdgroup_matrix<T, 8, 8>&, const simdgroup_matrix<T, 8, 8>&) {}

#else  // the emulator

namespace metal_sim {

// Cooperative scheduling: a fiber runs until it waits (a barrier, a spin on an atomic), then the scheduler resumes the
// next one. OS threads, one per GPU thread, spent most of an emulated run in the kernel's scheduler.
struct Barrier {
  int n = 0, arrived = 0;
  unsigned generation = 0;
};

struct Simdgroup {
  explicit Simdgroup(int lanes) { bar.n = lanes; }
  Barrier bar;
  alignas(8) unsigned char slot[32][8];
};

struct Thread {
  int lane = 0;
  Simdgroup* simd = nullptr;
  Barrier* group = nullptr;
};

// A fiber's stack, with a guard page below it so that an overflow faults instead of overwriting a neighbour.
constexpr size_t kStackBytes = 256 << 10;
struct Stack {
  Stack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    base = static_cast<char*>(mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base == MAP_FAILED) { std::perror("metal_sim: fiber stack"); std::abort(); }
    mprotect(base, page, PROT_NONE);
    top = base + page;
    bytes = kStackBytes + page;
  }
  ~Stack() { munmap(base, bytes); }
  Stack(const Stack&) = delete;
  char *base, *top;
  size_t bytes;
};

#if defined(__x86_64__) && !defined(METAL_SIM_UCONTEXT)
// Saves the callee-saved registers on the current stack, stores its pointer in *from, and restores `to`'s. glibc's
// swapcontext also saves the signal mask, a system call per switch: half of an emulated run.
extern "C" void metal_sim_switch(void** from, void* to);
asm(R"(
  .text
  .p2align 4
  .type metal_sim_switch, @function
metal_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size metal_sim_switch, .-metal_sim_switch
)");
struct Context {
  void* sp = nullptr;
};
inline void switch_to(Context& from, Context& to) { metal_sim_switch(&from.sp, to.sp); }
// A stack that metal_sim_switch's pops and ret turn into a call of entry (which never returns) at ABI alignment.
inline void prepare(Context& c, Stack& stack, void (*entry)()) {
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack.top + kStackBytes) & ~uintptr_t(15));
  *--top = 0;
  *--top = reinterpret_cast<uintptr_t>(entry);
  for (int r = 0; r < 6; ++r) *--top = 0;
  c.sp = top;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void prepare(Context& c, Stack& stack, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack.top;
  c.uc.uc_stack.ss_size = kStackBytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// Values a kernel may ask for by attribute name; uint3 members index x, y, z.
struct Ids {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threadgroups_per_grid, threads_per_threadgroup, threads_per_grid, grid_size;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
};

struct Fiber {
  Context context;
  Thread state;
  Ids ids;
  bool done = false;
};

inline Fiber* current = nullptr;  // the running fiber
inline Thread self;               // its state; the scheduler copies it in before each resume
inline Context scheduler;         // where a fiber goes when it waits or ends
inline unsigned long events = 0;  // arrivals, completed fibers, atomic writes: passes of the scheduler without one
constexpr int kDeadlockPasses = 1000;  // mean a deadlock

inline unsigned polls = 0;  // atomic loads since the running fiber was resumed

inline void yield() { switch_to(current->context, scheduler); }
inline void atomic_written() { ++events; }
inline void atomic_polled() {  // a fiber that keeps loading is spinning: it waits for another one
  if (++polls > 64) yield();
}

inline void arrive_and_wait(Barrier& b) {
  ++events;
  const unsigned generation = b.generation;
  if (++b.arrived == b.n) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == generation) yield();
}

// Every lane publishes its value, all wait, each reads what it needs, all wait again.
template <typename T, typename F>
T exchange(T v, F&& combine) {
  static_assert(sizeof(T) <= 8, "simd exchange of a value over 8 bytes");
  std::memcpy(self.simd->slot[self.lane], &v, sizeof(T));
  arrive_and_wait(self.simd->bar);
  T r = combine();
  arrive_and_wait(self.simd->bar);
  return r;
}
template <typename T>
T lane_value(int lane) {
  T r;
  std::memcpy(&r, self.simd->slot[lane], sizeof(T));
  return r;
}

inline const std::function<void(const Ids&)>* kernel = nullptr;

inline void fiber_main() {
  Fiber* f = current;
  (*kernel)(f->ids);
  f->done = true;
  ++events;
  switch_to(f->context, scheduler);  // never resumed
  std::abort();
}

// Runs fn for every thread of a dispatch_threads(grid, group) launch, threadgroups one after another, in index order
// or, with `reversed`, last first (a kernel that orders its threadgroups must not depend on their indices) and each
// group's threads resumed last first (a thread reading another's write with no barrier between sees the old value in
// one of the two orders).
inline void launch(uint3 grid, uint3 group, const std::function<void(const Ids&)>& fn, bool reversed = false) {
  const uint3 groups((grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y,
                     (grid.z + group.z - 1) / group.z);
  const int n = static_cast<int>(group.x * group.y * group.z);
  const int nsimd = (n + 31) / 32;
  std::vector<Stack> stacks(n);
  std::vector<Fiber> fibers(n);
  kernel = &fn;
  for (uint iz = 0; iz < groups.z; ++iz)
    for (uint iy = 0; iy < groups.y; ++iy)
      for (uint ix = 0; ix < groups.x; ++ix) {
        const uint gx = reversed ? groups.x - 1 - ix : ix;
        const uint gy = reversed ? groups.y - 1 - iy : iy;
        const uint gz = reversed ? groups.z - 1 - iz : iz;
        Barrier bar;
        bar.n = n;
        std::vector<Simdgroup> simds;
        simds.reserve(nsimd);
        for (int s = 0; s < nsimd; ++s) simds.emplace_back(std::min(32, n - 32 * s));
        for (int t = 0; t < n; ++t) {
          Fiber& f = fibers[t];
          Ids& ids = f.ids;
          const uint3 local(t % group.x, (t / group.x) % group.y, t / (group.x * group.y));
          ids.thread_position_in_threadgroup = local;
          ids.threadgroup_position_in_grid = uint3(gx, gy, gz);
          ids.thread_position_in_grid = uint3(gx * group.x + local.x, gy * group.y + local.y, gz * group.z + local.z);
          ids.threadgroups_per_grid = groups;
          ids.threads_per_threadgroup = group;
          ids.threads_per_grid = grid;
          ids.grid_size = grid;
          ids.thread_index_in_threadgroup = t;
          ids.thread_index_in_simdgroup = t % 32;
          ids.simdgroup_index_in_threadgroup = t / 32;
          ids.simdgroups_per_threadgroup = nsimd;
          ids.threads_per_simdgroup = 32;
          ids.thread_execution_width = 32;
          f.state = Thread{t % 32, &simds[t / 32], &bar};
          f.done = false;
          prepare(f.context, stacks[t], fiber_main);
        }
        for (int live = n, idle = 0; live > 0;) {
          const unsigned long before = events;
          for (int i = 0; i < n; ++i) {
            Fiber& f = fibers[reversed ? n - 1 - i : i];
            if (f.done) continue;
            current = &f;
            self = f.state;
            polls = 0;
            switch_to(scheduler, f.context);
            live -= f.done;
          }
          idle = events == before ? idle + 1 : 0;
          if (live > 0 && idle == kDeadlockPasses) {
            std::fprintf(stderr, "metal_sim: threadgroup (%u, %u, %u) deadlocked: %d of %d threads wait at a barrier "
                         "or on an atomic that nothing will release\n", gx, gy, gz, live, n);
            std::abort();
          }
        }
      }
}

}  // namespace metal_sim

template <typename T>
T simd_sum(T v) {
  return metal_sim::exchange(v, [] {
    T acc = metal_sim::lane_value<T>(0);
    for (int l = 1; l < 32; ++l) acc = acc + metal_sim::lane_value<T>(l);
    return acc;
  });
}
template <typename T>
T simd_max(T v) {
  return metal_sim::exchange(v, [] {
    T acc = metal_sim::lane_value<T>(0);
    for (int l = 1; l < 32; ++l) acc = metal::max(acc, metal_sim::lane_value<T>(l));
    return acc;
  });
}
template <typename T>
T simd_min(T v) {
  return metal_sim::exchange(v, [] {
    T acc = metal_sim::lane_value<T>(0);
    for (int l = 1; l < 32; ++l) acc = metal::min(acc, metal_sim::lane_value<T>(l));
    return acc;
  });
}
template <typename T>
T simd_shuffle_xor(T v, ushort mask) {
  return metal_sim::exchange(v, [mask] { return metal_sim::lane_value<T>(metal_sim::self.lane ^ mask); });
}
template <typename T>
T simd_shuffle(T v, ushort lane) {
  return metal_sim::exchange(v, [lane] { return metal_sim::lane_value<T>(lane); });
}
template <typename T>
T simd_broadcast(T v, ushort lane) {
  return simd_shuffle(v, lane);
}
inline void threadgroup_barrier(mem_flags) { metal_sim::arrive_and_wait(*metal_sim::self.group); }
inline void simdgroup_barrier(mem_flags) { metal_sim::arrive_and_wait(metal_sim::self.simd->bar); }

// An 8 x 8 simdgroup matrix: each lane holds row fm, columns fn and fn + 1 (the layout MLX's steel GEMM uses,
// mlx/backend/metal/kernels/steel/gemm/mma.h), so a multiply gathers the 32 lanes' pairs.
template <typename T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the shim emulates 8 x 8 simdgroup matrices");
  vec<T, 2> elems;
  vec<T, 2>& thread_elements() { return elems; }
};
namespace metal_sim {
inline int frag_row(int lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline int frag_col(int lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }
template <typename T>
void gather_matrix(const vec<T, 2>& mine, float (&m)[8][8]) {
  vec<float, 2> v(static_cast<float>(mine.x), static_cast<float>(mine.y));
  std::memcpy(self.simd->slot[self.lane], &v, sizeof(v));
  arrive_and_wait(self.simd->bar);
  for (int l = 0; l < 32; ++l) {
    vec<float, 2> p;
    std::memcpy(&p, self.simd->slot[l], sizeof(p));
    m[frag_row(l)][frag_col(l)] = p.x;
    m[frag_row(l)][frag_col(l) + 1] = p.y;
  }
  arrive_and_wait(self.simd->bar);
}
}  // namespace metal_sim
template <typename T>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                                   const simdgroup_matrix<T, 8, 8>& b, const simdgroup_matrix<T, 8, 8>& c) {
  float A[8][8], B[8][8];
  metal_sim::gather_matrix(a.elems, A);
  metal_sim::gather_matrix(b.elems, B);
  const int r = metal_sim::frag_row(metal_sim::self.lane), c0 = metal_sim::frag_col(metal_sim::self.lane);
  vec<T, 2> out;
  for (int j = 0; j < 2; ++j) {
    float acc = static_cast<float>(c.elems[j]);
    for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c0 + j];
    out[j] = static_cast<T>(acc);
  }
  d.elems = out;
}

#endif
