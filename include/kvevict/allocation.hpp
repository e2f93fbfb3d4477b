// Allocation: how one budget is split over the decision units of a sequence, as a piece apart from
// any score. A score-based policy decides *which* tokens of a unit are best; an allocation decides
// *how many* each unit keeps. Three rules, from the papers that showed the split matters:
//
//   uniform   every unit the same budget (every kvevict policy until now; SnapKV).
//   pyramid   a per-layer budget in an arithmetic sequence, largest at layer 0, whose mean is the
//             uniform budget (PyramidKV, Cai et al. 2024, arXiv 2406.02069; the schedule of
//             Zefan-Cai/KVCache-Factory PyramidKVCluster @c97f9d7): pyramid_budgets().
//   adaptive  the units of one layer share the layer's budget: the top scores across all of them
//             win, and each unit's share is mixed with a floor (Ada-KV, Feng et al. 2024, arXiv
//             2407.11550; FFY0/AdaKV AdaptiveSnapKVCluster @efe4e2e): adaptive_budgets().
//
// The functions are pure (numbers in, numbers out), so any policy that ranks tokens by a score per
// unit can take them: SnapKV, PyramidKV and Ada-KV do (policies/prompt_compression.hpp), and the
// `Allocated` decorator (policies/allocated.hpp, `--allocation`) hands the score columns of H2O,
// TOVA, K-norm and KeyDiff to the same functions. Nothing here knows about slots or attention.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/error.hpp"

namespace kvevict {

enum class Allocation : std::uint8_t { uniform, pyramid, adaptive };

[[nodiscard]] inline std::string_view to_string(Allocation allocation) {
  switch (allocation) {
    case Allocation::uniform:
      return "uniform";
    case Allocation::pyramid:
      return "pyramid";
    case Allocation::adaptive:
      return "adaptive";
  }
  return "?";
}

/// Parses "uniform", "pyramid" or "adaptive"; throws kvevict::Error naming the text otherwise.
[[nodiscard]] inline Allocation parse_allocation(std::string_view text) {
  for (const Allocation a : {Allocation::uniform, Allocation::pyramid, Allocation::adaptive}) {
    if (text == to_string(a)) return a;
  }
  throw Error("unknown allocation '" + std::string(text) +
              "' (expected uniform, pyramid or adaptive)");
}

/// Why a policy without a score rule (Policy::score_rule) cannot have a budget split over its
/// units, as every refusal says it after naming the policy.
inline constexpr std::string_view kNoScoreRule =
    "has no keep rule of the form \"protected plus the top k of one score column\" to split a "
    "budget over (h2o, tova, and knorm and keydiff at interval 1 have one; pyramidkv and adakv "
    "are SnapKV under the two allocations)";

/// `x` (finite, >= 0) rounded to the nearest integer, halves to even (torch.round), whatever the
/// floating-point rounding mode.
[[nodiscard]] inline int round_half_even(float x) {
  const float down = std::floor(x);
  const float fraction = x - down;
  const int base = static_cast<int>(down);
  if (fraction > 0.5f) return base + 1;
  if (fraction < 0.5f) return base;
  return base % 2 == 0 ? base : base + 1;
}

/// PyramidKV's per-layer budgets: `layers` (>= 2) budgets in an arithmetic sequence, layer 0 the
/// largest, with mean `mean` (>= 0), each at most `available` (the tokens a layer can choose from).
/// With `//` integer division: lo = mean // beta, hi = 2 mean - lo; if hi >= available then
/// hi = available and lo = 2 mean - available; step = (hi - lo) // (layers - 1), and layer l gets
/// hi - l * step. The clamp keeps hi + lo = 2 mean, so the budgets still average `mean` before the
/// step is floored; the floored step can make them sum to more than layers * mean (4 layers, mean
/// 16, beta 5: 29 + 21 + 13 + 5 = 68, not 64). Requires available >= mean (a layer can hold its
/// mean), which also keeps every budget >= 0. These are the authors' formulas (KVCache-Factory
/// PyramidKVCluster.update_kv), without their gating on the prompt length, which is PyramidKV's
/// own (policies/prompt_compression.hpp).
[[nodiscard]] inline std::vector<int> pyramid_budgets(int layers, int mean, int beta,
                                                      int available) {
  KVEVICT_REQUIRE(layers >= 2,
                  "pyramid allocation: needs at least 2 layers (the step divides by "
                  "layers - 1), got " +
                      std::to_string(layers));
  KVEVICT_REQUIRE(mean >= 0, "pyramid allocation: negative mean budget " + std::to_string(mean));
  KVEVICT_REQUIRE(beta >= 1, "pyramid allocation: beta must be >= 1, got " + std::to_string(beta));
  KVEVICT_REQUIRE(available >= mean, "pyramid allocation: " + std::to_string(available) +
                                         " tokens available, fewer than the mean budget " +
                                         std::to_string(mean));
  const std::int64_t twice = 2 * std::int64_t{mean};
  std::int64_t lo = mean / beta;
  std::int64_t hi = twice - lo;
  if (hi >= available) {
    hi = available;
    lo = twice - available;
  }
  const std::int64_t step = (hi - lo) / (layers - 1);
  std::vector<int> budgets(static_cast<std::size_t>(layers));
  for (int l = 0; l < layers; ++l)
    budgets[static_cast<std::size_t>(l)] = static_cast<int>(hi - l * step);
  return budgets;
}

/// PyramidKV's schedule under a budget that must hold: pyramid_budgets(layers, m, beta, no clamp)
/// at the largest m <= mean whose budgets sum to at most layers * mean (the floored step can hand
/// out more: 4 layers, mean 16, beta 5 give 29 + 21 + 13 + 5 = 68; m = 15 gives 27 + 19 + 11 + 3 =
/// 60). Decoding re-compression uses it (policies/prompt_compression.hpp), where no prompt length
/// is left to clamp to.
[[nodiscard]] inline std::vector<int> pyramid_budgets_within(int layers, int mean, int beta) {
  for (int m = mean; m > 0; --m) {
    const std::vector<int> budgets =
        pyramid_budgets(layers, m, beta, std::numeric_limits<int>::max());
    std::int64_t sum = 0;
    for (const int b : budgets) sum += b;
    if (sum <= std::int64_t{layers} * mean) return budgets;
  }
  return std::vector<int>(static_cast<std::size_t>(std::max(layers, 0)), 0);
}

namespace detail {
// The arguments of both adaptive splits below.
inline void check_adaptive_arguments(int mean, double floor) {
  KVEVICT_REQUIRE(mean >= 0, "adaptive allocation: negative mean budget " + std::to_string(mean));
  KVEVICT_REQUIRE(std::isfinite(floor) && floor >= 0.0 && floor <= 1.0,
                  "adaptive allocation: floor must be in [0, 1], got " + std::to_string(floor));
}
}  // namespace detail

/// Ada-KV's safeguarded split, for a split applied again and again: each unit first keeps its own
/// best min(f, candidates) with f = floor(floor * mean) (int(mean * floor), as the authors), then
/// the U * mean - (sum of those) best remaining candidates of all units win, whichever unit they
/// are in (ties: the older candidate, then the lower unit). Sums to min(U * mean, candidates)
/// exactly; a unit may have fewer candidates than `mean`. `scores[u]`: unit u's candidates, oldest
/// first. NaN scores are an error.
[[nodiscard]] inline std::vector<int> safeguarded_adaptive_budgets(
    std::span<const std::span<const float>> scores, int mean, double floor) {
  detail::check_adaptive_arguments(mean, floor);
  struct Entry {
    float score;
    std::int32_t index;
    std::int32_t unit;
  };
  const auto better = [](const Entry& a, const Entry& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.index != b.index) return a.index < b.index;
    return a.unit < b.unit;
  };
  const auto floor_count = static_cast<std::ptrdiff_t>(static_cast<double>(mean) * floor);
  std::vector<int> budgets(scores.size(), 0);
  std::vector<Entry> pool;
  std::vector<Entry> unit;
  for (std::size_t u = 0; u < scores.size(); ++u) {
    unit.clear();
    for (std::size_t i = 0; i < scores[u].size(); ++i) {
      KVEVICT_REQUIRE(!std::isnan(scores[u][i]), "adaptive allocation: score " + std::to_string(i) +
                                                     " of unit " + std::to_string(u) + " is NaN");
      unit.push_back({scores[u][i], static_cast<std::int32_t>(i), static_cast<std::int32_t>(u)});
    }
    const std::ptrdiff_t own = std::min(floor_count, static_cast<std::ptrdiff_t>(unit.size()));
    std::nth_element(unit.begin(), unit.begin() + own, unit.end(), better);
    budgets[u] = static_cast<int>(own);
    pool.insert(pool.end(), unit.begin() + own, unit.end());
  }
  std::int64_t rest = static_cast<std::int64_t>(scores.size()) * mean;
  for (const int b : budgets) rest -= b;
  if (rest < static_cast<std::int64_t>(pool.size())) {
    std::nth_element(pool.begin(), pool.begin() + rest, pool.end(), better);
    pool.resize(static_cast<std::size_t>(rest));
  }
  for (const Entry& winner : pool) ++budgets[static_cast<std::size_t>(winner.unit)];
  return budgets;
}

/// Ada-KV's per-unit budgets for the units of one layer. `scores[u]` are unit u's candidate
/// scores, oldest token first; `mean` (>= 0) is the uniform budget per unit, `floor` in [0, 1].
/// The U * mean highest scores over all units win (ties: the older token, then the lower unit),
/// n_u of them in unit u; unit u then keeps round((1 - floor) * n_u + f) with f = floor(floor *
/// mean), halves rounded to even, evaluated as the authors' torch code does: n_u times the float32
/// (1 - floor), rounded to float32, plus f, rounded to float32, then torch.round. The budgets need
/// not sum to U * mean (floor 0.2, mean 12: f = 2, and 0.4 per unit is lost), and a budget can
/// exceed a unit's candidates (the caller keeps all of them then). Requires mean <= the candidates
/// of every unit (the authors do not compress otherwise). NaN scores are an error.
[[nodiscard]] inline std::vector<int> adaptive_budgets(
    std::span<const std::span<const float>> scores, int mean, double floor) {
  detail::check_adaptive_arguments(mean, floor);
  struct Entry {
    float score;
    std::int32_t index;  // position in the unit's candidates (older first)
    std::int32_t unit;
  };
  std::vector<Entry> entries;
  for (std::size_t u = 0; u < scores.size(); ++u) {
    KVEVICT_REQUIRE(static_cast<int>(scores[u].size()) >= mean,
                    "adaptive allocation: unit " + std::to_string(u) + " has " +
                        std::to_string(scores[u].size()) + " candidates, fewer than the mean " +
                        "budget " + std::to_string(mean));
    for (std::size_t i = 0; i < scores[u].size(); ++i) {
      KVEVICT_REQUIRE(!std::isnan(scores[u][i]), "adaptive allocation: score " + std::to_string(i) +
                                                     " of unit " + std::to_string(u) + " is NaN");
      entries.push_back({scores[u][i], static_cast<std::int32_t>(i), static_cast<std::int32_t>(u)});
    }
  }
  const std::size_t winners = scores.size() * static_cast<std::size_t>(mean);
  const auto better = [](const Entry& a, const Entry& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.index != b.index) return a.index < b.index;
    return a.unit < b.unit;
  };
  if (winners < entries.size()) {
    std::nth_element(entries.begin(), entries.begin() + static_cast<std::ptrdiff_t>(winners),
                     entries.end(), better);
  }
  std::vector<int> counts(scores.size(), 0);
  for (std::size_t k = 0; k < std::min(winners, entries.size()); ++k) {
    ++counts[static_cast<std::size_t>(entries[k].unit)];
  }
  // The authors: floor_capacity = int(base * floor_ratio) in Python (double), then
  // torch.round(counts * (1 - floor_ratio) + floor_capacity) on a float32 tensor.
  const int floor_count = static_cast<int>(static_cast<double>(mean) * floor);
  const float keep_share = static_cast<float>(1.0 - floor);
  std::vector<int> budgets(scores.size());
  for (std::size_t u = 0; u < scores.size(); ++u) {
    const float share = static_cast<float>(counts[u]) * keep_share;
    const float mixed = share + static_cast<float>(floor_count);
    budgets[u] = round_half_even(mixed);
  }
  return budgets;
}

}  // namespace kvevict
