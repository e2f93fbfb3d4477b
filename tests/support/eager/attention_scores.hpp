// Reductions of attention rows to per-slot scores, with the GQA aggregation stated explicitly.
#pragma once

#include <cstddef>
#include <kvevict/error.hpp>
#include <span>

#include "eager/signals.hpp"

namespace kvevict::eager {

/// How the query heads that read one KV head are combined into that KV head's score.
enum class HeadReduction { sum, mean };

/// out[s] += reduce over the query heads in [q_head_begin, q_head_end), and sum over every query
/// row of `rows`, of the attention probability on slot s. Summing over rows gives H2O's accumulated
/// column sum; with a single (last) row it is TOVA's score.
inline void add_attention(const AttentionRows& rows, int q_head_begin, int q_head_end,
                          HeadReduction reduction, std::span<float> out) {
  KVEVICT_REQUIRE(0 <= q_head_begin && q_head_begin < q_head_end && q_head_end <= rows.q_heads(),
                  "add_attention: query head range out of bounds");
  const float weight = reduction == HeadReduction::mean
                           ? 1.0f / static_cast<float>(q_head_end - q_head_begin)
                           : 1.0f;
  for (int h = q_head_begin; h < q_head_end; ++h) {
    KVEVICT_REQUIRE(static_cast<std::size_t>(rows.keys(h)) <= out.size(),
                    "add_attention: attention row longer than the score column");
    for (int q = 0; q < rows.queries(); ++q) {
      const std::span<const float> row = rows.row(h, q);
      for (std::size_t s = 0; s < row.size(); ++s) out[s] += weight * row[s];
    }
  }
}

/// The query heads that read KV head `kv_head`: [kv_head * group, (kv_head + 1) * group).
inline void add_attention_of_group(const AttentionRows& rows, int kv_head, HeadReduction reduction,
                                   std::span<float> out) {
  const int group = rows.group_size();
  add_attention(rows, kv_head * group, (kv_head + 1) * group, reduction, out);
}

}  // namespace kvevict::eager
