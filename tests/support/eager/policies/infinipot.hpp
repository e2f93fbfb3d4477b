// InfiniPot: continual context distillation in a fixed memory pot (Kim et al., EMNLP 2024,
// "InfiniPot: Infinite Context Processing on Memory-Constrained LLMs"). No public code exists; the
// reference is the paper (shared/papers/infinipot-kim2024.txt): Sec. 3.2 (CCD), 3.3.1 (CaP, Eq. 2),
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
// head ranks its own pot). Positions: reset_on_compact (CR-RoPE, Sec. 3.5: keys stored pre-RoPE,
// survivors get 0..C-1 after each distillation, new tokens continue from C), so no position
// exceeds M plus the catalyst length. Paper setting: T = C / 2 worked best (Table 3).
//
// Where kvevict fixes what the paper leaves open:
// - NuC candidates are all pot tokens, as Sec. 3.3.3 says ("among current tokens in the pot").
//   Appendix B computes token_loss from outputs.logits, which read literally covers only the last
//   forward's tokens; that reading would never re-select an old token by novelty.
// - Appendix B forces NuC picks by raising their CaP to the maximum (the text: one unit above it);
//   two keep_top_k steps give the same set without depending on topk's tie order.
// - Chunks must not cross a pot boundary: engines feed at most pot_room() tokens per forward. A
//   chunk that overshoots anyway is tolerated: the whole (overfull) pot is distilled to C.
// - A pot distilled without catalyst attention for a layer (no observe_catalyst between two
//   distillations, e.g. an empty catalyst: the "w/o CaP" ablation of Table 3) would otherwise be
//   filled by lowest position, because every CaP score is 0. kvevict fills it with the most recent
//   slots instead: the paper reports that CCD without CaP behaves like a sliding window (Sec. 3.4,
//   Fig. 2), and keeping the oldest tokens of a stream is the worse default. NuC picks still come
//   first.
// - Surprisal is required for every token when novel > 0 (a missing value is an error at
//   distillation, not a silent 0); with novel = 0 it is not requested. NaN surprisal is an error.
// - novel must stay below keep (replay-format.md), so the NuC-only ablation (T = C) is not offered.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvevict/error.hpp>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "eager/attention_scores.hpp"
#include "eager/policy.hpp"
#include "eager/selection.hpp"

namespace kvevict::eager {

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

  [[nodiscard]] bool pot_full(const SlotTable& slots) const override {
    return slots.max_live() >= config_.pot;
  }
  [[nodiscard]] std::optional<int> pot_room(const SlotTable& slots) const override {
    return std::max(config_.pot - slots.max_live(), 0);
  }

  void on_append(SlotTable& slots, const ChunkInfo& chunk) override {
    // Mark the new slots "no surprisal yet" so that a forgotten observe_surprisal is caught.
    for (int l = 0; l < slots.layers(); ++l) {
      for (int g = 0; g < slots.kv_heads(); ++g) {
        const auto n = static_cast<std::size_t>(chunk_slots(slots, l, g, chunk));
        std::ranges::fill(slots.scores(l, g, kNucColumn).last(n),
                          std::numeric_limits<float>::quiet_NaN());
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
    for (int l = 0; l < slots.layers(); ++l) {
      for (int g = 0; g < slots.kv_heads(); ++g) {
        const auto n = static_cast<std::size_t>(chunk_slots(slots, l, g, chunk));
        std::ranges::copy(surprisal.first(n), slots.scores(l, g, kNucColumn).last(n).begin());
      }
    }
  }

  void observe_catalyst(SlotTable& slots, int layer, const AttentionRows& rows) override {
    KVEVICT_REQUIRE(layer >= 0 && layer < slots.layers(),
                    "infinipot: observe_catalyst layer " + std::to_string(layer) + " out of range");
    KVEVICT_REQUIRE(rows.kv_heads() == slots.kv_heads(),
                    "infinipot: catalyst rows have " + std::to_string(rows.kv_heads()) +
                        " KV heads, the cache has " + std::to_string(slots.kv_heads()));
    for (int g = 0; g < slots.kv_heads(); ++g) {
      const int pot_slots = count_pot_slots(slots, layer, g);
      KVEVICT_REQUIRE(rows.keys(g * rows.group_size()) >= pot_slots,
                      "infinipot: catalyst rows of layer " + std::to_string(layer) + ", KV head " +
                          std::to_string(g) + " cover " +
                          std::to_string(rows.keys(g * rows.group_size())) +
                          " slots, the pot holds " + std::to_string(pot_slots));
      // The column spans the catalyst's own slots too; what lands there is rolled back with them
      // before select, so only the pot slots' sums are ever read.
      add_attention_of_group(rows, g, HeadReduction::sum, slots.scores(layer, g, kCapColumn));
    }
    if (catalyst_seen_.size() < static_cast<std::size_t>(slots.layers())) {
      catalyst_seen_.resize(static_cast<std::size_t>(slots.layers()), 0);
    }
    catalyst_seen_[static_cast<std::size_t>(layer)] = 1;
  }

  bool select(const EvictionContext& context, CompactionPlan& plan) override {
    if (context.trigger != Trigger::pot_full) return false;
    SlotTable& slots = context.slots;
    const bool changed =
        select_each_head(slots, builder_, plan, [&](KeepSetBuilder& keep, int l, int g) {
          if (novel() > 0) {
            require_surprisal_observed(slots, l, g);
            keep.keep_top_k(slots.scores(l, g, kNucColumn), novel());
          }
          const bool catalyst_seen = static_cast<std::size_t>(l) < catalyst_seen_.size() &&
                                     catalyst_seen_[static_cast<std::size_t>(l)] != 0;
          if (catalyst_seen) {
            keep.keep_top_k(slots.scores(l, g, kCapColumn), config_.keep - novel());
          } else {
            keep.keep_most_recent(config_.keep);
          }
          // The next pot is scored by its own catalyst run: survivors start from 0 again.
          std::ranges::fill(slots.scores(l, g, kCapColumn), 0.0f);
        });
    std::ranges::fill(catalyst_seen_, 0);
    return changed;
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

  // Slots of the current chunk in head (layer, kv_head): its newest chunk.size() slots, which
  // holds only between the chunk's append and the catalyst (InfiniPot evicts nowhere in between).
  static int chunk_slots(const SlotTable& slots, int layer, int kv_head, const ChunkInfo& chunk) {
    const int live = slots.live(layer, kv_head);
    const int n = chunk.size();
    KVEVICT_REQUIRE(
        n <= live && slots.original_positions(layer, kv_head)[static_cast<std::size_t>(live - n)] ==
                         chunk.first_original_position,
        "infinipot: the chunk's slots are not the newest of head (" + std::to_string(layer) + ", " +
            std::to_string(kv_head) +
            "); observe surprisal right after append_chunk, before any catalyst");
    return n;
  }

  // Slots before the first catalyst slot (the catalyst is appended after the pot).
  static int count_pot_slots(const SlotTable& slots, int layer, int kv_head) {
    const std::span<const std::uint8_t> flags = slots.flags(layer, kv_head);
    const auto first_catalyst =
        std::ranges::find_if(flags, [](std::uint8_t f) { return (f & slot_flag::catalyst) != 0; });
    return static_cast<int>(first_catalyst - flags.begin());
  }

  static void require_surprisal_observed(const SlotTable& slots, int layer, int kv_head) {
    const std::span<const float> nuc = slots.scores(layer, kv_head, kNucColumn);
    for (std::size_t s = 0; s < nuc.size(); ++s) {
      KVEVICT_REQUIRE(
          !std::isnan(nuc[s]),
          "infinipot: no surprisal was observed for original position " +
              std::to_string(slots.original_positions(layer, kv_head)[s]) +
              "; with novel > 0 call observe_surprisal for every chunk (or set novel = 0)");
    }
  }

  InfiniPotConfig config_;
  KeepSetBuilder builder_;
  std::vector<std::uint8_t> catalyst_seen_;  // [layers]: catalyst attention observed for this pot
};

}  // namespace kvevict::eager
