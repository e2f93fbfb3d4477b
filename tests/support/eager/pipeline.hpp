// EvictionPipeline: signals -> policy -> keep-lists -> re-positioning -> slot compaction.
//
// The selection side of kvevict, without keys or values. It owns the order of events for one
// sequence and hands back each plan it applied to the slot table, so that the caller applies the
// same plan to its key/value buffers (KvStore::apply_kv, or an engine's own gather + rotate).
//
// Per forward:
//   before_chunk(n, turn_start)   before_turn trigger (SirLLM)               -> plan or nullptr
//   append_chunk(token_ids)       slots for the chunk in every head, positions per mode
//   observe_attention(layer, ..)  if the policy wants attention rows
//   observe_surprisal(..)         if it wants surprisal
//   end_forward()                 anchor / after_forward trigger             -> plan or nullptr
//   catalyst_pending()?           pot_full: begin_catalyst(ids), observe_catalyst(layer, ..) per
//                                 layer, end_catalyst() (rolls the catalyst back) -> plan
//
// Stage timing (set_timing, off by default): wall time inside the policy and in applying plans,
// for engines that report where eviction time goes. A few clock reads per call into the policy
// and per plan, none per slot; while off, no clock is read.
#pragma once

#include <chrono>
#include <cstdint>
#include <kvevict/error.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "eager/compaction_plan.hpp"
#include "eager/policy.hpp"
#include "eager/positions.hpp"
#include "eager/reposition.hpp"
#include "eager/signals.hpp"
#include "eager/slot_table.hpp"

namespace kvevict::eager {

/// Counters over the life of a pipeline.
struct PipelineStats {
  std::int64_t tokens_fed = 0;     ///< stream tokens appended (catalyst tokens excluded)
  std::int64_t compactions = 0;    ///< plans applied
  std::int64_t evicted_slots = 0;  ///< slots dropped, summed over all heads
};

/// Wall time of the eviction path by stage, summed while timing is on (EvictionPipeline::
/// set_timing). Integer clock ticks, so that sums of stages never drift from their parts.
struct EvictionTiming {
  using Clock = std::chrono::steady_clock;
  /// Inside the policy's decisions: Policy::observe_attention / observe_surprisal /
  /// observe_catalyst (scoring from the signals) and, per trigger fired, Policy::select (scores,
  /// top-k, keep-lists) plus assign_positions (the plan's new positions and rotation deltas).
  /// Appending the new tokens' slots (metadata, Policy::on_append) is not counted: every policy,
  /// the full cache included, pays it per token like the K/V write itself.
  Clock::duration policy{};
  /// Applying plans: SlotTable::apply (metadata and score columns compacted) and, where the owner
  /// of the K/V buffers reports it (add_reposition_time; EvictingCache does), gathering the kept
  /// key / value rows and re-rotating post-RoPE keys by their deltas.
  Clock::duration reposition{};

  [[nodiscard]] double policy_seconds() const {
    return std::chrono::duration<double>(policy).count();
  }
  [[nodiscard]] double reposition_seconds() const {
    return std::chrono::duration<double>(reposition).count();
  }
};

class EvictionPipeline {
 public:
  /// `slots` must outlive the pipeline; it may be a KvStore's table. `position_mode` defaults to
  /// the policy's own.
  EvictionPipeline(SlotTable& slots, std::unique_ptr<Policy> policy,
                   std::optional<PositionMode> position_mode = std::nullopt)
      : slots_(&slots), policy_(std::move(policy)) {
    KVEVICT_REQUIRE(policy_ != nullptr, "EvictionPipeline: policy is null");
    KVEVICT_REQUIRE(slots.score_columns() >= policy_->score_columns(),
                    "EvictionPipeline: the slot table has " +
                        std::to_string(slots.score_columns()) + " score columns, policy '" +
                        std::string(policy_->name()) + "' needs " +
                        std::to_string(policy_->score_columns()));
    position_mode_ = position_mode.value_or(policy_->default_position_mode());
    plan_.resize(slots.layers(), slots.kv_heads(), slots.capacity());
    catalyst_base_.assign(static_cast<std::size_t>(slots.head_caches()), 0);
  }

  [[nodiscard]] Policy& policy() { return *policy_; }
  [[nodiscard]] const Policy& policy() const { return *policy_; }
  [[nodiscard]] const SlotTable& slots() const { return *slots_; }
  [[nodiscard]] PositionMode position_mode() const { return position_mode_; }
  [[nodiscard]] const PipelineStats& stats() const { return stats_; }
  [[nodiscard]] bool wants(Signal signal) const { return policy_->signals().contains(signal); }
  /// Turns stage timing on or off (off by default). Totals are kept across toggles.
  void set_timing(bool enabled) { timing_enabled_ = enabled; }
  [[nodiscard]] bool timing_enabled() const { return timing_enabled_; }
  [[nodiscard]] const EvictionTiming& timing() const { return timing_; }
  /// Adds time the caller spent applying a plan to its own K/V buffers (only while timing is on).
  void add_reposition_time(EvictionTiming::Clock::duration elapsed) {
    if (timing_enabled_) timing_.reposition += elapsed;
  }
  /// The clock while timing is on, else a constant (no clock read): differences of two calls are
  /// the elapsed time, or zero.
  [[nodiscard]] EvictionTiming::Clock::time_point timing_now() const {
    return timing_enabled_ ? EvictionTiming::Clock::now() : EvictionTiming::Clock::time_point{};
  }
  /// The chunk being processed (valid from append_chunk to the next before_chunk).
  [[nodiscard]] const ChunkInfo& chunk() const { return chunk_; }

  /// Slots every head needs to take `incoming` more tokens now.
  [[nodiscard]] int required_capacity(int incoming) const { return slots_->max_live() + incoming; }

  /// Before feeding `incoming` tokens: fires before_turn if this chunk starts a turn and the
  /// policy listens. Returns the plan applied to the slot table, or nullptr.
  const CompactionPlan* before_chunk(int incoming, bool turn_start) {
    KVEVICT_REQUIRE(incoming > 0, "before_chunk: a chunk needs at least one token");
    KVEVICT_REQUIRE(!in_catalyst_, "before_chunk: a catalyst prompt is still open");
    chunk_turn_start_ = turn_start;
    if (turn_start && policy_->triggers().contains(Trigger::before_turn)) {
      return run(Trigger::before_turn, incoming);
    }
    return nullptr;
  }

  /// Appends the chunk's slots to every head, at positions given by the position mode. The slot
  /// table must have room (see required_capacity).
  void append_chunk(std::span<const std::int32_t> token_ids) {
    KVEVICT_REQUIRE(!token_ids.empty(), "append_chunk: empty chunk");
    KVEVICT_REQUIRE(!in_catalyst_, "append_chunk: a catalyst prompt is still open");
    append_slots(token_ids, stats_.tokens_fed, 0);
    chunk_ = ChunkInfo{stats_.tokens_fed, chunk_ids_, chunk_turn_start_};
    chunk_turn_start_ = false;
    stats_.tokens_fed += static_cast<std::int64_t>(token_ids.size());
    policy_->on_append(*slots_, chunk_);
  }

  void observe_attention(int layer, const AttentionRows& rows) {
    const EvictionTiming::Clock::time_point start = timing_now();
    policy_->observe_attention(*slots_, layer, rows);
    timing_.policy += timing_now() - start;
  }
  void observe_surprisal(std::span<const float> surprisal) {
    KVEVICT_REQUIRE(static_cast<int>(surprisal.size()) == chunk_.size(),
                    "observe_surprisal: expected one value per token of the chunk (" +
                        std::to_string(chunk_.size()) + "), got " +
                        std::to_string(surprisal.size()));
    const EvictionTiming::Clock::time_point start = timing_now();
    policy_->observe_surprisal(*slots_, chunk_, surprisal);
    timing_.policy += timing_now() - start;
  }

  /// After the forward's signals were observed: fires anchor (if the chunk held an anchor and the
  /// policy listens) or else after_forward. Returns the applied plan, or nullptr.
  const CompactionPlan* end_forward() {
    const TriggerSet triggers = policy_->triggers();
    if (triggers.contains(Trigger::anchor) && chunk_has_anchor_) return run(Trigger::anchor, 0);
    if (triggers.contains(Trigger::after_forward)) return run(Trigger::after_forward, 0);
    return nullptr;
  }

  /// Tokens that can be appended before the policy's pot is full (engines split chunks there), or
  /// nullopt when the policy has no pot.
  [[nodiscard]] std::optional<int> pot_room() const { return policy_->pot_room(*slots_); }

  /// Original position given to the first catalyst token: the catalyst continues the stream's
  /// positions (tokens_fed, tokens_fed + 1, ...) but never counts as fed; the next stream tokens
  /// reuse those positions after the rollback.
  [[nodiscard]] std::int64_t catalyst_first_position() const { return stats_.tokens_fed; }

  /// True when the policy's pot is full: run the catalyst prompt now (begin/end_catalyst).
  [[nodiscard]] bool catalyst_pending() const {
    return policy_->triggers().contains(Trigger::pot_full) && policy_->pot_full(*slots_);
  }

  /// Appends a catalyst prompt (flagged slot_flag::catalyst) after the pot's slots, positions
  /// continuing; it is attended like any chunk and rolled back by end_catalyst().
  void begin_catalyst(std::span<const std::int32_t> token_ids) {
    KVEVICT_REQUIRE(!in_catalyst_, "begin_catalyst: a catalyst prompt is already open");
    for (int l = 0; l < slots_->layers(); ++l) {
      for (int g = 0; g < slots_->kv_heads(); ++g) {
        catalyst_base_[static_cast<std::size_t>(l * slots_->kv_heads() + g)] = slots_->live(l, g);
      }
    }
    if (!token_ids.empty()) append_slots(token_ids, stats_.tokens_fed, slot_flag::catalyst);
    in_catalyst_ = true;
  }

  void observe_catalyst(int layer, const AttentionRows& rows) {
    KVEVICT_REQUIRE(in_catalyst_, "observe_catalyst: no catalyst prompt is open");
    const EvictionTiming::Clock::time_point start = timing_now();
    policy_->observe_catalyst(*slots_, layer, rows);
    timing_.policy += timing_now() - start;
  }

  /// Rolls the catalyst back and fires pot_full. Returns the applied plan, or nullptr. The caller
  /// truncates its own K/V to catalyst_base() first.
  const CompactionPlan* end_catalyst() {
    KVEVICT_REQUIRE(in_catalyst_, "end_catalyst: no catalyst prompt is open");
    for (int l = 0; l < slots_->layers(); ++l) {
      for (int g = 0; g < slots_->kv_heads(); ++g) slots_->truncate(l, g, catalyst_base(l, g));
    }
    in_catalyst_ = false;
    return run(Trigger::pot_full, 0);
  }

  /// Live count of head (layer, kv_head) before the open catalyst prompt.
  [[nodiscard]] int catalyst_base(int layer, int kv_head) const {
    return catalyst_base_[static_cast<std::size_t>(layer * slots_->kv_heads() + kv_head)];
  }

 private:
  void append_slots(std::span<const std::int32_t> token_ids, std::int64_t first_original,
                    std::uint8_t extra_flags) {
    const std::size_t n = token_ids.size();
    KVEVICT_REQUIRE(required_capacity(static_cast<int>(n)) <= slots_->capacity(),
                    "EvictionPipeline: " + std::to_string(n) + " new tokens do not fit: capacity " +
                        std::to_string(slots_->capacity()) + ", largest head holds " +
                        std::to_string(slots_->max_live()) +
                        " (reserve more, or feed smaller chunks)");
    chunk_ids_.assign(token_ids.begin(), token_ids.end());
    original_.resize(n);
    positions_.resize(n);
    flags_.resize(n);
    chunk_has_anchor_ = false;
    for (std::size_t i = 0; i < n; ++i) {
      original_[i] = first_original + static_cast<std::int64_t>(i);
      flags_[i] = static_cast<std::uint8_t>(policy_->flags_for(token_ids[i]) | extra_flags);
      chunk_has_anchor_ = chunk_has_anchor_ || (flags_[i] & slot_flag::anchor) != 0;
    }
    for (int l = 0; l < slots_->layers(); ++l) {
      for (int g = 0; g < slots_->kv_heads(); ++g) {
        positions_for_append(position_mode_, *slots_, l, g, first_original, positions_);
        slots_->append(l, g, original_, positions_, chunk_ids_, flags_);
      }
    }
  }

  const CompactionPlan* run(Trigger trigger, int incoming) {
    const EvictionTiming::Clock::time_point start = timing_now();
    if (plan_.capacity() < slots_->capacity()) {
      plan_.resize(slots_->layers(), slots_->kv_heads(), slots_->capacity());
    }
    plan_.clear();
    plan_.trigger = trigger;
    const EvictionContext context{trigger, *slots_, incoming};
    if (!policy_->select(context, plan_) || plan_.empty()) {
      timing_.policy += timing_now() - start;
      return nullptr;
    }
    assign_positions(position_mode_, *slots_, plan_);
    const EvictionTiming::Clock::time_point planned = timing_now();
    timing_.policy += planned - start;
    const std::int64_t before = slots_->total_live();
    slots_->apply(plan_);
    timing_.reposition += timing_now() - planned;
    stats_.compactions += 1;
    stats_.evicted_slots += before - slots_->total_live();
    return &plan_;
  }

  SlotTable* slots_;
  std::unique_ptr<Policy> policy_;
  PositionMode position_mode_ = PositionMode::original;
  CompactionPlan plan_;
  PipelineStats stats_;
  EvictionTiming timing_;
  bool timing_enabled_ = false;
  ChunkInfo chunk_;
  bool chunk_turn_start_ = false;
  bool chunk_has_anchor_ = false;
  bool in_catalyst_ = false;
  std::vector<int> catalyst_base_;  // [head_caches]
  // Per-chunk scratch, reused.
  std::vector<std::int32_t> chunk_ids_;
  std::vector<std::int64_t> original_;
  std::vector<std::int64_t> positions_;
  std::vector<std::uint8_t> flags_;
};

}  // namespace kvevict::eager
