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
#include <array>
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

// Quantized weights (specjax.models.quantized): codes [N, K] int8 (bits 8)
// or [N, K / 2] nibbles (bits 4, 5, 6; in each group of G, byte i holds
// element i in its low nibble and i + G/2 in its high one), for 5 and 6
// bits a plane of hb = bits - 4 high bits per element, [N, K * hb / 8]
// (byte b holds elements b * 8/hb + p at bit p * hb), and one scale (and
// min) per group of G inputs: w = (code - offset) * scale - min, with code
// = low | high << 4. Each tile's weight rows are read as packed bytes once,
// dequantised into a buffer that stays in L1, and applied to every x row
// by the float tiles above.
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));
constexpr uint64_t kLowNibbles = 0x0f0f0f0f0f0f0f0full;
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

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

struct QWork {
  const float* x;
  const uint8_t* codes;
  const uint8_t* high;  // nullptr: no high bits
  const float* scales;
  const float* mins;  // nullptr: no mins
  float* y;
  int64_t m, k, n, group, bits, offset, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  // 16 consecutive codes of one group -> out[0, 16): (code - offset) *
  // scale - min, as specjax.models.quantized computes it.
  static inline void emit(i32x16 codes, int32_t off, float sc, float mv,
                          float* out) {
    const f32x16 w = __builtin_convertvector(codes - off, f32x16) * sc - mv;
    std::memcpy(out, &w, sizeof(w));
  }

  void dequantise(int64_t j, float* out) const {
    const int64_t groups = k / group;
    const int32_t off = static_cast<int32_t>(offset);
    const float* s = scales + j * groups;
    const float* mn = mins ? mins + j * groups : nullptr;
    if (bits == 8) {
      const uint8_t* c = codes + j * k;
      for (int64_t g = 0; g < groups; ++g) {
        const float sc = s[g], mv = mn ? mn[g] : 0.f;
        for (int64_t e = g * group; e < (g + 1) * group; e += 16) {
          // int8 through uint8: GCC widens uint8 vectors with one
          // instruction but int8 ones element by element.
          u8x16 v;
          std::memcpy(&v, c + e, 16);
          emit(__builtin_convertvector(v ^ 0x80, i32x16) - 128, off, sc, mv,
               out + e);
        }
      }
      return;
    }
    // Within a group, byte i holds element i and element i + G/2; the
    // codes of 16 consecutive elements are the low (then high) nibbles of
    // 16 bytes, or for G = 16 the low then high nibbles of its 8 bytes.
    const int64_t half = group / 2;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = codes + j * (k / 2) + g * half;
      const float sc = s[g], mv = mn ? mn[g] : 0.f;
      for (int64_t e = 0; e < group; e += 16) {
        u8x16 v;
        if (half == 8) {  // built from two 64-bit halves: byte shuffles
          uint64_t b;     // and partial copies compile to scalar code
          std::memcpy(&b, c, 8);
          const u64x2 both = {b & kLowNibbles, (b >> 4) & kLowNibbles};
          v = reinterpret_cast<const u8x16&>(both);
        } else {
          std::memcpy(&v, c + e % half, 16);
          v = e < half ? v & 15 : v >> 4;
        }
        if (bits == 6) {  // 16 elements' high bits are 4 bytes
          const uint8_t* h = high + (j * k + g * group + e) / 4;
          const u32x4 t = {kHigh2[h[0]], kHigh2[h[1]], kHigh2[h[2]],
                           kHigh2[h[3]]};
          v |= reinterpret_cast<const u8x16&>(t);
        } else if (bits == 5) {  // 2 bytes
          const uint8_t* h = high + (j * k + g * group + e) / 8;
          const u64x2 t = {kHigh1[h[0]], kHigh1[h[1]]};
          v |= reinterpret_cast<const u8x16&>(t);
        }
        emit(__builtin_convertvector(v, i32x16), off, sc, mv,
             out + g * group + e);
      }
    }
  }

  void columns(int64_t n0, int64_t n1, float* rows_buf) const {
    const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
    const int nb = block_for(static_cast<int>((m + groups - 1) / groups));
    for (int64_t j = n0; j < n1;) {
      const int width = j + nb <= n1 ? nb : 1;
      for (int t = 0; t < width; ++t) dequantise(j + t, rows_buf + t * k);
      int64_t r0 = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t rows = (m - r0) / (groups - g);
        kTiles[width][rows](x + r0 * k, k, rows_buf, y + r0 * n + j, n);
        r0 += rows;
      }
      j += width;
    }
  }

  void drain() {
    std::unique_ptr<float[]> buf(new float[kMaxBlock * k]);
    for (int64_t c; (c = next.fetch_add(1)) < num_chunks;) {
      const int64_t n0 = c * chunk;
      columns(n0, std::min(n, n0 + chunk), buf.get());
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SmallMQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::U8> codes,
                           ffi::Buffer<ffi::U8> high,
                           ffi::Buffer<ffi::F32> scales,
                           ffi::Buffer<ffi::F32> mins,
                           ffi::ResultBuffer<ffi::F32> y, int64_t bits,
                           int64_t group, int64_t offset, int64_t has_mins) {
  const auto xd = x.dimensions(), cd = codes.dimensions();
  const auto hd = high.dimensions(), sd = scales.dimensions();
  const int64_t low_bits = bits == 8 ? 8 : 4;
  const bool has_high = bits == 5 || bits == 6;
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 ||
      (bits < 4 || bits > 8 || bits == 7) || group <= 0 || group % 16 ||
      xd[1] % group || sd[0] != cd[0] || sd[1] * group != xd[1] ||
      cd[1] * (8 / low_bits) != xd[1] ||
      (has_high && (hd.size() != 2 || hd[0] != cd[0] ||
                    hd[1] * 8 != xd[1] * (bits - 4)))) {
    return ffi::Error::InvalidArgument(
        "specjax_smallm_quant expects x [M, K], codes [N, K * bits / 8] "
        "(8 bits) or [N, K / 2], for 5 or 6 bits high [N, K * (bits - 4) "
        "/ 8], and scales [N, K / group], group a multiple of 16");
  }
  auto work = std::make_shared<QWork>();
  work->x = x.typed_data();
  work->codes = codes.typed_data();
  work->high = has_high ? high.typed_data() : nullptr;
  work->scales = scales.typed_data();
  work->mins = has_mins ? mins.typed_data() : nullptr;
  work->y = y->typed_data();
  work->m = xd[0];
  work->k = xd[1];
  work->n = cd[0];
  work->group = group;
  work->bits = bits;
  work->offset = offset;
  if (work->m == 0 || work->n == 0) return ffi::Error::Success();
  // About 64 KiB of packed weights per chunk, a multiple of the tile rows.
  const int64_t row_bytes = std::max<int64_t>(1, work->k * bits / 8);
  work->chunk = std::max<int64_t>(
      kMaxBlock, (1 << 16) / row_bytes / kMaxBlock * kMaxBlock);
  work->num_chunks = (work->n + work->chunk - 1) / work->chunk;
  const int64_t helpers = std::max<int64_t>(
      0, std::min<int64_t>(pool.num_threads() - 1, work->num_chunks - 1));
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work] { work->drain(); });
  }
  work->drain();
  while (work->finished.load(std::memory_order_acquire) < work->num_chunks) {
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMQuant, SmallMQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("has_mins"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallM, SmallMImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
