// Products with model weights: y = W x and Y = X W^T, f32 activations, W in its own type.
//
// W is a WeightMatrix [rows, cols], row-major (rows = output features). One row of X (decoding)
// is a fused dequantise-and-dot per row of W (kernels::matvec; with q8_0 decode activations, x is
// rounded to 8 bits once and Q8_0 / Q4_0 rows are multiplied in integers); several rows convert W a
// panel of rows at a time into f32, transposed, and multiply every row of X with it in
// outer-product tiles (kernels::weight_product), so each weight is converted once per product.
//
// With a pool, the rows of W are split among its threads: every output value is computed exactly
// as on one thread, so the result is bit-identical for any number of threads.
#pragma once

#include <Eigen/Core>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>

#include "thread_pool.hpp"

namespace kvevict::model {

/// Row-major f32 matrix: the layout of every activation buffer of the decoder.
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// How the products run: the pool that splits W's rows (none: the caller's thread), and what a
/// one-row product multiplies Q8_0 / Q4_0 W with (DecoderOptions::decode_activations).
struct ProductSettings {
  ThreadPool* pool = nullptr;
  DecodeActivations decode_activations = DecodeActivations::f32;
  /// matmul multiplies one row with the panel kernel too, so that every row's bits are the same
  /// whatever the number of rows (a DecoderBatch's sequences alone and together).
  bool rows_independent = false;
};

/// y = W x: `x` has W.cols values, `y` W.rows values (they must not overlap).
void matvec(const WeightMatrix& w, const float* x, float* y, const ProductSettings& settings = {});

/// Y = X W^T, X [n, W.cols], Y [n, W.rows] (row i of Y is W times row i of X). n == 1 takes the
/// matvec path unless settings.rows_independent.
void matmul(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y,
            const ProductSettings& settings = {});

}  // namespace kvevict::model
