// The implementation behind kvevict/engine.hpp: Sequence's state and logic (detail::SequenceCore)
// and the definitions of the engine view's functions. Included by engine.hpp only.
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvevict/attention_scores.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/decision.hpp"
#include "kvevict/detail/row_passes.hpp"
#include "kvevict/error.hpp"
#include "kvevict/granularity.hpp"
#include "kvevict/policies/allocated.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/signals.hpp"
#include "kvevict/slot_table.hpp"
#include "kvevict/timing.hpp"

namespace kvevict {
namespace detail {

// Checks the order of events and the signals the policy needs, keeps the slot metadata, and applies
// every decision to the engine's memory in one KvBackend::apply call.
class SequenceCore {
 public:
  SequenceCore(const SequenceConfig& config, std::unique_ptr<Policy> policy, KvBackend* backend,
               StageObserver* observer)
      : config_(validated(config)),
        policy_(std::move(policy)),
        backend_(backend),
        observer_(observer) {
    KVEVICT_REQUIRE(policy_ != nullptr, "Sequence: policy is null");
    KVEVICT_REQUIRE(!wants(Signal::keys) || config_.head_dim > 0,
                    "Sequence: policy '" + std::string(policy_->name()) +
                        "' reads the keys: set SequenceConfig::head_dim to their length");
    position_mode_ = config_.position_mode.value_or(policy_->default_position_mode());
    layout_ = UnitLayout(config_.layers, config_.kv_heads,
                         config_.granularity.value_or(policy_->default_granularity()));
    if (config_.budget_tokens > 0 || config_.budget_bytes > 0 ||
        config_.allocation != Allocation::uniform) {
      policy_ = std::make_unique<Allocated>(
          std::move(policy_),
          AllocationConfig{config_.allocation, config_.budget_tokens, config_.budget_bytes,
                           config_.token_bytes, config_.pyramid_beta, config_.adaptive_floor},
          layout_);
    }
    if (layout_.granularity().kind() == Granularity::Kind::block && !policy_->supports_blocks()) {
      throw Error("policy '" + std::string(policy_->name()) + "' has no block form of its keep " +
                  "rule, so granularity " + to_string(layout_.granularity()) +
                  " is not available to it (window, streaming_llm, h2o, tova and full have one): "
                  "use head, layer or token");
    }
    policy_->check_sequence(layout_, config_.q_heads / config_.kv_heads);
    const int capacity = initial_capacity();
    slots_ =
        SlotTable(layout_, position_mode_, capacity, policy_->score_columns(), config_.slot_reuse);
    if (backend_ != nullptr) backend_->reserve(capacity);
    decision_.reset(layout_.units());
    chunk_slots_.resize(static_cast<std::size_t>(layout_.units()));
    catalyst_base_.assign(static_cast<std::size_t>(layout_.units()), 0);
    observed_heads_.assign(static_cast<std::size_t>(config_.layers) * config_.kv_heads, 0);
    observed_key_layers_.assign(static_cast<std::size_t>(config_.layers), 0);
    layer_chunk_slots_.resize(static_cast<std::size_t>(config_.kv_heads));
    key_runs_.resize(static_cast<std::size_t>(layout_.units()));
    live_masks_.resize(static_cast<std::size_t>(layout_.units()));
    layer_keys_.resize(static_cast<std::size_t>(config_.kv_heads));
  }

  [[nodiscard]] const SequenceConfig& config() const { return config_; }
  [[nodiscard]] const Policy& policy() const { return *policy_; }
  [[nodiscard]] const SlotTable& slots() const { return slots_; }
  [[nodiscard]] PositionMode position_mode() const { return position_mode_; }
  [[nodiscard]] Granularity granularity() const { return layout_.granularity(); }
  [[nodiscard]] int capacity() const { return slots_.capacity(); }
  [[nodiscard]] const SequenceStats& stats() const { return stats_; }
  [[nodiscard]] bool wants(Signal signal) const { return policy_->signals().contains(signal); }
  void set_observer(StageObserver* observer) { observer_ = observer; }
  [[nodiscard]] StageObserver* observer() const { return observer_; }
  [[nodiscard]] bool wants_attention() const {
    return wants(Signal::attention_rows) || wants(Signal::last_attention_row);
  }
  [[nodiscard]] int attention_queries() const {
    if (wants(Signal::attention_rows)) return chunk_size();
    return wants(Signal::last_attention_row) && chunk_size() > 0 ? 1 : 0;
  }

  // --- what attention needs, per head ----------------------------------------------------------
  [[nodiscard]] int unit_of(int layer, int kv_head) const {
    check_head(layer, kv_head);
    return layout_.unit_of(layer, kv_head);
  }
  [[nodiscard]] int live(int layer, int kv_head) const {
    return slots_.live(unit_of(layer, kv_head));
  }
  /// Attention over head (layer, kv_head) covers slots [0, slot_limit) and skips the free ones.
  [[nodiscard]] int slot_limit(int layer, int kv_head) const {
    return slots_.slot_limit(unit_of(layer, kv_head));
  }
  /// Slot of every token of the current chunk (or catalyst) in head (layer, kv_head).
  [[nodiscard]] std::span<const std::int32_t> chunk_slots(int layer, int kv_head) const {
    return chunk_slots_[static_cast<std::size_t>(unit_of(layer, kv_head))];
  }
  /// RoPE position of live slot `slot` of head (layer, kv_head).
  [[nodiscard]] std::int64_t position(int layer, int kv_head, std::int32_t slot) const {
    return slots_.position(unit_of(layer, kv_head), slot);
  }
  /// Position a post-RoPE key at `slot` is (to be) stored rotated to.
  [[nodiscard]] std::int64_t key_position(int layer, int kv_head, std::int32_t slot) const {
    return slots_.key_position(unit_of(layer, kv_head), slot);
  }
  [[nodiscard]] std::span<const KeyRun> key_runs(int layer, int kv_head) const {
    require_attention_views("key_runs");
    return key_runs_[static_cast<std::size_t>(unit_of(layer, kv_head))];
  }
  [[nodiscard]] std::span<const std::uint8_t> live_mask(int layer, int kv_head) const {
    require_attention_views("live_mask");
    return live_masks_[static_cast<std::size_t>(unit_of(layer, kv_head))];
  }

  // --- per forward -----------------------------------------------------------------------------

  /// Starts a forward over `token_ids`: evicts first if the policy does so before a turn, then
  /// gives every token a slot in every head (chunk_slots).
  void begin_chunk(std::span<const std::int32_t> token_ids, bool turn_start = false) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::idle, state_ == State::forward
                                               ? "begin_chunk: the previous forward was not ended "
                                                 "(call end_forward)"
                                               : "begin_chunk: a catalyst prompt is open (call "
                                                 "end_catalyst)");
    KVEVICT_REQUIRE(!token_ids.empty(), "begin_chunk: a chunk needs at least one token");
    const int n = static_cast<int>(token_ids.size());
    if (turn_start) ++stats_.turns;
    if (turn_start && policy_->triggers().contains(Trigger::before_turn)) {
      decide(Trigger::before_turn, n);
    }
    append(token_ids, 0);
    chunk_ = ChunkInfo{stats_.tokens_fed, chunk_ids_, turn_start};
    stats_.tokens_fed += n;
    std::fill(observed_heads_.begin(), observed_heads_.end(), 0);
    std::fill(observed_key_layers_.begin(), observed_key_layers_.end(), 0);
    surprisal_observed_ = false;
    state_ = State::forward;
    policy_->on_append(slots_, chunk_);
    build_attention_views();
  }

  /// Tokens of the current chunk (or catalyst prompt); 0 between forwards.
  [[nodiscard]] int chunk_size() const { return state_ == State::idle ? 0 : chunk_size_; }
  [[nodiscard]] bool idle() const { return state_ == State::idle; }

  [[nodiscard]] bool attention_per_kv_head() const { return policy_->attention_per_kv_head(); }

  // KV heads [kv_head_begin, kv_head_end) of `layer` (every one when the policy takes a layer in
  // one call only).
  void observe_attention(int layer, int kv_head_begin, int kv_head_end, const float* data,
                         int queries, std::ptrdiff_t row_stride) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::forward,
                    "observe_attention: no forward is open (call begin_chunk first)");
    KVEVICT_REQUIRE(
        0 <= kv_head_begin && kv_head_begin < kv_head_end && kv_head_end <= config_.kv_heads,
        "observe_attention: KV heads [" + std::to_string(kv_head_begin) + ", " +
            std::to_string(kv_head_end) + ") are not a range of the sequence's " +
            std::to_string(config_.kv_heads));
    KVEVICT_REQUIRE(
        (kv_head_begin == 0 && kv_head_end == config_.kv_heads) || policy_->attention_per_kv_head(),
        "observe_attention: policy '" + std::string(policy_->name()) +
            "' reads a layer's attention rows in one call (attention_per_kv_head() "
            "is false): hand all " +
            std::to_string(config_.kv_heads) + " KV heads of layer " + std::to_string(layer) +
            " at once");
    check_unobserved(observed_heads_, layer, kv_head_begin, kv_head_end, "observe_attention");
    // In order, so that a unit the layer's KV heads share adds their rows as one call does.
    const auto heads =
        observed_heads_.begin() + static_cast<std::ptrdiff_t>(layer) * config_.kv_heads;
    const auto next = static_cast<int>(std::find(heads, heads + config_.kv_heads, 0) - heads);
    KVEVICT_REQUIRE(kv_head_begin == next,
                    "observe_attention: a layer's KV heads are observed in ascending order (a "
                    "unit they share adds their rows in that order): layer " +
                        std::to_string(layer) + " needs KV head " + std::to_string(next) +
                        " next, got " + std::to_string(kv_head_begin));
    const AttentionRows rows =
        attention_rows(layer, kv_head_begin, kv_head_end, data, queries, row_stride,
                       wants(Signal::attention_rows), "observe_attention");
    {
      const StageScope scope(observer_, Stage::policy);
      // A policy that checks the rows in its own pass over them is handed them unchecked.
      const bool checked_by_policy = policy_->checks_probabilities();
      if (wants(Signal::attention_rows)) {
        check_probabilities(layer, rows, "observe_attention", /*last_query_only=*/false,
                            checked_by_policy);
      } else if (wants(Signal::last_attention_row)) {
        check_probabilities(layer, rows, "observe_attention", /*last_query_only=*/true,
                            checked_by_policy);
      }
      policy_->observe_attention(slots_, layer, rows);
    }
    // Only once the policy took them: a rejected call may be retried.
    mark_observed(layer, kv_head_begin, kv_head_end);
  }

  void observe_keys(int layer, const float* data, std::ptrdiff_t row_stride) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::forward,
                    "observe_keys: no forward is open (call begin_chunk first)");
    check_unobserved(observed_key_layers_, layer, 0, 1, "observe_keys");
    KVEVICT_REQUIRE(config_.head_dim > 0,
                    "observe_keys: SequenceConfig::head_dim is 0 (the length of a key)");
    KVEVICT_REQUIRE(data != nullptr, "observe_keys: keys are null");
    KVEVICT_REQUIRE(row_stride >= config_.head_dim,
                    "observe_keys: row_stride (" + std::to_string(row_stride) +
                        ") is shorter than head_dim (" + std::to_string(config_.head_dim) + ")");
    for (int g = 0; g < config_.kv_heads; ++g) {
      layer_chunk_slots_[static_cast<std::size_t>(g)] =
          chunk_slots_[static_cast<std::size_t>(layout_.unit_of(layer, g))];
    }
    const KeyRows keys(data, chunk_size_, config_.head_dim, row_stride, layer_chunk_slots_);
    {
      const StageScope scope(observer_, Stage::policy);
      if (wants(Signal::keys)) check_keys(layer, keys);
      policy_->observe_keys(slots_, layer, keys);
    }
    observed_key_layers_[static_cast<std::size_t>(layer)] = 1;
  }

  void observe_surprisal(std::span<const float> surprisal) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::forward,
                    "observe_surprisal: no forward is open (call begin_chunk first)");
    KVEVICT_REQUIRE(!surprisal_observed_, "observe_surprisal: already observed for this chunk");
    KVEVICT_REQUIRE(static_cast<int>(surprisal.size()) == chunk_.size(),
                    "observe_surprisal: expected one value per token of the chunk (" +
                        std::to_string(chunk_.size()) + "), got " +
                        std::to_string(surprisal.size()));
    const StageScope scope(observer_, Stage::policy);
    if (wants(Signal::surprisal)) check_surprisal(surprisal);
    policy_->observe_surprisal(slots_, chunk_, surprisal);
    surprisal_observed_ = true;  // only once the policy took them: a rejected call may be retried
  }

  /// Ends the forward: checks that the policy got every signal it declared, then evicts if it does
  /// so now (after an anchor, or after every forward).
  void end_forward() {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::forward, "end_forward: no forward is open");
    if (wants(Signal::attention_rows) || wants(Signal::last_attention_row)) {
      require_every_layer(observed_heads_, "attention rows", "observe_attention");
    }
    if (wants(Signal::keys)) require_every_layer(observed_key_layers_, "keys", "observe_keys");
    KVEVICT_REQUIRE(!wants(Signal::surprisal) || surprisal_observed_,
                    "policy '" + std::string(policy_->name()) +
                        "' needs the surprisal of every token: call observe_surprisal before "
                        "end_forward");
    state_ = State::idle;
    const TriggerSet triggers = policy_->triggers();
    if (triggers.contains(Trigger::anchor) && chunk_has_anchor_) {
      decide(Trigger::anchor, 0);
    } else if (triggers.contains(Trigger::after_forward)) {
      decide(Trigger::after_forward, 0);
    }
  }

  /// A KV pool's pressure (KvPool): evicts by the policy's own keep rule until no unit holds more
  /// than `max_live` tokens besides what the rule protects. Between forwards only.
  void shrink_to(int max_live) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::idle, "shrink_to: end the forward (or catalyst) first");
    KVEVICT_REQUIRE(policy_->supports_pressure(),
                    "shrink_to: policy '" + std::string(policy_->name()) +
                        "' has no keep rule that evicts below its own budget (window, "
                        "streaming_llm, h2o, tova, knorm and keydiff have one)");
    KVEVICT_REQUIRE(max_live >= 0,
                    "shrink_to: max_live must be >= 0, got " + std::to_string(max_live));
    if (slots_.max_live() <= max_live) return;
    const std::int64_t before = stats_.evicted_slots;
    decide(Trigger::after_forward, 0, /*roll_back_catalyst=*/false, max_live);
    stats_.pressure_evicted_slots += stats_.evicted_slots - before;
  }

  /// Removes the newest `count` stream tokens from every unit (those a policy has not evicted
  /// already), and feeds continue from their positions: a speculative draft rejected, or a
  /// benchmark that holds the cache at one size. The engine discards its own K/V for them; the
  /// policy's internal state (a running RNG, SirLLM's last surprisal) is not rolled back.
  void roll_back(int count) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::idle, "roll_back: end the forward first");
    KVEVICT_REQUIRE(count >= 0 && count <= stats_.tokens_fed,
                    "roll_back: count " + std::to_string(count) + " outside [0, " +
                        std::to_string(stats_.tokens_fed) + "]");
    const std::int64_t first = stats_.tokens_fed - count;
    for (int unit = 0; unit < layout_.units(); ++unit) {
      const StreamOrderPieces order = slots_.stream_order_pieces(unit);
      const std::span<const std::int64_t> originals = slots_.original_positions(unit);
      int newest = 0;
      while (newest < order.size() &&
             originals[static_cast<std::size_t>(order[order.size() - 1 - newest])] >= first) {
        ++newest;
      }
      slots_.truncate(unit, newest);
    }
    stats_.tokens_fed = first;
  }

  // --- catalyst (InfiniPot) --------------------------------------------------------------------

  /// Tokens that fit before the policy's pot is full (feed at most this many per forward), or
  /// nullopt when the policy has no pot.
  [[nodiscard]] std::optional<int> pot_room() const { return policy_->pot_room(slots_); }
  /// True when the pot is full: run the catalyst prompt now.
  [[nodiscard]] bool catalyst_pending() const {
    const std::optional<int> room = pot_room();
    return state_ == State::idle && policy_->triggers().contains(Trigger::pot_full) && room &&
           *room == 0;
  }
  /// Appends a catalyst prompt (flagged slot_flag::catalyst) after the pot, positions continuing:
  /// write its K/V at chunk_slots, attend, observe_catalyst per layer, then end_catalyst. May be
  /// empty (no catalyst attention: InfiniPot's "w/o CaP" ablation).
  void begin_catalyst(std::span<const std::int32_t> token_ids) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::idle,
                    "begin_catalyst: end the forward first (and only when catalyst_pending())");
    for (int unit = 0; unit < layout_.units(); ++unit) {
      catalyst_base_[static_cast<std::size_t>(unit)] = slots_.live(unit);
    }
    if (!token_ids.empty()) append(token_ids, slot_flag::catalyst);
    for (std::vector<std::int32_t>& slots : chunk_slots_) slots.resize(token_ids.size());
    catalyst_size_ = chunk_size_ = static_cast<int>(token_ids.size());
    std::fill(observed_heads_.begin(), observed_heads_.end(), 0);
    state_ = State::catalyst;
    build_attention_views();
  }
  void observe_catalyst(int layer, const float* data, int queries, std::ptrdiff_t row_stride) {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::catalyst, "observe_catalyst: no catalyst prompt is open");
    check_unobserved(observed_heads_, layer, 0, config_.kv_heads, "observe_catalyst");
    const AttentionRows rows =
        attention_rows(layer, 0, config_.kv_heads, data, queries, row_stride,
                       wants(Signal::catalyst_attention), "observe_catalyst");
    {
      const StageScope scope(observer_, Stage::policy);
      if (wants(Signal::catalyst_attention)) {
        check_probabilities(layer, rows, "observe_catalyst", /*last_query_only=*/false);
      }
      policy_->observe_catalyst(slots_, layer, rows);
    }
    mark_observed(layer, 0, config_.kv_heads);
  }
  /// Rolls the catalyst back and lets the policy distill the pot; one KvBackend::apply covers both
  /// (the catalyst's slots are among the evicted).
  void end_catalyst() {
    require_usable();
    KVEVICT_REQUIRE(state_ == State::catalyst, "end_catalyst: no catalyst prompt is open");
    if (catalyst_size_ > 0 && wants(Signal::catalyst_attention)) {
      require_every_layer(observed_heads_, "catalyst attention rows", "observe_catalyst");
    }
    state_ = State::idle;
    ++stats_.catalyst_runs;
    decide(Trigger::pot_full, 0, /*roll_back_catalyst=*/true);
  }

 private:
  enum class State { idle, forward, catalyst };

  static SequenceConfig validated(SequenceConfig config) {
    KVEVICT_REQUIRE(config.layers > 0,
                    "Sequence: layers must be positive, got " + std::to_string(config.layers));
    KVEVICT_REQUIRE(config.kv_heads > 0,
                    "Sequence: kv_heads must be positive, got " + std::to_string(config.kv_heads));
    KVEVICT_REQUIRE(config.q_heads > 0 && config.q_heads % config.kv_heads == 0,
                    "Sequence: q_heads (" + std::to_string(config.q_heads) +
                        ") must be a positive multiple of kv_heads (" +
                        std::to_string(config.kv_heads) + ")");
    KVEVICT_REQUIRE(config.max_chunk > 0 && config.max_chunk <= SlotTable::kMaxCapacity,
                    "Sequence: max_chunk must be in [1, " +
                        std::to_string(SlotTable::kMaxCapacity) + "], got " +
                        std::to_string(config.max_chunk));
    KVEVICT_REQUIRE(config.initial_capacity >= 0, "Sequence: negative initial_capacity");
    KVEVICT_REQUIRE(config.max_initial_capacity >= 0, "Sequence: negative max_initial_capacity");
    KVEVICT_REQUIRE(config.head_dim >= 0, "Sequence: negative head_dim");
    KVEVICT_REQUIRE(config.max_pending_rotations >= 0,
                    "Sequence: max_pending_rotations must be >= 0");
    KVEVICT_REQUIRE(config.token_bytes >= 0, "Sequence: negative token_bytes");
    return config;
  }

  int initial_capacity() const {
    const int capacity = [&] {
      if (config_.initial_capacity > 0) return config_.initial_capacity;
      const std::optional<int> limit = policy_->retained_limit();
      if (!limit) return std::max(256, config_.max_chunk);
      return checked_int(
          checked_sum({*limit, config_.max_chunk},
                      "Sequence: the policy's retained limit + max_chunk", SlotTable::kMaxCapacity),
          "Sequence: capacity");
    }();
    return config_.max_initial_capacity > 0 ? std::min(capacity, config_.max_initial_capacity)
                                            : capacity;
  }

  void require_usable() const {
    KVEVICT_REQUIRE(unusable_because_.empty(), "Sequence: unusable after " + unusable_because_);
  }
  // Called from a catch block: from now on every call is refused with `reason` and the error.
  void become_unusable(std::string reason) {
    try {
      throw;
    } catch (const std::exception& error) {
      reason += std::string(": ") + error.what();
    } catch (...) {
    }
    unusable_because_ = std::move(reason);
  }
  void check_head(int layer, int kv_head) const {
    KVEVICT_REQUIRE(
        layer >= 0 && layer < config_.layers && kv_head >= 0 && kv_head < config_.kv_heads,
        "head (" + std::to_string(layer) + ", " + std::to_string(kv_head) +
            ") is outside the sequence's " + std::to_string(config_.layers) + " layers x " +
            std::to_string(config_.kv_heads) + " KV heads");
  }
  // The rows of KV heads [kv_head_begin, kv_head_end) of one layer as the policy reads them: the
  // shape is the sequence's own (query heads, each KV head's slot limit); only the data, the query
  // count and the stride are the engine's. `every_query`: the policy reads a row per query of the
  // chunk (H2O, a catalyst); else any of the chunk's newest queries, at least the last.
  AttentionRows attention_rows(int layer, int kv_head_begin, int kv_head_end, const float* data,
                               int queries, std::ptrdiff_t row_stride, bool every_query,
                               const char* call) {
    KVEVICT_REQUIRE(data != nullptr, std::string(call) + ": attention rows are null");
    KVEVICT_REQUIRE(
        every_query ? queries == chunk_size_ : queries >= 1 && queries <= chunk_size_,
        std::string(call) + ": policy '" + std::string(policy_->name()) + "' reads " +
            (every_query ? std::to_string(chunk_size_) : "1 to " + std::to_string(chunk_size_)) +
            " query rows per query head, got " + std::to_string(queries));
    for (int g = kv_head_begin; g < kv_head_end; ++g) {
      const int limit = slots_.slot_limit(layout_.unit_of(layer, g));
      KVEVICT_REQUIRE(row_stride >= limit, std::string(call) + ": row_stride (" +
                                               std::to_string(row_stride) +
                                               ") is shorter than the " + std::to_string(limit) +
                                               " slots of KV head " + std::to_string(g));
      layer_keys_[static_cast<std::size_t>(g)] = limit;
    }
    const int group = config_.q_heads / config_.kv_heads;
    const std::int64_t next =
        state_ == State::catalyst ? stats_.tokens_fed + catalyst_size_ : stats_.tokens_fed;
    return {data,
            (kv_head_end - kv_head_begin) * group,
            group,
            queries,
            row_stride,
            std::span<const int>(layer_keys_)
                .subspan(static_cast<std::size_t>(kv_head_begin),
                         static_cast<std::size_t>(kv_head_end - kv_head_begin)),
            next - queries,
            kv_head_begin};
  }

  void require_attention_views(const char* call) const {
    KVEVICT_REQUIRE(config_.attention_views,
                    std::string(call) + ": SequenceConfig::attention_views is off");
    KVEVICT_REQUIRE(state_ != State::idle, std::string(call) +
                                               ": valid during a forward or catalyst only (after "
                                               "begin_chunk / begin_catalyst)");
  }
  // Key runs and live masks of every unit, once per forward, for the engine's attention.
  void build_attention_views() {
    if (!config_.attention_views) return;
    const bool post_rope = config_.key_storage == KeyStorage::post_rope;
    for (int unit = 0; unit < layout_.units(); ++unit) {
      std::vector<KeyRun>& runs = key_runs_[static_cast<std::size_t>(unit)];
      std::vector<std::uint8_t>& mask = live_masks_[static_cast<std::size_t>(unit)];
      runs.clear();
      mask.assign(static_cast<std::size_t>(slots_.slot_limit(unit)), 0);
      const auto add_run = [&](int begin, int end, std::int64_t rotation) {
        runs.push_back(KeyRun{begin, end, post_rope ? rotation : 0});
        std::fill(mask.begin() + begin, mask.begin() + end, std::uint8_t{1});
      };
      if (post_rope) {
        slots_.for_each_key_run(unit, add_run);
      } else {
        slots_.for_each_live_run(unit, add_run);
      }
    }
  }

  // `observed`: observed_heads_ ([layers][kv_heads]: attention, catalyst) or observed_key_layers_
  // ([layers]: keys); entries [begin, end) of `layer`'s.
  void check_unobserved(const std::vector<std::uint8_t>& observed, int layer, int begin, int end,
                        const char* call) const {
    KVEVICT_REQUIRE(layer >= 0 && layer < config_.layers,
                    std::string(call) + ": layer " + std::to_string(layer) + " outside [0, " +
                        std::to_string(config_.layers) + ")");
    const std::size_t per_layer = observed.size() / static_cast<std::size_t>(config_.layers);
    const auto first =
        observed.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(layer) * per_layer);
    const auto last = first + static_cast<std::ptrdiff_t>(per_layer);
    // A KV head is named when only some of the layer's are observed.
    const bool whole = std::find(first, last, 0) == last;
    for (int g = begin; g < end; ++g) {
      KVEVICT_REQUIRE(first[g] == 0, std::string(call) + ": layer " + std::to_string(layer) +
                                         (whole ? "" : ", KV head " + std::to_string(g)) +
                                         " was already observed in this forward");
    }
  }
  void mark_observed(int layer, int kv_head_begin, int kv_head_end) {
    const auto row = static_cast<std::size_t>(layer) * static_cast<std::size_t>(config_.kv_heads);
    std::fill(observed_heads_.begin() + static_cast<std::ptrdiff_t>(row) + kv_head_begin,
              observed_heads_.begin() + static_cast<std::ptrdiff_t>(row) + kv_head_end,
              std::uint8_t{1});
  }

  // Attention values are probabilities: NaN, infinities, negatives and values above 1 are refused
  // before the policy adds any to its scores (H2O keeps sums for ever; sums of arbitrary floats
  // overflow to inf - inf = NaN). Only the rows the policy reads are checked, and only their shape
  // when the policy checks their values itself.
  void check_probabilities(int layer, const AttentionRows& rows, const char* call,
                           bool last_query_only, bool shape_only = false) const {
    // Rows cover each unit's slots exactly; some KV heads only when the policy takes them apart.
    check_attention_rows(slots_, layer, rows, call, policy_->attention_per_kv_head());
    if (!shape_only) kvevict::check_probabilities(rows, layer, call, last_query_only);
  }

  // Surprisal is -log p: NaN would make every ranking over it undefined, and SirLLM keeps scores
  // across turns. +inf (p = 0) ranks first and is kept.
  void check_surprisal(std::span<const float> surprisal) const {
    for (std::size_t k = 0; k < surprisal.size(); ++k) {
      KVEVICT_REQUIRE(
          !std::isnan(surprisal[k]),
          "observe_surprisal: the surprisal of token " + std::to_string(k) +
              " of the chunk (original position " +
              std::to_string(chunk_.first_original_position + static_cast<std::int64_t>(k)) +
              ") is NaN; nothing was recorded");
    }
  }
  // Keys are vectors of any sign and size, but a NaN or an infinity makes every norm and cosine
  // over them undefined.
  static void check_keys(int layer, const KeyRows& keys) {
    for (int g = 0; g < keys.kv_heads(); ++g) {
      for (int k = 0; k < keys.tokens(); ++k) {
        const std::span<const float> key = keys.key(g, k);
        const auto bad =
            std::find_if(key.begin(), key.end(), [](float x) { return !std::isfinite(x); });
        if (bad == key.end()) continue;
        throw Error("observe_keys: layer " + std::to_string(layer) + ", KV head " +
                    std::to_string(g) + ", token " + std::to_string(k) + " of the chunk, value " +
                    std::to_string(bad - key.begin()) + ": " + detail::describe_value(*bad) +
                    " is not finite; nothing was recorded");
      }
    }
  }
  // `observed` as in check_unobserved: every entry of every layer set.
  void require_every_layer(const std::vector<std::uint8_t>& observed, const char* signal,
                           const char* call) const {
    const std::size_t per_layer = observed.size() / static_cast<std::size_t>(config_.layers);
    for (std::size_t i = 0; i < observed.size(); ++i) {
      if (observed[i] != 0) continue;
      const std::size_t layer = i / per_layer;
      const bool none =
          std::none_of(observed.begin() + static_cast<std::ptrdiff_t>(layer * per_layer),
                       observed.begin() + static_cast<std::ptrdiff_t>((layer + 1) * per_layer),
                       [](std::uint8_t seen) { return seen != 0; });
      throw Error("policy '" + std::string(policy_->name()) + "' needs the " + signal +
                  " of every layer: layer " + std::to_string(layer) +
                  (none ? "" : ", KV head " + std::to_string(i % per_layer)) +
                  " was not observed (call " + call + " for every layer before " +
                  (state_ == State::catalyst ? "end_catalyst)" : "end_forward)"));
    }
  }

  // Gives every token of `token_ids` a slot in every unit, growing the slots if needed.
  void append(std::span<const std::int32_t> token_ids, std::uint8_t extra_flags) {
    const int n = static_cast<int>(token_ids.size());
    const std::int64_t needed =
        checked_sum({slots_.max_live(), n}, "slots needed", SlotTable::kMaxCapacity);
    if (needed > slots_.capacity()) {
      const int grown = static_cast<int>(std::min<std::int64_t>(
          std::max<std::int64_t>(needed, 2 * std::int64_t{slots_.capacity()}),
          SlotTable::kMaxCapacity));
      // A failed reserve may have left the engine's buffers anywhere between the two sizes.
      try {
        if (backend_ != nullptr) backend_->reserve(grown);
        slots_.reserve(grown);
      } catch (...) {
        become_unusable("growing to " + std::to_string(grown) + " slots per head failed");
        throw;
      }
    }
    chunk_ids_.assign(token_ids.begin(), token_ids.end());
    originals_.resize(static_cast<std::size_t>(n));
    flags_.resize(static_cast<std::size_t>(n));
    chunk_has_anchor_ = false;
    for (int i = 0; i < n; ++i) {
      originals_[static_cast<std::size_t>(i)] = stats_.tokens_fed + i;
      const auto flags = static_cast<std::uint8_t>(
          policy_->flags_for(token_ids[static_cast<std::size_t>(i)]) | extra_flags);
      flags_[static_cast<std::size_t>(i)] = flags;
      chunk_has_anchor_ = chunk_has_anchor_ || (flags & slot_flag::anchor) != 0;
    }
    for (int unit = 0; unit < layout_.units(); ++unit) {
      std::vector<std::int32_t>& slots = chunk_slots_[static_cast<std::size_t>(unit)];
      slots.resize(static_cast<std::size_t>(n));
      slots_.append(unit, originals_, chunk_ids_, flags_, slots);
    }
    chunk_size_ = n;
  }

  // Runs the policy for `trigger` and applies its decision (with the catalyst rolled back first
  // when asked), reporting everything that left the cache to the backend in one call.
  void decide(Trigger trigger, int incoming, bool roll_back_catalyst = false,
              int max_live = std::numeric_limits<int>::max()) {
    applied_begin(trigger);
    if (roll_back_catalyst) roll_back();
    {
      const StageScope scope(observer_, Stage::policy);
      decision_.clear();
      policy_->select(EvictionContext{trigger, slots_, incoming, {}, max_live}, decision_);
    }
    const StageScope scope(observer_, Stage::reposition);
    std::int64_t evicted = 0;
    const bool fold_keys =
        config_.key_storage == KeyStorage::post_rope && position_mode_ != PositionMode::original;
    slots_.locate_oldest([this](int unit) { return decision_.evicted(unit); }, oldest_at_);
    for (int unit = 0; unit < layout_.units(); ++unit) {
      const std::span<const std::int32_t> slots = decision_.evicted(unit);
      record_evicted(unit, slots);
      applied_.evicted_begin_[static_cast<std::size_t>(unit) + 1] = applied_.evicted_.size();
      if (!slots.empty()) {
        slots_.evict(unit, slots, oldest_at_[static_cast<std::size_t>(unit)]);
        evicted += static_cast<std::int64_t>(slots.size());
      }
      // Before the fold, so that its rotations name the slots after the moves.
      if (config_.compact_slots) compact(unit);
      if (!slots.empty() && fold_keys &&
          slots_.pending_rotation_bound(unit) > config_.max_pending_rotations) {
        const std::int64_t rotated =
            slots_.fold(unit, config_.max_pending_rotations,
                        [&](std::int64_t delta, std::span<const std::int32_t> turned) {
                          add_rotation(unit, delta, turned);
                        });
        if (rotated > 0) {
          stats_.rotated_keys += rotated * layout_.heads_per_unit();
          ++stats_.folds;
        }
      }
      applied_.rotation_begin_[static_cast<std::size_t>(unit) + 1] = applied_.rotations_.size();
    }
    point_rotations_at_slots();
    if (evicted > 0) {
      ++stats_.decisions;
      stats_.evicted_slots += evicted * layout_.heads_per_unit();
    }
    if (backend_ != nullptr && (!applied_.evicted_.empty() || applied_.has_moves())) {
      try {
        backend_->apply(applied_);
      } catch (...) {
        become_unusable("the KvBackend failed to apply a decision");
        throw;
      }
    }
  }

  // AppliedDecision's builder: units are filled in ascending order.
  void applied_begin(Trigger trigger) {
    applied_.trigger = trigger;
    applied_.position_mode = position_mode_;
    applied_.layout = layout_;
    applied_.evicted_.clear();
    applied_.rotations_.clear();
    applied_.rotated_slots_.clear();
    applied_.rotation_slot_begin_.clear();
    applied_.evicted_begin_.assign(static_cast<std::size_t>(layout_.units()) + 1, 0);
    applied_.rotation_begin_.assign(static_cast<std::size_t>(layout_.units()) + 1, 0);
    applied_.moves_.clear();
    applied_.moves_begin_.assign(static_cast<std::size_t>(layout_.units()) + 1, 0);
  }
  // compact_slots: `unit`'s live slots back to [0, live), the moves listed in applied_ and told
  // to the policy (its own per-slot state).
  void compact(int unit) {
    const std::size_t first = applied_.moves_.size();
    slots_.compact(unit, applied_.moves_);
    const std::size_t moved = applied_.moves_.size() - first;
    if (moved > 0) {
      policy_->move_slots(unit, std::span<const SlotMove>(applied_.moves_).subspan(first));
      stats_.moved_slots += static_cast<std::int64_t>(moved) * layout_.heads_per_unit();
    }
    applied_.moves_begin_[static_cast<std::size_t>(unit) + 1] = applied_.moves_.size();
  }
  void add_rotation(int unit, std::int64_t delta, std::span<const std::int32_t> slots) {
    applied_.rotation_slot_begin_.push_back(applied_.rotated_slots_.size());
    applied_.rotated_slots_.insert(applied_.rotated_slots_.end(), slots.begin(), slots.end());
    applied_.rotations_.push_back(KeyRotation{unit, delta, {}});
  }
  // After the last add_rotation, when the slot buffer no longer moves.
  void point_rotations_at_slots() {
    const std::span<const std::int32_t> all = applied_.rotated_slots_;
    for (std::size_t r = 0; r < applied_.rotations_.size(); ++r) {
      const std::size_t begin = applied_.rotation_slot_begin_[r];
      const std::size_t end =
          r + 1 < applied_.rotations_.size() ? applied_.rotation_slot_begin_[r + 1] : all.size();
      applied_.rotations_[r].slots = all.subspan(begin, end - begin);
    }
  }

  // Removes the catalyst's tokens (the newest of every unit), keeping them for record_evicted.
  void roll_back() {
    rolled_back_.assign(static_cast<std::size_t>(layout_.units()), {});
    for (int unit = 0; unit < layout_.units(); ++unit) {
      const int count = slots_.live(unit) - catalyst_base_[static_cast<std::size_t>(unit)];
      const std::span<const std::int32_t> order = slots_.stream_order(unit);
      std::vector<EvictedSlot>& removed = rolled_back_[static_cast<std::size_t>(unit)];
      for (const std::int32_t slot : order.last(static_cast<std::size_t>(count))) {
        removed.push_back(
            EvictedSlot{slot, slots_.original_positions(unit)[static_cast<std::size_t>(slot)],
                        slots_.position(unit, slot)});
      }
      slots_.truncate(unit, count);
    }
  }

  // Lists `slots` of `unit` (and a rolled-back catalyst's) in applied_, oldest first, with the
  // positions they have before the eviction.
  void record_evicted(int unit, std::span<const std::int32_t> slots) {
    const auto u = static_cast<std::size_t>(unit);
    const std::size_t first = applied_.evicted_.size();
    // seen_ is all zeros between calls: marked here, cleared below (O(evicted), not O(slots)).
    if (seen_.size() < static_cast<std::size_t>(slots_.slot_limit(unit))) {
      seen_.resize(static_cast<std::size_t>(slots_.slot_limit(unit)), 0);
    }
    const auto clear_seen = [&] {
      for (const std::int32_t slot : slots) {
        if (slots_.is_live(unit, slot)) seen_[static_cast<std::size_t>(slot)] = 0;
      }
    };
    for (const std::int32_t slot : slots) {
      if (!slots_.is_live(unit, slot) || seen_[static_cast<std::size_t>(slot)] != 0) {
        clear_seen();
        throw Error("policy '" + std::string(policy_->name()) + "' evicted slot " +
                    std::to_string(slot) + " of unit " + std::to_string(unit) +
                    ", which is not live or was listed twice");
      }
      seen_[static_cast<std::size_t>(slot)] = 1;
      applied_.evicted_.push_back(
          EvictedSlot{slot, slots_.original_positions(unit)[static_cast<std::size_t>(slot)],
                      slots_.position(unit, slot)});
    }
    clear_seen();
    if (u < rolled_back_.size()) {
      for (const EvictedSlot& slot : rolled_back_[u]) applied_.evicted_.push_back(slot);
      rolled_back_[u].clear();
    }
    std::sort(applied_.evicted_.begin() + static_cast<std::ptrdiff_t>(first),
              applied_.evicted_.end(), [](const EvictedSlot& a, const EvictedSlot& b) {
                return a.original_position < b.original_position;
              });
  }

  SequenceConfig config_;
  std::unique_ptr<Policy> policy_;
  KvBackend* backend_;
  StageObserver* observer_;
  PositionMode position_mode_ = PositionMode::original;
  UnitLayout layout_;
  SlotTable slots_;
  Decision decision_;
  std::vector<int> oldest_at_;  // decide's: where each unit's oldest evicted slot sits
                                // (SlotTable::locate_oldest)
  AppliedDecision applied_;
  SequenceStats stats_;
  State state_ = State::idle;
  std::string unusable_because_;  // empty while usable
  ChunkInfo chunk_;
  int chunk_size_ = 0;
  int catalyst_size_ = 0;
  bool chunk_has_anchor_ = false;
  bool surprisal_observed_ = false;
  std::vector<std::uint8_t> observed_heads_;       // [layers][kv_heads] this forward / catalyst
  std::vector<std::uint8_t> observed_key_layers_;  // [layers] keys observed this forward
  std::vector<std::span<const std::int32_t>> layer_chunk_slots_;  // [kv_heads] of observe_keys
  std::vector<std::vector<std::int32_t>> chunk_slots_;            // [units][chunk]
  std::vector<int> catalyst_base_;                     // [units] live before the catalyst
  std::vector<std::vector<EvictedSlot>> rolled_back_;  // [units] catalyst slots removed
  std::vector<std::uint8_t> seen_;                     // [>= slot limit] duplicate check, zeros
  // Per-chunk scratch, reused.
  std::vector<std::vector<KeyRun>> key_runs_;          // [units] this forward's runs
  std::vector<std::vector<std::uint8_t>> live_masks_;  // [units][slot limit] this forward
  std::vector<int> layer_keys_;                        // [kv_heads] slot limits of rows observed
  std::vector<std::int32_t> chunk_ids_;
  std::vector<std::int64_t> originals_;
  std::vector<std::uint8_t> flags_;
};

}  // namespace detail

inline std::span<const EvictedSlot> AppliedDecision::evicted(int unit) const {
  const auto u = static_cast<std::size_t>(unit);
  return std::span<const EvictedSlot>(evicted_).subspan(evicted_begin_[u],
                                                        evicted_begin_[u + 1] - evicted_begin_[u]);
}
inline std::span<const EvictedSlot> AppliedDecision::evicted(int layer, int kv_head) const {
  return evicted(layout.unit_of(layer, kv_head));
}
inline std::span<const SlotMove> AppliedDecision::moves(int unit) const {
  const auto u = static_cast<std::size_t>(unit);
  return std::span<const SlotMove>(moves_).subspan(moves_begin_[u],
                                                   moves_begin_[u + 1] - moves_begin_[u]);
}
inline std::span<const KeyRotation> AppliedDecision::rotations(int layer, int kv_head) const {
  const auto u = static_cast<std::size_t>(layout.unit_of(layer, kv_head));
  return std::span<const KeyRotation>(rotations_)
      .subspan(rotation_begin_[u], rotation_begin_[u + 1] - rotation_begin_[u]);
}

inline Sequence::Sequence(const SequenceConfig& config, std::unique_ptr<Policy> policy,
                          KvBackend* backend, StageObserver* observer)
    : core_(std::make_unique<detail::SequenceCore>(config, std::move(policy), backend, observer)) {}
inline Sequence::Sequence(Sequence&&) noexcept = default;
inline Sequence& Sequence::operator=(Sequence&&) noexcept = default;
inline Sequence::~Sequence() = default;

inline void Sequence::begin_chunk(std::span<const std::int32_t> token_ids, bool turn_start) {
  core_->begin_chunk(token_ids, turn_start);
}
inline std::span<const std::int32_t> Sequence::chunk_slots(int layer, int kv_head) const {
  return core_->chunk_slots(layer, kv_head);
}
inline std::int64_t Sequence::position(int layer, int kv_head, std::int32_t slot) const {
  return core_->position(layer, kv_head, slot);
}
inline std::int64_t Sequence::key_position(int layer, int kv_head, std::int32_t slot) const {
  return core_->key_position(layer, kv_head, slot);
}
inline int Sequence::slot_limit(int layer, int kv_head) const {
  return core_->slot_limit(layer, kv_head);
}
inline std::span<const KeyRun> Sequence::key_runs(int layer, int kv_head) const {
  return core_->key_runs(layer, kv_head);
}
inline std::span<const std::uint8_t> Sequence::live_mask(int layer, int kv_head) const {
  return core_->live_mask(layer, kv_head);
}
inline bool Sequence::wants_attention() const { return core_->wants_attention(); }
inline int Sequence::attention_queries() const { return core_->attention_queries(); }
inline bool Sequence::attention_per_kv_head() const { return core_->attention_per_kv_head(); }
inline void Sequence::observe_attention(int layer, const float* rows, int queries,
                                        std::ptrdiff_t row_stride) {
  core_->observe_attention(layer, 0, config().kv_heads, rows, queries, row_stride);
}
inline void Sequence::observe_attention(int layer, int kv_head_begin, int kv_head_end,
                                        const float* rows, int queries, std::ptrdiff_t row_stride) {
  core_->observe_attention(layer, kv_head_begin, kv_head_end, rows, queries, row_stride);
}
inline bool Sequence::wants_keys() const { return core_->wants(Signal::keys); }
inline void Sequence::observe_keys(int layer, const float* keys, std::ptrdiff_t row_stride) {
  core_->observe_keys(layer, keys, row_stride);
}
inline bool Sequence::wants_surprisal() const { return core_->wants(Signal::surprisal); }
inline void Sequence::observe_surprisal(std::span<const float> surprisal) {
  core_->observe_surprisal(surprisal);
}
inline void Sequence::end_forward() { core_->end_forward(); }
inline void Sequence::shrink_to(int max_live) { core_->shrink_to(max_live); }
inline void Sequence::roll_back(int count) { core_->roll_back(count); }
inline std::optional<int> Sequence::pot_room() const { return core_->pot_room(); }
inline bool Sequence::catalyst_pending() const { return core_->catalyst_pending(); }
inline void Sequence::begin_catalyst(std::span<const std::int32_t> token_ids) {
  core_->begin_catalyst(token_ids);
}
inline void Sequence::observe_catalyst(int layer, const float* rows, int queries,
                                       std::ptrdiff_t row_stride) {
  core_->observe_catalyst(layer, rows, queries, row_stride);
}
inline void Sequence::end_catalyst() { core_->end_catalyst(); }
inline const SequenceConfig& Sequence::config() const { return core_->config(); }
inline const Policy& Sequence::policy() const { return core_->policy(); }
inline PositionMode Sequence::position_mode() const { return core_->position_mode(); }
inline Granularity Sequence::granularity() const { return core_->granularity(); }
inline int Sequence::capacity() const { return core_->capacity(); }
inline int Sequence::chunk_size() const { return core_->chunk_size(); }
inline bool Sequence::idle() const { return core_->idle(); }
inline int Sequence::live(int layer, int kv_head) const { return core_->live(layer, kv_head); }
inline int Sequence::max_live() const { return core_->slots().max_live(); }
inline int Sequence::unit_of(int layer, int kv_head) const {
  return core_->unit_of(layer, kv_head);
}
inline const SequenceStats& Sequence::stats() const { return core_->stats(); }
inline const SlotTable& Sequence::slots() const { return core_->slots(); }
inline bool Sequence::wants(Signal signal) const { return core_->wants(signal); }
inline void Sequence::set_observer(StageObserver* observer) { core_->set_observer(observer); }
inline StageObserver* Sequence::observer() const { return core_->observer(); }

}  // namespace kvevict
