// AnLLM: anchor-based LLM inference (Pang et al., ACL 2024; pangjh3/AnLLM).
//
// Score: none; a token is an anchor or not, by id (flags_for marks slot_flag::anchor). Keep rule
// (§3.3, Algorithm 1, REDUCTION: keep c if index(c) >= last anchor index or c is an anchor): after
// a forward whose input held at least one anchor, keep every anchor-flagged slot plus the slots
// after the newest anchor; everything else goes, the BOS token and the tails kept from earlier
// chunks included. A forward without an anchor only appends, so the cache grows with the number of
// sentences. Trigger: anchor (the pipeline fires it after such a forward), else after_forward (used
// only by the cap). Granularity: the same keep-set in every layer and head.
// The authors' realtime forward (codes/llama_sft_forward_thisversion_new.py,
// llamamodel_forwardforinfer_realtime_asan) keeps [previous anchors, the chunk's anchors, the
// chunk's tokens after its last anchor]: the same set.
//
// AnLLM-EP and AnLLM-AC (§4.1) differ only in anchor_ids: EP uses the sentence end (the endpoint
// "." of the tokenizer, e.g. 29889 for Llama-2), AC a dedicated <AC> token appended after each
// sentence (32001 in the authors' tokenizer). Either set, or their union, is one anchor_ids list.
// Only a model trained with the anchor attention masks of Eq. (4) keeps working after the
// reduction: an ordinary model has never learnt to read a sentence through its anchor alone. The
// masks themselves are the engine's business; kvevict only decides what the cache keeps.
//
// Positions: the public code does not settle them (its forward relies on the installed
// transformers version's handling of positions with a reduced cache). kvevict defaults to original:
// AnLLM is continually pre-trained with ordinary positions 0..n-1 and only the Eq. (4) mask, so in
// training a token sees the earlier anchors at their own text positions; keeping those positions
// at inference reproduces that view exactly. Engines may choose cache_index instead.
//
// Cap (kvevict's extension, not in the paper): with max_slots > 0, once a head holds more than
// max_slots slots (after the anchor reduction, or after a forward without anchors) the oldest
// slots beyond the cap are dropped. The oldest anchors summarise the oldest sentences, the least
// likely to matter to what comes next, and dropping from the front keeps the current sentence
// whole. Without the cap the cache is unbounded on an endless stream.
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvevict/error.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

struct AnLlmConfig {
  std::vector<std::int32_t> anchor_ids;  ///< token ids that are anchors; at least one
  int max_slots = 0;                     ///< hard cap per head; 0 = no cap (the paper)
};

class AnLlmPolicy final : public Policy {
 public:
  explicit AnLlmPolicy(const AnLlmConfig& config)
      : anchor_ids_(config.anchor_ids), max_slots_(config.max_slots) {
    KVEVICT_REQUIRE(!anchor_ids_.empty(), "anllm: anchor_ids must name at least one token id");
    for (std::int32_t id : anchor_ids_) {
      KVEVICT_REQUIRE(id >= 0, "anllm: anchor ids must be >= 0, got " + std::to_string(id));
    }
    KVEVICT_REQUIRE(config.max_slots >= 0, "anllm: max_slots must be >= 0 (0 = no cap), got " +
                                               std::to_string(config.max_slots));
    std::sort(anchor_ids_.begin(), anchor_ids_.end());
    anchor_ids_.erase(std::unique(anchor_ids_.begin(), anchor_ids_.end()), anchor_ids_.end());
  }

  [[nodiscard]] std::string_view name() const override { return "anllm"; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::token_ids}; }
  [[nodiscard]] TriggerSet triggers() const override {
    return {Trigger::anchor, Trigger::after_forward};
  }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::original;
  }
  [[nodiscard]] std::optional<int> retained_limit() const override {
    if (max_slots_ > 0) return max_slots_;
    return std::nullopt;
  }
  [[nodiscard]] std::uint8_t flags_for(std::int32_t token_id) const override {
    return std::binary_search(anchor_ids_.begin(), anchor_ids_.end(), token_id) ? slot_flag::anchor
                                                                                : 0;
  }
  /// The anchor ids, sorted and without duplicates.
  [[nodiscard]] std::span<const std::int32_t> anchor_ids() const { return anchor_ids_; }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    if (context.trigger != Trigger::anchor && max_slots_ == 0) return false;
    bool changed = false;
    for (int l = 0; l < context.slots.layers(); ++l) {
      for (int g = 0; g < context.slots.kv_heads(); ++g) {
        const int live = context.slots.live(l, g);
        builder_.begin(live);
        if (context.trigger == Trigger::anchor) {
          keep_anchors_and_tail(context.slots.flags(l, g));
        } else {
          builder_.keep_range(0, live);
        }
        changed = write_capped(plan, l, g) || changed;
      }
    }
    return changed;
  }

 private:
  // Every anchor, plus the slots after the newest one (REDUCTION).
  void keep_anchors_and_tail(std::span<const std::uint8_t> flags) {
    int newest_anchor = -1;
    for (int s = builder_.slots() - 1; s >= 0; --s) {
      if ((flags[static_cast<std::size_t>(s)] & slot_flag::anchor) != 0) {
        newest_anchor = s;
        break;
      }
    }
    if (newest_anchor < 0) {  // no anchor cached (cannot follow an anchor forward): keep all
      builder_.keep_range(0, builder_.slots());
      return;
    }
    builder_.keep_flagged(flags, slot_flag::anchor);
    builder_.keep_range(newest_anchor + 1, builder_.slots());
  }

  // Writes the builder's keep set, minus its oldest entries beyond max_slots, into head (l, g).
  bool write_capped(CompactionPlan& plan, int layer, int kv_head) const {
    const std::span<std::int32_t> keep = plan.keep_buffer(layer, kv_head);
    int count = builder_.write(keep);
    if (max_slots_ > 0 && count > max_slots_) {
      std::copy(keep.begin() + (count - max_slots_), keep.begin() + count, keep.begin());
      count = max_slots_;
    }
    if (count == builder_.slots()) return false;
    plan.set_keep_count(layer, kv_head, count);
    return true;
  }

  std::vector<std::int32_t> anchor_ids_;
  int max_slots_;
  KeepSetBuilder builder_;
};

}  // namespace kvevict::eager
