// Highway implementation of kv_kernels.hpp, compiled once per target like kernels.cpp (see there
// for why vectors are capped at 16 floats: a lane count then divides a Q8_0 block of 32).
//
// A row format reads a vector of f32 values at column j of a stored row; the products are
// kernels.cpp's f32 tiles (kM rows of X or P, kN rows of K or kV vectors of V) with the stored row
// read through it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "model/kernels/kv_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/highway.h>

#include "model/half.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/kv_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace kvevict::model::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::CappedTag<float, 16>;
using V = hn::Vec<D>;

#if HWY_TARGET <= HWY_AVX3
constexpr int kWideTile = 4;
#else
constexpr int kWideTile = 2;
#endif

HWY_INLINE float sum_lanes(D d, V v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

HWY_INLINE std::uint16_t bits_at(const std::uint8_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

struct F16Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(),
                                      reinterpret_cast<const hwy::float16_t*>(row) + j));
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    return f16_to_float(bits_at(row + 2 * j));
  }
};

struct BF16Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(),
                                      reinterpret_cast<const hwy::bfloat16_t*>(row) + j));
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    return bf16_to_float(bits_at(row + 2 * j));
  }
};

// ggml's block_q8_0 along the row: j's block holds an f16 scale and 32 int8 values. A vector never
// straddles two blocks (its lane count divides 32).
struct Q8_0Row {
  static HWY_INLINE V load(D d, const std::uint8_t* row, std::int64_t j) {
    const std::uint8_t* block =
        row + static_cast<std::size_t>(j / kQ8_0BlockValues) * kQ8_0BlockBytes;
    const auto* q = reinterpret_cast<const std::int8_t*>(block + 2) + j % kQ8_0BlockValues;
    const V values = hn::ConvertTo(d, hn::PromoteTo(hn::Rebind<std::int32_t, D>(),
                                                    hn::LoadU(hn::Rebind<std::int8_t, D>(), q)));
    return hn::Mul(values, hn::Set(d, f16_to_float(bits_at(block))));
  }
  static HWY_INLINE float value(const std::uint8_t* row, std::int64_t j) {
    const std::uint8_t* block =
        row + static_cast<std::size_t>(j / kQ8_0BlockValues) * kQ8_0BlockBytes;
    return static_cast<float>(static_cast<std::int8_t>(block[2 + j % kQ8_0BlockValues])) *
           f16_to_float(bits_at(block));
  }
};

// Y[i][c] = X[i] . K[c] for kM rows of X and kN stored rows of K (kernels.cpp's product_tile).
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

template <class Row>
void scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const std::uint8_t* keys,
            std::size_t row_bytes, std::int64_t n, std::int64_t k, float* y,
            std::ptrdiff_t y_stride) {
  // A decode step's few queries: one stored row at a time, front to back, as MatmulTransposed
  // (interleaved rows are short streams the prefetcher does not follow).
  if (m <= 4) {
    for (std::int64_t c = 0; c < n; ++c) {
      score_columns<Row, 1>(x, x_stride, m, keys + c * row_bytes, row_bytes, k, y + c, y_stride);
    }
    return;
  }
  // Blocks of 64 rows of X (in L2) against every stored row, as MatmulTransposed.
  constexpr std::int64_t kRowBlock = 64;
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

// Y[i] += sum_s P[i][s] V[s] for kM rows and kV vectors of columns from column j (weighted_tile).
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

template <class Row>
void weighted(const float* p, std::ptrdiff_t p_stride, std::int64_t m, const std::uint8_t* values,
              std::size_t row_bytes, std::int64_t n, std::int64_t k, float* y,
              std::ptrdiff_t y_stride) {
  std::int64_t i = 0;
  for (; i + kWideTile <= m; i += kWideTile) {
    weighted_rows<Row, kWideTile>(p + i * p_stride, p_stride, values, row_bytes, n, k,
                                  y + i * y_stride, y_stride);
  }
  for (; i < m; ++i) {
    weighted_rows<Row, 1>(p + i * p_stride, p_stride, values, row_bytes, n, k, y + i * y_stride,
                          y_stride);
  }
}

void StoredScores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, KvType type,
                  const std::uint8_t* keys, std::size_t row_bytes, std::int64_t n, std::int64_t k,
                  float* y, std::ptrdiff_t y_stride) {
  switch (type) {
    case KvType::f16:
      return scores<F16Row>(x, x_stride, m, keys, row_bytes, n, k, y, y_stride);
    case KvType::bf16:
      return scores<BF16Row>(x, x_stride, m, keys, row_bytes, n, k, y, y_stride);
    case KvType::q8_0:
      return scores<Q8_0Row>(x, x_stride, m, keys, row_bytes, n, k, y, y_stride);
    case KvType::f32:
      break;  // kernels.hpp's f32 product (the caller)
  }
}

void AddWeightedStoredRows(const float* p, std::ptrdiff_t p_stride, std::int64_t m, KvType type,
                           const std::uint8_t* values, std::size_t row_bytes, std::int64_t n,
                           std::int64_t k, float* y, std::ptrdiff_t y_stride) {
  switch (type) {
    case KvType::f16:
      return weighted<F16Row>(p, p_stride, m, values, row_bytes, n, k, y, y_stride);
    case KvType::bf16:
      return weighted<BF16Row>(p, p_stride, m, values, row_bytes, n, k, y, y_stride);
    case KvType::q8_0:
      return weighted<Q8_0Row>(p, p_stride, m, values, row_bytes, n, k, y, y_stride);
    case KvType::f32:
      break;  // kernels.hpp's f32 product (the caller)
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvevict::model::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvevict::model::kernels {

HWY_EXPORT(StoredScores);
HWY_EXPORT(AddWeightedStoredRows);

void stored_scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const StoredRows& keys,
                   std::int64_t first, std::int64_t n, std::int64_t k, float* y,
                   std::ptrdiff_t y_stride) {
  if (keys.type == KvType::f32) {
    return matmul_transposed(x, x_stride, m, reinterpret_cast<const float*>(keys.row(first)), k, n,
                             k, y, y_stride);
  }
  HWY_DYNAMIC_DISPATCH(StoredScores)
  (x, x_stride, m, keys.type, keys.row(first), keys.row_bytes, n, k, y, y_stride);
}

void add_weighted_stored_rows(const float* p, std::ptrdiff_t p_stride, std::int64_t m,
                              const StoredRows& values, std::int64_t first, std::int64_t n,
                              std::int64_t k, float* y, std::ptrdiff_t y_stride) {
  if (values.type == KvType::f32) {
    return add_weighted_rows(p, p_stride, m, reinterpret_cast<const float*>(values.row(first)), k,
                             n, k, y, y_stride);
  }
  HWY_DYNAMIC_DISPATCH(AddWeightedStoredRows)
  (p, p_stride, m, values.type, values.row(first), values.row_bytes, n, k, y, y_stride);
}

}  // namespace kvevict::model::kernels
#endif  // HWY_ONCE
