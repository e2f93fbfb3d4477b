// SlotTable: the metadata of every cached token, per decision unit, without keys or values.
//
// Eviction is metadata. A unit's tokens live in slots [0, capacity); an evicted token's slot goes
// on a free list and the next token takes it, so no key or value row moves (unless the engine
// asks for compact(), which moves a unit's newest slots into its holes so that its rows can
// shrink with its share). Slot order is
// therefore not stream order: the table keeps stream order beside the slots (stream_order()).
//
// Positions without rewriting keys. Every token has an original position (its index in the input
// stream) and a RoPE position that depends on the position mode: `original` keeps the original
// position; `cache_index` and `reset_on_compact` give each token its rank in the unit's stream
// order, so every eviction lowers the position of every newer token by one. The table stores that
// as a few position groups instead of a position per slot: a group is a stretch of tokens,
// contiguous in stream order, that share one offset, position = original + position_offset. An
// eviction lowers the offsets of the groups after it (and splits the group it falls into, moving
// the shorter side), so the sliding-window policies, whose evictions always take the oldest
// non-sink, cost O(1) per step: their cache is two groups, the sinks and the window.
//
// Keys stored after RoPE carry a second offset per group: the stored key of a token is rotated to
// original + key_offset. The difference, the group's pending rotation, is applied to the query
// instead of the keys (attention over a run of slots with the same pending rotation rotates the
// query once); fold() applies it to the stored keys when too many different pending rotations have
// built up. See docs/design.md for the bound on how many times a key can be re-rotated.
//
// Columns (per unit, indexed by slot, valid for live slots):
//   original_position  index in the input stream (0, 1, 2, ... over the whole sequence)
//   token_id           the token's id
//   flags              slot_flag bits (sink, anchor, catalyst)
//   score(c)           float columns owned by the policy (c < score_columns()), and one spare
//                      column beside them, in which a policy builds new scores before it swaps
//                      them in (so that a refused signal leaves every score as it was)
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvevict/checked.hpp"
#include "kvevict/detail/row_passes.hpp"
#include "kvevict/detail/stream_order.hpp"
#include "kvevict/error.hpp"
#include "kvevict/granularity.hpp"
#include "kvevict/positions.hpp"

namespace kvevict {

using StreamOrderPieces = detail::StreamOrderPieces;

namespace detail {
// A process-wide serial for SlotTable::generation(): no two tables share a value.
inline std::uint64_t new_generation() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace detail

/// Which free slot a new token takes. Decisions never depend on it (ties go by original position);
/// the order only decides where rows sit, and so the order of sums over slots.
enum class SlotReuse : std::uint8_t {
  /// The slot freed last (kvevict's decoder: a stack, O(1)).
  newest_freed_first,
  /// The lowest free slot, as an engine that scans its cells from the lowest freed one allocates
  /// (llama.cpp's KV cache): then slot i is the engine's cell i and per-cell rows need no
  /// re-indexing. A min-heap, O(log free slots).
  lowest_first,
};

/// A live token that changed slot (SlotTable::compact): its rows go from `from` to `to`.
struct SlotMove {
  std::int32_t from = 0;
  std::int32_t to = 0;
};

class SlotTable {
 public:
  /// A stretch of a unit's tokens, contiguous in stream order, with one RoPE position offset and
  /// one stored-key offset (see the header comment).
  struct PositionGroup {
    std::int64_t position_offset = 0;  ///< RoPE position = original + position_offset
    std::int64_t key_offset = 0;       ///< stored post-RoPE key is rotated to original + key_offset
    int live = 0;                      ///< live tokens in the group
    /// Rotation still owed to the stored keys: position - stored key position.
    [[nodiscard]] std::int64_t pending_rotation() const { return position_offset - key_offset; }
  };
  static constexpr std::int32_t kFree = -1;  ///< group id of a free slot
  /// Largest capacity (slots per unit): 2^28 slots of even 2 x 64 f16 values are 64 GiB.
  static constexpr std::int64_t kMaxCapacity = std::int64_t{1} << 28;

  SlotTable() = default;
  SlotTable(const UnitLayout& layout, PositionMode mode, int capacity, int score_columns,
            SlotReuse reuse = SlotReuse::newest_freed_first)
      : layout_(layout), mode_(mode), reuse_(reuse), score_columns_(score_columns) {
    KVEVICT_REQUIRE(capacity > 0,
                    "SlotTable: capacity must be positive, got " + std::to_string(capacity));
    KVEVICT_REQUIRE(
        score_columns >= 0 && score_columns <= 16,
        "SlotTable: score columns must be in [0, 16], got " + std::to_string(score_columns));
    units_.resize(static_cast<std::size_t>(layout.units()));
    score_storage_.resize(units_.size() * static_cast<std::size_t>(stored_score_columns()));
    for (std::size_t i = 0; i < score_storage_.size(); ++i) {
      score_storage_[i] =
          static_cast<std::uint8_t>(i % static_cast<std::size_t>(stored_score_columns()));
    }
    reserve(capacity);
  }

  [[nodiscard]] const UnitLayout& layout() const { return layout_; }
  [[nodiscard]] int units() const { return static_cast<int>(units_.size()); }
  [[nodiscard]] PositionMode position_mode() const { return mode_; }
  [[nodiscard]] int capacity() const { return capacity_; }
  [[nodiscard]] int score_columns() const { return score_columns_; }

  /// Live tokens of unit `unit`.
  [[nodiscard]] int live(int unit) const { return state(unit).live; }
  /// Every live slot is below it: the most slots the unit has held since the last compact().
  /// Attention over a unit covers [0, slot_limit) and skips the free slots.
  [[nodiscard]] int slot_limit(int unit) const { return state(unit).slot_limit; }
  [[nodiscard]] bool is_live(int unit, std::int32_t slot) const {
    return slot >= 0 && slot < slot_limit(unit) && group_[index(unit, slot)] != kFree;
  }
  /// Largest live count over all units.
  [[nodiscard]] int max_live() const {
    int most = 0;
    for (const UnitState& s : units_) most = std::max(most, s.live);
    return most;
  }
  /// Live (layer, KV head) slots summed over all heads: what the keys and values occupy.
  [[nodiscard]] std::int64_t total_live() const { return total_live_; }
  /// The most live slots `unit` has held at once since construction.
  [[nodiscard]] int peak_live(int unit) const { return state(unit).peak_live; }
  /// The largest total_live() since construction.
  [[nodiscard]] std::int64_t peak_total_live() const { return peak_total_live_; }

  // Columns of unit `unit`, indexed by slot over [0, slot_limit(unit)). Free slots hold stale
  // values: read them only for live slots.
  [[nodiscard]] std::span<const std::int64_t> original_positions(int unit) const {
    return column(original_, unit);
  }
  [[nodiscard]] std::span<const std::int32_t> token_ids(int unit) const {
    return column(token_, unit);
  }
  [[nodiscard]] std::span<const std::uint8_t> flags(int unit) const { return column(flags_, unit); }
  /// Group id of every slot (kFree for free slots).
  [[nodiscard]] std::span<const std::int32_t> group_ids(int unit) const {
    return column(group_, unit);
  }
  [[nodiscard]] std::span<float> scores(int unit, int column_index) {
    return {score_data(unit, column_index), static_cast<std::size_t>(slot_limit(unit))};
  }
  [[nodiscard]] std::span<const float> scores(int unit, int column_index) const {
    return {score_data(unit, column_index), static_cast<std::size_t>(slot_limit(unit))};
  }
  /// The unit's spare score column (there is one when score_columns() > 0): what it holds is
  /// unspecified. A policy writes new scores there and swaps them in with swap_spare_scores().
  [[nodiscard]] std::span<float> spare_scores(int unit) {
    return {score_data(unit, score_columns_), static_cast<std::size_t>(slot_limit(unit))};
  }
  [[nodiscard]] std::span<const float> spare_scores(int unit) const {
    return {score_data(unit, score_columns_), static_cast<std::size_t>(slot_limit(unit))};
  }
  /// Column `column_index` of `unit` becomes what spare_scores(unit) held, and the spare what the
  /// column held: O(1), nothing is copied.
  void swap_spare_scores(int unit, int column_index) {
    KVEVICT_REQUIRE(
        column_index >= 0 && column_index < score_columns_,
        "SlotTable::swap_spare_scores: no score column " + std::to_string(column_index));
    std::uint8_t* storage =
        score_storage_.data() +
        static_cast<std::size_t>(unit) * static_cast<std::size_t>(stored_score_columns());
    std::swap(storage[column_index], storage[score_columns_]);
  }

  /// A value that changes whenever the live tokens of `unit` change other than by evictions and by
  /// appends above every original position the unit has held: a truncation, a compaction that
  /// moves slots, an append at an original position seen before. Never shared by two tables.
  /// Something kept beside a unit from one decision to the next (WorstCandidates' heap) learns
  /// of evictions and appends by itself, and is rebuilt when this changes.
  [[nodiscard]] std::uint64_t generation(int unit) const { return state(unit).generation; }
  /// Tokens evicted from `unit` since the table was made, and the original position of the last
  /// of them (-1 before any): with generation(), what tells something kept beside a unit that the
  /// one eviction since it last looked is the one it asked for (WorstCandidates' heap).
  [[nodiscard]] std::int64_t evictions(int unit) const { return state(unit).evictions; }
  [[nodiscard]] std::int64_t last_evicted(int unit) const { return state(unit).last_evicted; }

  /// The live slots of `unit`, oldest (lowest original position) first. Valid until the next
  /// change to the unit. After evictions that left the order in two pieces (a gap where the last
  /// evicted slot was: detail/stream_order.hpp) this is a copy, made once per change.
  [[nodiscard]] std::span<const std::int32_t> stream_order(int unit) const {
    return state(unit).order.view();
  }
  /// The same entries as they lie, in at most two pieces, without a copy: what a decision that
  /// reads a few entries of the order (the ends of its candidates, one entry) reads.
  [[nodiscard]] StreamOrderPieces stream_order_pieces(int unit) const {
    return state(unit).order.pieces();
  }

  /// Position group `group` of `unit` (ids from group_ids()).
  [[nodiscard]] const PositionGroup& group(int unit, std::int32_t group_id) const {
    return state(unit).groups[static_cast<std::size_t>(group_id)];
  }
  /// Number of position groups of `unit`: 1 under `original`, 2 for a sliding window with sinks.
  [[nodiscard]] int group_count(int unit) const {
    return static_cast<int>(state(unit).group_order.size());
  }
  /// RoPE position of live slot `slot`.
  [[nodiscard]] std::int64_t position(int unit, std::int32_t slot) const {
    const std::size_t i = index(unit, slot);
    return original_[i] + group(unit, group_[i]).position_offset;
  }
  /// Position the stored (post-RoPE) key of live slot `slot` is rotated to.
  [[nodiscard]] std::int64_t key_position(int unit, std::int32_t slot) const {
    const std::size_t i = index(unit, slot);
    return original_[i] + group(unit, group_[i]).key_offset;
  }
  /// An upper bound on the number of different pending rotations in `unit`. Pending rotations
  /// never increase along stream order (a fold keeps that: it only raises a stretch to its older
  /// neighbour's), and each eviction lowers those of a suffix of the groups, so every eviction
  /// since the last fold adds at most one new value to those the fold left.
  [[nodiscard]] int pending_rotation_bound(int unit) const {
    const UnitState& s = state(unit);
    return static_cast<int>(std::min<std::int64_t>(static_cast<std::int64_t>(s.group_order.size()),
                                                   s.rotations_at_fold + s.evicted_since_fold));
  }
  /// The number of different pending rotations in `unit` (one walk of its groups).
  [[nodiscard]] int pending_rotations(int unit) const {
    const UnitState& s = state(unit);
    int count = 0;
    for (std::size_t k = 0; k < s.group_order.size(); ++k) {
      count += k == 0 || pending_of(s, k) != pending_of(s, k - 1) ? 1 : 0;
    }
    return count;
  }

  /// Calls fn(begin, end, rotation) for every maximal range [begin, end) of live slots of `unit`
  /// whose groups have the same pending rotation, in slot order: attention over post-RoPE keys
  /// rotates each query once per range, to (query position - rotation). Free slots are skipped.
  template <class Fn>
  void for_each_key_run(int unit, Fn&& fn) const {
    for_each_run(
        unit, [](const PositionGroup& g) { return g.pending_rotation(); }, std::forward<Fn>(fn));
  }
  /// Calls fn(begin, end, offset) for every maximal range [begin, end) of live slots of `unit`
  /// with the same position offset (slot s is at RoPE position original(s) + offset): attention
  /// over pre-RoPE keys rotates each key to its position.
  template <class Fn>
  void for_each_position_run(int unit, Fn&& fn) const {
    for_each_run(
        unit, [](const PositionGroup& g) { return g.position_offset; }, std::forward<Fn>(fn));
  }
  /// Calls fn(begin, end, 0) for every maximal range [begin, end) of live slots of `unit`.
  template <class Fn>
  void for_each_live_run(int unit, Fn&& fn) const {
    for_each_run(
        unit, [](const PositionGroup&) { return std::int64_t{0}; }, std::forward<Fn>(fn));
  }

  /// Bytes of metadata per slot (all columns).
  [[nodiscard]] std::size_t bytes_per_slot() const {
    return sizeof(std::int64_t) + sizeof(std::int32_t) * 2 + sizeof(std::uint8_t) +
           sizeof(float) * static_cast<std::size_t>(stored_score_columns());
  }

  // ---------------------------------------------------------------------------------------------
  // Changes. kvevict::Sequence makes them; engines read the results.
  // ---------------------------------------------------------------------------------------------

  /// Grows every unit to `capacity` slots, keeping contents and slot numbers. Never shrinks.
  void reserve(int capacity) {
    if (capacity <= capacity_) return;
    KVEVICT_REQUIRE(capacity <= kMaxCapacity, "SlotTable: capacity " + std::to_string(capacity) +
                                                  " exceeds the limit of " +
                                                  std::to_string(kMaxCapacity) + " slots");
    const std::size_t units = units_.size();
    (void)checked_product(
        {static_cast<std::int64_t>(units), capacity, std::int64_t{1} + stored_score_columns()},
        "SlotTable: units * capacity * columns", kMaxCapacity * 64);
    regrow(original_, capacity, 1);
    regrow(token_, capacity, 1);
    regrow(flags_, capacity, 1);
    regrow(group_, capacity, 1, kFree);
    regrow(score_, capacity, stored_score_columns());
    capacity_ = capacity;
    for (UnitState& s : units_) s.order.reserve(capacity);
  }

  /// Appends tokens at `originals` (ascending, after every live token) to `unit` and writes the
  /// slot each one takes to `slots_out`. Scores start at 0. Free slots are reused in the table's
  /// SlotReuse order (either way a sliding window keeps reusing the slot it just freed).
  void append(int unit, std::span<const std::int64_t> originals,
              std::span<const std::int32_t> token_ids, std::span<const std::uint8_t> flags,
              std::span<std::int32_t> slots_out) {
    const std::size_t n = originals.size();
    KVEVICT_REQUIRE(token_ids.size() == n && flags.size() == n && slots_out.size() >= n,
                    "SlotTable::append: column lengths differ");
    UnitState& s = state(unit);
    KVEVICT_REQUIRE(static_cast<std::int64_t>(s.live) + static_cast<std::int64_t>(n) <= capacity_,
                    "SlotTable::append: unit " + std::to_string(unit) +
                        " would exceed its capacity of " + std::to_string(capacity_) + " slots");
    for (std::size_t k = 0; k < n; ++k) {
      const std::int64_t original = originals[k];
      KVEVICT_REQUIRE(s.order.size() == 0 || original > original_[index(unit, s.order[s.live - 1])],
                      "SlotTable::append: original positions must increase");
      if (original <= s.newest_appended) s.generation = detail::new_generation();
      s.newest_appended = original;
      std::int32_t slot;
      if (!s.free_slots.empty()) {
        if (reuse_ == SlotReuse::lowest_first) {
          std::pop_heap(s.free_slots.begin(), s.free_slots.end(), std::greater<>());
        }
        slot = s.free_slots.back();
        s.free_slots.pop_back();
      } else {
        slot = s.slot_limit++;
      }
      const std::size_t i = index(unit, slot);
      original_[i] = original;
      token_[i] = token_ids[k];
      flags_[i] = flags[k];
      group_[i] = group_for_append(s, original);
      for (int c = 0; c < score_columns_; ++c) score_data(unit, c)[slot] = 0.0f;
      s.order.push_back(slot);
      ++s.live;
      slots_out[k] = slot;
    }
    s.peak_live = std::max(s.peak_live, s.live);
    add_total_live(static_cast<std::int64_t>(n));
  }

  /// Evicts the live slots `slots` (any order, no duplicates) of `unit`: frees them and, under
  /// cache_index / reset_on_compact, lowers the positions of every newer token. `oldest_at` may
  /// name where the oldest of them sits in the stream order (locate_oldest); a wrong or stale
  /// index (-1 included) only costs a search.
  void evict(int unit, std::span<const std::int32_t> slots, int oldest_at = -1) {
    UnitState& s = state(unit);
    // Oldest first, so that each eviction's shift applies to positions as the mode defines them.
    scratch_.assign(slots.begin(), slots.end());
    const std::int64_t* originals = original_.data() + index(unit, 0);
    std::sort(scratch_.begin(), scratch_.end(),
              [originals](std::int32_t a, std::int32_t b) { return originals[a] < originals[b]; });
    for (const std::int32_t slot : scratch_) {
      KVEVICT_REQUIRE(is_live(unit, slot), "SlotTable::evict: slot " + std::to_string(slot) +
                                               " of unit " + std::to_string(unit) +
                                               " is not live (evicted twice?)");
      const bool located = oldest_at >= 0 && oldest_at < s.live && s.order[oldest_at] == slot;
      evict_one(s, unit, slot, located ? oldest_at : s.order.find(originals[slot], originals));
      oldest_at = -1;
    }
    add_total_live(-static_cast<std::int64_t>(scratch_.size()));
  }

  /// For each unit, where the oldest of its slots in `evicted(unit)` sits in its stream order
  /// (-1 for a unit that evicts nothing): at[unit], for evict(). First the two entries beside the
  /// gap the last eviction left (detail/stream_order.hpp), where a policy that evicts at about one
  /// stream index step after step (H2O) finds it; then a halving search, the units' searches side
  /// by side, one step of every search at a time, so that their reads overlap rather than wait one
  /// after another: a search reads about 2 log2(live) lines (the stream order, then the original
  /// position of the slot found there), each from memory after a decode step's weights have passed
  /// through the caches.
  template <class EvictedOf>
  void locate_oldest(const EvictedOf& evicted, std::vector<int>& at) {
    at.assign(units_.size(), -1);
    searches_.clear();
    for (int unit = 0; unit < units(); ++unit) {
      const std::span<const std::int32_t> slots = evicted(unit);
      if (slots.empty()) continue;
      const std::int64_t* originals = original_.data() + index(unit, 0);
      std::int64_t oldest = std::numeric_limits<std::int64_t>::max();
      for (const std::int32_t slot : slots) oldest = std::min(oldest, originals[slot]);
      const StreamOrderPieces entries = state(unit).order.pieces();
      const int after_gap = static_cast<int>(entries.front.size());
      for (const int i : {after_gap, after_gap - 1}) {
        if (i >= 0 && i < entries.size() && originals[entries[i]] == oldest) {
          at[static_cast<std::size_t>(unit)] = i;
        }
      }
      if (at[static_cast<std::size_t>(unit)] < 0) {
        searches_.push_back({entries, originals, oldest, 0, entries.size(), 0, unit});
      }
    }
    // std::lower_bound's steps, one of every search at a time: each search's middle entry read
    // (loads independent of each other, which the CPU overlaps) and the original it names asked
    // for, then every comparison.
    for (bool going = true; going;) {
      going = false;
      for (Search& f : searches_) {
        if (f.count == 0) continue;
        f.slot = f.entries[f.first + f.count / 2];
        detail::row_pass::prefetch_lines(f.originals + f.slot, 1, false);
      }
      for (Search& f : searches_) {
        if (f.count == 0) continue;
        const int half = f.count / 2;
        if (f.originals[f.slot] < f.target) {
          f.first += half + 1;
          f.count -= half + 1;
        } else {
          f.count = half;
        }
        going = going || f.count > 0;
      }
    }
    for (const Search& f : searches_) {
      const bool found = f.first < f.entries.size() && f.originals[f.entries[f.first]] == f.target;
      at[static_cast<std::size_t>(f.unit)] = found ? f.first : -1;
    }
  }

  /// Removes the newest `count` tokens of `unit` without moving anyone's position (a rolled-back
  /// catalyst prompt).
  void truncate(int unit, int count) {
    UnitState& s = state(unit);
    KVEVICT_REQUIRE(count >= 0 && count <= s.live, "SlotTable::truncate: count " +
                                                       std::to_string(count) + " outside [0, " +
                                                       std::to_string(s.live) + "]");
    if (count > 0) s.generation = detail::new_generation();
    for (int k = 0; k < count; ++k) {
      const std::int32_t slot = s.order[s.live - 1];
      s.order.pop_back(1);
      release(s, unit, slot);
    }
    add_total_live(-static_cast<std::int64_t>(count));
  }

  /// Moves the live slots of `unit` at or above live(unit) into its free slots below live(unit),
  /// both taken in ascending order, so that its live slots are exactly [0, live) and slot_limit ==
  /// live: what a store whose buffers shrink with a unit's share needs. Appends each move to
  /// `moves`. A moved token keeps everything but its slot (stream order, position, group, columns);
  /// decisions never depend on slots (ties go by original position). O(slots freed since the last
  /// compaction).
  void compact(int unit, std::vector<SlotMove>& moves) {
    UnitState& s = state(unit);
    if (s.slot_limit == s.live) return;
    // The holes: free slots below live, ascending. Every free slot is in free_slots.
    std::vector<std::int32_t>& holes = s.free_slots;
    holes.erase(std::remove_if(holes.begin(), holes.end(),
                               [&s](std::int32_t slot) { return slot >= s.live; }),
                holes.end());
    std::sort(holes.begin(), holes.end());
    const std::int32_t* groups = group_.data() + index(unit, 0);
    const std::int64_t* originals = original_.data() + index(unit, 0);
    std::size_t next_hole = 0;
    for (std::int32_t from = s.live; from < s.slot_limit; ++from) {
      if (groups[from] == kFree) continue;
      const std::int32_t to = holes[next_hole++];
      const int at = s.order.find(originals[from], originals);
      KVEVICT_REQUIRE(at >= 0, "SlotTable: live slot missing from the stream order");
      s.order.replace(at, to);
      const std::size_t i = index(unit, from);
      const std::size_t j = index(unit, to);
      original_[j] = original_[i];
      token_[j] = token_[i];
      flags_[j] = flags_[i];
      group_[j] = group_[i];
      group_[i] = kFree;
      for (int c = 0; c < score_columns_; ++c) {
        score_data(unit, c)[to] = score_data(unit, c)[from];
      }
      moves.push_back(SlotMove{from, to});
    }
    KVEVICT_REQUIRE(next_hole == holes.size(), "SlotTable::compact: free slots miscounted");
    if (next_hole > 0) s.generation = detail::new_generation();
    holes.clear();
    s.slot_limit = s.live;
  }

  /// Brings `unit` to at most `limit` different pending rotations, rotating as few stored keys as
  /// that takes: calls `rotate(delta, slots)` (delta < 0 under a rank mode: keys only move back)
  /// for each stretch of stream order whose keys turn, and returns how many keys turned. `limit` 0
  /// rotates every key to its position. Otherwise the values are stretches of stream order,
  /// falling from oldest to newest (pending_rotation_bound()); the cheapest way to drop m of them
  /// turns the m smallest stretches after the oldest, each to the value of the nearest older one
  /// kept, so that the values still fall and every turn moves a key back (docs/design.md, "Folds").
  template <class RotateFn>
  std::int64_t fold(int unit, int limit, RotateFn&& rotate) {
    UnitState& s = state(unit);
    std::vector<PendingStretch>& stretches = stretches_;
    stretches.clear();
    std::int64_t first = 0;  // stream index of the current stretch's first token
    for (std::size_t k = 0; k < s.group_order.size(); ++k) {
      const std::int64_t live = s.groups[static_cast<std::size_t>(s.group_order[k])].live;
      if (k == 0 || pending_of(s, k) != pending_of(s, k - 1)) {
        stretches.push_back(PendingStretch{pending_of(s, k), first, 0, k, k});
      }
      stretches.back().live += live;
      stretches.back().groups_end = k + 1;
      first += live;
    }
    const auto kept = static_cast<std::size_t>(limit);
    if (limit == 0) {
      for (PendingStretch& stretch : stretches) stretch.turned = stretch.pending != 0;
    } else if (stretches.size() > kept) {
      // The smallest stretches after the oldest (ties: the older), whose keys turn.
      by_size_.resize(stretches.size() - 1);
      std::iota(by_size_.begin(), by_size_.end(), std::int32_t{1});
      const auto smaller = [&](std::int32_t a, std::int32_t b) {
        const PendingStretch& x = stretches[static_cast<std::size_t>(a)];
        const PendingStretch& y = stretches[static_cast<std::size_t>(b)];
        return x.live < y.live || (x.live == y.live && a < b);
      };
      const auto dropped = static_cast<std::ptrdiff_t>(stretches.size() - kept);
      std::nth_element(by_size_.begin(), by_size_.begin() + dropped - 1, by_size_.end(), smaller);
      for (std::ptrdiff_t k = 0; k < dropped; ++k) {
        stretches[static_cast<std::size_t>(by_size_[static_cast<std::size_t>(k)])].turned = true;
      }
    }
    // Each turned stretch takes the value of the nearest older stretch kept (0 when limit is 0).
    const std::span<const std::int32_t> order = s.order.contiguous();
    std::int64_t rotated = 0;
    std::int64_t target = 0;
    for (const PendingStretch& stretch : stretches) {
      if (!stretch.turned) {
        if (limit != 0) target = stretch.pending;
        continue;
      }
      rotate(stretch.pending - target, order.subspan(static_cast<std::size_t>(stretch.first),
                                                     static_cast<std::size_t>(stretch.live)));
      rotated += stretch.live;
      for (std::size_t k = stretch.groups_begin; k < stretch.groups_end; ++k) {
        PositionGroup& group = s.groups[static_cast<std::size_t>(s.group_order[k])];
        group.key_offset = group.position_offset - target;
      }
    }
    // Left: `limit` values, or one (zero) when limit is 0.
    s.rotations_at_fold =
        static_cast<std::int64_t>(std::min(stretches.size(), std::max(kept, std::size_t{1})));
    s.evicted_since_fold = 0;
    return rotated;
  }

 private:
  // What a decision reads of a unit first: the first two cache lines (its size, generation and
  // evictions, the stream order's bounds), read from memory after a decode step's weights.
  struct alignas(64) UnitState {
    int live = 0;
    int slot_limit = 0;
    std::uint64_t generation = detail::new_generation();  // see generation()
    std::int64_t evictions = 0;                           // see evictions()
    std::int64_t last_evicted = -1;                       // see last_evicted()
    detail::StreamOrder order;
    int peak_live = 0;  // the largest `live` since construction
    // newest_freed_first: a stack; lowest_first: a min-heap.
    std::vector<std::int32_t> free_slots;
    std::vector<PositionGroup> groups;         // by id
    std::vector<std::int32_t> free_group_ids;  // ids to reuse
    std::vector<std::int32_t> group_order;     // ids, oldest stretch first
    std::int64_t evicted_since_fold = 0;
    std::int64_t rotations_at_fold = 1;  // different pending rotations the last fold left
    std::int64_t newest_appended = std::numeric_limits<std::int64_t>::min();
  };

  // fold()'s view of a unit: a maximal stretch of stream order with one pending rotation.
  struct PendingStretch {
    std::int64_t pending = 0;
    std::int64_t first = 0;  // stream index of its oldest token
    std::int64_t live = 0;
    std::size_t groups_begin = 0;  // its groups: group_order[groups_begin, groups_end)
    std::size_t groups_end = 0;
    bool turned = false;  // its keys turn to an older stretch's value
  };

  [[nodiscard]] bool rank_positions() const { return mode_ != PositionMode::original; }
  // Pending rotation of the k-th group in stream order.
  [[nodiscard]] std::int64_t pending_of(const UnitState& s, std::size_t k) const {
    return s.groups[static_cast<std::size_t>(s.group_order[k])].pending_rotation();
  }

  template <class KeyOf, class Fn>
  void for_each_run(int unit, KeyOf key_of, Fn&& fn) const {
    constexpr int kLongStretch = 16;
    const UnitState& s = state(unit);
    const std::int32_t* groups = group_.data() + index(unit, 0);
    const int limit = s.slot_limit;
    // Every slot of [0, limit) live and in one group (a window's, H2O's without re-positioning):
    // one run, without reading the ids.
    if (limit > 0 && s.live == limit) {
      const PositionGroup& only = s.groups[static_cast<std::size_t>(groups[0])];
      if (only.live == limit) {
        fn(0, limit, key_of(only));
        return;
      }
    }
    int begin = 0;
    while (begin < limit) {
      if (groups[begin] == kFree) {
        ++begin;
        continue;
      }
      const std::int32_t first_group = groups[begin];
      const std::int64_t key = key_of(s.groups[static_cast<std::size_t>(first_group)]);
      // Slots of one group share the key; look the group up only where the id changes.
      std::int32_t current = first_group;
      int end = begin + 1;
      int same = 1;  // ids equal to `current` in a row
      while (end < limit) {
        const std::int32_t id = groups[end];
        if (id == current) {
          ++end;
          // A long stretch of one group (a sliding window's, H2O's): the rest of it at the vector
          // width. Short ones (each eviction in the middle of the stream starts a group) stay in
          // this loop, where the CPU runs ahead from one to the next.
          if (++same == kLongStretch) end = detail::first_other(groups, end, limit, current);
          continue;
        }
        if (id == kFree || key_of(s.groups[static_cast<std::size_t>(id)]) != key) break;
        current = id;
        same = 1;
        ++end;
      }
      fn(begin, end, key);
      begin = end;
    }
  }
  [[nodiscard]] UnitState& state(int unit) { return units_[static_cast<std::size_t>(unit)]; }
  [[nodiscard]] const UnitState& state(int unit) const {
    return units_[static_cast<std::size_t>(unit)];
  }
  [[nodiscard]] std::size_t index(int unit, std::int32_t slot) const {
    return static_cast<std::size_t>(unit) * static_cast<std::size_t>(capacity_) +
           static_cast<std::size_t>(slot);
  }
  template <class T>
  [[nodiscard]] std::span<const T> column(const std::vector<T>& data, int unit) const {
    return {data.data() + index(unit, 0), static_cast<std::size_t>(slot_limit(unit))};
  }
  // The score columns and the spare, when there are score columns.
  [[nodiscard]] int stored_score_columns() const {
    return score_columns_ > 0 ? score_columns_ + 1 : 0;
  }
  // Where column c of `unit` is stored (c == score_columns_: the spare), as an offset in score_.
  [[nodiscard]] std::size_t score_offset(int unit, int c) const {
    const std::size_t block =
        static_cast<std::size_t>(unit) * static_cast<std::size_t>(stored_score_columns());
    return (block + score_storage_[block + static_cast<std::size_t>(c)]) *
           static_cast<std::size_t>(capacity_);
  }
  [[nodiscard]] float* score_data(int unit, int c) { return score_.data() + score_offset(unit, c); }
  [[nodiscard]] const float* score_data(int unit, int c) const {
    return score_.data() + score_offset(unit, c);
  }
  void add_total_live(std::int64_t slots_per_unit) {
    total_live_ += slots_per_unit * layout_.heads_per_unit();
    peak_total_live_ = std::max(peak_total_live_, total_live_);
  }

  // The group a token appended at `original` joins: the newest group when its offset already gives
  // the token the position the mode asks for (always, unless the unit was empty), else a new one.
  std::int32_t group_for_append(UnitState& s, std::int64_t original) {
    // original: position = original; rank modes: position = the token's rank = live count.
    const std::int64_t offset = rank_positions() ? s.live - original : 0;
    if (!s.group_order.empty()) {
      const std::int32_t newest = s.group_order.back();
      PositionGroup& group = s.groups[static_cast<std::size_t>(newest)];
      if (group.position_offset == offset) {
        ++group.live;
        return newest;
      }
    }
    // A new group's keys are written rotated to their original positions (key_offset 0).
    const std::int32_t id = new_group(s, PositionGroup{offset, 0, 1});
    s.group_order.push_back(id);
    return id;
  }

  std::int32_t new_group(UnitState& s, const PositionGroup& group) {
    if (!s.free_group_ids.empty()) {
      const std::int32_t id = s.free_group_ids.back();
      s.free_group_ids.pop_back();
      s.groups[static_cast<std::size_t>(id)] = group;
      return id;
    }
    s.groups.push_back(group);
    return static_cast<std::int32_t>(s.groups.size() - 1);
  }

  // Frees `slot` (already out of the stream order) and drops its group if it empties.
  void release(UnitState& s, int unit, std::int32_t slot) {
    const std::size_t i = index(unit, slot);
    const std::int32_t g = group_[i];
    group_[i] = kFree;
    s.free_slots.push_back(slot);
    if (reuse_ == SlotReuse::lowest_first) {
      std::push_heap(s.free_slots.begin(), s.free_slots.end(), std::greater<>());
    }
    --s.live;
    if (--s.groups[static_cast<std::size_t>(g)].live == 0) {
      s.group_order.erase(std::find(s.group_order.begin(), s.group_order.end(), g));
      s.free_group_ids.push_back(g);
    }
  }

  // Evicts `slot`, found at index `at` of the stream order (-1: not found).
  void evict_one(UnitState& s, int unit, std::int32_t slot, int at) {
    const std::int32_t* groups = group_.data() + index(unit, 0);
    KVEVICT_REQUIRE(at >= 0, "SlotTable: live slot missing from the stream order");
    const std::int32_t g = groups[slot];
    if (rank_positions()) {
      const bool older_in_group = at > 0 && groups[s.order[at - 1]] == g;
      const bool newer_in_group = at + 1 < s.live && groups[s.order[at + 1]] == g;
      // The first group (in stream order) whose tokens all lie after the evicted one.
      std::size_t first_shifted;
      const auto position_of = [&s](std::int32_t id) {
        return static_cast<std::size_t>(std::find(s.group_order.begin(), s.group_order.end(), id) -
                                        s.group_order.begin());
      };
      if (older_in_group && newer_in_group) {
        first_shifted = position_of(split(s, unit, g, at));
      } else if (newer_in_group) {
        first_shifted = position_of(g);
      } else {
        first_shifted = position_of(g) + 1;
      }
      for (std::size_t k = first_shifted; k < s.group_order.size(); ++k) {
        s.groups[static_cast<std::size_t>(s.group_order[k])].position_offset -= 1;
      }
      ++s.evicted_since_fold;
    }
    s.order.erase(at);
    ++s.evictions;
    s.last_evicted = original_[index(unit, slot)];
    release(s, unit, slot);
  }

  // Splits group `g` around the token at stream index `at`: the shorter side moves to a new group
  // with the same offsets. Returns the id of the group that holds the newer side.
  std::int32_t split(UnitState& s, int unit, std::int32_t g, int at) {
    std::int32_t* groups = group_.data() + index(unit, 0);
    // Walk both sides at once and stop at the shorter: O(min(older, newer)).
    int older = at - 1;  // older side so far: (older, at)
    int newer = at + 1;  // newer side so far: (at, newer)
    bool older_is_shorter = false;
    for (;;) {
      const bool older_goes_on = older >= 0 && groups[s.order[older]] == g;
      const bool newer_goes_on = newer < s.live && groups[s.order[newer]] == g;
      if (!older_goes_on || !newer_goes_on) {
        older_is_shorter = !older_goes_on;
        break;
      }
      --older;
      ++newer;
    }
    const int begin = older_is_shorter ? older + 1 : at + 1;
    const int end = older_is_shorter ? at : newer;
    PositionGroup piece = s.groups[static_cast<std::size_t>(g)];
    piece.live = end - begin;
    const std::int32_t id = new_group(s, piece);
    s.groups[static_cast<std::size_t>(g)].live -= piece.live;
    for (int k = begin; k < end; ++k) groups[s.order[k]] = id;
    auto position = std::find(s.group_order.begin(), s.group_order.end(), g);
    s.group_order.insert(older_is_shorter ? position : position + 1, id);
    return older_is_shorter ? g : id;
  }

  // Re-lays out [units * columns][capacity_] as [...][new_capacity], keeping [0, slot_limit).
  template <class T>
  void regrow(std::vector<T>& data, int new_capacity, int columns, T fill = T{}) {
    std::vector<T> grown(
        units_.size() * static_cast<std::size_t>(columns) * static_cast<std::size_t>(new_capacity),
        fill);
    for (std::size_t u = 0; u < units_.size(); ++u) {
      for (int c = 0; c < columns; ++c) {
        const std::size_t block =
            u * static_cast<std::size_t>(columns) + static_cast<std::size_t>(c);
        std::copy_n(data.begin() + static_cast<std::ptrdiff_t>(block * capacity_),
                    units_[u].slot_limit,
                    grown.begin() + static_cast<std::ptrdiff_t>(block * new_capacity));
      }
    }
    data.swap(grown);
  }

  UnitLayout layout_;
  PositionMode mode_ = PositionMode::original;
  SlotReuse reuse_ = SlotReuse::newest_freed_first;
  int capacity_ = 0;
  int score_columns_ = 0;
  std::vector<UnitState> units_;
  std::int64_t total_live_ = 0;
  std::int64_t peak_total_live_ = 0;
  std::vector<std::int64_t> original_;  // [units][capacity]
  std::vector<std::int32_t> token_;     // [units][capacity]
  std::vector<std::uint8_t> flags_;     // [units][capacity]
  std::vector<std::int32_t> group_;     // [units][capacity]; kFree for free slots
  std::vector<float> score_;            // [units][score_columns + 1][capacity], in storage order
  std::vector<std::uint8_t> score_storage_;  // [units][score_columns + 1]: column -> storage index
  std::vector<std::int32_t> scratch_;        // evict's working list
  // One halving search of locate_oldest: `count` entries from `first` left to search.
  struct Search {
    StreamOrderPieces entries;
    const std::int64_t* originals;
    std::int64_t target;
    int first;
    int count;
    std::int32_t slot;  // the entry read at this step
    int unit;
  };
  std::vector<Search> searches_;           // locate_oldest's
  std::vector<PendingStretch> stretches_;  // fold's working lists
  std::vector<std::int32_t> by_size_;
};

}  // namespace kvevict
