// StreamingLLM: window + attention sinks (Xiao et al., ICLR 2024; mit-han-lab/streaming-llm).
//
// Score: none. Keep rule: cache slots [0, sinks) (the attention sinks, in practice tokens 0..S-1)
// and the last `recent` slots [L - R, L). Trigger: after every forward once L > S + R; on the
// per-token perplexity path each step therefore attends to S + R + 1 keys. Granularity: the same
// keep-set in every layer and head. Positions: cache_index (the authors store keys before RoPE and
// rotate every key to its index in the cache at each forward). Paper default: S = 4.
// The authors' chat path instead evicts before each prompt to make room for prompt +
// max_new_tokens; an engine gets that by feeding the prompt as one chunk with max_chunk set.
#pragma once

#include <kvevict/error.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct StreamingLlmConfig {
  int sinks = 4;   ///< S >= 0 first slots kept for ever
  int recent = 0;  ///< R > 0 newest slots kept
};

class StreamingLlmPolicy final : public Policy {
 public:
  explicit StreamingLlmPolicy(const StreamingLlmConfig& config) : config_(config) {
    KVEVICT_REQUIRE(config.sinks >= 0,
                    "streaming_llm: sinks must be >= 0, got " + std::to_string(config.sinks));
    KVEVICT_REQUIRE(config.recent > 0,
                    "streaming_llm: recent must be positive, got " + std::to_string(config.recent));
  }

  [[nodiscard]] std::string_view name() const override { return "streaming_llm"; }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::cache_index;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    return config_.sinks + config_.recent;
  }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    return select_each_head(context.slots, builder_, plan, [this](KeepSetBuilder& keep, int, int) {
      keep.keep_range(0, config_.sinks);
      keep.keep_range(keep.slots() - config_.recent, keep.slots());
    });
  }

 private:
  StreamingLlmConfig config_;
  KeepSetBuilder builder_;
};

}  // namespace kvevict::eager
