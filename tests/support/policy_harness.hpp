// Test support shared by the policy tests: views of a SlotTable as plain vectors, and a harness
// that feeds a policy hand-written attention rows through an EvictionPipeline.
#pragma once

#include <cstdint>
#include <kvevict/pipeline.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/signals.hpp>
#include <kvevict/slot_table.hpp>
#include <memory>
#include <utility>
#include <vector>

namespace kvevict::test {

using Positions = std::vector<std::int64_t>;

/// Original positions kept in head (l, g), in slot order.
inline Positions kept_positions(const SlotTable& slots, int l = 0, int g = 0) {
  const auto original = slots.original_positions(l, g);
  return {original.begin(), original.end()};
}
/// RoPE positions of head (l, g), in slot order.
inline Positions rope_positions(const SlotTable& slots, int l = 0, int g = 0) {
  const auto position = slots.positions(l, g);
  return {position.begin(), position.end()};
}
/// Score column `column` of head (l, g), in slot order.
inline std::vector<float> score_column(const SlotTable& slots, int l, int g, int column) {
  const auto score = slots.scores(l, g, column);
  return {score.begin(), score.end()};
}

// Attention of one query head in one forward: rows[query][slot], in slot order over the head's
// cache as it stands during the forward; a row shorter than the cache is zero-padded (causal mask).
using HeadRows = std::vector<std::vector<float>>;
// One forward of one layer: [q_head] -> HeadRows.
using LayerRows = std::vector<HeadRows>;

LayerRows every_head(int q_heads, const HeadRows& rows) {
  return LayerRows(static_cast<std::size_t>(q_heads), rows);
}

// A policy over a SlotTable (with the policy's score columns), fed through an EvictionPipeline with
// hand-written attention rows (buffer layout [q_head][query][stride] as AttentionRows expects).
class Harness {
 public:
  static constexpr int kCapacity = 32;

  Harness(int layers, int q_heads, int kv_heads, std::unique_ptr<kvevict::Policy> policy)
      : q_heads_(q_heads),
        slots_(layers, kv_heads, kCapacity, policy->score_columns()),
        pipeline_(slots_, std::move(policy)) {}

  // One forward of `tokens` tokens. per_layer[l] holds that layer's rows (one entry: the same rows
  // in every layer). The rows are those of the chunk's last rows().size() queries.
  void feed(int tokens, const std::vector<LayerRows>& per_layer) {
    pipeline_.before_chunk(tokens, false);
    pipeline_.append_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(tokens), 0));
    for (int l = 0; l < slots_.layers(); ++l) {
      const LayerRows& rows = per_layer.size() == 1 ? per_layer[0] : per_layer.at(l);
      const int queries = static_cast<int>(rows.at(0).size());
      std::vector<float> buffer(static_cast<std::size_t>(q_heads_ * queries * kCapacity), 0.0f);
      for (int h = 0; h < q_heads_; ++h) {
        for (int q = 0; q < queries; ++q) {
          const std::vector<float>& row = rows.at(h).at(q);
          for (std::size_t s = 0; s < row.size(); ++s) {
            buffer[static_cast<std::size_t>((h * queries + q) * kCapacity) + s] = row[s];
          }
        }
      }
      std::vector<int> keys;
      for (int g = 0; g < slots_.kv_heads(); ++g) keys.push_back(slots_.live(l, g));
      const kvevict::AttentionRows attention(buffer.data(), q_heads_, q_heads_ / slots_.kv_heads(),
                                             queries, kCapacity, keys,
                                             pipeline_.stats().tokens_fed - queries);
      pipeline_.observe_attention(l, attention);
    }
    pipeline_.end_forward();
  }
  // The same rows for every query head of every layer.
  void feed(int tokens, const HeadRows& rows) { feed(tokens, {every_head(q_heads_, rows)}); }

  [[nodiscard]] Positions kept(int l = 0, int g = 0) const { return kept_positions(slots_, l, g); }
  [[nodiscard]] Positions positions(int l = 0, int g = 0) const {
    return rope_positions(slots_, l, g);
  }
  [[nodiscard]] std::vector<float> scores(int l = 0, int g = 0) const {
    return score_column(slots_, l, g, 0);
  }
  [[nodiscard]] const EvictionPipeline& pipeline() const { return pipeline_; }

 private:
  int q_heads_;
  SlotTable slots_;
  EvictionPipeline pipeline_;
};

}  // namespace kvevict::test
