// KvStore: kvevict's own key/value buffers, one [capacity, row] block per (layer, KV head), indexed
// by slot, each row one token's key (or value) stored as a KvType (f32, f16, bf16 or Q8_0). It is a
// KvBackend like an engine's: evictions free slots and move nothing; the only work a decision can
// ask of it is rotating folded post-RoPE keys.
//
// Rows are bytes of a type chosen at run time, not a template parameter: one decoder and one
// attention path serve every type, and the type costs one switch per head and run of slots (the
// kernels read the rows in their stored form, kv_kernels in the reference model).
//
// Roundings of a stored key. Writing a key is one rounding to the type (post-RoPE: rotated in
// double, then rounded). A fold rotates it from its stored form (decoded exactly, rotated in
// double) and rounds once more. kvevict folds keys only when their unit carries more than
// max_pending_rotations (L) different pending rotations; under a rank position mode a key is
// folded at most max(L, 1) + capacity times (docs/design.md, "Folds"), and under `original` never.
// A key therefore carries at most 1 + max(L, 1) + capacity roundings, each within
// kv_rounding_unit(type) of the rotated value (tests/test_kv_types.cpp checks the bound over
// 10,000 evictions).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvevict/checked.hpp"
#include "kvevict/decision.hpp"
#include "kvevict/engine.hpp"
#include "kvevict/error.hpp"
#include "kvevict/kv_type.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/rope.hpp"
#include "kvevict/shape.hpp"

namespace kvevict {

/// How many rows each head's block holds.
enum class HeadSizing : std::uint8_t {
  /// Every head the sequence's whole capacity (reserve()): no copy once reserved.
  whole_capacity,
  /// Each head what its slots use (fit()), under SequenceConfig::compact_slots: a head whose share
  /// of a budget shrinks gives its rows back. A block grows to 9/8 of what is asked and is cut
  /// back to that once it holds over 5/4 of it plus 16 rows, so it holds at most 5/4 of its slots
  /// plus 16 rows, and a block is copied only after its need moved by 1/8 (bytes_copied()).
  by_use,
};

/// Keys and values of every (layer, KV head): slot s is row s of that head's block, a row holding
/// kv_row_bytes(type, head_dim) bytes.
class KvStore final : public KvBackend {
 public:
  /// F32 rows as an Eigen matrix (kv_type() == f32 only).
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  /// Largest K + V allocation: 64 GiB, far beyond any machine kvevict's reference decoder runs on.
  static constexpr std::int64_t kMaxBytes = std::int64_t{1} << 36;

  /// Buffers for `shape`, rows stored as `type`; rotations (post-RoPE folds) use `rope`. Empty
  /// until reserve().
  KvStore(const CacheShape& shape, const RopeConfig& rope, KeyStorage key_storage,
          KvType type = KvType::f32, HeadSizing sizing = HeadSizing::whole_capacity)
      : shape_(shape),
        key_storage_(key_storage),
        type_(type),
        sizing_(sizing),
        row_bytes_((shape.validate(), kv_row_bytes(type, shape.head_dim))),
        heads_(static_cast<std::size_t>(shape.head_caches())) {
    if (key_storage == KeyStorage::post_rope) {
      rope_ = Rope(rope);
      angles_.resize(2 * static_cast<std::size_t>(rope_.pairs()));
      row_scratch_.resize(static_cast<std::size_t>(shape.head_dim));
    }
  }

  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  /// Slots per head the sequence may use (reserve()); under HeadSizing::by_use a head's block
  /// holds head_rows() of them.
  [[nodiscard]] int capacity() const { return capacity_; }
  /// Rows the block of head (layer, kv_head) holds.
  [[nodiscard]] int head_rows(int layer, int kv_head) const { return head(layer, kv_head).rows; }
  [[nodiscard]] KeyStorage key_storage() const { return key_storage_; }
  [[nodiscard]] KvType kv_type() const { return type_; }
  /// Bytes of one stored row (one token's key, or value, of one head).
  [[nodiscard]] std::size_t row_bytes() const { return row_bytes_; }

  void reserve(int capacity) override {
    if (capacity <= capacity_) return;
    (void)checked_allocation(
        {2, shape_.head_caches(), capacity, static_cast<std::int64_t>(row_bytes_)},
        "KvStore: key and value bytes", kMaxBytes);
    capacity_ = capacity;
    if (sizing_ == HeadSizing::by_use) return;
    for (HeadRows& rows : heads_) resize(rows, capacity);
  }

  /// HeadSizing::by_use: the block of head (layer, kv_head) holds at least rows [0, slots), with
  /// its contents (see HeadSizing for the rule). Call before writing a chunk's rows (slots = the
  /// head's slot limit, which a decision's compaction lowered). No-op under whole_capacity.
  void fit(int layer, int kv_head, int slots) {
    if (sizing_ != HeadSizing::by_use) return;
    KVEVICT_REQUIRE(slots >= 0 && slots <= capacity_, "KvStore::fit: " + std::to_string(slots) +
                                                          " slots, outside [0, " +
                                                          std::to_string(capacity_) + "]");
    HeadRows& rows = head(layer, kv_head);
    const int roomy = std::min(capacity_, slots + slots / 8);
    if (rows.rows < slots || rows.rows > slots + slots / 4 + 16) resize(rows, roomy);
  }

  /// Moves the rows each SlotMove names (compact_slots), then rotates the keys of every
  /// KeyRotation (post-RoPE storage), each from its stored form with one rounding; evicted slots
  /// need nothing.
  void apply(const AppliedDecision& decision) override {
    // The rows a decision names are scattered over the head's block, out of cache after the
    // attention's pass over every head: each is requested kRowsAhead rows before its turn, so
    // that the misses overlap instead of following one another.
    if (decision.has_moves()) {
      for (int l = 0; l < shape_.layers; ++l) {
        for (int g = 0; g < shape_.kv_heads; ++g) {
          const std::span<const SlotMove> moves = decision.moves(decision.layout.unit_of(l, g));
          for (std::size_t i = 0; i < moves.size(); ++i) {
            if (i + kRowsAhead < moves.size()) {
              prefetch_row(key_row(l, g, moves[i + kRowsAhead].from));
              prefetch_row(value_row(l, g, moves[i + kRowsAhead].from));
            }
            std::memcpy(key_row(l, g, moves[i].to), key_row(l, g, moves[i].from), row_bytes_);
            std::memcpy(value_row(l, g, moves[i].to), value_row(l, g, moves[i].from), row_bytes_);
          }
        }
      }
    }
    for (const KeyRotation& rotation : decision.rotations()) {
      KVEVICT_REQUIRE(key_storage_ == KeyStorage::post_rope,
                      "KvStore: a key rotation for pre-RoPE keys");
      const double* cos_sin = rope_.angles(rotation.delta, angles_.data());
      // The unit's heads, each with the same slots: rows visited head by head, row i of the walk
      // being slots[i % count] of head i / count.
      rotated_heads_.clear();
      for (int l = 0; l < shape_.layers; ++l) {
        for (int g = 0; g < shape_.kv_heads; ++g) {
          if (decision.layout.unit_of(l, g) == rotation.unit) rotated_heads_.push_back({l, g});
        }
      }
      const std::span<const std::int32_t> slots = rotation.slots;
      const std::size_t count = slots.size();
      const std::size_t rows = rotated_heads_.size() * count;
      const auto row_of_walk = [&](std::size_t i) {
        const auto [l, g] = rotated_heads_[i / count];
        return std::tuple{l, g, slots[i % count]};
      };
      for (std::size_t i = 0; i < rows; ++i) {
        if (i + kRowsAhead < rows) {
          const auto [l, g, slot] = row_of_walk(i + kRowsAhead);
          prefetch_row(key_row(l, g, slot));
        }
        const auto [l, g, slot] = row_of_walk(i);
        rotate_key(l, g, slot, cos_sin);
      }
      bytes_rotated_ += rows * row_bytes_;
    }
  }

  /// Stores head_dim values (float or double) as the key / value of slot `slot`: one rounding.
  template <class Real>
  void write_key(int layer, int kv_head, std::int32_t slot, const Real* key) {
    check_row(layer, kv_head, slot);
    encode_kv_row(type_, key, shape_.head_dim, key_row(layer, kv_head, slot));
  }
  template <class Real>
  void write_value(int layer, int kv_head, std::int32_t slot, const Real* value) {
    check_row(layer, kv_head, slot);
    encode_kv_row(type_, value, shape_.head_dim, value_row(layer, kv_head, slot));
  }
  /// The head_dim values of a stored key / value (exact).
  template <class Real>
  void read_key(int layer, int kv_head, std::int32_t slot, Real* out) const {
    decode_kv_row(type_, key_row(layer, kv_head, slot), shape_.head_dim, out);
  }
  template <class Real>
  void read_value(int layer, int kv_head, std::int32_t slot, Real* out) const {
    decode_kv_row(type_, value_row(layer, kv_head, slot), shape_.head_dim, out);
  }

  /// Stored bytes of the key / value row of slot `slot` of head (layer, kv_head).
  [[nodiscard]] std::uint8_t* key_row(int layer, int kv_head, std::int32_t slot) {
    return head_data(&HeadRows::keys, layer, kv_head) + static_cast<std::size_t>(slot) * row_bytes_;
  }
  [[nodiscard]] const std::uint8_t* key_row(int layer, int kv_head, std::int32_t slot) const {
    return head_data(&HeadRows::keys, layer, kv_head) + static_cast<std::size_t>(slot) * row_bytes_;
  }
  [[nodiscard]] std::uint8_t* value_row(int layer, int kv_head, std::int32_t slot) {
    return head_data(&HeadRows::values, layer, kv_head) +
           static_cast<std::size_t>(slot) * row_bytes_;
  }
  [[nodiscard]] const std::uint8_t* value_row(int layer, int kv_head, std::int32_t slot) const {
    return head_data(&HeadRows::values, layer, kv_head) +
           static_cast<std::size_t>(slot) * row_bytes_;
  }
  /// Key / value rows of slots [0, capacity) of head (layer, kv_head), as stored.
  [[nodiscard]] StoredRows stored_keys(int layer, int kv_head) const {
    return {head_data(&HeadRows::keys, layer, kv_head), type_, row_bytes_};
  }
  [[nodiscard]] StoredRows stored_values(int layer, int kv_head) const {
    return {head_data(&HeadRows::values, layer, kv_head), type_, row_bytes_};
  }
  /// F32 storage: key rows of slots [0, limit) of head (layer, kv_head), [limit, head_dim].
  [[nodiscard]] Eigen::Map<const Matrix> keys(int layer, int kv_head, int limit) const {
    return {f32_rows(&HeadRows::keys, layer, kv_head), limit, shape_.head_dim};
  }
  [[nodiscard]] Eigen::Map<const Matrix> values(int layer, int kv_head, int limit) const {
    return {f32_rows(&HeadRows::values, layer, kv_head), limit, shape_.head_dim};
  }

  /// Bytes of one slot's key and value rows (Q8_0 scales included).
  [[nodiscard]] std::size_t kv_bytes_per_slot() const { return 2 * row_bytes_; }
  /// Bytes allocated for keys and values, and the most allocated at once since construction.
  [[nodiscard]] std::size_t reserved_bytes() const { return reserved_bytes_; }
  [[nodiscard]] std::size_t peak_reserved_bytes() const { return peak_reserved_bytes_; }
  /// Key bytes rewritten by fold rotations since construction.
  [[nodiscard]] std::size_t bytes_rotated() const { return bytes_rotated_; }
  /// Key and value bytes copied by growing the buffers since construction.
  [[nodiscard]] std::size_t bytes_copied() const { return bytes_copied_; }

 private:
  // Rows live in f32 words so that f32 rows are floats; other types address the words' bytes (a
  // Q8_0 row of 34 bytes is not word-aligned). A buffer is padded to whole words: at most 3 bytes.
  using Word = float;

  // One head's key and value blocks: `rows` rows each.
  struct HeadRows {
    std::vector<Word> keys;
    std::vector<Word> values;
    int rows = 0;
  };

  [[nodiscard]] HeadRows& head(int layer, int kv_head) {
    return heads_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(shape_.kv_heads) +
                  static_cast<std::size_t>(kv_head)];
  }
  [[nodiscard]] const HeadRows& head(int layer, int kv_head) const {
    return heads_[static_cast<std::size_t>(layer) * static_cast<std::size_t>(shape_.kv_heads) +
                  static_cast<std::size_t>(kv_head)];
  }
  [[nodiscard]] std::uint8_t* head_data(std::vector<Word> HeadRows::*block, int layer,
                                        int kv_head) {
    return reinterpret_cast<std::uint8_t*>((head(layer, kv_head).*block).data());
  }
  [[nodiscard]] const std::uint8_t* head_data(std::vector<Word> HeadRows::*block, int layer,
                                              int kv_head) const {
    return reinterpret_cast<const std::uint8_t*>((head(layer, kv_head).*block).data());
  }
  [[nodiscard]] const float* f32_rows(std::vector<Word> HeadRows::*block, int layer,
                                      int kv_head) const {
    KVEVICT_REQUIRE(type_ == KvType::f32, "KvStore: rows as f32 matrices of a " +
                                              std::string(to_string(type_)) + " store");
    return (head(layer, kv_head).*block).data();
  }

  void check_row(int layer, int kv_head, std::int32_t slot) const {
    KVEVICT_REQUIRE(slot >= 0 && slot < head(layer, kv_head).rows,
                    "KvStore: slot " + std::to_string(slot) + " of head (" + std::to_string(layer) +
                        ", " + std::to_string(kv_head) + ") is beyond its " +
                        std::to_string(head(layer, kv_head).rows) + " rows (reserve, or fit)");
  }

  // Re-allocates a head's blocks to `rows` rows, keeping the rows both sizes hold.
  void resize(HeadRows& head_rows, int rows) {
    const std::size_t words =
        (static_cast<std::size_t>(rows) * row_bytes_ + sizeof(Word) - 1) / sizeof(Word);
    const std::size_t kept = static_cast<std::size_t>(std::min(rows, head_rows.rows)) * row_bytes_;
    for (std::vector<Word>* block : {&head_rows.keys, &head_rows.values}) {
      std::vector<Word> resized(words, Word(0));
      if (kept > 0) std::memcpy(resized.data(), block->data(), kept);
      reserved_bytes_ = reserved_bytes_ - block->size() * sizeof(Word) + words * sizeof(Word);
      block->swap(resized);
    }
    bytes_copied_ += 2 * kept;
    head_rows.rows = rows;
    peak_reserved_bytes_ = std::max(peak_reserved_bytes_, reserved_bytes_);
  }

  static constexpr std::size_t kRowsAhead = 8;
  // Asks for a row's cache lines ahead of its use (a hint: no effect on the result).
  void prefetch_row(const std::uint8_t* row) const {
#if defined(__GNUC__) || defined(__clang__)
    for (std::size_t b = 0; b < row_bytes_; b += 64) __builtin_prefetch(row + b);
#else
    (void)row;
#endif
  }

  // One fold of one key: f32 rows rotate in place (computed in double, rounded once); other types
  // are decoded exactly, rotated in double and rounded once.
  void rotate_key(int layer, int kv_head, std::int32_t slot, const double* cos_sin) {
    std::uint8_t* row = key_row(layer, kv_head, slot);
    if (type_ == KvType::f32) {
      rope_.rotate_with(reinterpret_cast<float*>(row), cos_sin);
      return;
    }
    decode_kv_row(type_, row, shape_.head_dim, row_scratch_.data());
    rope_.rotate_with(row_scratch_.data(), cos_sin);
    encode_kv_row(type_, row_scratch_.data(), shape_.head_dim, row);
  }

  CacheShape shape_;
  KeyStorage key_storage_;
  KvType type_;
  HeadSizing sizing_;
  std::size_t row_bytes_;
  std::vector<HeadRows> heads_;  // [layer * kv_heads + kv_head]
  Rope rope_;
  int capacity_ = 0;
  std::vector<double> angles_;                      // rotation scratch: [cos x pairs, sin x pairs]
  std::vector<double> row_scratch_;                 // one decoded key (folds of non-f32 rows)
  std::vector<std::pair<int, int>> rotated_heads_;  // (layer, kv_head) of one rotation's unit
  std::size_t bytes_rotated_ = 0;
  std::size_t bytes_copied_ = 0;
  std::size_t reserved_bytes_ = 0;
  std::size_t peak_reserved_bytes_ = 0;
};

}  // namespace kvevict
