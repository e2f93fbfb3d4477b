#include "matmul.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "half.hpp"
#include "kvevict/error.hpp"

namespace kvevict::model {
namespace {

// Rows of f16 / bf16 weights converted per block: about 64 KiB of f32, so the block stays in L2
// while every row of X is multiplied with it.
constexpr std::int64_t kBlockFloats = 16 * 1024;

std::int64_t block_rows(const WeightMatrix& w) {
  return std::max<std::int64_t>(1, kBlockFloats / std::max<std::int64_t>(1, w.cols));
}

// Every f16 value as f32 (256 KiB, stays in L2): a lookup is several times faster than the
// branchy f16_to_float, and gives the same values.
const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> values(65536);
    for (std::uint32_t bits = 0; bits < 65536; ++bits) {
      values[bits] = f16_to_float(static_cast<std::uint16_t>(bits));
    }
    return values;
  }();
  return table.data();
}

// Rows [begin, end) of a f16 / bf16 matrix, as f32, into `out` ([end - begin, cols] row-major).
void convert_rows(const WeightMatrix& w, std::int64_t begin, std::int64_t end, float* out) {
  const std::size_t count = static_cast<std::size_t>((end - begin) * w.cols);
  const std::byte* source = w.data + static_cast<std::size_t>(begin * w.cols) * 2;
  if (w.dtype == DType::f16) {
    const float* table = f16_table();
    for (std::size_t i = 0; i < count; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, source + 2 * i, sizeof bits);
      out[i] = table[bits];
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, source + 2 * i, sizeof bits);
      out[i] = bf16_to_float(bits);
    }
  }
}

std::vector<float>& block_buffer(const WeightMatrix& w) {
  thread_local std::vector<float> buffer;
  const std::size_t needed = static_cast<std::size_t>(block_rows(w) * w.cols);
  if (buffer.size() < needed) buffer.resize(needed);
  return buffer;
}

// y = W x for row-major f32 W [rows, cols]. Eight rows at a time, one from each eighth of W: eight
// independent read streams keep more cache lines in flight than one sequential stream, which
// lifts a single thread from ~8 GB/s (Eigen's GEMV on 288-wide rows) to ~17 GB/s (see
// bench/bench_decoder.cpp). The rows left over go one dot product each.
void rows_times_vector(const float* w, std::int64_t rows, std::int64_t cols, const float* x,
                       float* y) {
  constexpr int kStreams = 8;
  using Rows = Eigen::Map<const Eigen::Matrix<float, kStreams, Eigen::Dynamic, Eigen::RowMajor>, 0,
                          Eigen::OuterStride<>>;
  using Out = Eigen::Map<Eigen::Matrix<float, kStreams, 1>, 0, Eigen::InnerStride<>>;
  const Eigen::Map<const Eigen::VectorXf> in(x, cols);  // [cols]
  const std::int64_t part = rows / kStreams;
  for (std::int64_t r = 0; r < part; ++r) {
    const Rows block(w + r * cols, kStreams, cols, Eigen::OuterStride<>(part * cols));  // [8, cols]
    Out out(y + r, kStreams, 1, Eigen::InnerStride<>(part));                            // [8]
    out.noalias() = block * in;
  }
  for (std::int64_t r = part * kStreams; r < rows; ++r) {
    y[r] = Eigen::Map<const Eigen::VectorXf>(w + r * cols, cols).dot(in);
  }
}

void check_matrix(const WeightMatrix& w) {
  KVEVICT_REQUIRE(w.data != nullptr && w.rows > 0 && w.cols > 0,
                  "matmul: weight matrix is empty or has no data");
}

}  // namespace

void matvec(const WeightMatrix& w, const float* x, float* y) {
  check_matrix(w);
  if (w.dtype == DType::f32) {
    rows_times_vector(reinterpret_cast<const float*>(w.data), w.rows, w.cols, x, y);
    return;
  }
  std::vector<float>& buffer = block_buffer(w);
  const std::int64_t step = block_rows(w);
  for (std::int64_t begin = 0; begin < w.rows; begin += step) {
    const std::int64_t end = std::min(begin + step, w.rows);
    convert_rows(w, begin, end, buffer.data());
    rows_times_vector(buffer.data(), end - begin, w.cols, x, y + begin);  // [b]
  }
}

void matmul(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y) {
  check_matrix(w);
  KVEVICT_REQUIRE(x.cols() == w.cols && y.cols() == w.rows && x.rows() == y.rows(),
                  "matmul: shapes do not match: X [" + std::to_string(x.rows()) + ", " +
                      std::to_string(x.cols()) + "], W [" + std::to_string(w.rows) + ", " +
                      std::to_string(w.cols) + "], Y [" + std::to_string(y.rows()) + ", " +
                      std::to_string(y.cols()) + "]");
  if (x.rows() == 0) return;
  if (x.rows() == 1) {
    // One row: the matvec path (GEMV), rows of X and Y are contiguous.
    matvec(w, x.data(), y.data());
    return;
  }
  if (w.dtype == DType::f32) {
    const Eigen::Map<const RowMatrix> weights(reinterpret_cast<const float*>(w.data), w.rows,
                                              w.cols);  // [rows, cols]
    y.noalias() = x * weights.transpose();              // [n, rows]
    return;
  }
  std::vector<float>& buffer = block_buffer(w);
  const std::int64_t step = block_rows(w);
  for (std::int64_t begin = 0; begin < w.rows; begin += step) {
    const std::int64_t end = std::min(begin + step, w.rows);
    convert_rows(w, begin, end, buffer.data());
    const Eigen::Map<const RowMatrix> block(buffer.data(), end - begin, w.cols);  // [b, cols]
    y.middleCols(begin, end - begin).noalias() = x * block.transpose();           // [n, b]
  }
}

}  // namespace kvevict::model
