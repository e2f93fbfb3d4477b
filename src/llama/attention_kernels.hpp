// The kernels of the attention rows kvevict computes itself when llama.cpp runs flash attention
// (llama_sequence.cpp, GraphTap::observe_flash): the products of a KV head's queries with its K
// cells, each cell read once for every query row and converted to f32 in registers, and the
// softmax of each row. Google Highway, dispatched at run time to the best target the CPU supports
// (as src/model/kernels, whose tiles these follow, but over cells gathered by index: a sequence's
// cells need not be contiguous in llama.cpp's cache).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvevict::llama::kernels {

/// The cell types read in registers: ggml's f32, f16, bf16 and Q8_0 (block_q8_0: an f16 scale and
/// 32 int8 values) rows.
enum class CellType : std::uint8_t { f32, f16, bf16, q8_0 };

/// K rows of one KV head: row c at base + c * row_bytes.
struct CellRows {
  CellType type = CellType::f32;
  const std::uint8_t* base = nullptr;
  std::size_t row_bytes = 0;
};

/// Y[r][s] = X[r] . K[cells[s]] for r in [0, m), s in [0, n), rows of k values: X row r at
/// x + r * x_stride (f32), Y row r at y + r * y_stride (overwritten). Each K row is read once for
/// all m rows of X. Q8_0 needs k to be a multiple of 32.
void gathered_scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const CellRows& keys,
                     const std::int32_t* cells, std::int64_t n, std::int64_t k, float* y,
                     std::ptrdiff_t y_stride);

/// In place over row[0, n): row[s] = exp(t[s] - max) / sum with t[s] = scale * row[s] + bias[s],
/// max and sum over s; exactly 0 where bias[s] is -inf. At least one bias must be finite. The sum
/// is formed in f32 over a few vectors at a time and accumulated in double, as ggml's CPU soft_max.
void softmax_row(float* row, const float* bias, float scale, std::int64_t n);

/// out[j] = in[j] rounded to f16 (to nearest, ties to even: ggml's fp32 -> fp16 conversion) and
/// widened back to f32, j in [0, n). in and out may be the same.
void round_through_f16(const float* in, float* out, std::int64_t n);

}  // namespace kvevict::llama::kernels
