// The engine's whole view of kvevict: what an inference engine includes to let a policy bound its
// KV cache. The protocol (what to call per forward, in which order) is told once, in
// docs/design.md ("The forward protocol"); this header states each call's contract.
//
// The engine keeps its memory. kvevict gives every token of every (layer, KV head) a slot in
// [0, capacity), the engine stores the token's key and value wherever slot s maps to in its
// buffers, and each decision comes back in one KvBackend::apply call naming the freed slots and,
// rarely, stored keys to re-rotate. Evicting moves no data.
//
// Spans returned here view kvevict's memory: each says until which call it stays valid. Ranges are
// half-open ([begin, end)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvevict/allocation.hpp"
#include "kvevict/granularity.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/rope.hpp"  // kvevict::Rope, for engines without a RoPE of their own
#include "kvevict/signals.hpp"
#include "kvevict/timing.hpp"

namespace kvevict {

namespace detail {
class SequenceCore;
}

struct SequenceConfig {
  int layers = 0;
  int q_heads = 0;   ///< query heads (attention rows hold one row per query head)
  int kv_heads = 0;  ///< key/value heads; q_heads % kv_heads == 0
  /// Defaults to the policy's own (positions.hpp).
  std::optional<PositionMode> position_mode;
  /// Defaults to the policy's own (granularity.hpp): how many keep-sets. Engines whose cells are
  /// shared by every head (llama.cpp) use token; paged engines block:B (supports_blocks()).
  std::optional<Granularity> granularity;
  /// post_rope: keys are rotated when written (to key_position), and kvevict may ask to fold
  /// pending rotations into them. pre_rope: keys are rotated at attention; no rotation is asked.
  KeyStorage key_storage = KeyStorage::post_rope;
  /// Length of a key vector (observe_keys); needed only by policies that read the keys.
  int head_dim = 0;
  /// Largest chunk (and catalyst prompt) the engine will feed; it sizes the slots.
  int max_chunk = 1;
  /// Slots reserved up front; 0 = the policy's retained limit + max_chunk (256 if unbounded).
  int initial_capacity = 0;
  /// Caps that first reservation (0 = no cap); the slots then double as tokens arrive. Engines
  /// that must not reallocate while running leave it at 0.
  int max_initial_capacity = 0;
  /// post_rope keys under a shifting position mode: the most distinct pending rotations a unit
  /// carries (each costs attention one query rotation per run); past it kvevict folds the
  /// smallest stretches of stream order into the stored keys (docs/design.md, "Folds"). 0 = every
  /// key turned to its position at every decision (attention that cannot rotate the query per run).
  int max_pending_rotations = 32;
  /// Which free slot a new token takes: lowest_first when the engine allocates cells that way
  /// (llama.cpp), so that slot i stays the engine's cell i.
  SlotReuse slot_reuse = SlotReuse::newest_freed_first;
  /// After every decision, move each unit's newest live slots into its free ones so that its live
  /// slots are [0, live) (SlotTable::compact; AppliedDecision::moves): the engine's rows of a head
  /// can then shrink with its share (a budget split by allocation). The backend must move rows;
  /// an engine whose cells are shared by every head (llama.cpp) leaves it off.
  bool compact_slots = false;
  /// Build key_runs() and live_mask() at every begin_chunk / begin_catalyst (one pass over each
  /// unit's slots). Engines attending over their own cells (llama.cpp) turn it off.
  bool attention_views = true;
  /// One budget for the whole sequence, split over its decision units by `allocation`
  /// (policies/allocated.hpp; the policy needs a score rule: h2o, tova, knorm, keydiff): live
  /// tokens summed over every (layer, KV head), or their keys' and values' bytes (with
  /// token_bytes), at most one of the two. Both 0: the policy's own budget in every unit, split by
  /// `allocation`; both 0 under uniform: the policy alone, undecorated.
  std::int64_t budget_tokens = 0;
  std::int64_t budget_bytes = 0;
  /// Key + value bytes of one token of one KV head in the engine's storage type (2 *
  /// kv_row_bytes(type, head_dim)); needed by budget_bytes. EvictingCache fills it in.
  std::int64_t token_bytes = 0;
  Allocation allocation = Allocation::uniform;
  int pyramid_beta = 20;        ///< pyramid: lo = mean // beta (KVCache-Factory's default 20)
  double adaptive_floor = 0.2;  ///< adaptive: each head's floor share (AdaKV's default 0.2)
};

/// Counters over the life of a sequence. Slot counts are summed over all (layer, KV head).
struct SequenceStats {
  std::int64_t tokens_fed = 0;              ///< stream tokens appended (catalyst tokens excluded)
  std::int64_t decisions = 0;               ///< decisions that evicted something
  std::int64_t evicted_slots = 0;           ///< slots evicted (rolled-back catalyst slots excluded)
  std::int64_t rotated_keys = 0;            ///< stored keys re-rotated by folds
  std::int64_t folds = 0;                   ///< unit folds
  std::int64_t catalyst_runs = 0;           ///< catalyst prompts run
  std::int64_t turns = 0;                   ///< chunks that started a turn
  std::int64_t pressure_evicted_slots = 0;  ///< of evicted_slots, those shrink_to evicted
  std::int64_t moved_slots = 0;             ///< slots moved by compact_slots
};

/// A run of live slots [begin, end) of one head that share one `rotation`. post_rope keys: the
/// run's keys are stored rotated to (position - rotation), so attention rotates the query to
/// (query position - rotation) once per run. pre_rope keys: rotation is 0; rotate each key to
/// position(). Free slots may sit between runs, never inside one.
struct KeyRun {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  std::int64_t rotation = 0;
};

/// One evicted token as the engine sees it.
struct EvictedSlot {
  std::int32_t slot = 0;
  std::int64_t original_position = 0;
  std::int64_t position = 0;  ///< its RoPE position just before the decision
};

/// Stored post-RoPE keys of `slots` (one unit) to rotate by `delta` positions.
struct KeyRotation {
  int unit = 0;
  std::int64_t delta = 0;
  std::span<const std::int32_t> slots;
};

/// A decision as kvevict applied it to its metadata, handed to KvBackend::apply. Its spans are
/// valid during that call only.
class AppliedDecision {
 public:
  Trigger trigger = Trigger::after_forward;
  PositionMode position_mode = PositionMode::original;
  UnitLayout layout;  ///< which heads share a keep-set: layout.unit_of(layer, kv_head)

  /// Tokens evicted from the unit of head (layer, kv_head), oldest first; their slots are free.
  [[nodiscard]] std::span<const EvictedSlot> evicted(int layer, int kv_head) const;
  /// Tokens evicted from `unit`, oldest first.
  [[nodiscard]] std::span<const EvictedSlot> evicted(int unit) const;
  /// Evicted tokens over all units.
  [[nodiscard]] std::size_t evicted_count() const { return evicted_.size(); }
  /// Stored keys of head (layer, kv_head) to rotate in place (post_rope storage only).
  [[nodiscard]] std::span<const KeyRotation> rotations(int layer, int kv_head) const;
  /// Every rotation, grouped by unit in ascending unit order.
  [[nodiscard]] std::span<const KeyRotation> rotations() const { return rotations_; }
  /// Live tokens of `unit` that changed slot (SequenceConfig::compact_slots): move each head's key
  /// and value rows from `from` to `to`. Every `to` is free and no `from` is a `to`, so the moves
  /// are independent. Rotations name the slots after the moves.
  [[nodiscard]] std::span<const SlotMove> moves(int unit) const;
  /// Whether any unit's slots moved.
  [[nodiscard]] bool has_moves() const { return !moves_.empty(); }

 private:
  friend class detail::SequenceCore;  // the builder
  std::vector<EvictedSlot> evicted_;
  std::vector<std::size_t> evicted_begin_;  // [units + 1]
  std::vector<KeyRotation> rotations_;
  std::vector<std::size_t> rotation_begin_;       // [units + 1]
  std::vector<std::size_t> rotation_slot_begin_;  // [rotations]
  std::vector<std::int32_t> rotated_slots_;
  std::vector<SlotMove> moves_;
  std::vector<std::size_t> moves_begin_;  // [units + 1]
};

/// What the engine implements over its own K/V memory. kvevict's KvStore is one such backend.
class KvBackend {
 public:
  virtual ~KvBackend() = default;
  /// From now on every head's slots are [0, capacity): make room, keeping contents. Called at
  /// construction and whenever an unbounded policy needs more slots; capacity never shrinks.
  virtual void reserve(int capacity) = 0;
  /// Free the evicted slots (most engines: nothing to do), move the rows moves() names (only
  /// under compact_slots), then rotate the stored keys that rotations() names. Called once per
  /// decision, never empty. An exception leaves the sequence unusable: kvevict's metadata has
  /// changed already.
  virtual void apply(const AppliedDecision& decision) = 0;
};

/// One sequence under one policy. Misuse (a call out of order, a wanted signal missing, rows of the
/// wrong shape, NaN or out-of-range values) is a kvevict::Error with a message, and a refused call
/// changes nothing. Not thread-safe: one thread drives a sequence (const calls may run at once).
class Sequence {
 public:
  /// `backend` (null: metadata only) and `observer` (may be null) must outlive the sequence.
  /// The backend is reserve()d to the initial capacity here.
  Sequence(const SequenceConfig& config, std::unique_ptr<Policy> policy,
           KvBackend* backend = nullptr, StageObserver* observer = nullptr);
  Sequence(Sequence&&) noexcept;
  Sequence& operator=(Sequence&&) noexcept;
  ~Sequence();

  // --- per forward -------------------------------------------------------------------------------

  /// Starts a forward over `token_ids` (a turn's first chunk: turn_start, for SirLLM): evicts
  /// first if the policy does so before a turn, then gives every token a slot in every head.
  void begin_chunk(std::span<const std::int32_t> token_ids, bool turn_start = false);
  /// Slot of each token of the current chunk (or catalyst) in head (layer, kv_head). Valid until
  /// the next begin_chunk / begin_catalyst.
  [[nodiscard]] std::span<const std::int32_t> chunk_slots(int layer, int kv_head) const;
  /// RoPE position of live slot `slot`: the query's, for the chunk's own slots.
  [[nodiscard]] std::int64_t position(int layer, int kv_head, std::int32_t slot) const;
  /// Position a post_rope key at `slot` is (to be) stored rotated to.
  [[nodiscard]] std::int64_t key_position(int layer, int kv_head, std::int32_t slot) const;
  /// Attention over head (layer, kv_head) covers slots [0, slot_limit).
  [[nodiscard]] int slot_limit(int layer, int kv_head) const;
  /// The live slots of [0, slot_limit) by run (KeyRun). Valid from begin_chunk / begin_catalyst
  /// until end_forward / end_catalyst (needs config().attention_views).
  [[nodiscard]] std::span<const KeyRun> key_runs(int layer, int kv_head) const;
  /// One byte per slot of [0, slot_limit): 1 live, 0 free (attention gives free slots 0). Valid
  /// like key_runs.
  [[nodiscard]] std::span<const std::uint8_t> live_mask(int layer, int kv_head) const;

  /// True when the policy reads attention: hand attention_queries() rows of every layer.
  [[nodiscard]] bool wants_attention() const;
  /// How many of the chunk's newest queries the policy reads: the whole chunk (H2O), 1 (TOVA), or
  /// 0 when it reads no attention.
  [[nodiscard]] int attention_queries() const;
  /// Softmax rows of one layer, [q_heads][queries][row_stride] floats: the row of query head h
  /// over slots [0, slot_limit) of KV head h / (q_heads / kv_heads), free and masked slots 0.
  /// `queries` is attention_queries(). The data is read during the call only. Every layer once.
  void observe_attention(int layer, const float* rows, int queries, std::ptrdiff_t row_stride);
  /// True when the policy takes a layer's KV heads in separate calls (Policy::
  /// attention_per_kv_head: H2O, TOVA), with the same scores and decisions as one call for the
  /// layer: an engine that attends a KV head at a time then holds one head's rows, not the
  /// layer's.
  [[nodiscard]] bool attention_per_kv_head() const;
  /// The rows of KV heads [kv_head_begin, kv_head_end) of one layer, [(kv_head_end -
  /// kv_head_begin) x q_heads / kv_heads][queries][row_stride] floats, as above. Each call is
  /// refused whole (nothing recorded, the heads may be observed again); every KV head of every
  /// layer once. A range short of the whole layer needs attention_per_kv_head().
  void observe_attention(int layer, int kv_head_begin, int kv_head_end, const float* rows,
                         int queries, std::ptrdiff_t row_stride);
  /// True when the policy reads the keys (K-norm, KeyDiff): hand every layer's to observe_keys.
  [[nodiscard]] bool wants_keys() const;
  /// Keys of the chunk's tokens in one layer, [kv_heads][chunk][row_stride] floats, head_dim each,
  /// rotated to each token's position() as a post-RoPE cache holds them when written (whatever
  /// rotation the engine's own storage defers). Read during the call only. Every layer once, NaN
  /// and infinities refused.
  void observe_keys(int layer, const float* keys, std::ptrdiff_t row_stride);
  /// True when the policy reads the surprisal (-log p) of every token of the chunk.
  [[nodiscard]] bool wants_surprisal() const;
  void observe_surprisal(std::span<const float> surprisal);
  /// Ends the forward: checks that the policy got what it reads, then evicts if it does so now.
  void end_forward();

  /// A KV pool's pressure (kv_pool.hpp): evicts by the policy's own keep rule, now, until no head
  /// holds more than `max_live` tokens besides those the policy protects (its min_retained()).
  /// Between forwards; needs policy().supports_pressure().
  void shrink_to(int max_live);

  /// Removes the newest `count` stream tokens (a rejected draft); feeds continue from there. The
  /// engine discards their K/V; the policy's own state is not rolled back.
  void roll_back(int count);

  // --- InfiniPot's catalyst --------------------------------------------------------------------

  /// Tokens that fit before the policy's pot is full (feed at most this many per forward), or
  /// nullopt when the policy has no pot.
  [[nodiscard]] std::optional<int> pot_room() const;
  /// The pot is full: begin_catalyst(ids), write and attend as a chunk, observe_catalyst(layer,
  /// ...) for every layer (rows of all the catalyst's queries), end_catalyst().
  [[nodiscard]] bool catalyst_pending() const;
  void begin_catalyst(std::span<const std::int32_t> token_ids);
  void observe_catalyst(int layer, const float* rows, int queries, std::ptrdiff_t row_stride);
  void end_catalyst();

  // --- inspection --------------------------------------------------------------------------------

  [[nodiscard]] const SequenceConfig& config() const;
  [[nodiscard]] const Policy& policy() const;
  [[nodiscard]] PositionMode position_mode() const;
  [[nodiscard]] Granularity granularity() const;
  /// Slots per head in use ([0, capacity)); grows only for unbounded policies.
  [[nodiscard]] int capacity() const;
  /// Tokens of the current chunk (or catalyst prompt); 0 between forwards.
  [[nodiscard]] int chunk_size() const;
  /// True between forwards: no chunk and no catalyst prompt (even an empty one) is open.
  [[nodiscard]] bool idle() const;
  /// Live tokens of head (layer, kv_head).
  [[nodiscard]] int live(int layer, int kv_head) const;
  /// The most live tokens any head holds: the sequence's cells in an engine whose cells are
  /// shared by every head.
  [[nodiscard]] int max_live() const;
  /// Which keep-set (decision unit) head (layer, kv_head) belongs to.
  [[nodiscard]] int unit_of(int layer, int kv_head) const;
  [[nodiscard]] const SequenceStats& stats() const;
  /// The slot metadata (stream order, original positions, scores), for tools and tests.
  [[nodiscard]] const SlotTable& slots() const;
  /// Whether the policy consumes `signal` (signals.hpp).
  [[nodiscard]] bool wants(Signal signal) const;
  void set_observer(StageObserver* observer);
  [[nodiscard]] StageObserver* observer() const;

 private:
  std::unique_ptr<detail::SequenceCore> core_;
};

}  // namespace kvevict

#include "kvevict/detail/sequence-inl.hpp"
