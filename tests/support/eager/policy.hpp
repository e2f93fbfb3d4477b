// Policy: the interface every eviction policy implements (kvpress "press" shape, in C++).
//
// A policy is a per-sequence object. It declares the signals it consumes and the triggers it
// evicts on, keeps its per-slot state in score columns of the SlotTable (so compaction keeps that
// state aligned with the keys for free), and decides by filling a CompactionPlan. It never touches
// keys or values: the same policy object drives kvevict's KvStore or an engine's own buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "eager/compaction_plan.hpp"
#include "eager/positions.hpp"
#include "eager/signals.hpp"
#include "eager/slot_table.hpp"

namespace kvevict::eager {

/// The tokens of the forward being processed.
struct ChunkInfo {
  std::int64_t first_original_position = 0;
  std::span<const std::int32_t> token_ids;
  bool turn_start = false;
  [[nodiscard]] int size() const { return static_cast<int>(token_ids.size()); }
};

/// What a policy sees when a trigger fires. Policies may update their score columns in `slots`
/// (SirLLM decays them) but must not compact it: the pipeline applies the plan.
struct EvictionContext {
  Trigger trigger = Trigger::after_forward;
  SlotTable& slots;
  /// before_turn: tokens about to be fed; otherwise 0.
  int incoming = 0;
};

class Policy {
 public:
  virtual ~Policy() = default;

  /// Stable identifier, e.g. "streaming_llm".
  [[nodiscard]] virtual std::string_view name() const = 0;
  /// Signals the engine must compute and pass in.
  [[nodiscard]] virtual SignalSet signals() const { return {}; }
  /// When select() is called.
  [[nodiscard]] virtual TriggerSet triggers() const { return {Trigger::after_forward}; }
  /// Float score columns the policy keeps per slot.
  [[nodiscard]] virtual int score_columns() const { return 0; }
  /// The position mode of the paper / authors' code; engines may choose another.
  [[nodiscard]] virtual PositionMode default_position_mode() const {
    return PositionMode::original;
  }
  /// Most slots any head holds once the policy has evicted (at its steady point), or nullopt when
  /// the policy has no bound (full cache, AnLLM without a cap). Engines size buffers from it.
  [[nodiscard]] virtual std::optional<int> retained_limit() const { return std::nullopt; }
  /// slot_flag bits for a newly appended token (e.g. anchor).
  [[nodiscard]] virtual std::uint8_t flags_for(std::int32_t /*token_id*/) const { return 0; }
  /// InfiniPot: true when the pot is full and catalyst attention should be computed now.
  [[nodiscard]] virtual bool pot_full(const SlotTable& /*slots*/) const { return false; }
  /// Tokens that can still be appended before the pot is full (engines split chunks there so that
  /// a chunk never crosses a pot boundary), or nullopt when the policy has no pot.
  [[nodiscard]] virtual std::optional<int> pot_room(const SlotTable& /*slots*/) const {
    return std::nullopt;
  }

  /// The chunk's slots were just appended to every head (the newest chunk.size() slots).
  virtual void on_append(SlotTable& /*slots*/, const ChunkInfo& /*chunk*/) {}
  /// Attention rows of one layer for the current forward (attention_rows / last_attention_row).
  virtual void observe_attention(SlotTable& /*slots*/, int /*layer*/,
                                 const AttentionRows& /*rows*/) {}
  /// -log p of each token of the current chunk, index k for original position first + k.
  virtual void observe_surprisal(SlotTable& /*slots*/, const ChunkInfo& /*chunk*/,
                                 std::span<const float> /*surprisal*/) {}
  /// Attention rows of the catalyst prompt's queries for one layer (catalyst_attention). Rows cover
  /// the pot's slots followed by the catalyst's own slots.
  virtual void observe_catalyst(SlotTable& /*slots*/, int /*layer*/,
                                const AttentionRows& /*rows*/) {}

  /// Decides for `context.trigger`. Writes keep-lists of the heads that change into `plan` (which
  /// arrives cleared) and returns true if any head changes.
  virtual bool select(const EvictionContext& context, CompactionPlan& plan) = 0;
};

}  // namespace kvevict::eager
