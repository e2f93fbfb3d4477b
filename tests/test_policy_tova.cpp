// TOVA: keep-sets derived by hand from the paper (Oren et al. 2024, §3.4; App. A) and
// docs/policies.md ("TOVA"): score = mean over all query heads of the layer of the forward's LAST
// query row, current step only; when a head holds more than `budget` slots keep the first `sinks`
// plus the top scores of the rest; nothing else is protected. Every expected value below is worked
// out in the comments from the attention rows the test feeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <kvevict/error.hpp>
#include <kvevict/policies/tova.hpp>
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

using kvevict::PolicyParams;
using kvevict::TovaConfig;
using kvevict::TovaPolicy;
using kvevict::test::every_head;
using kvevict::test::expect_error;
using kvevict::test::Harness;
using kvevict::test::HeadRows;
using kvevict::test::LayerRows;
using kvevict::test::Positions;

std::unique_ptr<kvevict::Policy> tova(int budget, int sinks = 0, bool head_wise = false) {
  return kvevict::make_tova(TovaConfig{budget, sinks, head_wise});
}

void expect_scores_near(const std::vector<float>& actual, const std::vector<float>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-6) << "slot " << i;
  }
}

// The rows below are the last query's only (what Signal::last_attention_row delivers).
TEST(TovaPolicy, SteadyDecodeDropsTheArgminOfTheCurrentStepOnly) {
  Harness run(1, 1, 1, tova(/*budget=*/3));
  run.feed(3, HeadRows{{0.2f, 0.3f, 0.5f}});  // 3 = budget: nothing evicted
  EXPECT_EQ(run.kept(), (Positions{0, 1, 2}));

  // Token 3 attends [.4 .1 .3 .2] over positions [0 1 2 3]: position 1 (.1) goes.
  run.feed(1, HeadRows{{0.4f, 0.1f, 0.3f, 0.2f}});
  EXPECT_EQ(run.kept(), (Positions{0, 2, 3}));
  // Token 4 attends [.5 .15 .3 .05] over [0 2 3 4]: the token just fed scores least and goes.
  run.feed(1, HeadRows{{0.5f, 0.15f, 0.3f, 0.05f}});
  EXPECT_EQ(run.kept(), (Positions{0, 2, 3}));
  // Token 5 attends [.3 .4 .1 .2] over [0 2 3 5]: position 3 (.1) goes. Had the scores been
  // accumulated, 3 would hold .2 + .3 + .1 = .6 and 5 only .2, and 5 would have gone instead.
  run.feed(1, HeadRows{{0.3f, 0.4f, 0.1f, 0.2f}});
  EXPECT_EQ(run.kept(), (Positions{0, 2, 5}));
  expect_scores_near(run.scores(), {0.3f, 0.4f, 0.2f});  // this step's row, overwritten

  EXPECT_EQ(run.stats().evicted_slots, 3);
  EXPECT_EQ(run.positions(), run.kept());  // original positions by default
}

TEST(TovaPolicy, PrefillLongerThanTheBudgetIsCutInOneShotFromTheLastRow) {
  // Budget 2 < 5 prompt tokens. The last row [.1 .4 .05 .3 .15] keeps positions 1 and 3; the
  // earlier rows all favour position 0 (summing every row would give it 3.8 and keep it).
  const HeadRows all_rows{{1.0f},
                          {0.9f, 0.1f},
                          {0.9f, 0.05f, 0.05f},
                          {0.9f, 0.03f, 0.03f, 0.04f},
                          {0.1f, 0.4f, 0.05f, 0.3f, 0.15f}};
  // An engine that hands every row of the forward gets the same decision as one that hands the
  // last row only.
  Harness given_all_rows(1, 1, 1, tova(/*budget=*/2));
  given_all_rows.feed(5, all_rows);
  EXPECT_EQ(given_all_rows.kept(), (Positions{1, 3}));
  EXPECT_EQ(given_all_rows.stats().decisions, 1);

  Harness given_last_row(1, 1, 1, tova(/*budget=*/2));
  given_last_row.feed(5, HeadRows{all_rows.back()});
  EXPECT_EQ(given_last_row.kept(), (Positions{1, 3}));
}

TEST(TovaPolicy, BudgetCoveringEveryTokenEvictsNothing) {
  Harness run(2, 2, 2, tova(/*budget=*/8));
  run.feed(5, HeadRows{{0.2f, 0.2f, 0.2f, 0.2f, 0.2f}});
  for (int t = 5; t < 8; ++t) {
    run.feed(1, HeadRows{std::vector<float>(static_cast<std::size_t>(t + 1), 1.0f / (t + 1))});
  }
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g) EXPECT_EQ(run.kept(l, g), (Positions{0, 1, 2, 3, 4, 5, 6, 7}));
  }
  EXPECT_EQ(run.stats().decisions, 0);
}

// 4 query heads, 2 KV heads: heads 0, 1 read KV head 0; heads 2, 3 read KV head 1. Last rows of a
// 3-token prefill, slots 0, 1, 2:
const HeadRows kHead0{{0.7f, 0.2f, 0.1f}};
const HeadRows kHead1{{0.6f, 0.3f, 0.1f}};
const HeadRows kHead2{{0.0f, 0.1f, 0.9f}};
const HeadRows kHead3{{0.1f, 0.2f, 0.7f}};

TEST(TovaPolicy, GqaLayerScoreIsTheMeanOverAllQueryHeadsWithOneKeepSetPerLayer) {
  // Layer 0, mean of the four heads: slot 0 (.7 + .6 + 0 + .1) / 4 = .35, slot 1 .8 / 4 = .2,
  // slot 2 1.8 / 4 = .45 -> budget 2 keeps {0, 2} in BOTH KV heads, although KV head 0's own
  // group would prefer {0, 1} and KV head 1's {1, 2}.
  // Layer 1, every head [.1 .5 .4] -> {1, 2}: each layer decides for itself.
  Harness run(2, 4, 2, tova(/*budget=*/2));
  run.feed(3,
           {LayerRows{kHead0, kHead1, kHead2, kHead3}, LayerRows(4, HeadRows{{0.1f, 0.5f, 0.4f}})});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 2}));
  EXPECT_EQ(run.kept(0, 1), (Positions{0, 2}));
  EXPECT_EQ(run.kept(1, 0), (Positions{1, 2}));
  EXPECT_EQ(run.kept(1, 1), (Positions{1, 2}));
  // Mean, not sum: the kept scores are .35 and .45, and every KV head carries the layer score.
  expect_scores_near(run.scores(0, 0), {0.35f, 0.45f});
  expect_scores_near(run.scores(0, 1), {0.35f, 0.45f});
}

TEST(TovaPolicy, HeadWiseGivesEachKvHeadItsOwnKeepSet) {
  Harness run(1, 4, 2, tova(/*budget=*/2, /*sinks=*/0, /*head_wise=*/true));
  // KV head 0 = mean(head 0, head 1) = [.65 .25 .1] -> {0, 1};
  // KV head 1 = mean(head 2, head 3) = [.05 .15 .8] -> {1, 2}.
  run.feed(3, {LayerRows{kHead0, kHead1, kHead2, kHead3}});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1}));
  EXPECT_EQ(run.kept(0, 1), (Positions{1, 2}));
  expect_scores_near(run.scores(0, 0), {0.65f, 0.25f});
  expect_scores_near(run.scores(0, 1), {0.15f, 0.8f});

  // Token 3: each query head's row covers its own KV head's slots.
  // KV head 0 over positions [0 1 3]: mean([.2 .3 .5], [.4 .2 .4]) = [.3 .25 .45] -> keeps 0, 3.
  // KV head 1 over positions [1 2 3]: mean([.1 .1 .8], [.3 .1 .6]) = [.2 .1 .7] -> keeps 1, 3.
  run.feed(1, {LayerRows{HeadRows{{0.2f, 0.3f, 0.5f}}, HeadRows{{0.4f, 0.2f, 0.4f}},
                         HeadRows{{0.1f, 0.1f, 0.8f}}, HeadRows{{0.3f, 0.1f, 0.6f}}}});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 3}));
  EXPECT_EQ(run.kept(0, 1), (Positions{1, 3}));
}

TEST(TovaPolicy, TiesGoToTheLowerPosition) {
  // Last row [.25 .5 .25]: slot 1 is kept, slots 0 and 2 tie (exactly) for the second place and
  // the lower position wins, so the newest token goes.
  Harness run(1, 1, 1, tova(/*budget=*/2));
  run.feed(3, HeadRows{{0.25f, 0.5f, 0.25f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1}));
}

TEST(TovaPolicy, TheNewestTokenIsDroppedWhenItScoresLeast) {
  // Nothing is protected (kvpress's TOVA always keeps the last token; the paper does not).
  Harness run(1, 1, 1, tova(/*budget=*/2));
  run.feed(2, HeadRows{{0.6f, 0.4f}});
  run.feed(1, HeadRows{{0.6f, 0.3f, 0.1f}});  // token 2 scores .1: dropped right after its forward
  EXPECT_EQ(run.kept(), (Positions{0, 1}));
  run.feed(1, HeadRows{{0.5f, 0.2f, 0.3f}});  // over [0 1 3]: position 1 (.2) goes
  EXPECT_EQ(run.kept(), (Positions{0, 3}));
}

TEST(TovaPolicy, SinksAreKeptInsideTheBudget) {
  // Budget 3. Token 3 attends [.05 .5 .3 .15] over positions [0 1 2 3].
  // sinks 0: top 3 = positions 1 (.5), 2 (.3), 3 (.15); position 0 (.05) goes.
  // sinks 1: position 0 is kept anyway and the top 3 - 1 = 2 of {1, 2, 3} fill the budget: 3 goes.
  Harness plain(1, 1, 1, tova(/*budget=*/3));
  Harness with_sink(1, 1, 1, tova(/*budget=*/3, /*sinks=*/1));
  for (Harness* run : {&plain, &with_sink}) {
    run->feed(3, HeadRows{{0.2f, 0.3f, 0.5f}});
    run->feed(1, HeadRows{{0.05f, 0.5f, 0.3f, 0.15f}});
  }
  EXPECT_EQ(plain.kept(), (Positions{1, 2, 3}));
  EXPECT_EQ(with_sink.kept(), (Positions{0, 1, 2}));
}

TEST(TovaPolicy, NanAttentionIsAnError) {
  Harness run(1, 1, 1, tova(/*budget=*/2));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { run.feed(3, HeadRows{{0.5f, nan, 0.5f}}); }, "NaN");
}

TEST(TovaPolicy, InvalidConfigurationsAreErrors) {
  expect_error([] { (void)kvevict::make_tova(TovaConfig{0}); },
               "tova: budget must be positive, got 0");
  expect_error(
      [] {
        (void)kvevict::make_tova(TovaConfig{4, -1});
      },
      "tova: sinks must be >= 0, got -1");
  expect_error(
      [] {
        (void)kvevict::make_tova(TovaConfig{4, 4});
      },
      "not larger than the protected set");
  expect_error(
      [] {
        (void)kvevict::make_tova(TovaConfig{4, 5});
      },
      "not larger than the protected set");
  expect_error([] { (void)kvevict::make_policy("tova", PolicyParams().set("sinks", 1)); },
               "policy 'tova': missing parameter 'budget'");
  expect_error(
      [] {
        (void)kvevict::make_policy("tova", PolicyParams().set("budget", 4).set("head_wise", 2));
      },
      "parameter 'head_wise' must be in [0, 1], got 2");
  expect_error(
      [] { (void)kvevict::make_policy("tova", PolicyParams().set("budget", 4).set("recent", 2)); },
      "unknown parameter 'recent'");
}

TEST(TovaPolicy, RegistryBuildsItWithTheReplayParameterNames) {
  const auto names = kvevict::policy_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "tova"), names.end());
  const auto policy = kvevict::make_policy("tova", PolicyParams().set("budget", 16));
  EXPECT_EQ(policy->name(), "tova");
  EXPECT_EQ(policy->retained_limit(), 16);
  EXPECT_TRUE(policy->signals().contains(kvevict::Signal::last_attention_row));
  EXPECT_FALSE(policy->signals().contains(kvevict::Signal::attention_rows));
  EXPECT_EQ(policy->default_position_mode(), kvevict::PositionMode::original);
  EXPECT_EQ(policy->default_granularity(), kvevict::Granularity::layer);  // TOVA-layer
  EXPECT_NE(dynamic_cast<const TovaPolicy*>(policy.get()), nullptr);      // no sinks: no decorator

  // Sinks are a ProtectOldest around TOVA with the rest of the budget; head_wise is TOVA-head.
  const auto head_wise = kvevict::make_policy(
      "tova", PolicyParams().set("budget", 16).set("sinks", 4).set("head_wise", 1));
  EXPECT_EQ(head_wise->retained_limit(), 16);
  EXPECT_EQ(head_wise->default_granularity(), kvevict::Granularity::head);
  const auto& sinks = dynamic_cast<const kvevict::ProtectOldest&>(*head_wise);
  EXPECT_EQ(sinks.count(), 4);
  EXPECT_EQ(sinks.inner().retained_limit(), 12);
}

TEST(TovaPolicy, LayerWiseKvHeadsShareOneKeepSet) {
  // Per layer, the KV heads of a layer are one decision unit: the same slots by construction, so
  // a keep-list can never be applied to a head holding other tokens.
  Harness run(2, 2, 2, tova(/*budget=*/2));
  EXPECT_EQ(run.sequence().slots().layout().units(), 2);
  EXPECT_EQ(run.sequence().unit_of(0, 0), run.sequence().unit_of(0, 1));
  EXPECT_NE(run.sequence().unit_of(0, 0), run.sequence().unit_of(1, 0));
}

}  // namespace
