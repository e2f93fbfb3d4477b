// Shared pieces of the turn-level policies (SirLLM and its baselines RandomLLM / IntervalLLM).
//
// All three decide once per turn, before the turn is fed, with one keep-set for the whole model
// (token granularity): a random draw (RandomLLM) is made once, not once per head.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/selection.hpp"

namespace kvevict::detail {

/// Throws unless the first chunk of a turn, `incoming` tokens, fits the unprotected budget. The
/// turn-level rule makes room for it before it is fed, so a chunk longer than the budget can never
/// fit (the SirLLM authors assert on a whole turn; later chunks of a turn grow the cache, as in
/// their code).
inline void require_turn_fits(int incoming, int budget, std::string_view policy,
                              std::string_view budget_name) {
  KVEVICT_REQUIRE(
      incoming <= budget,
      std::string(policy) + ": a turn's first chunk of " + std::to_string(incoming) +
          " tokens is longer than " + std::string(budget_name) + " = " + std::to_string(budget) +
          "; the cache makes room for it before it is fed, so feed turns in chunks of at most " +
          std::to_string(budget) + " tokens (the CLI's --chunk), or raise the budget");
}

/// RandomLLM and IntervalLLM (SirLLM §4.1.1) without their sinks (a ProtectOldest around them):
/// `budget` tokens sampled from the history, with SirLLM's turn-level trigger and capacity rule.
/// Before a turn of n tokens, with H unprotected tokens cached: if H + n > budget, keep
/// budget - n of them (leave_out names the others); otherwise keep everything.
class HistorySampler : public Policy {
 public:
  HistorySampler(std::string_view policy_name, int budget) : budget_(budget) {
    KVEVICT_REQUIRE(budget > 0, std::string(policy_name) + ": budget must be positive, got " +
                                    std::to_string(budget));
  }

  [[nodiscard]] SignalSet signals() const override { return {Signal::turn_boundaries}; }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::before_turn}; }
  /// As SirLLM, whose code base the baselines share (StreamingLLM's cache-index positions).
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::cache_index;
  }
  [[nodiscard]] Granularity default_granularity() const override { return Granularity::token; }
  [[nodiscard]] std::optional<int> retained_limit() const override { return budget_; }

  void select(const EvictionContext& context, Decision& decision) override {
    if (context.trigger != Trigger::before_turn) return;
    const int incoming = context.incoming;
    require_turn_fits(incoming, budget_, name(), "budget");
    const Protection& protection = context.protection;
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      // The unprotected tokens, oldest first: without flags, those between the protected oldest
      // and newest, in place; else the ones a keep set of the protected leaves.
      std::span<const std::int32_t> history = context.slots.stream_order(unit);
      if (protection.flags == 0) {
        const auto [first, last] = protection.unprotected(static_cast<int>(history.size()));
        history = history.subspan(static_cast<std::size_t>(first),
                                  static_cast<std::size_t>(last - first));
      } else {
        keep_.begin(context.slots, unit, protection);
        history_.clear();
        for (const std::int32_t slot : keep_.order()) {
          if (!keep_.is_kept(slot)) history_.push_back(slot);
        }
        history = history_;
      }
      if (static_cast<int>(history.size()) + incoming <= budget_) continue;
      // history + incoming > budget and incoming <= budget, so the history holds more than
      // budget - incoming tokens: the pick always has something to leave out.
      left_out_.clear();
      leave_out(history, budget_ - incoming, left_out_);
      for (const std::int32_t i : left_out_) {
        decision.evict(unit, history[static_cast<std::size_t>(i)]);
      }
    }
  }

 protected:
  /// Writes to `left_out` (empty) the indices into `history` (oldest first) of the tokens not kept
  /// when the policy keeps exactly `count` (>= 0, < history.size()) of them, in ascending order:
  /// history.size() - count indices. Only the evicted are named: at a turn of a few tokens that is
  /// a few, where the kept are nearly the whole history.
  virtual void leave_out(std::span<const std::int32_t> history, int count,
                         std::vector<std::int32_t>& left_out) = 0;

 private:
  int budget_;
  KeepSet keep_;                        // the protected, when flags protect some
  std::vector<std::int32_t> history_;   // the unprotected, when flags protect some
  std::vector<std::int32_t> left_out_;  // indices into the history
};

}  // namespace kvevict::detail
