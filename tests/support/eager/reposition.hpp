// Re-positioning: the RoPE position of every slot, at append and after a compaction, per mode.
#pragma once

#include <cstdint>
#include <span>

#include "eager/compaction_plan.hpp"
#include "eager/positions.hpp"
#include "eager/slot_table.hpp"

namespace kvevict::eager {

/// Positions for `count` tokens about to be appended to head (layer, kv_head), written to `out`.
/// original: the tokens' original positions; cache_index / reset_on_compact: the slot indices they
/// will occupy (live, live + 1, ...).
inline void positions_for_append(PositionMode mode, const SlotTable& slots, int layer, int kv_head,
                                 std::int64_t first_original_position,
                                 std::span<std::int64_t> out) {
  const std::int64_t first =
      mode == PositionMode::original ? first_original_position : slots.live(layer, kv_head);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = first + static_cast<std::int64_t>(i);
}

/// Fills new_positions and position_deltas of every changed head of `plan`, which must not have
/// been applied to `slots` yet. original: positions are kept (delta 0); cache_index and
/// reset_on_compact: kept slot i moves to position i.
///
/// In every mode a slot's new position is at most its old one (its index can only fall), so a key
/// is re-rotated at most (its first position) times, each with delta < 0; see docs/design.md.
inline void assign_positions(PositionMode mode, const SlotTable& slots, CompactionPlan& plan) {
  for (int l = 0; l < plan.layers(); ++l) {
    for (int g = 0; g < plan.kv_heads(); ++g) {
      if (!plan.changes(l, g)) continue;
      const std::span<const std::int32_t> keep = plan.keep(l, g);
      const std::span<const std::int64_t> old_positions = slots.positions(l, g);
      const std::span<std::int64_t> new_positions = plan.positions_buffer(l, g);
      const std::span<std::int64_t> deltas = plan.deltas_buffer(l, g);
      for (std::size_t i = 0; i < keep.size(); ++i) {
        const std::int64_t old_position = old_positions[static_cast<std::size_t>(keep[i])];
        new_positions[i] =
            mode == PositionMode::original ? old_position : static_cast<std::int64_t>(i);
        deltas[i] = new_positions[i] - old_position;
      }
    }
  }
}

}  // namespace kvevict::eager
