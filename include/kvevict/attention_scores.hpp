// Attention rows reduced to per-slot scores, with the aggregation over query heads stated.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvevict/detail/row_passes.hpp"
#include "kvevict/error.hpp"
#include "kvevict/signals.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {

/// out[s] += weight * (sum over the query heads in [q_head_begin, q_head_end) and over every query
/// row of `rows` of the attention probability on slot s). Summing over rows gives H2O's
/// accumulated column sum; with a single (last) row and weight 1 / heads it is TOVA's mean.
/// Returns false if a row held NaN or an infinity (the scores are then not meaningful). The rows
/// are added in that order, four at a time in one pass over `out` at the CPU's vector width
/// (detail/row_passes.hpp), the check fused into it.
[[nodiscard]] inline bool add_attention(const AttentionRows& rows, int q_head_begin, int q_head_end,
                                        float weight, std::span<float> out) {
  KVEVICT_REQUIRE(0 <= q_head_begin && q_head_begin < q_head_end && q_head_end <= rows.q_heads(),
                  "add_attention: query head range out of bounds");
  // Rows of one KV head's group all have its slot limit; the batch of four shares a length.
  std::array<const float*, 4> batch{};
  std::size_t batched = 0;
  std::size_t length = 0;
  bool finite = true;
  for (int h = q_head_begin; h < q_head_end; ++h) {
    KVEVICT_REQUIRE(static_cast<std::size_t>(rows.keys(h)) <= out.size(),
                    "add_attention: attention row longer than the score column");
    for (int q = 0; q < rows.queries(); ++q) {
      const std::span<const float> row = rows.row(h, q);
      if (batched > 0 && row.size() != length) {  // rows of another length: flush one by one
        for (std::size_t r = 0; r < batched; ++r) {
          finite &= detail::add_scaled(batch[r], length, weight, out.data());
        }
        batched = 0;
      }
      length = row.size();
      batch[batched++] = row.data();
      if (batched == batch.size()) {
        finite &= detail::add_scaled4(batch.data(), length, weight, out.data());
        batched = 0;
      }
    }
  }
  for (std::size_t r = 0; r < batched; ++r) {
    finite &= detail::add_scaled(batch[r], length, weight, out.data());
  }
  return finite;
}

/// Throws unless `rows` can be scores of layer `layer` of `slots`: the layer exists, the rows have
/// the table's KV heads, and each row covers its unit's slots exactly (AttentionRows::keys is the
/// unit's slot limit). `policy` names the caller in messages.
inline void check_attention_rows(const SlotTable& slots, int layer, const AttentionRows& rows,
                                 std::string_view policy) {
  // Per-forward path: plain ifs, so that no message is built unless a check fails.
  const UnitLayout& layout = slots.layout();
  if (layer < 0 || layer >= layout.layers()) {
    throw Error(std::string(policy) + ": attention rows for layer " + std::to_string(layer) +
                " of " + std::to_string(layout.layers()));
  }
  if (rows.kv_heads() != layout.kv_heads()) {
    throw Error(std::string(policy) + ": attention rows cover " + std::to_string(rows.kv_heads()) +
                " KV heads, the cache has " + std::to_string(layout.kv_heads()));
  }
  if (rows.queries() <= 0) throw Error(std::string(policy) + ": attention rows hold no query");
  for (int g = 0; g < layout.kv_heads(); ++g) {
    const int keys = rows.keys(g * rows.group_size());
    const int slot_limit = slots.slot_limit(layout.unit_of(layer, g));
    if (keys != slot_limit) {
      throw Error(std::string(policy) + ": attention rows of layer " + std::to_string(layer) +
                  ", KV head " + std::to_string(g) + " cover " + std::to_string(keys) +
                  " slots, the cache has " + std::to_string(slot_limit) +
                  " (rows are indexed by slot, over [0, slot_limit))");
    }
  }
}

}  // namespace kvevict
