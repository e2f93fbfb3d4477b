// EvictingCache: a KvStore driven by an EvictionPipeline, the one object a decoder talks to.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "eager/kv_store.hpp"
#include "eager/pipeline.hpp"
#include "eager/policy.hpp"
#include "eager/positions.hpp"
#include "eager/rope.hpp"
#include "eager/shape.hpp"

namespace kvevict::eager {

struct CacheConfig {
  CacheShape shape;
  /// RoPE of the model; rope.head_dim must equal shape.head_dim.
  RopeConfig rope;
  /// Defaults to the policy's own position mode.
  std::optional<PositionMode> position_mode;
  KeyStorage key_storage = KeyStorage::pre_rope;
  /// Largest chunk the engine will feed (and catalyst prompt it will run): sizes the buffers so
  /// that a bounded policy never reallocates. Unbounded policies grow geometrically.
  int max_chunk = 1;
  /// Slots reserved up front; 0 = retained_limit() + max_chunk, or 256 for unbounded policies.
  int initial_capacity = 0;
};

/// Keys, values and slot metadata of one sequence plus its policy. Usage per forward:
///   begin_chunk(ids, turn_start);                           // may evict (before_turn)
///   for each layer: write_chunk(l, g, keys, values);        // pre-RoPE keys of the chunk
///                   attention_keys(l, g, scratch) / values(l, g) / positions(l, g);
///                   observe_attention(l, rows) if wants(attention rows)
///   observe_surprisal(...) if wants(Signal::surprisal)
///   end_forward();                                          // may evict
///   if (catalyst_pending()) { begin_catalyst(ids); ... write_chunk ...; observe_catalyst(...);
///                             end_catalyst(); }
template <class Scalar = float>
class EvictingCache {
 public:
  using Matrix = typename KvStore<Scalar>::Matrix;

  EvictingCache(const CacheConfig& config, std::unique_ptr<Policy> policy)
      : config_(validated(config, policy.get())),
        rope_(config_.rope),
        store_(config_.shape, planned_capacity(config_, *policy), policy->score_columns()),
        pipeline_(store_.slots(), std::move(policy), config_.position_mode) {}

  [[nodiscard]] const CacheConfig& config() const { return config_; }
  [[nodiscard]] const Rope& rope() const { return rope_; }
  [[nodiscard]] KvStore<Scalar>& store() { return store_; }
  [[nodiscard]] const KvStore<Scalar>& store() const { return store_; }
  [[nodiscard]] EvictionPipeline& pipeline() { return pipeline_; }
  [[nodiscard]] const EvictionPipeline& pipeline() const { return pipeline_; }
  [[nodiscard]] Policy& policy() { return pipeline_.policy(); }
  [[nodiscard]] bool wants(Signal signal) const { return pipeline_.wants(signal); }
  [[nodiscard]] int live(int layer, int kv_head) const { return store_.live(layer, kv_head); }
  [[nodiscard]] MemoryStats memory() const { return store_.memory(); }
  /// Stage timing of the eviction path (EvictionTiming; off by default, no clock read while off).
  /// Reposition time includes this cache's K/V gather and post-RoPE key re-rotation.
  void set_timing(bool enabled) { pipeline_.set_timing(enabled); }
  [[nodiscard]] const EvictionTiming& timing() const { return pipeline_.timing(); }

  /// Starts a forward over `token_ids`: evicts first if the policy does so before a turn, then
  /// appends the tokens' slots to every head (growing the buffers only if they are too small).
  void begin_chunk(std::span<const std::int32_t> token_ids, bool turn_start = false) {
    const int n = static_cast<int>(token_ids.size());
    if (const CompactionPlan* plan = pipeline_.before_chunk(n, turn_start)) apply_kv(*plan);
    ensure_room(n);
    pipeline_.append_chunk(token_ids);
    chunk_size_ = n;
  }

  /// Stores the chunk's keys (before RoPE, [n, head_dim]) and values for head (layer, kv_head).
  /// With post-RoPE storage the keys are rotated to their positions here.
  void write_chunk(int layer, int kv_head, const Eigen::Ref<const Matrix>& keys,
                   const Eigen::Ref<const Matrix>& values) {
    const int end = store_.live(layer, kv_head);
    KVEVICT_REQUIRE(keys.rows() == chunk_size_ && values.rows() == chunk_size_,
                    "write_chunk: expected " + std::to_string(chunk_size_) + " rows, got " +
                        std::to_string(keys.rows()) + " keys and " + std::to_string(values.rows()) +
                        " values");
    Eigen::Map<Matrix> key_rows = store_.key_rows(layer, kv_head, end - chunk_size_, end);
    key_rows = keys;
    store_.value_rows(layer, kv_head, end - chunk_size_, end) = values;
    if (config_.key_storage == KeyStorage::post_rope) {
      rope_.rotate_rows(key_rows.data(), key_rows.cols(),
                        store_.slots().positions(layer, kv_head).last(chunk_size_));
    }
  }

  /// Keys of head (layer, kv_head) rotated to their positions, [live, head_dim]: the stored keys
  /// with post-RoPE storage, else a rotated copy written to `scratch`. `scratch` is grown to the
  /// store's capacity once and then reused, so repeated calls do not allocate.
  [[nodiscard]] Eigen::Map<const Matrix> attention_keys(int layer, int kv_head,
                                                        Matrix& scratch) const {
    if (config_.key_storage == KeyStorage::post_rope) return store_.keys(layer, kv_head);
    const Eigen::Map<const Matrix> keys = store_.keys(layer, kv_head);
    if (scratch.rows() < store_.capacity() || scratch.cols() != keys.cols()) {
      scratch.resize(store_.capacity(), keys.cols());
    }
    Eigen::Map<Matrix> rotated(scratch.data(), keys.rows(), keys.cols());
    rotated = keys;
    rope_.rotate_rows(rotated.data(), rotated.cols(), store_.slots().positions(layer, kv_head));
    return {rotated.data(), rotated.rows(), rotated.cols()};
  }
  [[nodiscard]] Eigen::Map<const Matrix> values(int layer, int kv_head) const {
    return store_.values(layer, kv_head);
  }
  /// RoPE position of every live slot of head (layer, kv_head); the chunk's queries sit at the
  /// positions of its last chunk_size() slots.
  [[nodiscard]] std::span<const std::int64_t> positions(int layer, int kv_head) const {
    return store_.slots().positions(layer, kv_head);
  }
  [[nodiscard]] int chunk_size() const { return chunk_size_; }

  void observe_attention(int layer, const AttentionRows& rows) {
    pipeline_.observe_attention(layer, rows);
  }
  void observe_surprisal(std::span<const float> surprisal) {
    pipeline_.observe_surprisal(surprisal);
  }

  /// Ends the forward: evicts if the policy does so now.
  void end_forward() {
    if (const CompactionPlan* plan = pipeline_.end_forward()) apply_kv(*plan);
  }

  [[nodiscard]] bool catalyst_pending() const { return pipeline_.catalyst_pending(); }
  /// Tokens that fit before the policy's pot is full (split chunks there), or nullopt.
  [[nodiscard]] std::optional<int> pot_room() const { return pipeline_.pot_room(); }
  /// Appends a catalyst prompt; write its K/V with write_chunk, attend, observe_catalyst.
  void begin_catalyst(std::span<const std::int32_t> token_ids) {
    ensure_room(static_cast<int>(token_ids.size()));
    pipeline_.begin_catalyst(token_ids);
    chunk_size_ = static_cast<int>(token_ids.size());
  }
  void observe_catalyst(int layer, const AttentionRows& rows) {
    pipeline_.observe_catalyst(layer, rows);
  }
  /// Rolls the catalyst back and distills the pot.
  void end_catalyst() {
    if (const CompactionPlan* plan = pipeline_.end_catalyst()) apply_kv(*plan);
    chunk_size_ = 0;
  }

 private:
  static CacheConfig validated(CacheConfig config, const Policy* policy) {
    KVEVICT_REQUIRE(policy != nullptr, "EvictingCache: policy is null");
    config.shape.validate();
    if (config.rope.head_dim == 0) config.rope.head_dim = config.shape.head_dim;
    KVEVICT_REQUIRE(config.rope.head_dim == config.shape.head_dim,
                    "EvictingCache: rope.head_dim (" + std::to_string(config.rope.head_dim) +
                        ") differs from shape.head_dim (" + std::to_string(config.shape.head_dim) +
                        ")");
    KVEVICT_REQUIRE(config.max_chunk > 0, "EvictingCache: max_chunk must be positive");
    KVEVICT_REQUIRE(config.initial_capacity >= 0, "EvictingCache: negative initial_capacity");
    return config;
  }
  static int planned_capacity(const CacheConfig& config, const Policy& policy) {
    if (config.initial_capacity > 0) return config.initial_capacity;
    const std::optional<int> limit = policy.retained_limit();
    return limit ? *limit + config.max_chunk : std::max(256, config.max_chunk);
  }
  void ensure_room(int incoming) {
    const int needed = pipeline_.required_capacity(incoming);
    if (needed > store_.capacity()) store_.reserve(std::max(needed, 2 * store_.capacity()));
  }
  void apply_kv(const CompactionPlan& plan) {
    const EvictionTiming::Clock::time_point start = pipeline_.timing_now();
    store_.apply_kv(plan, config_.key_storage == KeyStorage::post_rope ? &rope_ : nullptr);
    pipeline_.add_reposition_time(pipeline_.timing_now() - start);
  }

  CacheConfig config_;
  Rope rope_;
  KvStore<Scalar> store_;
  EvictionPipeline pipeline_;
  int chunk_size_ = 0;
};

}  // namespace kvevict::eager
