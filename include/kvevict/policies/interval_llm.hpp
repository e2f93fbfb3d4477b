// IntervalLLM: attention sinks + the history sampled at a fixed stride (baseline of SirLLM, Yao et
// al., ACL 2024, §4.1.1, after the strided pattern of Child et al. 2019: "uniformly samples tokens
// from the historical token sequence at fixed intervals ... interval = floor(history token length
// / cache size). This approach continues until the cache size is fully utilized"; Table 1 runs it
// with 4 sinks and 508 slots, no recent window).
//
// Score: none. Keep rule, before a turn of n tokens with L cached and capacity sinks + budget: if
// L + n > capacity, keep the first `sinks` tokens and, with history h = L - sinks and room
// k = budget - n, the history tokens i * floor(h / k) for i = 0 .. k-1 (oldest first), i.e. every
// stride-th token from the oldest history token until the room is used; otherwise keep everything
// (a HistorySampler inside a ProtectOldest(sinks)). A turn longer than `budget` is an error.
// Trigger: before_turn (Signal::turn_boundaries), SirLLM's turn-level rule. Granularity: token.
// Positions: cache_index, as SirLLM. The authors released no code for the baselines. kvevict reads
// "history" as the non-sink tokens and "cache size" as the room left for them after the incoming
// turn, and starts at the oldest history token (the newest h - k * stride may fall outside).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "kvevict/policies/detail/turn_eviction.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict {

struct IntervalLlmConfig {
  int sinks = 4;   ///< S >= 0 first tokens kept for ever
  int budget = 0;  ///< B > 0 tokens for the sampled history (and the incoming turn)
};

class IntervalLlmPolicy final : public detail::HistorySampler {
 public:
  explicit IntervalLlmPolicy(int budget) : HistorySampler("interval_llm", budget) {}

  [[nodiscard]] std::string_view name() const override { return "interval_llm"; }

 protected:
  void leave_out(std::span<const std::int32_t> history, int count,
                 std::vector<std::int32_t>& left_out) override {
    // Kept: i * stride for i in [0, count); count < history.size(), so the stride is >= 1 and
    // count strides stay inside the history.
    const int size = static_cast<int>(history.size());
    const int stride = count > 0 ? size / count : size;
    int next_kept = 0;  // index of the next kept token, while fewer than count were kept
    for (int i = 0; i < size; ++i) {
      if (i == next_kept && next_kept < count * stride) {
        next_kept += stride;
        continue;
      }
      left_out.push_back(i);
    }
  }
};

/// IntervalLlmPolicy with `sinks` protected first tokens, named "interval_llm".
[[nodiscard]] inline std::unique_ptr<Policy> make_interval_llm(const IntervalLlmConfig& config) {
  return std::make_unique<ProtectOldest>(std::make_unique<IntervalLlmPolicy>(config.budget),
                                         config.sinks, "interval_llm");
}

inline constexpr ParamSpec kIntervalLlmParams[] = {
    {"sinks", ParamType::integer, "first tokens kept for ever", 4, 0, kMaxSlotsParam},
    {"budget", ParamType::integer, "tokens for the sampled history and the incoming turn",
     std::nullopt, 1, kMaxSlotsParam},
};

inline constexpr PolicySpec kIntervalLlmSpec{
    "interval_llm",
    "IntervalLLM (SirLLM's baseline, Yao et al. 2024): sinks + a strided history, before each turn",
    kIntervalLlmParams,
    [](int budget, int sinks) {
      return PolicyParams().set("sinks", sinks).set("budget", budget_after_sinks(budget, sinks));
    },
    [](const PolicyParams& params) {
      return make_interval_llm({params.get_int("sinks"), params.get_int("budget")});
    },
};

}  // namespace kvevict
