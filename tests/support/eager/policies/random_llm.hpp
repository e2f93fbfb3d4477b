// RandomLLM: attention sinks + a random subset of the history (baseline of SirLLM, Yao et al., ACL
// 2024, §4.1.1: "maintains the key-value states of the attention sink tokens as well as a random
// selection of historical tokens"; Table 1 runs it with 4 sinks and 508 slots, no recent window).
//
// Score: none. Keep rule, before a turn of n tokens with L cached and capacity sinks + budget: if
// L + n > capacity, keep slots [0, sinks) and budget - n history slots drawn uniformly without
// replacement from [sinks, L); otherwise keep everything. A turn longer than `budget` is an error.
// Trigger: before_turn (Signal::turn_boundaries), SirLLM's turn-level rule; nothing happens inside
// a turn. Granularity: one keep-set for all layers and heads (one draw per eviction).
// Positions: cache_index, as SirLLM. The authors released no code for the baselines: trigger and
// capacity rule are SirLLM's, with the random pick in place of the entropy top-k.
//
// Reproducibility: the draw uses std::mt19937_64 seeded with `seed` (its output sequence is fixed
// by the C++ standard) and kvevict's own unbiased bounded draw (std::uniform_int_distribution
// differs between standard libraries), so a seed gives the same keep-sets on every platform. The
// generator advances with each eviction: successive turns draw different subsets.
#pragma once

#include <cstdint>
#include <numeric>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include "eager/policies/detail/turn_eviction.hpp"
#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct RandomLlmConfig {
  int sinks = 4;           ///< S >= 0 first slots kept for ever
  int budget = 0;          ///< B > 0 slots for the sampled history (and the incoming turn)
  std::uint64_t seed = 0;  ///< seed of the std::mt19937_64 that draws the history subset
};

namespace detail {

/// Uniform integer in [0, bound), bound > 0. Rejects the raw draws below 2^64 mod bound, so that
/// the accepted range is a whole number of copies of [0, bound): no modulo bias.
inline std::uint64_t uniform_below(std::mt19937_64& engine, std::uint64_t bound) {
  const std::uint64_t threshold = (std::uint64_t{0} - bound) % bound;
  for (;;) {
    const std::uint64_t draw = engine();
    if (draw >= threshold) return draw % bound;
  }
}

}  // namespace detail

class RandomLlmPolicy final : public detail::SinkHistoryPolicy {
 public:
  explicit RandomLlmPolicy(const RandomLlmConfig& config)
      : SinkHistoryPolicy("random_llm", config.sinks, config.budget), engine_(config.seed) {}

  [[nodiscard]] std::string_view name() const override { return "random_llm"; }

 protected:
  void pick_history(int first, int last, int count, KeepSetBuilder& keep) override {
    // Partial Fisher-Yates: after step i, history_[0..i] is a uniform sample without replacement.
    history_.resize(static_cast<std::size_t>(last - first));
    std::iota(history_.begin(), history_.end(), first);
    const std::size_t size = history_.size();
    for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
      const std::size_t j = i + static_cast<std::size_t>(detail::uniform_below(engine_, size - i));
      std::swap(history_[i], history_[j]);
      keep.keep_range(history_[i], history_[i] + 1);
    }
  }

 private:
  std::mt19937_64 engine_;
  std::vector<int> history_;
};

}  // namespace kvevict::eager
