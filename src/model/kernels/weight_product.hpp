// Y = X W^T for many rows of X (a prefill chunk) with W in its own type: the product of matmul
// (src/model/matmul.hpp) for more than one row of X, compiled per SIMD target like kernels.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/model/model.hpp>
#include <vector>

namespace kvevict::model::kernels {

/// Rows of X laid out for weight_product's tiles (the layout of the SIMD target that packed them).
struct PackedRows {
  std::vector<float> values;
  std::int64_t rows = 0;         ///< m
  std::int64_t cols = 0;         ///< values a row (W.cols)
  std::int64_t padded_rows = 0;  ///< m rounded up to whole tiles
  std::int64_t tile_rows = 0;    ///< the packing target's rows per tile
};

/// Packs the m rows of X (k values each, row i at x + i * x_stride) into `out`, once for every
/// range of W's rows multiplied with them (matmul packs before splitting W between threads).
void pack_rows(const float* x, std::ptrdiff_t x_stride, std::int64_t m, std::int64_t k,
               PackedRows& out);

/// Y[i][r] = X[i] . W[r] for i in [0, x.rows) and the rows r in [row_begin, row_end) of W (any
/// DType; x packed by pack_rows with W.cols values a row, on the same SIMD target). Row i of Y
/// starts at y + i * y_stride; only its columns [row_begin, row_end) are written.
///
/// Every output is one f32 accumulator summed over k = 0, 1, ... W.cols - 1 in turn (a fused
/// multiply-add per term where the target has one), whatever m, the row range and the target's
/// tile: the bits of an output do not depend on how the rows of W are split between threads.
void weight_product(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                    const PackedRows& x, float* y, std::ptrdiff_t y_stride);

/// The same for X in place (row i at x + i * x_stride, m rows): packs it, then multiplies.
void weight_product(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                    const float* x, std::ptrdiff_t x_stride, std::int64_t m, float* y,
                    std::ptrdiff_t y_stride);

}  // namespace kvevict::model::kernels
