// Block granularity (granularity.hpp, selection.hpp WorstCandidates::evict_blocks): one keep-set
// for the sequence, kept or evicted in whole blocks of B tokens by original position, as paged
// engines free memory. Every expected keep-set below is worked out in the comments from the rule:
//   - a unit may hold its protected tokens plus the rule's `keep` (the token form's bound);
//   - a block holding a protected token, and the newest block, are kept whole;
//   - other blocks go worst first (lowest mean score, ties: the later block; by recency: the
//     oldest) until the unit is within its bound.
#include <gtest/gtest.h>
#include <kvevict/c_api.h>

#include <cstdint>
#include <kvevict/engine.hpp>
#include <kvevict/error.hpp>
#include <kvevict/granularity.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/sirllm.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <kvevict/policies/tova.hpp>
#include <kvevict/policies/window.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::test::observe_attention;

using kvevict::Granularity;
using kvevict::PositionMode;
using kvevict::Sequence;
using kvevict::SequenceConfig;
using kvevict::test::expect_error;
using kvevict::test::Harness;
using kvevict::test::HeadRows;
using kvevict::test::Positions;

SequenceConfig one_head(Granularity granularity, PositionMode mode = PositionMode::original) {
  SequenceConfig config;
  config.layers = 1;
  config.q_heads = 1;
  config.kv_heads = 1;
  config.granularity = granularity;
  config.position_mode = mode;
  config.max_chunk = 8;
  return config;
}

// Feeds `count` tokens one forward each to a policy that reads no signal.
void feed_tokens(Sequence& sequence, int count) {
  for (int i = 0; i < count; ++i) {
    sequence.begin_chunk(std::vector<std::int32_t>{0});
    sequence.end_forward();
  }
}

Positions kept(const Sequence& sequence) {
  return kvevict::test::kept_positions(sequence.slots(), 0);
}

TEST(BlockGranularity, ParsesAndNamesBlocks) {
  EXPECT_EQ(kvevict::parse_granularity("block:16"), Granularity::blocks(16));
  EXPECT_EQ(kvevict::parse_granularity("block:16").block_tokens(), 16);
  EXPECT_EQ(kvevict::to_string(Granularity::blocks(32)), "block:32");
  EXPECT_EQ(Granularity::token.block_tokens(), 1);
  EXPECT_TRUE(Granularity::blocks(4).whole_sequence());
  EXPECT_FALSE(Granularity::layer.whole_sequence());
  for (const char* bad : {"block:", "block:0", "block:-4", "block:4x", "block:99999999999",
                          "block:65537", "blocks:4", "block 4"}) {
    expect_error([&] { (void)kvevict::parse_granularity(bad); }, "granularity");
  }
  // One unit for the whole model, as token.
  const kvevict::UnitLayout layout(3, 2, Granularity::blocks(8));
  EXPECT_EQ(layout.units(), 1);
  EXPECT_EQ(layout.unit_of(2, 1), 0);
  EXPECT_EQ(layout.layers_per_unit(), 3);
  EXPECT_EQ(layout.block_tokens(), 8);
}

TEST(BlockGranularity, WindowDropsTheOldestWholeBlockOncePerBlock) {
  // Window of 8, blocks of 4, cache_index. Tokens 0..7 fit. Token 8 makes 9 > 8: blocks
  // [0..3] [4..7] [8]; [8] is the newest, the oldest other block [0..3] goes: 5 tokens left.
  // Tokens 9..11 fill up to 8 again; token 12 makes 9: [4..7] goes. One decision per 4 tokens.
  Sequence sequence(one_head(Granularity::blocks(4), PositionMode::cache_index),
                    std::make_unique<kvevict::WindowPolicy>(kvevict::WindowConfig{8}));
  feed_tokens(sequence, 8);
  EXPECT_EQ(kept(sequence), (Positions{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(sequence.stats().decisions, 0);
  feed_tokens(sequence, 1);
  EXPECT_EQ(kept(sequence), (Positions{4, 5, 6, 7, 8}));
  // cache_index: the kept tokens are re-numbered 0..4.
  EXPECT_EQ(kvevict::test::rope_positions(sequence.slots(), 0), (Positions{0, 1, 2, 3, 4}));
  feed_tokens(sequence, 3);
  EXPECT_EQ(kept(sequence), (Positions{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(sequence.stats().decisions, 1);
  feed_tokens(sequence, 1);
  EXPECT_EQ(kept(sequence), (Positions{8, 9, 10, 11, 12}));
  EXPECT_EQ(sequence.stats().decisions, 2);
  EXPECT_EQ(sequence.stats().evicted_slots, 8);
}

TEST(BlockGranularity, SinksKeepTheirWholeBlock) {
  // StreamingLLM, 2 sinks + window 10 (bound 12), blocks of 4. At token 12: 13 tokens, blocks
  // [0..3] (holds the sinks: kept whole) [4..7] [8..11] [12] (newest); by recency [4..7] goes.
  Sequence sequence(one_head(Granularity::blocks(4), PositionMode::cache_index),
                    kvevict::make_streaming_llm(kvevict::StreamingLlmConfig{2, 10}));
  feed_tokens(sequence, 13);
  EXPECT_EQ(kept(sequence), (Positions{0, 1, 2, 3, 8, 9, 10, 11, 12}));
  // Four more reach 13 again at token 16: [8..11] goes, the sinks' block stays.
  feed_tokens(sequence, 4);
  EXPECT_EQ(kept(sequence), (Positions{0, 1, 2, 3, 12, 13, 14, 15, 16}));
}

TEST(BlockGranularity, H2oRanksBlocksByTheirMeanScore) {
  // H2O heavy 4 + recent 2 (bound 6), blocks of 2, one head. A 6-token prefill, column sums:
  //   q0 [1]                 -> s0 = 1
  //   q1 [1 0]               -> s0 = 2, s1 = 0
  //   q2 [0 0 1]             -> s2 = 1
  //   q3 [0 0 .5 .5]         -> s2 = 1.5, s3 = .5
  //   q4 [0 0 0 .5 .5]       -> s3 = 1, s4 = .5
  //   q5 [0 0 0 0 0 1]       -> s5 = 1
  Harness run(1, 1, 1, kvevict::make_h2o(kvevict::H2oConfig{4, 2}), Granularity::blocks(2));
  run.feed(6, HeadRows{{1.0f},
                       {1.0f, 0.0f},
                       {0.0f, 0.0f, 1.0f},
                       {0.0f, 0.0f, 0.5f, 0.5f},
                       {0.0f, 0.0f, 0.0f, 0.5f, 0.5f},
                       {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 2, 3, 4, 5}));
  // Token 6 attends [.1 0 .1 .1 .2 .2 .3]: s = 2.1 0 1.6 1.1 .7 1.2 .3, 7 tokens > 6. Recent =
  // positions 5, 6: block [4 5] and the newest [6] are kept. Candidates [0 1] (mean 1.05) and
  // [2 3] (mean 1.35): [0 1] goes, although position 0 has the highest score of all. (Per token,
  // H2O would drop position 1 alone.)
  run.feed(1, HeadRows{{0.1f, 0.0f, 0.1f, 0.1f, 0.2f, 0.2f, 0.3f}});
  EXPECT_EQ(run.kept(), (Positions{2, 3, 4, 5, 6}));
}

TEST(BlockGranularity, TovaTiesEvictTheLaterBlock) {
  // TOVA budget 4, blocks of 2, one head. A 5-token prefill whose last row is [.1 .3 .2 .2 .2]:
  // 5 > 4; blocks [0 1] (mean .2) [2 3] (mean .2) [4] (newest, kept). Equal means: the later block
  // goes, as the token form keeps the lower position among equals. (Per token, TOVA drops 0.)
  Harness run(1, 1, 1, kvevict::make_tova(kvevict::TovaConfig{.budget = 4}),
              Granularity::blocks(2));
  run.feed(5, HeadRows{{0.1f, 0.3f, 0.2f, 0.2f, 0.2f}});
  EXPECT_EQ(run.kept(), (Positions{0, 1, 4}));
}

// Over random streams, for every block-capable policy: a block older than the newest is either
// whole or gone after every decision, and the unit stays within the token form's bound.
TEST(BlockGranularity, BlocksLeaveWholeAndTheBoundHolds) {
  constexpr int kBlock = 4;
  const std::vector<std::string> policies = {"window", "streaming_llm", "h2o", "tova"};
  for (const std::string& name : policies) {
    for (const PositionMode mode : {PositionMode::original, PositionMode::cache_index}) {
      SCOPED_TRACE(name + " " + std::string(kvevict::to_string(mode)));
      std::unique_ptr<kvevict::Policy> policy =
          kvevict::make_policy(name, kvevict::budget_params(name, 24, 4));
      const int bound = *policy->retained_limit();
      SequenceConfig config = one_head(Granularity::blocks(kBlock), mode);
      config.q_heads = 2;
      Sequence sequence(config, std::move(policy));
      std::mt19937 random(7);
      std::uniform_int_distribution<int> chunk(1, 8);
      std::uniform_real_distribution<float> weight(0.0f, 1.0f);
      kvevict::test::SlotRows rows_for;
      for (int step = 0; step < 200; ++step) {
        const int n = chunk(random);
        sequence.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 0));
        if (sequence.wants(kvevict::Signal::attention_rows) ||
            sequence.wants(kvevict::Signal::last_attention_row)) {
          // n query rows over the live tokens, each normalised (a softmax row).
          const int live = sequence.slots().live(0);
          kvevict::test::HeadRows rows;
          for (int q = 0; q < n; ++q) {
            std::vector<float> row(static_cast<std::size_t>(live - n + q + 1));
            float sum = 0.0f;
            for (float& p : row) sum += (p = weight(random));
            for (float& p : row) p /= sum;
            rows.push_back(row);
          }
          observe_attention(sequence, 0,
                            rows_for.make(sequence, 0, kvevict::test::every_head(2, rows),
                                          sequence.stats().tokens_fed - n));
        }
        sequence.end_forward();

        const Positions live = kept(sequence);
        // Protected blocks (the sinks', the recent window's) may hold up to kBlock - 1 more each.
        EXPECT_LE(static_cast<int>(live.size()), bound + 2 * (kBlock - 1)) << "step " << step;
        const std::int64_t newest_block = live.back() / kBlock;
        std::vector<int> per_block(static_cast<std::size_t>(newest_block + 1), 0);
        for (const std::int64_t p : live) ++per_block[static_cast<std::size_t>(p / kBlock)];
        for (std::int64_t b = 0; b < newest_block; ++b) {
          const int held = per_block[static_cast<std::size_t>(b)];
          EXPECT_TRUE(held == 0 || held == kBlock) << "block " << b << " holds " << held;
        }
      }
      EXPECT_GT(sequence.stats().decisions, 0);
    }
  }
}

TEST(BlockGranularity, PoliciesWithoutABlockRuleSaySo) {
  kvevict::SirLlmConfig sirllm;
  sirllm.entropy = 8;
  sirllm.recent = 4;
  expect_error(
      [&] {
        Sequence sequence(one_head(Granularity::blocks(4)),
                          std::make_unique<kvevict::SirLlmPolicy>(sirllm));
      },
      "has no block form");
}

// The C API takes the same "block:B" and reports a bad one as an error with a message.
TEST(BlockGranularity, CApiTakesBlocks) {
  kvevict_config config;
  kvevict_config_init(&config);
  config.layers = 2;
  config.q_heads = 2;
  config.kv_heads = 1;
  config.granularity = "block:4";
  kvevict_sequence* sequence = nullptr;
  ASSERT_EQ(kvevict_sequence_create("window", "recent=8", &config, nullptr, &sequence), KVEVICT_OK)
      << kvevict_last_error();
  // As WindowDropsTheOldestWholeBlockOncePerBlock: 9 tokens leave 5, 13 leave 5 again.
  const std::int32_t token = 0;
  for (int i = 0; i < 13; ++i) {
    ASSERT_EQ(kvevict_sequence_begin_chunk(sequence, &token, 1, 0), KVEVICT_OK);
    ASSERT_EQ(kvevict_sequence_end_forward(sequence), KVEVICT_OK);
    if (i == 8) {
      EXPECT_EQ(kvevict_sequence_live(sequence, 1, 0), 5);
    }
  }
  EXPECT_EQ(kvevict_sequence_live(sequence, 0, 0), 5);
  kvevict_sequence_destroy(sequence);

  config.granularity = "block:four";
  sequence = nullptr;
  EXPECT_NE(kvevict_sequence_create("window", "recent=8", &config, nullptr, &sequence), KVEVICT_OK);
  EXPECT_EQ(sequence, nullptr);
  EXPECT_NE(std::string(kvevict_last_error()).find("block size"), std::string::npos)
      << kvevict_last_error();
}

}  // namespace
