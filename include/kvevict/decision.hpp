// A policy's decision and what an engine receives when it is applied.
//
// Decision: what the policy wrote, the slots to evict per decision unit. AppliedDecision: what the
// engine's KvBackend receives in one call once kvevict has updated its metadata: the evicted slots
// (with the positions they had) and the stored keys to re-rotate, both per unit; the heads of a
// unit are layout().unit_of(layer, kv_head).
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

/// One evicted token as the engine sees it.
struct EvictedSlot {
  std::int32_t slot = 0;
  std::int64_t original_position = 0;
  std::int64_t position = 0;  ///< its RoPE position just before the decision
};

/// Stored post-RoPE keys of `slots` (one unit) to rotate by `delta` positions.
struct KeyRotation {
  int unit = 0;
  std::int64_t delta = 0;
  std::span<const std::int32_t> slots;
};

/// A decision as kvevict applied it, handed to the engine's KvBackend in one call.
class AppliedDecision {
 public:
  Trigger trigger = Trigger::after_forward;
  PositionMode position_mode = PositionMode::original;
  UnitLayout layout;

  /// Tokens evicted from `unit`, oldest first. Their slots are free from now on.
  [[nodiscard]] std::span<const EvictedSlot> evicted(int unit) const {
    const auto u = static_cast<std::size_t>(unit);
    return std::span<const EvictedSlot>(evicted_).subspan(
        evicted_begin_[u], evicted_begin_[u + 1] - evicted_begin_[u]);
  }
  /// Tokens evicted from the unit of head (layer, kv_head).
  [[nodiscard]] std::span<const EvictedSlot> evicted(int layer, int kv_head) const {
    return evicted(layout.unit_of(layer, kv_head));
  }
  /// Key rotations, grouped by unit in ascending unit order. Empty with pre-RoPE keys.
  [[nodiscard]] std::span<const KeyRotation> rotations() const { return rotations_; }
  /// Key rotations of the unit of head (layer, kv_head).
  [[nodiscard]] std::span<const KeyRotation> rotations(int layer, int kv_head) const {
    const auto u = static_cast<std::size_t>(layout.unit_of(layer, kv_head));
    return std::span<const KeyRotation>(rotations_)
        .subspan(rotation_begin_[u], rotation_begin_[u + 1] - rotation_begin_[u]);
  }
  /// Evicted tokens over all units.
  [[nodiscard]] std::size_t evicted_count() const { return evicted_.size(); }

  // Builder side (kvevict::Sequence). Units are filled in ascending order.
  void begin(Trigger why, PositionMode mode, const UnitLayout& units) {
    trigger = why;
    position_mode = mode;
    layout = units;
    evicted_.clear();
    rotations_.clear();
    rotated_slots_.clear();
    evicted_begin_.assign(static_cast<std::size_t>(units.units()) + 1, 0);
    rotation_begin_.assign(static_cast<std::size_t>(units.units()) + 1, 0);
  }
  void add_evicted(const EvictedSlot& slot) { evicted_.push_back(slot); }
  /// Sorts the evicted entries from index `first` on (the current unit's) oldest first.
  void sort_evicted_from(std::size_t first) {
    std::sort(evicted_.begin() + static_cast<std::ptrdiff_t>(first), evicted_.end(),
              [](const EvictedSlot& a, const EvictedSlot& b) {
                return a.original_position < b.original_position;
              });
  }
  /// Closes unit `unit`'s evicted list (call for every unit in ascending order).
  void end_unit_evictions(int unit) {
    evicted_begin_[static_cast<std::size_t>(unit) + 1] = evicted_.size();
  }
  void add_rotation(int unit, std::int64_t delta, std::span<const std::int32_t> slots) {
    const std::size_t first = rotated_slots_.size();
    rotated_slots_.insert(rotated_slots_.end(), slots.begin(), slots.end());
    rotations_.push_back(KeyRotation{unit, delta, {}});
    rotation_slot_begin_.resize(rotations_.size());
    rotation_slot_begin_.back() = first;
  }
  /// Closes unit `unit`'s rotations (call for every unit in ascending order, after its rotations).
  void end_unit_rotations(int unit) {
    rotation_begin_[static_cast<std::size_t>(unit) + 1] = rotations_.size();
  }
  /// Points every rotation at its slots (after the last add_rotation: the buffer no longer moves).
  void finish() {
    for (std::size_t r = 0; r < rotations_.size(); ++r) {
      const std::size_t end =
          r + 1 < rotations_.size() ? rotation_slot_begin_[r + 1] : rotated_slots_.size();
      rotations_[r].slots = std::span<const std::int32_t>(rotated_slots_)
                                .subspan(rotation_slot_begin_[r], end - rotation_slot_begin_[r]);
    }
  }

 private:
  std::vector<EvictedSlot> evicted_;
  std::vector<std::size_t> evicted_begin_;  // [units + 1]
  std::vector<KeyRotation> rotations_;
  std::vector<std::size_t> rotation_begin_;       // [units + 1]
  std::vector<std::size_t> rotation_slot_begin_;  // [rotations]
  std::vector<std::int32_t> rotated_slots_;
};

}  // namespace kvevict
