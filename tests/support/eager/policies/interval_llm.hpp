// IntervalLLM: attention sinks + the history sampled at a fixed stride (baseline of SirLLM, Yao et
// al., ACL 2024, §4.1.1, after the strided pattern of Child et al. 2019: "uniformly samples tokens
// from the historical token sequence at fixed intervals ... interval = floor(history token length
// / cache size). This approach continues until the cache size is fully utilized"; Table 1 runs it
// with 4 sinks and 508 slots, no recent window).
//
// Score: none. Keep rule, before a turn of n tokens with L cached and capacity sinks + budget: if
// L + n > capacity, keep slots [0, sinks) and, with history h = L - sinks and room k = budget - n,
// the history slots sinks + i * floor(h / k) for i = 0 .. k-1, i.e. every stride-th slot from the
// oldest history token until the room is used; otherwise keep everything. A turn longer than
// `budget` is an error. Trigger: before_turn (Signal::turn_boundaries), SirLLM's turn-level rule.
// Granularity: one keep-set for all layers and heads. Positions: cache_index, as SirLLM.
// The authors released no code for the baselines. kvevict reads "history" as the non-sink slots
// and "cache size" as the room left for them after the incoming turn, and starts at the oldest
// history slot (the newest h - k * stride slots may fall outside the sample).
#pragma once

#include <string_view>

#include "eager/policies/detail/turn_eviction.hpp"
#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct IntervalLlmConfig {
  int sinks = 4;   ///< S >= 0 first slots kept for ever
  int budget = 0;  ///< B > 0 slots for the sampled history (and the incoming turn)
};

class IntervalLlmPolicy final : public detail::SinkHistoryPolicy {
 public:
  explicit IntervalLlmPolicy(const IntervalLlmConfig& config)
      : SinkHistoryPolicy("interval_llm", config.sinks, config.budget) {}

  [[nodiscard]] std::string_view name() const override { return "interval_llm"; }

 protected:
  void pick_history(int first, int last, int count, KeepSetBuilder& keep) override {
    if (count <= 0) return;
    // count < last - first, so the stride is >= 1 and count strides stay inside the history.
    const int stride = (last - first) / count;
    for (int i = 0; i < count; ++i) keep.keep_range(first + i * stride, first + i * stride + 1);
  }
};

}  // namespace kvevict::eager
