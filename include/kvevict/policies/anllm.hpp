// AnLLM: anchor-based LLM inference (Pang et al., ACL 2024; pangjh3/AnLLM).
//
// Score: none; a token is an anchor or not, by id (flags_for marks slot_flag::anchor). Keep rule
// (§3.3, Algorithm 1, REDUCTION: keep c if index(c) >= last anchor index or c is an anchor): after
// a forward whose input held at least one anchor, keep every anchor-flagged slot plus the slots
// after the newest anchor; everything else goes, the BOS token and the tails kept from earlier
// chunks included. A forward without an anchor only appends, so the cache grows with the number of
// sentences. Trigger: anchor (Sequence fires it after such a forward). Granularity: token (the same
// keep-set in every layer and head).
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
// Cap (kvevict's extension, not in the paper): with max_slots > 0, a SlotCap decorator
// (policies/protection.hpp): once a unit holds more than max_slots tokens (after the anchor
// reduction, or after a forward without anchors) the oldest tokens beyond the cap are dropped. The
// oldest anchors summarise the oldest sentences, the least likely to matter to what comes next, and
// dropping from the front keeps the current sentence whole. Without the cap the cache is unbounded
// on an endless stream.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/policies/protection.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

struct AnLlmConfig {
  std::vector<std::int32_t> anchor_ids;  ///< token ids that are anchors; at least one
  int max_slots = 0;                     ///< cap per unit (a SlotCap); 0 = no cap (the paper)
};

/// AnLLM's keep rule without the cap.
class AnLlmPolicy final : public Policy {
 public:
  explicit AnLlmPolicy(std::vector<std::int32_t> anchor_ids) : anchor_ids_(std::move(anchor_ids)) {
    KVEVICT_REQUIRE(!anchor_ids_.empty(), "anllm: anchor_ids must name at least one token id");
    for (std::int32_t id : anchor_ids_) {
      KVEVICT_REQUIRE(id >= 0, "anllm: anchor ids must be >= 0, got " + std::to_string(id));
    }
    std::sort(anchor_ids_.begin(), anchor_ids_.end());
    anchor_ids_.erase(std::unique(anchor_ids_.begin(), anchor_ids_.end()), anchor_ids_.end());
  }

  [[nodiscard]] std::string_view name() const override { return "anllm"; }
  [[nodiscard]] SignalSet signals() const override { return {Signal::token_ids}; }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::anchor}; }
  [[nodiscard]] Granularity default_granularity() const override { return Granularity::token; }
  [[nodiscard]] std::uint8_t flags_for(std::int32_t token_id) const override {
    return std::binary_search(anchor_ids_.begin(), anchor_ids_.end(), token_id) ? slot_flag::anchor
                                                                                : 0;
  }
  /// The anchor ids, sorted and without duplicates.
  [[nodiscard]] std::span<const std::int32_t> anchor_ids() const { return anchor_ids_; }

  void select(const EvictionContext& context, Decision& decision) override {
    if (context.trigger != Trigger::anchor) return;
    const SlotTable& slots = context.slots;
    for (int unit = 0; unit < slots.units(); ++unit) {
      // REDUCTION: every anchor, plus the tokens after the newest one.
      const std::span<const std::uint8_t> flags = slots.flags(unit);
      const std::span<const std::int32_t> order = slots.stream_order(unit);
      const auto newest_anchor = std::find_if(order.rbegin(), order.rend(), [&](std::int32_t slot) {
        return (flags[static_cast<std::size_t>(slot)] & slot_flag::anchor) != 0;
      });
      if (newest_anchor == order.rend()) continue;  // no anchor cached: keep all
      keep_.begin(slots, unit, context.protection);
      keep_.keep_flagged(slot_flag::anchor);
      keep_.keep_newer_than(
          slots.original_positions(unit)[static_cast<std::size_t>(*newest_anchor)]);
      keep_.evict_rest(decision);
    }
  }

 private:
  std::vector<std::int32_t> anchor_ids_;
  KeepSet keep_;
};

/// AnLlmPolicy, capped by a SlotCap when max_slots > 0, named "anllm".
[[nodiscard]] inline std::unique_ptr<Policy> make_anllm(const AnLlmConfig& config) {
  KVEVICT_REQUIRE(config.max_slots >= 0, "anllm: max_slots must be >= 0 (0 = no cap), got " +
                                             std::to_string(config.max_slots));
  auto anllm = std::make_unique<AnLlmPolicy>(config.anchor_ids);
  if (config.max_slots == 0) return anllm;
  return std::make_unique<SlotCap>(std::move(anllm), config.max_slots, "anllm");
}

inline constexpr ParamSpec kAnLlmParams[] = {
    {"anchor_ids", ParamType::integer_list,
     "token ids of the anchors (the sentence end for AnLLM-EP, <AC> for AnLLM-AC)", std::nullopt, 0,
     std::numeric_limits<std::int32_t>::max()},
    {"max_slots", ParamType::integer, "cap per unit, oldest dropped first (0 = no cap)", 0, 0,
     kMaxSlotsParam},
};

inline constexpr PolicySpec kAnLlmSpec{
    "anllm",
    "AnLLM (Pang et al. 2024): every anchor + the tokens after the newest, after anchor forwards",
    kAnLlmParams,
    [](int budget, int /*sinks*/) { return PolicyParams().set("max_slots", budget); },
    [](const PolicyParams& params) {
      const std::vector<std::int64_t>& ids = params.get_list("anchor_ids");
      return make_anllm(
          {std::vector<std::int32_t>(ids.begin(), ids.end()), params.get_int("max_slots")});
    },
};

}  // namespace kvevict
