// H2O: keep-sets derived by hand from docs/policies.md ("H2O") and the paper's rule: per KV head,
// score = running sum of attention columns (GQA: summed over the group's query heads); once a head
// holds more than heavy + recent slots, keep the last `recent` plus the top `heavy` of the rest.
// Every expected value below is worked out in the comments from the attention rows the test feeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvevict/error.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/slot_table.hpp>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::H2oConfig;
using kvevict::PolicyParams;
using kvevict::test::every_head;
using kvevict::test::expect_error;
using kvevict::test::Harness;
using kvevict::test::HeadRows;
using kvevict::test::LayerRows;
using kvevict::test::Positions;

std::unique_ptr<kvevict::Policy> h2o(int heavy, int recent) {
  return kvevict::make_h2o(H2oConfig{heavy, recent});
}

void expect_scores_near(const std::vector<float>& actual, const std::vector<float>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-5) << "slot " << i;
  }
}

TEST(H2oPolicy, SteadyDecodeDropsTheArgminAmongNonRecentSlots) {
  Harness run(1, 1, 1, h2o(/*heavy=*/2, /*recent=*/2));
  // Prefill of 4 = heavy + recent: nothing evicted. Column sums:
  //   slot 0: 1 + .5 + .2 + .1 = 1.8   slot 1: .5 + .6 + .3 = 1.4
  //   slot 2: .2 + .4 = .6             slot 3: .2
  run.feed(4, HeadRows{{1.0f}, {0.5f, 0.5f}, {0.2f, 0.6f, 0.2f}, {0.1f, 0.3f, 0.4f, 0.2f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 2, 3}));
  expect_scores_near(run.scores(), {1.8f, 1.4f, 0.6f, 0.2f});
  EXPECT_EQ(run.stats().decisions, 0);

  // Token 4 attends [.1 .2 .3 .1 .3] -> sums 1.9 1.6 .9 .3 .3. Recent = positions 3, 4; the top 2
  // of {0: 1.9, 1: 1.6, 2: .9} keep 0 and 1, so 2 goes although 3 scores less (3 is recent).
  run.feed(1, HeadRows{{0.1f, 0.2f, 0.3f, 0.1f, 0.3f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 3, 4}));
  expect_scores_near(run.scores(), {1.9f, 1.6f, 0.3f, 0.3f});

  // Token 5 over positions [0 1 3 4 5] attends [.05 .05 .1 .6 .2] -> 1.95 1.65 .4 .9 .2.
  // Recent = 4, 5; among {0, 1, 3} position 3 (.4) is the argmin.
  run.feed(1, HeadRows{{0.05f, 0.05f, 0.1f, 0.6f, 0.2f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 4, 5}));

  // Token 6 over [0 1 4 5 6] attends [.1 0 .8 .1 0] -> 2.05 1.65 1.7 .3 0. Recent = 5, 6; position
  // 4 (.3 + .6 + .8 = 1.7) has overtaken position 1 (1.65): the accumulated sum decides, not age.
  run.feed(1, HeadRows{{0.1f, 0.0f, 0.8f, 0.1f, 0.0f}});
  EXPECT_EQ(run.kept(), (Positions{0, 4, 5, 6}));
  expect_scores_near(run.scores(), {2.05f, 1.7f, 0.3f, 0.0f});

  EXPECT_EQ(run.stats().evicted_slots, 3);  // exactly one slot per decode step
  EXPECT_EQ(run.positions(), run.kept());   // original positions by default
}

TEST(H2oPolicy, PrefillLongerThanTheBudgetIsCutInOneShot) {
  // heavy 1 + recent 2 = 3 < 5 prompt tokens. Layer 0 (one peaked head), column sums:
  //   slot 0: 1 + .1 + .05 + .05 + .1 = 1.3   slot 1: .9 + .9 + .8 + .6 = 3.2
  //   slot 2: .05 + .05 + .1 = .2             slot 3: .1 + .1 = .2      slot 4: .1
  // Recent = 3, 4; top 1 of {0, 1, 2} is slot 1, so token 0 goes (H2O protects no sink).
  const HeadRows peaked{{1.0f},
                        {0.1f, 0.9f},
                        {0.05f, 0.9f, 0.05f},
                        {0.05f, 0.8f, 0.05f, 0.1f},
                        {0.1f, 0.6f, 0.1f, 0.1f, 0.1f}};
  // Layer 1, uniform rows (query i gives 1/(i+1) to each key): slot j sums 1/(j+1) + ... + 1/5,
  // so slot 0 (2.28) beats slot 1 (1.28) and slot 2 (.78): early tokens win on raw column sums.
  const HeadRows uniform{{1.0f},
                         {1.0f / 2, 1.0f / 2},
                         {1.0f / 3, 1.0f / 3, 1.0f / 3},
                         {1.0f / 4, 1.0f / 4, 1.0f / 4, 1.0f / 4},
                         {1.0f / 5, 1.0f / 5, 1.0f / 5, 1.0f / 5, 1.0f / 5}};
  Harness run(2, 1, 1, h2o(/*heavy=*/1, /*recent=*/2));
  run.feed(5, {LayerRows{peaked}, LayerRows{uniform}});
  EXPECT_EQ(run.kept(0), (Positions{1, 3, 4}));
  EXPECT_EQ(run.kept(1), (Positions{0, 3, 4}));
  expect_scores_near(run.scores(0), {3.2f, 0.2f, 0.1f});
  EXPECT_EQ(run.stats().decisions, 1);  // one cut, not one per token
}

TEST(H2oPolicy, NewTokensStartAtTheirColumnSumsWithinTheChunkAndAreNeverNormalised) {
  Harness run(1, 1, 1, h2o(/*heavy=*/4, /*recent=*/4));
  // Chunk 1: rows [1], [.5 .5] -> slot 0: 1.5, slot 1: .5.
  run.feed(2, HeadRows{{1.0f}, {0.5f, 0.5f}});
  expect_scores_near(run.scores(), {1.5f, 0.5f});
  // Chunk 2 (tokens 2, 3): rows [1/3 x3], [1/4 x4] add 1/3 + 1/4 = 7/12 to slots 0..2 and 1/4 to
  // slot 3: 1.5 + 7/12, .5 + 7/12, 7/12, 1/4. Slot 0 exceeds 1: sums are not normalised.
  run.feed(2, HeadRows{{1.0f / 3, 1.0f / 3, 1.0f / 3}, {0.25f, 0.25f, 0.25f, 0.25f}});
  const float seven_twelfths = 7.0f / 12.0f;
  expect_scores_near(run.scores(),
                     {1.5f + seven_twelfths, 0.5f + seven_twelfths, seven_twelfths, 0.25f});
}

TEST(H2oPolicy, BudgetCoveringEveryTokenEvictsNothing) {
  Harness run(2, 2, 2, h2o(/*heavy=*/4, /*recent=*/4));
  // 5 + 1 + 1 + 1 = 8 tokens = heavy + recent: the trigger never fires.
  run.feed(5, HeadRows{{1.0f},
                       {0.5f, 0.5f},
                       {0.2f, 0.3f, 0.5f},
                       {0.1f, 0.2f, 0.3f, 0.4f},
                       {0.2f, 0.2f, 0.2f, 0.2f, 0.2f}});
  for (int t = 5; t < 8; ++t) {
    run.feed(1, HeadRows{std::vector<float>(static_cast<std::size_t>(t + 1), 1.0f / (t + 1))});
  }
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g) EXPECT_EQ(run.kept(l, g), (Positions{0, 1, 2, 3, 4, 5, 6, 7}));
  }
  EXPECT_EQ(run.stats().decisions, 0);
}

TEST(H2oPolicy, GqaScoreIsTheSumOverTheGroupsQueryHeads) {
  // 4 query heads, 2 KV heads (group 2: heads 0, 1 read KV head 0; heads 2, 3 read KV head 1).
  // heavy 1 + recent 1 = 2 < 3 prompt tokens. Column sums per query head (slots 0, 1, 2):
  const HeadRows head_a{{1.0f}, {0.3f, 0.7f}, {0.1f, 0.2f, 0.7f}};  // 1.4  .9   .7
  const HeadRows head_b{{1.0f}, {0.0f, 1.0f}, {0.0f, 1.0f, 0.0f}};  // 1.0  2.0  0
  const HeadRows head_c{{1.0f}, {0.9f, 0.1f}, {0.8f, 0.1f, 0.1f}};  // 2.7  .2   .1
  const HeadRows head_d{{1.0f}, {0.5f, 0.5f}, {0.4f, 0.3f, 0.3f}};  // 1.9  .8   .3
  // Layer 0 = [a b c d]. KV head 0 = a + b: 2.4 2.9 .7 -> recent slot 2 + slot 1. (Head a alone
  // would keep slot 0, and so would a layer-wide sum a + b + c + d: 7.0 vs 3.9.)
  // KV head 1 = c + d: 4.6 1.0 .4 -> slot 2 + slot 0.
  // Layer 1 = [c d a b]: the groups swap, and so do the keep-sets.
  Harness run(2, 4, 2, h2o(/*heavy=*/1, /*recent=*/1));
  run.feed(3,
           {LayerRows{head_a, head_b, head_c, head_d}, LayerRows{head_c, head_d, head_a, head_b}});
  EXPECT_EQ(run.kept(0, 0), (Positions{1, 2}));
  EXPECT_EQ(run.kept(0, 1), (Positions{0, 2}));
  EXPECT_EQ(run.kept(1, 0), (Positions{0, 2}));
  EXPECT_EQ(run.kept(1, 1), (Positions{1, 2}));
  // Sum, not mean: KV head 0 keeps 2.9 and .7 (a mean would store 1.45 and .35).
  expect_scores_near(run.scores(0, 0), {2.9f, 0.7f});
  expect_scores_near(run.scores(0, 1), {4.6f, 0.4f});
}

TEST(H2oPolicy, TiesGoToTheLowerPosition) {
  Harness run(1, 1, 1, h2o(/*heavy=*/1, /*recent=*/1));
  // Rows [1], [.5 .5] -> 1.5, .5. Token 2 attends [0 1 0] -> 1.5, 1.5, 0 (exact in binary).
  // Recent keeps slot 2; slots 0 and 1 tie for the one heavy slot: the lower position wins.
  run.feed(2, HeadRows{{1.0f}, {0.5f, 0.5f}});
  run.feed(1, HeadRows{{0.0f, 1.0f, 0.0f}});
  EXPECT_EQ(run.kept(), (Positions{0, 2}));
}

TEST(H2oPolicy, WithoutARecentWindowTheNewestTokenCompetes) {
  Harness run(1, 1, 1, h2o(/*heavy=*/2, /*recent=*/0));
  // [1], [.5 .5] -> 1.5, .5; token 2 attends [.6 .3 .1] -> 2.1, .8, .1: the newest is the argmin.
  run.feed(2, HeadRows{{1.0f}, {0.5f, 0.5f}});
  run.feed(1, HeadRows{{0.6f, 0.3f, 0.1f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1}));
}

TEST(H2oPolicy, NanAttentionIsAnError) {
  Harness run(1, 1, 1, h2o(/*heavy=*/2, /*recent=*/2));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { run.feed(2, HeadRows{{1.0f}, {nan, 0.5f}}); }, "NaN");
}

TEST(H2oPolicy, InvalidConfigurationsAreErrors) {
  expect_error(
      [] {
        (void)kvevict::make_h2o(H2oConfig{-1, 4});
      },
      "h2o: heavy must be >= 0, got -1");
  expect_error(
      [] {
        (void)kvevict::make_h2o(H2oConfig{4, -1});
      },
      "h2o: recent must be >= 0, got -1");
  expect_error([] { (void)kvevict::make_h2o(H2oConfig{0, 0}); }, "heavy + recent must be positive");
  expect_error([] { (void)kvevict::make_policy("h2o", PolicyParams().set("heavy", 2)); },
               "policy 'h2o': missing parameter 'recent'");
  expect_error(
      [] {
        (void)kvevict::make_policy("h2o",
                                   PolicyParams().set("heavy", 2).set("recent", 2).set("sinks", 4));
      },
      "unknown parameter 'sinks'");
}

TEST(H2oPolicy, RegistryBuildsItWithTheReplayParameterNames) {
  const auto names = kvevict::policy_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "h2o"), names.end());
  const auto policy = kvevict::make_policy("h2o", PolicyParams().set("heavy", 3).set("recent", 5));
  EXPECT_EQ(policy->name(), "h2o");
  EXPECT_EQ(policy->retained_limit(), 8);
  EXPECT_EQ(policy->score_columns(), 1);
  EXPECT_TRUE(policy->signals().contains(kvevict::Signal::attention_rows));
  EXPECT_TRUE(policy->triggers().contains(kvevict::Trigger::after_forward));
  EXPECT_EQ(policy->default_position_mode(), kvevict::PositionMode::original);
  // The recent window is a decorator around the heavy-hitter rule (policies/protection.hpp).
  const auto& recent = dynamic_cast<const kvevict::ProtectNewest&>(*policy);
  EXPECT_EQ(recent.count(), 5);
  EXPECT_EQ(dynamic_cast<const kvevict::HeavyHitterPolicy&>(recent.inner()).retained_limit(), 3);
}

}  // namespace
