// Window (sliding window; Beltagy et al. 2020, the baseline of StreamingLLM and TOVA).
//
// Score: none. Keep rule: the last `recent` tokens. Trigger: after every forward, once a head holds
// more than `recent` slots; a multi-token chunk is trimmed after its forward, so the chunk itself
// attended to everything before it. Granularity: the same keep-set in every layer and head.
// Positions: cache_index by default, as in the streaming-llm repository's window baseline.
// Known failure: once token 0 leaves the cache perplexity explodes (StreamingLLM §3.1); the sink
// variant (streaming_llm.hpp) fixes exactly that.
#pragma once

#include <kvevict/error.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct WindowConfig {
  int recent = 0;  ///< tokens kept, R > 0
};

class WindowPolicy final : public Policy {
 public:
  explicit WindowPolicy(const WindowConfig& config) : config_(config) {
    KVEVICT_REQUIRE(config.recent > 0,
                    "window: recent must be positive, got " + std::to_string(config.recent));
  }

  [[nodiscard]] std::string_view name() const override { return "window"; }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::cache_index;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override { return config_.recent; }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    return select_each_head(context.slots, builder_, plan, [this](KeepSetBuilder& keep, int, int) {
      keep.keep_range(keep.slots() - config_.recent, keep.slots());
    });
  }

 private:
  WindowConfig config_;
  KeepSetBuilder builder_;
};

}  // namespace kvevict::eager
