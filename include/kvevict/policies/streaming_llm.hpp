// StreamingLLM: window + attention sinks (Xiao et al., ICLR 2024; mit-han-lab/streaming-llm).
//
// Score: none. Keep rule: the first `sinks` tokens (the attention sinks, in practice tokens
// 0..S-1) and the newest `recent`: a Window of `recent` inside a ProtectOldest of `sinks`
// (policies/protection.hpp). Trigger: after every forward once a unit holds more than S + R; on the
// per-token perplexity path each step therefore attends to S + R + 1 keys. Granularity: token (the
// same keep-set in every layer and head). Positions: cache_index (the authors store keys before
// RoPE and rotate every key to its index in the cache at each forward; kvevict gets the same
// positions from two position groups, the sinks and the window, and no key is ever re-rotated).
// Paper default: S = 4.
// The authors' chat path instead evicts before each prompt to make room for prompt +
// max_new_tokens; an engine gets that by feeding the prompt as one chunk with max_chunk set.
#pragma once

#include <memory>
#include <optional>

#include "kvevict/policies/protection.hpp"
#include "kvevict/policies/window.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict {

struct StreamingLlmConfig {
  int sinks = 4;   ///< S >= 0 first tokens kept for ever
  int recent = 0;  ///< R > 0 newest tokens kept
};

/// Window(recent) with `sinks` protected first tokens, named "streaming_llm".
[[nodiscard]] inline std::unique_ptr<Policy> make_streaming_llm(const StreamingLlmConfig& config) {
  return std::make_unique<ProtectOldest>(
      std::make_unique<WindowPolicy>(WindowConfig{config.recent}), config.sinks, "streaming_llm");
}

inline constexpr ParamSpec kStreamingLlmParams[] = {
    {"sinks", ParamType::integer, "first tokens kept for ever (attention sinks)", 4, 0,
     kMaxSlotsParam},
    {"recent", ParamType::integer, "newest tokens kept", std::nullopt, 1, kMaxSlotsParam},
};

inline constexpr PolicySpec kStreamingLlmSpec{
    "streaming_llm",
    "StreamingLLM (Xiao et al. 2024): `sinks` first tokens + the newest `recent`",
    kStreamingLlmParams,
    [](int budget, int sinks) {
      return PolicyParams().set("sinks", sinks).set("recent", budget_after_sinks(budget, sinks));
    },
    [](const PolicyParams& params) {
      return make_streaming_llm({params.get_int("sinks"), params.get_int("recent")});
    },
};

}  // namespace kvevict
