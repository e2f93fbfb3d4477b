// H2O: heavy hitters + recent window (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
// Generative Inference of Large Language Models", NeurIPS 2023, Algorithm 1 "H2 Eviction
// Algorithm"; reference code FMInference/H2O, h2o_hf/utils_real_drop).
//
// Score: per (layer, KV head), the attention each slot has accumulated (score column 0). Every
// forward adds, for every query row of the forward, that row's softmax probability on the slot:
// a prefill adds raw column sums (early tokens see more queries and win), a decode step adds its
// one row, and a new token starts at its own column sum within its chunk. Never normalised, never
// decayed. Keep rule: the last `recent` slots (they include the newest) plus the top `heavy`
// scores among the rest; ties go to the lower position. Trigger: after every forward once a head
// holds more than heavy + recent slots, so the forward itself attended to every cached token and a
// prefill longer than the budget is cut in one shot. Granularity: per KV head (keep-sets differ).
// Positions: original (the authors store keys after RoPE and never re-rotate).
// Paper vs code: the authors' code is MHA-only; for GQA kvevict defines the KV head's score as
// the SUM over the query heads of its group (our definition, not the authors'). The authors
// accumulate in fp16 on GPU; kvevict accumulates in fp32, so decisions can differ only where two
// scores are within fp16 rounding of each other.
#pragma once

#include <cmath>
#include <kvevict/error.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "eager/attention_scores.hpp"
#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct H2oConfig {
  int heavy = 0;   ///< slots kept by accumulated attention, >= 0 (paper default: half the budget)
  int recent = 0;  ///< newest slots always kept, >= 0; heavy + recent > 0 is the cache budget
};

class H2oPolicy final : public Policy {
 public:
  explicit H2oPolicy(const H2oConfig& config) : config_(config) {
    KVEVICT_REQUIRE(config.heavy >= 0, "h2o: heavy must be >= 0, got " +
                                           std::to_string(config.heavy) +
                                           " (a budget smaller than the protected recent window)");
    KVEVICT_REQUIRE(config.recent >= 0,
                    "h2o: recent must be >= 0, got " + std::to_string(config.recent));
    KVEVICT_REQUIRE(
        config.heavy + config.recent > 0,
        "h2o: the budget heavy + recent must be positive, got heavy = 0 and recent = 0");
  }

  [[nodiscard]] std::string_view name() const override { return "h2o"; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::attention_rows}; }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::after_forward}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::original;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    return config_.heavy + config_.recent;
  }
  [[nodiscard]] const H2oConfig& config() const { return config_; }

  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    // Per-forward path: plain ifs, so that no message is built unless a check fails.
    if (layer < 0 || layer >= slots.layers()) {
      throw Error("h2o: attention rows for layer " + std::to_string(layer) + " of " +
                  std::to_string(slots.layers()));
    }
    if (rows.kv_heads() != slots.kv_heads()) {
      throw Error("h2o: attention rows cover " + std::to_string(rows.kv_heads()) +
                  " KV heads, the cache has " + std::to_string(slots.kv_heads()));
    }
    for (int g = 0; g < slots.kv_heads(); ++g) {
      const std::span<float> accumulated = slots.scores(layer, g, kScore);
      add_attention_of_group(rows, g, HeadReduction::sum, accumulated);
      // A NaN would sit in the sum for ever and surface only when the slot leaves the recent
      // window; report it at the forward that produced it instead.
      for (const float score : accumulated) {
        if (std::isnan(score)) {
          throw Error("h2o: attention rows of layer " + std::to_string(layer) + ", KV head " +
                      std::to_string(g) + " contain NaN");
        }
      }
    }
  }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    // With live <= heavy + recent the rule keeps every slot, and the head is left unchanged.
    const SlotTable& slots = context.slots;
    return select_each_head(slots, builder_, plan, [&](KeepSetBuilder& keep, int l, int g) {
      keep.keep_range(keep.slots() - config_.recent, keep.slots());
      keep.keep_top_k(slots.scores(l, g, kScore), config_.heavy);
    });
  }

 private:
  static constexpr int kScore = 0;  // the accumulated-attention column

  H2oConfig config_;
  KeepSetBuilder builder_;
};

}  // namespace kvevict::eager
