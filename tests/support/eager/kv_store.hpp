// KvStore: one sequence's keys, values and slot metadata, per layer and KV head.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <kvevict/error.hpp>
#include <span>
#include <string>
#include <vector>

#include "eager/compaction_plan.hpp"
#include "eager/detail/gather.hpp"
#include "eager/rope.hpp"
#include "eager/shape.hpp"
#include "eager/slot_table.hpp"

namespace kvevict::eager {

/// Exact byte counts of a store. "kv" counts keys and values, "metadata" the slot columns.
struct MemoryStats {
  std::size_t live_kv_bytes = 0;        ///< keys + values of live slots
  std::size_t live_metadata_bytes = 0;  ///< slot columns of live slots
  std::size_t reserved_bytes = 0;       ///< everything allocated for slots (capacity x all columns)
  std::size_t peak_live_bytes = 0;      ///< the largest live_bytes() seen since construction
  std::size_t peak_kv_bytes = 0;        ///< keys + values at that peak
  [[nodiscard]] std::size_t live_bytes() const { return live_kv_bytes + live_metadata_bytes; }
};

/// Keys and values `[capacity, head_dim]`, contiguous and row-major per (layer, KV head), plus a
/// SlotTable. Each head has its own live count: per-head policies keep different tokens per head.
///
/// `Scalar` is the storage type (float here; Eigen::half / Eigen::bfloat16 are the intended
/// extensions). Compaction is in place and stable and allocates nothing; only reserve() allocates.
template <class Scalar = float>
class KvStore {
 public:
  using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  KvStore(const CacheShape& shape, int capacity, int score_columns = 0) : shape_(shape) {
    shape.validate();
    KVEVICT_REQUIRE(capacity > 0,
                    "KvStore: capacity must be positive, got " + std::to_string(capacity));
    slots_ = SlotTable(shape.layers, shape.kv_heads, capacity, score_columns);
    allocate(capacity);
  }

  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  [[nodiscard]] int capacity() const { return slots_.capacity(); }
  [[nodiscard]] int live(int layer, int kv_head) const { return slots_.live(layer, kv_head); }
  [[nodiscard]] SlotTable& slots() { return slots_; }
  [[nodiscard]] const SlotTable& slots() const { return slots_; }

  /// Live keys of head (layer, kv_head): [live, head_dim].
  [[nodiscard]] Eigen::Map<Matrix> keys(int layer, int kv_head) {
    return rows(keys_, layer, kv_head, 0, live(layer, kv_head));
  }
  [[nodiscard]] Eigen::Map<const Matrix> keys(int layer, int kv_head) const {
    return rows(keys_, layer, kv_head, 0, live(layer, kv_head));
  }
  /// Live values of head (layer, kv_head): [live, head_dim].
  [[nodiscard]] Eigen::Map<Matrix> values(int layer, int kv_head) {
    return rows(values_, layer, kv_head, 0, live(layer, kv_head));
  }
  [[nodiscard]] Eigen::Map<const Matrix> values(int layer, int kv_head) const {
    return rows(values_, layer, kv_head, 0, live(layer, kv_head));
  }
  /// Key rows [begin, end) of head (layer, kv_head), which must lie within the live slots.
  [[nodiscard]] Eigen::Map<Matrix> key_rows(int layer, int kv_head, int begin, int end) {
    check_rows(layer, kv_head, begin, end);
    return rows(keys_, layer, kv_head, begin, end);
  }
  [[nodiscard]] Eigen::Map<Matrix> value_rows(int layer, int kv_head, int begin, int end) {
    check_rows(layer, kv_head, begin, end);
    return rows(values_, layer, kv_head, begin, end);
  }

  /// Grows every head to `capacity` slots, keeping contents. Never shrinks.
  void reserve(int capacity) {
    if (capacity <= this->capacity()) return;
    const int old_capacity = this->capacity();
    std::vector<Scalar> old_keys;
    std::vector<Scalar> old_values;
    old_keys.swap(keys_);
    old_values.swap(values_);
    allocate(capacity);
    const std::size_t row = static_cast<std::size_t>(shape_.head_dim);
    for (int l = 0; l < shape_.layers; ++l) {
      for (int g = 0; g < shape_.kv_heads; ++g) {
        const std::size_t h = static_cast<std::size_t>(l) * shape_.kv_heads + g;
        const std::size_t n = static_cast<std::size_t>(live(l, g)) * row;
        std::copy_n(old_keys.begin() + h * old_capacity * row, n,
                    keys_.begin() + h * capacity * row);
        std::copy_n(old_values.begin() + h * old_capacity * row, n,
                    values_.begin() + h * capacity * row);
      }
    }
    slots_.reserve(capacity);
  }

  /// Appends rows of keys and values ([n, head_dim] each) with their metadata to head (layer,
  /// kv_head). Keys are stored as given: the caller decides whether they are already rotated.
  void append(int layer, int kv_head, const Eigen::Ref<const Matrix>& new_keys,
              const Eigen::Ref<const Matrix>& new_values,
              std::span<const std::int64_t> original_positions,
              std::span<const std::int64_t> positions, std::span<const std::int32_t> token_ids,
              std::span<const std::uint8_t> flags) {
    KVEVICT_REQUIRE(new_keys.cols() == shape_.head_dim && new_values.cols() == shape_.head_dim,
                    "KvStore::append: rows must have head_dim = " +
                        std::to_string(shape_.head_dim) + " columns");
    KVEVICT_REQUIRE(new_keys.rows() == static_cast<Eigen::Index>(token_ids.size()) &&
                        new_values.rows() == new_keys.rows(),
                    "KvStore::append: key, value and metadata row counts differ");
    const int begin = live(layer, kv_head);
    slots_.append(layer, kv_head, original_positions, positions, token_ids, flags);
    const int end = live(layer, kv_head);
    rows(keys_, layer, kv_head, begin, end) = new_keys;
    rows(values_, layer, kv_head, begin, end) = new_values;
  }

  /// Drops the newest slots of head (layer, kv_head) so that `new_live` remain.
  void truncate(int layer, int kv_head, int new_live) { slots_.truncate(layer, kv_head, new_live); }

  /// Gathers keys and values of every changed head of `plan`, rows keep()[i] -> i, and, when keys
  /// are stored after RoPE (`post_rope_keys` given), rotates kept key i by position_deltas()[i].
  /// Touches only K/V: use this when the slot table was compacted already (EvictionPipeline does
  /// that), apply() otherwise. The plan's positions must be assigned (see reposition.hpp).
  void apply_kv(const CompactionPlan& plan, const Rope* post_rope_keys = nullptr) {
    check_plan(plan);
    const std::ptrdiff_t row = shape_.head_dim;
    for (int l = 0; l < shape_.layers; ++l) {
      for (int g = 0; g < shape_.kv_heads; ++g) {
        if (!plan.changes(l, g)) continue;
        const std::span<const std::int32_t> keep = plan.keep(l, g);
        Scalar* key_data = head_data(keys_, l, g);
        detail::gather_rows_in_place(key_data, row, keep);
        detail::gather_rows_in_place(head_data(values_, l, g), row, keep);
        if (post_rope_keys != nullptr) {
          post_rope_keys->rotate_rows(key_data, row, plan.position_deltas(l, g));
        }
      }
    }
  }

  /// Applies `plan` to keys, values and the slot table together. Stable, in place, no allocation.
  void apply(const CompactionPlan& plan, const Rope* post_rope_keys = nullptr) {
    check_plan(plan);
    for (int l = 0; l < shape_.layers; ++l) {
      for (int g = 0; g < shape_.kv_heads; ++g) {
        if (plan.changes(l, g)) detail::validate_keep_list(plan.keep(l, g), live(l, g));
      }
    }
    apply_kv(plan, post_rope_keys);
    slots_.apply(plan);
  }

  /// Bytes one slot occupies: its key and value rows plus its metadata.
  [[nodiscard]] std::size_t kv_bytes_per_slot() const {
    return 2 * static_cast<std::size_t>(shape_.head_dim) * sizeof(Scalar);
  }
  [[nodiscard]] std::size_t bytes_per_slot() const {
    return kv_bytes_per_slot() + slots_.bytes_per_slot();
  }

  /// Byte counts over all heads.
  [[nodiscard]] MemoryStats memory() const {
    MemoryStats stats;
    const auto live_slots = static_cast<std::size_t>(slots_.total_live());
    stats.live_kv_bytes = live_slots * kv_bytes_per_slot();
    stats.live_metadata_bytes = live_slots * slots_.bytes_per_slot();
    stats.reserved_bytes =
        static_cast<std::size_t>(capacity()) * shape_.head_caches() * bytes_per_slot();
    const auto peak_slots = static_cast<std::size_t>(slots_.peak_total_live());
    stats.peak_live_bytes = peak_slots * bytes_per_slot();
    stats.peak_kv_bytes = peak_slots * kv_bytes_per_slot();
    return stats;
  }
  /// Byte counts of head (layer, kv_head); peak is not tracked per head.
  [[nodiscard]] MemoryStats memory(int layer, int kv_head) const {
    MemoryStats stats;
    const std::size_t n = static_cast<std::size_t>(live(layer, kv_head));
    stats.live_kv_bytes = n * kv_bytes_per_slot();
    stats.live_metadata_bytes = n * slots_.bytes_per_slot();
    stats.reserved_bytes = static_cast<std::size_t>(capacity()) * bytes_per_slot();
    return stats;
  }

 private:
  void allocate(int capacity) {
    const std::size_t n =
        static_cast<std::size_t>(shape_.head_caches()) * capacity * shape_.head_dim;
    keys_.assign(n, Scalar(0));
    values_.assign(n, Scalar(0));
  }
  void check_plan(const CompactionPlan& plan) const {
    KVEVICT_REQUIRE(plan.layers() == shape_.layers && plan.kv_heads() == shape_.kv_heads,
                    "KvStore: plan shape does not match the store");
  }
  void check_rows(int layer, int kv_head, int begin, int end) const {
    KVEVICT_REQUIRE(0 <= begin && begin <= end && end <= live(layer, kv_head),
                    "KvStore: row range [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") outside the live slots");
  }
  [[nodiscard]] Scalar* head_data(std::vector<Scalar>& data, int layer, int kv_head) {
    return data.data() + (static_cast<std::size_t>(layer) * shape_.kv_heads + kv_head) *
                             capacity() * shape_.head_dim;
  }
  [[nodiscard]] const Scalar* head_data(const std::vector<Scalar>& data, int layer,
                                        int kv_head) const {
    return data.data() + (static_cast<std::size_t>(layer) * shape_.kv_heads + kv_head) *
                             capacity() * shape_.head_dim;
  }
  [[nodiscard]] Eigen::Map<Matrix> rows(std::vector<Scalar>& data, int layer, int kv_head,
                                        int begin, int end) {
    return {head_data(data, layer, kv_head) + static_cast<std::ptrdiff_t>(begin) * shape_.head_dim,
            end - begin, shape_.head_dim};
  }
  [[nodiscard]] Eigen::Map<const Matrix> rows(const std::vector<Scalar>& data, int layer,
                                              int kv_head, int begin, int end) const {
    return {head_data(data, layer, kv_head) + static_cast<std::ptrdiff_t>(begin) * shape_.head_dim,
            end - begin, shape_.head_dim};
  }

  CacheShape shape_;
  SlotTable slots_;
  std::vector<Scalar> keys_;    // [layers * kv_heads][capacity][head_dim]
  std::vector<Scalar> values_;  // [layers * kv_heads][capacity][head_dim]
};

}  // namespace kvevict::eager
