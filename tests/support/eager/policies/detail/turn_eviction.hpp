// Shared pieces of the turn-level policies (SirLLM and its baselines RandomLLM / IntervalLLM).
//
// All three decide once per turn, before the turn is fed, and apply one keep-set to every layer and
// KV head: the decision is made on head (0, 0) and copied, so that a random draw (RandomLLM) is
// made once, not once per head.
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvevict/error.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager::detail {

/// The live count every head shares. Throws if the heads differ: a policy with one keep-set for the
/// whole sequence cannot have produced that table.
inline int uniform_live_count(const SlotTable& slots, std::string_view policy) {
  const int live = slots.live(0, 0);
  for (int l = 0; l < slots.layers(); ++l) {
    for (int g = 0; g < slots.kv_heads(); ++g) {
      KVEVICT_REQUIRE(slots.live(l, g) == live,
                      std::string(policy) +
                          ": every head must hold the same slots (one keep-set for all " +
                          "layers and heads), but head (0, 0) holds " + std::to_string(live) +
                          " and head (" + std::to_string(l) + ", " + std::to_string(g) +
                          ") holds " + std::to_string(slots.live(l, g)));
    }
  }
  return live;
}

/// Copies the keep-list of head (0, 0) to every other head of `plan`.
inline void copy_keep_to_all_heads(CompactionPlan& plan) {
  if (!plan.changes(0, 0)) return;
  const std::span<const std::int32_t> keep = plan.keep(0, 0);
  for (int l = 0; l < plan.layers(); ++l) {
    for (int g = 0; g < plan.kv_heads(); ++g) {
      if (l == 0 && g == 0) continue;
      std::copy(keep.begin(), keep.end(), plan.keep_buffer(l, g).begin());
      plan.set_keep_count(l, g, static_cast<int>(keep.size()));
    }
  }
}

/// Throws unless a turn of `incoming` tokens fits beside the sinks. The turn-level rule makes room
/// for the whole turn before it is fed, so a turn longer than the non-sink part of the budget can
/// never fit (the SirLLM authors assert on it).
inline void require_turn_fits(int incoming, int non_sink_budget, std::string_view policy,
                              std::string_view budget_name) {
  KVEVICT_REQUIRE(
      incoming <= non_sink_budget,
      std::string(policy) + ": a turn of " + std::to_string(incoming) + " tokens is longer than " +
          std::string(budget_name) + " = " + std::to_string(non_sink_budget) +
          "; the cache must make room for a whole turn before it is fed (feed shorter turns, "
          "or raise the budget)");
}

/// Sum of non-negative budget parts as int, or an error if it overflows.
inline int checked_budget_sum(std::int64_t total, std::string_view policy) {
  KVEVICT_REQUIRE(total <= std::int64_t{1} << 30, std::string(policy) + ": the total budget " +
                                                      std::to_string(total) + " is too large");
  return static_cast<int>(total);
}

/// RandomLLM and IntervalLLM (SirLLM §4.1.1): the attention sinks plus `budget` slots sampled from
/// the history, with SirLLM's turn-level trigger and capacity rule. Before a turn of n tokens, with
/// L cached: if L + n > sinks + budget, keep slots [0, sinks) and pick budget - n of the history
/// slots [sinks, L) (pick_history); otherwise keep everything.
class SinkHistoryPolicy : public Policy {
 public:
  SinkHistoryPolicy(std::string_view policy_name, int sinks, int budget)
      : sinks_(sinks), budget_(budget) {
    KVEVICT_REQUIRE(sinks >= 0, std::string(policy_name) + ": sinks must be >= 0, got " +
                                    std::to_string(sinks));
    KVEVICT_REQUIRE(budget > 0, std::string(policy_name) + ": budget must be positive, got " +
                                    std::to_string(budget));
    capacity_ = checked_budget_sum(std::int64_t{sinks} + budget, policy_name);
  }

  [[nodiscard]] SignalSet signals() const override { return {Signal::turn_boundaries}; }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::before_turn}; }
  /// As SirLLM, whose code base the baselines share (StreamingLLM's cache-index positions).
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::cache_index;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override { return capacity_; }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    if (context.trigger != Trigger::before_turn) return false;
    const int incoming = context.incoming;
    require_turn_fits(incoming, budget_, name(), "budget");
    const int live = uniform_live_count(context.slots, name());
    if (live + incoming <= capacity_) return false;
    // live + incoming > sinks + budget and incoming <= budget, so the history [sinks, live) holds
    // more than budget - incoming slots: the pick always has something to leave out.
    builder_.begin(live);
    builder_.keep_range(0, sinks_);
    pick_history(sinks_, live, budget_ - incoming, builder_);
    const bool changed = builder_.write(plan, 0, 0);
    copy_keep_to_all_heads(plan);
    return changed;
  }

 protected:
  /// Keeps exactly `count` (>= 0, < last - first) of the history slots [first, last) in `keep`.
  virtual void pick_history(int first, int last, int count, KeepSetBuilder& keep) = 0;

 private:
  int sinks_;
  int budget_;
  int capacity_ = 0;
  KeepSetBuilder builder_;
};

}  // namespace kvevict::eager::detail
