// Small-M matrix product for verification passes: y[M, N] = x[M, K] @ w[N, K]^T.
//
// Decoding and verification multiply a few rows (M = B * T <= 32) by large
// weight matrices, so the cost is reading the weights once. This kernel
// streams each weight row w[n, :] from memory exactly once and applies it to
// every row of x, which stays in cache (M * K floats). Output rows are split
// into chunks that XLA's intra-op thread pool and the calling thread claim
// with an atomic counter, so no thread waits on a task that never started.
//
// Built at first use by specjax/kernels/build.py with the host's compiler and
// -march=native; vector code comes from GCC/Clang vector extensions, which
// lower to AVX-512, AVX2 or NEON as the machine has.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

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

inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
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
      for (int j = 0; j < NB; ++j) acc[j][r] += u[j] * xr;
    }
  }
  for (int j = 0; j < NB; ++j) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[j][r]);
      for (int64_t i = kv; i < k; ++i) s += w[j * k + i] * x[r * k + i];
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

struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void drain() {
    for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
      const int64_t n0 = c * chunk;
      columns(x, w, y, m, k, n, n0, std::min(n, n0 + chunk));
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SmallMImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument(
        "specjax_smallm_matmul expects x [M, K] and w [N, K]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  if (m == 0 || n == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->m = m;
  work->k = k;
  work->n = n;
  // About 256 KiB of weights per chunk, a multiple of the tile's rows.
  work->chunk = std::max<int64_t>(
      kMaxBlock, (1 << 16) / std::max<int64_t>(k, 1) / kMaxBlock * kMaxBlock);
  work->num_chunks = (n + work->chunk - 1) / work->chunk;
  // The calling thread works too: with it, as many threads as the pool has
  // (one more oversubscribes the cores XLA sized the pool for).
  const int64_t helpers = std::max<int64_t>(
      0, std::min<int64_t>(pool.num_threads() - 1, work->num_chunks - 1));
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work] { work->drain(); });
  }
  work->drain();
  while (work->finished.load(std::memory_order_acquire) < work->num_chunks) {
    // Only chunks another thread already claimed remain: they are running.
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallM, SmallMImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
