// The products of attention and of matmul, written once over a row reader and included per target
// by kernels.cpp (f32 rows: weights and f32 K/V) and kv_kernels.cpp (K/V stored as f16, bf16,
// Q8_0), after <hwy/highway.h>; Highway's per-target include guard below re-expands it for each
// target foreach_target.h compiles.
//
// A row reader is a struct with
//   static V load(D, const std::uint8_t* row, std::int64_t j);    // values [j, j + lanes) as f32
//   static float value(const std::uint8_t* row, std::int64_t j);  // value j as f32
// A vector load never straddles a Q8_0 block: vectors are capped at 16 floats, which divides 32.
//
// Vectors are at most 16 floats (CappedTag<float, 16>: a 512-bit register). Scalable vectors (SVE,
// RVV) are not compiled (kernels.cpp disables them): the tiles keep vectors in arrays, which
// sizeless types do not allow.

// NOLINTNEXTLINE(llvm-header-guard): Highway's per-target include guard
#if defined(KVEVICT_MODEL_KERNELS_TILES_INL_HPP_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVEVICT_MODEL_KERNELS_TILES_INL_HPP_
#undef KVEVICT_MODEL_KERNELS_TILES_INL_HPP_
#else
#define KVEVICT_MODEL_KERNELS_TILES_INL_HPP_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

HWY_BEFORE_NAMESPACE();
namespace kvevict::model::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::CappedTag<float, 16>;
using V = hn::Vec<D>;

// x86 with AVX-512 has 32 vector registers, the others 16: the tiles are sized to fit.
#if HWY_TARGET <= HWY_AVX3
constexpr int kWideTile = 4;
#else
constexpr int kWideTile = 2;
#endif

HWY_INLINE float sum_lanes(D d, V v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

struct F32Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    return hn::LoadU(d, reinterpret_cast<const float*>(row) + j);
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    return reinterpret_cast<const float*>(row)[j];
  }
};

// --- Y = X K^T ----------------------------------------------------------------------------------

// Y[i][c] = X[i] . K[c] for a tile of kM rows of X and kN rows of K: kM * kN accumulators, each
// loaded vector of X used kN times and of K kM times, each summed across its lanes at the end.
template <class Row, int kM, int kN>
HWY_INLINE void score_tile(const float* x, std::ptrdiff_t x_stride, const std::uint8_t* keys,
                           std::size_t row_bytes, std::int64_t k, float* y,
                           std::ptrdiff_t y_stride) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  V acc[kM][kN];
  for (int i = 0; i < kM; ++i) {
    for (int c = 0; c < kN; ++c) acc[i][c] = hn::Zero(d);
  }
  std::int64_t j = 0;
  for (; j + lanes <= k; j += lanes) {
    V kv[kN];
    for (int c = 0; c < kN; ++c) kv[c] = Row::load(d, keys + c * row_bytes, j);
    for (int i = 0; i < kM; ++i) {
      const V xv = hn::LoadU(d, x + i * x_stride + j);
      for (int c = 0; c < kN; ++c) acc[i][c] = hn::MulAdd(xv, kv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < kM; ++i) {
    for (int c = 0; c < kN; ++c) {
      float total = sum_lanes(d, acc[i][c]);
      for (std::int64_t t = j; t < k; ++t) {
        total += x[i * x_stride + t] * Row::value(keys + c * row_bytes, t);
      }
      y[i * y_stride + c] = total;
    }
  }
}

// Rows [0, m) of X against kN rows of K, which stay in L1 while the rows of X stream past.
template <class Row, int kN>
HWY_INLINE void score_columns(const float* x, std::ptrdiff_t x_stride, std::int64_t m,
                              const std::uint8_t* keys, std::size_t row_bytes, std::int64_t k,
                              float* y, std::ptrdiff_t y_stride) {
  std::int64_t i = 0;
  for (; i + 4 <= m; i += 4) {
    score_tile<Row, 4, kN>(x + i * x_stride, x_stride, keys, row_bytes, k, y + i * y_stride,
                           y_stride);
  }
  for (; i < m; ++i) {
    score_tile<Row, 1, kN>(x + i * x_stride, x_stride, keys, row_bytes, k, y + i * y_stride,
                           y_stride);
  }
}

#if HWY_TARGET != HWY_SCALAR
constexpr std::size_t kLanes = hn::MaxLanes(D());

// Lane c of the result is the sum of the lanes of sums[c], for c in [0, kLanes): the vectors are
// added pairwise, even lanes to odd lanes, halving their number at each level (kLanes - 1
// ConcatEven / ConcatOdd pairs in all, against kLanes full reductions one vector at a time).
// Lane order: the pairs of sums[2c] fill the lower half of each new vector, those of sums[2c + 1]
// the upper half, so that after the last level lane c holds sums[c]. Overwrites sums.
HWY_INLINE V sum_each(D d, V* sums) {
  for (std::size_t width = kLanes; width > 1; width /= 2) {
    for (std::size_t c = 0; c < width / 2; ++c) {
      sums[c] = hn::Add(hn::ConcatEven(d, sums[2 * c + 1], sums[2 * c]),
                        hn::ConcatOdd(d, sums[2 * c + 1], sums[2 * c]));
    }
  }
  return sums[0];
}

// Y[r][g] = X[r] . K[g] for the kR rows of X and the kLanes / kR keys of a tile, over k = kVecs
// vectors (kVecs 0: k / lanes, known at run time only): score_tile's kR x (kLanes / kR)
// independent accumulators, but their sums across lanes formed together (sum_each) instead of one
// full reduction each, which cost more than reading the key. sums[r * keys + g] puts each row's
// scores side by side in the result. kPartial: only the first `count` keys exist (zeros stand for
// the others), so that a key's score is summed in the same order wherever it falls: the logits do
// not depend on how the rows of W are split between threads.
// kPerKey: key g is scored with its own rows, xs[g] (key_blocks_by_run); otherwise every key with
// xs[0]'s, each of their vectors loaded once for all the tile's keys. A key's sum is the same
// either way.
template <class Row, int kR, int kVecs, bool kPartial = false, bool kPerKey = false>
HWY_INLINE void key_tile(const float* const* xs, std::ptrdiff_t x_stride, const std::uint8_t* keys,
                         std::size_t row_bytes, std::int64_t k, float* y, std::ptrdiff_t y_stride,
                         int count = static_cast<int>(kLanes) / kR) {
  constexpr int kKeys = static_cast<int>(kLanes) / kR;
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t vecs = kVecs > 0 ? kVecs : k / lanes;
  V sums[kLanes];
  for (V& sum : sums) sum = hn::Zero(d);
#pragma GCC unroll 8
  for (std::int64_t jv = 0; jv < vecs; ++jv) {
    V kv[kKeys];
    for (int g = 0; g < kKeys; ++g) {
      kv[g] = !kPartial || g < count ? Row::load(d, keys + g * row_bytes, jv * lanes) : hn::Zero(d);
    }
    for (int r = 0; r < kR; ++r) {
      if constexpr (kPerKey) {
        for (int g = 0; g < kKeys; ++g) {
          const V xv = hn::LoadU(d, xs[g] + r * x_stride + jv * lanes);
          sums[r * kKeys + g] = hn::MulAdd(xv, kv[g], sums[r * kKeys + g]);
        }
      } else {
        const V xv = hn::LoadU(d, xs[0] + r * x_stride + jv * lanes);
        for (int g = 0; g < kKeys; ++g) {
          sums[r * kKeys + g] = hn::MulAdd(xv, kv[g], sums[r * kKeys + g]);
        }
      }
    }
  }
  HWY_ALIGN float tile[kLanes];
  hn::Store(sum_each(d, sums), d, tile);
  for (int r = 0; r < kR; ++r) std::copy_n(tile + r * kKeys, count, y + r * y_stride);
}

// How far ahead key_blocks asks for keys: about 4 KB of rows, whole blocks of kLanes keys.
HWY_INLINE std::int64_t keys_ahead(std::size_t row_bytes) {
  const std::size_t block_bytes = kLanes * row_bytes;
  return static_cast<std::int64_t>(
      kLanes * std::max<std::size_t>(1, (std::size_t{4096} + block_bytes - 1) / block_bytes));
}

// Asks for the block of kLanes keys `ahead` rows past `tile`, those of the `left` rows from tile
// on that exist (a short range's tail included).
HWY_INLINE void prefetch_keys(const std::uint8_t* tile, std::size_t row_bytes, std::int64_t ahead,
                              std::int64_t left) {
  const std::int64_t rows = std::min(static_cast<std::int64_t>(kLanes), left - ahead);
  for (std::size_t b = 0; b < static_cast<std::size_t>(std::max<std::int64_t>(0, rows)) * row_bytes;
       b += 64) {
    hwy::Prefetch(tile + ahead * row_bytes + b);
  }
}

// Y[i][c] = X[i] . K[c] for i in [0, m), c in [0, n), k a multiple of the lanes: blocks of kLanes
// keys (in L1 after the first rows of X read them), rows of X four (or one) at a time. The keys
// about 4 KB ahead are prefetched: without it the hardware prefetchers do not run far enough
// ahead, and the products wait for each key in turn (measured: q.K at 16K slots took the time of
// its arithmetic plus that of the read, about 1.6x the read; with it, about the read).
template <class Row, int kVecs>
HWY_INLINE void key_blocks(const float* x, std::ptrdiff_t x_stride, std::int64_t m,
                           const std::uint8_t* keys, std::size_t row_bytes, std::int64_t n,
                           std::int64_t k, float* y, std::ptrdiff_t y_stride) {
  constexpr int kRows = kLanes >= 4 ? 4 : static_cast<int>(kLanes);
  const std::int64_t ahead = keys_ahead(row_bytes);
  const auto block = static_cast<std::int64_t>(kLanes);
  constexpr int kTileKeys = static_cast<int>(kLanes) / kRows;
  std::int64_t c = 0;
  for (; c + block <= n; c += block) {
    const std::uint8_t* tile = keys + c * row_bytes;
    prefetch_keys(tile, row_bytes, ahead, n - c);
    std::int64_t i = 0;
    for (; i + kRows <= m; i += kRows) {
      const float* xi = x + i * x_stride;
      for (int g = 0; g < block; g += kTileKeys) {
        key_tile<Row, kRows, kVecs>(&xi, x_stride, tile + g * row_bytes, row_bytes, k,
                                    y + i * y_stride + c + g, y_stride);
      }
    }
    for (; i < m; ++i) {
      const float* xi = x + i * x_stride;
      key_tile<Row, 1, kVecs>(&xi, x_stride, tile, row_bytes, k, y + i * y_stride + c, y_stride);
    }
  }
  if (c == n) return;
  // The last n - c < kLanes keys: kRows rows at a time by tiles of kTileKeys keys, as above (each
  // score summed alike, whatever the tile: kLanes accumulators either way), then the rows left.
  const std::uint8_t* tail = keys + c * row_bytes;
  std::int64_t i = 0;
  for (; i + kRows <= m; i += kRows) {
    const float* xi = x + i * x_stride;
    for (std::int64_t g = 0; g < n - c; g += kTileKeys) {
      key_tile<Row, kRows, kVecs, true>(
          &xi, x_stride, tail + g * row_bytes, row_bytes, k, y + i * y_stride + c + g, y_stride,
          static_cast<int>(std::min<std::int64_t>(kTileKeys, n - c - g)));
    }
  }
  for (; i < m; ++i) {
    const float* xi = x + i * x_stride;
    key_tile<Row, 1, kVecs, true>(&xi, x_stride, tail, row_bytes, k, y + i * y_stride + c, y_stride,
                                  static_cast<int>(n - c));
  }
}

// One tile of key_blocks_by_run, kLanes / kR keys: rows[g] is key g's first query row (kR of them,
// x_stride apart). The tile reads its rows once when every key's are the same (kPerKey otherwise).
template <class Row, int kR, int kVecs>
HWY_INLINE void key_tile_of_runs(const float* const* rows, std::ptrdiff_t x_stride,
                                 const std::uint8_t* keys, std::size_t row_bytes, std::int64_t k,
                                 float* y, std::ptrdiff_t y_stride, int count) {
  constexpr int kKeys = static_cast<int>(kLanes) / kR;
  bool one_run = true;
  for (int g = 1; g < kKeys; ++g) one_run = one_run && rows[g] == rows[0];
  if (count == kKeys) {
    if (one_run) return key_tile<Row, kR, kVecs>(rows, x_stride, keys, row_bytes, k, y, y_stride);
    return key_tile<Row, kR, kVecs, false, true>(rows, x_stride, keys, row_bytes, k, y, y_stride);
  }
  if (one_run) {
    return key_tile<Row, kR, kVecs, true>(rows, x_stride, keys, row_bytes, k, y, y_stride, count);
  }
  key_tile<Row, kR, kVecs, true, true>(rows, x_stride, keys, row_bytes, k, y, y_stride, count);
}

// key_blocks with a block of query rows per run of keys: keys [runs[r - 1].end, runs[r].end) (from
// 0; the last end is n) are scored with the rows at runs[r].x + x_offset. Each score is key_tile's
// sum for its key alone, so the bits are those of key_blocks over each run on its own, whatever
// the runs' lengths: under cache_index a unit's live slots fall into thousands of runs of a few
// slots (freed slots are refilled by newer tokens), which one call each would pay for many times.
template <class Row, int kVecs, class Run>
HWY_INLINE void key_blocks_by_run(const Run* runs, std::ptrdiff_t x_offset, std::ptrdiff_t x_stride,
                                  std::int64_t m, const std::uint8_t* keys, std::size_t row_bytes,
                                  std::int64_t n, std::int64_t k, float* y,
                                  std::ptrdiff_t y_stride) {
  constexpr int kRows = kLanes >= 4 ? 4 : static_cast<int>(kLanes);
  constexpr int kTileKeys = static_cast<int>(kLanes) / kRows;
  const std::int64_t ahead = keys_ahead(row_bytes);
  const auto block = static_cast<std::int64_t>(kLanes);
  const Run* run = runs;
  const float* xs[kLanes];    // the rows of each key of the block (past n: the last key's)
  const float* rows[kLanes];  // those of a tile, at row i
  for (std::int64_t c = 0; c < n; c += block) {
    const std::int64_t count = std::min(block, n - c);
    const std::uint8_t* tile = keys + c * row_bytes;
    prefetch_keys(tile, row_bytes, ahead, n - c);
    for (std::int64_t g = 0; g < block; ++g) {
      while (g < count && run->end <= c + g) ++run;
      xs[g] = run->x + x_offset;
    }
    std::int64_t i = 0;
    for (; i + kRows <= m; i += kRows) {
      for (int g = 0; g < count; g += kTileKeys) {
        for (int t = 0; t < kTileKeys; ++t) rows[t] = xs[g + t] + i * x_stride;
        key_tile_of_runs<Row, kRows, kVecs>(
            rows, x_stride, tile + g * row_bytes, row_bytes, k, y + i * y_stride + c + g, y_stride,
            static_cast<int>(std::min<std::int64_t>(kTileKeys, count - g)));
      }
    }
    for (; i < m; ++i) {
      for (std::int64_t t = 0; t < block; ++t) rows[t] = xs[t] + i * x_stride;
      key_tile_of_runs<Row, 1, kVecs>(rows, x_stride, tile, row_bytes, k, y + i * y_stride + c,
                                      y_stride, static_cast<int>(count));
    }
  }
}

// f(std::integral_constant<int, V>) with V = vecs for the row widths unrolled (2, 4 and 8
// vectors), 0 (known at run time only) for the others.
template <class F>
HWY_INLINE void with_row_vectors(std::int64_t vecs, F&& f) {
  switch (vecs) {
    case 2:
      return f(std::integral_constant<int, 2>());
    case 4:
      return f(std::integral_constant<int, 4>());
    case 8:
      return f(std::integral_constant<int, 8>());
    default:
      return f(std::integral_constant<int, 0>());
  }
}
#endif

// Rows of X that scores() and scores_by_run() take against every row of K at a time (64 x k
// floats, in L2): a decode step's few stacked queries are one block, a prefill's chunk several.
constexpr std::int64_t kRowBlock = 64;

// Y = X K^T over n rows of K: Y[i][c] = X[i] . K[c], i in [0, m), c in [0, n), k values a row.
// Blocks of kRowBlock rows of X against every row of K. The common row widths unrolled.
template <class Row>
void scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const std::uint8_t* keys,
            std::size_t row_bytes, std::int64_t n, std::int64_t k, float* y,
            std::ptrdiff_t y_stride) {
#if HWY_TARGET != HWY_SCALAR
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(D()));
  if (k % lanes == 0) {
    for (std::int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
      const std::int64_t rows = std::min(kRowBlock, m - i0);
      const float* xb = x + i0 * x_stride;
      float* yb = y + i0 * y_stride;
      with_row_vectors(k / lanes, [&](auto vecs) {
        key_blocks<Row, decltype(vecs)::value>(xb, x_stride, rows, keys, row_bytes, n, k, yb,
                                               y_stride);
      });
    }
    return;
  }
#endif
  // Rows not a multiple of the lanes: score_tile, whose sums across lanes finish the tails.
  if (m <= 8) {  // one key at a time, read front to back
    for (std::int64_t c = 0; c < n; ++c) {
      score_columns<Row, 1>(x, x_stride, m, keys + c * row_bytes, row_bytes, k, y + c, y_stride);
    }
    return;
  }
  for (std::int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const std::int64_t rows = std::min(kRowBlock, m - i0);
    const float* xb = x + i0 * x_stride;
    float* yb = y + i0 * y_stride;
    std::int64_t c = 0;
    for (; c + kWideTile <= n; c += kWideTile) {
      score_columns<Row, kWideTile>(xb, x_stride, rows, keys + c * row_bytes, row_bytes, k, yb + c,
                                    y_stride);
    }
    for (; c < n; ++c) {
      score_columns<Row, 1>(xb, x_stride, rows, keys + c * row_bytes, row_bytes, k, yb + c,
                            y_stride);
    }
  }
}

// scores() with the rows of X changing along the keys (key_blocks_by_run): keys [runs[r - 1].end,
// runs[r].end) of [0, n) against the rows at runs[r].x, run_count > 0 runs, the last ending at n.
// The bits of scores() over each run alone.
template <class Row, class Run>
void scores_by_run(const Run* runs, std::size_t run_count, std::ptrdiff_t x_stride, std::int64_t m,
                   const std::uint8_t* keys, std::size_t row_bytes, std::int64_t n, std::int64_t k,
                   float* y, std::ptrdiff_t y_stride) {
#if HWY_TARGET != HWY_SCALAR
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(D()));
  if (k % lanes == 0) {
    for (std::int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
      const std::int64_t rows = std::min(kRowBlock, m - i0);
      float* yb = y + i0 * y_stride;
      with_row_vectors(k / lanes, [&](auto vecs) {
        key_blocks_by_run<Row, decltype(vecs)::value>(runs, i0 * x_stride, x_stride, rows, keys,
                                                      row_bytes, n, k, yb, y_stride);
      });
    }
    return;
  }
#endif
  // Rows not a multiple of the lanes: scores() over each run.
  static_cast<void>(n);  // the last run's end
  std::int64_t begin = 0;
  for (std::size_t r = 0; r < run_count; ++r) {
    const std::int64_t end = runs[r].end;
    scores<Row>(runs[r].x, x_stride, m, keys + begin * static_cast<std::int64_t>(row_bytes),
                row_bytes, end - begin, k, y + begin, y_stride);
    begin = end;
  }
}

// --- Y += P V -----------------------------------------------------------------------------------

// Y[i] += sum_s P[i][s] V[s] for kM rows and kV vectors of columns from column j.
template <class Row, int kM, int kV>
HWY_INLINE void weighted_tile(const float* p, std::ptrdiff_t p_stride, const std::uint8_t* values,
                              std::size_t row_bytes, std::int64_t n, std::int64_t j, float* y,
                              std::ptrdiff_t y_stride) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  V acc[kM][kV];
  for (int i = 0; i < kM; ++i) {
    for (int c = 0; c < kV; ++c) acc[i][c] = hn::LoadU(d, y + i * y_stride + j + c * lanes);
  }
  for (std::int64_t s = 0; s < n; ++s) {
    V vv[kV];
    for (int c = 0; c < kV; ++c) vv[c] = Row::load(d, values + s * row_bytes, j + c * lanes);
    for (int i = 0; i < kM; ++i) {
      const V weight = hn::Set(d, p[i * p_stride + s]);
      for (int c = 0; c < kV; ++c) acc[i][c] = hn::MulAdd(weight, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < kM; ++i) {
    for (int c = 0; c < kV; ++c) hn::StoreU(acc[i][c], d, y + i * y_stride + j + c * lanes);
  }
}

template <class Row, int kM>
HWY_INLINE void weighted_rows(const float* p, std::ptrdiff_t p_stride, const std::uint8_t* values,
                              std::size_t row_bytes, std::int64_t n, std::int64_t k, float* y,
                              std::ptrdiff_t y_stride) {
  const D d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t j = 0;
  for (; j + 4 * lanes <= k; j += 4 * lanes) {
    weighted_tile<Row, kM, 4>(p, p_stride, values, row_bytes, n, j, y, y_stride);
  }
  for (; j + lanes <= k; j += lanes) {
    weighted_tile<Row, kM, 1>(p, p_stride, values, row_bytes, n, j, y, y_stride);
  }
  for (; j < k; ++j) {
    for (int i = 0; i < kM; ++i) {
      float total = y[i * y_stride + j];
      for (std::int64_t s = 0; s < n; ++s) {
        total += p[i * p_stride + s] * Row::value(values + s * row_bytes, j);
      }
      y[i * y_stride + j] = total;
    }
  }
}

// Y += P V over n rows of V: Y[i] += sum over s of P[i][s] V[s], i in [0, m), k values a row.
// Blocks of kBlock rows of V, each read by every tile of Y while it is in L1 / L2 (a head's V can
// be far larger than L2, and a tile reads only its columns for its rows of P), the next block
// prefetched as key_blocks does. Each Y value still sums over s in order.
template <class Row>
void weighted(const float* p, std::ptrdiff_t p_stride, std::int64_t m, const std::uint8_t* values,
              std::size_t row_bytes, std::int64_t n, std::int64_t k, float* y,
              std::ptrdiff_t y_stride) {
  constexpr std::int64_t kBlock = 64;
  for (std::int64_t s0 = 0; s0 < n; s0 += kBlock) {
    const std::int64_t rows = std::min(kBlock, n - s0);
    const std::uint8_t* block = values + s0 * row_bytes;
    if (s0 + 2 * kBlock <= n) {
      for (std::size_t b = 0; b < kBlock * row_bytes; b += 64)
        hwy::Prefetch(block + kBlock * row_bytes + b);
    }
    std::int64_t i = 0;
    for (; i + kWideTile <= m; i += kWideTile) {
      weighted_rows<Row, kWideTile>(p + i * p_stride + s0, p_stride, block, row_bytes, rows, k,
                                    y + i * y_stride, y_stride);
    }
    for (; i < m; ++i) {
      weighted_rows<Row, 1>(p + i * p_stride + s0, p_stride, block, row_bytes, rows, k,
                            y + i * y_stride, y_stride);
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvevict::model::kernels
HWY_AFTER_NAMESPACE();

#endif  // KVEVICT_MODEL_KERNELS_TILES_INL_HPP_
