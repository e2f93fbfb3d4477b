// Policies scored from the keys alone, no attention read: they run with any attention kernel (flash
// attention included) and cost no softmax.
//
// K-norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
// Compression", arXiv 2406.11430; reference code NVIDIA/kvpress KnormPress @8bb29b9).
//   Score: -||k||_2 of each cached key: the paper finds low key norms go with high attention, so
//   the smallest norms stay. Computed once, when the key is written (a rotation keeps the norm).
//
// KeyDiff (Park et al. 2025, arXiv 2504.15364; reference code NVIDIA/kvpress KeyDiffPress
// @8bb29b9).
//   Score: -cos(k, a), a = the mean of the unit-normalised cached keys of the head (kvpress:
//   F.normalize(keys).mean, not the mean of the raw keys), recomputed from the cache as it stands
//   at every eviction: the keys least similar to the anchor (the most distinctive) stay.
//
// Keep rule (both): when a unit holds more than `budget` tokens, keep `budget`: the newest `recent`
// tokens (kvevict's addition, a ProtectNewest around the policy; kvpress protects nothing) and the
// top scores among the rest, ties to the lower position. The token just fed can be dropped at once.
// Trigger: after every forward, the prompt included (kvpress's DecodingPress with interval 1,
// extended to the prompt, as ../shared/replay-format.md "Key scores" states; the paper's KeyDiff
// evicts after each block of the prompt, which is this trigger with block-sized chunks).
// Positions: original (keys stored after RoPE, as in kvpress's cache).
// Granularity: per KV head (kvpress). A coarser unit (layer, token, block) scores a token by the
// mean over the unit's heads of each head's score (KeyDiff: each head against its own anchor).
//
// Signal: Signal::keys, the chunk's keys per layer (Sequence::observe_keys). K-norm keeps one float
// per slot. KeyDiff keeps every cached key's unit vector (head_dim floats per slot and head, as
// much memory as an f32 K cache), because its anchor moves with every eviction and the signal hands
// only the new keys; its selection reads those vectors twice per unit, in stream order: the
// anchor's sum, then n x head_dim multiply-adds for the scores, eight slots' sums at a time
// (detail::add_rows_in_order, detail::score_rows_in_order).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/detail/row_passes.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

namespace detail {

// Which of a unit's heads (layer, kv_head) is: 0 per head, the KV head per layer, layer-major over
// the whole sequence per token / block.
[[nodiscard]] inline int head_in_unit(const UnitLayout& layout, int layer, int kv_head) {
  if (layout.heads_per_unit() == 1) return 0;
  return layout.layers_per_unit() > 1 ? layer * layout.kv_heads() + kv_head : kv_head;
}

[[nodiscard]] inline double squared_norm(std::span<const float> key) {
  double sum = 0.0;
  for (const float x : key) sum += static_cast<double>(x) * x;
  return sum;
}

}  // namespace detail

namespace detail {

// What K-norm and KeyDiff share: the keys signal, one score column, and the keep rule (the top
// `budget` unprotected tokens by score, after every forward). score_unit() brings a unit's column
// up to date before its selection, where the score depends on the whole cache (KeyDiff).
class KeyScoredPolicy : public Policy {
 public:
  KeyScoredPolicy(int budget, std::string_view name, ScoreTrend trend)
      : budget_(budget), name_(name), worst_(trend) {
    KVEVICT_REQUIRE(budget >= 0,
                    std::string(name) + ": budget must be >= 0, got " + std::to_string(budget));
  }

  [[nodiscard]] std::string_view name() const override { return name_; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::keys}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] std::optional<int> retained_limit() const override { return budget_; }
  [[nodiscard]] bool supports_blocks() const override { return true; }
  [[nodiscard]] bool supports_pressure() const override { return true; }
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    return ScoreRule{kScore, budget_, {}};
  }
  void update_scores(SlotTable& slots, int unit) override { score_unit(slots, unit); }

  void select(const EvictionContext& context, Decision& decision) override {
    SlotTable& slots = context.slots;
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int keep = context.keep(unit, budget_);
      // Nothing to evict: no scores needed.
      if (slots.live(unit) <= std::min(keep, context.max_live)) continue;
      score_unit(slots, unit);
      (void)worst_.evict(slots, unit, context.protection, keep, slots.scores(unit, kScore),
                         decision, context.max_live);
    }
  }

 protected:
  static constexpr int kScore = 0;

  virtual void score_unit(SlotTable& /*slots*/, int /*unit*/) {}

 private:
  int budget_;
  std::string_view name_;
  WorstCandidates worst_;
};

}  // namespace detail

/// K-norm's score and keep rule: the `budget` unprotected tokens of smallest key norm.
class KnormPolicy final : public detail::KeyScoredPolicy {
 public:
  // A token's score is written once, with its key.
  explicit KnormPolicy(int budget) : KeyScoredPolicy(budget, "knorm", ScoreTrend::never_falls) {}

  // -||k|| of each new token, averaged over the unit's heads (one head per unit: exactly -||k||).
  void observe_keys(SlotTable& slots, int layer, const KeyRows& keys) override {
    const UnitLayout& layout = slots.layout();
    const double weight = 1.0 / layout.heads_per_unit();
    for (int g = 0; g < keys.kv_heads(); ++g) {
      const std::span<float> score = slots.scores(layout.unit_of(layer, g), kScore);
      for (int k = 0; k < keys.tokens(); ++k) {
        score[static_cast<std::size_t>(keys.slot(g, k))] -=
            static_cast<float>(weight * std::sqrt(detail::squared_norm(keys.key(g, k))));
      }
    }
  }
};

/// KeyDiff's score and keep rule: the `budget` unprotected tokens least similar to the mean of the
/// normalised cached keys.
class KeyDiffPolicy final : public detail::KeyScoredPolicy {
 public:
  explicit KeyDiffPolicy(int budget) : KeyScoredPolicy(budget, "keydiff", ScoreTrend::any) {}

  // Keeps each new key's unit vector at [unit][slot][head in unit][head_dim].
  void observe_keys(SlotTable& slots, int layer, const KeyRows& keys) override {
    const UnitLayout& layout = slots.layout();
    if (directions_.empty()) {
      head_dim_ = keys.head_dim();
      directions_.resize(static_cast<std::size_t>(slots.units()));
    }
    KVEVICT_REQUIRE(keys.head_dim() == head_dim_, "keydiff: the key length changed");
    const std::size_t per_slot = per_slot_floats(layout);
    directions_per_slot_ = per_slot;
    for (int g = 0; g < keys.kv_heads(); ++g) {
      const int unit = layout.unit_of(layer, g);
      std::vector<float>& directions = directions_[static_cast<std::size_t>(unit)];
      if (directions.size() < static_cast<std::size_t>(slots.capacity()) * per_slot) {
        directions.resize(static_cast<std::size_t>(slots.capacity()) * per_slot);
      }
      const std::size_t head = static_cast<std::size_t>(detail::head_in_unit(layout, layer, g));
      for (int k = 0; k < keys.tokens(); ++k) {
        const std::span<const float> key = keys.key(g, k);
        // F.normalize: k / max(||k||, 1e-12).
        const double scale = 1.0 / std::max(std::sqrt(detail::squared_norm(key)), 1e-12);
        float* out = directions.data() + static_cast<std::size_t>(keys.slot(g, k)) * per_slot +
                     head * static_cast<std::size_t>(head_dim_);
        for (int d = 0; d < head_dim_; ++d) out[d] = static_cast<float>(key[d] * scale);
      }
    }
  }

  void move_slots(int unit, std::span<const SlotMove> moves) override {
    if (directions_.empty()) return;
    std::vector<float>& directions = directions_[static_cast<std::size_t>(unit)];
    const std::size_t per_slot = directions_per_slot_;
    for (const SlotMove& move : moves) {
      const float* from = directions.data() + static_cast<std::size_t>(move.from) * per_slot;
      std::copy_n(from, per_slot, directions.data() + static_cast<std::size_t>(move.to) * per_slot);
    }
  }

 private:
  [[nodiscard]] std::size_t per_slot_floats(const UnitLayout& layout) const {
    return static_cast<std::size_t>(layout.heads_per_unit()) * static_cast<std::size_t>(head_dim_);
  }

  // score(t) = -mean over the unit's heads of cos(k_t, a) = -(u_t . s) / ||s||, where u_t is k_t's
  // unit vector and s the sum of the live u (the anchor a = s / n points the same way).
  void score_unit(SlotTable& slots, int unit) override {
    KVEVICT_REQUIRE(!directions_.empty(), "keydiff: no keys were observed");
    const UnitLayout& layout = slots.layout();
    const std::size_t per_slot = per_slot_floats(layout);
    const std::vector<float>& directions = directions_[static_cast<std::size_t>(unit)];
    const std::span<const std::int32_t> order = slots.stream_order(unit);
    const int live = static_cast<int>(order.size());
    anchor_.assign(per_slot, 0.0);
    detail::add_rows_in_order(directions.data(), per_slot, order.data(), live, anchor_.data());
    const int heads = layout.heads_per_unit();
    inverse_norms_.assign(static_cast<std::size_t>(heads), 0.0);
    for (int h = 0; h < heads; ++h) {
      const std::span<const double> s(anchor_.data() + static_cast<std::size_t>(h) * head_dim_,
                                      static_cast<std::size_t>(head_dim_));
      double norm = 0.0;
      for (const double x : s) norm += x * x;
      // cosine_similarity's eps: a zero anchor makes every score 0 (ties go to the lower position).
      inverse_norms_[static_cast<std::size_t>(h)] = 1.0 / std::max(std::sqrt(norm), 1e-8);
    }
    detail::score_rows_in_order(directions.data(), per_slot, order.data(), live, heads, head_dim_,
                                anchor_.data(), inverse_norms_.data(),
                                slots.scores(unit, kScore).data());
  }

  int head_dim_ = 0;
  std::size_t directions_per_slot_ = 0;
  std::vector<std::vector<float>> directions_;  // [unit][slot][head in unit][head_dim]
  std::vector<double> anchor_;                  // [head in unit][head_dim] sum of unit vectors
  std::vector<double> inverse_norms_;           // [head in unit]
};

struct KeyScoreConfig {
  int budget = 0;  ///< tokens kept per unit, recent included, > 0
  int recent = 0;  ///< newest tokens always kept, 0 <= recent < budget (kvevict's addition)
};

namespace detail {
template <class Scored>
[[nodiscard]] std::unique_ptr<Policy> make_key_scored(const KeyScoreConfig& config,
                                                      const char* name) {
  KVEVICT_REQUIRE(config.budget > 0, std::string(name) + ": budget must be positive, got " +
                                         std::to_string(config.budget));
  KVEVICT_REQUIRE(config.recent >= 0, std::string(name) + ": recent must be >= 0, got " +
                                          std::to_string(config.recent));
  KVEVICT_REQUIRE(config.recent < config.budget,
                  std::string(name) + ": budget " + std::to_string(config.budget) +
                      " is not larger than the protected recent window (" +
                      std::to_string(config.recent) + "): no slot would be chosen by its keys");
  auto scored = std::make_unique<Scored>(config.budget - config.recent);
  if (config.recent == 0) return scored;
  return std::make_unique<ProtectNewest>(std::move(scored), config.recent, name);
}
}  // namespace detail

/// K-norm with `recent` newest tokens counted inside the budget, named "knorm".
[[nodiscard]] inline std::unique_ptr<Policy> make_knorm(const KeyScoreConfig& config) {
  return detail::make_key_scored<KnormPolicy>(config, "knorm");
}
/// KeyDiff with `recent` newest tokens counted inside the budget, named "keydiff".
[[nodiscard]] inline std::unique_ptr<Policy> make_keydiff(const KeyScoreConfig& config) {
  return detail::make_key_scored<KeyDiffPolicy>(config, "keydiff");
}

inline constexpr ParamSpec kKeyScoreParams[] = {
    {"budget", ParamType::integer, "tokens kept, recent included", std::nullopt, 1, kMaxSlotsParam},
    {"recent", ParamType::integer, "newest tokens always kept, inside the budget", 0, 0,
     kMaxSlotsParam},
};

inline constexpr PolicySpec kKnormSpec{
    "knorm",
    "K-norm (Devoto et al. 2024): the top `budget` by smallest key L2 norm; reads keys only",
    kKeyScoreParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("budget", budget); },
    [](const PolicyParams& params) {
      return make_knorm({params.get_int("budget"), params.get_int("recent")});
    },
};

inline constexpr PolicySpec kKeyDiffSpec{
    "keydiff",
    "KeyDiff (Park et al. 2025): the top `budget` keys least similar to the mean normalised key",
    kKeyScoreParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("budget", budget); },
    [](const PolicyParams& params) {
      return make_keydiff({params.get_int("budget"), params.get_int("recent")});
    },
};

}  // namespace kvevict
