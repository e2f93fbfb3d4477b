// The reference decoder's hot loops, written once with Google Highway (kernels.cpp) and compiled
// for every SIMD target Highway knows on the build's architecture (x86: SSSE3, SSE4, AVX2,
// AVX-512; Arm: NEON), the best one the CPU has chosen at the first call. One portable binary: no
// -march flag. Why Highway and not GCC's target_clones: docs/kernels.md.
//
// Weights are read in their own type (model.hpp's DType): a product dequantises each weight as it
// is multiplied, in registers, and never holds an f32 copy of a Q8_0 / Q4_0 / f16 / bf16 matrix
// (matmul's rows are converted a panel of rows at a time into a small buffer: weight_product.hpp).
// All arithmetic is f32 with f32 accumulators; results differ from a naive loop only by the
// order of the additions (and by Highway's exp, within 1 ulp, in softmax and SiLU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/model/model.hpp>
#include <string>
#include <vector>

namespace kvevict::model::kernels {

/// y[r] = W[r] . x for the rows [row_begin, row_end) of W (any DType; x has W.cols values).
void matvec(const WeightMatrix& w, const float* x, float* y, std::int64_t row_begin,
            std::int64_t row_end);

/// A row of activations rounded to 8 bits per value in blocks of 32, as llama.cpp rounds them for
/// its Q8_0 / Q4_0 products: value j of block b is round(x[j] / scales[b]), scales[b] = max |x|
/// over the block / 127, so values lie in [-127, 127]. A block holding NaN or an infinity gets a
/// NaN scale (and zero values), so that the products give NaN rather than a number.
struct QuantizedRow {
  std::vector<std::int8_t> values;
  std::vector<float> scales;
  /// 8 * scales[b] * (sum of block b's values): a Q4_0 weight is its nibble minus 8, so a Q4_0
  /// product multiplies the nibbles as they are and subtracts this times the weights' scale.
  std::vector<float> nibble_offsets;
};

/// Rounds n values (a multiple of 32) of x into `out` (resized).
void quantize_row(const float* x, std::int64_t n, QuantizedRow& out);

/// y[r] = W[r] . x for the rows [row_begin, row_end) of a Q8_0 or Q4_0 W and x quantized by
/// quantize_row. Each block's 32 products are summed exactly in integers (AVX2 and AVX-512:
/// maddubs, as llama.cpp's kernels; other targets: a plain loop), then, in block order,
/// total = fma(weight scale * x scale, sum, total) and for Q4_0 offset = fma(weight scale,
/// nibble offset, offset); y[r] = total - offset. Every target and any split of the rows give the
/// same bits.
void matvec_quantized(const WeightMatrix& w, const QuantizedRow& x, float* y,
                      std::int64_t row_begin, std::int64_t row_end);

/// Rows [row_begin, row_end) of W as f32 into `out` ([row_end - row_begin, W.cols] row-major).
void dequantize_rows(const WeightMatrix& w, std::int64_t row_begin, std::int64_t row_end,
                     float* out);

/// Y = X W^T for f32 operands: Y[i][r] = X[i] . W[r] for i in [0, m), r in [0, n), over k values.
/// Row i of X starts at x + i * x_stride, row r of W at w + r * w_stride, row i of Y at
/// y + i * y_stride (overwritten).
void matmul_transposed(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const float* w,
                       std::ptrdiff_t w_stride, std::int64_t n, std::int64_t k, float* y,
                       std::ptrdiff_t y_stride);

/// Y += P V: Y[i] += sum over s in [0, n) of P[i][s] V[s], for i in [0, m), rows of k values.
/// Row i of P starts at p + i * p_stride, row s of V at v + s * v_stride, row i of Y at
/// y + i * y_stride.
void add_weighted_rows(const float* p, std::ptrdiff_t p_stride, std::int64_t m, const float* v,
                       std::ptrdiff_t v_stride, std::int64_t n, std::int64_t k, float* y,
                       std::ptrdiff_t y_stride);

/// out = x / sqrt(mean(x^2) + eps) * weight over n values (llama2.c's rmsnorm). out may be x.
void rmsnorm(const float* x, const float* weight, std::int64_t n, float eps, float* out);

/// gate = silu(gate) * up = gate / (1 + exp(-gate)) * up over n values.
void swiglu(float* gate, const float* up, std::int64_t n);

/// x += y over n values.
void add(float* x, const float* y, std::int64_t n);

/// The largest of n > 0 values (-inf ones included).
[[nodiscard]] float max(const float* x, std::int64_t n);

/// x = exp((x - shift) * scale) over n values, in place; returns nothing: -inf inputs give values
/// that callers overwrite (softmax zeroes its masked and free slots explicitly).
void exp_shifted(float* x, std::int64_t n, float shift, float scale);

/// The sum of n values.
[[nodiscard]] float sum(const float* x, std::int64_t n);

/// x *= factor over n values.
void scale(float* x, std::int64_t n, float factor);

/// Rotates `rows` rows of `row_stride` floats by one rotation: pairs (x[i], x[i + half]) for
/// half_split, (x[2i], x[2i + 1]) for interleaved, i in [0, pairs), by the angles whose cos and sin
/// are cos_sin[i] and cos_sin[pairs + i] (kvevict::Rope::angles).
void rotate(float* data, std::ptrdiff_t row_stride, std::int64_t rows, const double* cos_sin,
            int pairs, bool interleaved);

// --- Dispatch -----------------------------------------------------------------------------------

/// Highway's bits of the targets compiled into this binary that this CPU supports, best first.
[[nodiscard]] std::vector<std::int64_t> available_targets();
/// "AVX3", "AVX2", "SSE4", "EMU128", ...
[[nodiscard]] std::string target_name(std::int64_t target);
/// The target the next kernel call runs on.
[[nodiscard]] std::string active_target();
/// Makes every kernel run on `target` (one of available_targets()), for tests and benchmarks
/// comparing targets; 0 restores the best one. Not thread-safe: call it between forwards.
void force_target(std::int64_t target);

}  // namespace kvevict::model::kernels
