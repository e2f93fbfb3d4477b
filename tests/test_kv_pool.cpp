// KvPool (kvevict/kv_pool.hpp): the grant rule on hand-worked claims, the pressed keep rule of the
// budget policies (their own ranking, protected tokens kept), admission and feeding errors, and
// sixteen sequences in a pool that holds four at full length.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/expect_error.hpp"

namespace {

using kvevict::KvPool;
using kvevict::PoolClaim;
using kvevict::Sequence;
using kvevict::SequenceConfig;
using kvevict::test::expect_error;

SequenceConfig one_head(int max_chunk) {
  SequenceConfig config;
  config.layers = 1;
  config.q_heads = 1;
  config.kv_heads = 1;
  config.max_chunk = max_chunk;
  config.granularity = kvevict::Granularity::token;
  return config;
}

std::unique_ptr<Sequence> make_sequence(std::string_view policy, int budget, int max_chunk = 1) {
  return std::make_unique<Sequence>(
      one_head(max_chunk), kvevict::make_policy(policy, kvevict::budget_params(policy, budget, 0)));
}

// Original positions live in the sequence's one unit, ascending.
std::vector<std::int64_t> kept(const Sequence& sequence) {
  const kvevict::SlotTable& slots = sequence.slots();
  std::vector<std::int64_t> originals;
  for (const std::int32_t slot : slots.stream_order(0)) {
    originals.push_back(slots.original_positions(0)[static_cast<std::size_t>(slot)]);
  }
  return originals;
}

// One forward of `tokens` tokens, with uniform attention rows over each query's causal past when
// the policy reads attention.
void step(Sequence& sequence, int tokens) {
  const std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens), 7);
  sequence.begin_chunk(ids);
  if (sequence.wants_attention()) {
    const int queries = sequence.attention_queries();
    const int limit = sequence.slot_limit(0, 0);
    const std::span<const std::int32_t> chunk = sequence.chunk_slots(0, 0);
    std::vector<float> rows(static_cast<std::size_t>(queries * limit), 0.0f);
    for (int q = 0; q < queries; ++q) {
      // Query q is chunk token tokens - queries + q: it sees every live slot but the chunk's later
      // tokens.
      const int token = tokens - queries + q;
      std::vector<std::int32_t> seen;
      for (const std::int32_t slot : sequence.slots().stream_order(0)) seen.push_back(slot);
      for (int later = token + 1; later < tokens; ++later) {
        seen.erase(std::find(seen.begin(), seen.end(), chunk[static_cast<std::size_t>(later)]));
      }
      for (const std::int32_t slot : seen) {
        rows[static_cast<std::size_t>(q * limit + slot)] = 1.0f / static_cast<float>(seen.size());
      }
    }
    sequence.observe_attention(0, rows.data(), queries, limit);
  }
  sequence.end_forward();
}

// --- the grant rule
// -------------------------------------------------------------------------------

TEST(PoolGrants, NoPressureGrantsWhatIsHeld) {
  const std::vector<PoolClaim> claims{{30, 1, 4, true}, {20, 1, 4, true}};
  EXPECT_EQ(kvevict::pool_grants(100, claims), (std::vector<std::int64_t>{30, 20}));
}

TEST(PoolGrants, OnlyTheMemberOverTheLevelIsCut) {
  // 100 + 10 held, 2 incoming, pool 100: 98 may be kept. At level L >= 10 the two keep L + 10,
  // so L = 88; the small member keeps everything.
  const std::vector<PoolClaim> claims{{100, 1, 4, true}, {10, 1, 4, true}};
  EXPECT_EQ(kvevict::pool_grants(100, claims), (std::vector<std::int64_t>{88, 10}));
}

TEST(PoolGrants, LeftoverCellsGoToTheLowestMembers) {
  // 3 x 40 held, 3 incoming, pool 100: 97 kept; 3L <= 97 gives L = 32 with one cell left.
  const std::vector<PoolClaim> claims{{40, 1, 5, true}, {40, 1, 5, true}, {40, 1, 5, true}};
  EXPECT_EQ(kvevict::pool_grants(100, claims), (std::vector<std::int64_t>{33, 32, 32}));
}

TEST(PoolGrants, NoMemberGoesBelowItsMinimum) {
  // kept(L) = clamp(L, 45, 50) + clamp(L, 5, 50) <= 60: L = 15 (45 + 15).
  const std::vector<PoolClaim> claims{{50, 0, 45, true}, {50, 0, 5, true}};
  EXPECT_EQ(kvevict::pool_grants(60, claims), (std::vector<std::int64_t>{45, 15}));
}

TEST(PoolGrants, FixedReservationsAreNeverCut) {
  // 30 reserved, 2 incoming: 70 - 30 - 2 = 38 for the pressable member.
  const std::vector<PoolClaim> claims{{30, 0, 0, false}, {50, 2, 1, true}};
  EXPECT_EQ(kvevict::pool_grants(70, claims), (std::vector<std::int64_t>{30, 38}));
}

TEST(PoolGrants, MinimumsThatDoNotFitAreAnError) {
  const std::vector<PoolClaim> claims{{50, 1, 40, true}, {50, 1, 40, true}};
  expect_error([&] { (void)kvevict::pool_grants(70, claims); }, "even with every member cut");
}

// --- the pressed keep rule
// ------------------------------------------------------------------------

TEST(PoolPressure, H2oIsCutByItsAccumulatedAttentionKeepingItsRecentWindow) {
  // H2O with heavy 4, recent 2 (budget 6) over one prompt of 6 tokens, whose attention sums to
  // t0 2.0, t1 1.35, t2 1.25, t3 0.9 (columns of the rows below): the budget holds all six.
  Sequence sequence(one_head(6), kvevict::make_h2o({4, 2}));
  const std::vector<std::int32_t> ids(6, 1);
  sequence.begin_chunk(ids);
  const int limit = sequence.slot_limit(0, 0);
  ASSERT_EQ(limit, 6);
  const std::vector<float> rows{
      1.0f, 0,     0,     0,    0,    0,     //
      0.2f, 0.8f,  0,     0,    0,    0,     //
      0.1f, 0.1f,  0.8f,  0,    0,    0,     //
      0.5f, 0.1f,  0.1f,  0.3f, 0,    0,     //
      0.1f, 0.25f, 0.25f, 0.1f, 0.3f, 0,     //
      0.1f, 0.1f,  0.1f,  0.5f, 0.1f, 0.1f,  //
  };
  sequence.observe_attention(0, rows.data(), 6, limit);
  sequence.end_forward();
  ASSERT_EQ(kept(sequence), (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
  // Pressed to 4: the recent t4, t5 stay, and of t0..t3 the two best by attention (t0, t1), where
  // a window would have kept t2, t3.
  sequence.shrink_to(4);
  EXPECT_EQ(kept(sequence), (std::vector<std::int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(sequence.stats().pressure_evicted_slots, 2);
  // Pressed below its protected window, it keeps the window (min_retained).
  EXPECT_EQ(sequence.policy().min_retained(), 2);
  sequence.shrink_to(1);
  EXPECT_EQ(kept(sequence), (std::vector<std::int64_t>{4, 5}));
}

TEST(PoolPressure, StreamingLlmKeepsItsSinksAndTheNewest) {
  // sinks 2, recent 6 over 8 tokens: pressed to 5, the sinks and the 3 newest remain.
  Sequence sequence(one_head(8), kvevict::make_streaming_llm({2, 6}));
  step(sequence, 8);
  sequence.shrink_to(5);
  EXPECT_EQ(kept(sequence), (std::vector<std::int64_t>{0, 1, 5, 6, 7}));
  EXPECT_EQ(sequence.policy().min_retained(), 2);
}

TEST(PoolPressure, PoliciesWithoutAPressedFormRefuseIt) {
  Sequence sequence(one_head(1),
                    kvevict::make_policy("sirllm", kvevict::budget_params("sirllm", 8, 0)));
  expect_error([&] { sequence.shrink_to(4); }, "no keep rule that evicts below its own budget");
}

TEST(PoolPressure, ShrinkingInsideAForwardIsRefused) {
  auto sequence = make_sequence("window", 8);
  const std::vector<std::int32_t> ids{1};
  sequence->begin_chunk(ids);
  expect_error([&] { sequence->shrink_to(0); }, "end the forward");
}

// --- admission and feeding
// ------------------------------------------------------------------------

TEST(KvPool, ChargesMinimumsAndRefusesWhatCanNeverFit) {
  KvPool pool(10);
  // h2o heavy 4 + recent 4, chunk 1: minimum 4 (its window), charge 5.
  auto a = std::make_unique<Sequence>(one_head(1), kvevict::make_h2o({4, 4}));
  auto b = std::make_unique<Sequence>(one_head(1), kvevict::make_h2o({4, 4}));
  auto c = std::make_unique<Sequence>(one_head(1), kvevict::make_h2o({4, 4}));
  EXPECT_EQ(pool.join(*a), 0);
  EXPECT_EQ(pool.minimum(0), 4);
  EXPECT_EQ(pool.join(*b), 1);
  EXPECT_EQ(pool.charged(), 10);
  expect_error([&] { (void)pool.join(*c); }, "can never give up");
  // A budget beyond the pool: 20 + 1 > 10.
  auto wide = make_sequence("window", 20);
  expect_error([&] { (void)pool.join(*wide); }, "can never grant it");
  // No bound and no pressed form.
  Sequence full(one_head(1), kvevict::make_policy("full"));
  expect_error([&] { (void)pool.join(full); }, "no bound");
  // A sequence joins once, and between forwards.
  expect_error([&] { (void)pool.join(*b); }, "a member already");
  auto open_forward = make_sequence("window", 4);
  const std::vector<std::int32_t> one{1};
  open_forward->begin_chunk(one);
  expect_error([&] { (void)pool.join(*open_forward); }, "inside a forward");
  // A member that left frees its charge and its id.
  pool.leave(0);
  EXPECT_EQ(pool.charged(), 5);
  EXPECT_EQ(pool.join(*c), 0);
}

TEST(KvPool, FixedMembersAreChargedTheirBoundPlusAChunk) {
  KvPool pool(30);
  auto sirllm = std::make_unique<Sequence>(
      one_head(2), kvevict::make_policy("sirllm", kvevict::budget_params("sirllm", 12, 0)));
  ASSERT_TRUE(sirllm->policy().retained_limit().has_value());
  const int bound = *sirllm->policy().retained_limit();
  (void)pool.join(*sirllm);
  EXPECT_EQ(pool.charged(), bound + 2);
}

TEST(KvPool, BadFeedsAreRefusedAndChangeNothing) {
  KvPool pool(20);
  auto a = make_sequence("window", 8, 2);
  auto b = make_sequence("window", 8, 2);
  (void)pool.join(*a);
  (void)pool.join(*b);
  using Feed = KvPool::Feed;
  const std::vector<Feed> unknown{{5, 1}};
  expect_error([&] { pool.make_room(unknown); }, "member 5 is not in the pool");
  const std::vector<Feed> too_many{{0, 3}};
  expect_error([&] { pool.make_room(too_many); }, "outside [0, 2]");
  const std::vector<Feed> twice{{1, 1}, {1, 1}};
  expect_error([&] { pool.make_room(twice); }, "fed twice");
  pool.leave(1);
  const std::vector<Feed> closed{{1, 1}};
  expect_error([&] { pool.make_room(closed); }, "member 1 is not in the pool");
  EXPECT_EQ(pool.stats().steps, 0);
  // The other member is unaffected.
  const std::vector<Feed> fine{{0, 2}};
  pool.make_room(fine);
  step(*a, 2);
  EXPECT_EQ(a->max_live(), 2);
}

TEST(KvPool, ThreeWindowsShareTwelveCellsEvenly) {
  // Window 8, one token per step each, pool 12: steps 1-4 fit (3k cells at step k); from step 5
  // each holds 4 before the step, 12 + 3 > 12, so every member is cut to L = 3 and fed back to 4.
  KvPool pool(12);
  std::vector<std::unique_ptr<Sequence>> sequences;
  std::vector<KvPool::Feed> feeds;
  for (int i = 0; i < 3; ++i) {
    sequences.push_back(make_sequence("window", 8));
    feeds.push_back({pool.join(*sequences.back()), 1});
  }
  for (int k = 1; k <= 20; ++k) {
    pool.make_room(feeds);
    for (auto& sequence : sequences) step(*sequence, 1);
  }
  for (auto& sequence : sequences) {
    EXPECT_EQ(kept(*sequence), (std::vector<std::int64_t>{16, 17, 18, 19}));
  }
  EXPECT_EQ(pool.stats().peak_cells, 12);
  EXPECT_EQ(pool.stats().pressed_steps, 16);  // steps 5 to 20
}

TEST(KvPool, SixteenGrowingSequencesInAPoolForFour) {
  // Budget 32 and chunks of up to 4: a sequence at full length needs 36 cells; the pool holds 4.
  constexpr int kBudget = 32;
  constexpr int kChunk = 4;
  constexpr std::int64_t kCells = 4 * (kBudget + kChunk);
  // Charges (minimum + chunk): window 1 + 4, streaming_llm (4 sinks) 4 + 4, h2o (recent 8)
  // 8 + 4, tova 1 + 4; 120 of the 144 cells for the sixteen.
  const char* const policies[] = {"window", "streaming_llm", "tova"};
  KvPool pool(kCells);
  std::vector<std::unique_ptr<Sequence>> sequences;
  for (int i = 0; i < 16; ++i) {
    std::unique_ptr<kvevict::Policy> policy =
        i % 4 == 3 ? kvevict::make_h2o({kBudget - 8, 8})
                   : kvevict::make_policy(policies[i % 4],
                                          kvevict::budget_params(policies[i % 4], kBudget, 4));
    sequences.push_back(std::make_unique<Sequence>(one_head(kChunk), std::move(policy)));
    ASSERT_EQ(pool.join(*sequences.back()), i);
  }
  EXPECT_EQ(pool.charged(), 120);
  std::mt19937 rng(27);
  std::vector<KvPool::Feed> feeds;
  for (int s = 0; s < 400; ++s) {
    feeds.clear();
    for (int i = 0; i < 16; ++i) {
      const int tokens = static_cast<int>(rng() % (kChunk + 1));
      if (tokens > 0) feeds.push_back({i, tokens});
    }
    const std::vector<std::int64_t> before = [&] {
      std::vector<std::int64_t> held;
      for (auto& sequence : sequences) held.push_back(sequence->max_live());
      return held;
    }();
    pool.make_room(feeds);
    std::int64_t peak = 0;
    for (int i = 0; i < 16; ++i) {
      // Nobody is cut below its minimum (or below what it held, if less).
      EXPECT_GE(sequences[static_cast<std::size_t>(i)]->max_live(),
                std::min(before[static_cast<std::size_t>(i)], pool.minimum(i)));
      peak += sequences[static_cast<std::size_t>(i)]->max_live();
    }
    for (const KvPool::Feed& feed : feeds) {
      step(*sequences[static_cast<std::size_t>(feed.member)], feed.tokens);
      peak += feed.tokens;
    }
    ASSERT_LE(peak, kCells) << "step " << s;
  }
  EXPECT_LE(pool.stats().peak_cells, kCells);
  EXPECT_GT(pool.stats().pressed_steps, 0);
  // Every sequence grew past its minimum at some point and is still bounded by its budget.
  for (auto& sequence : sequences) {
    EXPECT_LE(sequence->max_live(), kBudget);
    EXPECT_GT(sequence->stats().tokens_fed, kBudget);
  }
}

}  // namespace
