#include "matmul.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernels.hpp"
#include "kvevict/error.hpp"

namespace kvevict::model {
namespace {

// Rows of a non-f32 W converted per block: about 64 KiB of f32, so the block stays in L2 while
// every row of X is multiplied with it.
constexpr std::int64_t kBlockFloats = 16 * 1024;

void check_matrix(const WeightMatrix& w) {
  KVEVICT_REQUIRE(w.data != nullptr && w.rows > 0 && w.cols > 0,
                  "matmul: weight matrix is empty or has no data");
}

}  // namespace

void matvec(const WeightMatrix& w, const float* x, float* y) {
  check_matrix(w);
  kernels::matvec(w, x, y, 0, w.rows);
}

void matmul(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) {
  check_matrix(w);
  KVEVICT_REQUIRE(x.cols() == w.cols && y.cols() == w.rows && x.rows() == y.rows(),
                  "matmul: shapes do not match: X [" + std::to_string(x.rows()) + ", " +
                      std::to_string(x.cols()) + "], W [" + std::to_string(w.rows) + ", " +
                      std::to_string(w.cols) + "], Y [" + std::to_string(y.rows()) + ", " +
                      std::to_string(y.cols()) + "]");
  const std::int64_t n = x.rows();
  if (n == 0) return;
  if (n == 1) {
    matvec(w, x.data(), y.data());  // one row: the fused dequantise-and-dot
    return;
  }
  if (w.dtype == DType::f32) {
    kernels::matmul_transposed(x.data(), x.outerStride(), n, reinterpret_cast<const float*>(w.data),
                               w.cols, w.rows, w.cols, y.data(), y.outerStride());
    return;
  }
  thread_local std::vector<float> buffer;
  const std::int64_t step = std::max<std::int64_t>(1, kBlockFloats / w.cols);
  buffer.resize(static_cast<std::size_t>(std::min(step, w.rows) * w.cols));
  for (std::int64_t begin = 0; begin < w.rows; begin += step) {
    const std::int64_t end = std::min(begin + step, w.rows);
    kernels::dequantize_rows(w, begin, end, buffer.data());  // [end - begin, cols]
    kernels::matmul_transposed(x.data(), x.outerStride(), n, buffer.data(), w.cols, end - begin,
                               w.cols, y.data() + begin, y.outerStride());  // [n, end - begin]
  }
}

}  // namespace kvevict::model
