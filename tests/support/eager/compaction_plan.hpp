// CompactionPlan: a policy's decision, one keep-list (plus new RoPE positions) per (layer, KV
// head).
//
// This is the whole contract between selection and storage. kvevict's own KvStore applies it, and
// an engine that owns its K/V buffers applies it itself: for every head that changes(), gather rows
// keep()[i] -> i of keys, values and any per-slot data, then (if keys are stored after RoPE) rotate
// kept key i by position_deltas()[i] (= new position - old position, see reposition.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvevict/error.hpp>
#include <span>
#include <vector>

#include "eager/signals.hpp"

namespace kvevict::eager {

class CompactionPlan {
 public:
  CompactionPlan() = default;
  CompactionPlan(int layers, int kv_heads, int capacity) { resize(layers, kv_heads, capacity); }

  /// Sizes the buffers for `capacity` slots per head (allocates) and clears the plan.
  void resize(int layers, int kv_heads, int capacity) {
    layers_ = layers;
    kv_heads_ = kv_heads;
    capacity_ = capacity;
    const std::size_t heads = static_cast<std::size_t>(layers) * kv_heads;
    keep_.assign(heads * capacity, 0);
    positions_.assign(heads * capacity, 0);
    deltas_.assign(heads * capacity, 0);
    counts_.assign(heads, kUnchanged);
  }

  /// Marks every head unchanged; no allocation.
  void clear() {
    std::fill(counts_.begin(), counts_.end(), kUnchanged);
    trigger = Trigger::after_forward;
  }

  [[nodiscard]] int layers() const { return layers_; }
  [[nodiscard]] int kv_heads() const { return kv_heads_; }
  [[nodiscard]] int capacity() const { return capacity_; }

  /// Whether head (layer, kv_head) is compacted by this plan.
  [[nodiscard]] bool changes(int layer, int kv_head) const {
    return counts_[index(layer, kv_head)] != kUnchanged;
  }
  /// True when no head changes.
  [[nodiscard]] bool empty() const {
    for (int count : counts_) {
      if (count != kUnchanged) return false;
    }
    return true;
  }

  /// Slots kept in head (layer, kv_head), strictly ascending. Only meaningful if changes().
  [[nodiscard]] std::span<const std::int32_t> keep(int layer, int kv_head) const {
    const std::size_t h = index(layer, kv_head);
    return {keep_.data() + h * capacity_, static_cast<std::size_t>(counts_[h])};
  }
  /// RoPE position of each kept slot after compaction, parallel to keep().
  [[nodiscard]] std::span<const std::int64_t> new_positions(int layer, int kv_head) const {
    const std::size_t h = index(layer, kv_head);
    return {positions_.data() + h * capacity_, static_cast<std::size_t>(counts_[h])};
  }

  /// Rotation that moves kept slot i from its old to its new RoPE position, parallel to keep().
  [[nodiscard]] std::span<const std::int64_t> position_deltas(int layer, int kv_head) const {
    const std::size_t h = index(layer, kv_head);
    return {deltas_.data() + h * capacity_, static_cast<std::size_t>(counts_[h])};
  }

  /// Writer side: the full-capacity buffer of head (layer, kv_head); fill its first `count`
  /// entries, then call set_keep_count.
  [[nodiscard]] std::span<std::int32_t> keep_buffer(int layer, int kv_head) {
    return {keep_.data() + index(layer, kv_head) * capacity_, static_cast<std::size_t>(capacity_)};
  }
  void set_keep_count(int layer, int kv_head, int count) {
    KVEVICT_REQUIRE(count >= 0 && count <= capacity_, "CompactionPlan: keep count out of range");
    counts_[index(layer, kv_head)] = count;
  }
  [[nodiscard]] std::span<std::int64_t> positions_buffer(int layer, int kv_head) {
    const std::size_t h = index(layer, kv_head);
    return {positions_.data() + h * capacity_, static_cast<std::size_t>(counts_[h])};
  }
  [[nodiscard]] std::span<std::int64_t> deltas_buffer(int layer, int kv_head) {
    const std::size_t h = index(layer, kv_head);
    return {deltas_.data() + h * capacity_, static_cast<std::size_t>(counts_[h])};
  }

  /// Why the plan was made.
  Trigger trigger = Trigger::after_forward;

 private:
  static constexpr int kUnchanged = -1;
  [[nodiscard]] std::size_t index(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * kv_heads_ + kv_head;
  }

  int layers_ = 0;
  int kv_heads_ = 0;
  int capacity_ = 0;
  std::vector<std::int32_t> keep_;       // [heads][capacity]
  std::vector<std::int64_t> positions_;  // [heads][capacity]
  std::vector<std::int64_t> deltas_;     // [heads][capacity]
  std::vector<int> counts_;              // [heads]; kUnchanged or the kept count
};

}  // namespace kvevict::eager
