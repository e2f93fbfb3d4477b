// Highway implementation of weight_product.hpp, compiled once per target like kernels.cpp.
//
// An outer-product kernel over W packed into panels (as GEMM libraries do): a panel holds
// kTileVecs vectors of W's rows (48 rows at AVX-512, 16 at AVX2), converted to f32 once per
// product and stored transposed one slice of kDepth values of k at a time, [kDepth][panel width],
// so that for each k one vector load of the panel gives consecutive outputs. A tile of kTileRows
// rows of X times the panel keeps kTileRows x kTileVecs accumulators in registers (AVX-512's 32
// registers: 8 x 3 = 24; 16 registers elsewhere: 6 x 2 = 12) and per k reads kTileVecs vectors of
// W and broadcasts kTileRows values of X, for kTileRows x kTileVecs multiply-adds. The panel's
// slice (24 KiB at AVX-512) stays in L1 while every tile of X passes it; X is packed once per
// product, tile by tile, and the outputs are carried from slice to slice in an L2 buffer. Sizes
// and measurements: docs/kernels.md, "Prefill's products".
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

#include "kvevict/error.hpp"
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

// Values of k per pass over a panel: the panel's slice [kDepth][width] (24 KiB at AVX-512, 8 KiB
// at AVX2) stays in L1 while every tile of X passes it.
constexpr std::int64_t kDepth = 128;

HWY_INLINE std::int64_t panel_width() {
  return kTileVecs * static_cast<std::int64_t>(hn::Lanes(PanelTag()));
}

// out[r][c] = sums[r][c] (accumulate) or 0, + X[r] . W[c] over one slice of k, for the kRows rows
// of a packed tile of X ([depth][kTileRows]: the tile's values at each t side by side) and the
// panel's slice ([depth][width]). sums has `width` floats a row, out `out_stride`; out is sums
// until the last slice. The sums go on from the previous slice's stored as f32, which changes no
// bit: every output is one chain of multiply-adds over t = 0, 1, ... k - 1.
template <int kRows>
HWY_INLINE void panel_tile(const float* x_tile, const float* panel, std::int64_t depth,
                           const float* sums, bool accumulate, float* out,
                           std::ptrdiff_t out_stride) {
  const PanelTag d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t width = kTileVecs * lanes;
  PanelVec acc[kRows][kTileVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kTileVecs; ++v) {
      acc[r][v] = accumulate ? hn::LoadU(d, sums + r * width + v * lanes) : hn::Zero(d);
    }
  }
#pragma GCC unroll 4
  for (std::int64_t t = 0; t < depth; ++t) {
    PanelVec wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = hn::LoadU(d, panel + t * width + v * lanes);
    for (int r = 0; r < kRows; ++r) {
      const PanelVec xv = hn::Set(d, x_tile[t * kTileRows + r]);
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = hn::MulAdd(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kTileVecs; ++v) hn::StoreU(acc[r][v], d, out + r * out_stride + v * lanes);
  }
}

// The last `rows` (< kTileRows) rows of X against a panel's slice.
template <int kRows>
HWY_INLINE void last_rows(int rows, const float* x_tile, const float* panel, std::int64_t depth,
                          const float* sums, bool accumulate, float* out,
                          std::ptrdiff_t out_stride) {
  if constexpr (kRows > 0) {
    if (rows == kRows) {
      return panel_tile<kRows>(x_tile, panel, depth, sums, accumulate, out, out_stride);
    }
    last_rows<kRows - 1>(rows, x_tile, panel, depth, sums, accumulate, out, out_stride);
  }
}

#if HWY_TARGET != HWY_SCALAR
// out[j][i] = in[i][j] for i, j < lanes (row i of `in` at in + i * in_stride, row j of `out` at
// out + j * out_stride): the square transposed in registers, log2(lanes) rounds in which vector i
// takes the even lanes of the pair (2i, 2i + 1) and vector lanes / 2 + i their odd lanes.
HWY_INLINE void transpose_square(const float* in, std::int64_t in_stride, float* out,
                                 std::int64_t out_stride) {
  const PanelTag d;
  constexpr std::size_t kLanes = hn::MaxLanes(PanelTag());
  PanelVec v[kLanes];
  PanelVec w[kLanes];
  for (std::size_t i = 0; i < kLanes; ++i) {
    v[i] = hn::LoadU(d, in + static_cast<std::int64_t>(i) * in_stride);
  }
  for (std::size_t round = 1; round < kLanes; round *= 2) {
    for (std::size_t i = 0; i < kLanes / 2; ++i) {
      w[i] = hn::ConcatEven(d, v[2 * i + 1], v[2 * i]);
      w[kLanes / 2 + i] = hn::ConcatOdd(d, v[2 * i + 1], v[2 * i]);
    }
    for (std::size_t i = 0; i < kLanes; ++i) v[i] = w[i];
  }
  for (std::size_t j = 0; j < kLanes; ++j) {
    hn::StoreU(v[j], d, out + static_cast<std::int64_t>(j) * out_stride);
  }
}
#endif

// X packed for panel_tile: slice after slice of kDepth values of k, in each slice tile after tile
// of kTileRows rows, in each tile [depth][kTileRows]. Slice d0 starts at d0 * padded_m. A tile's
// values for one t are then one small run, and a slice's tiles one run the prefetchers follow,
// where X itself would be kTileRows streams a row apart. Rows past m are left unset (never read).
void pack_x(const float* x, std::ptrdiff_t x_stride, std::int64_t m, std::int64_t k,
            std::int64_t padded_m, float* packed) {
  for (std::int64_t d0 = 0; d0 < k; d0 += kDepth) {
    const std::int64_t depth = std::min(kDepth, k - d0);
    float* slice = packed + d0 * padded_m;
    std::int64_t rows_done = 0;  // rows of X whose values [d0, d0 + vectorised) are packed
    std::int64_t vectorised = 0;
#if HWY_TARGET != HWY_SCALAR
    // Where a vector holds two tiles' rows (AVX-512: 16 lanes, tiles of 8), squares of lanes x
    // lanes values transposed in registers: each transposed row is t's values of two tiles.
    constexpr std::int64_t kLanes = hn::MaxLanes(PanelTag());
    if constexpr (kLanes == 2 * kTileRows) {
      if (static_cast<std::int64_t>(hn::Lanes(PanelTag())) == kLanes) {
        vectorised = depth - depth % kLanes;
        HWY_ALIGN float square[kLanes * kLanes];
        for (; rows_done + kLanes <= m; rows_done += kLanes) {
          float* first_tile = slice + (rows_done / kTileRows) * depth * kTileRows;
          float* second_tile = first_tile + depth * kTileRows;
          for (std::int64_t t0 = 0; t0 < vectorised; t0 += kLanes) {
            transpose_square(x + rows_done * x_stride + d0 + t0, x_stride, square, kLanes);
            for (std::int64_t j = 0; j < kLanes; ++j) {
              std::copy_n(square + j * kLanes, kTileRows, first_tile + (t0 + j) * kTileRows);
              std::copy_n(square + j * kLanes + kTileRows, kTileRows,
                          second_tile + (t0 + j) * kTileRows);
            }
          }
        }
      }
    }
#endif
    for (std::int64_t i = 0; i < m; ++i) {
      const float* row = x + i * x_stride + d0;
      float* out = slice + (i / kTileRows) * depth * kTileRows + i % kTileRows;
      for (std::int64_t t = i < rows_done ? vectorised : 0; t < depth; ++t) {
        out[t * kTileRows] = row[t];
      }
    }
  }
}

// panel[t][c] = rows[c][t] for c < count, 0 for c in [count, width), t in [0, depth); row c of
// `rows` starts at rows + c * row_stride. A full panel goes in squares of lanes x lanes values
// transposed in registers (a scalar copy of each value cost 8 % of a product at k = 2048); the
// values left over one by one, row by row.
void pack_panel(const float* rows, std::int64_t row_stride, std::int64_t count, std::int64_t depth,
                std::int64_t width, float* panel) {
  std::int64_t done = 0;  // values of each row already in the panel
#if HWY_TARGET != HWY_SCALAR
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(PanelTag()));
  if (count == width) {
    done = depth - depth % lanes;
    for (std::int64_t t0 = 0; t0 < done; t0 += lanes) {
      for (std::int64_t c0 = 0; c0 < width; c0 += lanes) {
        transpose_square(rows + c0 * row_stride + t0, row_stride, panel + t0 * width + c0, width);
      }
    }
  }
#endif
  for (std::int64_t c = 0; c < count; ++c) {
    const float* row = rows + c * row_stride;
    for (std::int64_t t = done; t < depth; ++t) panel[t * width + c] = row[t];
  }
  if (count < width) {
    for (std::int64_t t = 0; t < depth; ++t) {
      std::fill(panel + t * width + count, panel + (t + 1) * width, 0.0f);
    }
  }
}

void PackRows(const float* x, std::ptrdiff_t x_stride, std::int64_t m, std::int64_t k,
              PackedRows& out) {
  const std::int64_t padded_m = (m + kTileRows - 1) / kTileRows * kTileRows;
  out.rows = m;
  out.cols = k;
  out.padded_rows = padded_m;
  out.tile_rows = kTileRows;
  out.values.resize(static_cast<std::size_t>(padded_m * k));
  pack_x(x, x_stride, m, k, padded_m, out.values.data());
}

void WeightProduct(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                   const PackedRows& x, float* y, std::ptrdiff_t y_stride) {
  const std::int64_t k = w.cols;
  const std::int64_t m = x.rows;
  const std::int64_t width = panel_width();
  const std::int64_t padded_m = x.padded_rows;
  KVEVICT_REQUIRE(x.tile_rows == kTileRows,
                  "weight_product: the rows were packed for another SIMD target");
  thread_local std::vector<float> converted;  // [width][k]: rows of a non-f32 W as f32
  thread_local std::vector<float> panel;      // [kDepth][width]
  thread_local std::vector<float> sums;       // [padded_m][width]: the panel's outputs so far
  panel.resize(static_cast<std::size_t>(kDepth * width));
  sums.resize(static_cast<std::size_t>(padded_m * width));
  if (w.dtype != DType::f32) converted.resize(static_cast<std::size_t>(k * width));
  for (std::int64_t first = row_begin; first < row_end; first += width) {
    const std::int64_t count = std::min(width, row_end - first);
    const float* rows = reinterpret_cast<const float*>(w.data) + first * k;
    if (w.dtype != DType::f32) {
      dequantize_rows(w, first, first + count, converted.data());
      rows = converted.data();
    }
    for (std::int64_t d0 = 0; d0 < k; d0 += kDepth) {
      const std::int64_t depth = std::min(kDepth, k - d0);
      pack_panel(rows + d0, k, count, depth, width, panel.data());
      const float* slice = x.values.data() + d0 * padded_m;
      const bool accumulate = d0 > 0;
      // The last slice of a full panel stores straight into Y; a partial one goes through sums.
      const bool into_y = d0 + depth == k && count == width;
      float* out = into_y ? y + first : sums.data();
      const std::ptrdiff_t out_stride = into_y ? y_stride : width;
      std::int64_t i = 0;
      for (; i + kTileRows <= m; i += kTileRows) {
        panel_tile<kTileRows>(slice + i * depth, panel.data(), depth, sums.data() + i * width,
                              accumulate, out + i * out_stride, out_stride);
      }
      last_rows<kTileRows - 1>(static_cast<int>(m - i), slice + i * depth, panel.data(), depth,
                               sums.data() + i * width, accumulate, out + i * out_stride,
                               out_stride);
    }
    if (count < width) {
      for (std::int64_t i = 0; i < m; ++i) {
        std::copy_n(sums.data() + i * width, count, y + i * y_stride + first);
      }
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace kvevict::model::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvevict::model::kernels {

HWY_EXPORT(PackRows);
HWY_EXPORT(WeightProduct);

void pack_rows(const float* x, std::ptrdiff_t x_stride, std::int64_t m, std::int64_t k,
               PackedRows& out) {
  HWY_DYNAMIC_DISPATCH(PackRows)(x, x_stride, m, k, out);
}

void weight_product(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                    const PackedRows& x, float* y, std::ptrdiff_t y_stride) {
  KVEVICT_REQUIRE(x.cols == w.cols && x.rows > 0,
                  "weight_product: the packed rows do not have W's columns");
  HWY_DYNAMIC_DISPATCH(WeightProduct)(w, row_begin, row_end, x, y, y_stride);
}

void weight_product(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                    const float* x, std::ptrdiff_t x_stride, std::int64_t m, float* y,
                    std::ptrdiff_t y_stride) {
  thread_local PackedRows packed;
  pack_rows(x, x_stride, m, w.cols, packed);
  weight_product(w, row_begin, row_end, packed, y, y_stride);
}

}  // namespace kvevict::model::kernels
#endif  // HWY_ONCE
