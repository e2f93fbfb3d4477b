// SnapKV, PyramidKV, Ada-KV (policies/prompt_compression.hpp) and their allocations
// (allocation.hpp): keep-sets worked out by hand from the rules the papers and authors' code state
// (../shared/replay-format.md, "Prompt compression"). The votes are the sums of the prompt's last
// `window` attention rows over the prefix [0, N), N = P - window; they are pooled (avg: zeros
// outside, divided by the kernel; max: over the in-range neighbours) and each unit keeps its top
// k plus the window, once, after the prompt. Every expected value is derived in the comments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <kvevict/allocation.hpp>
#include <kvevict/error.hpp>
#include <kvevict/granularity.hpp>
#include <kvevict/policies/prompt_compression.hpp>
#include <kvevict/policy_registry.hpp>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::Allocation;
using kvevict::GqaLayout;
using kvevict::PolicyParams;
using kvevict::Pooling;
using kvevict::PromptCompressionConfig;
using kvevict::PromptCompressionPolicy;
using kvevict::test::expect_error;
using kvevict::test::Harness;
using kvevict::test::HeadRows;
using kvevict::test::LayerRows;
using kvevict::test::Positions;

std::unique_ptr<kvevict::Policy> compression(int capacity, int window, int kernel,
                                             Pooling pooling = Pooling::avg,
                                             Allocation allocation = Allocation::uniform,
                                             GqaLayout gqa = GqaLayout::repeat, int beta = 20,
                                             double floor = 0.2) {
  return std::make_unique<PromptCompressionPolicy>(
      PromptCompressionConfig{capacity, window, kernel, pooling, gqa, allocation, beta, floor});
}

// The rows of a P-token prompt: P - window decoy rows that put 0.9 on position min(1, i) (summed,
// as H2O would, they would make position 1 the heaviest token), then `window` given rows.
HeadRows prompt_rows(int prompt, const HeadRows& window_rows) {
  HeadRows rows;
  const int decoys = prompt - static_cast<int>(window_rows.size());
  for (int i = 0; i < decoys; ++i) {
    std::vector<float> row(static_cast<std::size_t>(i + 1), i == 0 ? 1.0f : 0.1f / i);
    if (i > 0) row[1] = 0.9f;
    rows.push_back(row);
  }
  for (const std::vector<float>& row : window_rows) rows.push_back(row);
  return rows;
}

// Rows of a later one-token forward over `live` tokens: uniform (never read).
HeadRows decode_row(int live) {
  return {std::vector<float>(static_cast<std::size_t>(live), 1.0f / static_cast<float>(live))};
}

TEST(SnapKv, KeepsTheWindowAndTheTopVotesOnceThenDecodeTokensAccumulate) {
  // P = 8, window 2, capacity 5, kernel 1 (pooling is the identity): N = 6, k = 3.
  // Votes = row 6 + row 7 over positions 0..5:
  //   row 6: .30 .05 .10 .20 .05 .10 | .20 0
  //   row 7: .05 .05 .35 .05 .10 .05 | .15 .20
  //   v    : .35 .10 .45 .25 .15 .15
  // Top 3: position 2 (.45), 0 (.35), 3 (.25), plus the window {6, 7}. Position 1, which every
  // earlier row favours, goes: only the window's rows vote.
  Harness run(1, 1, 1, compression(/*capacity=*/5, /*window=*/2, /*kernel=*/1));
  run.feed(8, prompt_rows(8, {{0.30f, 0.05f, 0.10f, 0.20f, 0.05f, 0.10f, 0.20f},
                              {0.05f, 0.05f, 0.35f, 0.05f, 0.10f, 0.05f, 0.15f, 0.20f}}));
  EXPECT_EQ(run.kept(), (Positions{0, 2, 3, 6, 7}));
  EXPECT_EQ(run.stats().decisions, 1);
  // Decode tokens, and a later multi-token chunk, only append (the authors' forwards).
  run.feed(1, decode_row(6));
  run.feed(1, decode_row(7));
  EXPECT_EQ(run.kept(), (Positions{0, 2, 3, 6, 7, 8, 9}));
  run.feed(3, HeadRows(3, std::vector<float>(10, 0.1f)));
  EXPECT_EQ(run.kept(), (Positions{0, 2, 3, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(run.stats().decisions, 1);
  EXPECT_EQ(run.positions(), run.kept());  // original positions
}

TEST(SnapKv, PromptAtOrBelowTheCapacityIsKeptWhole) {
  // P = 5 = capacity: the authors skip P < C, and at P = C their top-k keeps all N.
  Harness run(1, 1, 1, compression(/*capacity=*/5, /*window=*/2, /*kernel=*/1));
  run.feed(5, prompt_rows(5, {{0.5f, 0.1f, 0.1f, 0.2f}, {0.1f, 0.1f, 0.1f, 0.3f, 0.4f}}));
  EXPECT_EQ(run.kept(), (Positions{0, 1, 2, 3, 4}));
  EXPECT_EQ(run.stats().decisions, 0);
}

// Votes v = .40 .20 .02 .01 .25 .04 over positions 0..5 (P = 8, window 2: rows 6 and 7 each carry
// half of them), capacity 5: k = 3.
const HeadRows kPoolingWindow{{0.20f, 0.10f, 0.01f, 0.005f, 0.125f, 0.02f, 0.5f},
                              {0.20f, 0.10f, 0.01f, 0.005f, 0.125f, 0.02f, 0.3f, 0.2f}};

TEST(SnapKv, AvgPoolingCountsTheZeroPaddingAtTheEdges) {
  // kernel 3, divided by 3 everywhere, zeros outside [0, 6):
  //   p0 = (0 + .40 + .20) / 3 = .2000   p1 = (.40 + .20 + .02) / 3 = .2067
  //   p2 = (.20 + .02 + .01) / 3 = .0767 p3 = (.02 + .01 + .25) / 3 = .0933
  //   p4 = (.01 + .25 + .04) / 3 = .1000 p5 = (.25 + .04 + 0) / 3 = .0967
  // Top 3: 1, 0, 4. Dividing the edges by their in-range count instead would give
  // p5 = .29 / 2 = .145 and keep 5 in place of 4.
  Harness run(1, 1, 1, compression(/*capacity=*/5, /*window=*/2, /*kernel=*/3));
  run.feed(8, prompt_rows(8, kPoolingWindow));
  EXPECT_EQ(run.kept(), (Positions{0, 1, 4, 6, 7}));
  const std::vector<float> pooled = run.scores();  // kept tokens' pooled votes, then the window
  EXPECT_NEAR(pooled[0], 0.60f / 3, 1e-6);
  EXPECT_NEAR(pooled[1], 0.62f / 3, 1e-6);
  EXPECT_NEAR(pooled[2], 0.30f / 3, 1e-6);
}

TEST(SnapKv, MaxPoolingTakesTheLargestNeighbourAndTiesGoToTheLowerPosition) {
  // kernel 3, max over in-range neighbours:
  //   p0 = max(.40, .20) = .40  p1 = max(.40, .20, .02) = .40  p2 = max(.20, .02, .01) = .20
  //   p3 = max(.02, .01, .25) = .25  p4 = .25  p5 = max(.25, .04) = .25
  // Top 3: 0, 1, then three tokens tie at .25 for the last slot: the lowest position, 3, wins.
  Harness run(1, 1, 1, compression(/*capacity=*/5, /*window=*/2, /*kernel=*/3, Pooling::max));
  run.feed(8, prompt_rows(8, kPoolingWindow));
  EXPECT_EQ(run.kept(), (Positions{0, 1, 3, 6, 7}));
}

// One layer, 2 query heads (a GQA group of 2 over one KV head in the model). P = 6, window 2,
// capacity 3, kernel 1: N = 4, k = 1. Window rows (rows 4 and 5) per query head:
//   head 0 votes .50 .10 .10 .10 (row 4: .25 .05 .05 .05 | .6, row 5: .25 .05 .05 .05 | .3 .3)
//   head 1 votes .10 .10 .10 .60 (row 4: .05 .05 .05 .30 | .55, row 5: .05 .05 .05 .30 | .3 .25)
const HeadRows kHead0Window{{0.25f, 0.05f, 0.05f, 0.05f, 0.6f},
                            {0.25f, 0.05f, 0.05f, 0.05f, 0.3f, 0.3f}};
const HeadRows kHead1Window{{0.05f, 0.05f, 0.05f, 0.30f, 0.55f},
                            {0.05f, 0.05f, 0.05f, 0.30f, 0.3f, 0.25f}};

TEST(SnapKv, GqaRepeatKeepsOneSetPerQueryHeadInACacheOfQueryHeads) {
  // repeat: the cache lays out one head per query head (kv_heads = q_heads = 2); each keeps its own
  // top vote: head 0 position 0, head 1 position 3.
  auto policy = compression(3, 2, 1);
  EXPECT_EQ(kvevict::cached_kv_heads(*policy, /*q_heads=*/2, /*kv_heads=*/1), 2);
  Harness run(1, 2, 2, std::move(policy));
  run.feed(6, {LayerRows{prompt_rows(6, kHead0Window), prompt_rows(6, kHead1Window)}});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 4, 5}));
  EXPECT_EQ(run.kept(0, 1), (Positions{3, 4, 5}));
}

TEST(SnapKv, GqaMeanAveragesTheGroupsVotesIntoOneSetPerKvHead) {
  // mean: one KV head; votes (.50 + .10) / 2 = .30, .10, .10, (.10 + .60) / 2 = .35: position 3.
  auto policy = compression(3, 2, 1, Pooling::avg, Allocation::uniform, GqaLayout::mean);
  EXPECT_EQ(kvevict::cached_kv_heads(*policy, 2, 1), 1);
  Harness run(1, 2, 1, std::move(policy));
  run.feed(6, {LayerRows{prompt_rows(6, kHead0Window), prompt_rows(6, kHead1Window)}});
  EXPECT_EQ(run.kept(), (Positions{3, 4, 5}));
}

TEST(SnapKv, GqaRepeatOnACacheOfKvHeadsIsRefusedWhenTheSequenceIsBuilt) {
  // repeat keeps one set per query head, so its cache must hold one KV head per query head: a
  // sequence of 2 query heads over 1 KV head is refused before any forward.
  expect_error([] { Harness(1, 2, 1, compression(3, 2, 1)); },
               "snapkv: gqa = repeat keeps one set per query head, but the sequence caches 1 KV "
               "heads for 2 query heads: build it with kv_heads = q_heads");
  EXPECT_NO_THROW(Harness(1, 2, 1,
                          compression(3, 2, 1, Pooling::avg, Allocation::uniform,
                                      GqaLayout::mean)));  // one set per KV head
}

TEST(PyramidAllocation, BudgetsFollowTheArithmeticScheduleWithItsClampAndFlooredStep) {
  // 3 layers, mean 18, beta 4, 58 available: lo = 18 // 4 = 4, hi = 36 - 4 = 32 < 58,
  // step = (32 - 4) // 2 = 14: 32, 18, 4 (mean 18).
  EXPECT_EQ(kvevict::pyramid_budgets(3, 18, 4, 58), (std::vector<int>{32, 18, 4}));
  // Clamp: 2 layers, mean 16, beta 8, 29 available: lo = 2, hi = 30 >= 29, so hi = 29 and
  // lo = 32 - 29 = 3; step = 26: 29, 3.
  EXPECT_EQ(kvevict::pyramid_budgets(2, 16, 8, 29), (std::vector<int>{29, 3}));
  // Floored step: 4 layers, mean 16, beta 5: lo = 3, hi = 29, step = 26 // 3 = 8:
  // 29, 21, 13, 5, which sum to 68, not 4 * 16 = 64.
  EXPECT_EQ(kvevict::pyramid_budgets(4, 16, 5, 100), (std::vector<int>{29, 21, 13, 5}));
  expect_error([] { (void)kvevict::pyramid_budgets(1, 16, 5, 100); }, "at least 2 layers");
  expect_error([] { (void)kvevict::pyramid_budgets(2, 16, 0, 100); }, "beta");
  expect_error([] { (void)kvevict::pyramid_budgets(2, 16, 5, 10); }, "fewer than the mean");
}

TEST(PyramidKv, PromptLengthSelectsNoCompressionTheUniformBranchOrThePyramid) {
  // 2 layers, capacity 4, window 1 (b = 3), kernel 1, beta 20. The window is the last token; the
  // votes are its row. Row of the last token over a P = 8 prompt:
  //   .05 .10 .15 .20 .25 .02 .03 | .20
  const std::vector<float> last{0.05f, 0.10f, 0.15f, 0.20f, 0.25f, 0.02f, 0.03f, 0.20f};
  const auto pyramid = [] {
    return compression(4, 1, 1, Pooling::avg, Allocation::pyramid, GqaLayout::repeat, 20);
  };
  {  // P = 3 < C = 4: nothing happens.
    Harness run(2, 1, 1, pyramid());
    run.feed(3, prompt_rows(3, {{0.2f, 0.3f, 0.5f}}));
    EXPECT_EQ(run.kept(0), (Positions{0, 1, 2}));
    EXPECT_EQ(run.kept(1), (Positions{0, 1, 2}));
  }
  {  // P = 5: C <= 5 < 2b = 6, the uniform branch: both layers keep b = 3 of N = 4 + the window.
     // Row .05 .30 .15 .20 | .30: position 0 goes in both layers.
    Harness run(2, 1, 1, pyramid());
    run.feed(5, prompt_rows(5, {{0.05f, 0.30f, 0.15f, 0.20f, 0.30f}}));
    EXPECT_EQ(run.kept(0), (Positions{1, 2, 3, 4}));
    EXPECT_EQ(run.kept(1), (Positions{1, 2, 3, 4}));
  }
  {  // P = 8 >= 6: N = 7, lo = 3 // 20 = 0, hi = 6 - 0 = 6 < 7, step = 6 // 1 = 6: layer 0 keeps
     // 6 votes (all but the lowest, position 5 at .02), layer 1 keeps 0: only the window.
    Harness run(2, 1, 1, pyramid());
    run.feed(8, prompt_rows(8, {last}));
    EXPECT_EQ(run.kept(0), (Positions{0, 1, 2, 3, 4, 6, 7}));
    EXPECT_EQ(run.kept(1), (Positions{7}));
  }
}

TEST(AdaptiveAllocation, LayerWideTopKThenTheFloorMixRoundedHalfToEven) {
  using Scores = std::vector<std::vector<float>>;
  const auto budgets = [](const Scores& scores, int mean, double floor) {
    std::vector<std::span<const float>> spans(scores.begin(), scores.end());
    return kvevict::adaptive_budgets(spans, mean, floor);
  };
  // Two units, mean 3: the top 6 of the 10 scores are unit 0's .30 .25 .20 .15 and unit 1's .05
  // .04, so n = 4, 2. Floor 0: the budgets are n itself.
  const Scores uneven{{0.30f, 0.25f, 0.20f, 0.15f, 0.01f}, {0.05f, 0.04f, 0.03f, 0.02f, 0.012f}};
  EXPECT_EQ(budgets(uneven, 3, 0.0), (std::vector<int>{4, 2}));
  // Floor 0.5: f = int(0.5 * 3) = 1; 0.5 * 4 + 1 = 3, 0.5 * 2 + 1 = 2: 5 in all, not 6.
  EXPECT_EQ(budgets(uneven, 3, 0.5), (std::vector<int>{3, 2}));
  // Floor 1: every unit gets int(mean) whatever its share: the uniform budget.
  EXPECT_EQ(budgets(uneven, 3, 1.0), (std::vector<int>{3, 3}));
  // n = 3, 3 with floor 0.5: 1.5 + 1 = 2.5 rounds to even, 2 (half up would give 3).
  const Scores even{{0.9f, 0.8f, 0.7f, 0.05f}, {0.6f, 0.5f, 0.4f, 0.03f}};
  EXPECT_EQ(budgets(even, 3, 0.5), (std::vector<int>{2, 2}));
  // n = 5, 1 with floor 0.5: 3.5 -> 4 and 1.5 -> 2.
  const Scores lopsided{{0.9f, 0.8f, 0.7f, 0.6f, 0.55f}, {0.5f, 0.1f, 0.1f, 0.1f, 0.1f}};
  EXPECT_EQ(budgets(lopsided, 3, 0.5), (std::vector<int>{4, 2}));
  // Ties for the last of the 2 winning places (mean 1, two units; .9 wins the first) go to the
  // older token, then to the lower unit: .5 at index 1 of unit 0 against .5 at index 0 of unit 1
  // -> unit 1's is older, n = 1, 1; against .5 at index 1 of unit 1 -> unit 0, n = 2, 0.
  EXPECT_EQ(budgets(Scores{{0.9f, 0.5f}, {0.5f, 0.1f}}, 1, 0.0), (std::vector<int>{1, 1}));
  EXPECT_EQ(budgets(Scores{{0.9f, 0.5f}, {0.1f, 0.5f}}, 1, 0.0), (std::vector<int>{2, 0}));
  EXPECT_EQ(kvevict::round_half_even(0.5f), 0);
  EXPECT_EQ(kvevict::round_half_even(1.5f), 2);
  EXPECT_EQ(kvevict::round_half_even(2.5f), 2);
  EXPECT_EQ(kvevict::round_half_even(2.5001f), 3);
  EXPECT_EQ(kvevict::round_half_even(2.4999f), 2);
  expect_error([&] { (void)budgets(Scores{{0.1f, std::nanf("")}, {0.2f, 0.3f}}, 1, 0.0); }, "NaN");
  expect_error([&] { (void)budgets(uneven, 3, 1.5); }, "floor must be in [0, 1]");
}

TEST(AdaKv, HeadsOfALayerShareItsBudgetByTheirTopVotes) {
  // One layer, 2 heads (MHA), capacity 4, window 1: b = 3; P = 6, N = 5, kernel 1. The votes are
  // the last row of each head (the `uneven` scores above): head 0 .30 .25 .20 .15 .01, head 1 .05
  // .04 .03 .02 .012. Floor 0: n = 4, 2, so head 0 keeps positions 0-3, head 1 positions 0, 1;
  // both keep the window, position 5. Plain SnapKV would keep 3 in each.
  const HeadRows head0 = prompt_rows(6, {{0.30f, 0.25f, 0.20f, 0.15f, 0.01f, 0.09f}});
  const HeadRows head1 = prompt_rows(6, {{0.05f, 0.04f, 0.03f, 0.02f, 0.012f, 0.848f}});
  Harness adaptive(1, 2, 2,
                   compression(4, 1, 1, Pooling::avg, Allocation::adaptive, GqaLayout::repeat, 20,
                               /*floor=*/0.0));
  adaptive.feed(6, {LayerRows{head0, head1}});
  EXPECT_EQ(adaptive.kept(0, 0), (Positions{0, 1, 2, 3, 5}));
  EXPECT_EQ(adaptive.kept(0, 1), (Positions{0, 1, 5}));
  // Floor 0.5: budgets 3, 2.
  Harness floored(1, 2, 2,
                  compression(4, 1, 1, Pooling::avg, Allocation::adaptive, GqaLayout::repeat, 20,
                              /*floor=*/0.5));
  floored.feed(6, {LayerRows{head0, head1}});
  EXPECT_EQ(floored.kept(0, 0), (Positions{0, 1, 2, 5}));
  EXPECT_EQ(floored.kept(0, 1), (Positions{0, 1, 5}));
  Harness uniform(1, 2, 2, compression(4, 1, 1));
  uniform.feed(6, {LayerRows{head0, head1}});
  EXPECT_EQ(uniform.kept(0, 1), (Positions{0, 1, 2, 5}));
}

TEST(PromptCompression, RegistryEntriesAndTheBudgetMapping) {
  for (const char* name : {"snapkv", "pyramidkv", "adakv"}) {
    const auto policy = kvevict::make_policy(name, kvevict::budget_params(name, 64));
    EXPECT_EQ(policy->name(), name);
    EXPECT_FALSE(policy->retained_limit().has_value()) << name;  // decode tokens accumulate
    EXPECT_TRUE(policy->signals().contains(kvevict::Signal::attention_rows));
    EXPECT_EQ(policy->default_granularity(), kvevict::Granularity::head);
    const auto& config = dynamic_cast<const PromptCompressionPolicy&>(*policy).config();
    EXPECT_EQ(config.capacity, 64);
    EXPECT_EQ(config.window, 32);  // half the budget, at most the authors' 32
    EXPECT_EQ(config.kernel, 5);   // the code's defaults: kernel 5, avg pooling, repeat
    EXPECT_EQ(config.pooling, Pooling::avg);
    EXPECT_EQ(config.gqa, GqaLayout::repeat);
  }
  EXPECT_EQ(kvevict::budget_params("snapkv", 20).to_string(), "capacity=20 window=10");
  const auto words = PolicyParams::parse("capacity=24 window=6 pooling=max gqa=mean floor=0.25");
  EXPECT_EQ(words.get_word("pooling"), "max");
  const auto ada = kvevict::make_policy("adakv", words);
  const auto& config = dynamic_cast<const PromptCompressionPolicy&>(*ada).config();
  EXPECT_EQ(config.pooling, Pooling::max);
  EXPECT_EQ(config.gqa, GqaLayout::mean);
  EXPECT_DOUBLE_EQ(config.floor, 0.25);
  EXPECT_EQ(config.allocation, Allocation::adaptive);
}

TEST(PromptCompression, BadInputIsAClearError) {
  const auto make = [](const char* name, const char* params) {
    return [=] { (void)kvevict::make_policy(name, PolicyParams::parse(params)); };
  };
  expect_error(make("snapkv", "capacity=8 window=8"), "capacity 8 must be larger than window 8");
  expect_error(make("snapkv", "capacity=8 window=0"), "parameter 'window' must be in [1,");
  expect_error([] { (void)compression(8, 0, 1); }, "window must be at least 1");
  expect_error(make("snapkv", "capacity=8 window=2 kernel=4"), "kernel must be odd, got 4");
  expect_error(make("snapkv", "capacity=8 pooling=mean"),
               "parameter 'pooling' must be one of avg, max, got 'mean'");
  expect_error(make("snapkv", "capacity=8 gqa=sum"),
               "parameter 'gqa' must be one of repeat, mean, got 'sum'");
  expect_error(make("snapkv", "capacity=8 pooling=2"), "must be one of avg, max, got 2");
  expect_error(make("snapkv", "capacity=max"), "parameter 'capacity' has a malformed value 'max'");
  expect_error(make("pyramidkv", "capacity=8 window=2 beta=0"), "parameter 'beta' must be in [1,");
  expect_error(make("adakv", "capacity=8 window=2 floor=1.5"), "parameter 'floor' must be in [0,");
  expect_error([] { (void)PolicyParams::parse("pooling=m-ax"); }, "malformed value");

  // NaN attention never reaches the votes: the sequence refuses the rows, naming them.
  Harness nan_rows(1, 1, 1, compression(3, 1, 1));
  expect_error(
      [&] {
        nan_rows.feed(
            4, prompt_rows(4, {{0.1f, std::numeric_limits<float>::quiet_NaN(), 0.1f, 0.7f}}));
      },
      "is not an attention probability");
  // Sequences a policy cannot run on are refused when they are built, not at their first forward:
  // granularities an allocation cannot take and PyramidKV's division by layers - 1 (GQA: above).
  expect_error(
      [] {
        Harness(1, 2, 2, compression(3, 1, 1, Pooling::avg, Allocation::adaptive),
                kvevict::Granularity::layer);
      },
      "adakv: the heads of a layer share its budget, so it needs granularity head, not "
      "layer");
  expect_error(
      [] {
        Harness(2, 1, 1, compression(3, 1, 1, Pooling::avg, Allocation::pyramid),
                kvevict::Granularity::token);
      },
      "pyramidkv: its budgets are per layer");
  expect_error([] { Harness(1, 1, 1, compression(3, 1, 1, Pooling::avg, Allocation::pyramid)); },
               "pyramidkv: needs at least 2 layers");
}

TEST(SnapKv, CoarserUnitsAverageTheVotesOfEveryQueryHeadTheyCover) {
  // Per layer, 2 KV heads (MHA, so repeat and mean agree): the unit's votes are the mean of the two
  // heads' (.50 .10 .10 .10 and .10 .10 .10 .60 as above): .30 .10 .10 .35: position 3 in both.
  Harness run(1, 2, 2, compression(3, 2, 1), kvevict::Granularity::layer);
  run.feed(6, {LayerRows{prompt_rows(6, kHead0Window), prompt_rows(6, kHead1Window)}});
  EXPECT_EQ(run.kept(0, 0), (Positions{3, 4, 5}));
  EXPECT_EQ(run.kept(0, 1), (Positions{3, 4, 5}));
}

}  // namespace

// kvpress's decoding re-compression (`interval`): every `interval` tokens after the prompt, each
// unit goes back to its share from the votes of the stream's last `window` queries.
std::unique_ptr<kvevict::Policy> recompressing(int capacity, int window, int interval,
                                               Allocation allocation = Allocation::uniform,
                                               double floor = 0.2) {
  PromptCompressionConfig config{capacity,          window,     1,  Pooling::avg,
                                 GqaLayout::repeat, allocation, 20, floor};
  config.interval = interval;
  return std::make_unique<PromptCompressionPolicy>(config);
}

TEST(SnapKv, IntervalRecompressesFromTheLastWindowQueriesAcrossForwards) {
  // Capacity 4, window 2 (b = 2), kernel 1, interval 2. A 4-token prompt is kept whole (P <= C).
  Harness run(1, 1, 1, recompressing(/*capacity=*/4, /*window=*/2, /*interval=*/2));
  run.feed(4, prompt_rows(4, {{0.5f, 0.5f, 0.0f}, {0.25f, 0.25f, 0.25f, 0.25f}}));
  EXPECT_EQ(run.kept(), (Positions{0, 1, 2, 3}));
  // Two tokens (4, 5) in one forward: 2 tokens since the prompt, a re-compression. Window {4, 5};
  // the votes over positions 0..3 are the rows of queries 4 and 5:
  //   q4: .10 .40 .05 .30 | .15        q5: .05 .30 .10 .05 | .20 .30
  //   v : .15 .70 .15 .35  -> the top b = 2 are positions 1 (.70) and 3 (.35).
  run.feed(
      2, HeadRows{{0.10f, 0.40f, 0.05f, 0.30f, 0.15f}, {0.05f, 0.30f, 0.10f, 0.05f, 0.20f, 0.30f}});
  EXPECT_EQ(run.kept(), (Positions{1, 3, 4, 5}));
  // One token (6): 1 since the last re-compression, below the interval: it only appends, and the
  // unit holds C + interval - 1 = 5, the retained limit.
  run.feed(1, HeadRows{{0.30f, 0.05f, 0.25f, 0.10f, 0.30f}});
  EXPECT_EQ(run.kept(), (Positions{1, 3, 4, 5, 6}));
  ASSERT_TRUE(run.sequence().policy().retained_limit().has_value());
  EXPECT_EQ(*run.sequence().policy().retained_limit(), 5);
  // Token 7: a re-compression. The last 2 queries are 6 (the previous forward) and 7; queries 4
  // and 5 no longer vote. Window {6, 7}, prefix {1, 3, 4, 5}:
  //   q6: .30 .05 .25 .10 | .30        q7: .10 .05 .30 .05 | .20 .30
  //   v : .40 .10 .55 .15  -> positions 4 (.55) and 1 (.40).
  run.feed(1, HeadRows{{0.10f, 0.05f, 0.30f, 0.05f, 0.20f, 0.30f}});
  EXPECT_EQ(run.kept(), (Positions{1, 4, 6, 7}));
  EXPECT_EQ(run.stats().decisions, 2);
}

TEST(PyramidKv, IntervalRecompressesToTheScheduleThatFitsTheBudget) {
  // 2 layers, capacity 4, window 1 (b = 3), beta 20, interval 1: pyramid_budgets_within(2, 3, 20)
  // = lo 0, hi 6, step 6: {6, 0} (sum 6 = 2 b). Layer 0 keeps up to 6 votes, layer 1 only the
  // window. A 2-token prompt is kept whole (P < C).
  Harness run(2, 1, 1, recompressing(4, 1, 1, Allocation::pyramid));
  run.feed(2, prompt_rows(2, {{0.5f, 0.5f}}));
  // Token 2: layer 0 has a prefix of 2 <= 6 and keeps it; layer 1 keeps its window.
  run.feed(1, HeadRows{{0.2f, 0.3f, 0.5f}});
  EXPECT_EQ(run.kept(0), (Positions{0, 1, 2}));
  EXPECT_EQ(run.kept(1), (Positions{2}));
  // Retained limit: 2 b - b // beta + window + interval - 1 = 6 - 0 + 1 + 0 = 7.
  EXPECT_EQ(run.sequence().policy().retained_limit().value_or(-1), 7);
}

TEST(AdaKv, IntervalRecompressionSharesTheLayerWithTheFloorFirst) {
  // One layer, 2 heads, capacity 3, window 1 (b = 2, the layer's 2 b = 4 votes), floor 0, interval
  // 1. A 2-token prompt is not compressed (b <= P - w fails: 2 > 1).
  Harness run(1, 2, 2, recompressing(3, 1, 1, Allocation::adaptive, /*floor=*/0.0));
  run.feed(2, prompt_rows(2, {{0.5f, 0.5f}}));
  // Token 2: 2 candidates per head, 4 in all: everything fits.
  run.feed(1, HeadRows{{0.3f, 0.3f, 0.4f}});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1, 2}));
  EXPECT_EQ(run.kept(0, 1), (Positions{0, 1, 2}));
  // Token 3, the votes are q3's rows over positions 0..2:
  //   head 0: .40 .30 .20 | .10     head 1: .05 .25 .10 | .60
  // The layer's top 4: .40 .30 .25 .20 -> head 0 keeps 0, 1, 2; head 1 keeps 1.
  run.feed(1, {LayerRows{HeadRows{{0.40f, 0.30f, 0.20f, 0.10f}},
                         HeadRows{{0.05f, 0.25f, 0.10f, 0.60f}}}});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1, 2, 3}));
  EXPECT_EQ(run.kept(0, 1), (Positions{1, 3}));
  // Token 4. Head 0 over {0, 1, 2, 3 | 4}: .10 .10 .10 .50 | .20; head 1 over {1, 3 | 4}: .30 .30 |
  // .40. Top 4: .50 (head 0, position 3), both of head 1's .30, then one .10 of head 0: the oldest
  // candidate, position 0. Head 0 keeps {0, 3, 4}, head 1 {1, 3, 4}: 4 votes + 2 windows.
  run.feed(1, {LayerRows{HeadRows{{0.10f, 0.10f, 0.10f, 0.50f, 0.20f}},
                         HeadRows{{0.30f, 0.30f, 0.40f}}}});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 3, 4}));
  EXPECT_EQ(run.kept(0, 1), (Positions{1, 3, 4}));
  // Its share depends on the heads of a layer: no retained limit.
  EXPECT_FALSE(run.sequence().policy().retained_limit().has_value());
}

TEST(PromptCompression, IntervalIsARegistryParameterAndNegativeIsAnError) {
  const auto policy =
      kvevict::make_policy("snapkv", PolicyParams::parse("capacity=8 window=4 interval=16"));
  EXPECT_EQ(dynamic_cast<const PromptCompressionPolicy&>(*policy).config().interval, 16);
  EXPECT_EQ(policy->retained_limit().value_or(-1), 8 + 15);
  // interval 0 (the default): the authors' one-shot form, unbounded.
  EXPECT_FALSE(kvevict::make_policy("snapkv", PolicyParams::parse("capacity=8 window=4"))
                   ->retained_limit()
                   .has_value());
  expect_error([] { (void)recompressing(4, 2, -1); }, "interval must be >= 0");
  expect_error(
      [] {
        (void)kvevict::make_policy("adakv", PolicyParams::parse("capacity=8 window=4 interval=-1"));
      },
      "interval");
}
