// Window (sliding window; Beltagy et al. 2020, the baseline of StreamingLLM and TOVA).
//
// Score: none (recency). Keep rule: the newest `recent` tokens among those not protected. Trigger:
// after every forward, once a unit holds more; a multi-token chunk is trimmed after its forward,
// so the chunk itself attended to everything before it. Granularity: token (the same keep-set in
// every layer and head). Positions: cache_index by default, as in the streaming-llm repository's
// window baseline. Known failure: once token 0 leaves the cache perplexity explodes (StreamingLLM
// §3.1); the sink variant (streaming_llm.hpp) fixes exactly that.
// Cost: O(evicted) per step, whatever the window size (the oldest candidates go first).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "kvevict/error.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

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
  [[nodiscard]] Granularity default_granularity() const override { return Granularity::token; }
  [[nodiscard]] std::optional<int> retained_limit() const override { return config_.recent; }
  [[nodiscard]] bool supports_blocks() const override { return true; }
  [[nodiscard]] bool supports_pressure() const override { return true; }

  void select(const EvictionContext& context, Decision& decision) override {
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      (void)worst_.evict(context.slots, unit, context.protection, config_.recent, {}, decision,
                         context.max_live);
    }
  }

 private:
  WindowConfig config_;
  WorstCandidates worst_;
};

inline constexpr ParamSpec kWindowParams[] = {
    {"recent", ParamType::integer, "newest tokens kept", std::nullopt, 1, kMaxSlotsParam},
};

inline constexpr PolicySpec kWindowSpec{
    "window",
    "sliding window (Beltagy et al. 2020): the newest `recent` tokens",
    kWindowParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("recent", budget); },
    [](const PolicyParams& params) -> std::unique_ptr<Policy> {
      return std::make_unique<WindowPolicy>(WindowConfig{params.get_int("recent")});
    },
};

}  // namespace kvevict
