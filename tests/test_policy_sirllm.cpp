// SirLLM and its baselines RandomLLM / IntervalLLM: keep-sets derived by hand from the paper and
// docs/policies.md (the arithmetic is in the comments), decay, the shifted scores, and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <kvevict/policies/random_llm.hpp>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "support/policy_harness.hpp"

namespace {

using kvevict::PolicyParams;
using Positions = std::vector<std::int64_t>;
using Scores = std::vector<float>;

constexpr int kLayers = 2;
constexpr int kKvHeads = 2;
constexpr int kTableCapacity = 64;

// A sequence of kLayers x kKvHeads heads; every chunk fed is a turn unless told otherwise.
class Stream {
 public:
  explicit Stream(std::unique_ptr<kvevict::Policy> policy)
      : sequence_(config(), std::move(policy)) {}

  // One forward of surprisal.size() tokens carrying these surprisal values.
  void turn(const Scores& surprisal, bool turn_start = true) {
    const int n = static_cast<int>(surprisal.size());
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
    std::iota(ids.begin(), ids.end(), 100 + static_cast<std::int32_t>(fed_));
    fed_ += n;
    sequence_.begin_chunk(ids, turn_start);
    if (sequence_.wants(kvevict::Signal::surprisal)) sequence_.observe_surprisal(surprisal);
    sequence_.end_forward();
  }
  // A turn of n tokens with surprisal 1 (a separate name: turn({8}) must stay one token).
  void turn_of(int n) { turn(Scores(static_cast<std::size_t>(n), 1.0f)); }

  [[nodiscard]] Positions kept(int l = 0, int g = 0) const {
    return kvevict::test::kept_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] Positions positions(int l = 0, int g = 0) const {
    return kvevict::test::rope_positions(sequence_.slots(), sequence_.unit_of(l, g));
  }
  [[nodiscard]] Scores scores(int l = 0, int g = 0) const {
    return kvevict::test::score_column(sequence_.slots(), sequence_.unit_of(l, g), 0);
  }
  // The same keep-set in every layer and head.
  void expect_uniform() const {
    for (int l = 0; l < kLayers; ++l) {
      for (int g = 0; g < kKvHeads; ++g) {
        EXPECT_EQ(kept(l, g), kept()) << "head (" << l << ", " << g << ")";
        if (sequence_.slots().score_columns() > 0) {
          EXPECT_EQ(scores(l, g), scores());
        }
      }
    }
  }
  [[nodiscard]] kvevict::Sequence& sequence() { return sequence_; }

 private:
  static kvevict::SequenceConfig config() {
    kvevict::SequenceConfig c;
    c.layers = kLayers;
    c.q_heads = kKvHeads;
    c.kv_heads = kKvHeads;
    c.max_chunk = kTableCapacity;
    return c;
  }

  kvevict::Sequence sequence_;
  std::int64_t fed_ = 0;
};

std::unique_ptr<kvevict::Policy> sirllm(int sinks, int entropy, int recent, double decay,
                                        bool shifted = false) {
  return std::make_unique<kvevict::SirLlmPolicy>(
      kvevict::SirLlmConfig{sinks, entropy, recent, decay, shifted});
}

// ---------------------------------------------------------------------------------------------
// SirLLM

TEST(SirLlmPolicy, DeclaresItsSignalsTriggerAndBudget) {
  const auto policy = sirllm(4, 24, 8, 0.7);
  EXPECT_EQ(policy->name(), "sirllm");
  EXPECT_TRUE(policy->signals().contains(kvevict::Signal::surprisal));
  EXPECT_TRUE(policy->signals().contains(kvevict::Signal::turn_boundaries));
  EXPECT_TRUE(policy->triggers().contains(kvevict::Trigger::before_turn));
  EXPECT_FALSE(policy->triggers().contains(kvevict::Trigger::after_forward));
  EXPECT_EQ(policy->score_columns(), 1);
  EXPECT_EQ(policy->default_position_mode(), kvevict::PositionMode::cache_index);
  EXPECT_EQ(policy->retained_limit(), 4 + 24 + 8);
}

TEST(SirLlmPolicy, DecaysRetainedScoresBeforeEveryLaterTurnEvenWithoutEviction) {
  // sinks 2, entropy 4, recent 0: capacity 6; decay 0.5 (exact in binary).
  Stream stream(sirllm(2, 4, 0, 0.5));
  stream.turn({1, 2, 3});  // first turn: empty cache, nothing to decay
  EXPECT_EQ(stream.scores(), (Scores{1, 2, 3}));
  // L = 3, n = 2: 5 <= 6, nothing evicted, but the three retained scores are halved; the new
  // turn's scores are appended as given.
  stream.turn({4, 5});
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 3, 4}));
  EXPECT_EQ(stream.scores(), (Scores{0.5, 1, 1.5, 4, 5}));
  EXPECT_EQ(stream.sequence().stats().evicted_slots, 0);
  stream.expect_uniform();
}

TEST(SirLlmPolicy, RanksAllSlotsSinksIncludedThenFillsWithTheMostRecent) {
  // sinks 2, entropy 3, recent 0: capacity 5.
  Stream stream(sirllm(2, 3, 0, 0.5));
  stream.turn({9, 0.5, 7});  // positions 0..2
  stream.turn({3, 1});       // positions 3, 4; L = 3 + 2 = 5 <= 5: decay only -> 4.5 .25 3.5 3 1
  // Next turn n = 1, L = 5: 6 > 5. Top entropy - n = 2 over all five slots: 4.5 (pos 0, a sink)
  // and 3.5 (pos 2). Sinks add pos 1. Fill with the newest up to 5 - 1 = 4: pos 4. Pos 3 (score
  // 3, the best non-sink after pos 2) goes; ranking only the non-sinks would have kept it and
  // dropped pos 4 instead.
  stream.turn({8});
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 4, 5}));
  // The four survivors were halved once more after the eviction; the new token is undecayed.
  EXPECT_EQ(stream.scores(), (Scores{2.25, 0.125, 1.75, 0.5, 8}));
  EXPECT_EQ(stream.positions(), (Positions{0, 1, 2, 3, 4}));  // cache_index
  stream.expect_uniform();
}

TEST(SirLlmPolicy, TiesGoToTheLowerSlot) {
  // sinks 1, entropy 3, recent 0: capacity 4. Scores 1 5 5 5; a turn of 1: top 2 among the
  // three tied 5s are the lower slots 1 and 2; with sink 0 that is 3 = 4 - 1, no fill.
  Stream stream(sirllm(1, 3, 0, 1.0));
  stream.turn({1, 5, 5});
  stream.turn({5});
  stream.turn({2});
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 4}));
}

TEST(SirLlmPolicy, TurnLongerThanTheEntropySlotsKeepsSinksAndMostRecentOnly) {
  // sinks 2, entropy 2, recent 4: capacity 8, turns up to 6 tokens.
  Stream stream(sirllm(2, 2, 4, 1.0));
  stream.turn({1, 1, 100, 1, 1, 1});  // positions 0..5; pos 2 has by far the highest score
  stream.turn({1, 1});                // positions 6, 7: L + n = 8 <= 8
  // n = 3: entropy - n = -1, no top-k slot at all. Sinks 0, 1, then the newest up to 8 - 3 = 5:
  // positions 7, 6, 5. The high-entropy pos 2 is dropped.
  stream.turn({1, 1, 1});
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 5, 6, 7, 8, 9, 10}));
}

TEST(SirLlmPolicy, EvictsOnThisTurnsScoresThenDecays) {
  // decay 0 separates the authors' order (evict, then decay) from decaying first.
  // sinks 1, entropy 3, recent 0: capacity 4.
  Stream stream(sirllm(1, 3, 0, 0.0));
  stream.turn({1, 5, 2});  // positions 0..2
  // n = 2, L = 3: 5 > 4. Top 1 over all: pos 1 (5); sink pos 0; 2 = 4 - 2 kept. Then decay 0.
  stream.turn({7, 3});  // positions 3, 4
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 3, 4}));
  EXPECT_EQ(stream.scores(), (Scores{0, 0, 7, 3}));
  // n = 1, L = 4: top 2 over 0 0 7 3 = pos 3, 4 (the last turn, still undecayed); sink pos 0.
  // Decaying first would have zeroed everything and kept pos 0, 1 by the tie rule, then pos 4.
  stream.turn({1});
  EXPECT_EQ(stream.kept(), (Positions{0, 3, 4, 5}));
}

TEST(SirLlmPolicy, ChunksInsideATurnNeitherEvictNorDecay) {
  // sinks 1, entropy 2, recent 0: capacity 3. A turn fed as 2 + 1 + 1 tokens grows past it.
  Stream stream(sirllm(1, 2, 0, 0.5));
  stream.turn({4, 2});
  stream.turn({6}, false);
  stream.turn({8}, false);
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 3}));
  EXPECT_EQ(stream.scores(), (Scores{4, 2, 6, 8}));
  // The next turn (n = 1, L = 4): top 1 = pos 3 (8); sink 0; 2 = 3 - 1 kept; then halved.
  stream.turn({1});
  EXPECT_EQ(stream.kept(), (Positions{0, 3, 4}));
  EXPECT_EQ(stream.scores(), (Scores{2, 4, 1}));
}

TEST(SirLlmPolicy, ShiftedScoresFollowTheAuthorsCode) {
  // Token j takes the value of token j - 1; a turn's first token takes the turn's maximum; a
  // later chunk of the same turn continues from the previous chunk's last value.
  // sinks 1, entropy 4, recent 0: capacity 5.
  Stream shifted(sirllm(1, 4, 0, 1.0, true));
  Stream paper(sirllm(1, 4, 0, 1.0, false));
  for (Stream* stream : {&shifted, &paper}) {
    stream->turn({2, 8, 4});   // shifted: max 8, then 2, 8
    stream->turn({3, 6});      // shifted: max 6, then 3
    stream->turn({5}, false);  // same turn: shifted takes the previous value, 6
  }
  EXPECT_EQ(shifted.scores(), (Scores{8, 2, 8, 6, 3, 6}));
  EXPECT_EQ(paper.scores(), (Scores{2, 8, 4, 3, 6, 5}));
  // Next turn n = 1, L = 6 > 4: top 3 of (8 2 8 6 3 6) = pos 0, 2, 3 (6 ties: pos 3 beats
  // pos 5); sink pos 0; fill up to 4 with pos 5.
  shifted.turn({1});
  EXPECT_EQ(shifted.kept(), (Positions{0, 2, 3, 5, 6}));
  // Paper scores (2 8 4 3 6 5): top 3 = pos 1, 4, 5; sink pos 0; already 4.
  paper.turn({1});
  EXPECT_EQ(paper.kept(), (Positions{0, 1, 4, 5, 6}));
  shifted.expect_uniform();
}

TEST(SirLlmPolicy, TurnLongerThanRecentPlusEntropyIsAnError) {
  // sinks 2, entropy 2, recent 1: a turn may hold at most 3 tokens, first turn included.
  Stream first(sirllm(2, 2, 1, 1.0));
  EXPECT_THROW(first.turn_of(4), kvevict::Error);
  Stream later(sirllm(2, 2, 1, 1.0));
  later.turn_of(3);
  later.turn_of(2);
  EXPECT_THROW(later.turn_of(4), kvevict::Error);
}

// Refused when observed (Sequence), before SirLLM keeps it for the rankings of later turns.
TEST(SirLlmPolicy, NanSurprisalIsAnError) {
  Stream stream(sirllm(1, 2, 0, 1.0));
  EXPECT_THROW(stream.turn({1, std::numeric_limits<float>::quiet_NaN()}), kvevict::Error);
}

TEST(SirLlmPolicy, RejectsBadConfigurations) {
  using kvevict::SirLlmConfig;
  using kvevict::SirLlmPolicy;
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{-1, 8, 0, 1.0, false}), kvevict::Error);
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{4, -1, 8, 1.0, false}), kvevict::Error);
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{4, 8, -1, 1.0, false}), kvevict::Error);
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{4, 0, 0, 1.0, false}), kvevict::Error);
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{4, 8, 0, 1.5, false}), kvevict::Error);
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{4, 8, 0, -0.1, false}), kvevict::Error);
  EXPECT_THROW(SirLlmPolicy(SirLlmConfig{4, 8, 0, std::nan(""), false}), kvevict::Error);
  EXPECT_NO_THROW(SirLlmPolicy(SirLlmConfig{0, 0, 8, 0.0, false}));  // StreamingLLM-like
}

TEST(SirLlmPolicy, RegistryReadsTheReplayParameters) {
  const auto policy = kvevict::make_policy(
      "sirllm",
      PolicyParams().set("sinks", 4).set("entropy", 24).set("recent", 0).set("decay", 0.7));
  EXPECT_EQ(policy->name(), "sirllm");
  EXPECT_EQ(policy->retained_limit(), 28);
  // Defaults: sinks 4, recent 0, decay 1, shifted 0.
  EXPECT_EQ(kvevict::make_policy("sirllm", PolicyParams().set("entropy", 8))->retained_limit(), 12);
  EXPECT_NO_THROW(
      (void)kvevict::make_policy("sirllm", PolicyParams().set("entropy", 8).set("shifted", 1)));
  EXPECT_THROW(
      (void)kvevict::make_policy("sirllm", PolicyParams().set("entropy", 8).set("shifted", 2)),
      kvevict::Error);
  EXPECT_THROW((void)kvevict::make_policy("sirllm", PolicyParams().set("sinks", 4)),
               kvevict::Error);  // entropy is required
  EXPECT_THROW(
      (void)kvevict::make_policy("sirllm", PolicyParams().set("entropy", 8).set("heavy", 2)),
      kvevict::Error);  // unknown parameter
}

// ---------------------------------------------------------------------------------------------
// RandomLLM

std::unique_ptr<kvevict::Policy> random_llm(int sinks, int budget, std::uint64_t seed) {
  return kvevict::make_random_llm(kvevict::RandomLlmConfig{sinks, budget, seed});
}

// Turn sizes used by the RandomLLM tests (all <= budget 6).
const std::vector<int> kTurns = {6, 2, 3, 1, 4, 2, 5, 3, 6, 1, 2, 4};

std::vector<Positions> run_random(std::uint64_t seed) {
  Stream stream(random_llm(2, 6, seed));
  std::vector<Positions> decisions;
  for (int n : kTurns) {
    stream.turn_of(n);
    stream.expect_uniform();
    decisions.push_back(stream.kept());
  }
  return decisions;
}

TEST(RandomLlmPolicy, KeepsSinksPlusBudgetMinusTurnHistorySlots) {
  // sinks 2, budget 6: capacity 8.
  Stream stream(random_llm(2, 6, 7));
  stream.turn_of(6);  // positions 0..5
  stream.turn_of(2);  // 6, 7: L + n = 8 <= 8, nothing evicted
  EXPECT_EQ(stream.kept().size(), 8u);
  // n = 3, L = 8: keep sinks 0, 1 and 6 - 3 = 3 of the six history slots 2..7, then 8, 9, 10.
  stream.turn_of(3);
  const Positions kept = stream.kept();
  ASSERT_EQ(kept.size(), 8u);
  EXPECT_EQ(kept[0], 0);
  EXPECT_EQ(kept[1], 1);
  for (int i = 2; i < 5; ++i) {
    EXPECT_GE(kept[static_cast<std::size_t>(i)], 2);
    EXPECT_LE(kept[static_cast<std::size_t>(i)], 7);
  }
  EXPECT_EQ(Positions(kept.begin() + 5, kept.end()), (Positions{8, 9, 10}));
  stream.expect_uniform();
}

TEST(RandomLlmPolicy, SameSeedSameKeepSetsOtherSeedOthers) {
  const std::vector<Positions> a = run_random(42);
  EXPECT_EQ(run_random(42), a);
  EXPECT_NE(run_random(43), a);
  // Successive evictions draw fresh subsets: the generator is not reseeded per turn.
  for (const Positions& kept : a) EXPECT_LE(kept.size(), 8u);
}

TEST(RandomLlmPolicy, BoundedDrawIsUniformAndInRange) {
  std::mt19937_64 engine(1);
  EXPECT_EQ(kvevict::detail::uniform_below(engine, 1), 0u);
  // 3 does not divide 2^64: a plain modulo would be (very slightly) biased; the counts of 30000
  // draws must each be within 5 standard deviations (~ 5 * 82) of 10000.
  std::vector<int> counts(3, 0);
  for (int i = 0; i < 30000; ++i) ++counts[kvevict::detail::uniform_below(engine, 3)];
  for (int count : counts) EXPECT_NEAR(count, 10000, 410);
  const std::uint64_t huge = (std::uint64_t{1} << 63) + 1;  // rejects almost half the raw draws
  for (int i = 0; i < 100; ++i) EXPECT_LT(kvevict::detail::uniform_below(engine, huge), huge);
}

// RandomLLM's generator must give std::mt19937_64's sequence (fixed by the C++ standard), so that
// a seed's keep-sets stay those of the standard engine: the same outputs over several blocks of
// 312 for seeds at the edges, and the standard's check value (the 10000th output of the default
// seed, 5489).
TEST(RandomLlmPolicy, GeneratorGivesTheStandardSequence) {
  for (const std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{5489},
                                   ~std::uint64_t{0}, std::uint64_t{1} << 63}) {
    std::mt19937_64 standard(seed);
    kvevict::detail::MersenneTwister64 blocks(seed);
    for (int i = 0; i < 2000; ++i)
      ASSERT_EQ(blocks(), standard()) << "seed " << seed << " output " << i;
  }
  kvevict::detail::MersenneTwister64 check(5489);
  for (int i = 1; i < 10000; ++i) (void)check();
  EXPECT_EQ(check(), 9981545732273789042ULL);
}

TEST(RandomLlmPolicy, RejectsBadConfigurationsAndLongTurns) {
  EXPECT_THROW(random_llm(-1, 6, 0), kvevict::Error);
  EXPECT_THROW(random_llm(4, 0, 0), kvevict::Error);
  Stream stream(random_llm(2, 3, 0));
  EXPECT_THROW(stream.turn_of(4), kvevict::Error);  // a turn longer than the budget
  const auto policy = kvevict::make_policy(
      "random_llm", PolicyParams().set("sinks", 4).set("budget", 508).set("seed", 3));
  EXPECT_EQ(policy->retained_limit(), 512);
  EXPECT_EQ(policy->default_position_mode(), kvevict::PositionMode::cache_index);
  EXPECT_THROW(
      (void)kvevict::make_policy("random_llm", PolicyParams().set("budget", 8).set("seed", -1)),
      kvevict::Error);
}

// ---------------------------------------------------------------------------------------------
// IntervalLLM

std::unique_ptr<kvevict::Policy> interval_llm(int sinks, int budget) {
  return kvevict::make_interval_llm(kvevict::IntervalLlmConfig{sinks, budget});
}

TEST(IntervalLlmPolicy, SamplesTheHistoryAtStrideHistoryOverRoom) {
  // sinks 2, budget 6: capacity 8.
  Stream stream(interval_llm(2, 6));
  stream.turn_of(6);  // 0..5
  stream.turn_of(2);  // 6, 7: 8 <= 8
  // n = 3, L = 8: history h = 6 (slots 2..7), room k = 6 - 3 = 3, stride floor(6 / 3) = 2:
  // slots 2, 4, 6 (= positions 2, 4, 6), then the turn 8, 9, 10.
  stream.turn_of(3);
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 4, 6, 8, 9, 10}));
  // n = 2, L = 8: h = 6 (slots 2..7 = positions 2 4 6 8 9 10), k = 4, stride floor(6 / 4) = 1:
  // slots 2..5 = positions 2, 4, 6, 8; then 11, 12.
  stream.turn_of(2);
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 4, 6, 8, 11, 12}));
  // n = 4, L = 8: h = 6 (slots 2..7 = positions 2 4 6 8 11 12), k = 2, stride 3: slots 2, 5 =
  // positions 2, 8; then 13..16.
  stream.turn_of(4);
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 2, 8, 13, 14, 15, 16}));
  // n = 6 = budget, L = 8: k = 0, only the sinks stay; then 17..22.
  stream.turn_of(6);
  EXPECT_EQ(stream.kept(), (Positions{0, 1, 17, 18, 19, 20, 21, 22}));
  stream.expect_uniform();
}

TEST(IntervalLlmPolicy, RejectsBadConfigurationsAndLongTurns) {
  EXPECT_THROW(interval_llm(-1, 6), kvevict::Error);
  EXPECT_THROW(interval_llm(4, -2), kvevict::Error);
  Stream stream(interval_llm(0, 2));
  EXPECT_THROW(stream.turn_of(3), kvevict::Error);
  EXPECT_EQ(
      kvevict::make_policy("interval_llm", PolicyParams().set("budget", 508))->retained_limit(),
      512);  // sinks default to 4
  EXPECT_THROW(
      (void)kvevict::make_policy("interval_llm", PolicyParams().set("budget", 8).set("seed", 1)),
      kvevict::Error);  // no seed for the deterministic baseline
}

}  // namespace
