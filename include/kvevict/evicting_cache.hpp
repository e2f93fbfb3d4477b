// EvictingCache: a Sequence over kvevict's own KvStore, the one object a decoder talks to.
//
// Usage per forward (the reference decoder, src/model/decoder.cpp, is the worked example):
//   begin_chunk(ids, turn_start);                      // may evict (before_turn)
//   for each layer, KV head:
//     write_chunk(l, g, keys_pre_rope, values);        // at chunk_slots(l, g), keys rotated here
//     attend over slots [0, slot_limit(l, g)): post-RoPE keys per for_each_key_run (rotate the
//       query to its position minus the run's rotation), pre-RoPE keys rotated by rotated_keys();
//     observe_attention(l, rows) if wants(...);
//   observe_surprisal(values) if wants(...);
//   end_forward();                                     // evicts: metadata only
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/kv_store.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/rope.hpp"
#include "kvevict/sequence.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/timing.hpp"

namespace kvevict {

struct CacheConfig {
  CacheShape shape;
  /// RoPE of the model; rope.head_dim 0 means shape.head_dim.
  RopeConfig rope;
  /// Defaults to the policy's own.
  std::optional<PositionMode> position_mode;
  /// Defaults to the policy's own.
  std::optional<Granularity> granularity;
  KeyStorage key_storage = KeyStorage::pre_rope;
  /// How keys and values are stored (kv_type.hpp); the engine side stays f32.
  KvType kv_type = KvType::f32;
  /// Largest chunk the engine will feed (and catalyst prompt it will run): sizes the buffers so
  /// that a bounded policy never reallocates. Unbounded policies grow geometrically.
  int max_chunk = 1;
  /// Slots reserved up front; 0 = retained_limit() + max_chunk, or 256 for unbounded policies.
  int initial_capacity = 0;
  /// SequenceConfig::max_initial_capacity: 0 = reserve everything the policy may hold up front.
  int max_initial_capacity = 0;
  /// See SequenceConfig::max_pending_rotations.
  int max_pending_rotations = 32;
};

/// Exact byte counts. "kv" counts keys and values, "metadata" the slot columns.
struct MemoryStats {
  std::size_t live_kv_bytes = 0;        ///< keys + values of live slots
  std::size_t live_metadata_bytes = 0;  ///< slot columns of live slots
  std::size_t reserved_bytes = 0;       ///< everything allocated for slots (K/V and metadata)
  std::size_t peak_live_bytes = 0;      ///< the largest live_bytes() seen since construction
  std::size_t peak_kv_bytes = 0;        ///< keys + values at that peak
  [[nodiscard]] std::size_t live_bytes() const { return live_kv_bytes + live_metadata_bytes; }
};

/// `Scalar` is the type keys and values are handed over and read back in (float); the storage type
/// is CacheConfig::kv_type.
template <class Scalar = float>
class EvictingCache {
  static_assert(std::is_same_v<Scalar, float>, "EvictingCache: keys and values are f32");

 public:
  using Matrix = KvStore::Matrix;

  EvictingCache(const CacheConfig& config, std::unique_ptr<Policy> policy,
                StageObserver* observer = nullptr)
      : config_(validated(config)),
        rope_(config_.rope),
        store_(config_.shape, config_.rope, config_.key_storage, config_.kv_type),
        sequence_(sequence_config(config_), std::move(policy), &store_, observer) {}

  [[nodiscard]] const CacheConfig& config() const { return config_; }
  [[nodiscard]] const Rope& rope() const { return rope_; }
  [[nodiscard]] Sequence& sequence() { return sequence_; }
  [[nodiscard]] const Sequence& sequence() const { return sequence_; }
  [[nodiscard]] const KvStore& store() const { return store_; }
  [[nodiscard]] const SlotTable& slots() const { return sequence_.slots(); }
  [[nodiscard]] Policy& policy() { return sequence_.policy(); }
  [[nodiscard]] bool wants(Signal signal) const { return sequence_.wants(signal); }
  [[nodiscard]] int live(int layer, int kv_head) const { return sequence_.live(layer, kv_head); }
  [[nodiscard]] int slot_limit(int layer, int kv_head) const {
    return sequence_.slot_limit(layer, kv_head);
  }
  [[nodiscard]] int chunk_size() const { return sequence_.chunk_size(); }
  [[nodiscard]] std::span<const std::int32_t> chunk_slots(int layer, int kv_head) const {
    return sequence_.chunk_slots(layer, kv_head);
  }
  void set_observer(StageObserver* observer) { sequence_.set_observer(observer); }

  [[nodiscard]] MemoryStats memory() const {
    const SlotTable& slots = sequence_.slots();
    MemoryStats stats;
    const auto live_slots = static_cast<std::size_t>(slots.total_live());
    const auto heads_per_unit = static_cast<std::size_t>(slots.layout().heads_per_unit());
    stats.live_kv_bytes = live_slots * store_.kv_bytes_per_slot();
    // Metadata is kept once per unit, shared by the unit's heads.
    stats.live_metadata_bytes = live_slots / heads_per_unit * slots.bytes_per_slot();
    stats.reserved_bytes = store_.reserved_bytes() + static_cast<std::size_t>(slots.capacity()) *
                                                         static_cast<std::size_t>(slots.units()) *
                                                         slots.bytes_per_slot();
    const auto peak_slots = static_cast<std::size_t>(slots.peak_total_live());
    stats.peak_kv_bytes = peak_slots * store_.kv_bytes_per_slot();
    stats.peak_live_bytes =
        stats.peak_kv_bytes + peak_slots / heads_per_unit * slots.bytes_per_slot();
    return stats;
  }

  /// Starts a forward over `token_ids` (Sequence::begin_chunk).
  void begin_chunk(std::span<const std::int32_t> token_ids, bool turn_start = false) {
    sequence_.begin_chunk(token_ids, turn_start);
  }

  /// Stores the chunk's keys (before RoPE, [n, head_dim]) and values of head (layer, kv_head) at
  /// its chunk slots. With post-RoPE storage each key is rotated to its key position here.
  void write_chunk(int layer, int kv_head, const Eigen::Ref<const Matrix>& keys,
                   const Eigen::Ref<const Matrix>& values) {
    const std::span<const std::int32_t> slots = sequence_.chunk_slots(layer, kv_head);
    KVEVICT_REQUIRE(
        keys.rows() == static_cast<Eigen::Index>(slots.size()) && values.rows() == keys.rows() &&
            keys.cols() == config_.shape.head_dim && values.cols() == keys.cols(),
        "write_chunk: expected " + std::to_string(slots.size()) + " rows of " +
            std::to_string(config_.shape.head_dim) + " keys and values, got [" +
            std::to_string(keys.rows()) + ", " + std::to_string(keys.cols()) + "] and [" +
            std::to_string(values.rows()) + ", " + std::to_string(values.cols()) + "]");
    const bool post_rope = config_.key_storage == KeyStorage::post_rope;
    key_scratch_.resize(static_cast<std::size_t>(keys.cols()));
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const auto row = static_cast<Eigen::Index>(i);
      // Rotated in double and rounded once to the storage type.
      for (Eigen::Index c = 0; c < keys.cols(); ++c) key_scratch_[c] = keys(row, c);
      if (post_rope) {
        rope_.rotate(key_scratch_.data(), sequence_.key_position(layer, kv_head, slots[i]));
      }
      store_.write_key(layer, kv_head, slots[i], key_scratch_.data());
      store_.write_value(layer, kv_head, slots[i], values.data() + row * values.outerStride());
    }
  }

  /// Stored keys of slots [0, slot_limit) of head (layer, kv_head), f32 storage only (any type:
  /// stored_keys). Post-RoPE: rotated to their key positions (attend per for_each_key_run);
  /// pre-RoPE: unrotated (see rotated_keys).
  [[nodiscard]] Eigen::Map<const Matrix> keys(int layer, int kv_head) const {
    return store_.keys(layer, kv_head, slot_limit(layer, kv_head));
  }
  [[nodiscard]] Eigen::Map<const Matrix> values(int layer, int kv_head) const {
    return store_.values(layer, kv_head, slot_limit(layer, kv_head));
  }
  /// Keys / values of slots [0, capacity) of head (layer, kv_head) as stored (read slot_limit).
  [[nodiscard]] StoredRows stored_keys(int layer, int kv_head) const {
    return store_.stored_keys(layer, kv_head);
  }
  [[nodiscard]] StoredRows stored_values(int layer, int kv_head) const {
    return store_.stored_values(layer, kv_head);
  }
  /// Pre-RoPE storage: the keys of slots [0, slot_limit) rotated to their positions, written to
  /// `scratch` (grown to the capacity once, then reused). Free slots' rows are left stale.
  [[nodiscard]] Eigen::Map<const Matrix> rotated_keys(int layer, int kv_head,
                                                      Matrix& scratch) const {
    KVEVICT_REQUIRE(config_.key_storage == KeyStorage::pre_rope,
                    "rotated_keys: keys are stored after RoPE already");
    const int limit = slot_limit(layer, kv_head);
    if (scratch.rows() < store_.capacity() || scratch.cols() != config_.shape.head_dim) {
      scratch.resize(store_.capacity(), config_.shape.head_dim);
    }
    const std::span<const std::int64_t> originals =
        sequence_.slots().original_positions(sequence_.unit_of(layer, kv_head));
    sequence_.for_each_position_run(layer, kv_head, [&](int begin, int end, std::int64_t offset) {
      for (int s = begin; s < end; ++s) {
        store_.read_key(layer, kv_head, s, scratch.row(s).data());
        rope_.rotate(scratch.row(s).data(), originals[static_cast<std::size_t>(s)] + offset);
      }
    });
    return {scratch.data(), limit, config_.shape.head_dim};
  }
  /// RoPE position of live slot `slot` of head (layer, kv_head).
  [[nodiscard]] std::int64_t position(int layer, int kv_head, std::int32_t slot) const {
    return sequence_.position(layer, kv_head, slot);
  }
  template <class Fn>
  void for_each_key_run(int layer, int kv_head, Fn&& fn) const {
    sequence_.for_each_key_run(layer, kv_head, std::forward<Fn>(fn));
  }

  /// Reference q . k of one pre-RoPE query at RoPE position `query_position` against every slot of
  /// head (layer, kv_head): out[s] for live slots, -infinity for free ones (out holds slot_limit
  /// values). With post-RoPE keys the query is rotated once per run (to its position minus the
  /// run's pending rotation); with pre-RoPE keys every key is rotated to its position. Unscaled.
  void dot_products(int layer, int kv_head, std::span<const Scalar> query,
                    std::int64_t query_position, std::span<float> out) const {
    const int limit = slot_limit(layer, kv_head);
    KVEVICT_REQUIRE(static_cast<int>(query.size()) == config_.shape.head_dim &&
                        static_cast<int>(out.size()) >= limit,
                    "dot_products: need head_dim query values and slot_limit outputs");
    std::fill(out.begin(), out.begin() + limit, -std::numeric_limits<float>::infinity());
    std::vector<Scalar> rotated(query.begin(), query.end());
    const bool post_rope = config_.key_storage == KeyStorage::post_rope;
    Matrix decoded;  // post-RoPE: the stored keys decoded; pre-RoPE: rotated to their positions
    if (post_rope) {
      decoded.resize(limit, config_.shape.head_dim);
      for (int s = 0; s < limit; ++s) store_.read_key(layer, kv_head, s, decoded.row(s).data());
    }
    const Eigen::Map<const Matrix> keys =
        post_rope ? Eigen::Map<const Matrix>(decoded.data(), limit, config_.shape.head_dim)
                  : rotated_keys(layer, kv_head, decoded);
    const auto score = [&](int begin, int end, std::int64_t rotation) {
      std::copy(query.begin(), query.end(), rotated.begin());
      rope_.rotate(rotated.data(), query_position - (post_rope ? rotation : 0));
      const Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> q(rotated.data(),
                                                                         config_.shape.head_dim);
      for (int s = begin; s < end; ++s) {
        out[static_cast<std::size_t>(s)] = static_cast<float>(keys.row(s).dot(q.transpose()));
      }
    };
    if (post_rope) {
      sequence_.for_each_key_run(layer, kv_head, score);
    } else {
      sequence_.for_each_position_run(layer, kv_head, score);
    }
  }

  void observe_attention(int layer, const AttentionRows& rows) {
    sequence_.observe_attention(layer, rows);
  }
  void observe_surprisal(std::span<const float> surprisal) {
    sequence_.observe_surprisal(surprisal);
  }
  void end_forward() { sequence_.end_forward(); }

  [[nodiscard]] bool catalyst_pending() const { return sequence_.catalyst_pending(); }
  [[nodiscard]] std::optional<int> pot_room() const { return sequence_.pot_room(); }
  void begin_catalyst(std::span<const std::int32_t> token_ids) {
    sequence_.begin_catalyst(token_ids);
  }
  void observe_catalyst(int layer, const AttentionRows& rows) {
    sequence_.observe_catalyst(layer, rows);
  }
  void end_catalyst() { sequence_.end_catalyst(); }

 private:
  static CacheConfig validated(CacheConfig config) {
    config.shape.validate();
    if (config.rope.head_dim == 0) config.rope.head_dim = config.shape.head_dim;
    KVEVICT_REQUIRE(config.rope.head_dim == config.shape.head_dim,
                    "EvictingCache: rope.head_dim (" + std::to_string(config.rope.head_dim) +
                        ") differs from shape.head_dim (" + std::to_string(config.shape.head_dim) +
                        ")");
    return config;
  }
  static SequenceConfig sequence_config(const CacheConfig& config) {
    SequenceConfig sequence;
    sequence.layers = config.shape.layers;
    sequence.q_heads = config.shape.q_heads;
    sequence.kv_heads = config.shape.kv_heads;
    sequence.position_mode = config.position_mode;
    sequence.granularity = config.granularity;
    sequence.key_storage = config.key_storage;
    sequence.max_chunk = config.max_chunk;
    sequence.initial_capacity = config.initial_capacity;
    sequence.max_initial_capacity = config.max_initial_capacity;
    sequence.max_pending_rotations = config.max_pending_rotations;
    return sequence;
  }

  CacheConfig config_;
  Rope rope_;
  KvStore store_;
  Sequence sequence_;
  std::vector<double> key_scratch_;  // one key on its way to the store
};

}  // namespace kvevict
