// RandomLLM: attention sinks + a random subset of the history (baseline of SirLLM, Yao et al., ACL
// 2024, §4.1.1: "maintains the key-value states of the attention sink tokens as well as a random
// selection of historical tokens"; Table 1 runs it with 4 sinks and 508 slots, no recent window).
//
// Score: none. Keep rule, before a turn of n tokens with L cached and capacity sinks + budget: if
// L + n > capacity, keep the first `sinks` tokens and budget - n history tokens drawn uniformly
// without replacement from the rest; otherwise keep everything (a HistorySampler inside a
// ProtectOldest(sinks)). A turn longer than `budget` is an error. Trigger: before_turn
// (Signal::turn_boundaries), SirLLM's turn-level rule; nothing happens inside a turn. Granularity:
// token (one draw per eviction). Positions: cache_index, as SirLLM. The authors released no code
// for the baselines: trigger and capacity rule are SirLLM's, with the random pick in place of the
// entropy top-k.
//
// Reproducibility: the draw uses the output sequence of std::mt19937_64 seeded with `seed` (fixed
// by the C++ standard; made a block at a time by detail::MersenneTwister64) and kvevict's own
// unbiased bounded draw (std::uniform_int_distribution differs between standard libraries), so a
// seed gives the same keep-sets on every platform. The generator advances with each eviction:
// successive turns draw different subsets.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "kvevict/policies/detail/mersenne_twister.hpp"
#include "kvevict/policies/detail/turn_eviction.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"

namespace kvevict {

struct RandomLlmConfig {
  int sinks = 4;           ///< S >= 0 first tokens kept for ever
  int budget = 0;          ///< B > 0 tokens for the sampled history (and the incoming turn)
  std::uint64_t seed = 0;  ///< seed of the std::mt19937_64 sequence that draws the history subset
};

namespace detail {

/// Uniform integer in [0, bound), bound > 0. Rejects the raw draws below 2^64 mod bound, so that
/// the accepted range is a whole number of copies of [0, bound): no modulo bias. That threshold is
/// below `bound`, so a draw of at least `bound` (all but a bound / 2^64 share) is accepted without
/// dividing for it.
template <class Engine>  // 64-bit outputs: std::mt19937_64, MersenneTwister64
std::uint64_t uniform_below(Engine& engine, std::uint64_t bound) {
  for (;;) {
    const std::uint64_t draw = engine();
    if (draw >= bound || draw >= (std::uint64_t{0} - bound) % bound) return draw % bound;
  }
}

}  // namespace detail

class RandomLlmPolicy final : public detail::HistorySampler {
 public:
  RandomLlmPolicy(int budget, std::uint64_t seed)
      : HistorySampler("random_llm", budget), engine_(seed) {}

  [[nodiscard]] std::string_view name() const override { return "random_llm"; }

 protected:
  void leave_out(std::span<const std::int32_t> history, int count,
                 std::vector<std::int32_t>& left_out) override {
    // Partial Fisher-Yates over history indices: after step i, picks_[0..i] is a uniform sample
    // without replacement, and the indices after the last step's are the ones not drawn.
    picks_.resize(history.size());
    std::iota(picks_.begin(), picks_.end(), std::int32_t{0});
    const std::size_t size = picks_.size();
    for (std::size_t i = 0; i < static_cast<std::size_t>(count); ++i) {
      const std::size_t j = i + static_cast<std::size_t>(detail::uniform_below(engine_, size - i));
      std::swap(picks_[i], picks_[j]);
    }
    left_out.assign(picks_.begin() + count, picks_.end());
    std::sort(left_out.begin(), left_out.end());
  }

 private:
  detail::MersenneTwister64 engine_;
  std::vector<std::int32_t> picks_;  // history indices (a unit holds < 2^28 slots)
};

/// RandomLlmPolicy with `sinks` protected first tokens, named "random_llm".
[[nodiscard]] inline std::unique_ptr<Policy> make_random_llm(const RandomLlmConfig& config) {
  return std::make_unique<ProtectOldest>(
      std::make_unique<RandomLlmPolicy>(config.budget, config.seed), config.sinks, "random_llm");
}

inline constexpr ParamSpec kRandomLlmParams[] = {
    {"sinks", ParamType::integer, "first tokens kept for ever", 4, 0, kMaxSlotsParam},
    {"budget", ParamType::integer, "tokens for the sampled history and the incoming turn",
     std::nullopt, 1, kMaxSlotsParam},
    {"seed", ParamType::integer, "seed of the draw (std::mt19937_64)", 0, 0, 9.0e15},
};

inline constexpr PolicySpec kRandomLlmSpec{
    "random_llm",
    "RandomLLM (SirLLM's baseline, Yao et al. 2024): sinks + a random history, before each turn",
    kRandomLlmParams,
    [](int budget, int sinks) {
      return PolicyParams().set("sinks", sinks).set("budget", budget_after_sinks(budget, sinks));
    },
    [](const PolicyParams& params) {
      return make_random_llm({params.get_int("sinks"), params.get_int("budget"),
                              static_cast<std::uint64_t>(params.get_real("seed"))});
    },
};

}  // namespace kvevict
