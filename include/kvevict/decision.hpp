// A policy's decision: the slots to evict per decision unit. What the engine receives once kvevict
// has applied it is an AppliedDecision (engine.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvevict/granularity.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/signals.hpp"

namespace kvevict {

/// Slots to evict, per decision unit. Buffers are reused: clear() allocates nothing.
class Decision {
 public:
  void reset(int units) {
    evicted_.resize(static_cast<std::size_t>(units));
    clear();
  }
  void clear() {
    for (std::vector<std::int32_t>& slots : evicted_) slots.clear();
  }
  [[nodiscard]] int units() const { return static_cast<int>(evicted_.size()); }

  /// Marks live slot `slot` of `unit` for eviction.
  void evict(int unit, std::int32_t slot) {
    evicted_[static_cast<std::size_t>(unit)].push_back(slot);
  }
  [[nodiscard]] std::span<const std::int32_t> evicted(int unit) const {
    return evicted_[static_cast<std::size_t>(unit)];
  }
  /// True when no unit evicts anything.
  [[nodiscard]] bool empty() const {
    for (const std::vector<std::int32_t>& slots : evicted_) {
      if (!slots.empty()) return false;
    }
    return true;
  }

 private:
  std::vector<std::vector<std::int32_t>> evicted_;  // [unit] slots
};

}  // namespace kvevict
