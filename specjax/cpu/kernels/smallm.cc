// Small-M matrix product for verification passes: y[M, N] = x[M, K] @ w[N, K]^T.
//
// Decoding and verification multiply a few rows (M = B * T <= 32) by large
// weight matrices, so the cost is reading the weights once. This kernel
// streams each weight row w[n, :] from memory exactly once and applies it to
// every row of x, which stays in cache (M * K floats). Output rows are split
// into chunks that XLA's intra-op thread pool and the calling thread claim
// with an atomic counter, so no thread waits on a task that never started.
//
// Built at first use by specjax/kernels/__init__.py with the host's compiler
// and -march=native; vector code comes from GCC/Clang vector extensions,
// which lower to AVX-512, AVX2 or NEON as the machine has, plus AVX-512
// intrinsics (VNNI, VBMI) where the compiler targets them, each with a
// portable fallback.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__F16C__) || defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one zmm register
constexpr int kRegisters = 32;
#else
constexpr int kLanes = 8;  // one ymm (AVX2) or two NEON registers
constexpr int kRegisters = 16;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x16 __attribute__((vector_size(64)));

// a * b + c for scalars and `vec`, rounded once where the machine has
// fused multiply-adds, else twice. The kernels are built with
// -ffp-contract=off, so a product and a sum fuse only here: left to the
// compiler, GCC's tuning for AMD cores (-march=znver3, for one) kept them
// apart in some accumulation chains and not others ("avoid FMA chains"),
// so tiles of different shapes rounded differently, and a verification
// pass no longer reproduced a decode step bit for bit.
template <typename V>
[[gnu::always_inline]] inline V madd(V a, V b, V c) {
  constexpr int n = sizeof(V) / sizeof(float);
#if defined(__AVX512F__)
  if constexpr (n == 16) {
    return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
  }
#endif
#if defined(__FMA__)
  if constexpr (n == 8) {
    return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
  }
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  if constexpr (n == 1) {
    return __builtin_fmaf(a, b, c);
  } else {
    V r;
    for (int i = 0; i < n; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
  }
#else
  return a * b + c;  // no fused multiply-add to contract to
#endif
}

// Sums by halves: a tree of log2(lanes) dependent adds, not a chain.
inline float hsum(f32x4 v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float hsum(f32x8 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3) +
              __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
inline float hsum(f32x16 v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// f(std::integral_constant<int, i>{}) for i = 0, ..., N - 1, unrolled in
// the source. A tile's accumulator array indexed only by such constants is
// split into registers early; indexed in a loop that GCC 12 unrolls late,
// the array kept a copy in memory, stored on every block (the int8 tile
// ran at 7 cycles per row and block instead of 4).
template <typename F, int... I>
[[gnu::always_inline]] inline void unroll_seq(
    F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
[[gnu::always_inline]] inline void unroll(F&& f) {
  unroll_seq(f, std::make_integer_sequence<int, N>{});
}

// Rows [0, R) of x against NB consecutive weight rows: NB * R vector
// accumulators, NB + R loads per NB * R fused multiply-adds.
template <int NB, int R>
void tile(const float* x, int64_t k, const float* w, float* y, int64_t ldy) {
  vec acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = vec{};
  const int64_t kv = k / kLanes * kLanes;
  // The next tile's rows follow this tile's in memory: prefetch them into L2
  // at the rate this tile consumes its own, one linear stream ahead.
  const char* ahead = reinterpret_cast<const char*>(w + NB * k);
  for (int64_t i = 0; i < kv; i += kLanes) {
    for (int j = 0; j < NB; ++j) {
      __builtin_prefetch(ahead + (i * NB + j * kLanes) * sizeof(float), 0, 2);
    }
    vec u[NB];
    for (int j = 0; j < NB; ++j) u[j] = load(w + j * k + i);
    for (int r = 0; r < R; ++r) {
      vec xr = load(x + r * k + i);
      for (int j = 0; j < NB; ++j) acc[j][r] = madd(u[j], xr, acc[j][r]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[j][r]);
      for (int64_t i = kv; i < k; ++i) s = madd(w[j * k + i], x[r * k + i], s);
      y[r * ldy + j] = s;
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
constexpr int kMaxRows = 12;  // x rows per tile
constexpr int kMaxBlock = 4;  // weight rows per tile

// Weight rows per tile for `rows` x rows: NB * rows accumulators plus NB
// weight vectors and one x vector fit the register file.
constexpr int block_for(int rows) {
  int nb = 1;
  while (nb < kMaxBlock && (nb + 1) * rows + (nb + 1) + 1 <= kRegisters) ++nb;
  return nb;
}

template <int NB>
constexpr TileFn kRow[kMaxRows + 1] = {
    nullptr,      tile<NB, 1>,  tile<NB, 2>,  tile<NB, 3>, tile<NB, 4>,
    tile<NB, 5>,  tile<NB, 6>,  tile<NB, 7>,  tile<NB, 8>, tile<NB, 9>,
    tile<NB, 10>, tile<NB, 11>, tile<NB, 12>};
// kTiles[nb][rows]: nb weight rows against `rows` x rows.
constexpr const TileFn* kTiles[kMaxBlock + 1] = {nullptr, kRow<1>, kRow<2>,
                                                 kRow<3>, kRow<4>};

// Output columns [n0, n1) for all M rows. Rows go in balanced groups of at
// most kMaxRows so the accumulators stay in registers; later groups re-read
// the tile's weight rows from cache, not memory.
void columns(const float* x, const float* w, float* y, int64_t m, int64_t k,
             int64_t n, int64_t n0, int64_t n1) {
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  // One tile width for every group, sized for the largest group.
  const int nb = block_for(static_cast<int>((m + groups - 1) / groups));
  for (int64_t j = n0; j < n1;) {
    const int width = j + nb <= n1 ? nb : 1;
    int64_t r0 = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = (m - r0) / (groups - g);  // balanced, <= kMaxRows
      kTiles[width][rows](x + r0 * k, k, w + j * k, y + r0 * n + j, n);
      r0 += rows;
    }
    j += width;
  }
}

// Chunks [0, count) of a product's output columns, claimed by the threads
// that run it. They are split into one run of consecutive chunks per
// thread, which that thread takes in order, so each thread streams its own
// weight rows from memory; a thread done with its run takes the next
// chunks of the others' runs. (With chunks dealt out alternately, each
// thread's weight stream jumped at every chunk and a two-thread product
// ran 12-20% slower than two one-thread halves.)
class Chunks {
 public:
  Chunks(int64_t count, int64_t threads)
      : count_(count),
        runs_(std::max<int64_t>(1, std::min(threads, count))),
        next_(new std::atomic<int64_t>[runs_]) {
    for (int64_t r = 0; r < runs_; ++r) next_[r] = start(r);
  }

  // Calls run(c) for chunks c not yet claimed: this thread's run first.
  template <typename F>
  void drain(F&& run) {
    const int64_t me = arrivals_.fetch_add(1) % runs_;
    for (int64_t i = 0; i < runs_; ++i) {
      const int64_t r = (me + i) % runs_, end = start(r + 1);
      for (int64_t c; (c = next_[r].fetch_add(1)) < end;) {
        run(c);
        finished_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  // Returns once every chunk has run (the ones left were claimed by
  // threads already running them).
  void wait() const {
    while (finished_.load(std::memory_order_acquire) < count_) {
    }
  }

 private:
  int64_t start(int64_t r) const { return r * count_ / runs_; }

  const int64_t count_, runs_;
  std::unique_ptr<std::atomic<int64_t>[]> next_;
  std::atomic<int64_t> arrivals_{0};
  std::atomic<int64_t> finished_{0};
};

// Runs work->drain() over num_chunks chunks (work->chunks) on the calling
// thread and up to pool.num_threads() - 1 of the pool's (one more would
// oversubscribe the cores XLA sized the pool for), and returns when all
// are done.
template <typename W>
void RunChunks(ffi::ThreadPool& pool, const std::shared_ptr<W>& work,
               int64_t num_chunks) {
  const int64_t helpers = std::max<int64_t>(
      0, std::min<int64_t>(pool.num_threads() - 1, num_chunks - 1));
  work->chunks = std::make_unique<Chunks>(num_chunks, helpers + 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work] { work->drain(); });
  }
  work->drain();
  work->chunks->wait();
}

// Computes output columns [n0, n1) of a float product for all M rows.
using ColumnsFn = void (*)(const float* x, const float* w, float* y,
                           int64_t m, int64_t k, int64_t n, int64_t n0,
                           int64_t n1);

struct Work {
  ColumnsFn run;
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, chunk;
  std::unique_ptr<Chunks> chunks;

  void drain() {
    chunks->drain([&](int64_t c) {
      const int64_t n0 = c * chunk;
      run(x, w, y, m, k, n, n0, std::min(n, n0 + chunk));
    });
  }
};

// The product's N output columns in chunks of `chunk`, `run` on the pool
// and the calling thread.
void RunProduct(ffi::ThreadPool& pool, ColumnsFn run, const float* x,
                const float* w, float* y, int64_t m, int64_t k, int64_t n,
                int64_t chunk) {
  if (m == 0 || n == 0) return;
  auto work = std::make_shared<Work>();
  work->run = run;
  work->x = x;
  work->w = w;
  work->y = y;
  work->m = m;
  work->k = k;
  work->n = n;
  work->chunk = chunk;
  RunChunks(pool, work, (n + chunk - 1) / chunk);
}

// y[m, n] = x[m, k] @ w[n, k]^T on the pool and the calling thread, in
// chunks of about 256 KiB of weights, a multiple of the tile's rows.
void Multiply(ffi::ThreadPool& pool, const float* x, const float* w, float* y,
              int64_t m, int64_t k, int64_t n) {
  RunProduct(pool, columns, x, w, y, m, k, n,
             std::max<int64_t>(kMaxBlock, (1 << 16) / std::max<int64_t>(k, 1)
                                              / kMaxBlock * kMaxBlock));
}

ffi::Error SmallMImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument(
        "specjax_smallm_matmul expects x [M, K] and w [N, K]");
  }
  Multiply(pool, x.typed_data(), w.typed_data(), y->typed_data(), xd[0],
           xd[1], wd[0]);
  return ffi::Error::Success();
}

// The product with w stored [K, N] (in, out) instead: y[m, n] = sum over k
// of x[m, k] * w[k, n], each output one chain of multiply-adds over k in
// order, whatever M and the tile, so a row's result does not depend on the
// other rows. A tile holds R x rows against V vectors of consecutive
// output columns in registers and reads w's row segment once per k for
// its R rows (`kInOutRows` * `kInOutVecs` accumulators).
constexpr int kInOutRows = 6;
constexpr int kInOutVecs = 4;

template <int R, int V>
void in_out_tile(const float* x, int64_t k, const float* w, int64_t n,
                 float* y) {
  vec acc[R][V];
  unroll<R>([&](auto r) { unroll<V>([&](auto v) { acc[r][v] = vec{}; }); });
  for (int64_t i = 0; i < k; ++i) {
    vec u[V];
    unroll<V>([&](auto v) { u[v] = load(w + i * n + v * kLanes); });
    unroll<R>([&](auto r) {
      const vec xr = vec{} + x[r * k + i];
      unroll<V>([&](auto v) { acc[r][v] = madd(xr, u[v], acc[r][v]); });
    });
  }
  unroll<R>([&](auto r) {
    unroll<V>([&](auto v) {
      std::memcpy(y + r * n + v * kLanes, &acc[r][v], sizeof(vec));
    });
  });
}

using InOutTileFn = void (*)(const float*, int64_t, const float*, int64_t,
                             float*);
template <int V>
constexpr InOutTileFn kInOutRow[kInOutRows + 1] = {
    nullptr,           in_out_tile<1, V>, in_out_tile<2, V>,
    in_out_tile<3, V>, in_out_tile<4, V>, in_out_tile<5, V>,
    in_out_tile<6, V>};

// Output columns [n0, n1) of y [M, N] = x [M, K] @ w [K, N] for all M rows:
// each tile of columns for every group of at most kInOutRows rows in turn,
// so that later groups read the tile's weights from cache. Columns past
// the last whole vector are summed one at a time, in the same order.
void in_out_columns(const float* x, const float* w, float* y, int64_t m,
                    int64_t k, int64_t n, int64_t n0, int64_t n1) {
  const auto groups = [&](auto&& run) {
    for (int64_t r0 = 0; r0 < m; r0 += kInOutRows) {
      run(static_cast<int>(std::min<int64_t>(kInOutRows, m - r0)), r0);
    }
  };
  int64_t j = n0;
  for (; j + kInOutVecs * kLanes <= n1; j += kInOutVecs * kLanes) {
    groups([&](int rows, int64_t r0) {
      kInOutRow<kInOutVecs>[rows](x + r0 * k, k, w + j, n, y + r0 * n + j);
    });
  }
  for (; j + kLanes <= n1; j += kLanes) {
    groups([&](int rows, int64_t r0) {
      kInOutRow<1>[rows](x + r0 * k, k, w + j, n, y + r0 * n + j);
    });
  }
  for (; j < n1; ++j) {
    for (int64_t r = 0; r < m; ++r) {
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s = madd(x[r * k + i], w[i * n + j], s);
      y[r * n + j] = s;
    }
  }
}

// y[m, n] = x[m, k] @ w[k, n] on the pool and the calling thread, in chunks
// of 256 output columns.
void MultiplyInOut(ffi::ThreadPool& pool, const float* x, const float* w,
                   float* y, int64_t m, int64_t k, int64_t n) {
  RunProduct(pool, in_out_columns, x, w, y, m, k, n, 256);
}

// Rows of x per pass over the weights in a layer loop's product: a pass
// reads each weight row once for this many x rows, which stay in L2.
constexpr int64_t kPickRows = 64;

// The same product with w the index-th of the remaining operands (one
// matrix per layer), or, with one remaining operand of rank 3, its
// index-th slab (a mixture of experts' stacked experts): a layer loop or an
// expert loop reads its matrix where it lies, where slicing a stacked
// array for XLA's dot would copy it. Matrices are [N, K], or with in_out
// [K, N] (MultiplyInOut). Any number of rows, in passes of kPickRows.
ffi::Error SmallMPickImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::S32> index, ffi::RemainingArgs ws,
                          ffi::ResultBuffer<ffi::F32> y, int64_t in_out) {
  const auto xd = x.dimensions();
  const int64_t layer = index.typed_data()[0];
  const bool stacked = ws.size() == 1;
  const char* kUsage =
      "specjax_smallm_pick expects x [M, K], a scalar index, and matrices "
      "[N, K] ([K, N] in_out; the index below their number) or one stack "
      "[L, N, K] ([L, K, N] in_out; the index below L)";
  if (xd.size() != 2 || index.element_count() != 1 || layer < 0 ||
      (!stacked && layer >= static_cast<int64_t>(ws.size()))) {
    return ffi::Error::InvalidArgument(kUsage);
  }
  auto w = ws.get<ffi::Buffer<ffi::F32>>(stacked ? 0 : layer);
  if (!w.has_value()) return w.error();
  const auto wd = w->dimensions();
  const float* base = w->typed_data();
  const int64_t rank = static_cast<int64_t>(wd.size());
  if (!((rank == 3 && stacked && layer < wd[0]) ||
        (rank == 2 && (!stacked || layer == 0)))) {
    return ffi::Error::InvalidArgument(kUsage);
  }
  const int64_t k = xd[1], m = xd[0];
  const int64_t in_dim = in_out ? wd[rank - 2] : wd[rank - 1];
  const int64_t n = in_out ? wd[rank - 1] : wd[rank - 2];
  if (in_dim != k) return ffi::Error::InvalidArgument(kUsage);
  if (rank == 3) base += layer * wd[1] * wd[2];
  for (int64_t r = 0; r < m; r += kPickRows) {
    const int64_t rows = std::min(kPickRows, m - r);
    (in_out ? MultiplyInOut : Multiply)(pool, x.typed_data() + r * k, base,
                                        y->typed_data() + r * n, rows, k, n);
  }
  return ffi::Error::Success();
}

// Quantized weights (specjax.models.quantized): codes [N, K] int8 (bits 8)
// or [N, K / 2] nibbles (bits 4, 5, 6; in each group of G, byte i holds
// element i in its low nibble and i + G/2 in its high one), for 5 and 6
// bits a plane of hb = bits - 4 high bits per element, [N, K * hb / 8]
// (byte b holds elements b * 8/hb + p at bit p * hb), and one scale (and
// min) per group of G inputs (GroupFactors: float, half, or the K-quants'
// two levels): w = (code - offset) * scale - min, with code = low | high
// << 4. Each weight row is read as packed bytes once. The nibble formats
// in groups of 16, 32 and 64 (with AVX-512 VNNI and VBMI) are unpacked in
// registers: ftile dequantises them exactly for float activations, gtile
// multiplies them by int8 activations (act8). Otherwise a row is unpacked
// into its codes, one byte each, in a buffer that stays in L1 (row_codes):
// with float activations the codes are dequantised there and the float
// tiles above apply them to every x row; with int8 activations qtile
// multiplies the codes by each row's int8 x directly.
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));
constexpr uint64_t kLowNibbles = 0x0f0f0f0f0f0f0f0full;
typedef int32_t i32x16 __attribute__((vector_size(64)));

// A byte of hb-bit high codes -> its 8 / hb elements' bytes, each shifted
// into bits 4 and up (element p of the byte at bit p * hb).
template <int HB, typename T>
constexpr std::array<T, 256> high_table() {
  std::array<T, 256> table{};
  for (int byte = 0; byte < 256; ++byte) {
    T out = 0;
    for (int p = 0; p < 8 / HB; ++p) {
      const T code = (byte >> (p * HB)) & ((1 << HB) - 1);
      out |= (code << 4) << (8 * p);
    }
    table[byte] = out;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kHigh2 = high_table<2, uint32_t>();
constexpr std::array<uint64_t, 256> kHigh1 = high_table<1, uint64_t>();

// int8 activations ("a8", as llama.cpp computes its quantized products):
// each x row is quantized per chunk of kChunk inputs, d = max|x| / 127 and
// q = round(x / d) (half to even), and a product sums code * q in int32
// over each 4 inputs (VNNI's vpdpbusd where the CPU has it).
constexpr int64_t kChunk = 64;
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));

// out[l] = sum over t < 4 of u[4l + t] * q[4l + t].
inline i32x16 dot_quads(u8x64 u, i8x64 q) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (i32x16)_mm512_dpbusd_epi32(_mm512_setzero_si512(), (__m512i)u,
                                     (__m512i)q);
#else
  i32x16 out;
  for (int l = 0; l < 16; ++l) {
    int32_t sum = 0;
    for (int t = 0; t < 4; ++t) {
      sum += int32_t{u[4 * l + t]} * int32_t{q[4 * l + t]};
    }
    out[l] = sum;
  }
  return out;
#endif
}

// Nibble formats with int8 activations (gtile below) read a block of
// kNibBlock elements as 64 packed bytes: byte b holds element
// nib_element(G, 0, b) in its low nibble and nib_element(G, 1, b) in its
// high one.
constexpr int64_t kNibBlock = 128;

// Element (block-relative) of lane b of part p (0: low nibbles, 1: high)
// of a block in group size G, where byte i of a group holds elements i and
// i + G / 2 (specjax.models.quantized's layout).
constexpr int nib_element(int group, int part, int b) {
  return b / (group / 2) * group + part * (group / 2) + b % (group / 2);
}

// gtile's lanes. It sums each group's dot-product lanes (eight in groups
// of 64, four in groups of 32, two in groups of 16), so that one
// conversion and one scaling serve a group, and fills the vector with
// several weight rows' sums: lane l of the sums belongs to group
// lane_group(G, l) of the block and weight row lane_row(G, l) of the tile
// (G = 32: group l / 4, row l % 4; G = 16: in each 128-bit lane L, row 0's
// groups 2L and 2L + 1, then row 1's; G = 64: group l / 8, one row). With
// one weight row a tile, its sums take the other rows' lanes too.
constexpr int lane_group(int64_t group, int l) {
  return group == 64 ? l / 8 : group == 32 ? l / 4 : 2 * (l / 4) + l % 2;
}
constexpr int lane_row(int64_t group, int l) {
  return group == 32 ? l % 4 : l % 4 / 2;
}

// One chunk of kChunk inputs as int8: codes q = round(x / d) (half to
// even, clamped to +-127) for d = max|x| / 127, as
// specjax.models.quantized.quantize_activations computes them; returns d
// and each 16 inputs' sum of codes in sums[kChunk / 16].
inline float quantize_chunk(const float* x, int8_t* q, int32_t* sums) {
#if defined(__AVX512F__)
  __m512 v[kChunk / 16];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < kChunk / 16; ++i) {
    v[i] = _mm512_loadu_ps(x + 16 * i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  const float d = _mm512_reduce_max_ps(amax) / 127.f;
  const __m512 dv = _mm512_set1_ps(d > 0.f ? d : 1.f);
  for (int i = 0; i < kChunk / 16; ++i) {
    __m512 c = _mm512_roundscale_ps(
        _mm512_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, _mm512_set1_ps(-127.f)),
                      _mm512_set1_ps(127.f));
    const __m512i ci = d > 0.f ? _mm512_cvtps_epi32(c) : _mm512_setzero_si512();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i),
                     _mm512_cvtsepi32_epi8(ci));
    sums[i] = _mm512_reduce_add_epi32(ci);
  }
  return d;
#else
  float amax = 0.f;
  for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  for (int64_t i = 0; i < kChunk; i += 16) {
    int32_t sum = 0;
    for (int64_t t = i; t < i + 16; ++t) {
      const float c = d > 0.f ? std::nearbyint(x[t] / d) : 0.f;
      q[t] = static_cast<int8_t>(std::clamp(c, -127.f, 127.f));
      sum += q[t];
    }
    sums[i / 16] = sum;
  }
  return d;
#endif
}

// x [M, K] as int8: q [M, K], d [M, K / kChunk], and each group's sum of
// q * d (the offset and min terms of the product) block-major, gsum
// [ceil(K / G / 16), M, 16], zero past K / G (finish_rows). For gtile
// (`nib`), also block-major, so that a tile's rows of one block lie
// together at offsets fixed at compile time: the codes in the order of
// each block's packed bytes, qp [K / kNibBlock, M, kNibBlock] (the low
// part's 64, then the high part's), and per lane of gtile's sums
// (lane_group), d, dl [K / kNibBlock, M, 16] (for G <= kChunk, lanes 0-7
// fall in the block's first chunk, 8-15 in its second), and the group
// sums, gl [K / kNibBlock, M, 16].
inline int64_t gsum_blocks(int64_t groups) { return (groups + 15) / 16; }

struct Act8 {
  std::unique_ptr<int8_t[]> q, qp;
  std::unique_ptr<float[]> d, gsum, dl, gl;
  int64_t m;

  Act8(const float* x, int64_t m, int64_t k, int64_t group, bool nib)
      : q(new int8_t[m * k]),
        d(new float[m * k / kChunk]),
        gsum(new float[m * gsum_blocks(k / group) * 16]()),
        m(m) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k / kChunk; ++c) {
        int32_t sums[kChunk / 16];
        const float dc = quantize_chunk(x + r * k + c * kChunk,
                                        q.get() + r * k + c * kChunk, sums);
        d[r * (k / kChunk) + c] = dc;
        for (int i = 0; i < kChunk / 16; ++i) {
          const int64_t g = (c * kChunk + 16 * i) / group;
          gsum[(g / 16 * m + r) * 16 + g % 16] += dc * sums[i];
        }
      }
    }
    if (nib) permute(k, static_cast<int>(group));
  }

  void permute(int64_t k, int group) {
    const int64_t blocks = k / kNibBlock;
    qp.reset(new int8_t[m * k]);
    dl.reset(new float[m * blocks * 16]);
    gl.reset(new float[m * blocks * 16]);
    std::array<uint8_t, kNibBlock> order;  // source element of each byte
    for (int part = 0; part < 2; ++part) {
      for (int i = 0; i < 64; ++i) {
        order[64 * part + i] =
            static_cast<uint8_t>(nib_element(group, part, i));
      }
    }
#if defined(__AVX512VBMI__)
    const __m512i lo_idx = _mm512_loadu_si512(order.data());
    const __m512i hi_idx = _mm512_loadu_si512(order.data() + 64);
#endif
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t r = 0; r < m; ++r) {
        const int8_t* src = q.get() + r * k + b * kNibBlock;
        int8_t* dst = qp.get() + (b * m + r) * kNibBlock;
#if defined(__AVX512VBMI__)
        const __m512i s0 = _mm512_loadu_si512(src);
        const __m512i s1 = _mm512_loadu_si512(src + 64);
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(s0, lo_idx, s1));
        _mm512_storeu_si512(dst + 64,
                            _mm512_permutex2var_epi8(s0, hi_idx, s1));
#else
        for (int i = 0; i < kNibBlock; ++i) dst[i] = src[order[i]];
#endif
        float* dlanes = dl.get() + (b * m + r) * 16;
        for (int l = 0; l < 16; ++l) {
          dlanes[l] = d[r * (k / kChunk) + 2 * b + l / 8];
        }
        float* glanes = gl.get() + (b * m + r) * 16;
        for (int l = 0; l < 16; ++l) {
          const int64_t g = b * (kNibBlock / group) + lane_group(group, l);
          glanes[l] = gsum[(g / 16 * m + r) * 16 + g % 16];
        }
      }
    }
  }
};

// y[r * ldy] for rows [r0, r0 + R) from their lane sums acc[r], less the
// offset and min terms: coef[g] (scale * offset + min, zero from K / G to
// a multiple of 16) times the group sums of q * d.
template <int R>
[[gnu::always_inline]] inline void finish_rows(
    f32x16* acc, const Act8& a, int64_t r0, int64_t groups, const float* coef,
    float* y, int64_t ldy) {
  const float* gs = a.gsum.get() + r0 * 16;
  for (int64_t g = 0; g < groups; g += 16, gs += a.m * 16) {
    f32x16 c;
    std::memcpy(&c, coef + g, sizeof(c));
    unroll<R>([&](auto r) {
      f32x16 sums;
      std::memcpy(&sums, gs + 16 * r, sizeof(sums));
      acc[r] -= c * sums;
    });
  }
  unroll<R>([&](auto r) { y[r * ldy] = hsum(acc[r]); });
}

// Lane l of a chunk's dot_quads covers inputs [4l, 4l + 4): the scale of
// its group, for LPG = G / 4 lanes a group (G = 16, 32), or one group for
// the whole chunk (LPG = 16: G >= 64).
template <int LPG>
inline f32x16 lane_scales(const float* s, int64_t c, int64_t group) {
  if constexpr (LPG == 4) {
#if defined(__AVX512F__)  // (GCC shuffles a loaded f32x4 through the stack)
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1,
                                         0, 0, 0, 0);
    return (f32x16)_mm512_permutexvar_ps(
        idx, _mm512_castps128_ps512(_mm_loadu_ps(s + 4 * c)));
#else
    f32x4 p;
    std::memcpy(&p, s + 4 * c, sizeof(p));
    return __builtin_shufflevector(p, p, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2,
                                   3, 3, 3, 3);
#endif
  } else if constexpr (LPG == 8) {
    // (Two broadcasts: a shuffle of a loaded pair goes through the stack.)
    const f32x16 a = f32x16{} + s[2 * c], b = f32x16{} + s[2 * c + 1];
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  } else {
    return f32x16{} + s[c * kChunk / group];
  }
}

// Rows [0, R) of the int8 activations against one weight row's codes u
// (element order, K bytes) and scales s: y[r] = sum over chunks of d[r, c]
// * sum over lanes of s * dot, less corr[r] (the offset and min terms).
template <int R, int LPG>
void qtile(const Act8& a, int64_t r0, int64_t k, int64_t group,
           const uint8_t* u, const float* s, const float* coef, float* y,
           int64_t ldy) {
  const int64_t chunks = k / kChunk, groups = k / group;
  const int8_t* q = a.q.get() + r0 * k;
  const float* d = a.d.get() + r0 * chunks;
  f32x16 acc[R];
  unroll<R>([&](auto r) { acc[r] = f32x16{}; });
  for (int64_t c = 0; c < chunks; ++c) {
    u8x64 uc;
    std::memcpy(&uc, u + c * kChunk, sizeof(uc));
    const f32x16 sc = lane_scales<LPG>(s, c, group);
    unroll<R>([&](auto r) {
      i8x64 qc;
      std::memcpy(&qc, q + r * k + c * kChunk, sizeof(qc));
      const f32x16 dot = __builtin_convertvector(dot_quads(uc, qc), f32x16);
      // Not fused: a chain of fused multiply-adds waits on their longer
      // latency (an AVX2 build tuned for Zen 3 ran 9 rows 1.1x slower).
      acc[r] += dot * (sc * d[r * chunks + c]);
    });
  }
  finish_rows<R>(acc, a, r0, groups, coef, y, ldy);
}

using QTileFn = void (*)(const Act8&, int64_t, int64_t, int64_t,
                         const uint8_t*, const float*, const float*, float*,
                         int64_t);
template <int LPG>
constexpr QTileFn kQRow[kMaxRows + 1] = {
    nullptr,          qtile<1, LPG>,  qtile<2, LPG>,  qtile<3, LPG>,
    qtile<4, LPG>,    qtile<5, LPG>,  qtile<6, LPG>,  qtile<7, LPG>,
    qtile<8, LPG>,    qtile<9, LPG>,  qtile<10, LPG>, qtile<11, LPG>,
    qtile<12, LPG>};

#if defined(__AVX512VBMI__)
// The HB-bit high codes of 64 elements (64 * HB / 8 bytes at h; element
// p of a byte at bit p * HB) ORed into bits 4 and up of u[0, 64): vpermb
// copies each byte to its elements' lanes and each lane tests its bits.
template <int HB>
inline void or_high64(const uint8_t* h, uint8_t* u) {
  constexpr int per = 8 / HB;  // elements per byte
  alignas(64) static constexpr auto masks = [] {
    std::array<std::array<uint8_t, 64>, 3> m{};
    for (int e = 0; e < 64; ++e) {
      m[0][e] = e / per;                       // source byte
      m[1][e] = 1u << (e % per * HB);          // the code's bit 0
      m[2][e] = HB == 2 ? 2u << (e % per * HB) : 0;  // bit 1
    }
    return m;
  }();
  const __m128i src =
      HB == 2 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(h))
              : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h));
  const __m512i lanes = _mm512_permutexvar_epi8(
      _mm512_load_si512(masks[0].data()), _mm512_castsi128_si512(src));
  __m512i v = _mm512_loadu_si512(u);
  v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(
      _mm512_test_epi8_mask(lanes, _mm512_load_si512(masks[1].data())),
      _mm512_set1_epi8(0x10)));
  if (HB == 2) {
    v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(
        _mm512_test_epi8_mask(lanes, _mm512_load_si512(masks[2].data())),
        _mm512_set1_epi8(0x20)));
  }
  _mm512_storeu_si512(u, v);
}
#endif

// The HB-bit high codes of one row of K elements (K * HB / 8 bytes at h)
// ORed into bits 4 and up of its codes u[0, K): 64 elements at a time
// where the CPU has VBMI, then 16 at a time through the kHigh tables.
template <int HB>
void or_high_row(const uint8_t* h, uint8_t* u, int64_t k) {
  int64_t e = 0;
#if defined(__AVX512VBMI__)
  for (; e + 64 <= k; e += 64, h += 8 * HB) or_high64<HB>(h, u + e);
#endif
  for (; e < k; e += 16, h += 2 * HB) {  // 16 elements: 2 * HB bytes
    u8x16 t;
    if constexpr (HB == 2) {
      const u32x4 w = {kHigh2[h[0]], kHigh2[h[1]], kHigh2[h[2]],
                       kHigh2[h[3]]};
      t = reinterpret_cast<const u8x16&>(w);
    } else {
      const u64x2 w = {kHigh1[h[0]], kHigh1[h[1]]};
      t = reinterpret_cast<const u8x16&>(w);
    }
    u8x16 v;
    std::memcpy(&v, u + e, 16);
    v |= t;
    std::memcpy(u + e, &v, 16);
  }
}

using GTileFn = void (*)(const Act8&, int64_t, int64_t, const uint8_t*,
                         const uint8_t*, const float*, int64_t, const float*,
                         int64_t, float*, int64_t);
// x rows a gtile of several weight rows takes: its accumulators, weight
// vectors and factors fit the 32 registers.
constexpr int kMultiMaxRows = 9;
// From this many x rows on, gtile takes several weight rows a tile: fewer
// rows are bound by reading the weights, which one row a tile reads in one
// stream, faster.
constexpr int64_t kMultiRows = 3;

// gtile by weight rows a tile: one[rows] (up to kMaxRows) and, where the
// format has them, multi[rows] (up to kMultiMaxRows), `width` weight rows
// a tile; one is null where gtile does not take the format.
struct GTiles {
  const GTileFn* one = nullptr;
  const GTileFn* multi = nullptr;
  int64_t width = 1;
};

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// Nibble formats in groups of 16, 32 or 64 (Q4_K, Q5_0, Q6_K, int4) with
// int8 activations, unpacked in registers (gtile below): a block's 64
// packed bytes give its low-nibble part and its high-nibble part with one
// AND and one shift, the high bits are merged in with a byte permute and
// a multishift, and each part's vpdpbusd multiplies the activations in the
// same order (Act8's qp). Elsewhere (no VNNI and VBMI, 8-bit codes, other
// groups) qtile serves, after unpacking each weight row into L1.

// The HB high bits of part P of a block in group size G, in bits 4 and up
// of each lane, from the block's 16 * HB high bytes in the low lanes of
// src: vpermb gathers each qword's HB source bytes (8 lanes are 8
// consecutive elements) and vpmultishiftqb moves each lane's bits.
template <int G, int HB, int P>
inline __m512i high_part(__m512i src) {
  alignas(64) static constexpr auto t = [] {
    std::array<std::array<uint8_t, 64>, 2> m{};
    for (int b = 0; b < 64; ++b) {
      const int e0 = nib_element(G, P, b / 8 * 8);
      m[0][b] = static_cast<uint8_t>(e0 * HB / 8 + (b % 8 < HB ? b % 8 : 0));
      m[1][b] = static_cast<uint8_t>((b % 8 * HB - 4) & 63);
    }
    return m;
  }();
  const __m512i bytes =
      _mm512_permutexvar_epi8(_mm512_load_si512(t[0].data()), src);
  return _mm512_and_si512(
      _mm512_multishift_epi64_epi8(_mm512_load_si512(t[1].data()), bytes),
      _mm512_set1_epi8(static_cast<char>(((1 << HB) - 1) << 4)));
}

// One block's 128 codes of a weight row: its 64 packed bytes at row, and
// for HB > 0 its 16 * HB high bytes at h -> the low part's (lo) and the
// high part's (hi), one code a byte.
template <int G, int HB>
[[gnu::always_inline]] inline void block_codes(const uint8_t* row,
                                               const uint8_t* h, __m512i* lo,
                                               __m512i* hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i packed = _mm512_loadu_si512(row);
  *lo = _mm512_and_si512(packed, nibble);
  *hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  if constexpr (HB > 0) {
    const __m512i src =
        HB == 1 ? _mm512_castsi128_si512(
                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(h)))
                : _mm512_castsi256_si512(_mm256_loadu_si256(
                      reinterpret_cast<const __m256i*>(h)));
    *lo = _mm512_or_si512(*lo, high_part<G, HB, 0>(src));
    *hi = _mm512_or_si512(*hi, high_part<G, HB, 1>(src));
  }
}

// The group sums (lane_group, lane_row) of a tile's NB weight rows' int32
// dot-product lanes v[0, NB): NB = 4 (G = 32), 2 (G = 16) or 1 (the row's
// sums repeated in the others' lanes; G = 64 always). Integer sums: exact,
// whatever the order.
template <int G, int NB>
[[gnu::always_inline]] inline __m512i group_sums(const __m512i* v) {
  const __m512i a = v[0], b = v[NB > 1 ? 1 : 0];
  if constexpr (G == 16) {  // adjacent lanes, rows a and b
    const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
    return _mm512_add_epi32(
        _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0x88)),
        _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0xdd)));
  } else if constexpr (NB == 1) {  // a group's lanes: pairs, halves (and
    const __m512i t =                 // for G = 64 128-bit lane pairs)
        _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB));
    const __m512i u =
        _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
    if constexpr (G == 64) {
      return _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, 0xb1));
    }
    return u;
  } else {
    const __m512i c = v[2], d = v[3];
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b),
                                        _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d),
                                        _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd),
                            _mm512_unpackhi_epi64(ab, cd));
  }
}

// A tile's per-group float factors (scales or coef) for one block in the
// lanes of group_sums: row t's 128 / G factors at f + t * stride.
template <int G, int NB>
[[gnu::always_inline]] inline __m512 group_factors(const float* f,
                                                   int64_t stride) {
  constexpr int kGpb = kNibBlock / G;  // groups a block: 4 or 8
  alignas(64) static constexpr auto idx = [] {
    std::array<int32_t, 16> t{};
    for (int l = 0; l < 16; ++l) {
      t[l] = (NB > 1 ? lane_row(G, l) : 0) * kGpb + lane_group(G, l);
    }
    return t;
  }();
  const __m512i index = _mm512_load_si512(idx.data());
  if constexpr (NB == 1) {
    return _mm512_permutexvar_ps(
        index, _mm512_maskz_loadu_ps((1u << kGpb) - 1, f));
  } else if constexpr (G == 32) {  // rows 0-3, 4 factors each
    const __m256 r01 = _mm256_insertf128_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(f)), _mm_loadu_ps(f + stride), 1);
    const __m256 r23 = _mm256_insertf128_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(f + 2 * stride)),
        _mm_loadu_ps(f + 3 * stride), 1);
    return _mm512_permutexvar_ps(
        index, _mm512_insertf32x8(_mm512_castps256_ps512(r01), r23, 1));
  } else {  // G = 16: rows 0-1, 8 factors each
    return _mm512_permutexvar_ps(
        index, _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(f)),
                                  _mm256_loadu_ps(f + stride), 1));
  }
}

// Rows [0, R) of the int8 activations against NB consecutive weight rows
// (4 for G = 32, 2 for G = 16, or 1): their packed low nibbles (K / 2
// bytes a row, from low), high bits (K * HB / 8, from high), scales (K /
// G, rows sstride apart) and coef (scale * offset + min, rows cstride
// apart) -> y[r * ldy + t]. Per block and x row, two vpdpbusd a weight row
// give 16 int32 lanes, group_sums adds each group's lanes into one vector
// for the tile, and per group one conversion, one product with scale * d
// and one fused subtraction of coef times the group's sum of q * d
// accumulate in float; the groups are summed at the end. The float
// operations serve NB rows at once (a [8960, 1536] Q4_K product at 9
// rows: 5.2 -> 3.8 cycles per row and block on a Zen 4 core, in cache). With
// one weight row each lane repeats its group's value, and every row's
// float operations are the same ones on the same values whatever NB, R
// and M are: a verification pass reproduces a decode step bit for bit.
template <int R, int NB, int G, int HB>
void gtile(const Act8& a, int64_t r0, int64_t k, const uint8_t* low,
           const uint8_t* high, const float* s, int64_t sstride,
           const float* coef, int64_t cstride, float* y, int64_t ldy) {
  constexpr int kGpb = kNibBlock / G;
  const int64_t blocks = k / kNibBlock;
  const int8_t* q0 = a.qp.get() + r0 * kNibBlock;
  const float* dl0 = a.dl.get() + r0 * 16;
  const float* gl0 = a.gl.get() + r0 * 16;
  const int64_t m = a.m;
  f32x16 acc[R];
  unroll<R>([&](auto r) { acc[r] = f32x16{}; });
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i lo[NB], hi[NB];
    unroll<NB>([&](auto t) {
      const uint8_t* row = low + t * (k / 2) + 64 * b;
      // The next tile's block: one linear stream ahead of this tile's.
      _mm_prefetch(reinterpret_cast<const char*>(row + NB * (k / 2)),
                   _MM_HINT_T0);
      block_codes<G, HB>(row, high + t * (k * HB / 8) + 16 * HB * b, &lo[t],
                         &hi[t]);
    });
    const __m512 sc = group_factors<G, NB>(s + kGpb * b, sstride);
    const __m512 cf = group_factors<G, NB>(coef + kGpb * b, cstride);
    const int8_t* q = q0 + b * m * kNibBlock;
    const float* dl = dl0 + b * m * 16;
    const float* gl = gl0 + b * m * 16;
    unroll<R>([&](auto r) {
      const __m512i x0 = _mm512_loadu_si512(q + kNibBlock * r);
      const __m512i x1 = _mm512_loadu_si512(q + kNibBlock * r + 64);
      __m512i dot[NB];
      unroll<NB>([&](auto t) {
        dot[t] = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[t], x0), hi[t],
            x1);
      });
      const __m512 sum = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(group_sums<G, NB>(dot)),
          _mm512_mul_ps(sc, _mm512_loadu_ps(dl + 16 * r)), (__m512)acc[r]);
      acc[r] = (f32x16)_mm512_fnmadd_ps(cf, _mm512_loadu_ps(gl + 16 * r), sum);
    });
  }
  // Per row, its groups in a fixed tree: 128-bit lanes (0 + 1) + (2 + 3)
  // (G = 64: 0 + 2, one group each), then for G = 16 a row's two lanes.
  // Weight row t's total lands in lane t (G = 32) or 2t (G = 16).
  unroll<R>([&](auto r) {
    __m512 h = (__m512)acc[r];
    if constexpr (G != 64) {
      h = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, 0xb1));
    }
    h = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, 0x4e));
    if constexpr (G == 16) {
      h = _mm512_maskz_compress_ps(
          0x5, _mm512_add_ps(h, _mm512_shuffle_ps(h, h, 0xb1)));
    }
    _mm512_mask_storeu_ps(y + r * ldy, (1u << NB) - 1, h);
  });
}

// gtile's entry points for R = 1 .. sizeof(I) x rows (index R; 0 null).
template <int NB, int G, int HB, int... I>
constexpr std::array<GTileFn, sizeof...(I) + 1> gtile_rows(
    std::integer_sequence<int, I...>) {
  return {nullptr, gtile<I + 1, NB, G, HB>...};
}
template <int NB, int G, int HB, int Rows>
constexpr auto kGTiles =
    gtile_rows<NB, G, HB>(std::make_integer_sequence<int, Rows>{});

// The format's tiles: NB weight rows (4 or 2) where it has them.
template <int NB, int G, int HB>
constexpr GTiles gtiles_of() {
  if constexpr (NB == 1) return {kGTiles<1, G, HB, kMaxRows>.data()};
  return {kGTiles<1, G, HB, kMaxRows>.data(),
          kGTiles<NB, G, HB, kMultiMaxRows>.data(), NB};
}

inline GTiles gtiles(int64_t bits, int64_t group, int64_t k) {
  if (k % kNibBlock) return {};
  if (bits == 4 && group == 32) return gtiles_of<4, 32, 0>();
  if (bits == 4 && group == 64) return gtiles_of<1, 64, 0>();
  if (bits == 5 && group == 32) return gtiles_of<4, 32, 1>();
  if (bits == 6 && group == 16) return gtiles_of<2, 16, 2>();
  return {};
}
#else
inline GTiles gtiles(int64_t, int64_t, int64_t) { return {}; }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__linux__)
#define SPECJAX_AMX 1
// AMX tiles for int8 activations, in the formats gtile takes (groups of 16,
// 32 or 64): 16 weight rows a tile against up to 16 x rows at once. Per
// block and group, one tdpbusd gives the group's integer sums for every
// (weight row, x row) pair: A is the weight rows' codes (uint8, [16, G]),
// B the x rows' codes (int8, [G / 4, 16, 4]), C [16 weight rows, 16 x rows]
// int32. The float epilogue then runs gtile's operations on each sum, the
// same ones on the same values in the same order (one conversion, a
// product with scale * d, one fused multiply-add, one fused subtraction of
// coef times the group sum of q * d, over blocks; the block's groups
// summed in gtile's tree at the end), so every row equals a gtile row, and
// a one-row decode step, bit for bit. Integer sums are exact in any order.

// Rows of a tile: x rows (B's columns, C's) and weight rows (A's, C's).
constexpr int64_t kAmxRows = 16;
// From this many x rows on, int8 products take AMX tiles. A tile's
// epilogue costs the same for 1 to 16 x rows (its vectors run over them),
// so fewer rows ran faster in gtile, measured on a [8960, 1536] product
// (Q4_K, Q5_0, Q6_K): AMX 0.5-0.9x gtile at 4-10 rows, 1.05-1.2x at
// 12-16, 1.3-1.7x at 32-64.
constexpr int64_t kAmxMinRows = 12;

// Whether this process may use AMX tiles: Linux grants their register
// state on request, once per process; an older kernel, or a hypervisor
// without it, refuses, and gtile serves. SPECJAX_NO_AMX=1 turns them off.
inline bool amx_usable() {
  static const bool usable = [] {
    const char* off = std::getenv("SPECJAX_NO_AMX");
    if (off && off[0] && off[0] != '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// A tile's groups of a block in K: the low part's G / 2 codes, then the
// high part's (any order serves an integer sum, the same for A and B).
// Weights: the block's low and high 64 bytes of codes, interleaved in
// chunks of G / 2 (qwords) so that group g is bytes [G g, G (g + 1)).
template <int G>
inline void amx_interleave(__m512i lo, __m512i hi, uint8_t* out) {
  alignas(64) static constexpr auto idx = [] {
    constexpr int cq = G / 16;  // qwords a half group
    std::array<int64_t, 16> t{};
    for (int o = 0; o < 16; ++o) {
      const int within = o % (2 * cq);
      t[o] = within / cq * 8 + o / (2 * cq) * cq + within % cq;
    }
    return t;
  }();
  _mm512_storeu_si512(out, _mm512_permutex2var_epi64(
                               lo, _mm512_load_si512(idx.data()), hi));
  _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi64(
                                    lo, _mm512_load_si512(idx.data() + 8),
                                    hi));
}

// x's operands for AMX tiles, from Act8 (with qp): per group of 16 x rows
// (xg), block b and group i of the block, B [G / 4, 16, 4] of the group's
// codes in amx_interleave's K order, and d and the group's sum of q * d as
// vectors over the 16 rows (lanes past M zero).
struct AmxAct {
  std::unique_ptr<int8_t[]> b;    // [XG, blocks, groups a block, G * 16]
  std::unique_ptr<float[]> d, g;  // [XG, blocks, groups a block, 16]
  int64_t xgroups, blocks, gpb;

  AmxAct(const Act8& a, int64_t k, int64_t group)
      : xgroups((a.m + kAmxRows - 1) / kAmxRows),
        blocks(k / kNibBlock),
        gpb(kNibBlock / group) {
    const int64_t m = a.m, tile = group * kAmxRows;  // bytes of a B tile
    b.reset(new int8_t[xgroups * blocks * gpb * tile]());
    d.reset(new float[xgroups * blocks * gpb * 16]());
    g.reset(new float[xgroups * blocks * gpb * 16]());
    const int64_t half = group / 2;
    for (int64_t r = 0; r < m; ++r) {
      const int64_t xg = r / kAmxRows, lane = r % kAmxRows;
      for (int64_t bl = 0; bl < blocks; ++bl) {
        const int8_t* q = a.qp.get() + (bl * m + r) * kNibBlock;
        for (int64_t i = 0; i < gpb; ++i) {
          const int64_t at = (xg * blocks + bl) * gpb + i;
          int8_t* t = b.get() + at * tile;
          for (int64_t e = 0; e < group; ++e) {
            const int64_t src = 64 * (e / half) + half * i + e % half;
            t[e / 4 * 64 + lane * 4 + e % 4] = q[src];
          }
          const int64_t grp = bl * gpb + i;
          d[at * 16 + lane] = a.d[r * (k / kChunk) + grp * group / kChunk];
          g[at * 16 + lane] = a.gsum[(grp / 16 * m + r) * 16 + grp % 16];
        }
      }
    }
  }
};

// AMX's tile registers: C (sums) 0-3, A (weights) 4-5, B (x codes) 6-7.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit AmxConfig(int group) {
    for (int t = 0; t < 4; ++t) colsb[t] = 64, rows[t] = kAmxRows;
    for (int t = 4; t < 6; ++t) colsb[t] = group, rows[t] = kAmxRows;
    for (int t = 6; t < 8; ++t) colsb[t] = 64, rows[t] = group / 4;
  }
};

// Groups [i, i + NG) of one block (NG 2 or 4): C = A (weights, rows of
// 128 bytes at w) times B (tiles of G * 16 bytes at x) -> c[NG][16][16].
template <int G, int NG>
[[gnu::always_inline]] inline void amx_groups(const uint8_t* w,
                                              const int8_t* x, int32_t* c) {
  constexpr int64_t kB = G * kAmxRows;
  _tile_zero(0);
  _tile_loadd(4, w, 128);
  _tile_loadd(6, x, 64);
  _tile_zero(1);
  _tile_loadd(5, w + G, 128);
  _tile_loadd(7, x + kB, 64);
  _tile_dpbusd(0, 4, 6);
  _tile_dpbusd(1, 5, 7);
  if constexpr (NG == 4) {
    _tile_zero(2);
    _tile_loadd(4, w + 2 * G, 128);
    _tile_loadd(6, x + 2 * kB, 64);
    _tile_zero(3);
    _tile_loadd(5, w + 3 * G, 128);
    _tile_loadd(7, x + 3 * kB, 64);
    _tile_dpbusd(2, 4, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (NG == 4) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// gtile's tree over a row's groups of a block, at lanes of `a` (one
// vector over x rows per group): G = 32 (0 + 1) + (2 + 3), G = 16 ((0 +
// 2) + (4 + 6)) + ((1 + 3) + (5 + 7)), G = 64 0 + 1.
template <int G>
[[gnu::always_inline]] inline __m512 amx_tree(const float* a) {
  const auto v = [a](int i) { return _mm512_loadu_ps(a + 16 * i); };
  if constexpr (G == 64) return _mm512_add_ps(v(0), v(1));
  if constexpr (G == 32) {
    return _mm512_add_ps(_mm512_add_ps(v(0), v(1)),
                         _mm512_add_ps(v(2), v(3)));
  }
  return _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(v(0), v(2)), _mm512_add_ps(v(4), v(6))),
      _mm512_add_ps(_mm512_add_ps(v(1), v(3)), _mm512_add_ps(v(5), v(7))));
}

// Per-thread buffers of amx_tile.
struct AmxBuffers {
  alignas(64) uint8_t w[kAmxRows * kNibBlock];         // A, a block
  alignas(64) int32_t c[8 * kAmxRows * kAmxRows];      // C, a block
  std::unique_ptr<float[]> acc;  // [XG, 16 weight rows, groups a block, 16]

  explicit AmxBuffers(int64_t xgroups)
      : acc(new float[xgroups * kAmxRows * 8 * 16]) {}
};

// 16 weight rows (packed low nibbles from low, k / 2 bytes a row; high
// bits from high, k * HB / 8; scales s, rows sstride apart, and coef,
// rows cstride apart) against every x row of `x` -> y[r * ldy + t], t < 16.
template <int G, int HB>
void amx_tile(const AmxAct& x, int64_t m, int64_t k, const uint8_t* low,
              const uint8_t* high, const float* s, int64_t sstride,
              const float* coef, int64_t cstride, AmxBuffers& buf, float* y,
              int64_t ldy) {
  constexpr int kGpb = kNibBlock / G;
  constexpr int64_t kB = G * kAmxRows;
  const int64_t blocks = k / kNibBlock, xgroups = x.xgroups;
  float* acc = buf.acc.get();
  std::fill(acc, acc + xgroups * kAmxRows * kGpb * 16, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t t = 0; t < kAmxRows; ++t) {
      const uint8_t* row = low + t * (k / 2) + 64 * b;
      _mm_prefetch(reinterpret_cast<const char*>(row + 64 * 4), _MM_HINT_T0);
      __m512i lo, hi;
      block_codes<G, HB>(row, high + t * (k * HB / 8) + 16 * HB * b, &lo, &hi);
      amx_interleave<G>(lo, hi, buf.w + t * kNibBlock);
    }
    for (int64_t xg = 0; xg < xgroups; ++xg) {
      const int64_t at = (xg * blocks + b) * kGpb;
      const int8_t* xb = x.b.get() + at * kB;
      for (int i = 0; i < kGpb; i += 4) {
        if constexpr (kGpb == 2) {
          amx_groups<G, 2>(buf.w, xb, buf.c);
        } else {
          amx_groups<G, 4>(buf.w + G * i, xb + kB * i, buf.c + 256 * i);
        }
      }
      float* a = acc + xg * kAmxRows * kGpb * 16;
      for (int i = 0; i < kGpb; ++i) {
        const __m512 dv = _mm512_loadu_ps(x.d.get() + (at + i) * 16);
        const __m512 gv = _mm512_loadu_ps(x.g.get() + (at + i) * 16);
        const int64_t grp = b * kGpb + i;
        for (int64_t t = 0; t < kAmxRows; ++t) {
          float* at_acc = a + (t * kGpb + i) * 16;
          const __m512 sums = _mm512_cvtepi32_ps(
              _mm512_load_si512(buf.c + 256 * i + 16 * t));
          const __m512 sum = _mm512_fmadd_ps(
              sums, _mm512_mul_ps(_mm512_set1_ps(s[t * sstride + grp]), dv),
              _mm512_loadu_ps(at_acc));
          _mm512_storeu_ps(at_acc, _mm512_fnmadd_ps(
                                      _mm512_set1_ps(coef[t * cstride + grp]),
                                      gv, sum));
        }
      }
    }
  }
  for (int64_t xg = 0; xg < xgroups; ++xg) {
    const int64_t rows = std::min(kAmxRows, m - xg * kAmxRows);
    for (int64_t t = 0; t < kAmxRows; ++t) {
      alignas(64) float h[16];
      _mm512_store_ps(h, amx_tree<G>(acc + (xg * kAmxRows + t) * kGpb * 16));
      for (int64_t r = 0; r < rows; ++r) {
        y[(xg * kAmxRows + r) * ldy + t] = h[r];
      }
    }
  }
}

using AmxTileFn = void (*)(const AmxAct&, int64_t, int64_t, const uint8_t*,
                           const uint8_t*, const float*, int64_t,
                           const float*, int64_t, AmxBuffers&, float*,
                           int64_t);

// amx_tile for the formats gtile takes, or null.
inline AmxTileFn amx_tiles(int64_t bits, int64_t group, int64_t k) {
  if (k % kNibBlock || !amx_usable()) return nullptr;
  if (bits == 4 && group == 32) return amx_tile<32, 0>;
  if (bits == 4 && group == 64) return amx_tile<64, 0>;
  if (bits == 5 && group == 32) return amx_tile<32, 1>;
  if (bits == 6 && group == 16) return amx_tile<16, 2>;
  return nullptr;
}
#endif

// 16 bytes, read as uint8 (or with Signed as int8) -> 16 int32 (GCC turns
// __builtin_convertvector on a loaded vector into byte-by-byte inserts).
template <bool Signed = false>
inline i32x16 widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (i32x16)(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
#else
  std::conditional_t<Signed, i8x16, u8x16> v;
  std::memcpy(&v, p, 16);
  return __builtin_convertvector(v, i32x16);
#endif
}

// Float activations x [M, K] for ftile. In groups of 32 or more, each 16
// bytes of a block's packed part hold 16 consecutive elements, read from x
// in place. In groups of 16, ftile reads each part's 64 code bytes as 16
// dwords and takes byte q of every dword at once (q = 0..3: lane l is byte
// 4l + q), so x is copied in that order: xp [M, K], each row's block of
// kNibBlock with part p's element for byte 4l + q at 64p + 16q + l. (Rows
// stay apart: with a block's M rows side by side, a [64, 8960] x put each
// block of a row group on its own page.)
struct XPerm {
  const float* x;
  std::unique_ptr<float[]> xp;  // null for groups of 32 or more

  XPerm(const float* x, int64_t m, int64_t k, int group) : x(x) {
    if (group >= 32) return;
    // The block's source element of each destination, computed once: the
    // division in nib_element made the copy cost a third of a [9, 8960]
    // Q6_K product.
    int32_t order[kNibBlock];
    for (int part = 0; part < 2; ++part) {
      for (int q = 0; q < 4; ++q) {
        for (int l = 0; l < 16; ++l) {
          order[64 * part + 16 * q + l] = nib_element(group, part, 4 * l + q);
        }
      }
    }
    xp.reset(new float[m * k]);
    for (int64_t b = 0; b < k / kNibBlock; ++b) {
      for (int64_t r = 0; r < m; ++r) {
        float* dst = xp.get() + r * k + b * kNibBlock;
        const float* src = x + r * k + b * kNibBlock;
        for (int i = 0; i < kNibBlock; ++i) dst[i] = src[order[i]];
      }
    }
  }
};

// ftile's weight rows: t of a tile's NB rows at low + t * k / 2, high +
// t * k * HB / 8, scales and mins at + t * groups (mins null: none).
struct FRows {
  const uint8_t* low;
  const uint8_t* high;
  const float* scales;
  const float* mins;
  int64_t groups;
  float* deq;  // [NB, K] the rows' weights, in XPerm's order (kStore/kLoad)
};
// How ftile gets its weights: dequantised in registers (kRegs), the same
// and stored to FRows::deq with no x rows (kStore), or loaded from there
// (kLoad): the same values, for M too large for one pass of tiles.
enum FMode { kRegs, kStore, kLoad };
using FTileFn = void (*)(const XPerm&, int64_t, int64_t, int64_t,
                         const FRows&, int8_t, float*, int64_t);
// ftile's tiles: multi[rows] (up to kFTileRows x rows), two weight rows
// sharing each x load (even at one x row: two independent chains of sums),
// and one[rows] for a last odd weight row; the *_load ones read weights
// that [0] (kStore) dequantised, when M takes many passes of tiles, and
// wide_load[rows] (up to kFWideRows) kFWideBlock of them a tile.
struct FTiles {
  const FTileFn* one = nullptr;
  const FTileFn* multi = nullptr;
  const FTileFn* one_load = nullptr;
  const FTileFn* multi_load = nullptr;
  const FTileFn* wide_load = nullptr;
};
// x rows a tile, in both modes. Taller tiles ran slower, measured: 9 rows
// of a [1536] x [1536, 8960] Q4_K product took 1.5x as long in one tile as
// in tiles of 5 and 4 that each dequantise again, and 64 rows 1.3x as long
// in loading tiles of 10 and 11 as in tiles of 6.
constexpr int kFTileRows = 6;
// Up to this many x rows, each tile of rows dequantises the weights again
// in registers; above, they are dequantised once into L1 (kStore, kLoad).
constexpr int kFRegsRows = 12;
// Loading tiles of this many weight rows and up to kFWideRows x rows: each
// x vector loaded serves kFWideBlock products instead of two, so that x
// rows streaming from L2 keep up with the FMAs (20 accumulators, 8 weight
// vectors and an x vector in the 32 registers). Measured on a Zen 5 core,
// 64 rows of a [1536] x [1536, 8960] product: Q4_K 1.26x and Q6_K 1.48x
// as fast as tiles of two weight rows and 6 x rows; 6 x rows (33
// registers) spilled and ran 1.2x slower than 5.
constexpr int kFWideBlock = 4;
constexpr int kFWideRows = 5;
// Bytes of x [M, K] above which ftile's passes take x rows outer
// (`columns`): more than an L2 holds beside the weights.
constexpr int64_t kFXBytes = int64_t{1} << 20;

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// How far ahead of each weight row's reads ftile prefetches, in bytes
// (about 5 rows of a [*, 1536] Q4_K matrix). With the hardware prefetcher
// alone, a one-row product of two weight rows a tile ran 1.7x slower from
// memory than in cache on Zen 4; with this, 1.1x.
constexpr int64_t kFPrefetch = 4096;

// prefetcht0 p, as inline assembly: GCC 12 at -O3 drops ftile's
// _mm_prefetch calls.
inline void prefetch(const uint8_t* p) {
  asm volatile("prefetcht0 %0" : : "m"(*p));
}

// Rows [r0, r0 + R) of float x (XPerm) against NB nibble-format weight
// rows (G = 16, 32 or 64; HB high bits), dequantised in registers 16
// weights at a time exactly as specjax.models.quantized does it, w = (c -
// offset) * s - m in float32 (two roundings, no fused product), then
// multiplied into one float accumulator per x row and weight row. Each
// output's operations and their order are the same
// whatever R, NB and M are: a verification pass reproduces a decode step
// bit for bit. Out y[r * ldy + t].
template <int R, int NB, int G, int HB, FMode Mode = kRegs>
void ftile(const XPerm& xp, int64_t m, int64_t r0, int64_t k,
           const FRows& w, int8_t offset, float* y, int64_t ldy) {
  constexpr int kGpb = kNibBlock / G;  // groups a block
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i off8 = _mm512_set1_epi8(offset);
  const __m512i off32 = _mm512_set1_epi32(offset);
  const __m512i byte32 = _mm512_set1_epi32(0xff);
  const __m512i magic = _mm512_set1_epi32(0x4b000000);  // 2^23 as float
  const __m512 magic_off = _mm512_set1_ps(8388608.0f + offset);
  const float* x0 = (G >= 32 ? xp.x : xp.xp.get()) + r0 * k;
  const bool has_mins = w.mins != nullptr;
  // 4-bit codes in groups of 32 or more: each group's 16 weights are
  // looked up by code (vpermps reads an index's low 4 bits), from a table
  // of (i - offset) * s - m, i = 0..15, computed as above.
  const __m512 codes_f = _mm512_cvtepi32_ps(_mm512_sub_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      off32));
  f32x16 acc[NB][R];
  unroll<NB>([&](auto t) {
    unroll<R>([&](auto r) { acc[t][r] = f32x16{}; });
  });
  for (int64_t b = 0; b < k / kNibBlock; ++b) {
    if constexpr (Mode != kLoad) {
      unroll<NB>([&](auto t) {
        prefetch(w.low + t * (k / 2) + 64 * b + kFPrefetch);
        if constexpr (HB > 0) {
          prefetch(w.high + t * (k * HB / 8) + 16 * HB * b + kFPrefetch);
        }
      });
    }
    // Both parts' codes as bytes, with their high bits: c - offset (it
    // fits int8) in groups of 32, c itself in groups of 16 (see below).
    __m512i part[NB][2];
    if constexpr ((HB > 0 || G == 16) && Mode != kLoad) {
      unroll<NB>([&](auto t) {
        const __m512i v = _mm512_loadu_si512(w.low + t * (k / 2) + 64 * b);
        part[t][0] = _mm512_and_si512(v, nibble);
        part[t][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (HB > 0) {
          const uint8_t* h = w.high + t * (k * HB / 8) + 16 * HB * b;
          const __m512i src =
              HB == 1 ? _mm512_castsi128_si512(_mm_loadu_si128(
                            reinterpret_cast<const __m128i*>(h)))
                      : _mm512_castsi256_si512(_mm256_loadu_si256(
                            reinterpret_cast<const __m256i*>(h)));
          part[t][0] = _mm512_or_si512(part[t][0], high_part<G, HB, 0>(src));
          part[t][1] = _mm512_or_si512(part[t][1], high_part<G, HB, 1>(src));
        }
        if constexpr (G != 16) {
          part[t][0] = _mm512_sub_epi8(part[t][0], off8);
          part[t][1] = _mm512_sub_epi8(part[t][1], off8);
        }
      });
    }
    // Groups of 16: lane l of byte q's vector (q = j below) is byte 4l + q
    // of a part, in group l / 2 of the block whatever q and the part are
    // (nib_element): one scale (and min) vector a block.
    __m512 block_s[NB], block_m[NB];
    if constexpr (G == 16 && Mode != kLoad) {
      const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4,
                                              5, 5, 6, 6, 7, 7);
      auto expand = [&](const float* f) {
        return _mm512_permutexvar_ps(
            pairs, _mm512_castps256_ps512(_mm256_loadu_ps(f)));
      };
      unroll<NB>([&](auto t) {
        const int64_t row = t * w.groups + kGpb * b;
        block_s[t] = expand(w.scales + row);
        block_m[t] = has_mins ? expand(w.mins + row) : _mm512_setzero_ps();
      });
    }
    const float* xb = x0 + b * kNibBlock;
    unroll<4>([&](auto j) {
      // Bytes 16j.. of the block hold group j's (G = 32) or j / 2's (G =
      // 64) elements in both parts: one scale (and min) serves both.
      constexpr int g0 = G == 32 ? j : j / 2;
      __m512 wv[NB][2];
      unroll<NB>([&](auto t) {
        float* deq = w.deq + t * k + kNibBlock * b + 16 * j;
        if constexpr (Mode == kLoad) {
          wv[t][0] = _mm512_loadu_ps(deq);
          wv[t][1] = _mm512_loadu_ps(deq + 64);
          return;
        }
        const int64_t row = t * w.groups + kGpb * b + g0;
        const __m512 sv = G == 16 ? block_s[t] : _mm512_set1_ps(w.scales[row]);
        const __m512 mv = G == 16    ? block_m[t]
                          : has_mins ? _mm512_set1_ps(w.mins[row])
                                     : _mm512_setzero_ps();
        auto deq16 = [&](__m512 c) {
          // The rounding form: GCC would otherwise fuse the product into
          // the min's subtraction in some tiles and not others.
          const __m512 p = _mm512_mul_round_ps(
              c, sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          return has_mins ? _mm512_sub_ps(p, mv) : p;
        };
        __m512i c[2];  // c - offset, int32 (high bits, groups of 32)
        if constexpr (G == 16) {
          // Byte j of each dword as the float 2^23 + c (c in the low
          // mantissa bits), minus 2^23 + offset: c - offset exactly, with
          // a shift and a logic op where extracting and widening 16 bytes
          // took two shuffles (Q6_K on one Zen 4 thread: 5.2 -> 4.4
          // cycles per 16 weights).
          unroll<2>([&](auto p) {
            const __m512i d =
                j == 0 ? part[t][p] : _mm512_srli_epi32(part[t][p], 8 * j);
            wv[t][p] = deq16(_mm512_sub_ps(
                _mm512_castsi512_ps(
                    _mm512_ternarylogic_epi32(d, byte32, magic, 0xea)),
                magic_off));
          });
        } else if constexpr (HB > 0) {
          c[0] = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(part[t][0], j));
          c[1] = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(part[t][1], j));
        } else {
          // Both parts' codes: the low part's in bits 0-3, the high's in 4-7.
          const __m512i v =
              (__m512i)widen(w.low + t * (k / 2) + 64 * b + 16 * j);
          const __m512 table = deq16(codes_f);
          wv[t][0] = _mm512_permutexvar_ps(v, table);
          wv[t][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        }
        unroll<2>([&](auto p) {
          if constexpr (HB > 0 && G != 16) {
            wv[t][p] = deq16(_mm512_cvtepi32_ps(c[p]));
          }
          if constexpr (Mode == kStore) _mm512_storeu_ps(deq + 64 * p, wv[t][p]);
        });
      });
      unroll<2>([&](auto p) {
        unroll<R>([&](auto r) {
          const __m512 xv = _mm512_loadu_ps(
              xb + k * r + (G >= 32 ? nib_element(G, p, 16 * j)
                                    : 64 * p + 16 * j));
          unroll<NB>([&](auto t) {
            acc[t][r] = (f32x16)_mm512_fmadd_ps(wv[t][p], xv,
                                                (__m512)acc[t][r]);
          });
        });
      });
    });
  }
  unroll<NB>([&](auto t) {
    unroll<R>([&](auto r) {
      y[r * ldy + t] = hsum(acc[t][r]);
    });
  });
}

template <int NB, int G, int HB, FMode Mode, int... I>
constexpr std::array<FTileFn, sizeof...(I) + 1> ftile_rows(
    std::integer_sequence<int, I...>) {
  return {ftile<0, NB, G, HB, kStore>, ftile<I + 1, NB, G, HB, Mode>...};
}
template <int NB, int G, int HB, FMode Mode, int Rows>
constexpr auto kFTiles =
    ftile_rows<NB, G, HB, Mode>(std::make_integer_sequence<int, Rows>{});
template <int G, int HB>
constexpr FTiles ftiles_of() {
  return {kFTiles<1, G, HB, kRegs, kFTileRows>.data(),
          kFTiles<2, G, HB, kRegs, kFTileRows>.data(),
          kFTiles<1, G, HB, kLoad, kFTileRows>.data(),
          kFTiles<2, G, HB, kLoad, kFTileRows>.data(),
          kFTiles<kFWideBlock, G, HB, kLoad, kFWideRows>.data()};
}

// ftile's tiles for a nibble format, or none.
inline FTiles ftiles(int64_t bits, int64_t group) {
  if (bits == 4 && group == 16) return ftiles_of<16, 0>();
  if (bits == 4 && group == 32) return ftiles_of<32, 0>();
  if (bits == 4 && group == 64) return ftiles_of<64, 0>();
  if (bits == 5 && group == 32) return ftiles_of<32, 1>();
  if (bits == 6 && group == 16) return ftiles_of<16, 2>();
  return {};
}
#else
inline FTiles ftiles(int64_t, int64_t) { return {}; }
#endif

// Lanes 8-15 of a 16-lane vector.
constexpr i32x16 kSecondHalf = {0, 0, 0, 0, 0, 0, 0, 0,
                                -1, -1, -1, -1, -1, -1, -1, -1};

// An IEEE half (GGUF's Q8_0 and Q5_0 block scales) as float, exactly.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? sign | 0x7f800000u | (man << 13)
                                  : sign | ((exp + 112) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// A matrix's per-group scales or mins [N, K / G], read as stored: float,
// half, or two-level (the K-quants: integer sub-factors [N, K / G] times a
// half factor per run of `per` groups [N, K / G / per], an exact float
// product). All null: none (a matrix without mins).
struct GroupFactors {
  const float* f32 = nullptr;
  const uint16_t* f16 = nullptr;
  const uint8_t* sub = nullptr;
  bool sub_signed = false;  // int8 sub-factors (Q6_K's scales), else uint8
  const uint16_t* sup = nullptr;
  int64_t per = 1;

  // Weight row j's factors [groups]: as stored, or converted into tmp.
  const float* row(int64_t j, int64_t groups, float* tmp) const {
    if (f32) return f32 + j * groups;
    if (f16) {
      for (int64_t g = 0; g < groups; ++g) {
        tmp[g] = half_to_float(f16[j * groups + g]);
      }
      return tmp;
    }
    if (!sub) return nullptr;
    const int64_t supers = groups / per;
    const uint8_t* q = sub + j * groups;
    const uint16_t* d = sup + j * supers;
    int64_t b = 0;
    // 16 groups a vector: one super-block of 16 (Q6_K) or two of 8 (Q4_K).
    if (per == 16 || per == 8) {
      const int64_t step = 16 / per;
      for (; b + step <= supers; b += step) {
        const float d0 = half_to_float(d[b]);
        const float d1 = step == 2 ? half_to_float(d[b + 1]) : d0;
        const f32x16 dv = kSecondHalf ? f32x16{} + d1 : f32x16{} + d0;
        const i32x16 v = sub_signed ? widen<true>(q + b * per)
                                    : widen(q + b * per);
        const f32x16 w = __builtin_convertvector(v, f32x16) * dv;
        std::memcpy(tmp + b * per, &w, sizeof(w));
      }
    }
    for (; b < supers; ++b) {
      const float db = half_to_float(d[b]);
      for (int64_t i = b * per; i < (b + 1) * per; ++i) {
        tmp[i] = db * static_cast<float>(sub_signed
                                             ? static_cast<int8_t>(q[i])
                                             : static_cast<int>(q[i]));
      }
    }
    return tmp;
  }
};

struct QWork {
  const float* x;
  const uint8_t* codes;
  const uint8_t* high;  // nullptr: no high bits
  GroupFactors scales, mins;
  float* y;
  std::unique_ptr<Act8> act;  // nullptr: float activations
  FTiles ft;  // float activations, nibble formats: ftile's tiles
  std::unique_ptr<XPerm> xperm;  // x for ftile
  GTiles gt;  // gtile's tiles, where it takes the format
#if defined(SPECJAX_AMX)
  AmxTileFn amx = nullptr;  // AMX tiles, from kAmxMinRows x rows
  std::unique_ptr<AmxAct> amx_act;
#endif
  int64_t m, k, n, group, bits, offset, chunk;
  std::unique_ptr<Chunks> chunks;

  // 16 consecutive codes of one group -> out[0, 16): (code - offset) *
  // scale - min, as specjax.models.quantized computes it.
  static inline void emit(i32x16 codes, int32_t off, float sc, float mv,
                          float* out) {
    const f32x16 w = __builtin_convertvector(codes - off, f32x16) * sc - mv;
    std::memcpy(out, &w, sizeof(w));
  }

  // What row_codes adds to a code: 8-bit codes are int8, read as uint8
  // through code ^ 0x80 = code + 128 (GCC widens uint8 vectors with one
  // instruction but int8 ones element by element; VNNI multiplies uint8).
  int32_t bias() const { return bits == 8 ? 128 : 0; }

  // The codes (plus bias()) of weight row j, in element order -> u[0, K).
  void row_codes(int64_t j, uint8_t* __restrict u) const {
    // Members as locals: stores through u (uint8_t aliases anything) would
    // otherwise reload them every iteration.
    const int64_t k = this->k, group = this->group, bits = this->bits;
    const uint8_t* codes = this->codes;
    const uint8_t* high = this->high;
    if (bits == 8) {
      for (int64_t e = 0; e < k; e += 16) {
        u8x16 v;
        std::memcpy(&v, codes + j * k + e, 16);
        v ^= 0x80;
        std::memcpy(u + e, &v, 16);
      }
      return;
    }
    // Within a group, byte i holds element i (low nibble) and element
    // i + G/2 (high nibble).
    const int64_t half = group / 2;
    const uint8_t* c = codes + j * (k / 2);
    for (int64_t g = 0; g < k / group; ++g, c += half) {
      uint8_t* out = u + g * group;
      if (half == 8) {  // built from two 64-bit halves: byte shuffles
        uint64_t b;     // and partial copies compile to scalar code
        std::memcpy(&b, c, 8);
        const u64x2 both = {b & kLowNibbles, (b >> 4) & kLowNibbles};
        std::memcpy(out, &both, 16);
        continue;
      }
      for (int64_t e = 0; e < half; e += 16) {
        u8x16 v;
        std::memcpy(&v, c + e, 16);
        const u8x16 lo = v & 15, hi = v >> 4;
        std::memcpy(out + e, &lo, 16);
        std::memcpy(out + half + e, &hi, 16);
      }
    }
    if (bits == 6) {
      or_high_row<2>(high + j * k / 4, u, k);
    } else if (bits == 5) {
      or_high_row<1>(high + j * k / 8, u, k);
    }
  }

  // Weight row j dequantised -> out[0, K), through its codes u[0, K);
  // tmp holds 2 K / G floats.
  void dequantise(int64_t j, uint8_t* __restrict u, float* __restrict out,
                  float* tmp) const {
    row_codes(j, u);
    const int64_t k = this->k, group = this->group, groups = k / group;
    const int32_t off = static_cast<int32_t>(offset) + bias();
    const float* s = scales.row(j, groups, tmp);
    const float* mn = mins.row(j, groups, tmp + groups);
    for (int64_t g = 0; g < groups; ++g) {
      const float sc = s[g], mv = mn ? mn[g] : 0.f;
      for (int64_t e = g * group; e < (g + 1) * group; e += 16) {
        emit(widen(u + e), off, sc, mv, out + e);
      }
    }
  }

  void columns(int64_t n0, int64_t n1, uint8_t* u, float* rows_buf,
               float* tmp) const {
    const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
    if (ft.one) {  // nibble formats: dequantised in registers (ftile)
      const int64_t ng = k / group, hb_row = high ? k * (bits - 4) / 8 : 0;
      // Weight rows j.. (nb of them): rows of scales and mins lie ng
      // apart, as stored or converted (scales into tmp, mins into tmp +
      // kFWideBlock ng).
      auto weight_rows = [&](int64_t j, int64_t nb) {
        FRows w{codes + j * (k / 2), high ? high + j * hb_row : nullptr,
                scales.row(j, ng, tmp),
                mins.row(j, ng, tmp + kFWideBlock * ng), ng, rows_buf};
        for (int64_t t = 1; t < nb; ++t) {
          scales.row(j + t, ng, tmp + t * ng);
          mins.row(j + t, ng, tmp + (kFWideBlock + t) * ng);
        }
        return w;
      };
      const bool in_registers = m <= kFRegsRows;
      const int64_t row_groups = (m + kFTileRows - 1) / kFTileRows;
      if (!in_registers && m * k * int64_t{sizeof(float)} > kFXBytes) {
        // x exceeds L2 (a prefill chunk of a down projection): groups of
        // x rows outer, each over the chunk's weight rows dequantised in
        // registers again, so that x crosses from L3 once per chunk
        // rather than once per weight row pair.
        int64_t r0 = 0;
        for (int64_t g = 0; g < row_groups; ++g) {
          const int64_t rows = (m - r0) / (row_groups - g);
          for (int64_t j = n0; j < n1;) {
            const int64_t nb = j + 2 <= n1 ? 2 : 1;
            const FRows w = weight_rows(j, nb);
            (nb > 1 ? ft.multi : ft.one)[rows](
                *xperm, m, r0, k, w, static_cast<int8_t>(offset),
                y + r0 * n + j, n);
            j += nb;
          }
          r0 += rows;
        }
        return;
      }
      const int64_t wide_groups = (m + kFWideRows - 1) / kFWideRows;
      for (int64_t j = n0; j < n1;) {
        const bool wide = !in_registers && j + kFWideBlock <= n1;
        const int64_t nb = wide ? kFWideBlock : j + 2 <= n1 ? 2 : 1;
        const FRows w = weight_rows(j, nb);
        const FTileFn* tiles = wide ? ft.wide_load : nb > 1 ? ft.multi : ft.one;
        if (!in_registers) {
          tiles[0](*xperm, m, 0, k, w, static_cast<int8_t>(offset), y, n);
          if (!wide) tiles = nb > 1 ? ft.multi_load : ft.one_load;
        }
        const int64_t groups = wide ? wide_groups : row_groups;
        int64_t r0 = 0;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t rows = (m - r0) / (groups - g);
          tiles[rows](*xperm, m, r0, k, w, static_cast<int8_t>(offset),
                      y + r0 * n + j, n);
          r0 += rows;
        }
        j += nb;
      }
      return;
    }
    const int nb = block_for(static_cast<int>((m + groups - 1) / groups));
    for (int64_t j = n0; j < n1;) {
      const int width = j + nb <= n1 ? nb : 1;
      for (int t = 0; t < width; ++t) {
        dequantise(j + t, u, rows_buf + t * k, tmp);
      }
      int64_t r0 = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = (m - r0) / (groups - g);
        kTiles[width][rows](x + r0 * k, k, rows_buf, y + r0 * n + j, n);
        r0 += rows;
      }
      j += width;
    }
  }

  // Output columns [n0, n1) from int8 activations: formats gtile takes go
  // to it, gt.width weight rows a tile from kMultiRows x rows on (in groups
  // of at most kMultiMaxRows x rows), else one (groups of at most
  // kMaxRows); others are unpacked a weight row at a time into u (K bytes,
  // in L1) for qtile.
  void columns_a8(int64_t n0, int64_t n1, uint8_t* u, float* coef,
                  float* tmp, void* amx_buf) const {
    const int64_t groups = k / group, cstride = gsum_blocks(groups) * 16;
    const int lpg = group >= kChunk ? 16 : static_cast<int>(group / 4);
    const QTileFn* tiles = lpg == 4 ? kQRow<4> : lpg == 8 ? kQRow<8>
                                                          : kQRow<16>;
    const float off = static_cast<float>(offset + bias());
    const int64_t width = gt.one && m >= kMultiRows ? gt.width : 1;
    const int64_t max_rows = width > 1 ? kMultiMaxRows : kMaxRows;
    const int64_t row_groups = (m + max_rows - 1) / max_rows;
    const int64_t hb_row = high ? k * (bits - 4) / 8 : 0;
    // The scales of weight rows j.. (count of them, groups apart: as
    // stored, or converted into tmp), and their coef (scale * offset +
    // min) into coef, rows cstride apart, zero from groups on.
    const auto factors = [&](int64_t j, int64_t count) {
      const float* s = scales.row(j, groups, tmp);
      for (int64_t t = 1; t < count; ++t) {
        scales.row(j + t, groups, tmp + t * groups);
      }
      for (int64_t t = 0; t < count; ++t) {
        float* c = coef + t * cstride;
        const float* mn = mins.row(j + t, groups, tmp + count * groups);
        for (int64_t g = 0; g < groups; ++g) {
          c[g] = s[t * groups + g] * off + (mn ? mn[g] : 0.f);
        }
        std::fill(c + groups, c + cstride, 0.f);
      }
      return s;
    };
    for (int64_t j = n0; j < n1;) {
#if defined(SPECJAX_AMX)
      if (amx && j + kAmxRows <= n1) {  // 16 weight rows in AMX tiles
        const float* s = factors(j, kAmxRows);
        amx(*amx_act, m, k, codes + j * k / 2,
            high ? high + j * hb_row : nullptr, s, groups, coef, cstride,
            *static_cast<AmxBuffers*>(amx_buf), y + j, n);
        j += kAmxRows;
        continue;
      }
#endif
      const int64_t nb = j + width <= n1 ? width : 1;
      const float* s = factors(j, nb);
      const uint8_t* low = codes + j * k / 2;
      const uint8_t* hb = high ? high + j * hb_row : nullptr;
      if (!gt.one) row_codes(j, u);
      int64_t r0 = 0;
      for (int64_t rg = 0; rg < row_groups; ++rg) {
        const int64_t rows = (m - r0) / (row_groups - rg);
        float* out = y + r0 * n + j;
        if (gt.one) {
          (nb > 1 ? gt.multi : gt.one)[rows](*act, r0, k, low, hb, s, groups,
                                             coef, cstride, out, n);
        } else {
          tiles[rows](*act, r0, k, group, u, s, coef, out, n);
        }
        r0 += rows;
      }
      j += nb;
    }
  }

  void drain() {
    std::unique_ptr<float[]> buf(new float[kMaxBlock * k]);
    std::unique_ptr<uint8_t[]> u(new uint8_t[k]);
    void* amx_buf = nullptr;
#if defined(SPECJAX_AMX)
    // Scales and mins of 16 weight rows; tiles configured per thread.
    std::unique_ptr<float[]> tmp(new float[(kAmxRows + 5) * (k / group)]);
    std::unique_ptr<AmxBuffers> amx_bufs;
    if (amx) {
      amx_bufs.reset(new AmxBuffers(amx_act->xgroups));
      amx_buf = amx_bufs.get();
      const AmxConfig config(static_cast<int>(group));
      // GCC's _tile_loadconfig tells the compiler it reads 8 bytes, which
      // then dropped the stores of the other 56 as dead (and ldtilecfg
      // faulted on garbage): a barrier keeps them.
      asm volatile("" : : "r"(&config) : "memory");
      _tile_loadconfig(&config);
    }
#else
    std::unique_ptr<float[]> tmp(new float[2 * kFWideBlock * (k / group)]);
#endif
    chunks->drain([&](int64_t c) {
      const int64_t n0 = c * chunk, n1 = std::min(n, n0 + chunk);
      if (act) {
        columns_a8(n0, n1, u.get(), buf.get(), tmp.get(), amx_buf);
      } else {
        columns(n0, n1, u.get(), buf.get(), tmp.get());
      }
    });
#if defined(SPECJAX_AMX)
    if (amx) _tile_release();
#endif
  }
};

// An operand of QuantProduct: a whole buffer, or slab `index` [dims[1:]]
// of a stacked one [L, ...] where it lies (a mixture of experts' experts).
struct Slab {
  ffi::DataType type;
  ffi::Span<const int64_t> dims;
  const void* data;

  Slab(const ffi::AnyBuffer& b)  // NOLINT: a whole buffer is a slab
      : type(b.element_type()), dims(b.dimensions()),
        data(b.untyped_data()) {}
  // b [L, ...], 0 <= index < L.
  Slab(const ffi::AnyBuffer& b, int64_t index)
      : type(b.element_type()),
        dims(b.dimensions().last(b.dimensions().size() - 1)),
        data(static_cast<const char*>(b.untyped_data()) +
             index * (b.size_bytes() / b.dimensions()[0])) {}
  ffi::DataType element_type() const { return type; }
  ffi::Span<const int64_t> dimensions() const { return dims; }
  const void* untyped_data() const { return data; }
};

// Scales or mins [n, groups] of element type `type` (F32, F16, or with
// `integer` S8 / U8 times half factors sup [n, groups / per]) -> f, or
// false where the buffers do not make them.
bool read_factors(const Slab& sub, const Slab& sup, int64_t n,
                  int64_t groups, bool integer_ok, GroupFactors* f) {
  const auto t = sub.element_type();
  const auto sd = sub.dimensions();
  if (sd.size() != 2 || sd[0] != n || sd[1] != groups) return false;
  if (t == ffi::DataType::F32) {
    f->f32 = static_cast<const float*>(sub.untyped_data());
    return true;
  }
  if (t == ffi::DataType::F16) {
    f->f16 = static_cast<const uint16_t*>(sub.untyped_data());
    return true;
  }
  const auto pd = sup.dimensions();
  if (!integer_ok || (t != ffi::DataType::S8 && t != ffi::DataType::U8) ||
      sup.element_type() != ffi::DataType::F16 || pd.size() != 2 ||
      pd[0] != n || pd[1] <= 0 || groups % pd[1]) {
    return false;
  }
  f->sub = static_cast<const uint8_t*>(sub.untyped_data());
  f->sub_signed = t == ffi::DataType::S8;
  f->sup = static_cast<const uint16_t*>(sup.untyped_data());
  f->per = groups / pd[1];
  return true;
}

// One quantized product y[m, n] = x[m, k] @ w^T from w's buffers (see
// above); codes and high are any one-byte type (int8 codes are read as
// bytes: an XLA bitcast to uint8 would copy them every call), scales float,
// half or int8 / uint8 times half super_scales, mins float or uint8 times
// half super_mins (read_factors; all read as stored).
ffi::Error QuantProduct(ffi::ThreadPool& pool, const float* x, int64_t m,
                        int64_t k, const Slab& codes, const Slab& high,
                        const Slab& scales, const Slab& mins,
                        const Slab& super_scales, const Slab& super_mins,
                        float* y, int64_t bits, int64_t group,
                        int64_t offset, int64_t has_mins, int64_t act8) {
  const auto cd = codes.dimensions(), hd = high.dimensions();
  const int64_t low_bits = bits == 8 ? 8 : 4;
  const bool has_high = bits == 5 || bits == 6;
  auto work = std::make_shared<QWork>();
  if (cd.size() != 2 || ffi::ByteWidth(codes.element_type()) != 1 ||
      (has_high && ffi::ByteWidth(high.element_type()) != 1) ||
      (bits < 4 || bits > 8 || bits == 7) || group <= 0 || group % 16 ||
      (bits < 8 && group != 16 && group % 32) ||
      (act8 && (k % kChunk ||
               (group != 16 && group != 32 && group % kChunk))) ||
      k % group || cd[1] * (8 / low_bits) != k ||
      (has_high && (hd.size() != 2 || hd[0] != cd[0] ||
                    hd[1] * 8 != k * (bits - 4))) ||
      // scales and mins [N, K / group] (read_factors checks their shapes)
      !read_factors(scales, super_scales, cd[0], k / group, true,
                    &work->scales) ||
      (has_mins && (!read_factors(mins, super_mins, cd[0], k / group,
                                  mins.element_type() == ffi::DataType::U8,
                                  &work->mins) ||
                    work->mins.f16))) {
    return ffi::Error::InvalidArgument(
        "specjax_smallm_quant expects x [M, K], codes [N, K * bits / 8] "
        "(8 bits) or [N, K / 2], for 5 or 6 bits high [N, K * (bits - 4) "
        "/ 8], scales [N, K / group] float or half (or int8 / uint8 with "
        "half super_scales [N, K / group / S]), mins float (or uint8 with "
        "half super_mins), group a multiple of 16 (of 32 for nibbles, or "
        "16; with int8 activations, K a multiple of 64 and group 16, 32 or "
        "a multiple of 64)");
  }
  work->x = x;
  work->codes = static_cast<const uint8_t*>(codes.untyped_data());
  work->high =
      has_high ? static_cast<const uint8_t*>(high.untyped_data()) : nullptr;
  work->y = y;
  work->m = m;
  work->k = k;
  work->n = cd[0];
  work->group = group;
  work->bits = bits;
  work->offset = offset;
  if (work->m == 0 || work->n == 0) return ffi::Error::Success();
  if (act8) {
    work->gt = gtiles(bits, group, k);
    work->act.reset(new Act8(work->x, work->m, work->k, group,
                             work->gt.one != nullptr));
#if defined(SPECJAX_AMX)
    if (work->gt.one && m >= kAmxMinRows && cd[0] >= kAmxRows &&
        (work->amx = amx_tiles(bits, group, k))) {
      work->amx_act.reset(new AmxAct(*work->act, k, group));
    }
#endif
  } else if (k % kNibBlock == 0 && (work->ft = ftiles(bits, group)).one) {
    work->xperm.reset(new XPerm(x, m, k, static_cast<int>(group)));
  }
  // About 64 KiB of packed weights per chunk, a multiple of the tile rows.
  const int64_t row_bytes = std::max<int64_t>(1, work->k * bits / 8);
  work->chunk = std::max<int64_t>(
      kMaxBlock, (1 << 16) / row_bytes / kMaxBlock * kMaxBlock);
#if defined(SPECJAX_AMX)
  if (work->amx) {  // whole AMX tiles of weight rows
    work->chunk = std::max(kAmxRows, work->chunk / kAmxRows * kAmxRows);
  }
#endif
  RunChunks(pool, work, (work->n + work->chunk - 1) / work->chunk);
  return ffi::Error::Success();
}

ffi::Error SmallMQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::AnyBuffer codes, ffi::AnyBuffer high,
                           ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                           ffi::AnyBuffer super_scales,
                           ffi::AnyBuffer super_mins,
                           ffi::ResultBuffer<ffi::F32> y, int64_t bits,
                           int64_t group, int64_t offset, int64_t has_mins,
                           int64_t act8) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) {
    return ffi::Error::InvalidArgument("specjax_smallm_quant expects x [M, K]");
  }
  return QuantProduct(pool, x.typed_data(), xd[0], xd[1], codes, high, scales,
                      mins, super_scales, super_mins, y->typed_data(), bits,
                      group, offset, has_mins, act8);
}

// The quantized product inside a layer loop: the remaining operands are
// every layer's codes, then high bits, scales, mins, super_scales and
// super_mins (kPickOperands of L each; a layer without one of them repeats
// another of its buffers there), and the layer's format is element
// `index` of each attribute, since a GGUF file may store one name in
// different block types from layer to layer. Or, where the codes have
// rank 3, the operands are one stack each [L, ...] (a mixture of experts'
// experts, one format: attributes of one element), and the product reads
// slab `index` of each where it lies. Any number of rows, in passes of
// kPickRows.
ffi::Error SmallMQuantPickImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::S32> index,
                               ffi::RemainingArgs ws,
                               ffi::ResultBuffer<ffi::F32> y,
                               ffi::Span<const int64_t> bits,
                               ffi::Span<const int64_t> group,
                               ffi::Span<const int64_t> offset,
                               ffi::Span<const int64_t> has_mins,
                               int64_t act8) {
  const auto xd = x.dimensions();
  constexpr int64_t kPickOperands = 6;
  const int64_t formats = static_cast<int64_t>(ws.size()) / kPickOperands;
  const int64_t layer = index.typed_data()[0];
  if (xd.size() != 2 || index.element_count() != 1 ||
      static_cast<int64_t>(ws.size()) != kPickOperands * formats ||
      formats == 0 || static_cast<int64_t>(bits.size()) != formats ||
      static_cast<int64_t>(group.size()) != formats ||
      static_cast<int64_t>(offset.size()) != formats ||
      static_cast<int64_t>(has_mins.size()) != formats) {
    return ffi::Error::InvalidArgument(
        "specjax_smallm_quant_pick expects x [M, K], a scalar index, and "
        "6 L buffers and L formats, or 6 stacks [L, ...] and one format");
  }
  const auto cd = ws.get<ffi::AnyBuffer>(0)->dimensions();
  const bool stacked = formats == 1 && cd.size() == 3;
  const int64_t layers = stacked ? cd[0] : formats;
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument(
        "specjax_smallm_quant_pick: index " + std::to_string(layer) +
        " is not below L = " + std::to_string(layers));
  }
  std::vector<Slab> b;
  for (int64_t i = 0; i < kPickOperands; ++i) {
    auto buffer = ws.get<ffi::AnyBuffer>(stacked ? i : i * layers + layer);
    if (!buffer.has_value()) return buffer.error();
    if (!stacked) {
      b.emplace_back(*buffer);
    } else if (buffer->dimensions().size() == 3 &&
               buffer->dimensions()[0] == layers) {
      b.emplace_back(*buffer, layer);
    } else {
      return ffi::Error::InvalidArgument(
          "specjax_smallm_quant_pick: a stack's 6 operands must all be "
          "[L, N, ...] with one L");
    }
  }
  const int64_t f = stacked ? 0 : layer;  // the format's element
  const int64_t m = xd[0], k = xd[1], n = b[0].dimensions()[0];
  for (int64_t r = 0; r < m; r += kPickRows) {
    ffi::Error e = QuantProduct(
        pool, x.typed_data() + r * k, std::min(kPickRows, m - r), k, b[0],
        b[1], b[2], b[3], b[4], b[5], y->typed_data() + r * n, bits[f],
        group[f], offset[f], has_mins[f], act8);
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMQuant, SmallMQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("has_mins")
                                  .Attr<int64_t>("act8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallM, SmallMImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMPick, SmallMPickImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("in_out"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMQuantPick, SmallMQuantPickImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("group")
                                  .Attr<ffi::Span<const int64_t>>("offset")
                                  .Attr<ffi::Span<const int64_t>>("has_mins")
                                  .Attr<int64_t>("act8"));

// 1 where int8 products of kAmxMinRows x rows or more take AMX tiles in
// this process, else 0 (specjax.cpu.kernels.amx).
extern "C" int SpecjaxAmx() {
#if defined(SPECJAX_AMX)
  return amx_usable() ? 1 : 0;
#else
  return 0;
#endif
}
