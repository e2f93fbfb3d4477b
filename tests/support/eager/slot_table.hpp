// SlotTable: per-slot metadata of every (layer, KV head) cache, without the keys and values.
//
// Policies read and write only this table, so an engine that keeps K/V in its own buffers can still
// run every kvevict policy: it keeps a SlotTable beside its buffers and applies the same plans to
// both.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <kvevict/error.hpp>
#include <span>
#include <string>
#include <vector>

#include "eager/compaction_plan.hpp"
#include "eager/detail/gather.hpp"

namespace kvevict::eager {

/// Columns, per (layer, KV head), with one entry per live slot; slots are in the order tokens were
/// appended, so slot order is ascending original position in every head:
///   original_position  position in the input stream (0, 1, 2, ... over the whole sequence)
///   position           current RoPE position (depends on the position mode)
///   token_id           the token's id
///   flags              slot_flag bits (sink, anchor, catalyst)
///   score(c)           float columns owned by the policy (c < score_columns())
class SlotTable {
 public:
  SlotTable() = default;
  SlotTable(int layers, int kv_heads, int capacity, int score_columns)
      : layers_(layers), kv_heads_(kv_heads), score_columns_(score_columns) {
    KVEVICT_REQUIRE(layers > 0 && kv_heads > 0, "SlotTable: layers and kv_heads must be positive");
    KVEVICT_REQUIRE(capacity > 0,
                    "SlotTable: capacity must be positive, got " + std::to_string(capacity));
    KVEVICT_REQUIRE(score_columns >= 0, "SlotTable: negative score column count");
    live_.assign(static_cast<std::size_t>(head_caches()), 0);
    reserve(capacity);
  }

  [[nodiscard]] int layers() const { return layers_; }
  [[nodiscard]] int kv_heads() const { return kv_heads_; }
  [[nodiscard]] int head_caches() const { return layers_ * kv_heads_; }
  [[nodiscard]] int capacity() const { return capacity_; }
  [[nodiscard]] int score_columns() const { return score_columns_; }
  [[nodiscard]] int live(int layer, int kv_head) const { return live_[head(layer, kv_head)]; }
  /// Largest live count over all heads.
  [[nodiscard]] int max_live() const { return *std::max_element(live_.begin(), live_.end()); }
  /// Sum of live counts over all heads.
  [[nodiscard]] std::int64_t total_live() const { return total_live_; }
  /// The largest total_live() since construction.
  [[nodiscard]] std::int64_t peak_total_live() const { return peak_total_live_; }

  // Column views over the live slots of head (layer, kv_head).
  [[nodiscard]] std::span<std::int64_t> original_positions(int layer, int kv_head) {
    return column(original_position_, layer, kv_head);
  }
  [[nodiscard]] std::span<const std::int64_t> original_positions(int layer, int kv_head) const {
    return column(original_position_, layer, kv_head);
  }
  [[nodiscard]] std::span<std::int64_t> positions(int layer, int kv_head) {
    return column(position_, layer, kv_head);
  }
  [[nodiscard]] std::span<const std::int64_t> positions(int layer, int kv_head) const {
    return column(position_, layer, kv_head);
  }
  [[nodiscard]] std::span<std::int32_t> token_ids(int layer, int kv_head) {
    return column(token_id_, layer, kv_head);
  }
  [[nodiscard]] std::span<const std::int32_t> token_ids(int layer, int kv_head) const {
    return column(token_id_, layer, kv_head);
  }
  [[nodiscard]] std::span<std::uint8_t> flags(int layer, int kv_head) {
    return column(flags_, layer, kv_head);
  }
  [[nodiscard]] std::span<const std::uint8_t> flags(int layer, int kv_head) const {
    return column(flags_, layer, kv_head);
  }
  [[nodiscard]] std::span<float> scores(int layer, int kv_head, int column_index) {
    return {score_data(layer, kv_head, column_index), live_size(layer, kv_head)};
  }
  [[nodiscard]] std::span<const float> scores(int layer, int kv_head, int column_index) const {
    return {score_data(layer, kv_head, column_index), live_size(layer, kv_head)};
  }

  /// Grows every head to hold `capacity` slots, keeping contents. Never shrinks.
  void reserve(int capacity) {
    if (capacity <= capacity_) return;
    regrow(original_position_, capacity, 1);
    regrow(position_, capacity, 1);
    regrow(token_id_, capacity, 1);
    regrow(flags_, capacity, 1);
    regrow(score_, capacity, score_columns_);
    capacity_ = capacity;
  }

  /// Appends `token_ids.size()` slots to head (layer, kv_head). Scores start at 0.
  void append(int layer, int kv_head, std::span<const std::int64_t> original_positions,
              std::span<const std::int64_t> positions, std::span<const std::int32_t> token_ids,
              std::span<const std::uint8_t> flags) {
    const std::size_t n = token_ids.size();
    KVEVICT_REQUIRE(original_positions.size() == n && positions.size() == n && flags.size() == n,
                    "SlotTable::append: column lengths differ");
    const int live_before = live(layer, kv_head);
    KVEVICT_REQUIRE(live_before + static_cast<std::int64_t>(n) <= capacity_,
                    "SlotTable::append: head (" + std::to_string(layer) + ", " +
                        std::to_string(kv_head) + ") would exceed its capacity of " +
                        std::to_string(capacity_) + " slots");
    const std::size_t begin = slot_offset(layer, kv_head) + live_before;
    std::copy(original_positions.begin(), original_positions.end(),
              original_position_.begin() + begin);
    std::copy(positions.begin(), positions.end(), position_.begin() + begin);
    std::copy(token_ids.begin(), token_ids.end(), token_id_.begin() + begin);
    std::copy(flags.begin(), flags.end(), flags_.begin() + begin);
    for (int c = 0; c < score_columns_; ++c) {
      std::fill_n(score_data(layer, kv_head, c) + live_before, n, 0.0f);
    }
    live_[head(layer, kv_head)] = live_before + static_cast<int>(n);
    set_total_live(total_live_ + static_cast<std::int64_t>(n));
  }

  /// Drops the newest slots of head (layer, kv_head) so that `new_live` remain (roll back).
  void truncate(int layer, int kv_head, int new_live) {
    KVEVICT_REQUIRE(new_live >= 0 && new_live <= live(layer, kv_head),
                    "SlotTable::truncate: new live count " + std::to_string(new_live) +
                        " outside [0, " + std::to_string(live(layer, kv_head)) + "]");
    set_total_live(total_live_ - (live(layer, kv_head) - new_live));
    live_[head(layer, kv_head)] = new_live;
  }

  /// Keeps the slots `keep` (strictly ascending) of head (layer, kv_head), in order, in every
  /// column, and sets their RoPE positions to `new_positions`. Stable, in place, no allocation.
  void compact(int layer, int kv_head, std::span<const std::int32_t> keep,
               std::span<const std::int64_t> new_positions) {
    detail::validate_keep_list(keep, live(layer, kv_head));
    KVEVICT_REQUIRE(new_positions.size() == keep.size(),
                    "SlotTable::compact: one new position per kept slot expected");
    const std::size_t offset = slot_offset(layer, kv_head);
    detail::gather_in_place(original_position_.data() + offset, keep);
    detail::gather_in_place(token_id_.data() + offset, keep);
    detail::gather_in_place(flags_.data() + offset, keep);
    for (int c = 0; c < score_columns_; ++c) {
      detail::gather_in_place(score_data(layer, kv_head, c), keep);
    }
    std::copy(new_positions.begin(), new_positions.end(), position_.begin() + offset);
    set_total_live(total_live_ - (live(layer, kv_head) - static_cast<int>(keep.size())));
    live_[head(layer, kv_head)] = static_cast<int>(keep.size());
  }

  /// Applies every changed head of `plan`.
  void apply(const CompactionPlan& plan) {
    KVEVICT_REQUIRE(plan.layers() == layers_ && plan.kv_heads() == kv_heads_,
                    "SlotTable::apply: plan shape does not match the table");
    for (int l = 0; l < layers_; ++l) {
      for (int g = 0; g < kv_heads_; ++g) {
        if (plan.changes(l, g)) compact(l, g, plan.keep(l, g), plan.new_positions(l, g));
      }
    }
  }

  /// Bytes of metadata per slot (all columns).
  [[nodiscard]] std::size_t bytes_per_slot() const {
    return sizeof(std::int64_t) * 2 + sizeof(std::int32_t) + sizeof(std::uint8_t) +
           sizeof(float) * static_cast<std::size_t>(score_columns_);
  }

 private:
  void set_total_live(std::int64_t total) {
    total_live_ = total;
    peak_total_live_ = std::max(peak_total_live_, total);
  }
  [[nodiscard]] std::size_t head(int layer, int kv_head) const {
    return static_cast<std::size_t>(layer) * kv_heads_ + kv_head;
  }
  [[nodiscard]] std::size_t slot_offset(int layer, int kv_head) const {
    return head(layer, kv_head) * capacity_;
  }
  [[nodiscard]] std::size_t live_size(int layer, int kv_head) const {
    return static_cast<std::size_t>(live(layer, kv_head));
  }
  template <class T>
  [[nodiscard]] std::span<T> column(std::vector<T>& data, int layer, int kv_head) {
    return {data.data() + slot_offset(layer, kv_head), live_size(layer, kv_head)};
  }
  template <class T>
  [[nodiscard]] std::span<const T> column(const std::vector<T>& data, int layer,
                                          int kv_head) const {
    return {data.data() + slot_offset(layer, kv_head), live_size(layer, kv_head)};
  }
  [[nodiscard]] float* score_data(int layer, int kv_head, int c) {
    return score_.data() + (head(layer, kv_head) * score_columns_ + c) * capacity_;
  }
  [[nodiscard]] const float* score_data(int layer, int kv_head, int c) const {
    return score_.data() + (head(layer, kv_head) * score_columns_ + c) * capacity_;
  }
  // Re-lays out [head_caches * columns][capacity_] as [...][new_capacity], keeping live prefixes.
  template <class T>
  void regrow(std::vector<T>& data, int new_capacity, int columns) {
    std::vector<T> grown(static_cast<std::size_t>(head_caches()) * columns * new_capacity);
    for (int h = 0; h < head_caches(); ++h) {
      for (int c = 0; c < columns; ++c) {
        const std::size_t block = static_cast<std::size_t>(h) * columns + c;
        std::copy_n(data.begin() + block * capacity_, live_[h],
                    grown.begin() + block * new_capacity);
      }
    }
    data.swap(grown);
  }

  int layers_ = 0;
  int kv_heads_ = 0;
  int capacity_ = 0;
  int score_columns_ = 0;
  std::vector<int> live_;  // [head_caches]
  std::int64_t total_live_ = 0;
  std::int64_t peak_total_live_ = 0;
  std::vector<std::int64_t> original_position_;  // [head_caches][capacity]
  std::vector<std::int64_t> position_;           // [head_caches][capacity]
  std::vector<std::int32_t> token_id_;           // [head_caches][capacity]
  std::vector<std::uint8_t> flags_;              // [head_caches][capacity]
  std::vector<float> score_;                     // [head_caches][score_columns][capacity]
};

}  // namespace kvevict::eager
