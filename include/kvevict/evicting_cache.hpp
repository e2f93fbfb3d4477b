// EvictingCache: a Sequence (engine.hpp) over kvevict's own KvStore, with RoPE: what the reference
// decoder (src/model/decoder_batch.cpp) drives. The forward protocol is the Sequence's
// (docs/design.md); this adds writing a chunk's K/V at its slots (write_chunk) and reading the
// stored rows back.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvevict/engine.hpp"
#include "kvevict/kv_store.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/rope.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/timing.hpp"

namespace kvevict {

struct CacheConfig {
  CacheShape shape;
  /// RoPE of the model; rope.head_dim 0 means shape.head_dim.
  RopeConfig rope;
  /// How keys and values are stored (kv_type.hpp); the engine side stays f32.
  KvType kv_type = KvType::f32;
  /// The sequence's settings (engine.hpp); layers, q_heads and kv_heads come from `shape`.
  SequenceConfig sequence;
};

/// Exact byte counts. "kv" counts keys and values, "metadata" the slot columns.
struct MemoryStats {
  std::size_t live_kv_bytes = 0;        ///< keys + values of live slots
  std::size_t live_metadata_bytes = 0;  ///< slot columns of live slots
  std::size_t reserved_bytes = 0;       ///< everything allocated for slots (K/V and metadata)
  std::size_t peak_live_bytes = 0;      ///< the largest live_bytes() seen since construction
  std::size_t peak_kv_bytes = 0;        ///< keys + values at that peak
  /// Keys + values allocated now, and the most at once (KvStore; under compact_slots each head's
  /// rows follow its use, else every head holds the whole capacity).
  std::size_t reserved_kv_bytes = 0;
  std::size_t peak_reserved_kv_bytes = 0;
  [[nodiscard]] std::size_t live_bytes() const { return live_kv_bytes + live_metadata_bytes; }
};

/// Keys and values are handed over and read back in f32; the storage type is CacheConfig::kv_type.
class EvictingCache {
 public:
  using Matrix = KvStore::Matrix;

  EvictingCache(const CacheConfig& config, std::unique_ptr<Policy> policy,
                StageObserver* observer = nullptr)
      : config_(validated(config)),
        rope_(config_.rope),
        store_(config_.shape, config_.rope, config_.sequence.key_storage, config_.kv_type,
               config_.sequence.compact_slots ? HeadSizing::by_use : HeadSizing::whole_capacity),
        sequence_(config_.sequence, std::move(policy), &store_, observer) {}

  [[nodiscard]] const CacheConfig& config() const { return config_; }
  [[nodiscard]] const Rope& rope() const { return rope_; }
  /// The forward protocol: begin_chunk, write_chunk here, attention, observe_*, end_forward.
  [[nodiscard]] Sequence& sequence() { return sequence_; }
  [[nodiscard]] const Sequence& sequence() const { return sequence_; }
  [[nodiscard]] const KvStore& store() const { return store_; }

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
    stats.reserved_kv_bytes = store_.reserved_bytes();
    stats.peak_reserved_kv_bytes = store_.peak_reserved_bytes();
    const auto peak_slots = static_cast<std::size_t>(slots.peak_total_live());
    stats.peak_kv_bytes = peak_slots * store_.kv_bytes_per_slot();
    stats.peak_live_bytes =
        stats.peak_kv_bytes + peak_slots / heads_per_unit * slots.bytes_per_slot();
    return stats;
  }

  /// Key and value bytes of the most tokens `unit` has held at once (each of its heads counted).
  [[nodiscard]] std::size_t unit_peak_kv_bytes(int unit) const {
    const SlotTable& slots = sequence_.slots();
    return static_cast<std::size_t>(slots.peak_live(unit)) *
           static_cast<std::size_t>(slots.layout().heads_per_unit()) * store_.kv_bytes_per_slot();
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
    const bool post_rope = config_.sequence.key_storage == KeyStorage::post_rope;
    key_scratch_.resize(static_cast<std::size_t>(keys.cols()));
    store_.fit(layer, kv_head, sequence_.slot_limit(layer, kv_head));
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

  /// Hands the keys write_chunk stored for `layer` (every KV head) to Sequence::observe_keys, for
  /// policies that read keys (Sequence::wants_keys()): each read back as stored (rounded to the KV
  /// type) and rotated to its token's position, as a post-RoPE cache holds a key when written,
  /// whatever rotation kvevict's storage defers (key_position) or applies later (pre_rope).
  void observe_stored_keys(int layer) {
    const CacheShape& shape = config_.shape;
    const auto head_dim = static_cast<std::size_t>(shape.head_dim);
    const int n = sequence_.chunk_size();
    const bool post_rope = config_.sequence.key_storage == KeyStorage::post_rope;
    stored_keys_.resize(static_cast<std::size_t>(shape.kv_heads) * static_cast<std::size_t>(n) *
                        head_dim);
    key_scratch_.resize(head_dim);
    for (int g = 0; g < shape.kv_heads; ++g) {
      const std::span<const std::int32_t> slots = sequence_.chunk_slots(layer, g);
      for (int i = 0; i < n; ++i) {
        const std::int32_t slot = slots[static_cast<std::size_t>(i)];
        store_.read_key(layer, g, slot, key_scratch_.data());
        const std::int64_t position = sequence_.position(layer, g, slot);
        const std::int64_t steps =
            post_rope ? position - sequence_.key_position(layer, g, slot) : position;
        if (steps != 0) rope_.rotate(key_scratch_.data(), steps);
        std::copy(key_scratch_.begin(), key_scratch_.end(),
                  stored_keys_.begin() + static_cast<std::ptrdiff_t>(
                                             (static_cast<std::size_t>(g) * n + i) * head_dim));
      }
    }
    sequence_.observe_keys(layer, stored_keys_.data(), static_cast<std::ptrdiff_t>(head_dim));
  }

  /// Stored keys of slots [0, slot_limit) of head (layer, kv_head), f32 storage only (any type:
  /// stored_keys). Post-RoPE: rotated to their key positions (attend per for_each_key_run);
  /// pre-RoPE: unrotated (see rotated_keys).
  [[nodiscard]] Eigen::Map<const Matrix> keys(int layer, int kv_head) const {
    return store_.keys(layer, kv_head, sequence_.slot_limit(layer, kv_head));
  }
  [[nodiscard]] Eigen::Map<const Matrix> values(int layer, int kv_head) const {
    return store_.values(layer, kv_head, sequence_.slot_limit(layer, kv_head));
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
    KVEVICT_REQUIRE(config_.sequence.key_storage == KeyStorage::pre_rope,
                    "rotated_keys: keys are stored after RoPE already");
    const int limit = sequence_.slot_limit(layer, kv_head);
    if (scratch.rows() < store_.capacity() || scratch.cols() != config_.shape.head_dim) {
      scratch.resize(store_.capacity(), config_.shape.head_dim);
    }
    const int unit = sequence_.unit_of(layer, kv_head);
    const std::span<const std::int64_t> originals = sequence_.slots().original_positions(unit);
    sequence_.slots().for_each_position_run(unit, [&](int begin, int end, std::int64_t offset) {
      for (int s = begin; s < end; ++s) {
        store_.read_key(layer, kv_head, s, scratch.row(s).data());
        rope_.rotate(scratch.row(s).data(), originals[static_cast<std::size_t>(s)] + offset);
      }
    });
    return {scratch.data(), limit, config_.shape.head_dim};
  }
  /// Reference q . k of one pre-RoPE query at RoPE position `query_position` against every slot of
  /// head (layer, kv_head): out[s] for live slots, -infinity for free ones (out holds slot_limit
  /// values). With post-RoPE keys the query is rotated once per run (to its position minus the
  /// run's pending rotation); with pre-RoPE keys every key is rotated to its position. Unscaled.
  void dot_products(int layer, int kv_head, std::span<const float> query,
                    std::int64_t query_position, std::span<float> out) const {
    const int limit = sequence_.slot_limit(layer, kv_head);
    KVEVICT_REQUIRE(static_cast<int>(query.size()) == config_.shape.head_dim &&
                        static_cast<int>(out.size()) >= limit,
                    "dot_products: need head_dim query values and slot_limit outputs");
    std::fill(out.begin(), out.begin() + limit, -std::numeric_limits<float>::infinity());
    std::vector<float> rotated(query.begin(), query.end());
    const bool post_rope = config_.sequence.key_storage == KeyStorage::post_rope;
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
      const Eigen::Map<const Eigen::VectorXf> q(rotated.data(), config_.shape.head_dim);
      for (int s = begin; s < end; ++s) {
        out[static_cast<std::size_t>(s)] = static_cast<float>(keys.row(s).dot(q.transpose()));
      }
    };
    const int unit = sequence_.unit_of(layer, kv_head);
    if (post_rope) {
      sequence_.slots().for_each_key_run(unit, score);
    } else {
      sequence_.slots().for_each_position_run(unit, score);
    }
  }

 private:
  static CacheConfig validated(CacheConfig config) {
    config.shape.validate();
    if (config.rope.head_dim == 0) config.rope.head_dim = config.shape.head_dim;
    KVEVICT_REQUIRE(config.rope.head_dim == config.shape.head_dim,
                    "EvictingCache: rope.head_dim (" + std::to_string(config.rope.head_dim) +
                        ") differs from shape.head_dim (" + std::to_string(config.shape.head_dim) +
                        ")");
    KVEVICT_REQUIRE(
        (config.sequence.layers == 0 || config.sequence.layers == config.shape.layers) &&
            (config.sequence.q_heads == 0 || config.sequence.q_heads == config.shape.q_heads) &&
            (config.sequence.kv_heads == 0 || config.sequence.kv_heads == config.shape.kv_heads) &&
            (config.sequence.head_dim == 0 || config.sequence.head_dim == config.shape.head_dim),
        "EvictingCache: the sequence's layers, heads and head_dim come from the shape (leave them "
        "0)");
    config.sequence.layers = config.shape.layers;
    config.sequence.q_heads = config.shape.q_heads;
    config.sequence.kv_heads = config.shape.kv_heads;
    config.sequence.head_dim = config.shape.head_dim;
    const auto token_bytes =
        static_cast<std::int64_t>(2 * kv_row_bytes(config.kv_type, config.shape.head_dim));
    KVEVICT_REQUIRE(config.sequence.token_bytes == 0 || config.sequence.token_bytes == token_bytes,
                    "EvictingCache: the sequence's token_bytes (" +
                        std::to_string(config.sequence.token_bytes) + ") differ from the " +
                        std::to_string(token_bytes) + " of the KV type (leave it 0)");
    config.sequence.token_bytes = token_bytes;
    return config;
  }
  CacheConfig config_;
  Rope rope_;
  KvStore store_;
  Sequence sequence_;
  std::vector<double> key_scratch_;  // one key on its way to the store
  std::vector<float> stored_keys_;   // [kv_heads][chunk][head_dim] for observe_stored_keys
};

}  // namespace kvevict
