// Decorators around a policy: protection (attention sinks, a recent window, anchors) and a slot
// cap, composed around any policy instead of re-coded in each (in the spirit of kvpress's wrapper
// presses).
//
// A protecting decorator adds to the context's Protection before the inner policy decides; the
// inner policy keeps the protected slots in addition to its own (every keep rule honours
// EvictionContext::protection), so its budget counts only the unprotected slots. That is how the
// papers compose them: StreamingLLM is a window of R plus S sinks, H2O is `heavy` heavy hitters
// plus a recent window of R, TOVA+i keeps i first tokens beside its budget - i. A slot cap acts
// after the inner policy, on what it kept.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy.hpp"

namespace kvevict {

/// Forwards every hook to the policy it wraps. `name` is what the composition is called.
class PolicyDecorator : public Policy {
 public:
  PolicyDecorator(std::unique_ptr<Policy> inner, std::string name)
      : inner_(std::move(inner)), name_(std::move(name)) {
    KVEVICT_REQUIRE(inner_ != nullptr, "policy decorator: the wrapped policy is null");
    if (name_.empty()) name_ = std::string(inner_->name());
  }

  [[nodiscard]] std::string_view name() const override { return name_; }
  [[nodiscard]] SignalSet signals() const override { return inner_->signals(); }
  [[nodiscard]] TriggerSet triggers() const override { return inner_->triggers(); }
  [[nodiscard]] int score_columns() const override { return inner_->score_columns(); }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return inner_->default_position_mode();
  }
  [[nodiscard]] Granularity default_granularity() const override {
    return inner_->default_granularity();
  }
  [[nodiscard]] bool supports_blocks() const override { return inner_->supports_blocks(); }
  [[nodiscard]] bool supports_pressure() const override { return inner_->supports_pressure(); }
  [[nodiscard]] int min_retained() const override { return inner_->min_retained(); }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    return inner_->score_rule();
  }
  void check_sequence(const UnitLayout& layout, int group_size) const override {
    inner_->check_sequence(layout, group_size);
  }
  void update_scores(SlotTable& slots, int unit) override { inner_->update_scores(slots, unit); }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    return inner_->retained_limit();
  }
  [[nodiscard]] bool uneven_shares() const override { return inner_->uneven_shares(); }
  [[nodiscard]] bool checks_probabilities() const override {
    return inner_->checks_probabilities();
  }
  [[nodiscard]] bool attention_per_kv_head() const override {
    return inner_->attention_per_kv_head();
  }
  [[nodiscard]] std::uint8_t flags_for(std::int32_t token_id) const override {
    return inner_->flags_for(token_id);
  }
  [[nodiscard]] std::optional<int> pot_room(const SlotTable& slots) const override {
    return inner_->pot_room(slots);
  }
  void move_slots(int unit, std::span<const SlotMove> moves) override {
    inner_->move_slots(unit, moves);
  }
  void on_append(SlotTable& slots, const ChunkInfo& chunk) override {
    inner_->on_append(slots, chunk);
  }
  void observe_attention(SlotTable& slots, int layer, const AttentionRows& rows) override {
    inner_->observe_attention(slots, layer, rows);
  }
  void observe_keys(SlotTable& slots, int layer, const KeyRows& keys) override {
    inner_->observe_keys(slots, layer, keys);
  }
  void observe_surprisal(SlotTable& slots, const ChunkInfo& chunk,
                         std::span<const float> surprisal) override {
    inner_->observe_surprisal(slots, chunk, surprisal);
  }
  void observe_catalyst(SlotTable& slots, int layer, const AttentionRows& rows) override {
    inner_->observe_catalyst(slots, layer, rows);
  }
  void select(const EvictionContext& context, Decision& decision) override {
    inner_->select(context, decision);
  }

  [[nodiscard]] Policy& inner() { return *inner_; }
  [[nodiscard]] const Policy& inner() const { return *inner_; }

 private:
  std::unique_ptr<Policy> inner_;
  std::string name_;
};

/// Keeps the `count` oldest tokens of every unit (attention sinks: StreamingLLM §3.2, TOVA+i) on
/// top of what the inner policy keeps. The inner policy never sees them as candidates.
class ProtectOldest final : public PolicyDecorator {
 public:
  ProtectOldest(std::unique_ptr<Policy> inner, int count, std::string name = {})
      : PolicyDecorator(std::move(inner), std::move(name)), count_(count) {
    KVEVICT_REQUIRE(count >= 0, std::string(this->name()) + ": sinks must be >= 0, got " +
                                    std::to_string(count));
  }
  [[nodiscard]] int count() const { return count_; }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    return plus(inner().retained_limit(), count_, name());
  }
  [[nodiscard]] int min_retained() const override {
    return *plus(inner().min_retained(), count_, name());
  }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    std::optional<ScoreRule> rule = inner().score_rule();
    if (rule) rule->protection.oldest = std::max(rule->protection.oldest, count_);
    return rule;
  }
  void select(const EvictionContext& context, Decision& decision) override {
    EvictionContext protected_context = context;
    protected_context.protection.oldest = std::max(context.protection.oldest, count_);
    inner().select(protected_context, decision);
  }

  /// limit + extra, or an error naming the policy when it leaves int range.
  static std::optional<int> plus(std::optional<int> limit, int extra, std::string_view policy) {
    if (!limit) return std::nullopt;
    return checked_int(checked_sum({*limit, extra}, std::string(policy) + ": budget"),
                       std::string(policy) + ": budget");
  }

 private:
  int count_;
};

/// Keeps the `count` newest tokens of every unit (H2O's recent window) on top of what the inner
/// policy keeps.
class ProtectNewest final : public PolicyDecorator {
 public:
  ProtectNewest(std::unique_ptr<Policy> inner, int count, std::string name = {})
      : PolicyDecorator(std::move(inner), std::move(name)), count_(count) {
    KVEVICT_REQUIRE(count >= 0, std::string(this->name()) + ": recent must be >= 0, got " +
                                    std::to_string(count));
  }
  [[nodiscard]] int count() const { return count_; }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    return ProtectOldest::plus(inner().retained_limit(), count_, name());
  }
  [[nodiscard]] int min_retained() const override {
    return *ProtectOldest::plus(inner().min_retained(), count_, name());
  }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    std::optional<ScoreRule> rule = inner().score_rule();
    if (rule) rule->protection.newest = std::max(rule->protection.newest, count_);
    return rule;
  }
  void select(const EvictionContext& context, Decision& decision) override {
    EvictionContext protected_context = context;
    protected_context.protection.newest = std::max(context.protection.newest, count_);
    inner().select(protected_context, decision);
  }

 private:
  int count_;
};

/// Marks the tokens in `anchor_ids` as anchors (slot_flag::anchor) and keeps every anchor on top of
/// what the inner policy keeps (AnLLM's anchors, around any policy). Unbounded: anchors accumulate.
class ProtectAnchors final : public PolicyDecorator {
 public:
  ProtectAnchors(std::unique_ptr<Policy> inner, std::vector<std::int32_t> anchor_ids,
                 std::string name = {})
      : PolicyDecorator(std::move(inner), std::move(name)), anchor_ids_(std::move(anchor_ids)) {
    KVEVICT_REQUIRE(!anchor_ids_.empty(),
                    std::string(this->name()) + ": anchor_ids must name at least one token id");
    std::sort(anchor_ids_.begin(), anchor_ids_.end());
  }
  [[nodiscard]] std::optional<int> retained_limit() const override { return std::nullopt; }
  /// Anchors accumulate and are never evicted: no pool can press the sequence below them.
  [[nodiscard]] bool supports_pressure() const override { return false; }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    std::optional<ScoreRule> rule = inner().score_rule();
    if (rule) rule->protection.flags |= slot_flag::anchor;
    return rule;
  }
  [[nodiscard]] std::uint8_t flags_for(std::int32_t token_id) const override {
    const bool anchor = std::binary_search(anchor_ids_.begin(), anchor_ids_.end(), token_id);
    return static_cast<std::uint8_t>(inner().flags_for(token_id) |
                                     (anchor ? slot_flag::anchor : 0));
  }
  void select(const EvictionContext& context, Decision& decision) override {
    EvictionContext protected_context = context;
    protected_context.protection.flags |= slot_flag::anchor;
    inner().select(protected_context, decision);
  }

 private:
  std::vector<std::int32_t> anchor_ids_;
};

/// At most `max_slots` tokens per unit: after the inner policy decides (and after every forward
/// the inner policy lets pass), the oldest of the tokens it kept beyond the cap are evicted too,
/// protected ones included. Use it outermost. kvevict's extension (AnLLM's `max_slots`): it bounds
/// a policy whose cache otherwise grows without limit.
class SlotCap final : public PolicyDecorator {
 public:
  SlotCap(std::unique_ptr<Policy> inner, int max_slots, std::string name = {})
      : PolicyDecorator(std::move(inner), std::move(name)), max_slots_(max_slots) {
    KVEVICT_REQUIRE(max_slots > 0, std::string(this->name()) +
                                       ": max_slots must be positive, got " +
                                       std::to_string(max_slots));
  }
  [[nodiscard]] int max_slots() const { return max_slots_; }
  /// The cap evicts single tokens (the oldest beyond it): no block form.
  [[nodiscard]] bool supports_blocks() const override { return false; }
  [[nodiscard]] TriggerSet triggers() const override {
    TriggerSet triggers = inner().triggers();
    triggers |= TriggerSet{Trigger::after_forward};
    return triggers;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    const std::optional<int> inner_limit = inner().retained_limit();
    return inner_limit ? std::min(*inner_limit, max_slots_) : max_slots_;
  }
  [[nodiscard]] int min_retained() const override {
    return std::min(inner().min_retained(), max_slots_);
  }
  /// The cap adds a rule beyond the top-k: not of that form.
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override { return std::nullopt; }
  void select(const EvictionContext& context, Decision& decision) override {
    if (inner().triggers().contains(context.trigger)) inner().select(context, decision);
    const SlotTable& slots = context.slots;
    for (int unit = 0; unit < slots.units(); ++unit) {
      const std::span<const std::int32_t> evicted = decision.evicted(unit);
      const int survivors = slots.live(unit) - static_cast<int>(evicted.size());
      if (survivors <= max_slots_) continue;
      going_.assign(static_cast<std::size_t>(slots.slot_limit(unit)), 0);
      for (const std::int32_t slot : evicted) going_[static_cast<std::size_t>(slot)] = 1;
      int excess = survivors - max_slots_;
      for (const std::int32_t slot : slots.stream_order(unit)) {
        if (excess == 0) break;
        if (going_[static_cast<std::size_t>(slot)] != 0) continue;
        decision.evict(unit, slot);
        --excess;
      }
    }
  }

 private:
  int max_slots_;
  std::vector<std::uint8_t> going_;  // [slot limit] evicted by the inner policy
};

}  // namespace kvevict
