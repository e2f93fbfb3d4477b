// make_policy: every policy by name, configured from PolicyParams (CLI, replay files, eval grids).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/policies/full.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/window.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict {

/// Names accepted by make_policy.
[[nodiscard]] inline std::vector<std::string_view> policy_names() {
  return {"full", "window", "streaming_llm"};
}

/// Builds policy `name` from `params`. Parameters (see each policy's header):
///   full           (none)
///   window         recent
///   streaming_llm  sinks (4), recent
/// Throws kvevict::Error for an unknown name, a missing, malformed or unknown parameter, or an
/// invalid configuration.
[[nodiscard]] inline std::unique_ptr<Policy> make_policy(std::string_view name,
                                                         const PolicyParams& params) {
  std::unique_ptr<Policy> policy;
  if (name == "full") {
    policy = std::make_unique<FullPolicy>();
  } else if (name == "window") {
    policy = std::make_unique<WindowPolicy>(WindowConfig{params.get_int("recent")});
  } else if (name == "streaming_llm") {
    policy = std::make_unique<StreamingLlmPolicy>(
        StreamingLlmConfig{params.get_int("sinks", 4), params.get_int("recent")});
  } else {
    std::string known;
    for (std::string_view candidate : policy_names()) known += " " + std::string(candidate);
    throw Error("unknown policy '" + std::string(name) + "' (known:" + known + ")");
  }
  params.check_all_used(name);
  return policy;
}

}  // namespace kvevict
