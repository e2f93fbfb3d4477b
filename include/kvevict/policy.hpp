// Policy: the interface every eviction policy implements (a kvpress "press", in C++).
//
// A policy is a per-sequence object: a score (what it reads from the signals it declares and keeps
// in score columns of the SlotTable), a keep rule (select(): which live slots go) and a trigger
// (when select() runs). Protection (sinks, a recent window, anchors) and a slot cap are decorators
// around a policy (policies/protection.hpp), not settings of each policy. A policy never touches
// keys or values: the same object drives kvevict's KvStore or an engine's own buffers, through
// kvevict::Sequence.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvevict/decision.hpp"
#include "kvevict/granularity.hpp"
#include "kvevict/positions.hpp"
#include "kvevict/selection.hpp"
#include "kvevict/signals.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {

/// The tokens of the forward being processed.
struct ChunkInfo {
  std::int64_t first_original_position = 0;
  std::span<const std::int32_t> token_ids;
  bool turn_start = false;
  [[nodiscard]] int size() const { return static_cast<int>(token_ids.size()); }
};

/// What a policy sees when a trigger fires. Policies may update their score columns in `slots`
/// (SirLLM decays them) but change nothing else: Sequence applies the decision.
struct EvictionContext {
  Trigger trigger = Trigger::after_forward;
  SlotTable& slots;
  /// before_turn: tokens about to be fed; otherwise 0.
  int incoming = 0;
  /// Slots the decorators around the policy protect: keep them in addition to the rule's own.
  Protection protection{};
  /// The most live slots the decision may leave in a unit, protected slots excepted: a KV pool's
  /// grant (Sequence::shrink_to). Policies whose supports_pressure() is true evict down to it by
  /// their own ranking; the default leaves the rule's own budget alone.
  int max_live = std::numeric_limits<int>::max();
  /// An allocation's split of a sequence budget (policies/allocated.hpp): when not empty, the
  /// keep rule's `keep` for unit u is unit_keep[u] instead of its own (Policy::score_rule()).
  std::span<const int> unit_keep{};

  /// The rule's keep for `unit`: unit_keep[unit], or `own` when no allocation is given.
  [[nodiscard]] int keep(int unit, int own) const {
    return unit_keep.empty() ? own : unit_keep[static_cast<std::size_t>(unit)];
  }
};

/// A keep rule of the form "the protected slots plus the top `keep` unprotected slots of score
/// column `column`, per unit" (H2O, TOVA, K-norm, KeyDiff): what an allocation needs to split one
/// sequence budget over the units (policies/allocated.hpp).
struct ScoreRule {
  int column = 0;  ///< the score column ranked (higher is kept; ties to the lower position)
  int keep = 0;    ///< unprotected slots each unit keeps: the rule's own budget
  Protection protection{};  ///< what the rule's decorators protect besides its top `keep`
};

class Policy {
 public:
  virtual ~Policy() = default;

  /// Stable identifier, e.g. "streaming_llm".
  [[nodiscard]] virtual std::string_view name() const = 0;
  /// Signals the engine must compute and pass in; a decision reached without them is an error.
  [[nodiscard]] virtual SignalSet signals() const { return {}; }
  /// When select() is called.
  [[nodiscard]] virtual TriggerSet triggers() const { return {Trigger::after_forward}; }
  /// Float score columns the policy keeps per slot.
  [[nodiscard]] virtual int score_columns() const { return 0; }
  /// The position mode of the paper / authors' code; engines may choose another.
  [[nodiscard]] virtual PositionMode default_position_mode() const {
    return PositionMode::original;
  }
  /// The granularity of the paper / authors' code: how many keep-sets (granularity.hpp).
  [[nodiscard]] virtual Granularity default_granularity() const { return Granularity::head; }
  /// Whether the keep rule has a block form, so that the policy accepts Granularity::block: whole
  /// blocks kept or evicted (selection.hpp, WorstCandidates).
  [[nodiscard]] virtual bool supports_blocks() const { return false; }
  /// Whether the keep rule honours EvictionContext::max_live (evicts further by its own ranking,
  /// protected slots kept), so that a KV pool can shrink the sequence below its budget
  /// (Sequence::shrink_to): the budget rules of Window, StreamingLLM, H2O, TOVA, K-norm, KeyDiff.
  [[nodiscard]] virtual bool supports_pressure() const { return false; }
  /// The fewest slots per unit the keep rule leaves however hard it is pressed (what its
  /// decorators protect: sinks, a recent window). Meaningful when supports_pressure().
  [[nodiscard]] virtual int min_retained() const { return 0; }
  /// The rule as "protected plus the top `keep` of one score column", when it has that form and
  /// honours EvictionContext::unit_keep; nullopt otherwise (the default).
  [[nodiscard]] virtual std::optional<ScoreRule> score_rule() const { return std::nullopt; }
  /// Throws kvevict::Error when the policy cannot run on this sequence's units (`layout`) and GQA
  /// grouping (`group_size` query heads per KV head). Called once, when the sequence is built, so
  /// that a sequence that exists can decode.
  virtual void check_sequence(const UnitLayout& /*layout*/, int /*group_size*/) const {}
  /// Brings `unit`'s score column up to date before it is ranked from outside select() (an
  /// allocation's ranking across units), for scores computed at eviction time (KeyDiff).
  virtual void update_scores(SlotTable& /*slots*/, int /*unit*/) {}
  /// Whether its units keep different numbers of tokens, or numbers that change (a budget split by
  /// pyramid or adaptive): an engine that sizes each head's rows by what it holds then compacts
  /// (SequenceConfig::compact_slots).
  [[nodiscard]] virtual bool uneven_shares() const { return false; }
  /// Most slots any unit holds once the policy has evicted (at its steady point), or nullopt when
  /// the policy has no bound (full cache, AnLLM without a cap). Engines size buffers from it.
  [[nodiscard]] virtual std::optional<int> retained_limit() const { return std::nullopt; }
  /// Whether observe_attention itself refuses rows that are not attention probabilities, with
  /// check_probabilities' message and before it changes any score (add_attention_checked: the
  /// check fused into its pass over the rows). Sequence then checks only their shape.
  [[nodiscard]] virtual bool checks_probabilities() const { return false; }
  /// Whether observe_attention takes a layer's KV heads in separate calls (AttentionRows::
  /// first_kv_head), each refused whole, with the same scores as one call for the layer: an
  /// engine that attends a KV head at a time then holds one head's rows, not the layer's.
  /// Otherwise every call covers all the layer's KV heads.
  [[nodiscard]] virtual bool attention_per_kv_head() const { return false; }
  /// slot_flag bits for a newly appended token (e.g. anchor).
  [[nodiscard]] virtual std::uint8_t flags_for(std::int32_t /*token_id*/) const { return 0; }
  /// Tokens that can still be appended before the policy's pot is full (engines split chunks
  /// there; 0 = full: run the catalyst now), or nullopt when the policy has no pot (InfiniPot).
  [[nodiscard]] virtual std::optional<int> pot_room(const SlotTable& /*slots*/) const {
    return std::nullopt;
  }

  /// Live tokens of `unit` changed slot (SequenceConfig::compact_slots; the table's columns have
  /// moved already): a policy keeping per-slot state of its own moves it here.
  virtual void move_slots(int /*unit*/, std::span<const SlotMove> /*moves*/) {}
  /// The chunk's tokens were just appended to every unit (Sequence::chunk_slots).
  virtual void on_append(SlotTable& /*slots*/, const ChunkInfo& /*chunk*/) {}
  /// Attention rows of one layer for the current forward (attention_rows / last_attention_row):
  /// every KV head's, or some of them when attention_per_kv_head().
  virtual void observe_attention(SlotTable& /*slots*/, int /*layer*/,
                                 const AttentionRows& /*rows*/) {}
  /// Key vectors of one layer's tokens of the current forward (Signal::keys).
  virtual void observe_keys(SlotTable& /*slots*/, int /*layer*/, const KeyRows& /*keys*/) {}
  /// -log p of each token of the current chunk, index k for original position first + k.
  virtual void observe_surprisal(SlotTable& /*slots*/, const ChunkInfo& /*chunk*/,
                                 std::span<const float> /*surprisal*/) {}
  /// Attention rows of the catalyst prompt's queries for one layer (catalyst_attention). Rows cover
  /// the pot's slots and the catalyst's own slots.
  virtual void observe_catalyst(SlotTable& /*slots*/, int /*layer*/,
                                const AttentionRows& /*rows*/) {}

  /// Decides for `context.trigger`: marks the live slots to evict in `decision` (which arrives
  /// cleared), keeping every slot context.protection covers.
  virtual void select(const EvictionContext& context, Decision& decision) = 0;
};

}  // namespace kvevict
