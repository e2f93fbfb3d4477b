// Highway implementation of weight_product.hpp, compiled once per target like kernels.cpp.
//
// An outer-product kernel over W packed into panels (as GEMM libraries do): a panel holds
// kTileVecs vectors of W's rows (48 rows at AVX-512, 16 at AVX2), converted to f32 once per
// product and stored transposed, [k][panel width], so that for each k one vector load of the panel
// gives consecutive outputs. A tile of kTileRows rows of X times the panel keeps
// kTileRows x kTileVecs accumulators in registers (AVX-512's 32 registers: 8 x 3 = 24; 16
// registers elsewhere: 6 x 2 = 12) and per k reads kTileVecs vectors of W and broadcasts
// kTileRows values of X, for kTileRows x kTileVecs multiply-adds. Each panel (at most
// 768 x 48 floats, 147 KiB, for the models benchmarked) stays in L2 while every tile of X passes.
//
// Against the dot-product tiles of tiles-inl.hpp (which the attention products keep): no sum
// across lanes at the end of each output, and a multiply-add per value loaded instead of one per
// value and a half.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "model/kernels/weight_product.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target.h must come first.
#include <hwy/highway.h>

#include "model/kernels/kernels.hpp"
#include "model/kernels/weight_product.hpp"

HWY_BEFORE_NAMESPACE();
namespace kvevict::model::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most 16 floats, like kernels.cpp's vectors.
using PanelTag = hn::CappedTag<float, 16>;
using PanelVec = hn::Vec<PanelTag>;

#if HWY_TARGET <= HWY_AVX3
constexpr int kTileRows = 8;
constexpr int kTileVecs = 3;
#else
constexpr int kTileRows = 6;
constexpr int kTileVecs = 2;
#endif
constexpr std::size_t kMaxWidth = kTileVecs * 16;

HWY_INLINE std::int64_t panel_width() {
  return kTileVecs * static_cast<std::int64_t>(hn::Lanes(PanelTag()));
}

// Y[r][c] = X[r] . W[c] for the kRows rows of X at x and the first `columns` rows of W in the
// panel ([k][width], zeros past `columns`).
template <int kRows>
HWY_INLINE void panel_tile(const float* x, std::ptrdiff_t x_stride, const float* panel,
                           std::int64_t k, float* y, std::ptrdiff_t y_stride,
                           std::int64_t columns) {
  const PanelTag d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t width = kTileVecs * lanes;
  PanelVec acc[kRows][kTileVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = hn::Zero(d);
  }
  for (std::int64_t t = 0; t < k; ++t) {
    PanelVec wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = hn::LoadU(d, panel + t * width + v * lanes);
    for (int r = 0; r < kRows; ++r) {
      const PanelVec xv = hn::Set(d, x[r * x_stride + t]);
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = hn::MulAdd(xv, wv[v], acc[r][v]);
    }
  }
  if (columns == width) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kTileVecs; ++v) hn::StoreU(acc[r][v], d, y + r * y_stride + v * lanes);
    }
    return;
  }
  HWY_ALIGN float tile[kMaxWidth];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kTileVecs; ++v) hn::Store(acc[r][v], d, tile + v * lanes);
    std::copy_n(tile, columns, y + r * y_stride);
  }
}

// The last `rows` (< kTileRows) rows of X against a panel.
template <int kRows>
HWY_INLINE void last_rows(int rows, const float* x, std::ptrdiff_t x_stride, const float* panel,
                          std::int64_t k, float* y, std::ptrdiff_t y_stride, std::int64_t columns) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return panel_tile<kRows>(x, x_stride, panel, k, y, y_stride, columns);
    last_rows<kRows - 1>(rows, x, x_stride, panel, k, y, y_stride, columns);
  }
}

// panel[t][c] = rows[c][t] for c < count, 0 for c in [count, width), t in [0, k).
void pack_panel(const float* rows, std::int64_t count, std::int64_t k, std::int64_t width,
                float* panel) {
  for (std::int64_t t = 0; t < k; ++t) {
    float* out = panel + t * width;
    for (std::int64_t c = 0; c < count; ++c) out[c] = rows[c * k + t];
    std::fill(out + count, out + width, 0.0f);
  }
}

void WeightProduct(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                   const float* x, std::ptrdiff_t x_stride, std::int64_t m, float* y,
                   std::ptrdiff_t y_stride) {
  const std::int64_t k = w.cols;
  const std::int64_t width = panel_width();
  thread_local std::vector<float> converted;  // [width][k]: rows of a non-f32 W as f32
  thread_local std::vector<float> panel;      // [k][width]
  panel.resize(static_cast<std::size_t>(k * width));
  if (w.dtype != DType::f32) converted.resize(static_cast<std::size_t>(k * width));
  for (std::int64_t first = row_begin; first < row_end; first += width) {
    const std::int64_t count = std::min(width, row_end - first);
    const float* rows = reinterpret_cast<const float*>(w.data) + first * k;
    if (w.dtype != DType::f32) {
      dequantize_rows(w, first, first + count, converted.data());
      rows = converted.data();
    }
    pack_panel(rows, count, k, width, panel.data());
    std::int64_t i = 0;
    for (; i + kTileRows <= m; i += kTileRows) {
      panel_tile<kTileRows>(x + i * x_stride, x_stride, panel.data(), k, y + i * y_stride + first,
                            y_stride, count);
    }
    last_rows<kTileRows - 1>(static_cast<int>(m - i), x + i * x_stride, x_stride, panel.data(), k,
                             y + i * y_stride + first, y_stride, count);
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvevict::model::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvevict::model::kernels {

HWY_EXPORT(WeightProduct);

void weight_product(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                    const float* x, std::ptrdiff_t x_stride, std::int64_t m, float* y,
                    std::ptrdiff_t y_stride) {
  HWY_DYNAMIC_DISPATCH(WeightProduct)(w, row_begin, row_end, x, x_stride, m, y, y_stride);
}

}  // namespace kvevict::model::kernels
#endif  // HWY_ONCE
