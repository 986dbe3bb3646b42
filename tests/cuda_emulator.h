// CUDA-on-CPU emulation of generated TPP kernels (test support, not library code).
//
// tests/cuda_emulator.py compiles generated CUDA C sources with g++ after this header: the
// host versions of cuda_bf16.h / cuda_fp16.h provide the 16-bit types, this header provides
// the CUDA built-ins the generators use (threadIdx & co, qualifiers, warp intrinsics, device
// math names, the PTX wrappers of tpp_cuda/ptx.py) and `tpp_emu::launch<&kernel>`, which runs
// a grid:
//   * blocks run one after another (so a `__shared__` variable, a function-local static here,
//     is one object per block, and the dynamic shared memory buffer is reused);
//   * serial mode: the threads of a block run one after another on the calling OS thread
//     (kernels without any cooperation; a barrier or warp collective there is a fatal error);
//   * threaded mode: every CUDA thread of the block is an OS thread; __syncthreads is a block
//     barrier, warp collectives (shuffles, votes, __syncwarp, mma, ldmatrix) meet at a barrier
//     of the warp's lanes (linear thread ids x + y*bx + z*bx*by, 32 per warp).
// Collectives require every existing lane of the warp in `mask` (no divergent-subset masks).
// A lane or thread that returns early leaves the barriers of its block and warp.
#pragma once

#define TPP_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>

#include <math.h>
#include <stdint.h>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ------------------------------------------------------------------ qualifiers
// (the CUDA host headers already define __global__, __device__, __host__, __forceinline__
// as nothing / inline; all standard headers are included above, before __noinline__ changes)
#undef __shared__
#define __shared__ static          // one object: blocks run one at a time
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif

namespace tpp_emu {

[[noreturn]] inline void fatal(const char* what) {
  std::fprintf(stderr, "tpp cuda emulator: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

constexpr std::size_t kDynamicSmemBytes = 256 * 1024;
alignas(128) inline unsigned char dynamic_smem[kDynamicSmemBytes];

// A reusable barrier whose participants may leave (a thread that returned). Waiters sleep
// on an atomic generation counter (futex), so hundreds of threads on two cores are fine.
class Barrier {
 public:
  void reset(int participants) { expected_ = participants; arrived_ = 0; }
  void arrive_and_wait() {
    unsigned gen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      gen = gen_.load(std::memory_order_relaxed);
      if (++arrived_ == expected_) { release(); return; }
    }
    while (gen_.load(std::memory_order_acquire) == gen) gen_.wait(gen, std::memory_order_acquire);
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_;
    if (arrived_ > 0 && arrived_ == expected_) release();
  }

 private:
  void release() {
    arrived_ = 0;
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
  }
  std::mutex mutex_;
  int expected_ = 0, arrived_ = 0;
  std::atomic<unsigned> gen_{0};
};

// One warp's meeting point: its barrier and the staging slots of the collectives.
struct Warp {
  Barrier barrier;
  int lanes = 32;                       // lanes that exist (the last warp may be partial)
  unsigned long long value[32];         // shuffles and votes
  unsigned mma_a[32][4], mma_b[32][2];  // mma operands
  const void* row[32];                  // ldmatrix row addresses
  unsigned mask() const { return lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u; }
};

struct Block {
  Barrier barrier;
  std::vector<Warp> warps;
};

struct ThreadState {
  Block* block = nullptr;   // null: serial mode (no collectives possible)
  Warp* warp = nullptr;
  int lane = 0;
};
inline thread_local ThreadState self;

inline Warp& warp_of(const char* what, unsigned mask) {
  if (self.warp == nullptr) {
    std::fprintf(stderr, "tpp cuda emulator: %s in a kernel run in serial mode "
                         "(launch it with threaded=True)\n", what);
    std::abort();
  }
  Warp& w = *self.warp;
  if ((mask & w.mask()) != w.mask()) {
    std::fprintf(stderr, "tpp cuda emulator: %s with mask 0x%08x: only full-warp masks "
                         "(0x%08x) are emulated\n", what, mask, w.mask());
    std::abort();
  }
  return w;
}

// Deposit this lane's 64-bit value, meet the warp, return the whole warp's slots (valid until
// the caller's done() call, the second meeting, after which slots may be overwritten).
struct Exchange {
  Warp& w;
  Exchange(const char* what, unsigned mask, unsigned long long mine) : w(warp_of(what, mask)) {
    w.value[self.lane] = mine;
    w.barrier.arrive_and_wait();
  }
  unsigned long long operator[](int lane) const { return w.value[lane]; }
  ~Exchange() { w.barrier.arrive_and_wait(); }
};

template <class T>
unsigned long long to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of a type > 8 bytes");
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
T from_bits(unsigned long long bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// PTX shfl.sync source lane: segments of `width` lanes; out-of-segment sources read own lane.
enum class Shfl { idx, up, down, bfly };
inline int shfl_source(Shfl mode, int lane, int b, int width) {
  const int start = lane & ~(width - 1), end = start + width - 1;
  int j = lane;
  switch (mode) {
    case Shfl::idx: j = start + (b & (width - 1)); break;
    case Shfl::up: j = lane - b; if (j < start) j = lane; break;
    case Shfl::down: j = lane + b; if (j > end) j = lane; break;
    case Shfl::bfly: j = lane ^ b; if (j > end) j = lane; break;
  }
  return j;
}

template <class T>
T shuffle(const char* what, unsigned mask, T var, Shfl mode, int b, int width) {
  if (width < 1 || width > 32 || (width & (width - 1)))
    fatal("shuffle width must be a power of 2 in 1..32");
  Exchange ex(what, mask, to_bits(var));
  const int src = shfl_source(mode, self.lane, b, width);
  return from_bits<T>(src < ex.w.lanes ? ex[src] : ex[self.lane]);
}

inline unsigned ballot(const char* what, unsigned mask, int pred) {
  Exchange ex(what, mask, pred != 0);
  unsigned bits = 0;
  for (int l = 0; l < ex.w.lanes; ++l) bits |= unsigned(ex[l] != 0) << l;
  return bits;
}

// ------------------------------------------------------------------ 16-bit values
inline float bf16_bits_to_float(unsigned short h) {
  return std::bit_cast<float>(unsigned(h) << 16);
}

inline float f16_bits_to_float(unsigned short h) {
  const unsigned e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float v;
  if (e == 0) v = std::ldexp(float(m), -24);                      // zero / subnormal
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(float(m | 0x400), int(e) - 25);
  return (h & 0x8000) ? -v : v;
}

// ------------------------------------------------------------------ mma.m16n8k16
// PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" (.f16 / .bf16 A and B,
// .f32 C/D); groupID = laneid >> 2, threadID_in_group (t) = laneid % 4; element i of a
// fragment is the low (i even) or high (i odd) half of register i / 2:
//   A (16x16, row): row = groupID for a_i with i < 2 || 4 <= i < 6, groupID + 8 otherwise;
//                   col = t*2 + (i & 1) for i < 4, t*2 + (i & 1) + 8 for i >= 4
//     => a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B (16x8, col): row = t*2 + (i & 1) for b_i with i < 2, t*2 + (i & 1) + 8 for i >= 2;
//                  col = groupID  => b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C/D (16x8):    row = groupID for c_i with i < 2, groupID + 8 otherwise; col = t*2 + (i & 1)
inline unsigned short half_of(unsigned reg, int k) {
  return (unsigned short)(k & 1 ? reg >> 16 : reg);
}

inline unsigned short mma_a_bits(const Warp& w, int row, int k) {
  return half_of(w.mma_a[(row & 7) * 4 + ((k & 7) >> 1)][(row >> 3) + 2 * (k >> 3)], k);
}
inline unsigned short mma_b_bits(const Warp& w, int k, int col) {
  return half_of(w.mma_b[col * 4 + ((k & 7) >> 1)][k >> 3], k);
}

// D += A*B in f32: each product of two 16-bit values is exact in f32; the 16 products are
// added to the accumulator one at a time in k order, each sum rounded to f32 (the tensor
// cores' internal order and rounding may differ within a few ulps).
inline void mma_16816(const char* what, float (*to_float)(unsigned short), float d[4],
                      const unsigned a[4], const unsigned b[2]) {
  Warp& w = warp_of(what, 0xffffffffu);
  if (w.lanes != 32) fatal("mma needs a full warp of 32 lanes");
  std::memcpy(w.mma_a[self.lane], a, sizeof(w.mma_a[0]));
  std::memcpy(w.mma_b[self.lane], b, sizeof(w.mma_b[0]));
  w.barrier.arrive_and_wait();
  const int g = self.lane >> 2, t = self.lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k)
      acc += to_float(mma_a_bits(w, row, k)) * to_float(mma_b_bits(w, k, col));
    d[i] = acc;
  }
  w.barrier.arrive_and_wait();
}

// ------------------------------------------------------------------ ldmatrix
// PTX ISA, ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16: lanes 8j..8j+7 give the
// addresses of rows 0..7 of matrix j (16 contiguous bytes each); lane l receives in r[j] the
// row l/4, columns 2*(l%4) and 2*(l%4)+1 of matrix j (low half: the lower column). With .trans
// it receives the same positions of the transposed matrix: rows 2*(l%4) and 2*(l%4)+1, column
// l/4 of the stored matrix.
inline unsigned short row_elem(const Warp& w, int matrix, int row, int col) {
  unsigned short v;
  std::memcpy(&v, static_cast<const unsigned char*>(w.row[8 * matrix + row]) + 2 * col, 2);
  return v;
}

inline void ldmatrix(const char* what, int count, bool trans, unsigned* r, const void* row) {
  Warp& w = warp_of(what, 0xffffffffu);
  if (w.lanes != 32) fatal("ldmatrix needs a full warp of 32 lanes");
  w.row[self.lane] = row;
  w.barrier.arrive_and_wait();
  const int q = self.lane >> 2, c = 2 * (self.lane & 3);
  for (int j = 0; j < count; ++j) {
    const unsigned lo = trans ? row_elem(w, j, c, q) : row_elem(w, j, q, c);
    const unsigned hi = trans ? row_elem(w, j, c + 1, q) : row_elem(w, j, q, c + 1);
    r[j] = lo | (hi << 16);
  }
  w.barrier.arrive_and_wait();
}

// ------------------------------------------------------------------ the grid
using Body = void (*)(const unsigned long long* args);

struct Geometry {
  unsigned grid[3], block[3];
  unsigned long long shared_bytes;
  unsigned long long blocks() const { return 1ull * grid[0] * grid[1] * grid[2]; }
  int threads() const { return int(block[0] * block[1] * block[2]); }
};

inline uint3 unflatten(unsigned long long id, const unsigned dims[3]) {
  return uint3{unsigned(id % dims[0]), unsigned(id / dims[0] % dims[1]),
               unsigned(id / dims[0] / dims[1])};
}

}  // namespace tpp_emu

// ------------------------------------------------------------------ built-in variables
inline thread_local uint3 threadIdx, blockIdx;
inline uint3 blockDim, gridDim;
constexpr int warpSize = 32;

// ------------------------------------------------------------------ intrinsics
inline void __syncthreads() {
  if (tpp_emu::self.block == nullptr)
    tpp_emu::fatal("__syncthreads in a kernel run in serial mode (launch it with threaded=True)");
  tpp_emu::self.block->barrier.arrive_and_wait();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  tpp_emu::warp_of("__syncwarp", mask).barrier.arrive_and_wait();
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { tpp_emu::fatal("__trap()"); }

template <class T> T __shfl_sync(unsigned mask, T var, int src, int width = warpSize) {
  return tpp_emu::shuffle("__shfl_sync", mask, var, tpp_emu::Shfl::idx, src, width);
}
template <class T> T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return tpp_emu::shuffle("__shfl_up_sync", mask, var, tpp_emu::Shfl::up, int(delta), width);
}
template <class T> T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return tpp_emu::shuffle("__shfl_down_sync", mask, var, tpp_emu::Shfl::down, int(delta), width);
}
template <class T> T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return tpp_emu::shuffle("__shfl_xor_sync", mask, var, tpp_emu::Shfl::bfly, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return tpp_emu::ballot("__ballot_sync", mask, pred);
}
inline int __any_sync(unsigned mask, int pred) {
  return tpp_emu::ballot("__any_sync", mask, pred) != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  return tpp_emu::ballot("__all_sync", mask, pred) == tpp_emu::warp_of("__all_sync", mask).mask();
}
inline unsigned __activemask() { return tpp_emu::warp_of("__activemask", 0xffffffffu).mask(); }

template <class T> T __ldg(const T* p) { return *p; }

template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T> T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
  return expected;
}
template <class T> T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
  return old;
}
template <class T> T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {}
  return old;
}

// ------------------------------------------------------------------ device math names
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x > 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
using std::isinf;
using std::isnan;
using std::isfinite;
#define TPP_EMU_MINMAX(T)                                        \
  inline T min(T a, T b) { return b < a ? b : a; }               \
  inline T max(T a, T b) { return a < b ? b : a; }
TPP_EMU_MINMAX(int)
TPP_EMU_MINMAX(unsigned)
TPP_EMU_MINMAX(long long)
TPP_EMU_MINMAX(unsigned long long)
#undef TPP_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// ------------------------------------------------------------------ tpp_cuda/ptx.py wrappers
inline void tpp_mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
  tpp_emu::mma_16816("tpp_mma_bf16_16816", tpp_emu::bf16_bits_to_float, d, a, b);
}
inline void tpp_mma_f16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
  tpp_emu::mma_16816("tpp_mma_f16_16816", tpp_emu::f16_bits_to_float, d, a, b);
}
inline void tpp_ldmatrix_x1(unsigned r[1], const void* p) {
  tpp_emu::ldmatrix("tpp_ldmatrix_x1", 1, false, r, p);
}
inline void tpp_ldmatrix_x2(unsigned r[2], const void* p) {
  tpp_emu::ldmatrix("tpp_ldmatrix_x2", 2, false, r, p);
}
inline void tpp_ldmatrix_x4(unsigned r[4], const void* p) {
  tpp_emu::ldmatrix("tpp_ldmatrix_x4", 4, false, r, p);
}
inline void tpp_ldmatrix_x2_trans(unsigned r[2], const void* p) {
  tpp_emu::ldmatrix("tpp_ldmatrix_x2_trans", 2, true, r, p);
}
inline void tpp_ldmatrix_x4_trans(unsigned r[4], const void* p) {
  tpp_emu::ldmatrix("tpp_ldmatrix_x4_trans", 4, true, r, p);
}

// cp.async.cg.shared.global, 16 bytes, src_bytes of them read, the rest zero-filled; the
// emulator copies synchronously, so commit / wait_group are no-ops.
inline void tpp_cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  if (src_bytes < 0 || src_bytes > 16) tpp_emu::fatal("tpp_cp_async_16: src_bytes outside [0, 16]");
  unsigned char tmp[16] = {};
  std::memcpy(tmp, gmem_src, std::size_t(src_bytes));
  std::memcpy(smem_dst, tmp, 16);
}
inline void tpp_cp_async_commit() {}
template <int N> inline void tpp_cp_async_wait() {}

// ------------------------------------------------------------------ launching
namespace tpp_emu {

template <class T> T arg(unsigned long long v) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<std::uintptr_t>(v));
  } else {
    static_assert(std::is_integral_v<T> || std::is_enum_v<T>,
                  "emulated kernels take pointers and integers only");
    return static_cast<T>(v);
  }
}

template <class... P, std::size_t... I>
void call(void (*kernel)(P...), const unsigned long long* a, std::index_sequence<I...>) {
  kernel(arg<std::remove_cv_t<P>>(a[I])...);
}

template <class... P> constexpr int arity(void (*)(P...)) { return int(sizeof...(P)); }

template <auto Kernel> void body(const unsigned long long* a) {
  call(Kernel, a, std::make_index_sequence<arity(Kernel)>{});
}

inline void fill_smem(const Geometry& g, unsigned char byte) {
  std::memset(dynamic_smem, byte, g.shared_bytes);
}

inline void run_serial(Body body, const unsigned long long* args, const Geometry& g,
                       unsigned char fill) {
  self = ThreadState{};
  for (unsigned long long b = 0; b < g.blocks(); ++b) {
    blockIdx = unflatten(b, g.grid);
    fill_smem(g, fill);
    for (int t = 0; t < g.threads(); ++t) {
      threadIdx = unflatten(t, g.block);
      body(args);
    }
  }
}

// One OS thread per CUDA thread, for the whole grid: between two blocks every thread meets
// at `between`, whose completion step (one thread, the others held) readies the next block.
inline void run_threaded(Body body, const unsigned long long* args, const Geometry& g,
                         unsigned char fill) {
  const int threads = g.threads(), nwarps = (threads + 31) / 32;
  Block block;
  block.warps = std::vector<Warp>(nwarps);
  auto ready_block = [&]() noexcept {
    block.barrier.reset(threads);
    for (int w = 0; w < nwarps; ++w) {
      block.warps[w].lanes = std::min(32, threads - 32 * w);
      block.warps[w].barrier.reset(block.warps[w].lanes);
    }
    fill_smem(g, fill);
  };
  std::barrier between(threads, ready_block);
  auto worker = [&](int t) {
    self = ThreadState{&block, &block.warps[t / 32], t % 32};
    threadIdx = unflatten(t, g.block);
    for (unsigned long long b = 0; b < g.blocks(); ++b) {
      between.arrive_and_wait();
      blockIdx = unflatten(b, g.grid);
      body(args);
      self.warp->barrier.leave();
      block.barrier.leave();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& th : pool) th.join();
}

// geom: grid x, y, z, block x, y, z, dynamic shared bytes. mode bit 0: threaded; bit 1: fill
// the dynamic shared memory with 0xff bytes (NaN in f32, bf16, f16) before each block, else 0.
// Returns 0, or 1 when the geometry is unusable (message on stderr).
template <auto Kernel>
int launch(const unsigned long long* args, const unsigned long long* geom, int mode) {
  Geometry g{{unsigned(geom[0]), unsigned(geom[1]), unsigned(geom[2])},
             {unsigned(geom[3]), unsigned(geom[4]), unsigned(geom[5])}, geom[6]};
  if (g.shared_bytes > kDynamicSmemBytes) {
    std::fprintf(stderr, "tpp cuda emulator: %llu bytes of dynamic shared memory (at most %zu)\n",
                 g.shared_bytes, kDynamicSmemBytes);
    return 1;
  }
  blockDim = uint3{g.block[0], g.block[1], g.block[2]};
  gridDim = uint3{g.grid[0], g.grid[1], g.grid[2]};
  const unsigned char fill = (mode & 2) ? 0xff : 0x00;
  if (mode & 1) run_threaded(&body<Kernel>, args, g, fill);
  else run_serial(&body<Kernel>, args, g, fill);
  return 0;
}

}  // namespace tpp_emu
