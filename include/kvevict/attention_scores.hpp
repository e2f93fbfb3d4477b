// Attention rows reduced to per-slot scores, with the aggregation over query heads stated.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
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

/// to[s] = from[s] + weight * (sum over the query heads in [q_head_begin, q_head_end) and over
/// every query row of `rows` of the attention probability on slot s), in place when `from` is
/// `to`, from zeros when `from` is empty. Summing over rows gives H2O's accumulated column sum;
/// with a single (last) row and weight 1 / heads it is TOVA's mean. Returns false if a row held a
/// value that is not an attention probability (detail::is_probability): `to` is then not
/// meaningful, and `from`, if another column, unchanged. The rows are added in that order, four
/// at a time in one pass over `to` at the CPU's vector width (detail/row_passes.hpp), the check
/// fused into it.
[[nodiscard]] inline bool add_attention(const AttentionRows& rows, int q_head_begin, int q_head_end,
                                        float weight, std::span<const float> from,
                                        std::span<float> to) {
  KVEVICT_REQUIRE(0 <= q_head_begin && q_head_begin < q_head_end && q_head_end <= rows.q_heads(),
                  "add_attention: query head range out of bounds");
  const bool in_place = from.data() == to.data();
  // Rows of one KV head's group all have its slot limit; the batch of four shares a length.
  std::array<const float*, 4> batch{};
  int batched = 0;
  std::size_t length = 0;
  const float* start = from.empty() ? nullptr : from.data();  // the first pass's, then in place
  bool probabilities = true;
  const auto flush = [&] {
    probabilities &= detail::add_rows(batch.data(), batched, length, weight, start, to.data());
    start = to.data();
    batched = 0;
  };
  for (int h = q_head_begin; h < q_head_end; ++h) {
    // Written anew (not in place), the sums must cover `to` whole; in place, a prefix of it.
    KVEVICT_REQUIRE(in_place ? static_cast<std::size_t>(rows.keys(h)) <= to.size()
                             : static_cast<std::size_t>(rows.keys(h)) == to.size() &&
                                   (from.empty() || from.size() >= to.size()),
                    "add_attention: attention row and score column lengths differ");
    for (int q = 0; q < rows.queries(); ++q) {
      const std::span<const float> row = rows.row(h, q);
      if (batched > 0 && row.size() != length) flush();  // a row of another length
      length = row.size();
      batch[static_cast<std::size_t>(batched++)] = row.data();
      if (batched == static_cast<int>(batch.size())) flush();
    }
  }
  if (batched > 0) flush();
  return probabilities;
}

/// add_attention in place: out[s] += weight * (...).
[[nodiscard]] inline bool add_attention(const AttentionRows& rows, int q_head_begin, int q_head_end,
                                        float weight, std::span<float> out) {
  return add_attention(rows, q_head_begin, q_head_end, weight, out, out);
}

namespace detail {
/// `value` as a message shows it: "NaN", else the shortest text that reads back as it.
inline std::string describe_value(float value) {
  if (std::isnan(value)) return "NaN";
  char text[32];
  const std::to_chars_result end = std::to_chars(text, text + sizeof text, value);
  return {text, end.ptr};
}
}  // namespace detail

/// Throws unless every value of the rows a policy reads (every query of `rows`, or the last one
/// when `last_query_only`) is an attention probability (detail::is_probability): NaN, infinities,
/// negatives and values above 1 are not. The message names `call`, the layer, query head, query,
/// slot and value of the first one found, and says that nothing was recorded.
inline void check_probabilities(const AttentionRows& rows, int layer, std::string_view call,
                                bool last_query_only) {
  const int first_query = last_query_only ? rows.queries() - 1 : 0;
  for (int h = 0; h < rows.q_heads(); ++h) {
    for (int q = first_query; q < rows.queries(); ++q) {
      const std::span<const float> row = rows.row(h, q);
      // One vectorised pass (row_passes.hpp); find_if only names the culprit.
      if (detail::all_probabilities(row.data(), row.size())) continue;
      const auto bad =
          std::find_if(row.begin(), row.end(), [](float p) { return !detail::is_probability(p); });
      throw Error(std::string(call) + ": layer " + std::to_string(layer) + ", query head " +
                  std::to_string(rows.first_kv_head() * rows.group_size() + h) + ", query " +
                  std::to_string(q) + " (original position " +
                  std::to_string(rows.first_query_position() + q) + "), slot " +
                  std::to_string(bad - row.begin()) + ": " + detail::describe_value(*bad) +
                  " is not an attention probability in [0, 1]; nothing was recorded");
    }
  }
}

/// Throws unless `rows` can be scores of layer `layer` of `slots`: the layer exists, the rows have
/// the table's KV heads (all of them, or a range of them when `some_kv_heads`), and each row
/// covers its unit's slots exactly (AttentionRows::keys is the unit's slot limit). `policy` names
/// the caller in messages.
inline void check_attention_rows(const SlotTable& slots, int layer, const AttentionRows& rows,
                                 std::string_view policy, bool some_kv_heads = false) {
  // Per-forward path: plain ifs, so that no message is built unless a check fails.
  const UnitLayout& layout = slots.layout();
  if (layer < 0 || layer >= layout.layers()) {
    throw Error(std::string(policy) + ": attention rows for layer " + std::to_string(layer) +
                " of " + std::to_string(layout.layers()));
  }
  const int first = rows.first_kv_head();
  if (some_kv_heads ? first + rows.kv_heads() > layout.kv_heads()
                    : first != 0 || rows.kv_heads() != layout.kv_heads()) {
    throw Error(std::string(policy) + ": attention rows cover KV heads [" + std::to_string(first) +
                ", " + std::to_string(first + rows.kv_heads()) + "), the cache has " +
                std::to_string(layout.kv_heads()) +
                (some_kv_heads ? "" : " (this policy reads every KV head of a layer at once)"));
  }
  if (rows.queries() <= 0) throw Error(std::string(policy) + ": attention rows hold no query");
  for (int g = 0; g < rows.kv_heads(); ++g) {
    const int keys = rows.keys(g * rows.group_size());
    const int slot_limit = slots.slot_limit(layout.unit_of(layer, first + g));
    if (keys != slot_limit) {
      throw Error(std::string(policy) + ": attention rows of layer " + std::to_string(layer) +
                  ", KV head " + std::to_string(first + g) + " cover " + std::to_string(keys) +
                  " slots, the cache has " + std::to_string(slot_limit) +
                  " (rows are indexed by slot, over [0, slot_limit))");
    }
  }
}

/// A score-based policy's observe_attention: for each KV head g of the rows (of layer `layer`),
/// adds `weight` x the rows of g's query heads (every query, or the last one when
/// `last_query_only`) to score column `column` of g's unit, or to zeros for a unit whose `restart`
/// flag is set (then cleared). A refused call changes no score: each unit's new sums are built in
/// its spare column and swapped in only once every row the call read was an attention
/// probability; else the message of check_probabilities (as Sequence would have refused the
/// rows: Policy::checks_probabilities). One pass over the rows, not a check and then a sum.
///
/// KV heads handed over in separate calls (AttentionRows::first_kv_head) give the same sums, bit
/// for bit, as one call: each KV head's rows are added in their own passes either way, and a unit
/// shared by the layer's KV heads adds the next head's rows to what the previous ones left.
inline void add_attention_checked(SlotTable& slots, int layer, const AttentionRows& rows,
                                  float weight, int column, bool last_query_only,
                                  std::span<std::uint8_t> restart = {}) {
  const UnitLayout& layout = slots.layout();
  const AttentionRows read = last_query_only ? rows.last_query() : rows;
  const int group = rows.group_size();
  const int first = rows.first_kv_head();
  // The KV heads of a layer share a unit (layer, token, block granularity) or each have their own.
  const bool shared = layout.kv_heads() > 1 && layout.unit_of(layer, 0) == layout.unit_of(layer, 1);
  for (int g = 0; g < rows.kv_heads(); ++g) {
    const int unit = layout.unit_of(layer, first + g);
    const std::span<float> spare = slots.spare_scores(unit);
    std::span<const float> from = slots.scores(unit, column);
    if (shared && g > 0) {
      from = spare;  // the unit's sums so far in this call
    } else if (!restart.empty() && restart[static_cast<std::size_t>(unit)] != 0) {
      from = {};
    }
    if (!add_attention(read, g * group, (g + 1) * group, weight, from, spare)) {
      check_probabilities(rows, layer, "observe_attention", last_query_only);
      throw Error("observe_attention: attention rows of layer " + std::to_string(layer) +
                  " are not probabilities; nothing was recorded");  // not reached
    }
  }
  for (int g = 0; g < (shared ? 1 : rows.kv_heads()); ++g) {
    const int unit = layout.unit_of(layer, first + g);
    slots.swap_spare_scores(unit, column);
    if (!restart.empty()) restart[static_cast<std::size_t>(unit)] = 0;
  }
}

}  // namespace kvevict
