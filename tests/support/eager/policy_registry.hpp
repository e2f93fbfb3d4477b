// make_policy: every policy by name, configured from PolicyParams (CLI, replay files, eval grids).
#pragma once

#include <cstdint>
#include <kvevict/error.hpp>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "eager/policies/anllm.hpp"
#include "eager/policies/full.hpp"
#include "eager/policies/h2o.hpp"
#include "eager/policies/infinipot.hpp"
#include "eager/policies/interval_llm.hpp"
#include "eager/policies/random_llm.hpp"
#include "eager/policies/sirllm.hpp"
#include "eager/policies/streaming_llm.hpp"
#include "eager/policies/tova.hpp"
#include "eager/policies/window.hpp"
#include "eager/policy.hpp"
#include "eager/policy_params.hpp"

namespace kvevict::eager {

/// Names accepted by make_policy.
[[nodiscard]] inline std::vector<std::string_view> policy_names() {
  return {"full", "window", "streaming_llm", "infinipot",    "h2o",
          "tova", "sirllm", "random_llm",    "interval_llm", "anllm"};
}

/// Builds policy `name` from `params`. Parameters (see each policy's header):
///   full           (none)
///   window         recent
///   streaming_llm  sinks (4), recent
///   infinipot      pot, keep, novel (keep / 2: the paper's T = C / 2 worked best)
///   h2o            heavy, recent
///   tova           budget, sinks (0), head_wise (0; 1 = one keep-set per KV head)
///   sirllm         sinks (4), entropy, recent (0), decay (1.0), shifted (0; 1 = authors' scores)
///   random_llm     sinks (4), budget, seed (0)
///   interval_llm   sinks (4), budget
///   anllm          anchor_ids (list), max_slots (0 = no cap)
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
  } else if (name == "infinipot") {
    const int keep = params.get_int("keep");
    policy = std::make_unique<InfiniPotPolicy>(
        InfiniPotConfig{params.get_int("pot"), keep, params.get_int("novel", keep / 2)});
  } else if (name == "h2o") {
    policy =
        std::make_unique<H2oPolicy>(H2oConfig{params.get_int("heavy"), params.get_int("recent")});
  } else if (name == "tova") {
    const int head_wise = params.get_int("head_wise", 0);
    KVEVICT_REQUIRE(head_wise == 0 || head_wise == 1,
                    "tova: head_wise must be 0 or 1, got " + std::to_string(head_wise));
    policy = std::make_unique<TovaPolicy>(
        TovaConfig{params.get_int("budget"), params.get_int("sinks", 0), head_wise == 1});
  } else if (name == "sirllm") {
    const int shifted = params.get_int("shifted", 0);
    KVEVICT_REQUIRE(shifted == 0 || shifted == 1,
                    "sirllm: shifted must be 0 or 1, got " + std::to_string(shifted));
    policy = std::make_unique<SirLlmPolicy>(
        SirLlmConfig{params.get_int("sinks", 4), params.get_int("entropy"),
                     params.get_int("recent", 0), params.get_double("decay", 1.0), shifted == 1});
  } else if (name == "random_llm") {
    const int seed = params.get_int("seed", 0);
    KVEVICT_REQUIRE(seed >= 0, "random_llm: seed must be >= 0, got " + std::to_string(seed));
    policy = std::make_unique<RandomLlmPolicy>(RandomLlmConfig{
        params.get_int("sinks", 4), params.get_int("budget"), static_cast<std::uint64_t>(seed)});
  } else if (name == "interval_llm") {
    policy = std::make_unique<IntervalLlmPolicy>(
        IntervalLlmConfig{params.get_int("sinks", 4), params.get_int("budget")});
  } else if (name == "anllm") {
    AnLlmConfig config;
    for (std::int64_t id : params.get_list("anchor_ids")) {
      KVEVICT_REQUIRE(id >= 0 && id <= std::numeric_limits<std::int32_t>::max(),
                      "anllm: anchor id " + std::to_string(id) + " is not a token id");
      config.anchor_ids.push_back(static_cast<std::int32_t>(id));
    }
    config.max_slots = params.get_int("max_slots", 0);
    policy = std::make_unique<AnLlmPolicy>(config);
  } else {
    std::string known;
    // append, not `" " + std::string(...)`: GCC 12 -O3 reports a false -Wrestrict on the latter.
    for (std::string_view candidate : policy_names()) known.append(" ").append(candidate);
    throw Error("unknown policy '" + std::string(name) + "' (known:" + known + ")");
  }
  params.check_all_used(name);
  return policy;
}

}  // namespace kvevict::eager
