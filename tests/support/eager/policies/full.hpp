// Full cache: never evicts. The baseline every bounded policy is compared with.
#pragma once

#include <string_view>

#include "eager/policy.hpp"

namespace kvevict::eager {

/// Keeps every token. Memory grows linearly with the stream; past the model's trained context the
/// positions are out of distribution (SirLLM Fig. 5: perplexity explodes).
class FullPolicy final : public Policy {
 public:
  [[nodiscard]] std::string_view name() const override { return "full"; }
  [[nodiscard]] TriggerSet triggers() const override { return {}; }
  bool select(const EvictionContext& /*context*/, CompactionPlan& /*plan*/) override {
    return false;
  }
};

}  // namespace kvevict::eager
