// KvStore: kvevict's own key/value buffers, one [capacity, head_dim] block per (layer, KV head),
// indexed by slot. It is a KvBackend like an engine's: evictions free slots and move nothing; the
// only work a decision can ask of it is rotating folded post-RoPE keys.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvevict/checked.hpp"
#include "kvevict/decision.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_backend.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/rope.hpp"
#include "kvevict/shape.hpp"

namespace kvevict {

/// Keys and values `[capacity, head_dim]`, contiguous and row-major per (layer, KV head), row s
/// holding the token in slot s of that head. `Scalar` is the storage type (float here;
/// Eigen::half / Eigen::bfloat16 are the intended extensions).
template <class Scalar = float>
class KvStore final : public KvBackend {
 public:
  using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  /// Largest K + V allocation: 64 GiB, far beyond any machine kvevict's reference decoder runs on.
  static constexpr std::int64_t kMaxBytes = std::int64_t{1} << 36;

  /// Buffers for `shape`; rotations (post-RoPE folds) use `rope`. Empty until reserve().
  KvStore(const CacheShape& shape, const RopeConfig& rope, KeyStorage key_storage)
      : shape_(shape), key_storage_(key_storage) {
    shape.validate();
    if (key_storage == KeyStorage::post_rope) {
      rope_ = Rope(rope);
      angles_.resize(2 * static_cast<std::size_t>(rope_.pairs()));
    }
  }

  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  [[nodiscard]] int capacity() const { return capacity_; }
  [[nodiscard]] KeyStorage key_storage() const { return key_storage_; }

  void reserve(int capacity) override {
    if (capacity <= capacity_) return;
    const std::size_t row = static_cast<std::size_t>(shape_.head_dim);
    (void)checked_allocation({2, shape_.head_caches(), capacity, shape_.head_dim,
                              static_cast<std::int64_t>(sizeof(Scalar))},
                             "KvStore: key and value bytes", kMaxBytes);
    std::vector<Scalar> keys(static_cast<std::size_t>(shape_.head_caches()) * capacity * row,
                             Scalar(0));
    std::vector<Scalar> values(keys.size(), Scalar(0));
    for (int h = 0; h < shape_.head_caches(); ++h) {
      const std::size_t n = static_cast<std::size_t>(capacity_) * row;
      std::copy_n(keys_.begin() + static_cast<std::ptrdiff_t>(h * n), n,
                  keys.begin() + static_cast<std::ptrdiff_t>(h) * capacity * row);
      std::copy_n(values_.begin() + static_cast<std::ptrdiff_t>(h * n), n,
                  values.begin() + static_cast<std::ptrdiff_t>(h) * capacity * row);
    }
    bytes_copied_ += 2 * keys_.size() * sizeof(Scalar);
    keys_.swap(keys);
    values_.swap(values);
    capacity_ = capacity;
  }

  /// Rotates the keys of every KeyRotation (post-RoPE storage); evicted slots need nothing.
  void apply(const AppliedDecision& decision) override {
    for (const KeyRotation& rotation : decision.rotations()) {
      KVEVICT_REQUIRE(key_storage_ == KeyStorage::post_rope,
                      "KvStore: a key rotation for pre-RoPE keys");
      const double* cos_sin = rope_.angles(rotation.delta, angles_.data());
      for (int l = 0; l < shape_.layers; ++l) {
        for (int g = 0; g < shape_.kv_heads; ++g) {
          if (decision.layout.unit_of(l, g) != rotation.unit) continue;
          for (const std::int32_t slot : rotation.slots)
            rope_.rotate_with(key_row(l, g, slot), cos_sin);
          bytes_rotated_ += rotation.slots.size() * row_bytes();
        }
      }
    }
  }

  /// Key row of slot `slot` of head (layer, kv_head): head_dim values.
  [[nodiscard]] Scalar* key_row(int layer, int kv_head, std::int32_t slot) {
    return head_data(keys_, layer, kv_head) + static_cast<std::ptrdiff_t>(slot) * shape_.head_dim;
  }
  [[nodiscard]] Scalar* value_row(int layer, int kv_head, std::int32_t slot) {
    return head_data(values_, layer, kv_head) + static_cast<std::ptrdiff_t>(slot) * shape_.head_dim;
  }
  /// Key rows of slots [0, limit) of head (layer, kv_head): [limit, head_dim].
  [[nodiscard]] Eigen::Map<const Matrix> keys(int layer, int kv_head, int limit) const {
    return {head_data(keys_, layer, kv_head), limit, shape_.head_dim};
  }
  [[nodiscard]] Eigen::Map<const Matrix> values(int layer, int kv_head, int limit) const {
    return {head_data(values_, layer, kv_head), limit, shape_.head_dim};
  }

  /// Bytes of one slot's key and value rows.
  [[nodiscard]] std::size_t kv_bytes_per_slot() const { return 2 * row_bytes(); }
  /// Bytes allocated for keys and values.
  [[nodiscard]] std::size_t reserved_bytes() const {
    return (keys_.size() + values_.size()) * sizeof(Scalar);
  }
  /// Key bytes rewritten by fold rotations since construction.
  [[nodiscard]] std::size_t bytes_rotated() const { return bytes_rotated_; }
  /// Key and value bytes copied by growing the buffers since construction.
  [[nodiscard]] std::size_t bytes_copied() const { return bytes_copied_; }

 private:
  [[nodiscard]] std::size_t row_bytes() const {
    return static_cast<std::size_t>(shape_.head_dim) * sizeof(Scalar);
  }
  [[nodiscard]] Scalar* head_data(std::vector<Scalar>& data, int layer, int kv_head) {
    return data.data() + (static_cast<std::size_t>(layer) * shape_.kv_heads + kv_head) *
                             static_cast<std::size_t>(capacity_) * shape_.head_dim;
  }
  [[nodiscard]] const Scalar* head_data(const std::vector<Scalar>& data, int layer,
                                        int kv_head) const {
    return data.data() + (static_cast<std::size_t>(layer) * shape_.kv_heads + kv_head) *
                             static_cast<std::size_t>(capacity_) * shape_.head_dim;
  }

  CacheShape shape_;
  KeyStorage key_storage_;
  Rope rope_;
  int capacity_ = 0;
  std::vector<Scalar> keys_;    // [layers * kv_heads][capacity][head_dim]
  std::vector<Scalar> values_;  // [layers * kv_heads][capacity][head_dim]
  std::vector<double> angles_;  // rotation scratch: [cos x pairs, sin x pairs]
  std::size_t bytes_rotated_ = 0;
  std::size_t bytes_copied_ = 0;
};

}  // namespace kvevict
