// InfiniPot: continual context distillation in a fixed memory pot (Kim et al., EMNLP 2024,
// "InfiniPot: Infinite Context Processing on Memory-Constrained LLMs"). No public code exists; the
// reference is the paper: Sec. 3.2 (CCD), 3.3.1 (CaP, Eq. 2),
// 3.3.2 (NuC, Eq. 3-4), 3.3.3 (combining both), 3.5 (CR-RoPE) and the Appendix B pseudo-code.
//
// Scores, per slot: NuC = -log p(x_t | retained context), the surprisal the engine measured when
// the token was fed (Eq. 4: the model saw only the compressed pot, so that is what the engine
// computes); one fixed value per token, never decayed or recomputed. CaP = attention a catalyst
// prompt, run after the pot's contents and then rolled back, pays to each pot slot, summed over the
// catalyst's queries (Eq. 2) and, with GQA, over the query heads that read the KV head (the paper's
// models are GQA but it does not state the reduction; sum matches replay-format.md). Keep rule, per
// (layer, KV head), among ALL slots of that head's pot (tokens kept by earlier distillations and
// tokens added since): the top `novel` (T) by NuC are forced in, then the top `keep - novel` by CaP
// among the rest fill the head to `keep` (C); ties go to the lower position. Trigger: pot_full,
// once a head holds `pot` (M) slots; the engine then runs the catalyst
// (EvictionPipeline::begin_catalyst / observe_catalyst / end_catalyst) and the pot is distilled.
// Granularity: per KV head (CaP differs per head, so keep-sets differ; NuC is per token but each
// head ranks its own pot). Coarser units sum CaP over every query head that reads the unit
// (kvevict's extension; the paper distils per head). Positions: reset_on_compact (CR-RoPE,
// Sec. 3.5: keys stored pre-RoPE, survivors get 0..C-1 after each distillation, new tokens continue
// from C), so no position exceeds M plus the catalyst length. Paper setting: T = C / 2 worked best
// (Table 3).
//
// Where kvevict fixes what the paper leaves open:
// - NuC candidates are all pot tokens, as Sec. 3.3.3 says ("among current tokens in the pot").
//   Appendix B computes token_loss from outputs.logits, which read literally covers only the last
//   forward's tokens; that reading would never re-select an old token by novelty.
// - Appendix B forces NuC picks by raising their CaP to the maximum (the text: one unit above it);
//   two keep_top_k steps give the same set without depending on topk's tie order.
// - Chunks must not cross a pot boundary: engines feed at most pot_room() tokens per forward. A
//   chunk that overshoots anyway is tolerated: the whole (overfull) pot is distilled to C.
// - A pot distilled without catalyst attention (an empty catalyst: the "w/o CaP" ablation of
//   Table 3) would otherwise be filled by lowest position, because every CaP score is 0. kvevict
//   fills it with the most recent slots instead: the paper reports that CCD without CaP behaves
//   like a sliding window (Sec. 3.4, Fig. 2), and keeping the oldest tokens of a stream is the
//   worse default. NuC picks still come first. A non-empty catalyst whose attention misses a layer
//   is an error (Sequence checks every layer was observed).
// - Surprisal is required for every token when novel > 0 (a forward without it is an error, not a
//   silent 0); with novel = 0 it is not requested. NaN surprisal is an error.
// - novel must stay below keep (docs/replay-format.md), so the NuC-only ablation (T = C) is not
//   offered.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/attention_scores.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policy.hpp"
#include "kvevict/policy_params.hpp"
#include "kvevict/selection.hpp"

namespace kvevict {

/// The paper's general catalyst prompt (CaP-G, Table 2), for engines to tokenize and feed with
/// begin_catalyst when no question is known. With a known question the paper appends it (CaP-Q).
inline constexpr std::string_view kInfiniPotGeneralCatalystPrompt =
    "Summarize the critical points highlighted in this section.";

struct InfiniPotConfig {
  int pot = 0;   ///< M > 0: slots per head at which the pot is distilled
  int keep = 0;  ///< C, 0 < C < M: slots per head after a distillation
  /// T, 0 <= T < C: slots forced by NuC surprisal; nullopt = C / 2 (the paper's setting).
  std::optional<int> novel = std::nullopt;
};

class InfiniPotPolicy final : public Policy {
 public:
  static constexpr int kNucColumn = 0;  ///< surprisal of each slot; NaN = not observed yet
  static constexpr int kCapColumn = 1;  ///< catalyst attention accumulated for the current pot

  explicit InfiniPotPolicy(const InfiniPotConfig& config) : config_(resolved(config)) {}

  /// The configuration with `novel` resolved.
  [[nodiscard]] const InfiniPotConfig& config() const { return config_; }
  [[nodiscard]] int novel() const { return *config_.novel; }

  [[nodiscard]] std::string_view name() const override { return "infinipot"; }
  [[nodiscard]] SignalSet signals() const override {
    SignalSet wanted{Signal::catalyst_attention};
    if (novel() > 0) wanted |= SignalSet{Signal::surprisal};
    return wanted;
  }
  [[nodiscard]] TriggerSet triggers() const override { return {Trigger::pot_full}; }
  [[nodiscard]] int score_columns() const override { return 2; }
  [[nodiscard]] PositionMode default_position_mode() const override {
    return PositionMode::reset_on_compact;
  }
  /// The pot size; engines reserve their largest chunk on top, which must cover the catalyst.
  [[nodiscard]] std::optional<int> retained_limit() const override { return config_.pot; }

  [[nodiscard]] std::optional<int> pot_room(const SlotTable& slots) const override {
    return std::max(config_.pot - slots.max_live(), 0);
  }

  void on_append(SlotTable& slots, const ChunkInfo& chunk) override {
    // Mark the new tokens "no surprisal yet" so that a forgotten observe_surprisal is caught.
    for (int unit = 0; unit < slots.units(); ++unit) {
      const std::span<float> nuc = slots.scores(unit, kNucColumn);
      for (const std::int32_t slot : chunk_slots(slots, unit, chunk)) {
        nuc[static_cast<std::size_t>(slot)] = std::numeric_limits<float>::quiet_NaN();
      }
    }
  }

  void observe_surprisal(SlotTable& slots, const ChunkInfo& chunk,
                         std::span<const float> surprisal) override {
    for (std::size_t k = 0; k < surprisal.size(); ++k) {
      KVEVICT_REQUIRE(!std::isnan(surprisal[k]), "infinipot: surprisal of original position " +
                                                     std::to_string(chunk.first_original_position +
                                                                    static_cast<std::int64_t>(k)) +
                                                     " is NaN");
    }
    for (int unit = 0; unit < slots.units(); ++unit) {
      const std::span<float> nuc = slots.scores(unit, kNucColumn);
      const std::span<const std::int32_t> chunk_tokens = chunk_slots(slots, unit, chunk);
      for (std::size_t k = 0; k < chunk_tokens.size(); ++k) {
        nuc[static_cast<std::size_t>(chunk_tokens[k])] = surprisal[k];
      }
    }
  }

  void observe_catalyst(SlotTable& slots, int layer, const AttentionRows& rows) override {
    check_attention_rows(slots, layer, rows, "infinipot");
    const UnitLayout& layout = slots.layout();
    const int group = rows.group_size();
    for (int g = 0; g < layout.kv_heads(); ++g) {
      const int unit = layout.unit_of(layer, g);
      // The column spans the catalyst's own slots too; what lands there is rolled back with them
      // before select, and the slots' scores are reset when they are reused.
      // A NaN lands in the CaP column and is reported when the pot is ranked (keep_top_k).
      (void)add_attention(rows, g * group, (g + 1) * group, 1.0f, slots.scores(unit, kCapColumn));
      if (catalyst_seen_.size() < static_cast<std::size_t>(slots.units())) {
        catalyst_seen_.resize(static_cast<std::size_t>(slots.units()), 0);
      }
      catalyst_seen_[static_cast<std::size_t>(unit)] = 1;
    }
  }

  void select(const EvictionContext& context, Decision& decision) override {
    if (context.trigger != Trigger::pot_full) return;
    SlotTable& slots = context.slots;
    for (int unit = 0; unit < slots.units(); ++unit) {
      if (slots.live(unit) <= config_.keep) continue;
      keep_.begin(slots, unit, context.protection);
      if (novel() > 0) {
        require_surprisal_observed(slots, unit);
        keep_.keep_top_k(slots.scores(unit, kNucColumn), novel());
      }
      const bool catalyst_seen = static_cast<std::size_t>(unit) < catalyst_seen_.size() &&
                                 catalyst_seen_[static_cast<std::size_t>(unit)] != 0;
      if (catalyst_seen) {
        keep_.keep_top_k(slots.scores(unit, kCapColumn), config_.keep - novel());
      } else {
        keep_.fill_newest(config_.keep);
      }
      keep_.evict_rest(decision);
    }
    // The next pot is scored by its own catalyst run: survivors start from 0 again.
    for (int unit = 0; unit < slots.units(); ++unit) {
      const std::span<float> cap = slots.scores(unit, kCapColumn);
      std::fill(cap.begin(), cap.end(), 0.0f);
    }
    std::fill(catalyst_seen_.begin(), catalyst_seen_.end(), 0);
  }

 private:
  static InfiniPotConfig resolved(InfiniPotConfig config) {
    KVEVICT_REQUIRE(config.pot > 0,
                    "infinipot: pot must be positive, got " + std::to_string(config.pot));
    KVEVICT_REQUIRE(config.keep > 0 && config.keep < config.pot,
                    "infinipot: keep must satisfy 0 < keep < pot (" + std::to_string(config.pot) +
                        "), got " + std::to_string(config.keep));
    if (!config.novel) config.novel = config.keep / 2;
    KVEVICT_REQUIRE(*config.novel >= 0 && *config.novel < config.keep,
                    "infinipot: novel must satisfy 0 <= novel < keep (" +
                        std::to_string(config.keep) + "), got " + std::to_string(*config.novel));
    return config;
  }

  // Slots of the current chunk in `unit`: its newest chunk.size() tokens, which holds only between
  // the chunk's append and the catalyst (InfiniPot evicts nowhere in between).
  static std::span<const std::int32_t> chunk_slots(const SlotTable& slots, int unit,
                                                   const ChunkInfo& chunk) {
    const std::span<const std::int32_t> order = slots.stream_order(unit);
    const auto n = static_cast<std::size_t>(chunk.size());
    KVEVICT_REQUIRE(
        n <= order.size() &&
            slots.original_positions(unit)[static_cast<std::size_t>(order[order.size() - n])] ==
                chunk.first_original_position,
        "infinipot: the chunk's tokens are not the newest of unit " + std::to_string(unit) +
            "; observe surprisal right after the chunk is appended, before any "
            "catalyst");
    return order.last(n);
  }

  static void require_surprisal_observed(const SlotTable& slots, int unit) {
    const std::span<const float> nuc = slots.scores(unit, kNucColumn);
    for (const std::int32_t slot : slots.stream_order(unit)) {
      KVEVICT_REQUIRE(
          !std::isnan(nuc[static_cast<std::size_t>(slot)]),
          "infinipot: no surprisal was observed for original position " +
              std::to_string(slots.original_positions(unit)[static_cast<std::size_t>(slot)]) +
              "; with novel > 0 call observe_surprisal for every chunk (or set novel = 0)");
    }
  }

  InfiniPotConfig config_;
  KeepSet keep_;
  std::vector<std::uint8_t> catalyst_seen_;  // [units]: catalyst attention observed for this pot
};

inline constexpr ParamSpec kInfiniPotParams[] = {
    {"pot", ParamType::integer, "M: tokens per unit at which the pot is distilled", std::nullopt, 2,
     kMaxSlotsParam},
    {"keep", ParamType::integer, "C < M: tokens per unit after a distillation", std::nullopt, 1,
     kMaxSlotsParam},
    {"novel", ParamType::integer, "T < C: tokens forced by surprisal (NuC); default C / 2",
     std::nullopt, 0, kMaxSlotsParam, /*optional=*/true},
};

inline constexpr PolicySpec kInfiniPotSpec{
    "infinipot",
    "InfiniPot (Kim et al. 2024): distil a pot of M to C by surprisal + catalyst attention",
    kInfiniPotParams,
    [](int budget, int /*sinks*/) {
      return PolicyParams().set("pot", budget).set("keep", budget / 2).set("novel", budget / 4);
    },
    [](const PolicyParams& params) -> std::unique_ptr<Policy> {
      return std::make_unique<InfiniPotPolicy>(InfiniPotConfig{
          params.get_int("pot"), params.get_int("keep"), params.get_optional_int("novel")});
    },
};

}  // namespace kvevict
