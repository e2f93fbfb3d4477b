// Shared selection: protection, keep-set construction and a defined top-k, over one unit's slots.
//
// Every policy's keep rule is a short sequence of steps over a unit's live slots: keep the slots
// its decorators protect (sinks, a recent window, anchors: Protection), then the rule's own (the
// top-k of a score among the slots not kept yet, the newest, ...); every live slot not kept is
// evicted. Ties in scores always go to the lower original position, so every decision is a
// function of the scores alone, whatever the slot layout.
//
// KeepSet is the general form (O(slot limit) per decision). evict_worst() is the form of the
// budget rules (Window, StreamingLLM, H2O, TOVA) on their per-token path: it evicts the few worst
// candidates in one pass over the unprotected range, or, ranking by recency, takes the oldest
// candidates in O(evicted).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvevict/decision.hpp"
#include "kvevict/detail/row_passes.hpp"
#include "kvevict/error.hpp"
#include "kvevict/slot_table.hpp"

namespace kvevict {

/// Slots that decorators (policies/protection.hpp) protect from the policy they wrap: kept in
/// addition to whatever the policy keeps. Nested decorators combine by union.
struct Protection {
  int oldest = 0;          ///< the `oldest` oldest live slots of every unit (attention sinks)
  int newest = 0;          ///< the `newest` newest live slots (a recent window)
  std::uint8_t flags = 0;  ///< every slot carrying one of these slot_flag bits (anchors)
  [[nodiscard]] bool empty() const { return oldest == 0 && newest == 0 && flags == 0; }

  /// Stream indices [first, last) of a unit of `live` tokens that `oldest` and `newest` leave
  /// unprotected (flags aside); the oldest are protected first when the two overlap.
  struct Range {
    int first = 0;
    int last = 0;
  };
  [[nodiscard]] Range unprotected(int live) const {
    const int first = std::min(oldest, live);
    return {first, live - std::min(newest, live - first)};
  }
};

/// Throws kvevict::Error if `score` is NaN: a NaN would make the ranking undefined.
inline void require_number(float score, std::int64_t original) {
  if (std::isnan(score)) {
    throw Error("eviction score is NaN at original position " + std::to_string(original) +
                ": the policy's signals (attention rows or surprisal) contain NaN");
  }
}

/// The keep set of one unit. Reusable: begin() allocates nothing once the buffers have grown.
class KeepSet {
 public:
  /// Starts a keep set over the live slots of `unit`, with the slots `protection` covers kept.
  void begin(const SlotTable& slots, int unit, const Protection& protection = {}) {
    slots_ = &slots;
    unit_ = unit;
    order_ = slots.stream_order(unit);
    kept_count_ = 0;
    kept_.assign(static_cast<std::size_t>(slots.slot_limit(unit)), 0);
    keep_oldest(protection.oldest);
    keep_newest(protection.newest);
    if (protection.flags != 0) keep_flagged(protection.flags);
  }

  [[nodiscard]] int live() const { return static_cast<int>(order_.size()); }
  [[nodiscard]] int kept() const { return kept_count_; }
  [[nodiscard]] bool is_kept(std::int32_t slot) const {
    return kept_[static_cast<std::size_t>(slot)] != 0;
  }
  /// The unit's live slots, oldest first.
  [[nodiscard]] std::span<const std::int32_t> order() const { return order_; }

  void keep(std::int32_t slot) { keep_each({&slot, 1}); }
  /// Keeps every slot of `slots`, counting in a register: each byte store may alias the count,
  /// which a loop of keep() therefore reloads at every slot.
  void keep_each(std::span<const std::int32_t> slots) {
    std::uint8_t* const kept = kept_.data();
    int added = 0;
    for (const std::int32_t slot : slots) {
      added += kept[static_cast<std::size_t>(slot)] == 0 ? 1 : 0;
      kept[static_cast<std::size_t>(slot)] = 1;
    }
    kept_count_ += added;
  }
  /// Keeps the `count` oldest live slots.
  void keep_oldest(int count) {
    keep_each(order_.first(static_cast<std::size_t>(std::clamp(count, 0, live()))));
  }
  /// Keeps the `count` newest live slots.
  void keep_newest(int count) {
    keep_each(order_.last(static_cast<std::size_t>(std::clamp(count, 0, live()))));
  }
  /// Keeps every live slot whose flags share a bit with `mask`.
  void keep_flagged(std::uint8_t mask) {
    const std::span<const std::uint8_t> flags = slots_->flags(unit_);
    for (const std::int32_t slot : order_) {
      if ((flags[static_cast<std::size_t>(slot)] & mask) != 0) keep(slot);
    }
  }
  /// Keeps every live slot at an original position above `original`.
  void keep_newer_than(std::int64_t original) {
    const std::span<const std::int64_t> originals = slots_->original_positions(unit_);
    for (auto it = order_.rbegin();
         it != order_.rend() && originals[static_cast<std::size_t>(*it)] > original; ++it) {
      keep(*it);
    }
  }
  /// Keeps the `k` highest-scoring live slots among those not kept yet (all of them if fewer).
  /// `scores` is indexed by slot. Ties go to the lower original position; NaN is an error.
  void keep_top_k(std::span<const float> scores, int k) {
    const std::span<const std::int64_t> originals = slots_->original_positions(unit_);
    candidates_.clear();
    for (const std::int32_t slot : order_) {
      if (is_kept(slot)) continue;
      require_number(scores[static_cast<std::size_t>(slot)],
                     originals[static_cast<std::size_t>(slot)]);
      candidates_.push_back(slot);
    }
    if (k <= 0) return;
    const int left_out = static_cast<int>(candidates_.size()) - k;
    if (left_out <= 0) {
      for (const std::int32_t slot : candidates_) keep(slot);
      return;
    }
    // A strict order (originals are distinct), so the top k are one set however they are found.
    const auto better = [&](std::int32_t a, std::int32_t b) {
      const float sa = scores[static_cast<std::size_t>(a)];
      const float sb = scores[static_cast<std::size_t>(b)];
      return sa > sb || (sa == sb && originals[static_cast<std::size_t>(a)] <
                                         originals[static_cast<std::size_t>(b)]);
    };
    if (left_out > kFewLeftOut) {
      std::nth_element(candidates_.begin(), candidates_.begin() + k, candidates_.end(), better);
      candidates_.resize(static_cast<std::size_t>(k));
      for (const std::int32_t slot : candidates_) keep(slot);
      return;
    }
    // A turn's few evictions (SirLLM: as many as the turn has tokens): the candidates left out are
    // the `left_out` worst, found in one pass, sorted worst first; the rest are the top k.
    worst_.clear();
    for (const std::int32_t slot : candidates_) {
      if (static_cast<int>(worst_.size()) == left_out) {
        if (!better(worst_.back(), slot)) continue;
        worst_.pop_back();
      }
      worst_.insert(std::upper_bound(worst_.begin(), worst_.end(), slot,
                                     [&](std::int32_t a, std::int32_t b) { return better(b, a); }),
                    slot);
    }
    constexpr std::uint8_t kLeftOut = 2;  // neither kept (1) nor free to keep (0), for this pass
    for (const std::int32_t slot : worst_) kept_[static_cast<std::size_t>(slot)] = kLeftOut;
    for (const std::int32_t slot : candidates_) {
      if (kept_[static_cast<std::size_t>(slot)] == 0) keep(slot);
    }
    for (const std::int32_t slot : worst_) kept_[static_cast<std::size_t>(slot)] = 0;
  }
  /// Keeps the newest slots not kept yet until `total` slots are kept (or none are left).
  void fill_newest(int total) {
    for (auto it = order_.rbegin(); it != order_.rend() && kept_count_ < total; ++it) keep(*it);
  }

  /// Evicts every live slot not kept; returns how many.
  int evict_rest(Decision& decision) const {
    int evicted = 0;
    for (const std::int32_t slot : order_) {
      if (is_kept(slot)) continue;
      decision.evict(unit_, slot);
      ++evicted;
    }
    return evicted;
  }

 private:
  const SlotTable* slots_ = nullptr;
  int unit_ = 0;
  std::span<const std::int32_t> order_;
  int kept_count_ = 0;
  std::vector<std::uint8_t> kept_;  // [slot limit]
  std::vector<std::int32_t> candidates_;
  static constexpr int kFewLeftOut = 16;  // keep_top_k: up to this many left out, one pass
  std::vector<std::int32_t> worst_;       // keep_top_k: the candidates left out, worst first
};

/// How a policy's scores move between decisions, for WorstCandidates.
enum class ScoreTrend : std::uint8_t {
  /// Any score may change (TOVA's last row, KeyDiff's moving anchor): each decision looks at every
  /// candidate.
  any,
  /// A token's score never decreases while it is live (K-norm's fixed norm, H2O's sum of
  /// probabilities). WorstCandidates then keeps the unit's candidates in a heap from one decision
  /// to the next, and a steady-state step costs a few heap moves instead of a pass over the unit.
  never_falls,
};

/// The worst of every slot of a unit (the lowest score, the later original position among equals:
/// WorstCandidates' order), found by a policy right after it rewrote the unit's score column whole
/// in a forward (TOVA), while the column is in cache; at select() a decode step's other layers have
/// streamed their weights through the caches since. When one token goes and it is a candidate (not
/// protected), it is the worst candidate, and WorstCandidates::evict takes it in place of its
/// search. It holds for the scores and slots as they stood: while the unit keeps its generation
/// and live count and the slot its token. The policy drops it when new tokens arrive (on_append)
/// and once select() has seen it.
struct KnownWorst {
  std::int32_t slot = -1;  ///< -1: none
  std::int64_t original = 0;
  int live = 0;
  std::uint64_t generation = 0;

  /// The worst of slots [0, slot_limit) of `unit` by `scores` (indexed by slot), when every one of
  /// them is live and none of their scores is NaN (the search then names it); else none. Two
  /// passes over the column at the CPU's vector width: its lowest value, then the slots holding
  /// it (usually one; among several, the highest original position).
  [[nodiscard]] static KnownWorst of_every_slot(const SlotTable& slots, int unit,
                                                std::span<const float> scores) {
    const int n = slots.slot_limit(unit);
    if (n == 0 || slots.live(unit) != n || scores.size() < static_cast<std::size_t>(n)) return {};
    const detail::row_pass::Lowest lowest = detail::lowest_of(scores.data(), n);
    if (lowest.nan) return {};
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    int worst = detail::first_equal(scores.data(), 0, n, lowest.value);
    for (int s = detail::first_equal(scores.data(), worst + 1, n, lowest.value); s < n;
         s = detail::first_equal(scores.data(), s + 1, n, lowest.value)) {
      if (originals[static_cast<std::size_t>(s)] > originals[static_cast<std::size_t>(worst)]) {
        worst = s;
      }
    }
    return {worst, originals[static_cast<std::size_t>(worst)], n, slots.generation(unit)};
  }

  /// Whether it still names the worst of `unit`'s slots: see above.
  [[nodiscard]] bool holds(const SlotTable& slots, int unit) const {
    return slot >= 0 && slots.generation(unit) == generation && slots.live(unit) == live &&
           slots.slot_limit(unit) == live &&
           slots.original_positions(unit)[static_cast<std::size_t>(slot)] == original;
  }
};

/// The budget rule of Window, StreamingLLM, H2O and TOVA for one unit: among the live slots that
/// `protection` leaves (the candidates), keeps the `keep` best and evicts the rest, and more of
/// the worst while the unit would hold over `max_live` (a KV pool's grant; protected slots are
/// never evicted for it). Best is the highest score in `scores` (indexed by slot; ties to the
/// lower original position), or, when `scores` is empty, the newest. Returns the number evicted.
/// Cost: one pass over the candidates with scores; O(evicted) by recency; under
/// ScoreTrend::never_falls, a steady-state eviction is O(log candidates) heap moves; with a
/// `known` worst that holds and is a candidate, when one goes, none.
class WorstCandidates {
 public:
  explicit WorstCandidates(ScoreTrend trend = ScoreTrend::any) : trend_(trend) {}

  /// The budget rule's order: a token of score `score_a` at original position `original_a` ranks
  /// below one of `score_b` at `original_b` (the lower score, and among equal scores the later
  /// token). A strict total order over distinct originals.
  [[nodiscard]] static bool ranks_below(float score_a, std::int64_t original_a, float score_b,
                                        std::int64_t original_b) {
    return score_a < score_b || (score_a == score_b && original_a > original_b);
  }

  /// The candidates of `unit` and how many of them evict() evicts (0 when none).
  struct Candidates {
    StreamOrderPieces order;  ///< the unit's stream order
    int first = 0;            ///< candidates: stream indices [first, last), flagged slots aside
    int last = 0;
    int count = 0;  ///< how many go
  };
  [[nodiscard]] static Candidates candidates(const SlotTable& slots, int unit,
                                             const Protection& protection, int keep,
                                             int max_live = std::numeric_limits<int>::max()) {
    // Entries by index, where the last eviction's gap may split them (the pieces): the order is
    // never copied or closed for a decision.
    const StreamOrderPieces order = slots.stream_order_pieces(unit);
    const int live = order.size();
    const auto [first, last] = protection.unprotected(live);
    int candidates = last - first;
    if (protection.flags != 0) {
      const std::span<const std::uint8_t> flags = slots.flags(unit);
      for (int i = first; i < last; ++i) {
        candidates -= (flags[static_cast<std::size_t>(order[i])] & protection.flags) != 0 ? 1 : 0;
      }
    }
    // Over the grant: the unit keeps live - candidates protected slots, so at most
    // max_live - that many candidates.
    const int granted = std::max(max_live, 0) - (live - candidates);
    return {order, first, last, std::max(candidates - std::max(std::min(keep, granted), 0), 0)};
  }

  int evict(const SlotTable& slots, int unit, const Protection& protection, int keep,
            std::span<const float> scores, Decision& decision,
            int max_live = std::numeric_limits<int>::max(), const KnownWorst& known = {}) {
    const Candidates chosen = candidates(slots, unit, protection, keep, max_live);
    if (chosen.count == 0) return 0;
    const StreamOrderPieces& order = chosen.order;
    const int first = chosen.first;
    const int last = chosen.last;
    const int count = chosen.count;
    const int live = order.size();
    const std::span<const std::uint8_t> flags = slots.flags(unit);
    const auto protected_by_flag = [&](std::int32_t slot) {
      return (flags[static_cast<std::size_t>(slot)] & protection.flags) != 0;
    };
    if (slots.layout().block_tokens() > 1) {
      return evict_blocks(slots, unit, order, first, last, protection.flags != 0, protected_by_flag,
                          count, scores, decision);
    }
    if (scores.empty()) {  // by recency: the oldest candidates go
      int evicted = 0;
      for (int i = first; evicted < count; ++i) {
        if (protection.flags != 0 && protected_by_flag(order[i])) continue;
        decision.evict(unit, order[i]);
        ++evicted;
      }
      return count;
    }
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    if (count == 1 && protection.flags == 0) {
      if (trend_ == ScoreTrend::never_falls) {
        return evict_one_kept(slots, unit, order, first, last, scores, originals, decision);
      }
      // The worst of every slot, if it is a candidate (its original position within theirs), is
      // the worst candidate.
      const auto original_at = [&](int i) { return originals[static_cast<std::size_t>(order[i])]; };
      if (known.holds(slots, unit) && (first == 0 || original_at(first) <= known.original) &&
          (last == live || known.original <= original_at(last - 1))) {
        decision.evict(unit, known.slot);
        return 1;
      }
      return evict_one(unit, order, first, last, scores, originals, decision);
    }
    // A strict total order (originals are unique), so the evicted set is the complement of "the
    // `keep` best" whatever the method.
    const auto worse = [&](std::int32_t a, std::int32_t b) {
      const auto ia = static_cast<std::size_t>(a);
      const auto ib = static_cast<std::size_t>(b);
      return ranks_below(scores[ia], originals[ia], scores[ib], originals[ib]);
    };
    worst_.clear();
    for (int i = first; i < last; ++i) {
      const std::int32_t slot = order[i];
      if (protection.flags != 0 && protected_by_flag(slot)) continue;
      require_number(scores[static_cast<std::size_t>(slot)],
                     originals[static_cast<std::size_t>(slot)]);
      if (count > kSmall) {
        worst_.push_back(slot);
        continue;
      }
      // Keep the `count` worst seen so far, sorted worst first: the steady state evicts one.
      if (static_cast<int>(worst_.size()) == count) {
        if (!worse(slot, worst_.back())) continue;
        worst_.pop_back();
      }
      worst_.insert(std::upper_bound(worst_.begin(), worst_.end(), slot, worse), slot);
    }
    if (count > kSmall) {
      std::nth_element(worst_.begin(), worst_.begin() + (count - 1), worst_.end(), worse);
      worst_.resize(static_cast<std::size_t>(count));
    }
    for (const std::int32_t slot : worst_) decision.evict(unit, slot);
    return count;
  }

 private:
  static constexpr int kSmall = 16;  // up to this many evictions: one pass with a sorted buffer

  // A block of live tokens: positions [begin, end) of the unit's stream order.
  struct Block {
    int begin = 0;
    int end = 0;
    float score = 0.0f;  // mean of its tokens' scores; unused by recency
  };

  // The block form of the rule (Granularity::block, B tokens per block), given the token form's
  // candidates [first, last) of `order` and the `count` of them it would evict: the unit may hold
  // as many tokens as the token form keeps (live - count). Tokens are grouped into blocks by
  // original position [b * B, (b + 1) * B); a block holding a protected token is kept whole, and
  // so is the newest block (a paged engine is still writing into it). The other blocks are full
  // (blocks only ever leave whole) and go worst first until at least `count` tokens are gone:
  // lowest mean score (ties: the later block goes), or, by recency, the oldest. The bound is exact
  // unless protected blocks alone exceed it; the unit can end up to B - 1 tokens below it.
  template <class Flagged>
  int evict_blocks(const SlotTable& slots, int unit, const StreamOrderPieces& order, int first,
                   int last, bool any_flag, const Flagged& protected_by_flag, int count,
                   std::span<const float> scores, Decision& decision) {
    const int live = order.size();
    const std::span<const std::int64_t> originals = slots.original_positions(unit);
    const std::int64_t size = slots.layout().block_tokens();
    blocks_.clear();
    for (int begin = 0; begin < live;) {
      const std::int64_t block = originals[static_cast<std::size_t>(order[begin])] / size;
      int end = begin + 1;
      while (end < live && originals[static_cast<std::size_t>(order[end])] / size == block) ++end;
      bool kept = begin < first || end > last || end == live;
      double sum = 0.0;
      for (int i = begin; i < end && !kept; ++i) {
        const std::int32_t slot = order[i];
        kept = any_flag && protected_by_flag(slot);
        if (scores.empty()) continue;
        require_number(scores[static_cast<std::size_t>(slot)],
                       originals[static_cast<std::size_t>(slot)]);
        sum += scores[static_cast<std::size_t>(slot)];
      }
      if (!kept) blocks_.push_back({begin, end, static_cast<float>(sum / (end - begin))});
      begin = end;
    }
    // Worst first: the lowest mean, and among equal means the later block (as the token form keeps
    // the lower original position). Blocks come oldest first: reversed, a stable sort keeps that.
    if (!scores.empty()) {
      std::reverse(blocks_.begin(), blocks_.end());
      std::stable_sort(blocks_.begin(), blocks_.end(),
                       [](const Block& a, const Block& b) { return a.score < b.score; });
    }
    int evicted = 0;
    for (const Block& block : blocks_) {
      if (evicted >= count) break;
      for (int i = block.begin; i < block.end; ++i) decision.evict(unit, order[i]);
      evicted += block.end - block.begin;
    }
    return evicted;
  }

  std::vector<Block> blocks_;

  // The steady state of a per-token budget rule: the single worst candidate, in one pass at the
  // CPU's vector width (detail/row_passes.hpp) over each piece of the order the candidates fill,
  // the candidates and the scores first read in order (stream_into_cache: bench_decode_step's H2O
  // overhead at 4K about a quarter lower). Candidates come oldest first, so among equal scores
  // the later one is the worse (ties keep the lower original position): the newer piece's worst
  // wins a tie with the older piece's.
  static int evict_one(int unit, const StreamOrderPieces& order, int first, int last,
                       std::span<const float> scores, std::span<const std::int64_t> originals,
                       Decision& decision) {
    detail::stream_into_cache(scores.data(), scores.size_bytes());
    const int split = static_cast<int>(order.front.size());
    std::int32_t worst_slot = -1;
    bool nan = false;
    for (const auto& [piece, offset] : {std::pair{order.front, 0}, std::pair{order.back, split}}) {
      const int begin = std::max(first - offset, 0);
      const int end = std::min(last - offset, static_cast<int>(piece.size()));
      if (begin >= end) continue;
      detail::stream_into_cache(piece.data() + begin,
                                static_cast<std::size_t>(end - begin) * sizeof(std::int32_t));
      const detail::row_pass::Worst worst =
          detail::worst_in_order(piece.data(), begin, end, scores.data());
      nan = nan || worst.nan;
      const std::int32_t slot = piece[static_cast<std::size_t>(worst.index)];
      if (worst_slot < 0 ||
          scores[static_cast<std::size_t>(slot)] <= scores[static_cast<std::size_t>(worst_slot)]) {
        worst_slot = slot;
      }
    }
    if (nan) {  // name the first NaN
      for (int i = first; i < last; ++i) {
        const std::int32_t slot = order[i];
        require_number(scores[static_cast<std::size_t>(slot)],
                       originals[static_cast<std::size_t>(slot)]);
      }
    }
    decision.evict(unit, worst_slot);
    return 1;
  }

  // ScoreTrend::never_falls: the candidates of each unit in a 4-ary heap, worst first, kept from
  // one decision to the next. An entry holds the candidate's score when the heap last looked at it
  // (a lower bound of its score now: scores never fall) and its original position (a later token
  // may take its slot). Invariant: every live candidate up to original position `through` has an
  // entry; entries of tokens evicted since are dropped when they come to the top.
  struct HeapEntry {
    float score = 0.0f;
    std::int32_t slot = 0;
    std::int64_t original = 0;
  };
  struct CandidateHeap {
    std::vector<HeapEntry> entries;
    std::uint64_t generation = 0;  // SlotTable::generation() at the last decision
    bool built = false;
    std::int64_t through = 0;
    // What the last decision leaves the next, while the unit's SlotTable::evictions() is
    // `evictions_after` and the last evicted token is the top (its own eviction applied and no
    // other since): the top is gone, and the live tokens up to `through` are the first
    // `held_through` of the stream order.
    std::int64_t evictions_after = -1;
    int held_through = 0;
  };

  static bool worse(const HeapEntry& a, const HeapEntry& b) {
    return ranks_below(a.score, a.original, b.score, b.original);
  }
  static void sift_up(std::vector<HeapEntry>& heap, std::size_t at) {
    const HeapEntry entry = heap[at];
    while (at > 0) {
      const std::size_t parent = (at - 1) / 4;
      if (!worse(entry, heap[parent])) break;
      heap[at] = heap[parent];
      at = parent;
    }
    heap[at] = entry;
  }
  static void sift_down(std::vector<HeapEntry>& heap, std::size_t at) {
    const HeapEntry entry = heap[at];
    for (;;) {
      const std::size_t first_child = 4 * at + 1;
      if (first_child >= heap.size()) break;
      const std::size_t end = std::min(first_child + 4, heap.size());
      std::size_t child = first_child;
      for (std::size_t c = first_child + 1; c < end; ++c)
        child = worse(heap[c], heap[child]) ? c : child;
      if (!worse(heap[child], entry)) break;
      heap[at] = heap[child];
      at = child;
    }
    heap[at] = entry;
  }

  // The single worst candidate under ScoreTrend::never_falls, from the unit's heap: the new
  // candidates (the tokens that left the protected newest) go in, entries of evicted tokens come
  // out, and a top whose score rose since it was pushed is pushed down with its score now, until
  // the top's score is its own: every other entry's score is at least its key, so the top is the
  // worst (the same one the pass finds). Rebuilt from the candidates when it cannot be in step:
  // a new generation (after one decision by the pass), a protected token at the top, a score that
  // fell, too many stale entries.
  // A step that follows the heap's own eviction and no other (the steady state) knows without a
  // read where its new candidates begin and that the top is gone: the first new candidate takes
  // the top's place and sinks from there, and the others climb from the bottom. A decode step's
  // weights have pushed the unit out of the caches since, so every read saved is a miss saved.
  int evict_one_kept(const SlotTable& slots, int unit, const StreamOrderPieces& order, int first,
                     int last, std::span<const float> scores,
                     std::span<const std::int64_t> originals, Decision& decision) {
    if (heaps_.size() < static_cast<std::size_t>(slots.units())) {
      heaps_.resize(static_cast<std::size_t>(slots.units()));
    }
    CandidateHeap& heap = heaps_[static_cast<std::size_t>(unit)];
    std::vector<HeapEntry>& entries = heap.entries;
    const auto original_of = [&](int i) { return originals[static_cast<std::size_t>(order[i])]; };
    const auto entry_of = [&](int i) {
      const std::int32_t slot = order[i];
      const float score = scores[static_cast<std::size_t>(slot)];
      require_number(score, originals[static_cast<std::size_t>(slot)]);
      return HeapEntry{score, slot, originals[static_cast<std::size_t>(slot)]};
    };
    if (heap.generation != slots.generation(unit)) {
      // A new table, a compaction, a truncation: the pass this time, and the heap built at the
      // next decision if the generation holds (a unit compacted often, as under Allocated's
      // pyramid split, does not pay for building it after each compaction).
      heap.generation = slots.generation(unit);
      heap.built = false;
      entries.clear();
      return evict_one(unit, order, first, last, scores, originals, decision);
    }
    // No token older than the oldest candidate is live but the protected oldest.
    const std::int64_t oldest =
        first > 0 ? original_of(first) : std::numeric_limits<std::int64_t>::min();
    const auto candidates = static_cast<std::size_t>(last - first);
    const bool own_step = heap.built && !entries.empty() &&
                          slots.evictions(unit) == heap.evictions_after &&
                          slots.last_evicted(unit) == entries.front().original &&
                          heap.held_through >= first && heap.held_through <= last;
    int from = last;  // the new candidates: [from, last)
    std::int64_t newest = heap.through;
    if (own_step) {
      // The live tokens up to `through` are [0, held_through), none of them protected newest.
      from = heap.held_through;
      if (from < last) newest = original_of(last - 1);
    } else {
      newest = original_of(last - 1);
      while (from > first && original_of(from - 1) > heap.through) --from;
    }
    bool rebuild = !heap.built || heap.through > newest || entries.size() > 2 * candidates + 64;
    HeapEntry read_live{0.0f, -1, 0};  // an entry just read from the stream order: live
    if (!rebuild) {
      if (own_step) {  // the top went: the first new one in its place
        if (from < last) {
          read_live = entry_of(from++);
          entries.front() = read_live;
        } else {
          entries.front() = entries.back();
          entries.pop_back();
        }
        if (!entries.empty()) sift_down(entries, 0);
      }
      for (int i = from; i < last; ++i) {
        entries.push_back(entry_of(i));
        sift_up(entries, entries.size() - 1);
      }
    }
    heap.through = newest;
    for (;;) {
      if (rebuild || entries.empty()) {
        entries.clear();
        for (int i = first; i < last; ++i) entries.push_back(entry_of(i));
        // Heapify: sift down every node with a child, the last one first.
        for (std::size_t at = (entries.size() + 2) / 4; at-- > 0;) sift_down(entries, at);
        heap.built = true;
        rebuild = false;
      }
      HeapEntry& top = entries.front();
      // Evicted since? Not asked of the entry just read from the order (a miss saved).
      const bool read_now = top.slot == read_live.slot && top.original == read_live.original;
      if (!read_now && (!slots.is_live(unit, top.slot) ||
                        originals[static_cast<std::size_t>(top.slot)] != top.original)) {
        top = entries.back();
        entries.pop_back();
        if (!entries.empty()) sift_down(entries, 0);
        continue;
      }
      const float now = scores[static_cast<std::size_t>(top.slot)];
      if (top.original < oldest) {  // a protected token: a sink was evicted by someone else
        rebuild = true;
      } else if (now == top.score) {
        decision.evict(unit, top.slot);
        heap.evictions_after = slots.evictions(unit) + 1;
        heap.held_through = last - 1;  // the live tokens up to `through` once this one goes
        return 1;
      } else if (now > top.score) {  // rose since: re-ranked by its score now
        top.score = now;
        sift_down(entries, 0);
      } else {
        require_number(now, top.original);
        rebuild = true;  // fell: the caller's trend was wrong; still the right answer
      }
    }
  }

  ScoreTrend trend_;
  std::vector<CandidateHeap> heaps_;
  std::vector<std::int32_t> worst_;
};

}  // namespace kvevict
