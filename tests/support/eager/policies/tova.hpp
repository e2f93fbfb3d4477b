// TOVA: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024,
// §3.4; ablations in App. A, Table 2; reference code schwartz-lab-NLP/TOVA src/tova_cache.py).
//
// Score: the CURRENT forward's attention of its last query only, averaged over ALL query heads of
// the layer (score column 0, overwritten every forward, never accumulated). Keep rule: when a head
// holds more than `budget` slots, keep the `budget` best: the first `sinks` slots (the paper's
// TOVA+i ablation, counted inside the budget; default 0) and the top scores among the rest, ties
// to the lower position. Nothing else is protected: no recent window, and the token just fed can
// be dropped at once. Trigger: after every forward, so a steady decode drops the argmin and a
// prefill longer than the budget is cut in one shot from the last prompt token's row.
// Granularity: one keep-set per layer, applied to every KV head (all heads of a layer therefore
// hold the same slots; works for GQA as is). Positions: original (keys stored after RoPE).
// Options: head_wise keeps one set per KV head, scored by the mean over that head's query-head
// group; the paper reports it worse than layer-wise (App. A, Table 2: TOVA-head vs TOVA-layer).
// Paper vs code: kvevict follows the paper and the authors' code. NVIDIA kvpress differs on
// purpose (its TOVA always keeps the last token); kvevict does not copy that.
#pragma once

#include <algorithm>
#include <cmath>
#include <kvevict/error.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct TovaConfig {
  int budget = 0;          ///< slots kept per head, > 0 (the paper's multi-state size)
  int sinks = 0;           ///< first slots always kept, inside the budget, 0 <= sinks < budget
  bool head_wise = false;  ///< one keep-set per KV head instead of per layer (paper: worse)
};

class TovaPolicy final : public Policy {
 public:
  explicit TovaPolicy(const TovaConfig& config) : config_(config) {
    KVEVICT_REQUIRE(config.budget > 0,
                    "tova: budget must be positive, got " + std::to_string(config.budget));
    KVEVICT_REQUIRE(config.sinks >= 0,
                    "tova: sinks must be >= 0, got " + std::to_string(config.sinks));
    KVEVICT_REQUIRE(config.sinks < config.budget,
                    "tova: budget " + std::to_string(config.budget) +
                        " is not larger than the protected set (sinks = " +
                        std::to_string(config.sinks) + "): no slot would be chosen by attention");
  }

  [[nodiscard]] std::string_view name() const override { return "tova"; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::last_attention_row}; }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::after_forward}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::original;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override { return config_.budget; }
  [[nodiscard]] const TovaConfig& config() const { return config_; }

  /// Uses the last query row of `rows` (an engine may pass every row of the forward; only the last
  /// one counts). Must be called for every layer in every forward: the score is not carried over.
  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    // Per-forward path: plain ifs, so that no message is built unless a check fails.
    if (layer < 0 || layer >= slots.layers()) {
      throw Error("tova: attention rows for layer " + std::to_string(layer) + " of " +
                  std::to_string(slots.layers()));
    }
    if (rows.kv_heads() != slots.kv_heads()) {
      throw Error("tova: attention rows cover " + std::to_string(rows.kv_heads()) +
                  " KV heads, the cache has " + std::to_string(slots.kv_heads()));
    }
    if (rows.queries() <= 0) throw Error("tova: attention rows hold no query");
    const int last_query = rows.queries() - 1;
    if (config_.head_wise) {
      const int group = rows.group_size();
      for (int g = 0; g < slots.kv_heads(); ++g) {
        overwrite_with_mean_row(rows, last_query, g * group, (g + 1) * group,
                                slots.scores(layer, g, kScore));
        require_no_nan(slots.scores(layer, g, kScore), layer);
      }
      return;
    }
    require_same_slots_in_layer(slots, layer);
    const std::span<float> layer_score = slots.scores(layer, 0, kScore);
    overwrite_with_mean_row(rows, last_query, 0, rows.q_heads(), layer_score);
    require_no_nan(layer_score, layer);
    // Every KV head carries the layer score, so each head's column reads the same after a step.
    for (int g = 1; g < slots.kv_heads(); ++g) {
      std::copy(layer_score.begin(), layer_score.end(), slots.scores(layer, g, kScore).begin());
    }
  }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    bool changed = false;
    for (int l = 0; l < context.slots.layers(); ++l) {
      if (config_.head_wise) {
        for (int g = 0; g < context.slots.kv_heads(); ++g) {
          changed = select_head(context.slots, l, g, plan) || changed;
        }
      } else {
        require_same_slots_in_layer(context.slots, l);
        if (select_head(context.slots, l, 0, plan)) {
          copy_keep_to_layer(plan, l, 0);
          changed = true;
        }
      }
    }
    return changed;
  }

 private:
  static constexpr int kScore = 0;  // the current step's attention column

  // out = mean over query heads [q_head_begin, q_head_end) of row `query`; slots the rows do not
  // cover score 0.
  static void overwrite_with_mean_row(const AttentionRows& rows, int query, int q_head_begin,
                                      int q_head_end, std::span<float> out) {
    std::fill(out.begin(), out.end(), 0.0f);
    const float weight = 1.0f / static_cast<float>(q_head_end - q_head_begin);
    for (int h = q_head_begin; h < q_head_end; ++h) {
      const std::span<const float> row = rows.row(h, query);
      if (row.size() > out.size()) {
        throw Error("tova: attention row of query head " + std::to_string(h) +
                    " is longer than the cache");
      }
      for (std::size_t s = 0; s < row.size(); ++s) out[s] += weight * row[s];
    }
  }

  static void require_no_nan(std::span<const float> scores, int layer) {
    for (const float score : scores) {
      if (std::isnan(score)) {
        throw Error("tova: attention rows of layer " + std::to_string(layer) + " contain NaN");
      }
    }
  }

  // Layer-wise TOVA applies one keep-list to every KV head, which is only meaningful while they all
  // hold the same slots (they do unless something else compacted a head).
  static void require_same_slots_in_layer(const SlotTable& slots, int layer) {
    for (int g = 1; g < slots.kv_heads(); ++g) {
      if (slots.live(layer, g) != slots.live(layer, 0)) {
        throw Error("tova (layer-wise): the KV heads of layer " + std::to_string(layer) +
                    " hold different slot counts; use head_wise for per-head caches");
      }
    }
  }

  bool select_head(const SlotTable& slots, int layer, int kv_head, CompactionPlan& plan) {
    const int live = slots.live(layer, kv_head);
    if (live <= config_.budget) return false;
    builder_.begin(live);
    builder_.keep_range(0, config_.sinks);
    builder_.keep_top_k(slots.scores(layer, kv_head, kScore), config_.budget - config_.sinks);
    return builder_.write(plan, layer, kv_head);
  }

  TovaConfig config_;
  KeepSetBuilder builder_;
};

}  // namespace kvevict::eager
