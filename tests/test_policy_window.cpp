// Window, StreamingLLM and Full: hand-computed keep-sets (docs/policies.md), the S + R + 1
// attention span of the per-token path, positions, and configuration errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "support/policy_harness.hpp"

namespace {

using kvevict::PolicyParams;
using kvevict::Sequence;
using kvevict::SequenceConfig;

Sequence sequence(int layers, int kv_heads, std::unique_ptr<kvevict::Policy> policy,
                  std::optional<kvevict::PositionMode> mode = std::nullopt) {
  SequenceConfig config;
  config.layers = layers;
  config.q_heads = kv_heads;
  config.kv_heads = kv_heads;
  config.max_chunk = 32;
  config.position_mode = mode;
  return Sequence(config, std::move(policy));
}

std::vector<std::int64_t> kept(const Sequence& s, int l = 0, int g = 0) {
  return kvevict::test::kept_positions(s.slots(), s.unit_of(l, g));
}
std::vector<std::int64_t> positions(const Sequence& s, int l = 0, int g = 0) {
  return kvevict::test::rope_positions(s.slots(), s.unit_of(l, g));
}
std::vector<std::int64_t> range(std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(end - begin));
  std::iota(out.begin(), out.end(), begin);
  return out;
}

// Feeds one forward of `n` tokens; returns the largest live count seen during the forward (the
// number of keys the chunk's last query attends to).
int feed(Sequence& s, int n) {
  const std::vector<std::int32_t> ids(static_cast<std::size_t>(n), 7);
  s.begin_chunk(ids);
  const int attended = s.slots().max_live();
  s.end_forward();
  return attended;
}

TEST(WindowPolicy, KeepsTheLastRTokensAfterEveryForward) {
  Sequence s = sequence(2, 2, kvevict::make_policy("window", PolicyParams().set("recent", 3)));
  for (int t = 0; t < 10; ++t) feed(s, 1);
  // After token 9: the last three tokens, in every layer and head.
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g) EXPECT_EQ(kept(s, l, g), (std::vector<std::int64_t>{7, 8, 9}));
  }
  EXPECT_EQ(positions(s), (std::vector<std::int64_t>{0, 1, 2}));  // cache_index by default
  EXPECT_EQ(s.stats().evicted_slots, 7 * 4);                      // 7 tokens x 4 heads
}

TEST(WindowPolicy, TrimsAMultiTokenChunkAfterItsForward) {
  Sequence s = sequence(1, 1, kvevict::make_policy("window", PolicyParams().set("recent", 4)));
  EXPECT_EQ(feed(s, 3), 3);    // nothing to trim
  EXPECT_EQ(feed(s, 10), 13);  // the chunk attends to all 13 before the trim
  EXPECT_EQ(kept(s), range(9, 13));
}

TEST(StreamingLlmPolicy, KeepsSinksAndRecentWindow) {
  Sequence s = sequence(
      1, 2, kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 2).set("recent", 3)));
  for (int t = 0; t < 10; ++t) feed(s, 1);
  // Sinks {0, 1} plus the last three of 0..9.
  EXPECT_EQ(kept(s, 0, 0), (std::vector<std::int64_t>{0, 1, 7, 8, 9}));
  EXPECT_EQ(kept(s, 0, 1), (std::vector<std::int64_t>{0, 1, 7, 8, 9}));
  // cache_index: the survivors slid down to 0..4; the next token will sit at 5.
  EXPECT_EQ(positions(s), range(0, 5));
}

// Per-token path: trim after the forward, so every steady step attends to S + R + 1 keys.
TEST(StreamingLlmPolicy, PerTokenStepsAttendToSPlusRPlusOneKeys) {
  const int sinks = 4, recent = 8;
  Sequence s =
      sequence(1, 1,
               kvevict::make_policy("streaming_llm",
                                    PolicyParams().set("sinks", sinks).set("recent", recent)));
  for (int t = 0; t < 40; ++t) {
    const int attended = feed(s, 1);
    EXPECT_EQ(attended, std::min(t + 1, sinks + recent + 1)) << "token " << t;
    EXPECT_LE(s.live(0, 0), sinks + recent);
  }
  EXPECT_EQ(kept(s), (std::vector<std::int64_t>{0, 1, 2, 3, 32, 33, 34, 35, 36, 37, 38, 39}));
}

TEST(StreamingLlmPolicy, PrefillLongerThanTheBudgetIsCutAfterItsForward) {
  Sequence s = sequence(
      1, 1, kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 8)));
  EXPECT_EQ(feed(s, 24), 24);
  std::vector<std::int64_t> expected = range(0, 4);
  for (std::int64_t p : range(16, 24)) expected.push_back(p);
  EXPECT_EQ(kept(s), expected);
}

TEST(StreamingLlmPolicy, OriginalPositionModeKeepsPositions) {
  Sequence s = sequence(
      1, 1, kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 1).set("recent", 2)),
      kvevict::PositionMode::original);
  for (int t = 0; t < 6; ++t) feed(s, 1);
  EXPECT_EQ(kept(s), (std::vector<std::int64_t>{0, 4, 5}));
  EXPECT_EQ(positions(s), (std::vector<std::int64_t>{0, 4, 5}));
}

TEST(StreamingLlmPolicy, BudgetAtLeastTheStreamEvictsNothing) {
  Sequence s = sequence(
      1, 1,
      kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 28)));
  for (int t = 0; t < 32; ++t) feed(s, 1);
  EXPECT_EQ(kept(s), range(0, 32));
  EXPECT_EQ(s.stats().decisions, 0);
}

TEST(FullPolicy, NeverEvicts) {
  Sequence s = sequence(1, 1, kvevict::make_policy("full", PolicyParams()));
  for (int t = 0; t < 5; ++t) feed(s, 7);
  EXPECT_EQ(kept(s), range(0, 35));
  EXPECT_EQ(positions(s), range(0, 35));  // original positions
}

TEST(PolicyRegistry, ClearErrorsForBadConfigurations) {
  const auto expect_error = [](const std::string& name, const PolicyParams& params,
                               const std::string& fragment) {
    try {
      (void)kvevict::make_policy(name, params);
      ADD_FAILURE() << name << ": expected kvevict::Error containing '" << fragment << "'";
    } catch (const kvevict::Error& error) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
    }
  };
  expect_error("window", PolicyParams().set("recent", 0), "parameter 'recent' must be in [1, ");
  expect_error("window", PolicyParams(), "policy 'window': missing parameter 'recent'");
  expect_error("window", PolicyParams().set("recent", 2.5), "must be an integer");
  expect_error("window", PolicyParams().set("recent", 4).set("recnet", 4),
               "unknown parameter 'recnet'");
  // A budget of sinks only: no room for the recent window the policy protects.
  expect_error("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 0),
               "parameter 'recent' must be in [1, ");
  expect_error("streaming_llm", PolicyParams().set("sinks", -1).set("recent", 4),
               "parameter 'sinks' must be in [0, ");
  expect_error("lru", PolicyParams(), "unknown policy 'lru'");
}

}  // namespace
