// H2O: heavy hitters + recent window (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
// Generative Inference of Large Language Models", NeurIPS 2023, Algorithm 1 "H2 Eviction
// Algorithm"; reference code FMInference/H2O, h2o_hf/utils_real_drop).
//
// Score: per unit (per KV head by default), the attention each slot has accumulated (score column
// 0). Every forward adds, for every query row of the forward, that row's softmax probability on
// the slot: a prefill adds raw column sums (early tokens see more queries and win), a decode step
// adds its one row, and a new token starts at its own column sum within its chunk. Never
// normalised, never decayed. Keep rule: the newest `recent` tokens (they include the newest) plus
// the top `heavy` scores among the rest; ties go to the lower position: HeavyHitterPolicy(heavy)
// inside a ProtectNewest(recent). Trigger: after every forward once a unit holds more than
// heavy + recent, so the forward itself attended to every cached token and a prefill longer than
// the budget is cut in one shot. Positions: original (the authors store keys after RoPE and never
// re-rotate).
// Granularity: per KV head (keep-sets differ). Coarser units sum the same rows over every query
// head that reads the unit: over the layer's query heads per layer, and over every layer's per
// token (kvevict's definition; the paper scores per head).
// Paper vs code: the authors' code is MHA-only; for GQA kvevict defines the KV head's score as
// the SUM over the query heads of its group (our definition, not the authors'). The authors
// accumulate in fp16 on GPU; kvevict accumulates in fp32, so decisions can differ only where two
// scores are within fp16 rounding of each other.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvevict/attention_scores.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

/// H2O's score and keep rule without its recent window: the top `heavy` unprotected tokens by
/// accumulated attention.
class HeavyHitterPolicy final : public Policy {
 public:
  explicit HeavyHitterPolicy(int heavy) : heavy_(heavy) {
    KVEVICT_REQUIRE(heavy >= 0, "h2o: heavy must be >= 0, got " + std::to_string(heavy) +
                                    " (a budget smaller than the protected recent window)");
  }

  [[nodiscard]] std::string_view name() const override { return "h2o"; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::attention_rows}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] std::optional<int> retained_limit() const override { return heavy_; }
  [[nodiscard]] bool supports_blocks() const override { return true; }
  [[nodiscard]] bool supports_pressure() const override { return true; }
  [[nodiscard]] bool checks_probabilities() const override { return true; }
  [[nodiscard]] bool attention_per_kv_head() const override { return true; }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    return ScoreRule{kScore, heavy_, {}};
  }

  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    check_attention_rows(slots, layer, rows, "h2o", /*some_kv_heads=*/true);
    // Every row, every query; a value outside [0, 1] would sit in the sum for ever: refused before
    // any score changes.
    add_attention_checked(slots, layer, rows, 1.0f, kScore, /*last_query_only=*/false);
  }

  void select(const EvictionContext& context, Decision& decision) override {
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      (void)worst_.evict(context.slots, unit, context.protection, context.keep(unit, heavy_),
                         context.slots.scores(unit, kScore), decision, context.max_live);
    }
  }

 private:
  static constexpr int kScore = 0;  // the accumulated-attention column

  int heavy_;
  WorstCandidates worst_{ScoreTrend::never_falls};  // probabilities only ever add
};

struct H2oConfig {
  int heavy = 0;   ///< tokens kept by accumulated attention, >= 0 (paper default: half the budget)
  int recent = 0;  ///< newest tokens always kept, >= 0; heavy + recent > 0 is the cache budget
};

/// HeavyHitterPolicy(heavy) with a recent window of `recent`, named "h2o".
[[nodiscard]] inline std::unique_ptr<Policy> make_h2o(const H2oConfig& config) {
  KVEVICT_REQUIRE(config.recent >= 0,
                  "h2o: recent must be >= 0, got " + std::to_string(config.recent));
  KVEVICT_REQUIRE(config.heavy > 0 || config.recent > 0,
                  "h2o: the budget heavy + recent must be positive, got heavy = " +
                      std::to_string(config.heavy) +
                      " and recent = " + std::to_string(config.recent));
  return std::make_unique<ProtectNewest>(std::make_unique<HeavyHitterPolicy>(config.heavy),
                                         config.recent, "h2o");
}

inline constexpr ParamSpec kH2oParams[] = {
    {"heavy", ParamType::integer, "tokens kept by accumulated attention", std::nullopt, 0,
     kMaxSlotsParam},
    {"recent", ParamType::integer, "newest tokens always kept", std::nullopt, 0, kMaxSlotsParam},
};

inline constexpr PolicySpec kH2oSpec{
    "h2o",
    "H2O (Zhang et al. 2023): the newest `recent` + the top `heavy` by accumulated attention",
    kH2oParams,
    [](int budget, int /*sinks*/) {
      return PolicyParams().set("heavy", budget / 2).set("recent", budget - budget / 2);
    },
    [](const PolicyParams& params) {
      return make_h2o({params.get_int("heavy"), params.get_int("recent")});
    },
};

}  // namespace kvevict
