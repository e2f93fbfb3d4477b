// Shared selection core: keep-set construction with composable protection and a defined top-k.
//
// Every policy's keep rule is a short sequence of steps over one head's slots, each adding slots to
// the keep set: protect a range (sinks, recent window), protect flagged slots (anchors), take the
// top-k of a score among the slots not kept yet, fill with the most recent. Protection therefore
// composes with any scorer: StreamingLLM is keep_range(0, S) + keep_range(L - R, L); H2O is
// keep_range(L - R, L) + keep_top_k(acc, heavy); InfiniPot is keep_top_k(nuc, T) +
// keep_top_k(cap, C - T).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvevict/error.hpp>
#include <span>
#include <string>
#include <vector>

#include "eager/compaction_plan.hpp"
#include "eager/slot_table.hpp"

namespace kvevict::eager {

/// Builds the keep set of one head. Reusable: begin() resets it without allocating once the
/// buffers have grown to the largest head seen.
class KeepSetBuilder {
 public:
  /// Starts a keep set over slots [0, slots), none kept.
  void begin(int slots) {
    slots_ = slots;
    kept_count_ = 0;
    kept_.assign(static_cast<std::size_t>(slots), 0);
  }

  [[nodiscard]] int slots() const { return slots_; }
  [[nodiscard]] int kept() const { return kept_count_; }
  [[nodiscard]] bool is_kept(int slot) const { return kept_[static_cast<std::size_t>(slot)] != 0; }

  /// Keeps slots [begin, end), clipped to [0, slots).
  void keep_range(int begin, int end) {
    for (int s = std::max(begin, 0); s < std::min(end, slots_); ++s) mark(s);
  }

  /// Keeps every slot whose flags share a bit with `mask`.
  void keep_flagged(std::span<const std::uint8_t> flags, std::uint8_t mask) {
    for (int s = 0; s < slots_; ++s) {
      if ((flags[static_cast<std::size_t>(s)] & mask) != 0) mark(s);
    }
  }

  /// Keeps the `k` highest-scoring slots among those not kept yet (all of them if fewer). Ties go
  /// to the lower slot, i.e. the lower original position. A NaN score is an error, never a silent
  /// choice: it would make the order undefined.
  void keep_top_k(std::span<const float> scores, int k) {
    KVEVICT_REQUIRE(static_cast<int>(scores.size()) >= slots_,
                    "keep_top_k: fewer scores than slots");
    candidates_.clear();
    for (int s = 0; s < slots_; ++s) {
      if (is_kept(s)) continue;
      if (std::isnan(scores[static_cast<std::size_t>(s)])) {
        throw Error("eviction score is NaN at slot " + std::to_string(s) +
                    ": the policy's signals (attention rows or surprisal) contain NaN");
      }
      candidates_.push_back(s);
    }
    if (k <= 0) return;
    if (k < static_cast<int>(candidates_.size())) {
      const auto better = [&scores](int a, int b) {
        const float sa = scores[static_cast<std::size_t>(a)];
        const float sb = scores[static_cast<std::size_t>(b)];
        return sa > sb || (sa == sb && a < b);
      };
      std::nth_element(candidates_.begin(), candidates_.begin() + k, candidates_.end(), better);
      candidates_.resize(static_cast<std::size_t>(k));
    }
    for (int s : candidates_) mark(s);
  }

  /// Keeps the newest slots not kept yet until `total` slots are kept (or none are left).
  void keep_most_recent(int total) {
    for (int s = slots_ - 1; s >= 0 && kept_count_ < total; --s) mark(s);
  }

  /// Writes the kept slots, ascending, to `out`; returns how many.
  int write(std::span<std::int32_t> out) const {
    KVEVICT_REQUIRE(static_cast<int>(out.size()) >= kept_count_,
                    "KeepSetBuilder: output too small");
    int n = 0;
    for (int s = 0; s < slots_; ++s) {
      if (is_kept(s)) out[static_cast<std::size_t>(n++)] = s;
    }
    return n;
  }

  /// Writes the keep set into head (layer, kv_head) of `plan`. Returns false, and leaves the head
  /// unchanged, when every slot is kept.
  bool write(CompactionPlan& plan, int layer, int kv_head) const {
    if (kept_count_ == slots_) return false;
    plan.set_keep_count(layer, kv_head, write(plan.keep_buffer(layer, kv_head)));
    return true;
  }

 private:
  void mark(int slot) {
    std::uint8_t& flag = kept_[static_cast<std::size_t>(slot)];
    kept_count_ += flag == 0 ? 1 : 0;
    flag = 1;
  }

  int slots_ = 0;
  int kept_count_ = 0;
  std::vector<std::uint8_t> kept_;
  std::vector<int> candidates_;
};

/// The per-head keep rule of most policies: for every (layer, KV head), begins `builder` over the
/// head's live slots, lets `rule(builder, layer, kv_head)` add the slots to keep, and writes the
/// result into `plan`. Returns true if any head changes.
template <class Rule>
bool select_each_head(const SlotTable& slots, KeepSetBuilder& builder, CompactionPlan& plan,
                      Rule&& rule) {
  bool changed = false;
  for (int l = 0; l < slots.layers(); ++l) {
    for (int g = 0; g < slots.kv_heads(); ++g) {
      builder.begin(slots.live(l, g));
      rule(builder, l, g);
      changed = builder.write(plan, l, g) || changed;
    }
  }
  return changed;
}

/// Copies the keep-list of head (layer, from_kv_head) to every other KV head of `layer`, for
/// policies whose decision is per layer (TOVA) or per sequence (StreamingLLM, SirLLM, AnLLM).
inline void copy_keep_to_layer(CompactionPlan& plan, int layer, int from_kv_head) {
  if (!plan.changes(layer, from_kv_head)) return;
  const std::span<const std::int32_t> keep = plan.keep(layer, from_kv_head);
  for (int g = 0; g < plan.kv_heads(); ++g) {
    if (g == from_kv_head) continue;
    std::copy(keep.begin(), keep.end(), plan.keep_buffer(layer, g).begin());
    plan.set_keep_count(layer, g, static_cast<int>(keep.size()));
  }
}

}  // namespace kvevict::eager
