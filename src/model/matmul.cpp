#include "matmul.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/kernels.hpp"
#include "kernels/weight_product.hpp"
#include "kvevict/error.hpp"

namespace kvevict::model {
namespace {

void check_matrix(const WeightMatrix& w) {
  KVEVICT_REQUIRE(w.data != nullptr && w.rows > 0 && w.cols > 0,
                  "matmul: weight matrix is empty or has no data");
}

// Rows of W per task: at least kMinTaskWeights weights (smaller products are not worth a wake-up),
// and about four tasks per thread, so that a thread the machine preempts delays no one for long.
constexpr std::int64_t kMinTaskWeights = 32 * 1024;

int task_count(const WeightMatrix& w, std::int64_t x_rows, const ThreadPool* pool) {
  if (pool == nullptr || pool->threads() == 1) return 1;
  const std::int64_t by_size = w.rows * w.cols * x_rows / kMinTaskWeights;
  return static_cast<int>(std::clamp<std::int64_t>(by_size, 1, 4 * pool->threads()));
}

// Several rows of X: the rows of W go to tasks in whole panels of kernels::weight_product (48 rows
// at AVX-512, 16 at AVX2, 8 at SSE4; 48 is a multiple of each), so that no task multiplies a panel
// padded with zeros (a task of 36 rows of W would pay for 48).
constexpr std::int64_t kPanelRows = 48;

}  // namespace

void matvec(const WeightMatrix& w, const float* x, float* y, const ProductSettings& settings) {
  check_matrix(w);
  const bool quantized = settings.decode_activations == DecodeActivations::q8_0 &&
                         (w.dtype == DType::q8_0 || w.dtype == DType::q4_0);
  // x rounded once, read by every task (through a reference: in a lambda that runs on a pool
  // thread, the name of a thread_local is that thread's own instance).
  thread_local kernels::QuantizedRow caller_row;
  kernels::QuantizedRow& x_quantized = caller_row;
  if (quantized) kernels::quantize_row(x, w.cols, x_quantized);
  const auto product_rows = [&](std::int64_t begin, std::int64_t end) {
    if (quantized) return kernels::matvec_quantized(w, x_quantized, y, begin, end);
    kernels::matvec(w, x, y, begin, end);
  };
  ThreadPool* pool = settings.pool;
  const int tasks = task_count(w, 1, pool);
  if (tasks == 1) return product_rows(0, w.rows);
  pool->run(tasks, [&](int task, int /*thread*/) {
    const Range rows = part_of(w.rows, tasks, task);
    product_rows(rows.begin, rows.end);
  });
}

void matmul(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y,
            const ProductSettings& settings) {
  check_matrix(w);
  KVEVICT_REQUIRE(x.cols() == w.cols && y.cols() == w.rows && x.rows() == y.rows(),
                  "matmul: shapes do not match: X [" + std::to_string(x.rows()) + ", " +
                      std::to_string(x.cols()) + "], W [" + std::to_string(w.rows) + ", " +
                      std::to_string(w.cols) + "], Y [" + std::to_string(y.rows()) + ", " +
                      std::to_string(y.cols()) + "]");
  const std::int64_t n = x.rows();
  if (n == 0) return;
  if (n == 1 && !settings.rows_independent) {
    matvec(w, x.data(), y.data(), settings);  // one row: the fused dequantise-and-dot
    return;
  }
  const std::int64_t panels = (w.rows + kPanelRows - 1) / kPanelRows;
  ThreadPool* pool = settings.pool;
  const int tasks = static_cast<int>(std::min<std::int64_t>(task_count(w, n, pool), panels));
  // X packed once for all tasks (through a reference: in a lambda that runs on a pool thread, the
  // name of a thread_local is that thread's own instance).
  thread_local kernels::PackedRows caller_packed;
  kernels::PackedRows& packed = caller_packed;
  kernels::pack_rows(x.data(), x.outerStride(), n, w.cols, packed);
  // Y = X W^T for the rows [begin, end) of W (columns [begin, end) of Y).
  const auto product_rows = [&](std::int64_t begin, std::int64_t end) {
    kernels::weight_product(w, begin, end, packed, y.data(), y.outerStride());
  };
  if (tasks == 1) return product_rows(0, w.rows);
  pool->run(tasks, [&](int task, int /*thread*/) {
    const Range part = part_of(panels, tasks, task);
    product_rows(part.begin * kPanelRows, std::min(part.end * kPanelRows, w.rows));
  });
}

}  // namespace kvevict::model
