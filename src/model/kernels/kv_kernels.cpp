// Highway implementation of kv_kernels.hpp, compiled once per target like kernels.cpp (see there
// for why vectors are capped at 16 floats: a lane count then divides a Q8_0 block of 32).
//
// A row reader per stored type reads a vector of f32 values at column j of a stored row; the
// products are tiles-inl.hpp's, the ones kernels.cpp runs over f32 rows.
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
#include "model/kernels/tiles-inl.hpp"

HWY_BEFORE_NAMESPACE();
namespace kvevict::model::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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

void StoredScoresByRun(const QueryRun* runs, std::size_t run_count, std::ptrdiff_t x_stride,
                       std::int64_t m, KvType type, const std::uint8_t* keys, std::size_t row_bytes,
                       std::int64_t n, std::int64_t k, float* y, std::ptrdiff_t y_stride) {
  const auto by_run = [&](auto row) {
    scores_by_run<decltype(row)>(runs, run_count, x_stride, m, keys, row_bytes, n, k, y, y_stride);
  };
  switch (type) {
    case KvType::f32:
      return by_run(F32Row());
    case KvType::f16:
      return by_run(F16Row());
    case KvType::bf16:
      return by_run(BF16Row());
    case KvType::q8_0:
      return by_run(Q8_0Row());
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
HWY_EXPORT(StoredScoresByRun);
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

void stored_scores_by_run(std::span<const QueryRun> runs, std::ptrdiff_t x_stride, std::int64_t m,
                          const StoredRows& keys, std::int64_t first, std::int64_t n,
                          std::int64_t k, float* y, std::ptrdiff_t y_stride) {
  HWY_DYNAMIC_DISPATCH(StoredScoresByRun)
  (runs.data(), runs.size(), x_stride, m, keys.type, keys.row(first), keys.row_bytes, n, k, y,
   y_stride);
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
