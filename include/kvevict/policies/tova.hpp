// TOVA: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024,
// §3.4; ablations in App. A, Table 2; reference code schwartz-lab-NLP/TOVA src/tova_cache.py).
//
// Score: the CURRENT forward's attention of its last query only, averaged over every query head
// that reads the unit (score column 0, rewritten every forward, never accumulated). Keep rule: when
// a unit holds more than `budget` tokens, keep the `budget` best: the first `sinks` tokens (the
// paper's TOVA+i ablation, counted inside the budget: a ProtectOldest(sinks) around TOVA with
// budget - sinks; default 0) and the top scores among the rest, ties to the lower position.
// Nothing else is protected: no recent window, and the token just fed can be dropped at once.
// Trigger: after every forward, so a steady decode drops the argmin and a prefill longer than the
// budget is cut in one shot from the last prompt token's row. Positions: original (keys stored
// after RoPE).
// Granularity: per layer (one keep-set for the KV heads of a layer, scored by the mean over all of
// the layer's query heads: the paper's TOVA-layer). `head_wise` selects per KV head, scored by the
// mean over that head's query-head group (TOVA-head; the paper reports it worse, App. A Table 2).
// Per token, the mean extends over every layer's query heads (kvevict's extension).
// Paper vs code: kvevict follows the paper and the authors' code. NVIDIA kvpress differs on
// purpose (its TOVA always keeps the last token); kvevict does not copy that.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvevict/attention_scores.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

struct TovaConfig {
  int budget = 0;          ///< tokens kept per unit, > 0 (the paper's multi-state size)
  int sinks = 0;           ///< first tokens always kept, inside the budget, 0 <= sinks < budget
  bool head_wise = false;  ///< one keep-set per KV head instead of per layer (paper: worse)
};

/// TOVA's score and keep rule: the top `budget` unprotected tokens by the last query's attention.
class TovaPolicy final : public Policy {
 public:
  explicit TovaPolicy(int budget, bool head_wise = false) : budget_(budget), head_wise_(head_wise) {
    KVEVICT_REQUIRE(budget > 0, "tova: budget must be positive, got " + std::to_string(budget));
  }

  [[nodiscard]] std::string_view name() const override { return "tova"; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::last_attention_row}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] Granularity default_granularity() const override {
    return head_wise_ ? Granularity::head : Granularity::layer;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override { return budget_; }
  [[nodiscard]] bool supports_blocks() const override { return true; }
  [[nodiscard]] bool supports_pressure() const override { return true; }
  [[nodiscard]] bool checks_probabilities() const override { return true; }
  [[nodiscard]] bool attention_per_kv_head() const override { return true; }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    return ScoreRule{kScore, budget_, {}};
  }

  /// The score is this forward's: every unit's sum starts from zero at its first layer (a unit
  /// over several layers adds the others' to it).
  void on_append(SlotTable& slots, const ChunkInfo& /*chunk*/) override {
    restart_.assign(static_cast<std::size_t>(slots.units()), 1);
    known_worst_.assign(static_cast<std::size_t>(slots.units()), KnownWorst{});
  }

  /// Uses the last query row of `rows` (an engine may pass every row of the forward; only the last
  /// one counts). Must be called for every layer in every forward: the score is not carried over.
  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    check_attention_rows(slots, layer, rows, "tova", /*some_kv_heads=*/true);
    // Mean over the query heads that read a unit: its KV heads' groups, over its layers.
    const float weight =
        1.0f / static_cast<float>(rows.group_size() * slots.layout().heads_per_unit());
    add_attention_checked(slots, layer, rows, weight, kScore, /*last_query_only=*/true, restart_);
    // A unit whose last head this was has its scores of the forward, in cache now: its worst slot
    // is found here rather than at select(), after the other layers' weights have passed.
    const UnitLayout& layout = slots.layout();
    if (layout.block_tokens() > 1) return;  // blocks are ranked whole at select()
    for (int g = 0; g < rows.kv_heads(); ++g) {
      const int kv_head = rows.first_kv_head() + g;
      if (!layout.last_head_of_unit(layer, kv_head)) continue;
      const int unit = layout.unit_of(layer, kv_head);
      if (static_cast<std::size_t>(unit) >= known_worst_.size()) break;  // no append yet
      known_worst_[static_cast<std::size_t>(unit)] =
          KnownWorst::of_every_slot(slots, unit, slots.scores(unit, kScore));
    }
  }

  void select(const EvictionContext& context, Decision& decision) override {
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      KnownWorst known;
      if (static_cast<std::size_t>(unit) < known_worst_.size()) {
        std::swap(known, known_worst_[static_cast<std::size_t>(unit)]);  // used once
      }
      (void)worst_.evict(context.slots, unit, context.protection, context.keep(unit, budget_),
                         context.slots.scores(unit, kScore), decision, context.max_live, known);
    }
  }

 private:
  static constexpr int kScore = 0;  // the current forward's attention column

  int budget_;
  bool head_wise_;
  std::vector<std::uint8_t> restart_;    // [units]: 1 until the unit's first layer of the forward
  std::vector<KnownWorst> known_worst_;  // [units]: found after the unit's last head, for select()
  WorstCandidates worst_;
};

/// TOVA with `sinks` first tokens counted inside the budget, named "tova".
[[nodiscard]] inline std::unique_ptr<Policy> make_tova(const TovaConfig& config) {
  KVEVICT_REQUIRE(config.budget > 0,
                  "tova: budget must be positive, got " + std::to_string(config.budget));
  KVEVICT_REQUIRE(config.sinks >= 0,
                  "tova: sinks must be >= 0, got " + std::to_string(config.sinks));
  KVEVICT_REQUIRE(config.sinks < config.budget,
                  "tova: budget " + std::to_string(config.budget) +
                      " is not larger than the protected set (sinks = " +
                      std::to_string(config.sinks) + "): no slot would be chosen by attention");
  auto tova = std::make_unique<TovaPolicy>(config.budget - config.sinks, config.head_wise);
  if (config.sinks == 0) return tova;
  return std::make_unique<ProtectOldest>(std::move(tova), config.sinks, "tova");
}

inline constexpr ParamSpec kTovaParams[] = {
    {"budget", ParamType::integer, "tokens kept, sinks included", std::nullopt, 1, kMaxSlotsParam},
    {"sinks", ParamType::integer, "first tokens always kept, inside the budget (TOVA+i)", 0, 0,
     kMaxSlotsParam},
    {"head_wise", ParamType::integer, "1: one keep-set per KV head (TOVA-head), 0: per layer", 0, 0,
     1},
};

inline constexpr PolicySpec kTovaSpec{
    "tova",
    "TOVA (Oren et al. 2024): the top `budget` by the last query's attention, mean over heads",
    kTovaParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("budget", budget); },
    [](const PolicyParams& params) {
      return make_tova(
          {params.get_int("budget"), params.get_int("sinks"), params.get_int("head_wise") == 1});
    },
};

}  // namespace kvevict
