// Y = X W^T for many rows of X (a prefill chunk) with W in its own type: the product of matmul
// (src/model/matmul.hpp) for more than one row of X, compiled per SIMD target like kernels.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/model/model.hpp>

namespace kvevict::model::kernels {

/// Y[i][r] = X[i] . W[r] for i in [0, m) and the rows r in [row_begin, row_end) of W (any DType;
/// rows of X have W.cols values). Row i of X starts at x + i * x_stride, row i of Y at
/// y + i * y_stride; only its columns [row_begin, row_end) are written.
///
/// Every output is one f32 accumulator summed over k = 0, 1, ... W.cols - 1 in turn (a fused
/// multiply-add per term where the target has one), whatever m, the row range and the target's
/// tile: the bits of an output do not depend on how the rows of W are split between threads.
void weight_product(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                    const float* x, std::ptrdiff_t x_stride, std::int64_t m, float* y,
                    std::ptrdiff_t y_stride);

}  // namespace kvevict::model::kernels
