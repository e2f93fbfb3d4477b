// InfiniPot: keep-sets derived by hand from the paper (Sec. 3.3.3 and Appendix B), driven through
// a Sequence with hand-built catalyst attention rows. Every expected set is worked out in
// the comment above it; none is taken from the fixtures or from the code's own output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <kvevict/kvevict.hpp>
#include <kvevict/policies/infinipot.hpp>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "support/policy_harness.hpp"

namespace {

using kvevict::test::observe_catalyst;

using kvevict::InfiniPotConfig;
using kvevict::InfiniPotPolicy;
using kvevict::PolicyParams;
using kvevict::SlotTable;
using Positions = std::vector<std::int64_t>;

// Catalyst attention of (layer, query head, catalyst query, pot slot).
using CatalystAttention = std::function<float(int layer, int q_head, int query, int slot)>;

// One sequence with room for the pot plus a chunk or the catalyst. Rows are built in stream order
// (pot token i, then catalyst token c) and laid out by slot.
class Rig {
 public:
  Rig(int layers, int q_heads, int kv_heads, const InfiniPotConfig& config, int max_chunk)
      : sequence_(sequence_config(layers, q_heads, kv_heads, max_chunk),
                  std::make_unique<InfiniPotPolicy>(config)) {}

  kvevict::Sequence& sequence() { return sequence_; }
  const SlotTable& slots() const { return sequence_.slots(); }
  const kvevict::SequenceStats& stats() const { return sequence_.stats(); }

  // One forward over surprisal.size() tokens; the surprisal is handed in when the policy asks.
  void feed(const std::vector<float>& surprisal) {
    const std::int64_t decisions = stats().decisions;
    sequence_.begin_chunk(std::vector<std::int32_t>(surprisal.size(), 42));
    if (sequence_.wants(kvevict::Signal::surprisal)) sequence_.observe_surprisal(surprisal);
    sequence_.end_forward();
    EXPECT_EQ(stats().decisions, decisions);  // InfiniPot never evicts inside a forward
  }
  // A forward without surprisal (engines that skip the signal).
  void feed_without_surprisal(int n) {
    const std::int64_t decisions = stats().decisions;
    sequence_.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 42));
    sequence_.end_forward();
    EXPECT_EQ(stats().decisions, decisions);
  }

  // Opens a catalyst of `length` tokens, hands every layer its rows (pot tokens from `attention`,
  // then the catalyst's own causal slots at a large 0.9 that must not matter), and closes it.
  // Returns whether the distillation evicted anything.
  bool catalyst(int length, const CatalystAttention& attention) {
    open_catalyst(length);
    for (int l = 0; l < sequence_.config().layers; ++l) observe_layer(l, length, attention);
    return close_catalyst();
  }

  void open_catalyst(int length) {
    EXPECT_TRUE(sequence_.catalyst_pending());
    catalyst_length_ = length;
    sequence_.begin_catalyst(std::vector<std::int32_t>(static_cast<std::size_t>(length), 7));
  }
  bool close_catalyst() {
    const std::int64_t decisions = stats().decisions;
    sequence_.end_catalyst();
    return stats().decisions > decisions;
  }

  void observe_layer(int layer, int length, const CatalystAttention& attention) {
    const kvevict::SequenceConfig& c = sequence_.config();
    const int group = c.q_heads / c.kv_heads;
    kvevict::test::LayerRows rows(static_cast<std::size_t>(c.q_heads));
    for (int h = 0; h < c.q_heads; ++h) {
      const int pot = sequence_.live(layer, h / group) - catalyst_length_;
      for (int p = 0; p < length; ++p) {
        std::vector<float> row(static_cast<std::size_t>(pot + length), 0.0f);
        for (int i = 0; i < pot; ++i) row[static_cast<std::size_t>(i)] = attention(layer, h, p, i);
        for (int k = 0; k <= p; ++k) row[static_cast<std::size_t>(pot + k)] = 0.9f;
        rows[static_cast<std::size_t>(h)].push_back(std::move(row));
      }
    }
    observe_catalyst(sequence_, layer, rows_.make(sequence_, layer, rows, stats().tokens_fed));
  }

  [[nodiscard]] Positions kept(int l = 0, int g = 0) const {
    return kvevict::test::kept_positions(slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] Positions positions(int l = 0, int g = 0) const {
    return kvevict::test::rope_positions(slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] std::vector<float> cap(int l = 0, int g = 0) const {
    return kvevict::test::score_column(slots(), sequence_.unit_of(l, g),
                                       InfiniPotPolicy::kCapColumn);
  }

 private:
  static kvevict::SequenceConfig sequence_config(int layers, int q_heads, int kv_heads,
                                                 int max_chunk) {
    kvevict::SequenceConfig c;
    c.layers = layers;
    c.q_heads = q_heads;
    c.kv_heads = kv_heads;
    c.max_chunk = max_chunk;
    return c;
  }

  kvevict::Sequence sequence_;
  kvevict::test::SlotRows rows_;
  int catalyst_length_ = 0;
};

Positions range(std::int64_t begin, std::int64_t end) {
  Positions out(static_cast<std::size_t>(end - begin));
  std::iota(out.begin(), out.end(), begin);
  return out;
}

// Single-head catalyst attention from a table indexed by pot slot (one catalyst query).
CatalystAttention by_slot(std::vector<float> table) {
  return [table = std::move(table)](int, int, int, int slot) {
    return table[static_cast<std::size_t>(slot)];
  };
}

TEST(InfiniPotPolicy, DeclaresItsSignalsTriggerColumnsAndPositionMode) {
  const InfiniPotPolicy policy(InfiniPotConfig{24, 12, 6});
  EXPECT_EQ(policy.name(), "infinipot");
  EXPECT_TRUE(policy.signals().contains(kvevict::Signal::surprisal));
  EXPECT_TRUE(policy.signals().contains(kvevict::Signal::catalyst_attention));
  EXPECT_FALSE(policy.signals().contains(kvevict::Signal::attention_rows));
  EXPECT_TRUE(policy.triggers().contains(kvevict::Trigger::pot_full));
  EXPECT_FALSE(policy.triggers().contains(kvevict::Trigger::after_forward));
  EXPECT_EQ(policy.score_columns(), 2);
  EXPECT_EQ(policy.default_position_mode(), kvevict::PositionMode::reset_on_compact);
  EXPECT_EQ(policy.retained_limit(), 24);
  // Pure CaP needs no surprisal from the engine.
  EXPECT_FALSE(
      InfiniPotPolicy(InfiniPotConfig{24, 12, 0}).signals().contains(kvevict::Signal::surprisal));
  EXPECT_EQ(kvevict::kInfiniPotGeneralCatalystPrompt,
            "Summarize the critical points highlighted in this section.");
}

// M = 8, C = 4, T = 2, one head, one catalyst query.
//   surprisal  0.1  0.2  5.0  0.3  0.4  4.0  0.5  0.6
//   CaP        .30  .25  0    .05  .12  0    .20  .08
// NuC forces positions 2 (5.0) and 5 (4.0) although the catalyst ignored them; the other C - T = 2
// slots go to the best CaP among the rest: 0 (.30), 1 (.25). Kept {0, 1, 2, 5}.
TEST(InfiniPotPolicy, NucForcedTokensAreKeptEvenWithZeroCatalystAttention) {
  Rig rig(1, 1, 1, InfiniPotConfig{8, 4, 2}, 1);
  EXPECT_EQ(rig.sequence().pot_room(), 8);
  rig.feed({0.1f, 0.2f, 5.0f, 0.3f, 0.4f, 4.0f, 0.5f, 0.6f});
  ASSERT_TRUE(rig.catalyst(1, by_slot({.30f, .25f, 0, .05f, .12f, 0, .20f, .08f})));
  EXPECT_EQ(rig.kept(), (Positions{0, 1, 2, 5}));
}

// Same pot with T = 0: the top C = 4 by CaP alone are 0 (.30), 1 (.25), 6 (.20), 4 (.12); the
// surprisal of position 2 no longer matters and the engine need not supply surprisal at all.
TEST(InfiniPotPolicy, NovelZeroSelectsByCatalystAttentionOnly) {
  Rig rig(1, 1, 1, InfiniPotConfig{8, 4, 0}, 1);
  rig.feed_without_surprisal(8);
  ASSERT_TRUE(rig.catalyst(1, by_slot({.30f, .25f, 0, .05f, .12f, 0, .20f, .08f})));
  EXPECT_EQ(rig.kept(), (Positions{0, 1, 4, 6}));
}

// GQA: 4 query heads over 2 KV heads (group 2), M = 6, C = 3, T = 0, two catalyst queries.
// KV head 0 is read by query heads 0 and 1:
//   q-head 0, query 0: .60  0    0    0    .15  0
//   q-head 0, query 1: 0    0    0    .25  0    0
//   q-head 1, query 0: 0    .35  0    0    0    0
//   q-head 1, query 1: 0    0    .30  .25  .10  0
//   sum (queries, heads): .60 .35 .30 .50 .25 0  -> top 3: 0, 3, 1 -> {0, 1, 3}
// A wrong reduction picks another set: q-head 0 alone {0, 3, 4}, q-head 1 alone {1, 2, 3}, the
// last catalyst query only (.0 .0 .30 .50 .10 .0) {2, 3, 4}, the max over heads {0, 1, 2}.
// KV head 1 (query heads 2 and 3):
//   q-head 2, query 0: 0    0    .40  0    0    .10
//   q-head 2, query 1: .05  0    0    0    .22  0
//   q-head 3, query 0: 0    .10  0    0    .15  0
//   q-head 3, query 1: 0    0    0    .05  0    .25
//   sum: .05 .10 .40 .05 .37 .35 -> top 3: 2, 4, 5 -> {2, 4, 5}
TEST(InfiniPotPolicy, GqaCatalystScoreIsSummedOverTheGroupsQueryHeadsAndQueries) {
  const float table[4][2][6] = {
      {{.60f, 0, 0, 0, .15f, 0}, {0, 0, 0, .25f, 0, 0}},
      {{0, .35f, 0, 0, 0, 0}, {0, 0, .30f, .25f, .10f, 0}},
      {{0, 0, .40f, 0, 0, .10f}, {.05f, 0, 0, 0, .22f, 0}},
      {{0, .10f, 0, 0, .15f, 0}, {0, 0, 0, .05f, 0, .25f}},
  };
  const CatalystAttention attention = [&table](int, int h, int p, int s) { return table[h][p][s]; };
  Rig rig(1, 4, 2, InfiniPotConfig{6, 3, 0}, 2);
  rig.feed_without_surprisal(6);
  rig.open_catalyst(2);
  rig.observe_layer(0, 2, attention);
  // The CaP column holds the group sum (.60 for slot 0, not the mean .30).
  const std::vector<float> cap = rig.cap(0, 0);
  EXPECT_FLOAT_EQ(cap[0], .60f);
  EXPECT_FLOAT_EQ(cap[3], .50f);
  ASSERT_TRUE(rig.close_catalyst());
  EXPECT_EQ(rig.kept(0, 0), (Positions{0, 1, 3}));
  EXPECT_EQ(rig.kept(0, 1), (Positions{2, 4, 5}));
}

// NuC candidates are ALL pot tokens, retained and new; M = 8, C = 4, T = 2, one head.
// Distillation 1, pot = positions 0..7:
//   surprisal  0.1  9.0  0.2  8.0  0.3  0.4  0.5  0.6
//   CaP        .40  0    .02  0    .03  .01  .30  .04
//   NuC forces 1 (9.0) and 3 (8.0); CaP adds 0 (.40) and 6 (.30): kept {0, 1, 3, 6} at positions
//   0..3 (CR-RoPE), i.e. deltas 0, 0, -1, -3.
// Then positions 8..11 arrive (surprisal 1.0 2.0 0.5 1.5) at positions 4..7 (continuing from C).
// Distillation 2, pot slots = positions 0 1 3 6 8 9 10 11:
//   surprisal  0.1  9.0  8.0  0.5  1.0  2.0  0.5  1.5
//   CaP        .05  0    0    .04  .30  0    .25  0
//   Right: NuC over the whole pot forces 1 (9.0) and 3 (8.0); CaP adds 8 (.30) and 10 (.25):
//   {1, 3, 8, 10}.
//   Wrong, NuC over the new tokens only: forces 9 (2.0) and 11 (1.5), CaP adds 8, 10:
//   {8, 9, 10, 11}.
//   Wrong, CaP not reset after distillation 1: 0 has .40 + .05 = .45 and 6 has .30 + .04 = .34,
//   both above 8 (.30): {0, 1, 3, 6}.
TEST(InfiniPotPolicy, NucCandidatesIncludeRetainedTokensAcrossTwoDistillations) {
  Rig rig(1, 1, 1, InfiniPotConfig{8, 4, 2}, 2);
  rig.feed({0.1f, 9.0f, 0.2f, 8.0f, 0.3f, 0.4f, 0.5f, 0.6f});
  EXPECT_EQ(rig.positions(), range(0, 8));
  ASSERT_TRUE(rig.catalyst(2, by_slot({.40f, 0, .02f, 0, .03f, .01f, .30f, .04f})));
  EXPECT_EQ(rig.kept(), (Positions{0, 1, 3, 6}));
  EXPECT_EQ(rig.positions(), range(0, 4));  // moved by 0, 0, -1, -3

  EXPECT_EQ(rig.sequence().pot_room(), 4);
  rig.feed({1.0f, 2.0f, 0.5f, 1.5f});
  EXPECT_EQ(rig.positions(), range(0, 8));  // the new tokens continue from C = 4
  rig.open_catalyst(2);
  // The catalyst sits after the pot, at positions M = 8 and 9: no position ever exceeds M + P - 1.
  EXPECT_EQ(rig.positions(), range(0, 10));
  rig.observe_layer(0, 2, by_slot({.05f, 0, 0, .04f, .30f, 0, .25f, 0}));
  ASSERT_TRUE(rig.close_catalyst());
  EXPECT_EQ(rig.kept(), (Positions{1, 3, 8, 10}));
  EXPECT_EQ(rig.positions(), range(0, 4));
  rig.feed({0.7f});
  EXPECT_EQ(rig.positions(), range(0, 5));
  EXPECT_EQ(rig.stats().decisions, 2);
}

// 2 layers x 2 KV heads (MHA), M = 4, C = 2, T = 1. Surprisal 0.1 0.2 3.0 0.3 forces position 2
// in every head; the remaining slot is each head's catalyst favourite (.5, every other slot
// .01 * (slot + 1)): (0, 0) -> 0, (0, 1) -> 1, (1, 0) -> 3, (1, 1) -> 0.
TEST(InfiniPotPolicy, KeepSetsDifferPerLayerAndHead) {
  const int favourite[2][2] = {{0, 1}, {3, 0}};
  const CatalystAttention attention = [&favourite](int l, int h, int, int s) {
    return s == favourite[l][h] ? .5f : .01f * static_cast<float>(s + 1);
  };
  Rig rig(2, 2, 2, InfiniPotConfig{4, 2, 1}, 1);
  rig.feed({0.1f, 0.2f, 3.0f, 0.3f});
  ASSERT_TRUE(rig.catalyst(1, attention));
  EXPECT_EQ(rig.kept(0, 0), (Positions{0, 2}));
  EXPECT_EQ(rig.kept(0, 1), (Positions{1, 2}));
  EXPECT_EQ(rig.kept(1, 0), (Positions{2, 3}));
  EXPECT_EQ(rig.kept(1, 1), (Positions{0, 2}));
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g) EXPECT_EQ(rig.positions(l, g), range(0, 2));
  }
}

// An engine feeding a 21-token stream in chunks of at most 5, split at pot_room(), M = 8, C = 4:
//   room 8 -> 5 (live 5); room 3 -> 3 (live 8, distill to 4); room 4 -> 4 (distill);
//   room 4 -> 4 (distill); room 4 -> 4 (distill); 1 token left -> live 5.
// Chunks 5 3 4 4 4 1, four distillations, and no head ever holds more than M before the catalyst.
TEST(InfiniPotPolicy, EnginesSplitChunksAtPotRoom) {
  const int pot = 8, max_chunk = 5, catalyst_length = 3;
  Rig rig(1, 1, 1, InfiniPotConfig{pot, 4, 2}, max_chunk);
  std::vector<int> chunks;
  int remaining = 21, next = 0;
  while (remaining > 0) {
    const int room = *rig.sequence().pot_room();
    ASSERT_GT(room, 0);
    const int n = std::min({remaining, room, max_chunk});
    std::vector<float> surprisal(static_cast<std::size_t>(n));
    for (float& s : surprisal) s = 0.01f * static_cast<float>(next++);  // distinct values
    rig.feed(surprisal);
    chunks.push_back(n);
    remaining -= n;
    EXPECT_LE(rig.slots().max_live(), pot);
    EXPECT_EQ(rig.sequence().catalyst_pending(), rig.slots().max_live() == pot);
    if (rig.sequence().catalyst_pending()) {
      rig.catalyst(catalyst_length, [](int, int, int p, int s) {
        return 0.001f * static_cast<float>((s * 7 + p) % 11 + s);  // distinct per slot
      });
      EXPECT_EQ(rig.slots().max_live(), 4);
    }
  }
  EXPECT_EQ(chunks, (std::vector<int>{5, 3, 4, 4, 4, 1}));
  EXPECT_EQ(rig.stats().decisions, 4);
  EXPECT_EQ(rig.slots().max_live(), 5);
}

// A chunk that overshoots the pot (6 then 5 tokens into M = 8) is tolerated: the 11-slot pot is
// distilled to C = 4. T = 0, CaP .5 on positions 0, 2, 9, 10 and .01 elsewhere: {0, 2, 9, 10}.
TEST(InfiniPotPolicy, AnOverfullPotIsStillDistilledToKeep) {
  Rig rig(1, 1, 1, InfiniPotConfig{8, 4, 0}, 8);
  rig.feed_without_surprisal(6);
  EXPECT_FALSE(rig.sequence().catalyst_pending());
  rig.feed_without_surprisal(5);
  EXPECT_EQ(rig.sequence().pot_room(), 0);
  ASSERT_TRUE(rig.catalyst(1, [](int, int, int, int s) {
    return (s == 0 || s == 2 || s == 9 || s == 10) ? .5f : .01f;
  }));
  EXPECT_EQ(rig.kept(), (Positions{0, 2, 9, 10}));
}

// Without catalyst attention (an empty catalyst, the "w/o CaP" ablation) the C - T slots left
// after NuC go to the most recent pot slots. M = 8, C = 4, T = 2, 2 layers; surprisal is high at 1
// (9.0) and 3 (8.0): NuC {1, 3} + most recent {6, 7} -> {1, 3, 6, 7} in both layers.
TEST(InfiniPotPolicy, WithoutCatalystAttentionTheFillIsTheMostRecentSlots) {
  Rig rig(2, 1, 1, InfiniPotConfig{8, 4, 2}, 1);
  rig.feed({0.1f, 9.0f, 0.2f, 8.0f, 0.3f, 0.4f, 0.5f, 0.6f});
  rig.open_catalyst(0);
  ASSERT_TRUE(rig.close_catalyst());
  EXPECT_EQ(rig.kept(0), (Positions{1, 3, 6, 7}));
  EXPECT_EQ(rig.kept(1), (Positions{1, 3, 6, 7}));
}

// A catalyst was run but a layer's attention never reached the policy: that is a misuse, not the
// ablation, and the distillation refuses to guess.
TEST(InfiniPotPolicy, CatalystAttentionMissingForALayerIsAnError) {
  Rig rig(2, 1, 1, InfiniPotConfig{8, 4, 2}, 1);
  rig.feed({0.1f, 9.0f, 0.2f, 8.0f, 0.3f, 0.4f, 0.5f, 0.6f});
  rig.open_catalyst(1);
  rig.observe_layer(0, 1, by_slot({.5f, .01f, .01f, .01f, .4f, .01f, .01f, .01f}));
  try {
    rig.close_catalyst();
    FAIL() << "a pot was distilled without layer 1's catalyst attention";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("layer 1 was not observed"), std::string::npos)
        << error.what();
  }
}

TEST(InfiniPotPolicy, NanSurprisalIsAnError) {
  Rig rig(1, 1, 1, InfiniPotConfig{8, 4, 2}, 1);
  rig.sequence().begin_chunk(std::vector<std::int32_t>{1, 2, 3});
  const std::vector<float> surprisal{0.5f, std::numeric_limits<float>::quiet_NaN(), 0.5f};
  try {
    rig.sequence().observe_surprisal(surprisal);
    FAIL() << "NaN surprisal was accepted";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("(original position 1) is NaN"), std::string::npos)
        << error.what();
  }
}

TEST(InfiniPotPolicy, MissingSurprisalIsAnErrorWhenNovelIsPositive) {
  Rig rig(1, 1, 1, InfiniPotConfig{4, 2, 1}, 1);
  try {
    rig.feed_without_surprisal(4);
    FAIL() << "a forward ended without the surprisal the policy needs";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("needs the surprisal"), std::string::npos)
        << error.what();
  }
}

// Refused when observed (Sequence checks the rows before the policy adds them), not at the
// distillation, which would come after the catalyst was rolled back.
TEST(InfiniPotPolicy, NanCatalystAttentionIsAnError) {
  Rig rig(1, 1, 1, InfiniPotConfig{4, 2, 0}, 1);
  rig.feed_without_surprisal(4);
  rig.open_catalyst(1);
  EXPECT_THROW(rig.observe_layer(0, 1,
                                 [](int, int, int, int s) {
                                   return s == 2 ? std::numeric_limits<float>::quiet_NaN() : .1f;
                                 }),
               kvevict::Error);
}

TEST(InfiniPotPolicy, InvalidConfigurationsAreErrors) {
  const auto rejects = [](InfiniPotConfig config, const std::string& needle) {
    try {
      InfiniPotPolicy policy(config);
      ADD_FAILURE() << "accepted pot " << config.pot << " keep " << config.keep;
    } catch (const kvevict::Error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
    }
  };
  rejects({0, 0, 0}, "pot must be positive");
  rejects({-4, 2, 0}, "pot must be positive");
  rejects({8, 0, 0}, "0 < keep < pot");
  rejects({8, 8, 0}, "0 < keep < pot");
  rejects({8, 9, 0}, "0 < keep < pot");
  rejects({8, 4, -1}, "0 <= novel < keep");
  rejects({8, 4, 4}, "0 <= novel < keep");
  rejects({8, 4, 5}, "0 <= novel < keep");
  // Without `novel`, T = C / 2 (the paper's setting).
  EXPECT_EQ(InfiniPotPolicy(InfiniPotConfig{8, 5}).novel(), 2);
  EXPECT_EQ(InfiniPotPolicy(InfiniPotConfig{8, 1}).novel(), 0);
}

TEST(InfiniPotPolicy, IsRegisteredWithNovelDefaultingToHalfOfKeep) {
  const auto names = kvevict::policy_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "infinipot"), names.end());
  const auto policy =
      kvevict::make_policy("infinipot", PolicyParams().set("pot", 24).set("keep", 12));
  ASSERT_EQ(policy->name(), "infinipot");
  EXPECT_EQ(dynamic_cast<const InfiniPotPolicy&>(*policy).novel(), 6);
  const auto explicit_novel = kvevict::make_policy(
      "infinipot", PolicyParams().set("pot", 24).set("keep", 12).set("novel", 0));
  EXPECT_EQ(dynamic_cast<const InfiniPotPolicy&>(*explicit_novel).novel(), 0);
  EXPECT_THROW((void)kvevict::make_policy("infinipot", PolicyParams().set("keep", 12)),
               kvevict::Error);
  EXPECT_THROW((void)kvevict::make_policy(
                   "infinipot", PolicyParams().set("pot", 24).set("keep", 12).set("novel", 12)),
               kvevict::Error);
  EXPECT_THROW((void)kvevict::make_policy(
                   "infinipot", PolicyParams().set("pot", 24).set("keep", 12).set("budget", 3)),
               kvevict::Error);
}

}  // namespace
