// What a policy may observe (signals) and when it may evict (triggers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "kvevict/error.hpp"

namespace kvevict {

/// Inputs a policy may consume. A policy declares the set it needs; an engine computes only those
/// (attention probabilities in particular cost memory traffic and are skipped when nobody asks).
enum class Signal : std::uint32_t {
  token_ids = 1u << 0,           ///< ids of the tokens fed (AnLLM anchors are recognised by id)
  surprisal = 1u << 1,           ///< -log p(x_i | context) per token (SirLLM, InfiniPot NuC)
  attention_rows = 1u << 2,      ///< softmax rows of every query of the forward (H2O)
  last_attention_row = 1u << 3,  ///< softmax row of the forward's last query only (TOVA)
  turn_boundaries = 1u << 4,     ///< the engine says where a turn starts (SirLLM)
  catalyst_attention = 1u << 5,  ///< attention of a catalyst prompt run and rolled back (InfiniPot)
  keys = 1u << 6,                ///< the key vectors of the tokens fed, per layer (K-norm, KeyDiff)
};

/// When a policy may evict. Each trigger calls Policy::select with the trigger named.
enum class Trigger : std::uint8_t {
  after_forward,  ///< after every forward, once its signals were observed (Window, H2O, TOVA)
  before_turn,    ///< before a turn is fed, knowing its size (SirLLM)
  pot_full,  ///< the cache reached the policy's pot size; catalyst attention is ready (InfiniPot)
  anchor,    ///< after a forward whose input held an anchor token (AnLLM)
};

/// A small bit set over an enum whose values are distinct bits (Signal) or bit indices (Trigger).
template <class Enum, bool values_are_bits>
class FlagSet {
 public:
  constexpr FlagSet() = default;
  constexpr FlagSet(std::initializer_list<Enum> flags) {
    for (Enum flag : flags) bits_ |= bit(flag);
  }
  [[nodiscard]] constexpr bool contains(Enum flag) const { return (bits_ & bit(flag)) != 0; }
  [[nodiscard]] constexpr bool empty() const { return bits_ == 0; }
  constexpr FlagSet& operator|=(FlagSet other) {
    bits_ |= other.bits_;
    return *this;
  }
  [[nodiscard]] constexpr std::uint32_t bits() const { return bits_; }

 private:
  static constexpr std::uint32_t bit(Enum flag) {
    if constexpr (values_are_bits) {
      return static_cast<std::uint32_t>(flag);
    } else {
      return 1u << static_cast<std::uint32_t>(flag);
    }
  }
  std::uint32_t bits_ = 0;
};

using SignalSet = FlagSet<Signal, true>;
using TriggerSet = FlagSet<Trigger, false>;

/// Per-slot flags stored beside every cached token.
namespace slot_flag {
inline constexpr std::uint8_t sink = 1u << 0;      ///< protected as an attention sink
inline constexpr std::uint8_t anchor = 1u << 1;    ///< an anchor token (AnLLM)
inline constexpr std::uint8_t catalyst = 1u << 2;  ///< part of a catalyst prompt, rolled back later
}  // namespace slot_flag

/// Attention probabilities of one layer's newest queries, as an engine hands them to a policy.
///
/// Layout: `[q_heads][queries][row_stride]`, float. The row of query head `h` covers the slots
/// `[0, keys(h))` of the cache of KV head `h / group_size` in this layer, in slot order (slot s is
/// the slot kvevict gave the token: Sequence::chunk_slots, SlotTable::stream_order), as they stood
/// during the forward (the chunk's tokens appended, nothing evicted yet): keys(h) is the slot limit
/// of that head's unit. Free slots, entries past `keys(h)` and causally masked entries (a query's
/// later chunk-mates) are zero.
///
/// The rows may cover some of the layer's KV heads only, [first_kv_head, first_kv_head +
/// kv_heads()), as an engine that hands each KV head's rows over right after its softmax does
/// (Policy::attention_per_kv_head): query head h of the rows is then query head first_kv_head x
/// group_size + h of the layer.
class AttentionRows {
 public:
  AttentionRows(const float* data, int q_heads, int group_size, int queries,
                std::ptrdiff_t row_stride, std::span<const int> keys_per_kv_head,
                std::int64_t first_query_position, int first_kv_head = 0)
      : data_(data),
        q_heads_(q_heads),
        group_size_(group_size),
        queries_(queries),
        row_stride_(row_stride),
        keys_per_kv_head_(keys_per_kv_head),
        first_query_position_(first_query_position),
        first_kv_head_(first_kv_head) {
    KVEVICT_REQUIRE(q_heads > 0 && group_size > 0 && q_heads % group_size == 0,
                    "AttentionRows: q_heads must be a positive multiple of group_size");
    KVEVICT_REQUIRE(static_cast<int>(keys_per_kv_head.size()) == q_heads / group_size,
                    "AttentionRows: need one key count per KV head");
    KVEVICT_REQUIRE(queries >= 0, "AttentionRows: negative query count");
    KVEVICT_REQUIRE(first_kv_head >= 0, "AttentionRows: negative first KV head");
  }

  /// Query heads of the rows (of the layer when first_kv_head() is 0 and they cover every KV head).
  [[nodiscard]] int q_heads() const { return q_heads_; }
  /// KV heads of the rows: the layer's [first_kv_head(), first_kv_head() + kv_heads()).
  [[nodiscard]] int kv_heads() const { return q_heads_ / group_size_; }
  [[nodiscard]] int first_kv_head() const { return first_kv_head_; }
  [[nodiscard]] int group_size() const { return group_size_; }
  /// Number of query rows per head (the forward's queries, or 1 for last_attention_row).
  [[nodiscard]] int queries() const { return queries_; }
  [[nodiscard]] const float* data() const { return data_; }
  [[nodiscard]] std::ptrdiff_t row_stride() const { return row_stride_; }
  /// Original position of query row 0.
  [[nodiscard]] std::int64_t first_query_position() const { return first_query_position_; }
  /// Slots covered by the rows of query head `q_head`.
  [[nodiscard]] int keys(int q_head) const {
    return keys_per_kv_head_[static_cast<std::size_t>(q_head / group_size_)];
  }
  /// The same rows restricted to the last query (TOVA's score).
  [[nodiscard]] AttentionRows last_query() const {
    KVEVICT_REQUIRE(queries_ > 0, "AttentionRows: no query");
    return {data_ + static_cast<std::ptrdiff_t>(queries_ - 1) * row_stride_,
            q_heads_,
            group_size_,
            1,
            row_stride_ * queries_,
            keys_per_kv_head_,
            first_query_position_ + queries_ - 1,
            first_kv_head_};
  }
  /// The softmax row of query `query` of query head `q_head`, one probability per slot.
  [[nodiscard]] std::span<const float> row(int q_head, int query) const {
    return {data_ + (static_cast<std::ptrdiff_t>(q_head) * queries_ + query) * row_stride_,
            static_cast<std::size_t>(keys(q_head))};
  }

 private:
  const float* data_;
  int q_heads_;
  int group_size_;
  int queries_;
  std::ptrdiff_t row_stride_;
  std::span<const int> keys_per_kv_head_;
  std::int64_t first_query_position_;
  int first_kv_head_;
};

/// The key vectors of one layer's newest tokens (the current chunk), as an engine hands them to a
/// policy.
///
/// Layout: `[kv_heads][tokens][row_stride]`, float; each row holds `head_dim` values, the key after
/// RoPE at its token's position, as a post-RoPE cache holds it when written. Token k of KV head g
/// took slot `slots(g)[k]` of that head's unit (Sequence::chunk_slots).
class KeyRows {
 public:
  KeyRows(const float* data, int tokens, int head_dim, std::ptrdiff_t row_stride,
          std::span<const std::span<const std::int32_t>> slots_per_kv_head)
      : data_(data),
        tokens_(tokens),
        head_dim_(head_dim),
        row_stride_(row_stride),
        slots_(slots_per_kv_head) {
    KVEVICT_REQUIRE(tokens >= 0 && head_dim > 0 && row_stride >= head_dim,
                    "KeyRows: need tokens >= 0 and a row stride of at least head_dim");
    for (const std::span<const std::int32_t> slots : slots_) {
      KVEVICT_REQUIRE(static_cast<int>(slots.size()) == tokens,
                      "KeyRows: need one slot per token in every KV head");
    }
  }

  [[nodiscard]] int kv_heads() const { return static_cast<int>(slots_.size()); }
  [[nodiscard]] int tokens() const { return tokens_; }
  [[nodiscard]] int head_dim() const { return head_dim_; }
  /// The key of token `token` in KV head `kv_head`: head_dim values.
  [[nodiscard]] std::span<const float> key(int kv_head, int token) const {
    return {data_ + (static_cast<std::ptrdiff_t>(kv_head) * tokens_ + token) * row_stride_,
            static_cast<std::size_t>(head_dim_)};
  }
  /// The slot token `token` took in KV head `kv_head`'s unit.
  [[nodiscard]] std::int32_t slot(int kv_head, int token) const {
    return slots_[static_cast<std::size_t>(kv_head)][static_cast<std::size_t>(token)];
  }

 private:
  const float* data_;
  int tokens_;
  int head_dim_;
  std::ptrdiff_t row_stride_;
  std::span<const std::span<const std::int32_t>> slots_;
};

}  // namespace kvevict
