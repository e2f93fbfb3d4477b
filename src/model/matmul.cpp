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

// Rows of W per task: at least kMinTaskWeights weights (smaller products are not worth a wake-up),
// and about four tasks per thread, so that a thread the machine preempts delays no one for long.
constexpr std::int64_t kMinTaskWeights = 32 * 1024;

int task_count(const WeightMatrix& w, std::int64_t x_rows, const ThreadPool* pool) {
  if (pool == nullptr || pool->threads() == 1) return 1;
  const std::int64_t by_size = w.rows * w.cols * x_rows / kMinTaskWeights;
  return static_cast<int>(std::clamp<std::int64_t>(by_size, 1, 4 * pool->threads()));
}

// y = X W^T for the rows [begin, end) of W (columns [begin, end) of Y).
void product_rows(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x,
                  Eigen::Ref<RowMatrix>& y, std::int64_t begin, std::int64_t end) {
  const std::int64_t n = x.rows();
  if (w.dtype == DType::f32) {
    const auto* rows = reinterpret_cast<const float*>(w.data) + begin * w.cols;
    kernels::matmul_transposed(x.data(), x.outerStride(), n, rows, w.cols, end - begin, w.cols,
                               y.data() + begin, y.outerStride());
    return;
  }
  thread_local std::vector<float> buffer;
  // A multiple of 16 rows: the products take rows of W in blocks of a vector's lane count (at most
  // 16), and a block's left-over rows cost a whole block (kernels::matmul_transposed).
  const std::int64_t step = std::max<std::int64_t>(16, kBlockFloats / w.cols / 16 * 16);
  buffer.resize(static_cast<std::size_t>(std::min(step, end - begin) * w.cols));
  for (std::int64_t block = begin; block < end; block += step) {
    const std::int64_t block_end = std::min(block + step, end);
    kernels::dequantize_rows(w, block, block_end, buffer.data());  // [block_end - block, cols]
    kernels::matmul_transposed(x.data(), x.outerStride(), n, buffer.data(), w.cols,
                               block_end - block, w.cols, y.data() + block,
                               y.outerStride());  // [n, block_end - block]
  }
}

}  // namespace

void matvec(const WeightMatrix& w, const float* x, float* y, ThreadPool* pool) {
  check_matrix(w);
  const int tasks = task_count(w, 1, pool);
  if (tasks == 1) return kernels::matvec(w, x, y, 0, w.rows);
  pool->run(tasks, [&](int task, int /*thread*/) {
    const Range rows = part_of(w.rows, tasks, task);
    kernels::matvec(w, x, y, rows.begin, rows.end);
  });
}

void matmul(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y,
            ThreadPool* pool) {
  check_matrix(w);
  KVEVICT_REQUIRE(x.cols() == w.cols && y.cols() == w.rows && x.rows() == y.rows(),
                  "matmul: shapes do not match: X [" + std::to_string(x.rows()) + ", " +
                      std::to_string(x.cols()) + "], W [" + std::to_string(w.rows) + ", " +
                      std::to_string(w.cols) + "], Y [" + std::to_string(y.rows()) + ", " +
                      std::to_string(y.cols()) + "]");
  const std::int64_t n = x.rows();
  if (n == 0) return;
  if (n == 1) {
    matvec(w, x.data(), y.data(), pool);  // one row: the fused dequantise-and-dot
    return;
  }
  const int tasks = task_count(w, n, pool);
  if (tasks == 1) return product_rows(w, x, y, 0, w.rows);
  pool->run(tasks, [&](int task, int /*thread*/) {
    const Range rows = part_of(w.rows, tasks, task);
    product_rows(w, x, y, rows.begin, rows.end);
  });
}

}  // namespace kvevict::model
