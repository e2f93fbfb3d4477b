// Full cache: never evicts. The baseline every bounded policy is compared with.
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict {

/// Keeps every token. Memory grows linearly with the stream; past the model's trained context the
/// positions are out of distribution (SirLLM Fig. 5: perplexity explodes).
class FullPolicy final : public Policy {
 public:
  [[nodiscard]] std::string_view name() const override { return "full"; }
  [[nodiscard]] TriggerSet triggers() const override { return {}; }
  [[nodiscard]] Granularity default_granularity() const override { return Granularity::token; }
  [[nodiscard]] bool supports_blocks() const override { return true; }  // never evicts
  void select(const EvictionContext& /*context*/, Decision& /*decision*/) override {}
};

inline constexpr PolicySpec kFullSpec{
    "full",
    "full cache: keeps every token (the baseline)",
    std::span<const ParamSpec>{},
    nullptr,
    [](const PolicyParams&) -> std::unique_ptr<Policy> { return std::make_unique<FullPolicy>(); },
};

}  // namespace kvevict
