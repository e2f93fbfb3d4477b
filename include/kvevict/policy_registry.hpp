// The policy registry: every policy's spec (declared in its header), looked up by name, and the one
// way every front end builds a policy from parameters or from a budget.
#pragma once

#include <array>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/policies/anllm.hpp"
#include "kvevict/policies/full.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/infinipot.hpp"
#include "kvevict/policies/interval_llm.hpp"
#include "kvevict/policies/key_scores.hpp"
#include "kvevict/policies/prompt_compression.hpp"
#include "kvevict/policies/random_llm.hpp"
#include "kvevict/policies/sirllm.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/tova.hpp"
#include "kvevict/policies/window.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict {

/// Every policy, in the order the documentation lists them.
[[nodiscard]] inline std::span<const PolicySpec* const> policy_specs() {
  static constexpr std::array<const PolicySpec*, 15> kSpecs{
      &kFullSpec,   &kWindowSpec,    &kStreamingLlmSpec, &kH2oSpec,       &kTovaSpec,
      &kSirLlmSpec, &kRandomLlmSpec, &kIntervalLlmSpec,  &kAnLlmSpec,     &kInfiniPotSpec,
      &kKnormSpec,  &kKeyDiffSpec,   &kSnapKvSpec,       &kPyramidKvSpec, &kAdaKvSpec};
  return kSpecs;
}

/// The policies' names, in the order of policy_specs().
[[nodiscard]] inline std::vector<std::string_view> policy_names() {
  std::vector<std::string_view> names;
  for (const PolicySpec* spec : policy_specs()) names.push_back(spec->name);
  return names;
}

/// "full, window, streaming_llm, ..." for messages and --help.
[[nodiscard]] inline std::string policy_list() {
  std::string list;
  for (const PolicySpec* spec : policy_specs()) {
    if (!list.empty()) list += ", ";
    list += spec->name;
  }
  return list;
}

/// The spec of policy `name`, or nullptr.
[[nodiscard]] inline const PolicySpec* find_policy_spec(std::string_view name) {
  for (const PolicySpec* spec : policy_specs()) {
    if (spec->name == name) return spec;
  }
  return nullptr;
}

/// The spec of policy `name`; throws kvevict::Error listing the known names.
[[nodiscard]] inline const PolicySpec& policy_spec(std::string_view name) {
  const PolicySpec* spec = find_policy_spec(name);
  if (spec == nullptr) {
    throw Error("unknown policy '" + std::string(name.substr(0, 64)) +
                "' (known: " + policy_list() + ")");
  }
  return *spec;
}

/// Builds policy `name` from `params` (typed and range-checked against its spec; defaults fill
/// the rest). Throws kvevict::Error naming the policy and parameter for any problem.
[[nodiscard]] inline std::unique_ptr<Policy> make_policy(std::string_view name,
                                                         const PolicyParams& params = {}) {
  const PolicySpec& spec = policy_spec(name);
  return spec.make(spec.resolve(params));
}

/// The parameters `--budget N` stands for in policy `name`, with `sinks` protected first tokens
/// where the policy counts sinks against the budget.
[[nodiscard]] inline PolicyParams budget_params(std::string_view name, int budget, int sinks = 4) {
  const PolicySpec& spec = policy_spec(name);
  KVEVICT_REQUIRE(spec.budget != nullptr, "--budget does not apply to policy '" +
                                              std::string(spec.name) + "', which has no budget");
  KVEVICT_REQUIRE(budget >= 1, "--budget must be at least 1, got " + std::to_string(budget));
  KVEVICT_REQUIRE(budget <= kMaxSlotsParam, "--budget must be at most " +
                                                PolicyParams::number_text(kMaxSlotsParam) +
                                                ", got " + std::to_string(budget));
  KVEVICT_REQUIRE(sinks >= 0, "--sinks must be >= 0, got " + std::to_string(sinks));
  return spec.budget(budget, sinks);
}

}  // namespace kvevict
