// KeyDiff's per-unit state (policies/key_scores.hpp): the unit vectors of the cached keys, their
// sum (the anchor's direction), and the scores against an earlier anchor that let a decision
// compute only a few scores exactly.
//
// The sum. Each component of a unit vector is rounded to a multiple of 2^-32 (kFixedScale) and
// summed as an integer, so adding a new key and removing an evicted one, in any order, gives the
// same bits as summing the cached keys afresh: the anchor is a function of the set of cached keys
// alone, kept in O(head_dim) per key rather than a pass over the cache per eviction. The rounding
// (under 2^-33 per key and component) is far below a float score's resolution.
//
// Reference scores. A score is y(t) = -(1/H) sum_h u_h(t) . a_h, a_h = s_h / ||s_h|| the
// normalised anchor of head h (H heads in the unit, ||u_h(t)|| <= 1). Scores computed against an
// earlier anchor b (the reference, c(t)) differ from today's by at most
// B = (1/H) sum_h ||a_h - b_h|| (Cauchy-Schwarz), plus rounding (kSlack). So if m is the lowest
// reference score among the candidates, the candidate with the lowest score today has
// c <= m + 2B, and every candidate with c > m + 2B scores strictly above it: today's scores of the
// tokens with c <= m + 2B alone name the token a pass over every score would evict. The lowest
// reference scores are kept sorted (`lowest`), with a bound under which no other live token's
// reference score lies (`above`), so those tokens are the front of that list.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace kvevict::detail {

/// Units of the sum per 1: a unit vector's component (|x| <= 1) is llround(x * 2^32), at most 2^32
/// in size, so 2^28 slots (SlotTable::kMaxCapacity) sum to under 2^61.
inline constexpr double kFixedScale = 4294967296.0;

/// llround(x * 2^32) (kFixedScale) for a finite float x, without a call: x * 2^32 is exact in a
/// double, and so is adding 0.5 of x's sign whenever the sum can reach the next integer (a float
/// has 24 significant bits, a double 53), so truncation rounds half away from zero, as llround.
[[nodiscard]] inline std::int64_t to_fixed(float x) {
  const double scaled = static_cast<double>(x) * kFixedScale;
  return static_cast<std::int64_t>(scaled + std::copysign(0.5, scaled));
}

/// ||key||^2, summed in double in order.
[[nodiscard]] inline double squared_norm(std::span<const float> key) {
  double sum = 0.0;
  for (const float x : key) sum += static_cast<double>(x) * x;
  return sum;
}

struct LowReference {
  float score = 0.0f;  ///< reference score
  std::int32_t slot = 0;
  std::int64_t original = 0;  ///< the token's original position (a later token may take the slot)

  /// The list's order: ascending reference score.
  [[nodiscard]] static bool by_score(const LowReference& a, const LowReference& b) {
    return a.score < b.score;
  }
};

struct KeyDirections {
  int heads = 0;
  int head_dim = 0;
  std::vector<float> rows;             ///< [slot][head][head_dim] unit vectors of the keys
  std::vector<std::uint8_t> counted;   ///< [slot * heads + head]: that piece is in `sum`
  std::vector<std::int64_t> sum;       ///< [head][head_dim] sum of the counted pieces, x 2^32
  int counted_nan = 0;                 ///< counted pieces holding a NaN (not in `sum`)
  std::vector<std::int32_t> unscored;  ///< slots written since the reference, one entry each

  // The unit as the last decision left it: its generation and eviction count before the decision,
  // and the slots it evicted (the largest original last): if the count has grown by exactly
  // those, they are the keys that left.
  std::uint64_t generation = 0;
  std::int64_t evictions = -1;  ///< -1: unknown, look at every slot
  std::vector<std::int32_t> decided;
  std::int64_t decided_last = 0;

  // The reference: the anchor the scores were last computed against (every key's then; each key
  // written since, against it, before the next decision).
  bool has_reference = false;
  std::vector<double> reference;                ///< [head][head_dim] the sum s then
  std::vector<double> reference_inverse_norms;  ///< [head] 1 / ||s_h|| then
  std::vector<LowReference> lowest;             ///< the lowest reference scores, ascending
  bool lowest_checked = true;  ///< false: `lowest` may name evicted tokens (unknown departures)
  float above = std::numeric_limits<float>::infinity();  ///< every other live token's c >= above

  [[nodiscard]] std::size_t row_floats() const {
    return static_cast<std::size_t>(heads) * static_cast<std::size_t>(head_dim);
  }
  [[nodiscard]] float* row(std::int32_t slot) {
    return rows.data() + static_cast<std::size_t>(slot) * row_floats();
  }

  void grow(int capacity) {
    const auto slots = static_cast<std::size_t>(capacity);
    if (rows.size() < slots * row_floats()) rows.resize(slots * row_floats());
    if (counted.size() < slots * static_cast<std::size_t>(heads)) {
      counted.resize(slots * static_cast<std::size_t>(heads));
    }
    sum.resize(row_floats());
  }

  /// Writes the unit vector of `key` (F.normalize: k / max(||k||, 1e-12)) as piece `head` of
  /// `slot`, in place of what the piece held.
  void write(std::int32_t slot, int head, std::span<const float> key) {
    const std::size_t piece = static_cast<std::size_t>(slot) * static_cast<std::size_t>(heads) +
                              static_cast<std::size_t>(head);
    float* out = row(slot) + static_cast<std::size_t>(head) * static_cast<std::size_t>(head_dim);
    if (counted[piece] != 0) count(slot, head, -1);
    const double scale = 1.0 / std::max(std::sqrt(squared_norm(key)), 1e-12);
    for (int d = 0; d < head_dim; ++d) out[d] = static_cast<float>(key[d] * scale);
    count(slot, head, +1);
    counted[piece] = 1;
    if (head == 0) unscored.push_back(slot);
  }

  /// Takes every piece of `slot` out of the sum (its token left).
  void forget(std::int32_t slot) {
    for (int h = 0; h < heads; ++h) {
      const std::size_t piece = static_cast<std::size_t>(slot) * static_cast<std::size_t>(heads) +
                                static_cast<std::size_t>(h);
      if (counted[piece] == 0) continue;
      count(slot, h, -1);
      counted[piece] = 0;
    }
  }

  /// Moves `from`'s pieces to `to` (a compaction), forgetting what `to` held.
  void move(std::int32_t from, std::int32_t to) {
    forget(to);
    std::copy_n(row(from), row_floats(), row(to));
    const auto h = static_cast<std::size_t>(heads);
    std::copy_n(counted.begin() + static_cast<std::ptrdiff_t>(from * h), h,
                counted.begin() + static_cast<std::ptrdiff_t>(to * h));
    std::fill_n(counted.begin() + static_cast<std::ptrdiff_t>(from * h), h, std::uint8_t{0});
  }

  /// The anchor's sum as doubles ([head][head_dim]; NaN when a counted key holds one) and each
  /// head's 1 / max(||s_h||, 1e-8) (cosine_similarity's eps: a zero anchor scores every key 0).
  void anchor(std::vector<double>& sums, std::vector<double>& inverse_norms) const {
    sums.resize(row_floats());
    for (std::size_t i = 0; i < sums.size(); ++i) {
      sums[i] = counted_nan > 0 ? std::numeric_limits<double>::quiet_NaN()
                                : static_cast<double>(sum[i]) / kFixedScale;
    }
    inverse_norms.resize(static_cast<std::size_t>(heads));
    for (int h = 0; h < heads; ++h) {
      double norm = 0.0;
      for (int d = 0; d < head_dim; ++d) {
        const double x = sums[static_cast<std::size_t>(h * head_dim + d)];
        norm += x * x;
      }
      inverse_norms[static_cast<std::size_t>(h)] = 1.0 / std::max(std::sqrt(norm), 1e-8);
    }
  }

 private:
  // Adds (sign +1) or removes (-1) piece `head` of `slot` to or from the sum.
  void count(std::int32_t slot, int head, int sign) {
    const std::size_t base = static_cast<std::size_t>(head) * static_cast<std::size_t>(head_dim);
    const float* piece = row(slot) + base;
    bool nan = false;
    for (int d = 0; d < head_dim; ++d) nan = nan || std::isnan(piece[d]);
    if (nan) {
      counted_nan += sign;
      return;
    }
    std::int64_t* out = sum.data() + base;
    for (int d = 0; d < head_dim; ++d) out[d] += sign * to_fixed(piece[d]);
  }
};

}  // namespace kvevict::detail
