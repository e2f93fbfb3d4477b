// Attention products over keys and values as the KvStore holds them (kvevict/kv_type.hpp: f32,
// f16, bf16, Q8_0): each stored row is converted to f32 in registers as it is multiplied, as the
// weight kernels do (kernels.hpp), and never copied out. F32 rows go to kernels.hpp's f32 products
// unchanged. Highway, dispatched at run time like kernels.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/kv_type.hpp>
#include <span>

namespace kvevict::model::kernels {

/// Y[i][s] = X[i] . K[first + s] for i in [0, m), s in [0, n), over k values (k = head_dim): X row
/// i at x + i * x_stride, Y row i at y + i * y_stride (overwritten); K rows as stored.
void stored_scores(const float* x, std::ptrdiff_t x_stride, std::int64_t m, const StoredRows& keys,
                   std::int64_t first, std::int64_t n, std::int64_t k, float* y,
                   std::ptrdiff_t y_stride);

/// A block of query rows and the run of keys it scores (stored_scores_by_run).
struct QueryRun {
  std::int64_t end = 0;      ///< the run is keys [the previous run's end (0 first), end)
  const float* x = nullptr;  ///< its rows: row i at x + i * x_stride
};

/// stored_scores with the rows of X changing along the keys: Y[i][s] = X_r[i] . K[first + s] for
/// s in [0, n), X_r the rows of the run r that holds key s (runs ascending, the last ending at n).
/// The bits of stored_scores over each run alone, in one call: a run of a key or two costs its
/// share of a tile, not a call and a tile of its own.
void stored_scores_by_run(std::span<const QueryRun> runs, std::ptrdiff_t x_stride, std::int64_t m,
                          const StoredRows& keys, std::int64_t first, std::int64_t n,
                          std::int64_t k, float* y, std::ptrdiff_t y_stride);

/// Y[i] += sum over s in [0, n) of P[i][s] V[first + s], for i in [0, m), rows of k values: P row i
/// at p + i * p_stride, Y row i at y + i * y_stride; V rows as stored.
void add_weighted_stored_rows(const float* p, std::ptrdiff_t p_stride, std::int64_t m,
                              const StoredRows& values, std::int64_t first, std::int64_t n,
                              std::int64_t k, float* y, std::ptrdiff_t y_stride);

}  // namespace kvevict::model::kernels
