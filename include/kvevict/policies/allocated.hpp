// Allocated: one budget for the whole sequence, split over its decision units by an allocation
// (kvevict/allocation.hpp), around any policy whose keep rule is "the protected slots plus the top
// `keep` of one score column per unit" (Policy::score_rule(): H2O, TOVA, K-norm, KeyDiff). The
// inner policy keeps its scoring and its protection; the decorator replaces each unit's `keep`
// with its share (EvictionContext::unit_keep) and the inner rule selects as before.
//
// The sequence budget. In tokens (AllocationConfig::budget_tokens: live tokens summed over every
// (layer, KV head)) or in bytes (budget_bytes: their keys and values in the engine's KV type,
// token_bytes per token and head, Q8_0 scales included). A unit of h heads costs h heads' rows per
// token, so the budget holds T = budget / (h * token_bytes) unit-tokens, M = T / U per unit on
// average (U units). Each unit keeps its protected set P (sinks + recent window) outside the split;
// the scored part S = T - U * P is split, m = S / U per unit on average. Without either budget the
// sequence budget is the policy's own: T = U * (P + keep), and `uniform` is then exactly the inner
// policy (every unit_keep equals its keep). Sequence wraps the policy when SequenceConfig asks for
// a budget or an allocation (engine.hpp), so engines set it there.
//
//   uniform   every unit keeps m.
//   pyramid   unit of layer l keeps pyramid_budgets(L, m', beta, no clamp)[l] (PyramidKV's
//             arithmetic schedule, layer 0 the largest), with m' the largest mean <= m whose
//             schedule fits in S: the authors' floored step can hand out more than L * m (their
//             4 layers, mean 16, beta 5 give 68 for 64), which a byte budget cannot take; m' is
//             m whenever it fits. The schedule is fixed: computed once.
//   adaptive  per layer, its H KV heads share H * m slots (Ada-KV). Each head first keeps its own
//             best f = floor(floor * m) candidates (Ada-KV's floor, int(m * floor) as the authors
//             compute it), then the H * m - (sum of those) best remaining candidates of the whole
//             layer win, whichever head they are in (ties: the older token, then the lower head).
//             Recomputed at every decision from the current scores. Needs granularity head.
//             The authors' code compresses once, at the prompt, and mixes winner counts with the
//             floor, round((1 - floor) * n + f), which hands out (1 - floor) * H * m + H * f <= H
//             * m slots (and up to H / 2 more by rounding); applied at every decode step, that mix
//             would shrink a heavy head by about floor * n - f tokens per step and drive every
//             head back to the uniform m. kvevict applies the paper's safeguard exactly instead
//             (the floor first, then the layer-wide top-k), which keeps the layer at H * m. The
//             authors' one-shot form is the `adakv` policy (policies/prompt_compression.hpp),
//             which the replay fixtures pin.
//
// A KV pool's pressure (EvictionContext::max_live) passes through: the inner rule keeps
// min(unit_keep, grant). Errors, before any work: no score rule, anchors (they accumulate beyond
// any budget), both budgets, a byte budget without token_bytes, a budget below one token per unit
// or not above the protected set, pyramid below per-layer units or with one layer, adaptive below
// per-head units, a floor outside [0, 1], beta < 1.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvevict/allocation.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/detail/row_passes.hpp"
#include "kvevict/error.hpp"
#include "kvevict/granularity.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/selection.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {

struct AllocationConfig {
  Allocation allocation = Allocation::uniform;
  /// Live tokens summed over every (layer, KV head); 0: budget_bytes, or the policy's own.
  std::int64_t budget_tokens = 0;
  /// Key and value bytes summed over every (layer, KV head); 0: budget_tokens, or the policy's own.
  std::int64_t budget_bytes = 0;
  /// Key + value bytes of one token of one KV head in the engine's KV type (a byte budget).
  std::int64_t token_bytes = 0;
  int beta = 20;       ///< pyramid: lo = m // beta, >= 1 (KVCache-Factory's default)
  double floor = 0.2;  ///< adaptive: each head's floor share, in [0, 1] (AdaKV's floor_alpha)
};

class Allocated final : public PolicyDecorator {
 public:
  /// `layout`: the sequence's units (Sequence passes its own).
  Allocated(std::unique_ptr<Policy> inner, const AllocationConfig& config, const UnitLayout& layout)
      : PolicyDecorator(std::move(inner), {}), config_(config), layout_(layout) {
    const std::string what = "allocation " + std::string(to_string(config.allocation)) +
                             ": policy '" + std::string(this->inner().name()) + "'";
    const std::optional<ScoreRule> rule = this->inner().score_rule();
    KVEVICT_REQUIRE(rule.has_value(), what + " " + std::string(kNoScoreRule));
    rule_ = *rule;
    KVEVICT_REQUIRE(rule_.protection.flags == 0,
                    what + " protects anchors, which accumulate beyond any sequence budget");
    KVEVICT_REQUIRE(config.budget_tokens >= 0 && config.budget_bytes >= 0,
                    what + ": a negative budget");
    KVEVICT_REQUIRE(config.budget_tokens == 0 || config.budget_bytes == 0,
                    what + ": give the sequence budget in tokens or in bytes, not both (" +
                        std::to_string(config.budget_tokens) + " tokens, " +
                        std::to_string(config.budget_bytes) + " bytes)");
    KVEVICT_REQUIRE(config.allocation != Allocation::pyramid || config.beta >= 1,
                    what + ": pyramid beta must be >= 1, got " + std::to_string(config.beta));
    KVEVICT_REQUIRE(
        config.allocation != Allocation::adaptive || (config.floor >= 0.0 && config.floor <= 1.0),
        what + ": adaptive floor must be in [0, 1], got " + number_text(config.floor));
    const std::int64_t units = layout.units();
    const std::int64_t heads_per_unit = layout.heads_per_unit();
    protected_ = rule_.protection.oldest + rule_.protection.newest;
    // T: the budget in unit-tokens.
    std::int64_t total = 0;
    std::string budget_text;
    if (config.budget_bytes > 0) {
      KVEVICT_REQUIRE(config.token_bytes > 0,
                      what +
                          ": a byte budget needs the bytes of one token's key and value "
                          "(SequenceConfig::token_bytes)");
      const std::int64_t row =
          checked_product({config.token_bytes, heads_per_unit}, "allocation: bytes per unit-token");
      total = config.budget_bytes / row;
      budget_text = std::to_string(config.budget_bytes) + " bytes (" + std::to_string(row) +
                    " per token of a unit)";
      KVEVICT_REQUIRE(total >= units,
                      what + ": a byte budget of " + budget_text + " is smaller than one row per " +
                          "unit: " + std::to_string(units) + " units need at least " +
                          std::to_string(units * row) + " bytes");
    } else if (config.budget_tokens > 0) {
      total = config.budget_tokens / heads_per_unit;
      budget_text = std::to_string(config.budget_tokens) + " tokens";
      KVEVICT_REQUIRE(total >= units, what + ": a budget of " + budget_text +
                                          " is smaller than one token per " + "unit (" +
                                          std::to_string(units * heads_per_unit) + " at least)");
    } else {
      total = units * (protected_ + rule_.keep);
      budget_text = "its own budget";
    }
    const std::int64_t per_unit = total / units;
    KVEVICT_REQUIRE(per_unit > protected_,
                    what + ": " + budget_text + " leaves " + std::to_string(per_unit) +
                        " tokens per unit, not more than the " + std::to_string(protected_) +
                        " it protects (sinks and recent window): nothing would be chosen by score");
    const std::int64_t scored = total - units * protected_;
    KVEVICT_REQUIRE(scored / units <= SlotTable::kMaxCapacity,
                    what + ": " + budget_text + " gives each unit more than " +
                        std::to_string(SlotTable::kMaxCapacity) + " slots");
    mean_ = static_cast<int>(scored / units);
    keep_.assign(static_cast<std::size_t>(units), mean_);
    switch (config.allocation) {
      case Allocation::uniform:
        break;
      case Allocation::pyramid:
        KVEVICT_REQUIRE(
            layout.granularity() == Granularity::head || layout.granularity() == Granularity::layer,
            what + " decides with granularity " + to_string(layout.granularity()) +
                ": pyramid gives every layer its own budget, so it needs per-layer "
                "or per-head units (granularity layer or head)");
        KVEVICT_REQUIRE(layout.layers() >= 2, what + ": pyramid needs at least 2 layers, got " +
                                                  std::to_string(layout.layers()));
        set_pyramid(scored);
        break;
      case Allocation::adaptive:
        KVEVICT_REQUIRE(layout.granularity() == Granularity::head,
                        what + " decides with granularity " + to_string(layout.granularity()) +
                            ": adaptive lets the KV heads of a layer compete for its budget, so "
                            "it needs one keep-set per KV head (granularity head" +
                            (this->inner().name() == "tova" ? "; tova: head_wise=1" : "") + ")");
        floor_count_ = static_cast<int>(static_cast<double>(mean_) * config.floor);
        unit_count_.assign(static_cast<std::size_t>(units), 0);
        break;
    }
  }

  [[nodiscard]] Allocation allocation() const { return config_.allocation; }
  /// The mean of the scored shares (m; pyramid: the schedule's m').
  [[nodiscard]] int mean() const { return mean_; }
  /// Tokens each unit protects besides its share (P).
  [[nodiscard]] int protected_per_unit() const { return protected_; }
  /// Each unit's share of the scored budget at the last decision (fixed for uniform and pyramid).
  [[nodiscard]] std::span<const int> unit_keep() const { return keep_; }

  [[nodiscard]] std::optional<int> retained_limit() const override {
    if (config_.allocation == Allocation::adaptive) {
      return checked_int(std::int64_t{layout_.kv_heads()} * mean_ + protected_,
                         "allocation: retained limit");
    }
    return *std::max_element(keep_.begin(), keep_.end()) + protected_;
  }
  [[nodiscard]] bool supports_blocks() const override {
    return config_.allocation == Allocation::uniform && inner().supports_blocks();
  }
  [[nodiscard]] bool uneven_shares() const override {
    return config_.allocation != Allocation::uniform;
  }
  /// The split is this decorator's: not a rule another allocation can wrap.
  [[nodiscard]] std::optional<ScoreRule> score_rule() const override { return std::nullopt; }

  void select(const EvictionContext& context, Decision& decision) override {
    if (config_.allocation == Allocation::adaptive && share_layers(context) &&
        context.max_live == std::numeric_limits<int>::max()) {
      // Every layer that evicts was split by its worst candidates (share_by_worst): restricted to
      // a head they are its lowest ranked beyond its share, the slots the inner rule would find
      // again with a scan of its own (Allocation.AdaptiveSplitMatchesTheRuleComputedFromScratch
      // checks the decisions against the rule from scratch).
      for (const Candidate& c : evictions_) decision.evict(c.unit, c.slot);
      return;
    }
    EvictionContext allocated = context;
    allocated.unit_keep = keep_;
    inner().select(allocated, decision);
  }

 private:
  // 1.5, not 1.500000.
  static std::string number_text(double value) {
    char text[32];
    (void)std::snprintf(text, sizeof text, "%g", value);
    return text;
  }

  struct Candidate {
    float score;
    std::int64_t original;
    std::int32_t unit;
    std::int32_t slot;
  };

  void set_pyramid(std::int64_t scored) {
    const int layers = layout_.layers();
    const std::int64_t units_per_layer = layout_.units() / layers;
    for (int mean = mean_; mean >= 0; --mean) {
      const std::vector<int> budgets =
          pyramid_budgets(layers, mean, config_.beta, std::numeric_limits<int>::max());
      std::int64_t sum = 0;
      for (const int b : budgets) sum += std::int64_t{b} * units_per_layer;
      if (sum > scored) continue;
      mean_ = mean;
      for (int unit = 0; unit < layout_.units(); ++unit) {
        keep_[static_cast<std::size_t>(unit)] =
            budgets[static_cast<std::size_t>(unit / units_per_layer)];
      }
      return;
    }
  }

  // Ada-KV's split of each layer's H * m slots over its heads, from the current scores.
  //
  // The rule: each head keeps its best f_u = min(f, candidates) (the floor), then the H * m -
  // sum(f_u) best of the rest of the layer win. When every head has at least f_u of its candidates
  // among the layer's H * m best, the floors lie inside those H * m (a head's share of the
  // layer's best is a prefix of its own ranking), so the winners are exactly the layer's H * m
  // best: each head keeps its candidates minus those among the layer's E = candidates - H * m
  // worst. At the steady state of a decode step E is the H new candidates, so one scan with a
  // buffer of E entries (share_by_worst) decides, as H2O's and TOVA's own one-eviction scan does;
  // the general rule (share_by_floors) runs when E is larger or a floor binds. Both give the same
  // shares. True when no layer needed the general rule: evictions_ then holds every eviction.
  bool share_layers(const EvictionContext& context) {
    SlotTable& slots = context.slots;
    Protection protection = context.protection;
    protection.oldest = std::max(protection.oldest, rule_.protection.oldest);
    protection.newest = std::max(protection.newest, rule_.protection.newest);
    protection.flags |= rule_.protection.flags;
    const int heads = layout_.kv_heads();
    bool by_worst = true;
    evictions_.clear();
    for (int layer = 0; layer < layout_.layers(); ++layer) {
      std::int64_t candidates = 0;
      for (int g = 0; g < heads; ++g) {
        const int unit = layout_.unit_of(layer, g);
        inner().update_scores(slots, unit);
        const int count = candidate_count(slots, unit, protection);
        unit_count_[static_cast<std::size_t>(unit)] = count;
        candidates += count;
      }
      const std::int64_t worst = candidates - std::int64_t{heads} * mean_;
      if (worst <= 0) {  // everything fits: every head keeps all its candidates
        for (int g = 0; g < heads; ++g) {
          const int unit = layout_.unit_of(layer, g);
          keep_[static_cast<std::size_t>(unit)] = unit_count_[static_cast<std::size_t>(unit)];
        }
        continue;
      }
      if (worst <= kWorstScan &&
          share_by_worst(slots, layer, protection, static_cast<int>(worst))) {
        evictions_.insert(evictions_.end(), worst_.begin(), worst_.end());
      } else {
        share_by_floors(slots, layer, protection);
        by_worst = false;
      }
    }
    return by_worst;
  }

  // The candidates of `unit`: live slots outside the protected ends and flags.
  [[nodiscard]] static int candidate_count(const SlotTable& slots, int unit,
                                           const Protection& protection) {
    const std::span<const std::int32_t> order = slots.stream_order(unit);
    const int live = static_cast<int>(order.size());
    const auto [first, last] = protection.unprotected(live);
    int count = last - first;
    if (protection.flags != 0) {
      const std::span<const std::uint8_t> flags = slots.flags(unit);
      for (int i = first; i < last; ++i) {
        if ((flags[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] &
             protection.flags) != 0)
          --count;
      }
    }
    return count;
  }

  // Calls visit(Candidate) for every candidate of `unit` (scores checked).
  template <class Visit>
  void for_each_candidate(const SlotTable& slots, int unit, const Protection& protection,
                          const Visit& visit) const {
    const std::span<const float> scores = slots.scores(unit, rule_.column);
    const std::span<const std::int32_t> order = slots.stream_order(unit);
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    const std::span<const std::uint8_t> flags = slots.flags(unit);
    const int live = static_cast<int>(order.size());
    const auto [first, last] = protection.unprotected(live);
    for (int i = first; i < last; ++i) {
      const std::int32_t slot = order[static_cast<std::size_t>(i)];
      if ((flags[static_cast<std::size_t>(slot)] & protection.flags) != 0) continue;
      const float score = scores[static_cast<std::size_t>(slot)];
      const std::int64_t original = originals[static_cast<std::size_t>(slot)];
      require_number(score, original);
      visit(Candidate{score, original, static_cast<std::int32_t>(unit), slot});
    }
  }

  // better(a, b): a ranks above b (higher score, then the older token, then the lower unit).
  [[nodiscard]] static bool better(const Candidate& a, const Candidate& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.original != b.original) return a.original < b.original;
    return a.unit < b.unit;
  }

  // The fast form (see share_layers): the layer's `worst` lowest candidates in one scan. False
  // when a head would keep fewer than its floor (the general rule decides then).
  bool share_by_worst(const SlotTable& slots, int layer, const Protection& protection, int worst) {
    worst_.clear();
    const auto lower = [](const Candidate& a, const Candidate& b) { return better(b, a); };
    float bound = std::numeric_limits<float>::infinity();  // the highest score in worst_, once full
    const int heads = layout_.kv_heads();
    std::uint32_t nan = 0;
    // Offers position i of `unit`'s stream order (a candidate but for its flags) to worst_, which
    // holds the lowest seen so far, lowest first.
    const auto offer = [&](int unit, int i) {
      const std::int32_t slot = slots.stream_order(unit)[static_cast<std::size_t>(i)];
      if (protection.flags != 0 &&
          (slots.flags(unit)[static_cast<std::size_t>(slot)] & protection.flags) != 0)
        return;
      const float score = slots.scores(unit, rule_.column)[static_cast<std::size_t>(slot)];
      nan |= detail::nan_flag(score);
      const Candidate c{score, slots.original_positions(unit)[static_cast<std::size_t>(slot)],
                        static_cast<std::int32_t>(unit), slot};
      if (static_cast<int>(worst_.size()) == worst) {
        if (!better(worst_.back(), c)) return;
        worst_.pop_back();
      }
      worst_.insert(std::upper_bound(worst_.begin(), worst_.end(), c, lower), c);
      if (static_cast<int>(worst_.size()) == worst) bound = worst_.back().score;
    };
    for (int g = 0; g < heads; ++g) {  // read in order first, then gathered (row_passes.hpp)
      const int unit = layout_.unit_of(layer, g);
      const std::span<const std::int32_t> order = slots.stream_order(unit);
      const std::span<const float> scores = slots.scores(unit, rule_.column);
      detail::stream_into_cache(order.data(), order.size_bytes());
      detail::stream_into_cache(scores.data(), scores.size_bytes());
    }
    // Each head's newest candidates first, newest to oldest: under an accumulated score (H2O)
    // they rank lowest, so the bound is tight before the older ones are scanned, which then rarely
    // stop the vector skip (scanned oldest first, each new lowest would). The order changes
    // nothing found: `better` is a strict total order.
    for (const bool newest : {true, false}) {
      for (int g = 0; g < heads; ++g) {
        const int unit = layout_.unit_of(layer, g);
        const int live = slots.live(unit);
        const auto [first, last] = protection.unprotected(live);
        const int split = std::max(first, last - kNewestFirst);
        const std::span<const float> scores = slots.scores(unit, rule_.column);
        const std::span<const std::int32_t> order = slots.stream_order(unit);
        if (newest) {
          for (int i = last - 1; i >= split; --i) {
            // `> bound` skips neither NaN (flagged in offer) nor an equal score (ties by position).
            if (!(scores[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] > bound))
              offer(unit, i);
          }
          continue;
        }
        for (int i = first; i < split; ++i) {
          // Most candidates rank above all of worst_ and are skipped at the CPU's vector width (a
          // score above the bound is neither NaN nor kept).
          i = detail::first_not_above(order.data(), i, split, scores.data(), bound);
          if (i == split) break;
          offer(unit, i);
        }
      }
    }
    if (nan != 0) {  // name the first NaN's position (for_each_candidate checks every score)
      for (int g = 0; g < heads; ++g) {
        for_each_candidate(slots, layout_.unit_of(layer, g), protection, [](const Candidate&) {});
      }
    }
    for (int g = 0; g < heads; ++g) {
      const int unit = layout_.unit_of(layer, g);
      keep_[static_cast<std::size_t>(unit)] = unit_count_[static_cast<std::size_t>(unit)];
    }
    for (const Candidate& c : worst_) --keep_[static_cast<std::size_t>(c.unit)];
    for (int g = 0; g < heads; ++g) {
      const int unit = layout_.unit_of(layer, g);
      const int floor = std::min(floor_count_, unit_count_[static_cast<std::size_t>(unit)]);
      if (keep_[static_cast<std::size_t>(unit)] < floor) return false;
    }
    return true;
  }

  // The general rule: each head's floor first, then the layer's best of the rest.
  void share_by_floors(const SlotTable& slots, int layer, const Protection& protection) {
    pool_.clear();
    std::int64_t floors = 0;
    const int heads = layout_.kv_heads();
    for (int g = 0; g < heads; ++g) {
      const int unit = layout_.unit_of(layer, g);
      unit_candidates_.clear();
      for_each_candidate(slots, unit, protection,
                         [&](const Candidate& c) { unit_candidates_.push_back(c); });
      const int floor = std::min(floor_count_, static_cast<int>(unit_candidates_.size()));
      std::nth_element(unit_candidates_.begin(), unit_candidates_.begin() + floor,
                       unit_candidates_.end(), better);
      pool_.insert(pool_.end(), unit_candidates_.begin() + floor, unit_candidates_.end());
      keep_[static_cast<std::size_t>(unit)] = floor;
      floors += floor;
    }
    const std::int64_t rest = std::int64_t{heads} * mean_ - floors;
    if (rest < static_cast<std::int64_t>(pool_.size())) {
      std::nth_element(pool_.begin(), pool_.begin() + rest, pool_.end(), better);
      pool_.resize(static_cast<std::size_t>(rest));
    }
    for (const Candidate& winner : pool_) ++keep_[static_cast<std::size_t>(winner.unit)];
  }

  // Up to this many evictions in a layer, the one-scan form (a decode step evicts H).
  static constexpr std::int64_t kWorstScan = 16;
  // share_by_worst scans each head's newest this many candidates first.
  static constexpr int kNewestFirst = 64;

  AllocationConfig config_;
  UnitLayout layout_;
  ScoreRule rule_;
  int protected_ = 0;
  int mean_ = 0;
  int floor_count_ = 0;
  std::vector<int> keep_;  // [units] each unit's scored share
  std::vector<Candidate> unit_candidates_;
  std::vector<Candidate> pool_;
  std::vector<Candidate> worst_;
  std::vector<Candidate> evictions_;  // share_layers by worst: every layer's worst_
  std::vector<int> unit_count_;       // [units] candidates at the current decision
};

}  // namespace kvevict
