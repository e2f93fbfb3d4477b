// SirLLM: Streaming Infinite Retentive LLM (Yao et al., ACL 2024; Zoeyyao27/SirLLM).
//
// Score (column 0): token entropy e_i = -log P(x_i | x_0 .. x_{i-1}) (§3.2), read from
// Signal::surprisal when the token is processed, then multiplied by `decay` before every later
// turn (§3.3: "after each round of dialogue, the stored entropy cache E is multiplied by this
// decay ratio", so old key tokens fade and the memory does not go rigid).
// Keep rule, before a turn of n tokens with L cached and capacity sinks + recent + entropy
// (authors' kv_cache.py::evict_for_space_token_entropy): if L + n > capacity, keep the top
// entropy - n scores over all cached slots, sinks included (none if entropy - n <= 0; ties go to
// the lower slot), then the sinks [0, sinks), then the most recent slots until capacity - n are
// kept; otherwise keep everything. Then, evicted or not, every retained score is multiplied by
// `decay` (eval_utils.py: after each eviction call, from the second turn on); the incoming turn's
// scores are appended undecayed. A turn longer than recent + entropy is an error.
// Trigger: before_turn (Signal::turn_boundaries); nothing is evicted inside a turn, so a turn fed
// in several chunks (a response decoded token by token) grows the cache past the capacity until
// the next turn starts. Granularity: one keep-set for all layers and heads.
// Positions: cache_index (§3.3: the cache [0, 1, 2, 3, 5, 7, 11, 12] gets positions 0..7).
// Paper defaults: sinks 4, entropy 508 or 1020, recent 0, decay 0.5 to 1.0 (Table 1).
//
// Paper vs authors' code, and what kvevict does:
// - Algorithm 1 only says "Topk(E)" when the cache exceeds the pre-training length; the code
//   decides before each turn to make room for it, with k = entropy - n and the recent fill.
//   kvevict follows the code. The code's top-k is Python's stable sort: ties to the lower index.
// - Algorithm 1 decays right after appending the turn's scores; the code decays before the next
//   turn, after evicting. Both scale every score by the same factor before each top-k, so they
//   rank alike for decay > 0; at decay = 0 only the code's order keeps the last turn's scores.
//   kvevict follows the code.
// - The code shifts scores by one: token j gets the value of token j - 1, and the first token of a
//   turn gets the turn's maximum (eval_utils.py::_cal_selfinfo). Default: the paper's definition;
//   `shifted` reproduces the code's layout from the surprisal signal. (The code gathers each
//   position's log-probabilities at that position's own id, which no surprisal signal carries.)
// - The code asserts on a turn longer than recent + entropy only when an eviction is needed;
//   kvevict rejects every such turn, so the limit is a property of the configuration.
// - The code keeps scores as Python floats (double); kvevict stores float.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvevict/error.hpp>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "eager/policies/detail/turn_eviction.hpp"
#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct SirLlmConfig {
  int sinks = 4;         ///< S >= 0 first slots always kept
  int entropy = 0;       ///< E >= 0 slots for the highest-entropy tokens
  int recent = 0;        ///< R >= 0 slots for the newest tokens; E + R > 0
  double decay = 1.0;    ///< in [0, 1]; 1.0 keeps scores for ever (rigid memory)
  bool shifted = false;  ///< the authors' shifted scores instead of the paper's e_i
};

class SirLlmPolicy final : public Policy {
 public:
  explicit SirLlmPolicy(const SirLlmConfig& config) : config_(config) {
    KVEVICT_REQUIRE(config.sinks >= 0,
                    "sirllm: sinks must be >= 0, got " + std::to_string(config.sinks));
    KVEVICT_REQUIRE(config.entropy >= 0,
                    "sirllm: entropy must be >= 0, got " + std::to_string(config.entropy));
    KVEVICT_REQUIRE(config.recent >= 0,
                    "sirllm: recent must be >= 0, got " + std::to_string(config.recent));
    KVEVICT_REQUIRE(std::int64_t{config.entropy} + config.recent > 0,
                    "sirllm: entropy + recent must be positive (no room for a turn otherwise)");
    KVEVICT_REQUIRE(std::isfinite(config.decay) && config.decay >= 0.0 && config.decay <= 1.0,
                    "sirllm: decay must be in [0, 1], got " + std::to_string(config.decay));
    capacity_ = detail::checked_budget_sum(
        std::int64_t{config.sinks} + config.recent + config.entropy, "sirllm");
  }

  [[nodiscard]] std::string_view name() const override { return "sirllm"; }
  [[nodiscard]] SignalSet signals() const override {
    return {Signal::surprisal, Signal::turn_boundaries};
  }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::before_turn}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::cache_index;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override { return capacity_; }

  void observe_surprisal(SlotTable& slots, const ChunkInfo& chunk,
                         std::span<const float> surprisal) override {
    const int n = chunk.size();
    if (n == 0) return;
    // Shifted (authors' code): token k takes the value of token k - 1; the first token of a turn
    // (or of the stream) has no predecessor in its forward and takes the turn's maximum. A later
    // chunk of the same turn continues from the previous chunk's last value.
    float first = surprisal[0];
    if (config_.shifted) {
      first =
          (chunk.turn_start || !previous_surprisal_) ? maximum(surprisal) : *previous_surprisal_;
      previous_surprisal_ = surprisal[static_cast<std::size_t>(n - 1)];
    }
    for (int l = 0; l < slots.layers(); ++l) {
      for (int g = 0; g < slots.kv_heads(); ++g) {
        const std::span<float> scores = slots.scores(l, g, kEntropyColumn);
        KVEVICT_REQUIRE(static_cast<int>(scores.size()) >= n,
                        "sirllm: fewer slots than surprisal values in head (" + std::to_string(l) +
                            ", " + std::to_string(g) + ")");
        float* chunk_scores = scores.data() + (scores.size() - static_cast<std::size_t>(n));
        // Slot k of the chunk takes surprisal[k], or surprisal[k - 1] when shifted.
        const int shift = config_.shifted ? 1 : 0;
        chunk_scores[0] = first;
        for (int k = 1; k < n; ++k) {
          chunk_scores[k] = surprisal[static_cast<std::size_t>(k - shift)];
        }
      }
    }
  }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    if (context.trigger != Trigger::before_turn) return false;
    const int incoming = context.incoming;
    detail::require_turn_fits(incoming, config_.recent + config_.entropy, "sirllm",
                              "recent + entropy");
    SlotTable& slots = context.slots;
    const int live = detail::uniform_live_count(slots, "sirllm");
    bool changed = false;
    if (live + incoming > capacity_) {
      builder_.begin(live);
      // Ranked over all slots, sinks included (the authors rank the whole score list): a sink that
      // ranks here uses one of the entropy slots and the recent fill takes up the slack.
      builder_.keep_top_k(slots.scores(0, 0, kEntropyColumn), config_.entropy - incoming);
      builder_.keep_range(0, config_.sinks);
      builder_.keep_most_recent(capacity_ - incoming);
      changed = builder_.write(plan, 0, 0);
      detail::copy_keep_to_all_heads(plan);
    }
    // Evicted or not: the retained scores fade once per turn. Slots about to be dropped are scaled
    // too; the pipeline discards them with the plan.
    if (config_.decay != 1.0) decay_scores(slots);
    return changed;
  }

 private:
  static constexpr int kEntropyColumn = 0;

  /// Largest value; NaN if any value is NaN, so that the error surfaces at the next top-k.
  static float maximum(std::span<const float> values) {
    float result = -std::numeric_limits<float>::infinity();
    for (float value : values) {
      if (std::isnan(value)) return value;
      result = std::max(result, value);
    }
    return result;
  }

  void decay_scores(SlotTable& slots) const {
    for (int l = 0; l < slots.layers(); ++l) {
      for (int g = 0; g < slots.kv_heads(); ++g) {
        for (float& score : slots.scores(l, g, kEntropyColumn)) {
          // decay 0 forgets everything, an infinite surprisal (p = 0) included: 0 * inf is NaN.
          score = std::isinf(score) && config_.decay == 0.0
                      ? 0.0f
                      : static_cast<float>(static_cast<double>(score) * config_.decay);
        }
      }
    }
  }

  SirLlmConfig config_;
  int capacity_ = 0;
  KeepSetBuilder builder_;
  std::optional<float> previous_surprisal_;  // last value of the previous chunk (shifted mode)
};

}  // namespace kvevict::eager
