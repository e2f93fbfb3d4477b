// Test support shared by the policy tests: a harness that feeds a policy hand-written attention
// rows through a kvevict::Sequence, and views of a unit's tokens as plain vectors in stream order.
//
// Tests speak in stream order (token 0, 1, 2, ... as they were fed): the rows they hand in list a
// head's live tokens oldest first, and every view comes back oldest first. The harness maps to and
// from the slots the Sequence gave the tokens, so the tests assert behaviour, not slot layout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvevict/engine.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/signals.hpp>
#include <kvevict/slot_table.hpp>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace kvevict::test {

using Positions = std::vector<std::int64_t>;

/// Original positions of the live tokens of `unit`, oldest first.
inline Positions kept_positions(const SlotTable& slots, int unit) {
  Positions out;
  for (const std::int32_t slot : slots.stream_order(unit)) {
    out.push_back(slots.original_positions(unit)[static_cast<std::size_t>(slot)]);
  }
  return out;
}
/// RoPE positions of the live tokens of `unit`, oldest first.
inline Positions rope_positions(const SlotTable& slots, int unit) {
  Positions out;
  for (const std::int32_t slot : slots.stream_order(unit))
    out.push_back(slots.position(unit, slot));
  return out;
}
/// Score column `column` of the live tokens of `unit`, oldest first.
inline std::vector<float> score_column(const SlotTable& slots, int unit, int column) {
  std::vector<float> out;
  for (const std::int32_t slot : slots.stream_order(unit)) {
    out.push_back(slots.scores(unit, column)[static_cast<std::size_t>(slot)]);
  }
  return out;
}

// Attention of one query head in one forward: rows[query][i] is the probability on the head's i-th
// oldest live token during the forward; a row shorter than the cache is zero-padded (causal mask).
using HeadRows = std::vector<std::vector<float>>;
// One forward of one layer: [q_head] -> HeadRows.
using LayerRows = std::vector<HeadRows>;

inline LayerRows every_head(int q_heads, const HeadRows& rows) {
  return LayerRows(static_cast<std::size_t>(q_heads), rows);
}

/// Softmax rows in stream order (rows[h][q][i], i-th oldest live token of KV head h / group),
/// laid out by slot for AttentionRows over `sequence` in `layer`. Keeps the buffers it points to.
class SlotRows {
 public:
  AttentionRows make(const Sequence& sequence, int layer, const LayerRows& rows,
                     std::int64_t first_query_position) {
    const SequenceConfig& config = sequence.config();
    const int group = config.q_heads / config.kv_heads;
    const int queries = static_cast<int>(rows.at(0).size());
    keys_.assign(static_cast<std::size_t>(config.kv_heads), 0);
    int stride = 0;
    for (int g = 0; g < config.kv_heads; ++g) {
      keys_[static_cast<std::size_t>(g)] = sequence.slot_limit(layer, g);
      stride = std::max(stride, keys_[static_cast<std::size_t>(g)]);
    }
    buffer_.assign(static_cast<std::size_t>(config.q_heads * queries * std::max(stride, 1)), 0.0f);
    for (int h = 0; h < config.q_heads; ++h) {
      const int unit = sequence.unit_of(layer, h / group);
      const std::span<const std::int32_t> order = sequence.slots().stream_order(unit);
      for (int q = 0; q < queries; ++q) {
        const std::vector<float>& row =
            rows.at(static_cast<std::size_t>(h)).at(static_cast<std::size_t>(q));
        for (std::size_t i = 0; i < row.size() && i < order.size(); ++i) {
          buffer_[static_cast<std::size_t>((h * queries + q) * stride + order[i])] = row[i];
        }
      }
    }
    return {buffer_.data(), config.q_heads, group, queries, stride, keys_, first_query_position};
  }

 private:
  std::vector<float> buffer_;
  std::vector<int> keys_;
};

// Hands `rows` to the sequence, which takes their data, query count and stride (the rest of their
// shape is its own).
inline void observe_attention(Sequence& sequence, int layer, const AttentionRows& rows) {
  sequence.observe_attention(layer, rows.data(), rows.queries(), rows.row_stride());
}
inline void observe_catalyst(Sequence& sequence, int layer, const AttentionRows& rows) {
  sequence.observe_catalyst(layer, rows.data(), rows.queries(), rows.row_stride());
}

// A policy driven through a Sequence with hand-written attention rows.
class Harness {
 public:
  static constexpr int kCapacity = 32;

  Harness(int layers, int q_heads, int kv_heads, std::unique_ptr<kvevict::Policy> policy,
          std::optional<Granularity> granularity = std::nullopt)
      : sequence_(config(layers, q_heads, kv_heads, granularity), std::move(policy)) {}
  /// With the sequence settings `adjust` makes to the harness's own (a budget, an allocation).
  template <class Adjust>
  Harness(int layers, int q_heads, int kv_heads, std::unique_ptr<kvevict::Policy> policy,
          std::optional<Granularity> granularity, const Adjust& adjust)
      : sequence_(adjusted(config(layers, q_heads, kv_heads, granularity), adjust),
                  std::move(policy)) {}

  // One forward of `tokens` tokens. per_layer[l] holds that layer's rows (one entry: the same rows
  // in every layer). The rows are those of the chunk's last rows().size() queries.
  void feed(int tokens, const std::vector<LayerRows>& per_layer) {
    sequence_.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(tokens), 0));
    const SequenceConfig& c = sequence_.config();
    for (int l = 0; l < c.layers; ++l) {
      const LayerRows& rows =
          per_layer.size() == 1 ? per_layer[0] : per_layer.at(static_cast<std::size_t>(l));
      const auto queries = static_cast<std::int64_t>(rows.at(0).size());
      observe_attention(sequence_, l,
                        rows_.make(sequence_, l, rows, sequence_.stats().tokens_fed - queries));
    }
    sequence_.end_forward();
  }
  // The same rows for every query head of every layer.
  void feed(int tokens, const HeadRows& rows) {
    feed(tokens, {every_head(sequence_.config().q_heads, rows)});
  }

  [[nodiscard]] Positions kept(int l = 0, int g = 0) const {
    return kept_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] Positions positions(int l = 0, int g = 0) const {
    return rope_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] std::vector<float> scores(int l = 0, int g = 0) const {
    return score_column(sequence_.slots(), sequence_.unit_of(l, g), 0);
  }
  [[nodiscard]] const SequenceStats& stats() const { return sequence_.stats(); }
  [[nodiscard]] const Sequence& sequence() const { return sequence_; }
  [[nodiscard]] Sequence& sequence() { return sequence_; }

 private:
  template <class Adjust>
  static SequenceConfig adjusted(SequenceConfig c, const Adjust& adjust) {
    adjust(c);
    return c;
  }
  static SequenceConfig config(int layers, int q_heads, int kv_heads,
                               std::optional<Granularity> granularity) {
    SequenceConfig c;
    c.layers = layers;
    c.q_heads = q_heads;
    c.kv_heads = kv_heads;
    c.granularity = granularity;
    c.max_chunk = kCapacity;
    c.initial_capacity = kCapacity;
    return c;
  }

  Sequence sequence_;
  SlotRows rows_;
};

}  // namespace kvevict::test
