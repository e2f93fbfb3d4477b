// The Allocated decorator (policies/allocated.hpp): one sequence budget split over the units by
// uniform, pyramid or adaptive, around a policy with a score rule. Expected keep-sets are worked
// out by hand in the comments from the attention rows fed; then the bad inputs, a KV pool's
// pressure, and the byte bound over random streams.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kvevict/allocation.hpp>
#include <kvevict/engine.hpp>
#include <kvevict/evicting_cache.hpp>
#include <kvevict/kv_type.hpp>
#include <kvevict/policies/allocated.hpp>
#include <kvevict/policies/h2o.hpp>
#include <kvevict/policies/key_scores.hpp>
#include <kvevict/policies/streaming_llm.hpp>
#include <kvevict/policies/tova.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

#define KVEVICT_EXPECT_ERROR(action, fragment) \
  kvevict::test::expect_error([&] { action; }, fragment)

namespace {

using kvevict::Allocated;
using kvevict::Allocation;
using kvevict::Granularity;
using kvevict::SequenceConfig;
using kvevict::test::Harness;
using kvevict::test::HeadRows;
using kvevict::test::LayerRows;
using kvevict::test::Positions;

std::unique_ptr<kvevict::Policy> tova(int budget, int sinks = 0, bool head_wise = false) {
  return kvevict::make_tova({budget, sinks, head_wise});
}

const Allocated& allocated(const Harness& run) {
  return dynamic_cast<const Allocated&>(run.sequence().policy());
}

// One row over 10 tokens; by score: 7 (.25), 1 (.20), 3 (.15), 5 (.12), 8 (.10), 9 (.07),
// 2 (.05), 6 (.03), 4 (.02), 0 (.01).
const HeadRows kTen{{0.01f, 0.20f, 0.05f, 0.15f, 0.02f, 0.12f, 0.03f, 0.25f, 0.10f, 0.07f}};

TEST(Allocation, UniformWithoutABudgetIsThePolicyItself) {
  // TOVA budget 4 over 4 layers: T = 4 units x 4, m = 4 in every unit, as without the decorator.
  Harness bare(4, 1, 1, tova(4));
  Harness uniform(4, 1, 1, tova(4), std::nullopt, [](SequenceConfig& c) { c.budget_tokens = 16; });
  bare.feed(10, kTen);
  uniform.feed(10, kTen);
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(uniform.kept(l), (Positions{1, 3, 5, 7})) << l;
    EXPECT_EQ(uniform.kept(l), bare.kept(l)) << l;
  }
  EXPECT_EQ(uniform.sequence().policy().retained_limit(), 4);
}

TEST(Allocation, PyramidGivesLowerLayersMore) {
  // 4 layers, mean m = 4, beta 4: lo = 4 // 4 = 1, hi = 2 * 4 - 1 = 7, step = (7 - 1) // 3 = 2:
  // 7, 5, 3, 1 (sum 16 = 4 x 4, so m' = m). Each layer keeps its top-k by the row above.
  Harness run(4, 1, 1, tova(4), std::nullopt, [](SequenceConfig& c) {
    c.allocation = Allocation::pyramid;
    c.pyramid_beta = 4;
  });
  run.feed(10, kTen);
  EXPECT_EQ(run.kept(0), (Positions{1, 2, 3, 5, 7, 8, 9}));  // 7, 1, 3, 5, 8, 9, 2
  EXPECT_EQ(run.kept(1), (Positions{1, 3, 5, 7, 8}));
  EXPECT_EQ(run.kept(2), (Positions{1, 3, 7}));
  EXPECT_EQ(run.kept(3), (Positions{7}));
  EXPECT_EQ(allocated(run).mean(), 4);
  EXPECT_EQ(run.sequence().policy().retained_limit(), 7);
}

TEST(Allocation, PyramidLowersTheMeanUntilTheAuthorsScheduleFits) {
  // beta 20 (the default), m = 4: lo = 0, hi = 8, step = 8 // 3 = 2: 8, 6, 4, 2 = 20 > 16 slots.
  // m' = 3: lo = 0, hi = 6, step = 2: 6, 4, 2, 0 = 12 <= 16: the largest mean that fits.
  Harness run(4, 1, 1, tova(4), std::nullopt,
              [](SequenceConfig& c) { c.allocation = Allocation::pyramid; });
  EXPECT_EQ(allocated(run).mean(), 3);
  EXPECT_EQ(std::vector<int>(allocated(run).unit_keep().begin(), allocated(run).unit_keep().end()),
            (std::vector<int>{6, 4, 2, 0}));
  // Per head: the two KV heads of a layer share its budget.
  Harness heads(2, 2, 2, tova(4, 0, true), std::nullopt, [](SequenceConfig& c) {
    c.allocation = Allocation::pyramid;
    c.pyramid_beta = 2;
  });
  // U = 4, m = 4: lo = 2, hi = 6, step = 4: 6, 2 per layer, 2 heads each: 16 = 4 x 4.
  EXPECT_EQ(
      std::vector<int>(allocated(heads).unit_keep().begin(), allocated(heads).unit_keep().end()),
      (std::vector<int>{6, 6, 2, 2}));
}

// Two KV heads of one layer (one query head each), TOVA-head budget 3: the layer has 6 slots.
// Head 0 by score: 0 (.30), 1 (.25), 2 (.20), 3 (.10), 4 (.05), 5 (.04), 6 (.03), 7 (.03).
// Head 1: 7 (.80), 6 (.08), then 0..5 at .02 (ties: the older first).
const LayerRows kTwoHeads{
    HeadRows{{0.30f, 0.25f, 0.20f, 0.10f, 0.05f, 0.04f, 0.03f, 0.03f}},
    HeadRows{{0.02f, 0.02f, 0.02f, 0.02f, 0.02f, 0.02f, 0.08f, 0.80f}},
};

Harness adaptive_run(double floor) {
  return Harness(1, 2, 2, tova(3, 0, true), std::nullopt, [floor](SequenceConfig& c) {
    c.allocation = Allocation::adaptive;
    c.adaptive_floor = floor;
  });
}

TEST(Allocation, AdaptiveHeadsOfALayerShareItsBudget) {
  // floor 0.4: f = int(3 * 0.4) = 1. Floors: head 0 keeps 0 (.30), head 1 keeps 7 (.80). The
  // other 6 - 2 = 4 slots go to the layer's best remaining: .25 (h0 1), .20 (h0 2), .10 (h0 3),
  // .08 (h1 6). Head 0 keeps 4, head 1 keeps 2 (uniform would keep 3 and 3).
  Harness run = adaptive_run(0.4);
  run.feed(8, {kTwoHeads});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1, 2, 3}));
  EXPECT_EQ(run.kept(0, 1), (Positions{6, 7}));
  EXPECT_EQ(run.sequence().policy().retained_limit(), 6);  // H x m: one head could take all
}

TEST(Allocation, AdaptiveWithFloorOneIsUniform) {
  // floor 1: f = 3 per head, nothing left to share: head 0 {0, 1, 2}, head 1 {7, 6, and the
  // oldest .02: 0}.
  Harness run = adaptive_run(1.0);
  run.feed(8, {kTwoHeads});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1, 2}));
  EXPECT_EQ(run.kept(0, 1), (Positions{0, 6, 7}));
}

TEST(Allocation, AdaptiveWithoutFloorIsTheLayerTopK) {
  // floor 0: the layer's 6 best over both heads: .80 (h1 7), .30, .25, .20, .10 (h0 0-3), .08
  // (h1 6). Then a decode token whose row gives h0's newest 0 and h1's newest .5: head 1's new
  // token (.5) beats head 0's worst kept (.10 at 3), so the layer's 6 become h0 {0, 1, 2} (its row
  // below: .3, .25, .2, .1, ...), h1 {6, 7, 8}.
  Harness run = adaptive_run(0.0);
  run.feed(8, {kTwoHeads});
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1, 2, 3}));
  EXPECT_EQ(run.kept(0, 1), (Positions{6, 7}));
  // Rows over each head's live tokens, oldest first: h0 holds 0, 1, 2, 3, 8; h1 holds 6, 7, 8.
  run.feed(1, {LayerRows{HeadRows{{0.3f, 0.25f, 0.2f, 0.1f, 0.0f}}, HeadRows{{0.2f, 0.3f, 0.5f}}}});
  // TOVA's score is this forward's row: h0 .3 (0), .25 (1), .2 (2), .1 (3), 0 (8); h1 .2 (6),
  // .3 (7), .5 (8). Top 6: .5 (h1 8), .3 (h0 0), .3 (h1 7), .25, .2 (h0 1, 2), .2 (h1 6); .1 goes.
  EXPECT_EQ(run.kept(0, 0), (Positions{0, 1, 2}));
  EXPECT_EQ(run.kept(0, 1), (Positions{6, 7, 8}));
}

TEST(Allocation, ByteBudgetCountsRowsOfTheKvType) {
  // 2 layers x 2 KV heads, f16 rows of head_dim 64: 128 bytes a row, 256 a token's K and V.
  // TOVA-head budget 4 with 1 sink: P = 1. 5,375 bytes hold 20 tokens (the rest is dropped), 5 per
  // unit: m = 5 - 1 = 4 scored + the sink.
  const std::int64_t token_bytes =
      2 * static_cast<std::int64_t>(kvevict::kv_row_bytes(kvevict::KvType::f16, 64));
  ASSERT_EQ(token_bytes, 256);
  Harness run(2, 2, 2, tova(3, 1, true), std::nullopt, [&](SequenceConfig& c) {
    c.budget_bytes = 20 * 256 + 255;
    c.token_bytes = token_bytes;
  });
  EXPECT_EQ(allocated(run).mean(), 4);
  EXPECT_EQ(allocated(run).protected_per_unit(), 1);
  EXPECT_EQ(run.sequence().policy().retained_limit(), 5);
  // Per layer (2 KV heads a unit): a unit-token costs 512 bytes, so 5,375 bytes hold 10: 5 per
  // unit, m = 4 again. Under q8_0 (two 34-byte blocks of 32 values a row: 136 bytes a token's K
  // and V at head_dim 64) they hold 5,375 // (2 x 136) = 19 layer-tokens: 9 per unit, m = 8.
  Harness layers(2, 2, 2, tova(3, 1), std::nullopt, [&](SequenceConfig& c) {
    c.budget_bytes = 20 * 256 + 255;
    c.token_bytes = token_bytes;
  });
  EXPECT_EQ(allocated(layers).mean(), 4);
  const std::int64_t q8 =
      2 * static_cast<std::int64_t>(kvevict::kv_row_bytes(kvevict::KvType::q8_0, 64));
  ASSERT_EQ(q8, 136);
  Harness quantised(2, 2, 2, tova(3, 1), std::nullopt, [&](SequenceConfig& c) {
    c.budget_bytes = 20 * 256 + 255;
    c.token_bytes = q8;
  });
  EXPECT_EQ(allocated(quantised).mean(), 8);
}

SequenceConfig small_config() {
  SequenceConfig c;
  c.layers = 2;
  c.q_heads = 2;
  c.kv_heads = 2;
  c.max_chunk = 4;
  c.token_bytes = 256;
  return c;
}

TEST(Allocation, BadInputIsRefusedNamingTheValue) {
  const auto build = [](const SequenceConfig& c, std::unique_ptr<kvevict::Policy> policy) {
    kvevict::Sequence sequence(c, std::move(policy));
  };
  SequenceConfig c = small_config();
  c.budget_bytes = 3 * 256;  // 3 tokens for 4 units
  KVEVICT_EXPECT_ERROR(build(c, tova(3, 1, true)), "smaller than one row per unit");
  c.budget_bytes = 4 * 256;  // 1 token per unit, the sink's
  KVEVICT_EXPECT_ERROR(build(c, tova(3, 1, true)), "not more than the 1 it protects");
  c.budget_tokens = 40;
  KVEVICT_EXPECT_ERROR(build(c, tova(3, 1, true)), "not both (40 tokens, 1024 bytes)");
  c = small_config();
  c.token_bytes = 0;
  c.budget_bytes = 4096;
  KVEVICT_EXPECT_ERROR(build(c, tova(3, 1, true)), "SequenceConfig::token_bytes");
  c = small_config();
  c.allocation = Allocation::pyramid;
  KVEVICT_EXPECT_ERROR(build(c, kvevict::make_streaming_llm({4, 8})),
                       "policy 'streaming_llm' has no keep rule");
  c.allocation = Allocation::adaptive;
  KVEVICT_EXPECT_ERROR(build(c, tova(4)), "granularity layer: adaptive");
  KVEVICT_EXPECT_ERROR(build(c, tova(4)), "tova: head_wise=1");
  c.adaptive_floor = 1.5;
  KVEVICT_EXPECT_ERROR(build(c, tova(4, 0, true)), "floor must be in [0, 1], got 1.5");
  c = small_config();
  c.allocation = Allocation::pyramid;
  c.granularity = Granularity::token;
  KVEVICT_EXPECT_ERROR(build(c, tova(4)), "granularity token: pyramid");
  KVEVICT_EXPECT_ERROR((void)kvevict::parse_allocation("lopsided"),
                       "unknown allocation 'lopsided'");
  c = small_config();
  c.allocation = Allocation::uniform;
  c.budget_tokens = 16;
  KVEVICT_EXPECT_ERROR(
      build(c, kvevict::make_policy("snapkv", kvevict::PolicyParams().set("capacity", 40))),
      "pyramidkv and adakv");
}

TEST(Allocation, PressureAndProtectionPassThrough) {
  // H2O heavy 4 recent 2 under pyramid: the recent window is protected outside the split and a
  // KV pool's grant still presses every unit (min_retained stays the window).
  SequenceConfig c = small_config();
  c.allocation = Allocation::pyramid;
  c.pyramid_beta = 2;
  c.max_chunk = 16;
  kvevict::Sequence sequence(c, kvevict::make_h2o({4, 2}));
  EXPECT_TRUE(sequence.policy().supports_pressure());
  EXPECT_EQ(sequence.policy().min_retained(), 2);
  // m = 4, lo = 2, hi = 6, step = 4: layer 0 keeps 6 + 2, layer 1 keeps 2 + 2.
  EXPECT_EQ(sequence.policy().retained_limit(), 8);
  kvevict::test::SlotRows rows;
  std::vector<std::int32_t> ids(12, 5);
  sequence.begin_chunk(ids);
  for (int l = 0; l < 2; ++l) {
    const HeadRows uniform(12, std::vector<float>(12, 1.0f / 12));
    kvevict::test::observe_attention(
        sequence, l, rows.make(sequence, l, kvevict::test::every_head(2, uniform), 0));
  }
  sequence.end_forward();
  EXPECT_EQ(sequence.live(0, 0), 8);
  EXPECT_EQ(sequence.live(1, 1), 4);
  sequence.shrink_to(5);  // layer 0 down to 5, layer 1 already below
  EXPECT_EQ(sequence.live(0, 0), 5);
  EXPECT_EQ(sequence.live(0, 1), 5);
  EXPECT_EQ(sequence.live(1, 0), 4);
  sequence.shrink_to(0);  // only the recent window is left
  EXPECT_EQ(sequence.max_live(), 2);
}

// Random softmax rows [q_heads][queries][stride] over each KV head's live slots, causal.
std::vector<float> random_rows(std::mt19937& rng, const kvevict::Sequence& sequence, int layer,
                               int queries, int& stride, std::vector<int>& keys) {
  const SequenceConfig& c = sequence.config();
  stride = 1;
  for (int g = 0; g < c.kv_heads; ++g) {
    keys[static_cast<std::size_t>(g)] = sequence.slot_limit(layer, g);
    stride = std::max(stride, keys[static_cast<std::size_t>(g)]);
  }
  std::vector<float> rows(static_cast<std::size_t>(c.q_heads) * queries * stride, 0.0f);
  std::exponential_distribution<float> weight(1.0f);
  for (int h = 0; h < c.q_heads; ++h) {
    const int unit = sequence.unit_of(layer, h / (c.q_heads / c.kv_heads));
    const auto order = sequence.slots().stream_order(unit);
    for (int q = 0; q < queries; ++q) {
      float* row = rows.data() + (static_cast<std::size_t>(h) * queries + q) * stride;
      const std::size_t visible = order.size() - static_cast<std::size_t>(queries - q - 1);
      float sum = 0;
      for (std::size_t i = 0; i < visible; ++i) sum += row[order[i]] = weight(rng);
      for (std::size_t i = 0; i < visible; ++i) row[order[i]] /= sum;
    }
  }
  return rows;
}

// Peak K/V bytes never exceed the byte budget plus one chunk: random streams, every allocation,
// every KV type, H2O and TOVA-head, budgets from tight to loose.
TEST(Allocation, PeakBytesStayWithinTheBudgetPlusOneChunk) {
  constexpr int kLayers = 3;
  constexpr int kQueryHeads = 4;
  constexpr int kKvHeads = 2;
  constexpr int kHeadDim = 64;
  constexpr int kMaxChunk = 5;
  std::mt19937 rng(29);
  int runs = 0;
  for (const kvevict::KvType type :
       {kvevict::KvType::f32, kvevict::KvType::f16, kvevict::KvType::bf16, kvevict::KvType::q8_0}) {
    const auto token_bytes = static_cast<std::int64_t>(2 * kvevict::kv_row_bytes(type, kHeadDim));
    for (const Allocation allocation :
         {Allocation::uniform, Allocation::pyramid, Allocation::adaptive}) {
      for (const bool h2o : {true, false}) {
        const int tokens_per_head = 6 + static_cast<int>(rng() % 40);
        SequenceConfig c;
        c.layers = kLayers;
        c.q_heads = kQueryHeads;
        c.kv_heads = kKvHeads;
        c.max_chunk = kMaxChunk;
        c.granularity = Granularity::head;
        c.allocation = allocation;
        c.adaptive_floor = 0.25 * static_cast<double>(rng() % 5);
        c.token_bytes = token_bytes;
        c.budget_bytes = std::int64_t{tokens_per_head} * kLayers * kKvHeads * token_bytes +
                         static_cast<std::int64_t>(rng() % 1000);
        kvevict::Sequence sequence(
            c, h2o ? kvevict::make_h2o({4, 2}) : kvevict::make_tova({4, 1, true}));
        std::vector<int> keys(kKvHeads);
        int stride = 0;
        for (int step = 0; step < 300; ++step) {
          const int n = 1 + static_cast<int>(rng() % kMaxChunk);
          sequence.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 7));
          const int queries = sequence.attention_queries();
          for (int l = 0; l < kLayers; ++l) {
            const std::vector<float> rows = random_rows(rng, sequence, l, queries, stride, keys);
            sequence.observe_attention(l, rows.data(), queries, stride);
          }
          sequence.end_forward();
          const std::int64_t bytes = sequence.slots().total_live() * token_bytes;
          ASSERT_LE(bytes, c.budget_bytes) << to_string(allocation) << " step " << step;
        }
        const std::int64_t chunk_bytes = std::int64_t{kMaxChunk} * kLayers * kKvHeads * token_bytes;
        EXPECT_LE(sequence.slots().peak_total_live() * token_bytes, c.budget_bytes + chunk_bytes)
            << to_string(type) << " " << to_string(allocation) << (h2o ? " h2o" : " tova");
        EXPECT_GT(sequence.stats().evicted_slots, 0);
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 24);
}

// Compacted slots (SequenceConfig::compact_slots, KvStore's HeadSizing::by_use) change where
// rows sit, nothing else: two caches fed the same random stream, one compacting, keep the same
// tokens in every unit after every step, with the same stored bits for each. H2O and TOVA per head
// under the three allocations; KeyDiff (its own per-slot unit vectors) and Ada-KV with kvpress's
// re-compression (its own per-slot votes of the recent queries) under a uniform split and their
// own. The compacting one's K/V allocation stays within 5/4 of the most tokens held at once, plus
// 16 rows per head: each head's block is refitted to its slots, which compacting keeps at its live
// tokens plus the chunk, before every write (KvStore::fit: at most 5/4 of them plus 16 rows).
TEST(Allocation, CompactedRowsFollowEachHeadsShareAndChangeNoDecision) {
  constexpr int kLayers = 3;
  constexpr int kQueryHeads = 4;
  constexpr int kKvHeads = 2;
  constexpr int kHeadDim = 32;
  constexpr int kMaxChunk = 5;
  constexpr int kGroup = kQueryHeads / kKvHeads;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int runs = 0;
  for (const kvevict::KvType type :
       {kvevict::KvType::f32, kvevict::KvType::f16, kvevict::KvType::bf16, kvevict::KvType::q8_0}) {
    const auto row_bytes = static_cast<std::int64_t>(kvevict::kv_row_bytes(type, kHeadDim));
    for (const Allocation allocation :
         {Allocation::uniform, Allocation::pyramid, Allocation::adaptive}) {
      for (const std::string name : {"h2o", "tova", "keydiff", "adakv"}) {
        // KeyDiff and Ada-KV once each (uniform: KeyDiff's split, Ada-KV's own).
        if ((name == "keydiff" || name == "adakv") && allocation != Allocation::uniform) continue;
        kvevict::CacheConfig config;
        config.shape = kvevict::CacheShape{kLayers, kQueryHeads, kKvHeads, kHeadDim};
        config.kv_type = type;
        config.sequence.max_chunk = kMaxChunk;
        config.sequence.granularity = Granularity::head;
        config.sequence.allocation = allocation;
        config.sequence.adaptive_floor = 0.25 * static_cast<double>(rng() % 5);
        if (name != "adakv") {
          config.sequence.budget_bytes =
              std::int64_t{8 + static_cast<int>(rng() % 30)} * kLayers * kKvHeads * 2 * row_bytes;
        }
        const auto policy = [&name]() -> std::unique_ptr<kvevict::Policy> {
          if (name == "h2o") return kvevict::make_h2o({4, 2});
          if (name == "tova") return kvevict::make_tova({4, 1, true});
          if (name == "keydiff") return kvevict::make_keydiff({4, 2});
          return kvevict::make_policy(
              "adakv", kvevict::PolicyParams::parse("capacity=24 window=4 interval=3 gqa=mean"));
        };
        kvevict::EvictingCache plain(config, policy());
        config.sequence.compact_slots = true;
        kvevict::EvictingCache compact(config, policy());
        kvevict::EvictingCache* caches[] = {&plain, &compact};
        std::vector<float> rows;
        for (int step = 0; step < 200; ++step) {
          const int n = 1 + static_cast<int>(rng() % kMaxChunk);
          const auto seed = static_cast<std::uint32_t>(rng());
          std::vector<kvevict::EvictingCache::Matrix> keys;
          std::vector<kvevict::EvictingCache::Matrix> values;
          for (int i = 0; i < kLayers * kKvHeads; ++i) {
            keys.emplace_back(n, kHeadDim);
            values.emplace_back(n, kHeadDim);
            for (float& x : keys.back().reshaped()) x = normal(rng);
            for (float& x : values.back().reshaped()) x = normal(rng);
          }
          for (kvevict::EvictingCache* cache : caches) {
            kvevict::Sequence& sequence = cache->sequence();
            sequence.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 7));
            const int queries = sequence.attention_queries();
            for (int l = 0; l < kLayers; ++l) {
              for (int g = 0; g < kKvHeads; ++g) {
                const auto i = static_cast<std::size_t>(l * kKvHeads + g);
                cache->write_chunk(l, g, keys[i], values[i]);
              }
              if (sequence.wants_keys()) cache->observe_stored_keys(l);
              if (!sequence.wants_attention()) continue;
              // Each live token's attention is a function of its original position (and the
              // step, head and query), wherever its slot is; at most 1/256 (fewer live tokens).
              int stride = 1;
              for (int g = 0; g < kKvHeads; ++g) {
                stride = std::max(stride, sequence.slot_limit(l, g));
              }
              rows.assign(static_cast<std::size_t>(kQueryHeads * queries * stride), 0.0f);
              for (int h = 0; h < kQueryHeads; ++h) {
                const int unit = sequence.unit_of(l, h / kGroup);
                const std::span<const std::int64_t> originals =
                    sequence.slots().original_positions(unit);
                for (int q = 0; q < queries; ++q) {
                  for (const std::int32_t slot : sequence.slots().stream_order(unit)) {
                    const auto original =
                        static_cast<std::uint32_t>(originals[static_cast<std::size_t>(slot)]);
                    const std::uint32_t hash = (seed ^ (original * 2654435761u) ^
                                                static_cast<std::uint32_t>((h * 8 + q) * 40503)) %
                                               1000u;
                    rows[static_cast<std::size_t>((h * queries + q) * stride + slot)] =
                        static_cast<float>(hash) / (1000.0f * 256.0f);
                  }
                }
              }
              sequence.observe_attention(l, rows.data(), queries, stride);
            }
            sequence.end_forward();
          }
          // The same tokens, the same bits.
          const kvevict::SlotTable& a = plain.sequence().slots();
          const kvevict::SlotTable& b = compact.sequence().slots();
          for (int l = 0; l < kLayers; ++l) {
            for (int g = 0; g < kKvHeads; ++g) {
              const int unit = plain.sequence().unit_of(l, g);
              ASSERT_EQ(a.live(unit), b.live(unit))
                  << name << " " << to_string(allocation) << " step " << step;
              ASSERT_EQ(b.slot_limit(unit), b.live(unit));
              for (int k = 0; k < a.live(unit); ++k) {
                const std::int32_t sa = a.stream_order(unit)[static_cast<std::size_t>(k)];
                const std::int32_t sb = b.stream_order(unit)[static_cast<std::size_t>(k)];
                ASSERT_EQ(a.original_positions(unit)[static_cast<std::size_t>(sa)],
                          b.original_positions(unit)[static_cast<std::size_t>(sb)])
                    << name << " " << to_string(allocation) << " step " << step;
                ASSERT_EQ(0, std::memcmp(plain.store().key_row(l, g, sa),
                                         compact.store().key_row(l, g, sb),
                                         static_cast<std::size_t>(row_bytes)));
                ASSERT_EQ(0, std::memcmp(plain.store().value_row(l, g, sa),
                                         compact.store().value_row(l, g, sb),
                                         static_cast<std::size_t>(row_bytes)));
              }
            }
          }
          // Every head's block was last refitted to its slots right after an append, whose sum
          // is at most the most tokens held at once (peak_total_live: within the budget plus one
          // chunk, Allocation.PeakBytesStayWithinTheBudgetPlusOneChunk).
          const std::int64_t peak_bytes = b.peak_total_live() * 2 * row_bytes;
          const std::int64_t slack = kLayers * kKvHeads * 2 * (16 * row_bytes + 8);
          ASSERT_LE(static_cast<std::int64_t>(compact.memory().reserved_kv_bytes),
                    peak_bytes * 5 / 4 + slack)
              << to_string(type) << " " << name << " " << to_string(allocation) << " step " << step;
        }
        EXPECT_GT(compact.sequence().stats().evicted_slots, 0);
        EXPECT_GT(compact.sequence().stats().moved_slots, 0);
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 32);
}

}  // namespace

TEST(AllocationRules, PyramidWithinTheBudgetLowersTheMeanUntilTheFlooredScheduleFits) {
  // 4 layers, mean 16, beta 5: lo 3, hi 29, step 26 // 3 = 8: 29 21 13 5 = 68 > 64. Mean 15: lo 3,
  // hi 27, step 8: 27 19 11 3 = 60 <= 64.
  EXPECT_EQ(kvevict::pyramid_budgets(4, 16, 5, 1 << 30), (std::vector<int>{29, 21, 13, 5}));
  EXPECT_EQ(kvevict::pyramid_budgets_within(4, 16, 5), (std::vector<int>{27, 19, 11, 3}));
  // 2 layers, mean 3, beta 20: lo 0, hi 6, step 6: 6 0 = 6, fits as it is.
  EXPECT_EQ(kvevict::pyramid_budgets_within(2, 3, 20), (std::vector<int>{6, 0}));
  EXPECT_EQ(kvevict::pyramid_budgets_within(3, 0, 20), (std::vector<int>{0, 0, 0}));
}

TEST(AllocationRules, SafeguardedAdaptiveGivesEachUnitItsFloorThenTheLayersBest) {
  using Scores = std::vector<std::vector<float>>;
  const auto budgets = [](const Scores& scores, int mean, double floor) {
    std::vector<std::span<const float>> spans(scores.begin(), scores.end());
    return kvevict::safeguarded_adaptive_budgets(spans, mean, floor);
  };
  // Unit 0 .30 .25 .20 .15 .01, unit 1 .05 .04 .03 .02 .012; mean 3, 6 places.
  const Scores uneven{{0.30f, 0.25f, 0.20f, 0.15f, 0.01f}, {0.05f, 0.04f, 0.03f, 0.02f, 0.012f}};
  // Floor 0: the layer's top 6 are unit 0's four and unit 1's .05 .04: 4, 2.
  EXPECT_EQ(budgets(uneven, 3, 0.0), (std::vector<int>{4, 2}));
  // Floor 1: f = 3 each, nothing left to share: 3, 3.
  EXPECT_EQ(budgets(uneven, 3, 1.0), (std::vector<int>{3, 3}));
  // Floor 0.7: f = int(2.1) = 2 each (.30 .25; .05 .04), then 6 - 4 = 2 of the rest (.20 .15
  // .01 .03 .02 .012): .20 and .15, both unit 0's: 4, 2. The sum is always 6 (the one-shot mix
  // would give round(.3 * 4 + 2), round(.3 * 2 + 2) = 3, 3).
  EXPECT_EQ(budgets(uneven, 3, 0.7), (std::vector<int>{4, 2}));
  // A unit with fewer candidates than its floor keeps them all and the rest goes to the others:
  // {.9} and {.5 .4 .3 .2 .1}, mean 2, floor 0.5: f = 1 each, then 4 - 2 = 2 of .4 .3 .2 .1: 1, 3.
  EXPECT_EQ(budgets(Scores{{0.9f}, {0.5f, 0.4f, 0.3f, 0.2f, 0.1f}}, 2, 0.5),
            (std::vector<int>{1, 3}));
  // Fewer candidates than places: every candidate is kept.
  EXPECT_EQ(budgets(Scores{{0.9f}, {0.5f}}, 2, 0.5), (std::vector<int>{1, 1}));
  // Ties: the older candidate, then the lower unit (mean 1, floor 0, .9 takes the first place).
  EXPECT_EQ(budgets(Scores{{0.9f, 0.5f}, {0.5f, 0.1f}}, 1, 0.0), (std::vector<int>{1, 1}));
  EXPECT_EQ(budgets(Scores{{0.9f, 0.5f}, {0.1f, 0.5f}}, 1, 0.0), (std::vector<int>{2, 0}));
}

// Adaptive's split against the rule computed from scratch (each head's best min(f, n_u), then the
// layer's best of the rest, ranking by score, then the older token, then the lower head), on
// random layers whose scores take few distinct values (so ties are common) and whose heads hold
// uneven numbers of candidates (so floors bind and the number of evictions varies from 0 to
// dozens: Allocated's one-scan form and its general form both run); and its decisions: each head
// evicts exactly its candidates ranked below its share (in the one-scan form Allocated evicts
// them itself, else the inner rule does).
TEST(Allocation, AdaptiveSplitMatchesTheRuleComputedFromScratch) {
  constexpr int kLayers = 2;
  constexpr int kHeads = 3;
  constexpr int kRecent = 2;
  const kvevict::UnitLayout layout(kLayers, kHeads, Granularity::head);
  std::mt19937 rng(2929);
  int cases = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int mean = 1 + static_cast<int>(rng() % 8);
    const double floor = 0.25 * static_cast<double>(rng() % 5);
    kvevict::AllocationConfig config;
    config.allocation = Allocation::adaptive;
    config.budget_tokens = std::int64_t{kLayers} * kHeads * (kRecent + mean);
    config.floor = floor;
    Allocated allocated(kvevict::make_h2o({4, kRecent}), config, layout);
    ASSERT_EQ(allocated.mean(), mean);
    kvevict::SlotTable slots(layout, kvevict::PositionMode::original, 64, 1,
                             kvevict::SlotReuse::lowest_first);
    for (int unit = 0; unit < layout.units(); ++unit) {
      const int live = static_cast<int>(rng() % (mean + 1 + (trial % 4) * 6)) + kRecent;
      std::vector<std::int64_t> originals;
      for (int i = 0; i < live; ++i) originals.push_back(2 * i + static_cast<int>(rng() % 2));
      std::vector<std::int32_t> out(originals.size());
      slots.append(unit, originals, std::vector<std::int32_t>(originals.size(), 7),
                   std::vector<std::uint8_t>(originals.size(), 0), out);
      for (const std::int32_t slot : out)
        slots.scores(unit, 0)[static_cast<std::size_t>(slot)] = static_cast<float>(rng() % 4);
    }
    // The rule from scratch: candidates are all but each head's newest kRecent. A head evicts its
    // candidates ranked below its share.
    std::vector<int> expected(static_cast<std::size_t>(layout.units()), 0);
    std::vector<std::vector<std::int64_t>> ranked(static_cast<std::size_t>(layout.units()));
    const int f = static_cast<int>(static_cast<double>(mean) * floor);
    for (int layer = 0; layer < kLayers; ++layer) {
      struct Entry {
        float score;
        std::int64_t original;
        int unit;
      };
      const auto better = [](const Entry& a, const Entry& b) {
        if (a.score != b.score) return a.score > b.score;
        if (a.original != b.original) return a.original < b.original;
        return a.unit < b.unit;
      };
      std::vector<Entry> rest;
      int floors = 0;
      for (int g = 0; g < kHeads; ++g) {
        const int unit = layout.unit_of(layer, g);
        std::vector<Entry> mine;
        const auto order = slots.stream_order(unit);
        for (std::size_t i = 0; i + kRecent < order.size(); ++i) {
          mine.push_back({slots.scores(unit, 0)[static_cast<std::size_t>(order[i])],
                          slots.original_positions(unit)[static_cast<std::size_t>(order[i])],
                          unit});
        }
        std::sort(mine.begin(), mine.end(), better);
        for (const Entry& e : mine) ranked[static_cast<std::size_t>(unit)].push_back(e.original);
        const int own = std::min(f, static_cast<int>(mine.size()));
        expected[static_cast<std::size_t>(unit)] = own;
        floors += own;
        rest.insert(rest.end(), mine.begin() + own, mine.end());
      }
      std::sort(rest.begin(), rest.end(), better);
      const int places = std::max(0, kHeads * mean - floors);
      for (int k = 0; k < places && k < static_cast<int>(rest.size()); ++k)
        ++expected[static_cast<std::size_t>(rest[static_cast<std::size_t>(k)].unit)];
    }
    kvevict::Decision decision;
    decision.reset(layout.units());
    allocated.select(kvevict::EvictionContext{kvevict::Trigger::after_forward, slots}, decision);
    const std::span<const int> keep = allocated.unit_keep();
    ASSERT_EQ(std::vector<int>(keep.begin(), keep.end()), expected) << "trial " << trial;
    for (int unit = 0; unit < layout.units(); ++unit) {
      const std::vector<std::int64_t>& mine = ranked[static_cast<std::size_t>(unit)];
      std::vector<std::int64_t> going(
          mine.begin() + std::min<std::ptrdiff_t>(expected[static_cast<std::size_t>(unit)],
                                                  static_cast<std::ptrdiff_t>(mine.size())),
          mine.end());
      std::vector<std::int64_t> evicted;
      for (const std::int32_t slot : decision.evicted(unit))
        evicted.push_back(slots.original_positions(unit)[static_cast<std::size_t>(slot)]);
      std::sort(going.begin(), going.end());
      std::sort(evicted.begin(), evicted.end());
      ASSERT_EQ(evicted, going) << "trial " << trial << " unit " << unit;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 400);
}

// A NaN among a layer's candidates is an error naming its position, in either form of the split.
TEST(Allocation, AdaptiveSplitRefusesANanScore) {
  const kvevict::UnitLayout layout(1, 2, Granularity::head);
  for (const int live : {6, 30}) {  // 2 or 50 evictions: the one-scan form and the general one
    kvevict::AllocationConfig config;
    config.allocation = Allocation::adaptive;
    config.budget_tokens = 2 * (2 + 3);  // m = 3 beside the 2 recent
    Allocated allocated(kvevict::make_h2o({4, 2}), config, layout);
    kvevict::SlotTable slots(layout, kvevict::PositionMode::original, 64, 1,
                             kvevict::SlotReuse::lowest_first);
    for (int unit = 0; unit < 2; ++unit) {
      std::vector<std::int64_t> originals;
      for (int i = 0; i < live; ++i) originals.push_back(i);
      std::vector<std::int32_t> out(originals.size());
      slots.append(unit, originals, std::vector<std::int32_t>(originals.size(), 7),
                   std::vector<std::uint8_t>(originals.size(), 0), out);
      for (const std::int32_t slot : out)
        slots.scores(unit, 0)[static_cast<std::size_t>(slot)] = 1.0f;
    }
    slots.scores(1, 0)[static_cast<std::size_t>(slots.stream_order(1)[1])] = std::nanf("");
    kvevict::Decision decision;
    decision.reset(2);
    KVEVICT_EXPECT_ERROR(
        allocated.select(kvevict::EvictionContext{kvevict::Trigger::after_forward, slots},
                         decision),
        "NaN at original position 1");
  }
}
