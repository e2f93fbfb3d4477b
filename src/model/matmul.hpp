// Products with model weights: y = W x and Y = X W^T, in f32 for every weight dtype.
//
// W is a WeightMatrix [rows, cols], row-major (rows = output features). f32 weights are read in
// place through Eigen::Map: one row of X (decoding) takes eight rows of W at a time, one from each
// eighth of W, so that eight read streams run at once (a matrix-vector product is bound by memory
// bandwidth); several rows of X go through Eigen's GEMM. f16 / bf16 weights are converted a block
// of rows at a time into a thread-local f32 buffer and multiplied from there. Single thread.
#pragma once

#include <Eigen/Core>
#include <kvevict/model/model.hpp>

namespace kvevict::model {

/// Row-major f32 matrix: the layout of every activation buffer of the decoder.
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// y = W x: `x` has W.cols values, `y` W.rows values (they must not overlap).
void matvec(const WeightMatrix& w, const float* x, float* y);

/// Y = X W^T, X [n, W.cols], Y [n, W.rows] (row i of Y is W times row i of X). n == 1 takes the
/// matvec path, so a single row gives bitwise the same result as matvec().
void matmul(const WeightMatrix& w, const Eigen::Ref<const RowMatrix>& x, Eigen::Ref<RowMatrix> y);

}  // namespace kvevict::model
