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
// `interval` I (default 1) is DecodingPress's `compression_steps` (NVIDIA/kvpress,
// presses/generation/decoding_press.py, default 10): each unit goes back to its budget after the
// forward in which I tokens have been appended since the last such forward (the count restarts
// there, evicting or not); between those, only a KV pool's grant evicts. A unit then holds at
// most budget + I - 1 tokens after any forward (retained_limit()), and one decision scores the
// keys once per I tokens rather than at every token.
// Positions: original (keys stored after RoPE, as in kvpress's cache).
// Granularity: per KV head (kvpress). A coarser unit (layer, token, block) scores a token by the
// mean over the unit's heads of each head's score (KeyDiff: each head against its own anchor).
//
// Signal: Signal::keys, the chunk's keys per layer (Sequence::observe_keys). K-norm keeps one float
// per slot. KeyDiff keeps every cached key's unit vector (head_dim floats per slot and head, as
// much memory as an f32 K cache), because its anchor moves with every eviction and the signal hands
// only the new keys. Its anchor's sum is kept as keys come and go, in fixed point, so that it is
// the same whatever the order (detail/key_directions.hpp). A decision that evicts one token
// scores only the keys whose scores against an earlier anchor lie within twice the anchor's move
// of the lowest (a bound, so the same token goes as if every key were scored); otherwise, or when
// too many keys lie that close, it scores every key (n x head_dim multiply-adds per unit,
// detail::score_rows) and that anchor becomes the reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/checked.hpp"
#include "kvevict/detail/key_directions.hpp"
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

// What K-norm and KeyDiff share: the keys signal, one score column, and the keep rule (the top
// `budget` unprotected tokens by score, after every forward). score_unit() brings a unit's column
// up to date before its selection, where the score depends on the whole cache (KeyDiff).
class KeyScoredPolicy : public Policy {
 public:
  KeyScoredPolicy(int budget, int interval, std::string_view name, ScoreTrend trend)
      : budget_(budget), interval_(interval), name_(name), worst_(trend) {
    KVEVICT_REQUIRE(budget >= 0,
                    std::string(name) + ": budget must be >= 0, got " + std::to_string(budget));
    KVEVICT_REQUIRE(interval >= 1, std::string(name) +
                                       ": interval must be >= 1 (1: decide after every forward), "
                                       "got " +
                                       std::to_string(interval));
    (void)checked_int(std::int64_t{budget} + interval - 1,
                      std::string(name) + ": budget + interval - 1");
  }

  [[nodiscard]] std::string_view name() const override { return name_; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::keys}; }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    return budget_ + interval_ - 1;
  }
  [[nodiscard]] bool supports_blocks() const override { return true; }
  [[nodiscard]] bool supports_pressure() const override { return true; }
  /// The rule an allocation splits: only when it decides after every forward (interval 1).
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override {
    if (interval_ > 1) return std::nullopt;
    return ScoreRule{kScore, budget_, {}};
  }
  void update_scores(SlotTable& slots, int unit) override { score_unit(slots, unit); }
  void on_append(SlotTable& /*slots*/, const ChunkInfo& chunk) override {
    appended_ += chunk.size();
  }

  void select(const EvictionContext& context, Decision& decision) override {
    SlotTable& slots = context.slots;
    // Back to the budget once `interval` tokens have come since the last time (the count restarts
    // there); otherwise no limit but a pool's grant.
    const bool due = appended_ >= interval_;
    if (due) appended_ = 0;
    for (int unit = 0; unit < slots.units(); ++unit) {
      const int keep = due ? context.keep(unit, budget_) : std::numeric_limits<int>::max();
      // Nothing to evict: no scores needed.
      if (slots.live(unit) <= std::min(keep, context.max_live)) continue;
      evict_unit(context, unit, keep, decision);
    }
  }

 protected:
  static constexpr int kScore = 0;

  [[nodiscard]] int interval() const { return interval_; }
  [[nodiscard]] WorstCandidates& worst() { return worst_; }

  // One unit over `keep` (or the pool's grant): its scores brought up to date, then the budget
  // rule.
  virtual void evict_unit(const EvictionContext& context, int unit, int keep, Decision& decision) {
    SlotTable& slots = context.slots;
    score_unit(slots, unit);
    (void)worst_.evict(slots, unit, context.protection, keep, slots.scores(unit, kScore), decision,
                       context.max_live);
  }
  virtual void score_unit(SlotTable& /*slots*/, int /*unit*/) {}

 private:
  int budget_;
  int interval_;
  std::int64_t appended_ = 0;  // tokens appended since the last decision that was due
  std::string_view name_;
  WorstCandidates worst_;
};

}  // namespace detail

/// K-norm's score and keep rule: the `budget` unprotected tokens of smallest key norm.
class KnormPolicy final : public detail::KeyScoredPolicy {
 public:
  // A token's score is written once, with its key.
  explicit KnormPolicy(int budget, int interval = 1)
      : KeyScoredPolicy(budget, interval, "knorm", ScoreTrend::never_falls) {}

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
  explicit KeyDiffPolicy(int budget, int interval = 1)
      : KeyScoredPolicy(budget, interval, "keydiff", ScoreTrend::any) {}

  // Keeps each new key's unit vector, in the unit's sum (detail/key_directions.hpp).
  void observe_keys(SlotTable& slots, int layer, const KeyRows& keys) override {
    const UnitLayout& layout = slots.layout();
    if (units_.empty()) {
      units_.resize(static_cast<std::size_t>(slots.units()));
      for (detail::KeyDirections& unit : units_) {
        unit.heads = layout.heads_per_unit();
        unit.head_dim = keys.head_dim();
      }
    }
    KVEVICT_REQUIRE(keys.head_dim() == units_.front().head_dim, "keydiff: the key length changed");
    for (int g = 0; g < keys.kv_heads(); ++g) {
      detail::KeyDirections& unit = units_[static_cast<std::size_t>(layout.unit_of(layer, g))];
      unit.grow(slots.capacity());
      const int head = detail::head_in_unit(layout, layer, g);
      for (int k = 0; k < keys.tokens(); ++k) unit.write(keys.slot(g, k), head, keys.key(g, k));
    }
  }

  void move_slots(int unit, std::span<const SlotMove> moves) override {
    if (units_.empty()) return;
    detail::KeyDirections& keys = units_[static_cast<std::size_t>(unit)];
    for (const SlotMove& move : moves) keys.move(move.from, move.to);
    keys.has_reference = false;  // its lists name slots
    keys.evictions = -1;
  }

  /// Units' decisions that evicted so far, and how many of them scored only the keys near the
  /// lowest reference score rather than every key.
  [[nodiscard]] std::int64_t decisions() const { return decisions_; }
  [[nodiscard]] std::int64_t decisions_from_reference() const { return decisions_from_reference_; }

  // From the reference scores when they can tell, else every key scored.
  void evict_unit(const EvictionContext& context, int unit, int keep, Decision& decision) override {
    SlotTable& slots = context.slots;
    detail::KeyDirections& keys = unit_keys(unit);
    take_anchor(slots, unit, keys);
    const bool from_reference = evict_from_reference(context, unit, keep, keys, decision);
    if (!from_reference) {
      score_every_key(slots, unit, keys);
      (void)worst().evict(slots, unit, context.protection, keep, slots.scores(unit, kScore),
                          decision, context.max_live);
    }
    // What this decision takes out: the sum drops those keys at the next one.
    const std::span<const std::int32_t> evicted = decision.evicted(unit);
    if (!evicted.empty()) {
      ++decisions_;
      decisions_from_reference_ += from_reference ? 1 : 0;
    }
    keys.decided.assign(evicted.begin(), evicted.end());
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    keys.decided_last = 0;
    for (const std::int32_t slot : evicted) {
      keys.decided_last = std::max(keys.decided_last, originals[static_cast<std::size_t>(slot)]);
    }
  }

 private:
  // Bounds the rounding of two scores (each a float of a value within 1e-14 of its formula's).
  static constexpr double kSlack = 1e-6;

  detail::KeyDirections& unit_keys(int unit) {
    KVEVICT_REQUIRE(!units_.empty(), "keydiff: no keys were observed");
    return units_[static_cast<std::size_t>(unit)];
  }

  // The unit's anchor now (anchor_, inverse_norms_), after taking the keys that left since its last
  // decision out of the sum: those the decision evicted if the unit's eviction count grew by
  // exactly them, else every counted key whose slot is no longer live.
  void take_anchor(const SlotTable& slots, int unit, detail::KeyDirections& keys) {
    const bool only_decided =
        keys.evictions >= 0 && slots.generation(unit) == keys.generation &&
        slots.evictions(unit) == keys.evictions + static_cast<std::int64_t>(keys.decided.size()) &&
        (keys.decided.empty() || slots.last_evicted(unit) == keys.decided_last);
    if (only_decided) {
      for (const std::int32_t slot : keys.decided) {
        if (!slots.is_live(unit, slot)) keys.forget(slot);  // else a new key took it
        // The evicted token's entry (a new token in its slot is not listed before its score).
        const auto listed =
            std::find_if(keys.lowest.begin(), keys.lowest.end(),
                         [slot](const detail::LowReference& entry) { return entry.slot == slot; });
        if (listed != keys.lowest.end()) keys.lowest.erase(listed);
      }
    } else {
      keys.lowest_checked = false;
      const auto written =
          static_cast<std::int32_t>(keys.counted.size() / static_cast<std::size_t>(keys.heads));
      for (std::int32_t slot = 0; slot < written; ++slot) {
        if (!slots.is_live(unit, slot)) keys.forget(slot);
      }
    }
    keys.generation = slots.generation(unit);
    keys.evictions = slots.evictions(unit);
    keys.decided.clear();
    keys.anchor(anchor_, inverse_norms_);
  }

  // score(t) = -mean over the unit's heads of cos(k_t, a) = -(u_t . s) / ||s||, where u_t is k_t's
  // unit vector and s the sum of the live u (the anchor a = s / n points the same way), for every
  // live key; they become the reference (detail/key_directions.hpp).
  void score_every_key(SlotTable& slots, int unit, detail::KeyDirections& keys) {
    const std::span<float> scores = slots.scores(unit, kScore);
    keys.grow(slots.capacity());
    // Every slot below the limit, live or not, in address order: the rows stream in from memory
    // (a free slot's score is never read).
    const int limit = slots.slot_limit(unit);
    while (static_cast<int>(every_slot_.size()) < limit) {
      every_slot_.push_back(static_cast<std::int32_t>(every_slot_.size()));
    }
    detail::score_rows(keys.rows.data(), keys.row_floats(), every_slot_.data(), limit, keys.heads,
                       keys.head_dim, anchor_.data(), inverse_norms_.data(), scores.data());
    keys.unscored.clear();
    // With an interval a decision evicts several tokens, which the reference never decides.
    if (interval() > 1) {
      keys.has_reference = false;
      return;
    }
    const StreamOrderPieces order = slots.stream_order_pieces(unit);
    keys.lowest_checked = true;
    keys.reference = anchor_;
    keys.reference_inverse_norms = inverse_norms_;
    // The lowest reference scores, sorted, and the lowest of the others.
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    keys.lowest.clear();
    bool nan = false;
    for (const std::span<const std::int32_t> piece : {order.front, order.back}) {
      for (const std::int32_t slot : piece) {
        const float score = scores[static_cast<std::size_t>(slot)];
        nan = nan || std::isnan(score);
        keys.lowest.push_back({score, slot, originals[static_cast<std::size_t>(slot)]});
      }
    }
    keys.has_reference = !nan;
    if (nan) return;  // the budget rule names it
    const std::size_t kept = std::min(keys.lowest.size(), kLowest + keys.lowest.size() / 32);
    keys.above = std::numeric_limits<float>::infinity();
    if (kept < keys.lowest.size()) {
      std::nth_element(keys.lowest.begin(), keys.lowest.begin() + static_cast<std::ptrdiff_t>(kept),
                       keys.lowest.end(), detail::LowReference::by_score);
      keys.above = keys.lowest[kept].score;
      keys.lowest.resize(kept);
    }
    std::sort(keys.lowest.begin(), keys.lowest.end(), detail::LowReference::by_score);
  }

  // One eviction from the reference scores (detail/key_directions.hpp): the tokens whose
  // reference score lies within 2B of the lowest candidate's are scored against today's anchor,
  // and the lowest of them goes (ties: the later original, as the budget rule). False when the
  // reference cannot decide (several to evict, blocks, flags, no or stale reference, too many
  // tokens within 2B): then every key is scored.
  bool evict_from_reference(const EvictionContext& context, int unit, int keep,
                            detail::KeyDirections& keys, Decision& decision) {
    const SlotTable& slots = context.slots;
    if (!keys.has_reference || keys.counted_nan > 0 || slots.layout().block_tokens() > 1 ||
        context.protection.flags != 0) {
      return false;
    }
    const WorstCandidates::Candidates chosen =
        WorstCandidates::candidates(slots, unit, context.protection, keep, context.max_live);
    const int live = chosen.order.size();
    if (chosen.count != 1 || keys.unscored.size() * 4 > static_cast<std::size_t>(live)) {
      return chosen.count == 0;
    }
    const std::span<float> scores = context.slots.scores(unit, kScore);
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    const auto is_gone = [&](const detail::LowReference& entry) {
      return !slots.is_live(unit, entry.slot) ||
             originals[static_cast<std::size_t>(entry.slot)] != entry.original;
    };
    if (!keys.lowest_checked) {
      keys.lowest.erase(std::remove_if(keys.lowest.begin(), keys.lowest.end(), is_gone),
                        keys.lowest.end());
      keys.lowest_checked = true;
    }
    // The keys written since, against the reference anchor.
    detail::score_rows(keys.rows.data(), keys.row_floats(), keys.unscored.data(),
                       static_cast<int>(keys.unscored.size()), keys.heads, keys.head_dim,
                       keys.reference.data(), keys.reference_inverse_norms.data(), scores.data());
    for (const std::int32_t slot : keys.unscored) {
      const detail::LowReference entry{scores[static_cast<std::size_t>(slot)], slot,
                                       originals[static_cast<std::size_t>(slot)]};
      if (is_gone(entry) || !(entry.score < keys.above)) continue;
      keys.lowest.insert(std::upper_bound(keys.lowest.begin(), keys.lowest.end(), entry,
                                          detail::LowReference::by_score),
                         entry);
    }
    keys.unscored.clear();
    // B: how far the scores can have moved since the reference.
    double bound = 0.0;
    for (int h = 0; h < keys.heads; ++h) {
      double squared = 0.0;
      for (int d = 0; d < keys.head_dim; ++d) {
        const auto i = static_cast<std::size_t>(h * keys.head_dim + d);
        const double moved =
            anchor_[i] * inverse_norms_[static_cast<std::size_t>(h)] -
            keys.reference[i] * keys.reference_inverse_norms[static_cast<std::size_t>(h)];
        squared += moved * moved;
      }
      bound += std::sqrt(squared);
    }
    bound = bound / keys.heads * (1.0 + 1e-6) + kSlack;
    // The candidates' originals lie in [oldest, newest] (the protected ends aside).
    const std::int64_t oldest = originals[static_cast<std::size_t>(chosen.order[chosen.first])];
    const std::int64_t newest = originals[static_cast<std::size_t>(chosen.order[chosen.last - 1])];
    near_.clear();
    double threshold = -1.0;  // m + 2B, once m is known
    for (const detail::LowReference& entry : keys.lowest) {
      if (entry.original < oldest || entry.original > newest) continue;
      if (near_.empty()) threshold = entry.score + 2.0 * bound;
      if (entry.score > threshold) break;
      near_.push_back(entry.slot);
    }
    if (near_.empty() || !(threshold < keys.above) ||
        near_.size() > 16 + static_cast<std::size_t>(live) / 16) {
      return false;
    }
    // Today's scores of those, the lowest of which goes.
    exact_.resize(static_cast<std::size_t>(slots.slot_limit(unit)));
    detail::score_rows(keys.rows.data(), keys.row_floats(), near_.data(),
                       static_cast<int>(near_.size()), keys.heads, keys.head_dim, anchor_.data(),
                       inverse_norms_.data(), exact_.data());
    std::int32_t worst = near_.front();
    for (const std::int32_t slot : near_) {
      const float score = exact_[static_cast<std::size_t>(slot)];
      const float worst_score = exact_[static_cast<std::size_t>(worst)];
      if (WorstCandidates::ranks_below(score, originals[static_cast<std::size_t>(slot)],
                                       worst_score, originals[static_cast<std::size_t>(worst)])) {
        worst = slot;
      }
    }
    decision.evict(unit, worst);
    return true;
  }

  void score_unit(SlotTable& slots, int unit) override {
    detail::KeyDirections& keys = unit_keys(unit);
    take_anchor(slots, unit, keys);
    score_every_key(slots, unit, keys);
  }

  // Reference scores kept sorted: this many plus one per 32 live tokens.
  static constexpr std::size_t kLowest = 64;

  std::vector<detail::KeyDirections> units_;
  std::vector<double> anchor_;            // [head in unit][head_dim] sum of unit vectors, today
  std::vector<double> inverse_norms_;     // [head in unit]
  std::vector<std::int32_t> near_;        // slots within 2B of the lowest reference score
  std::vector<float> exact_;              // [slot] today's scores of near_
  std::vector<std::int32_t> every_slot_;  // 0, 1, 2, ...
  std::int64_t decisions_ = 0;
  std::int64_t decisions_from_reference_ = 0;
};

struct KeyScoreConfig {
  int budget = 0;    ///< tokens kept per unit, recent included, > 0
  int recent = 0;    ///< newest tokens always kept, 0 <= recent < budget (kvevict's addition)
  int interval = 1;  ///< tokens between decisions, >= 1 (kvpress DecodingPress's compression_steps)
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
  auto scored = std::make_unique<Scored>(config.budget - config.recent, config.interval);
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
    {"interval", ParamType::integer,
     "back to the budget once per `interval` tokens (kvpress DecodingPress's compression_steps); "
     "1: after every forward",
     1, 1, kMaxSlotsParam},
};

inline constexpr PolicySpec kKnormSpec{
    "knorm",
    "K-norm (Devoto et al. 2024): the top `budget` by smallest key L2 norm; reads keys only",
    kKeyScoreParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("budget", budget); },
    [](const PolicyParams& params) {
      return make_knorm(
          {params.get_int("budget"), params.get_int("recent"), params.get_int("interval")});
    },
};

inline constexpr PolicySpec kKeyDiffSpec{
    "keydiff",
    "KeyDiff (Park et al. 2025): the top `budget` keys least similar to the mean normalised key",
    kKeyScoreParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("budget", budget); },
    [](const PolicyParams& params) {
      return make_keydiff(
          {params.get_int("budget"), params.get_int("recent"), params.get_int("interval")});
    },
};

}  // namespace kvevict
