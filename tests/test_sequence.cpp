// Sequence, SlotTable, KvStore and EvictingCache: eviction by metadata (slots reused, nothing
// moved), position groups, folds and the bound on key re-rotations, the order of events and the
// signal contract, the engine's KvBackend, capacity, the catalyst and before_turn triggers,
// granularity, stage timing, and clear errors for misuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kvevict/kvevict.hpp>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "support/expect_error.hpp"
#include "support/policy_harness.hpp"

namespace {

using kvevict::test::observe_attention;
using kvevict::test::observe_catalyst;

using kvevict::CacheConfig;
using kvevict::CacheShape;
using kvevict::EvictingCache;
using kvevict::PolicyParams;
using kvevict::PositionMode;
using kvevict::Sequence;
using kvevict::SequenceConfig;
using kvevict::SlotTable;
using kvevict::test::expect_error;
using Matrix = EvictingCache::Matrix;
using Positions = std::vector<std::int64_t>;

SequenceConfig config(int layers, int q_heads, int kv_heads, int max_chunk = 8) {
  SequenceConfig c;
  c.layers = layers;
  c.q_heads = q_heads;
  c.kv_heads = kv_heads;
  c.max_chunk = max_chunk;
  return c;
}

std::vector<std::int32_t> ids(int n, std::int32_t id = 0) {
  return std::vector<std::int32_t>(static_cast<std::size_t>(n), id);
}

void feed(Sequence& sequence, int n) {
  sequence.begin_chunk(ids(n));
  sequence.end_forward();
}

// Records what the sequence asks of the engine.
class RecordingBackend final : public kvevict::KvBackend {
 public:
  void reserve(int capacity) override { reserved.push_back(capacity); }
  void apply(const kvevict::AppliedDecision& decision) override {
    ++applies;
    evicted += static_cast<std::int64_t>(decision.evicted_count());
    for (const kvevict::KeyRotation& rotation : decision.rotations()) {
      rotated += static_cast<std::int64_t>(rotation.slots.size());
      deltas.push_back(rotation.delta);
    }
    if (fail) throw kvevict::Error("backend failed");
  }
  std::vector<int> reserved;
  int applies = 0;
  std::int64_t evicted = 0;
  std::int64_t rotated = 0;
  std::vector<std::int64_t> deltas;
  bool fail = false;
};

// ---------------------------------------------------------------------------------------------
// Eviction by metadata
// ---------------------------------------------------------------------------------------------

// A steady sliding window frees one slot and the next token takes it: the slot limit never passes
// the window plus one chunk, and no key or value row is ever rotated or copied.
TEST(EvictionByMetadata, SlidingWindowReusesTheSlotItFrees) {
  CacheConfig c;
  c.shape = CacheShape{2, 2, 2, 8};
  c.sequence.key_storage = kvevict::KeyStorage::post_rope;
  c.sequence.max_chunk = 1;
  EvictingCache cache(
      c, kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 12)));
  const Matrix rows = Matrix::Ones(1, 8);
  for (int t = 0; t < 500; ++t) {
    cache.sequence().begin_chunk(ids(1));
    for (int g = 0; g < 2; ++g) {
      for (int l = 0; l < 2; ++l) cache.write_chunk(l, g, rows, rows);
    }
    cache.sequence().end_forward();
    ASSERT_LE(cache.sequence().slot_limit(0, 0), 4 + 12 + 1);
  }
  EXPECT_EQ(cache.store().bytes_rotated(), 0u);
  EXPECT_EQ(cache.store().bytes_copied(), 0u);  // reserved once, at construction
  EXPECT_EQ(cache.sequence().stats().rotated_keys, 0);
  EXPECT_EQ(cache.sequence().stats().folds, 0);
  // Sinks and window: two position groups, whatever the stream length.
  EXPECT_EQ(cache.sequence().slots().group_count(0), 2);
}

// The evicted slot's token is gone from the metadata and the next token takes that very slot.
TEST(EvictionByMetadata, EvictedSlotsAreReusedNewestFreedFirst) {
  Sequence s(config(1, 1, 1), kvevict::make_policy("window", PolicyParams().set("recent", 3)));
  for (int t = 0; t < 3; ++t) feed(s, 1);
  EXPECT_EQ(s.slot_limit(0, 0), 3);
  s.begin_chunk(ids(1));  // token 3 into slot 3, evicted at end_forward: token 0 (slot 0)
  EXPECT_EQ(s.chunk_slots(0, 0)[0], 3);
  s.end_forward();
  EXPECT_FALSE(s.slots().is_live(0, 0));
  s.begin_chunk(ids(1));  // token 4 takes slot 0
  EXPECT_EQ(s.chunk_slots(0, 0)[0], 0);
  s.end_forward();
  EXPECT_EQ(kvevict::test::kept_positions(s.slots(), 0), (Positions{2, 3, 4}));
  EXPECT_EQ(kvevict::test::rope_positions(s.slots(), 0), (Positions{0, 1, 2}));
  EXPECT_EQ(s.slot_limit(0, 0), 4);
}

// Under cache_index every eviction lowers the positions of the newer tokens; the table keeps that
// as offsets of a few groups. A random pattern of evictions checked against ranks recomputed from
// scratch.
TEST(PositionGroups, RankPositionsMatchARecountAfterRandomEvictions) {
  const kvevict::UnitLayout layout(1, 1, kvevict::Granularity::head);
  SlotTable slots(layout, PositionMode::cache_index, 64, 0);
  std::mt19937 rng(3);
  std::int64_t next = 0;
  std::vector<std::int32_t> out(4);
  for (int step = 0; step < 3000; ++step) {
    if (slots.live(0) < 40) {
      const int n = 1 + static_cast<int>(rng() % 4);
      std::vector<std::int64_t> originals;
      for (int i = 0; i < n; ++i) originals.push_back(next++);
      slots.append(0, originals, std::vector<std::int32_t>(static_cast<std::size_t>(n), 0),
                   std::vector<std::uint8_t>(static_cast<std::size_t>(n), 0), out);
    }
    // Evict 1-3 random live tokens.
    const auto order = slots.stream_order(0);
    std::set<std::int32_t> evict;
    const int k = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < k && !order.empty(); ++i) evict.insert(order[rng() % order.size()]);
    slots.evict(0, std::vector<std::int32_t>(evict.begin(), evict.end()));
    const auto now = slots.stream_order(0);
    for (std::size_t i = 0; i < now.size(); ++i) {
      ASSERT_EQ(slots.position(0, now[i]), static_cast<std::int64_t>(i)) << "step " << step;
    }
  }
  // Groups are merged back as they empty: never more than one per gap between live tokens.
  EXPECT_LE(slots.group_count(0), slots.live(0));
}

// Folds. Under cache_index positions only fall, so every fold turns keys back (delta < 0). With
// max_pending_rotations = 0 (engines that cannot rotate queries per run) every decision turns every
// key to its position. With a limit L >= 1 a unit never carries more than L values after a
// decision, and a fold that drops one value (one eviction per decision here) turns the smallest
// of the L stretches after the oldest: at most live / L keys.
TEST(PositionGroups, FoldsTurnKeysBackwardsAndKeepAtMostTheLimit) {
  for (const int limit : {0, 2, 32}) {
    SCOPED_TRACE("max_pending_rotations " + std::to_string(limit));
    RecordingBackend backend;
    SequenceConfig c = config(1, 2, 1, 4);
    c.position_mode = PositionMode::cache_index;
    c.max_pending_rotations = limit;
    Sequence s(c, kvevict::make_policy("h2o", PolicyParams().set("heavy", 8).set("recent", 8)),
               &backend);
    std::mt19937 rng(11);
    for (int step = 0; step < 2000; ++step) {
      s.begin_chunk(ids(1));
      // Random attention: evictions land anywhere among the non-recent tokens.
      kvevict::test::LayerRows rows(2);
      for (auto& head : rows) {
        std::vector<float> row(static_cast<std::size_t>(s.live(0, 0)));
        for (float& p : row) p = static_cast<float>(rng() % 1000) / 1000.0f;
        head.push_back(row);
      }
      kvevict::test::SlotRows slot_rows;
      observe_attention(s, 0, slot_rows.make(s, 0, rows, step));
      const std::size_t rotations_before = backend.deltas.size();
      const std::int64_t rotated_before = backend.rotated;
      s.end_forward();
      for (std::size_t r = rotations_before; r < backend.deltas.size(); ++r) {
        EXPECT_LT(backend.deltas[r], 0);  // positions only fall under cache_index
      }
      if (limit == 0) {
        for (const std::int32_t slot : s.slots().stream_order(0)) {
          ASSERT_EQ(s.slots().key_position(0, slot), s.slots().position(0, slot));
        }
      } else {
        ASSERT_LE(backend.rotated - rotated_before, s.live(0, 0) / limit);
      }
      const int carried = s.slots().pending_rotations(0);
      ASSERT_LE(carried, std::max(limit, 1));
      ASSERT_LE(carried, s.slots().pending_rotation_bound(0));
    }
    if (limit == 0) {
      EXPECT_EQ(s.stats().folds, s.stats().decisions);
    } else if (limit == 2) {
      EXPECT_GT(s.stats().folds, 0);
    }
    EXPECT_EQ(backend.rotated, s.stats().rotated_keys);
  }
}

// Per-key count of re-rotations over a long H2O stream under cache_index: within the stated bound
// (capacity + max(limit, 1), docs/design.md "Folds"), far below the number of evictions.
TEST(PositionGroups, NoKeyIsReRotatedMoreThanTheBound) {
  for (const int limit : {0, 1, 3}) {
    SCOPED_TRACE("max_pending_rotations " + std::to_string(limit));
    class CountingBackend final : public kvevict::KvBackend {
     public:
      void reserve(int) override {}
      void apply(const kvevict::AppliedDecision& decision) override {
        for (const kvevict::KeyRotation& rotation : decision.rotations()) {
          for (const std::int32_t slot : rotation.slots) ++count[slot];
        }
      }
      std::map<std::int32_t, int> count;
    } backend;
    SequenceConfig c = config(1, 1, 1, 1);
    c.position_mode = PositionMode::cache_index;
    c.max_pending_rotations = limit;
    Sequence s(c, kvevict::make_policy("h2o", PolicyParams().set("heavy", 6).set("recent", 6)),
               &backend);
    std::mt19937 rng(5);
    int worst = 0;
    for (int step = 0; step < 3000; ++step) {
      s.begin_chunk(ids(1));
      const std::int32_t slot = s.chunk_slots(0, 0)[0];
      worst = std::max(worst, backend.count[slot]);
      backend.count[slot] = 0;  // a new token in the slot
      kvevict::test::LayerRows rows(1);
      std::vector<float> row(static_cast<std::size_t>(s.live(0, 0)));
      for (float& p : row) p = static_cast<float>(rng() % 1000) / 1000.0f;
      rows[0].push_back(row);
      kvevict::test::SlotRows slot_rows;
      observe_attention(s, 0, slot_rows.make(s, 0, rows, step));
      s.end_forward();
    }
    for (const auto& [slot, count] : backend.count) worst = std::max(worst, count);
    EXPECT_GT(worst, 0);
    EXPECT_LE(worst, std::max(limit, 1) + s.capacity());
    EXPECT_GT(s.stats().decisions, 2000);
  }
}

// ---------------------------------------------------------------------------------------------
// The engine's side: KvBackend, order of events, the signal contract
// ---------------------------------------------------------------------------------------------

TEST(Sequence, EveryDecisionReachesTheBackendInOneCall) {
  RecordingBackend backend;
  Sequence s(config(2, 2, 2), kvevict::make_policy("window", PolicyParams().set("recent", 4)),
             &backend);
  EXPECT_EQ(backend.reserved, (std::vector<int>{4 + 8}));  // retained limit + max_chunk
  for (int t = 0; t < 10; ++t) feed(s, 1);
  EXPECT_EQ(backend.applies, 6);  // one per forward that evicted
  EXPECT_EQ(backend.evicted, 6);  // one token per decision, one unit (token granularity)
  EXPECT_EQ(s.stats().evicted_slots, 6 * 4);  // summed over the 2 x 2 heads
  EXPECT_EQ(backend.rotated, 0);              // two groups at most: never folded
}

TEST(Sequence, AppliedDecisionsListTheEvictedTokensWithTheirPositions) {
  struct Capture final : kvevict::KvBackend {
    void reserve(int) override {}
    void apply(const kvevict::AppliedDecision& d) override {
      for (const kvevict::EvictedSlot& e : d.evicted(0, 0)) {
        evicted.push_back({e.original_position, e.position});
      }
      trigger = d.trigger;
    }
    std::vector<std::pair<std::int64_t, std::int64_t>> evicted;
    kvevict::Trigger trigger = kvevict::Trigger::before_turn;
  } backend;
  Sequence s(config(1, 1, 1),
             kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 1).set("recent", 2)),
             &backend);
  feed(s, 5);  // 0..4: keep 0, 3, 4; evict 1, 2 at positions 1, 2
  EXPECT_EQ(backend.evicted, (std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 1}, {2, 2}}));
  EXPECT_EQ(backend.trigger, kvevict::Trigger::after_forward);
  feed(s, 1);  // 0 3 4 5 at positions 0 1 2 3: evict 3 at position 1
  EXPECT_EQ(backend.evicted.back(), (std::pair<std::int64_t, std::int64_t>{3, 1}));
}

TEST(Sequence, AFailingBackendLeavesTheSequenceUnusable) {
  RecordingBackend backend;
  Sequence s(config(1, 1, 1), kvevict::make_policy("window", PolicyParams().set("recent", 2)),
             &backend);
  feed(s, 2);
  backend.fail = true;
  s.begin_chunk(ids(1));
  expect_error([&] { s.end_forward(); }, "backend failed");
  expect_error([&] { s.begin_chunk(ids(1)); }, "unusable");
}

// A reserve that fails may leave the engine's buffers anywhere between the two sizes: the sequence
// refuses every later call, naming the failure, even once the engine could reserve again.
TEST(Sequence, AFailedReserveLeavesTheSequenceUnusable) {
  struct FailingReserve final : kvevict::KvBackend {
    void reserve(int capacity) override {
      if (fail) throw kvevict::Error("out of device memory");
      reserved = capacity;
    }
    void apply(const kvevict::AppliedDecision&) override {}
    bool fail = false;
    int reserved = 0;
  } backend;
  SequenceConfig c = config(1, 1, 1, 4);
  c.initial_capacity = 4;
  Sequence s(c, kvevict::make_policy("full"), &backend);
  feed(s, 4);
  backend.fail = true;
  expect_error([&] { s.begin_chunk(ids(1)); }, "out of device memory");
  EXPECT_EQ(s.capacity(), 4);
  backend.fail = false;
  const std::string unusable =
      "Sequence: unusable after growing to 8 slots per head failed: out of device memory";
  expect_error([&] { s.begin_chunk(ids(1)); }, unusable);
  expect_error([&] { s.roll_back(1); }, unusable);
  expect_error([&] { s.begin_catalyst(ids(1)); }, unusable);
  EXPECT_EQ(backend.reserved, 4);
  EXPECT_EQ(s.stats().tokens_fed, 4);
}

TEST(Sequence, EventsOutOfOrderAreErrors) {
  Sequence s(config(1, 1, 1), kvevict::make_policy("full"));
  expect_error([&] { s.end_forward(); }, "no forward is open");
  expect_error([&] { s.observe_surprisal(std::vector<float>{1.0f}); }, "no forward is open");
  expect_error([&] { s.begin_chunk({}); }, "at least one token");
  s.begin_chunk(ids(3));
  expect_error([&] { s.begin_chunk(ids(1)); }, "call end_forward");
  expect_error([&] { s.observe_surprisal(std::vector<float>{1.0f}); }, "one value per token");
  expect_error([&] { s.begin_catalyst(ids(1)); }, "end the forward first");
  s.end_forward();
  expect_error([&] { s.end_catalyst(); }, "no catalyst prompt is open");
  expect_error([&] { (void)s.live(1, 0); }, "outside the sequence");
}

// A policy that needs attention rows and reaches a decision without them is an error, not a
// silent keep-the-oldest (H2O) or keep-the-first (TOVA).
TEST(Sequence, AMissingSignalIsAnErrorAtTheDecision) {
  for (const std::string name : {"h2o", "tova"}) {
    SCOPED_TRACE(name);
    Sequence s(config(2, 2, 1), kvevict::make_policy(name, kvevict::budget_params(name, 4)));
    s.begin_chunk(ids(2));
    kvevict::test::SlotRows rows;
    observe_attention(
        s, 0, rows.make(s, 0, kvevict::test::every_head(2, {{1.0f, 0.0f}, {0.5f, 0.5f}}), 0));
    expect_error([&] { s.end_forward(); },
                 "needs the attention rows of every layer: layer 1 was not observed");
  }
  Sequence sirllm(config(1, 1, 1),
                  kvevict::make_policy("sirllm", PolicyParams().set("entropy", 8)));
  sirllm.begin_chunk(ids(2), true);
  expect_error([&] { sirllm.end_forward(); }, "needs the surprisal of every token");
}

TEST(Sequence, ALayerObservedTwiceOrRowsOfTheWrongShapeAreErrors) {
  Sequence s(config(1, 2, 1), kvevict::make_policy("h2o", kvevict::budget_params("h2o", 4)));
  s.begin_chunk(ids(1));
  kvevict::test::SlotRows rows;
  const kvevict::test::LayerRows layer = kvevict::test::every_head(2, {{1.0f}});
  observe_attention(s, 0, rows.make(s, 0, layer, 0));
  expect_error([&] { observe_attention(s, 0, rows.make(s, 0, layer, 0)); }, "already observed");
  expect_error([&] { observe_attention(s, 3, rows.make(s, 0, layer, 0)); }, "layer 3 outside");
}

// Random softmax rows of one layer for `sequence`'s current chunk, laid out as observe_attention
// takes them ([q_heads][queries][stride]): each row spreads 1 over its unit's live slots.
std::vector<float> random_layer_rows(const Sequence& sequence, int layer, int queries,
                                     std::ptrdiff_t stride, std::mt19937& random) {
  const SequenceConfig& c = sequence.config();
  const int group = c.q_heads / c.kv_heads;
  std::vector<float> rows(static_cast<std::size_t>(c.q_heads * queries * stride), 0.0f);
  std::uniform_real_distribution<float> weight(0.01f, 1.0f);
  for (int h = 0; h < c.q_heads; ++h) {
    const int unit = sequence.unit_of(layer, h / group);
    for (int q = 0; q < queries; ++q) {
      float* row = rows.data() + (static_cast<std::ptrdiff_t>(h) * queries + q) * stride;
      float total = 0.0f;
      for (int slot = 0; slot < sequence.slot_limit(layer, h / group); ++slot) {
        if (sequence.slots().is_live(unit, slot)) total += row[slot] = weight(random);
      }
      for (int slot = 0; slot < stride; ++slot) row[slot] /= total;
    }
  }
  return rows;
}

// H2O and TOVA take a layer's KV heads in separate calls (Policy::attention_per_kv_head): every
// score keeps its bits and every decision its tokens, against one call per layer, whether each
// KV head has its own unit (H2O, TOVA-head) or the layer's share one (TOVA-layer, H2O at layer
// granularity), for group sizes 1 to 4 and chunks of 1 to 3 tokens after a prompt.
TEST(Sequence, AttentionPerKvHeadGivesTheScoresAndDecisionsOfOneCallPerLayer) {
  struct Case {
    std::string label;
    std::string policy;
    PolicyParams params;
    std::optional<kvevict::Granularity> granularity;
  };
  using kvevict::Granularity;
  const std::vector<Case> cases{
      {"h2o", "h2o", kvevict::budget_params("h2o", 12), std::nullopt},
      {"h2o layer", "h2o", kvevict::budget_params("h2o", 12), Granularity::layer},
      {"h2o token", "h2o", kvevict::budget_params("h2o", 12), Granularity::token},
      {"h2o block:4", "h2o", kvevict::budget_params("h2o", 12), Granularity::blocks(4)},
      {"tova", "tova", PolicyParams().set("budget", 10), std::nullopt},
      {"tova head_wise", "tova", PolicyParams().set("budget", 10).set("head_wise", 1),
       std::nullopt}};
  for (const Case& test : cases) {
    for (const auto& [q_heads, kv_heads] : {std::pair{2, 2}, {4, 2}, {6, 2}, {12, 3}}) {
      SCOPED_TRACE(test.label + " q_heads " + std::to_string(q_heads) + " kv_heads " +
                   std::to_string(kv_heads));
      SequenceConfig c = config(2, q_heads, kv_heads, 16);
      c.granularity = test.granularity;
      Sequence whole(c, kvevict::make_policy(test.policy, test.params));
      Sequence apart(c, kvevict::make_policy(test.policy, test.params));
      ASSERT_TRUE(apart.attention_per_kv_head());
      std::mt19937 random(7);
      const int group = q_heads / kv_heads;
      for (int step = 0; step < 40; ++step) {
        const int n = step == 0 ? 16 : 1 + step % 3;
        whole.begin_chunk(ids(n));
        apart.begin_chunk(ids(n));
        for (int layer = 0; layer < c.layers; ++layer) {
          int stride = 0;
          for (int g = 0; g < kv_heads; ++g) stride = std::max(stride, whole.slot_limit(layer, g));
          const int queries = whole.attention_queries();
          const std::vector<float> rows = random_layer_rows(whole, layer, queries, stride, random);
          whole.observe_attention(layer, rows.data(), queries, stride);
          for (int g = 0; g < kv_heads; ++g) {
            apart.observe_attention(
                layer, g, g + 1,
                rows.data() + static_cast<std::ptrdiff_t>(g) * group * queries * stride, queries,
                stride);
          }
        }
        whole.end_forward();
        apart.end_forward();
        for (int unit = 0; unit < whole.slots().units(); ++unit) {
          ASSERT_EQ(kvevict::test::kept_positions(whole.slots(), unit),
                    kvevict::test::kept_positions(apart.slots(), unit))
              << "step " << step << " unit " << unit;
          const std::vector<float> a = kvevict::test::score_column(whole.slots(), unit, 0);
          const std::vector<float> b = kvevict::test::score_column(apart.slots(), unit, 0);
          ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
              << "step " << step << " unit " << unit;
        }
      }
      EXPECT_GT(whole.stats().evicted_slots, 0);
    }
  }
}

// A call per KV head is refused whole: rows with a NaN in KV head 1 leave its scores as they were
// and it unobserved (KV head 0's call stands), and the same head may then be observed again.
// Heads observed twice, never or out of order, ranges outside the layer, and a policy that reads a
// layer in one call get errors naming them.
TEST(Sequence, AttentionPerKvHeadIsRefusedWholePerCallAndCheckedPerHead) {
  Sequence s(config(1, 4, 2), kvevict::make_policy("h2o", kvevict::budget_params("h2o", 8)));
  s.begin_chunk(ids(2));
  std::mt19937 random(3);
  const int stride = s.slot_limit(0, 0);
  std::vector<float> rows = random_layer_rows(s, 0, 2, stride, random);
  const std::ptrdiff_t head_rows = std::ptrdiff_t{2} * 2 * stride;  // group 2, 2 queries
  s.observe_attention(0, 0, 1, rows.data(), 2, stride);
  expect_error([&] { s.observe_attention(0, 0, 1, rows.data(), 2, stride); },
               "layer 0, KV head 0 was already observed");
  expect_error([&] { s.observe_attention(0, 0, 2, rows.data(), 2, stride); },
               "layer 0, KV head 0 was already observed");
  expect_error([&] { s.end_forward(); }, "layer 0, KV head 1 was not observed");
  const int unit = s.unit_of(0, 1);
  const std::vector<float> before = kvevict::test::score_column(s.slots(), unit, 0);
  std::vector<float> bad = rows;
  bad[static_cast<std::size_t>(head_rows + stride + 1)] = std::nanf("");
  expect_error([&] { s.observe_attention(0, 1, 2, bad.data() + head_rows, 2, stride); },
               "layer 0, query head 2, query 1");
  const std::vector<float> after = kvevict::test::score_column(s.slots(), unit, 0);
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0);
  expect_error([&] { s.observe_attention(0, 1, 1, rows.data(), 2, stride); },
               "KV heads [1, 1) are not a range");
  expect_error([&] { s.observe_attention(0, 1, 3, rows.data(), 2, stride); },
               "KV heads [1, 3) are not a range");
  s.observe_attention(0, 1, 2, rows.data() + head_rows, 2, stride);
  s.end_forward();

  Sequence three(config(1, 3, 3), kvevict::make_policy("h2o", kvevict::budget_params("h2o", 8)));
  three.begin_chunk(ids(1));
  const std::vector<float> rows3 = random_layer_rows(three, 0, 1, three.slot_limit(0, 0), random);
  expect_error([&] { three.observe_attention(0, 1, 2, rows3.data(), 1, three.slot_limit(0, 0)); },
               "layer 0 needs KV head 0 next, got 1");

  Sequence snapkv(config(1, 2, 2),
                  kvevict::make_policy("snapkv", kvevict::budget_params("snapkv", 4)));
  ASSERT_TRUE(snapkv.wants_attention());
  EXPECT_FALSE(snapkv.attention_per_kv_head());
  snapkv.begin_chunk(ids(2));
  const std::vector<float> one = random_layer_rows(snapkv, 0, 2, snapkv.slot_limit(0, 0), random);
  expect_error([&] { snapkv.observe_attention(0, 0, 1, one.data(), 2, snapkv.slot_limit(0, 0)); },
               "reads a layer's attention rows in one call");
}

// key_runs and live_mask are the engine's view of the live slots during a forward: the runs are
// disjoint, in slot order, cover exactly the live slots (the mask's ones), and a run's rotation
// is the pending rotation of every slot in it (position - key_position). RandomLLM under
// cache_index evicts anywhere, so the runs carry several rotations; pre-RoPE keys carry none.
TEST(Sequence, KeyRunsAndLiveMaskCoverExactlyTheLiveSlots) {
  struct Case {
    std::string policy;
    PositionMode positions;
    bool turn_start;  // RandomLLM evicts before a turn
  };
  // RandomLLM under cache_index evicts anywhere (several rotations); a window keeps every slot
  // live in one group once full (one run); StreamingLLM under cache_index re-positions its window.
  for (const Case& test : {Case{"random_llm", PositionMode::cache_index, true},
                           Case{"window", PositionMode::original, false},
                           Case{"streaming_llm", PositionMode::cache_index, false}}) {
    for (const kvevict::KeyStorage storage :
         {kvevict::KeyStorage::post_rope, kvevict::KeyStorage::pre_rope}) {
      SCOPED_TRACE(test.policy + " " + std::string(kvevict::to_string(storage)));
      SequenceConfig c = config(1, 1, 1, 1);
      c.position_mode = test.positions;
      c.key_storage = storage;
      Sequence s(c, kvevict::make_policy(test.policy, kvevict::budget_params(test.policy, 24)));
      std::size_t most_runs = 0;
      int full_steps = 0;
      for (int step = 0; step < 200; ++step) {
        s.begin_chunk(ids(1), test.turn_start);
        const std::span<const kvevict::KeyRun> runs = s.key_runs(0, 0);
        const std::span<const std::uint8_t> mask = s.live_mask(0, 0);
        ASSERT_EQ(static_cast<int>(mask.size()), s.slot_limit(0, 0));
        std::vector<std::uint8_t> covered(mask.size(), 0);
        std::int32_t previous_end = 0;
        for (const kvevict::KeyRun& run : runs) {
          ASSERT_LE(previous_end, run.begin);
          ASSERT_LT(run.begin, run.end);
          previous_end = run.end;
          for (std::int32_t slot = run.begin; slot < run.end; ++slot) {
            covered[static_cast<std::size_t>(slot)] = 1;
            const std::int64_t pending = s.position(0, 0, slot) - s.key_position(0, 0, slot);
            EXPECT_EQ(run.rotation, storage == kvevict::KeyStorage::post_rope ? pending : 0);
          }
        }
        for (std::size_t slot = 0; slot < mask.size(); ++slot) {
          EXPECT_EQ(covered[slot], s.slots().is_live(0, static_cast<std::int32_t>(slot)) ? 1 : 0);
          EXPECT_EQ(mask[slot], covered[slot]);
        }
        // A window's slots, every one live, are one run (runs are maximal).
        if (test.policy == "window" && s.live(0, 0) == s.slot_limit(0, 0)) {
          EXPECT_EQ(runs.size(), 1u);
          ++full_steps;
        }
        most_runs = std::max(most_runs, runs.size());
        s.end_forward();
      }
      expect_error([&] { (void)s.key_runs(0, 0); }, "valid during a forward");
      // RandomLLM: several pending rotations (post-RoPE); pre-RoPE: maximal runs of live slots.
      if (test.policy == "random_llm" && storage == kvevict::KeyStorage::post_rope) {
        EXPECT_GT(most_runs, 2u);
      }
      if (test.policy == "window") {
        EXPECT_GT(full_steps, 100);
      }
    }
  }
  SequenceConfig off = config(1, 1, 1);
  off.attention_views = false;
  Sequence s(off, kvevict::make_policy("window", kvevict::budget_params("window", 4)));
  s.begin_chunk(ids(1));
  expect_error([&] { (void)s.live_mask(0, 0); }, "attention_views is off");
}

// The rows' shape is the sequence's own (query heads, each KV head's slots); what the engine gives
// (data, query count, stride) is checked against it, and a refused call records nothing.
TEST(Sequence, AttentionRowsOfTheWrongCountOrStrideAreErrors) {
  Sequence s(config(1, 2, 1), kvevict::make_policy("h2o", kvevict::budget_params("h2o", 4)));
  s.begin_chunk(ids(3));
  EXPECT_EQ(s.attention_queries(), 3);  // H2O reads every query of the chunk
  std::vector<float> rows(2 * 3 * 3, 0.0f);
  for (int h = 0; h < 2; ++h) {
    for (int q = 0; q < 3; ++q) {
      for (int k = 0; k <= q; ++k)
        rows[static_cast<std::size_t>((h * 3 + q) * 3 + k)] = 1.0f / (q + 1);
    }
  }
  expect_error([&] { s.observe_attention(0, rows.data(), 1, 3); },
               "policy 'h2o' reads 3 query rows per query head, got 1");
  expect_error([&] { s.observe_attention(0, rows.data(), 3, 2); },
               "row_stride (2) is shorter than the 3 slots of KV head 0");
  expect_error([&] { s.observe_attention(0, nullptr, 3, 3); }, "attention rows are null");
  s.observe_attention(0, rows.data(), 3, 3);
  s.end_forward();

  Sequence tova(config(1, 2, 1), kvevict::make_policy("tova", kvevict::budget_params("tova", 4)));
  tova.begin_chunk(ids(3));
  EXPECT_EQ(tova.attention_queries(), 1);  // TOVA reads the last query; more rows are accepted
  tova.observe_attention(0, rows.data(), 3, 3);
  tova.end_forward();
  Sequence window(config(1, 2, 1),
                  kvevict::make_policy("window", kvevict::budget_params("window", 4)));
  window.begin_chunk(ids(1));
  EXPECT_FALSE(window.wants_attention());
  EXPECT_EQ(window.attention_queries(), 0);
}

// ---------------------------------------------------------------------------------------------
// Signal values: checked before a policy stores any (NaN or infinite scores, NaN catalyst rows)
// ---------------------------------------------------------------------------------------------

// Every score of every unit, as bits (NaN marks "not observed" in some columns).
std::vector<std::uint32_t> score_bits(const Sequence& s) {
  std::vector<std::uint32_t> out;
  for (int unit = 0; unit < s.slots().layout().units(); ++unit) {
    for (int column = 0; column < s.policy().score_columns(); ++column) {
      for (const float score : kvevict::test::score_column(s.slots(), unit, column)) {
        out.push_back(std::bit_cast<std::uint32_t>(score));
      }
    }
  }
  return out;
}

std::string text(float value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  std::ostringstream out;
  out << value;
  return out.str();
}

// Attention values are softmax probabilities, in [0, 1]. H2O sums them for ever and TOVA over the
// layers of a forward: anything else is refused before it reaches the scores, the message names the
// layer, query head, query, slot and value, and the same layer may then be observed again. The
// result is that of a sequence that never saw the bad rows.
TEST(Sequence, AttentionOutsideZeroToOneIsRefusedBeforeThePolicyStoresIt) {
  const float inf = std::numeric_limits<float>::infinity();
  const kvevict::test::HeadRows good{{1.0f, 0.0f, 0.0f}, {0.5f, 0.5f, 0.0f}, {0.2f, 0.3f, 0.5f}};
  for (const std::string name : {"h2o", "tova"}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf, -0.25f, 1.5f}) {
      SCOPED_TRACE(name + " with " + text(bad));
      const auto make = [&] {
        return Sequence(config(2, 2, 1),
                        kvevict::make_policy(name, kvevict::budget_params(name, 2)));
      };
      Sequence s = make();
      Sequence clean = make();
      kvevict::test::SlotRows rows;
      for (Sequence* sequence : {&s, &clean}) sequence->begin_chunk(ids(3));
      // TOVA reads only the last query: the bad value goes there, in query head 1, token 1.
      kvevict::test::LayerRows poisoned = kvevict::test::every_head(2, good);
      poisoned[1][2][1] = bad;
      const std::vector<std::uint32_t> before = score_bits(s);
      const std::int32_t slot = s.chunk_slots(0, 0)[1];
      expect_error([&] { observe_attention(s, 0, rows.make(s, 0, poisoned, 0)); },
                   "observe_attention: layer 0, query head 1, query 2 (original position 2), "
                   "slot " +
                       std::to_string(slot) + ": " + text(bad) +
                       " is not an attention probability in [0, 1]; nothing was recorded");
      EXPECT_EQ(score_bits(s), before);
      for (Sequence* sequence : {&s, &clean}) {
        for (int layer = 0; layer < 2; ++layer) {
          observe_attention(*sequence, layer,
                            rows.make(*sequence, layer, kvevict::test::every_head(2, good), 0));
        }
        sequence->end_forward();
      }
      EXPECT_EQ(score_bits(s), score_bits(clean));
      // H2O (heavy 1, recent 1) sums every row: token 0 has 1.7 per head, token 1 0.8. TOVA reads
      // the last row: 0.2, 0.3, 0.5.
      EXPECT_EQ(kvevict::test::kept_positions(s.slots(), 0),
                (name == "h2o" ? Positions{0, 2} : Positions{1, 2}));
    }
  }
}

// Surprisal is -log p. NaN is refused before SirLLM keeps it for its next turns (where it made
// every later decision fail) or InfiniPot for its next distillation; +inf (p = 0) is accepted and
// ranks first.
TEST(Sequence, NaNSurprisalIsRefusedBeforeThePolicyStoresIt) {
  for (const std::string name : {"sirllm", "infinipot"}) {
    SCOPED_TRACE(name);
    Sequence s(
        config(1, 1, 1),
        name == "sirllm"
            ? kvevict::make_policy("sirllm", PolicyParams().set("sinks", 0).set("entropy", 4))
            : kvevict::make_policy("infinipot", PolicyParams().set("pot", 8).set("keep", 4)));
    s.begin_chunk(ids(3), true);
    const std::vector<std::uint32_t> before = score_bits(s);
    expect_error(
        [&] {
          s.observe_surprisal(
              std::vector<float>{0.5f, std::numeric_limits<float>::quiet_NaN(), 0.5f});
        },
        "observe_surprisal: the surprisal of token 1 of the chunk (original position 1) is NaN; "
        "nothing was recorded");
    EXPECT_EQ(score_bits(s), before);
    s.observe_surprisal(std::vector<float>{0.5f, std::numeric_limits<float>::infinity(), 0.25f});
    s.end_forward();
    if (name == "sirllm") {
      // A turn of 2 leaves room for 2 of the 3 tokens: the highest surprisals, +inf and 0.5.
      s.begin_chunk(ids(2), true);
      EXPECT_EQ(kvevict::test::kept_positions(s.slots(), 0), (Positions{0, 1, 3, 4}));
    }
  }
}

// InfiniPot's catalyst rows alike: refused when observed, so the distillation after them never
// fails half-way (as it did with NaN catalyst rows: the catalyst was rolled back, the pot not
// distilled, and the engine never told).
TEST(Sequence, CatalystAttentionOutsideZeroToOneIsRefusedWhenObserved) {
  RecordingBackend backend;
  Sequence s(config(1, 1, 1),
             kvevict::make_policy("infinipot",
                                  PolicyParams().set("pot", 4).set("keep", 2).set("novel", 0)),
             &backend);
  s.begin_chunk(ids(4), true);
  s.observe_surprisal(std::vector<float>{1.0f, 1.0f, 1.0f, 1.0f});
  s.end_forward();
  ASSERT_TRUE(s.catalyst_pending());
  s.begin_catalyst(ids(2, 90));
  // Two catalyst queries over the 4 pot tokens and the 2 catalyst tokens: pot tokens 1 and 2 get
  // 0.7 and 0.5, tokens 0 and 3 0.4 and 0.3.
  kvevict::test::LayerRows rows{
      {{0.1f, 0.6f, 0.1f, 0.2f, 0.0f, 0.0f}, {0.3f, 0.1f, 0.4f, 0.1f, 0.1f, 0.0f}}};
  kvevict::test::LayerRows poisoned = rows;
  poisoned[0][1][3] = std::numeric_limits<float>::quiet_NaN();
  kvevict::test::SlotRows slot_rows;
  expect_error([&] { observe_catalyst(s, 0, slot_rows.make(s, 0, poisoned, 4)); },
               "observe_catalyst: layer 0, query head 0, query 1 (original position 5), slot " +
                   std::to_string(s.slots().stream_order(0)[3]) + ": NaN is not an attention");
  observe_catalyst(s, 0, slot_rows.make(s, 0, rows, 4));
  s.end_catalyst();
  EXPECT_EQ(backend.applies, 1);
  EXPECT_EQ(backend.evicted, 2 + 2);  // the catalyst and the pot's two least attended
  EXPECT_EQ(kvevict::test::kept_positions(s.slots(), 0), (Positions{1, 2}));
}

// ---------------------------------------------------------------------------------------------
// Capacity
// ---------------------------------------------------------------------------------------------

TEST(EvictingCache, BoundedPolicyNeverReallocates) {
  CacheConfig c;
  c.shape = CacheShape{1, 2, 1, 8};
  c.sequence.max_chunk = 4;
  EvictingCache cache(
      c, kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 12)));
  EXPECT_EQ(cache.store().capacity(), 4 + 12 + 4);
  const std::size_t reserved = cache.memory().reserved_bytes;
  std::mt19937 rng(1);
  for (int step = 0; step < 1000; ++step) {
    const int n = 1 + step % 4;
    cache.sequence().begin_chunk(ids(n));
    cache.write_chunk(0, 0, Matrix::Random(n, 8), Matrix::Random(n, 8));
    cache.sequence().end_forward();
  }
  EXPECT_EQ(cache.memory().reserved_bytes, reserved);
  EXPECT_EQ(cache.sequence().live(0, 0), 16);
  // Peak: 16 cached + a chunk of 4, with one metadata row (token granularity) per slot.
  EXPECT_EQ(cache.memory().peak_kv_bytes, 20 * cache.store().kv_bytes_per_slot());
  EXPECT_EQ(cache.memory().peak_live_bytes,
            20 * (cache.store().kv_bytes_per_slot() + cache.sequence().slots().bytes_per_slot()));
}

TEST(EvictingCache, UnboundedPolicyGrowsAndKeepsContents) {
  CacheConfig c;
  c.shape = CacheShape{1, 1, 1, 4};
  EvictingCache cache(c, kvevict::make_policy("full"));
  std::vector<float> first_key;
  for (int step = 0; step < 700; ++step) {
    cache.sequence().begin_chunk(ids(1));
    const Matrix k = Matrix::Random(1, 4);
    if (step == 0) first_key.assign(k.data(), k.data() + 4);
    cache.write_chunk(0, 0, k, k);
    cache.sequence().end_forward();
  }
  EXPECT_EQ(cache.sequence().live(0, 0), 700);
  EXPECT_GE(cache.store().capacity(), 700);
  EXPECT_GT(cache.store().bytes_copied(), 0u);  // grown geometrically: 256, 512, 1024
  // Pre-RoPE storage: the first token's key is stored as written, in slot 0.
  for (int col = 0; col < 4; ++col) {
    EXPECT_EQ(cache.keys(0, 0)(0, col), first_key[static_cast<std::size_t>(col)]);
  }
}

// Exact byte accounting: keys + values = 2 * head_dim * 4 per head; metadata = original position
// (8), token id (4), group id (4), flags (1), and 4 per score column plus 4 for the spare column
// beside them (SlotTable::spare_scores; H2O has one score column), once per unit.
TEST(EvictingCache, MemoryAccountingIsExact) {
  CacheConfig c;
  c.shape = CacheShape{2, 4, 2, 16};
  c.sequence.max_chunk = 8;
  EvictingCache cache(c, kvevict::make_policy("h2o", kvevict::budget_params("h2o", 8)));
  EXPECT_EQ(cache.store().kv_bytes_per_slot(), 2u * 16 * 4);
  EXPECT_EQ(cache.sequence().slots().bytes_per_slot(), 8u + 4 + 4 + 1 + 4 + 4);
  cache.sequence().begin_chunk(ids(5));
  // 5 tokens x 4 heads (per-head units: 4 metadata rows each).
  EXPECT_EQ(cache.memory().live_kv_bytes, 5u * 4 * 128);
  EXPECT_EQ(cache.memory().live_metadata_bytes, 5u * 4 * 25);
  EXPECT_EQ(cache.memory().reserved_bytes, 16u * 4 * 128 + 16u * 4 * 25);
}

// ---------------------------------------------------------------------------------------------
// Triggers
// ---------------------------------------------------------------------------------------------

// A test policy with a pot: when M tokens are cached it asks for a catalyst, then keeps the C pot
// tokens the catalyst attended to most.
class TestPotPolicy final : public kvevict::Policy {
 public:
  TestPotPolicy(int pot, int keep) : pot_(pot), keep_(keep) {}
  std::string_view name() const override { return "test_pot"; }
  kvevict::SignalSet signals() const override { return {kvevict::Signal::catalyst_attention}; }
  kvevict::TriggerSet triggers() const override { return {kvevict::Trigger::pot_full}; }
  int score_columns() const override { return 1; }
  PositionMode default_position_mode() const override { return PositionMode::reset_on_compact; }
  std::optional<int> pot_room(const SlotTable& slots) const override {
    return pot_ - slots.max_live();
  }
  void observe_catalyst(SlotTable& slots, int layer, const kvevict::AttentionRows& rows) override {
    (void)kvevict::add_attention(rows, 0, rows.q_heads(), 1.0f, slots.scores(layer, 0));
  }
  void select(const kvevict::EvictionContext& context, kvevict::Decision& decision) override {
    last_trigger = context.trigger;
    keep_set_.begin(context.slots, 0, context.protection);
    keep_set_.keep_top_k(context.slots.scores(0, 0), keep_);
    keep_set_.evict_rest(decision);
  }
  kvevict::Trigger last_trigger = kvevict::Trigger::after_forward;

 private:
  int pot_, keep_;
  kvevict::KeepSet keep_set_;
};

TEST(Sequence, CatalystIsAttendedRolledBackAndDistilled) {
  RecordingBackend backend;
  auto owned = std::make_unique<TestPotPolicy>(6, 3);
  TestPotPolicy* policy = owned.get();
  Sequence s(config(1, 1, 1), std::move(owned), &backend);
  EXPECT_EQ(s.position_mode(), PositionMode::reset_on_compact);
  s.begin_chunk(std::vector<std::int32_t>{10, 11, 12, 13, 14, 15}, true);
  s.end_forward();
  EXPECT_EQ(backend.applies, 0);  // no after_forward trigger
  ASSERT_TRUE(s.catalyst_pending());

  s.begin_catalyst(std::vector<std::int32_t>{90, 91});
  EXPECT_EQ(s.live(0, 0), 8);
  const std::int32_t first_catalyst_slot = s.chunk_slots(0, 0)[0];
  EXPECT_NE(s.slots().flags(0)[static_cast<std::size_t>(first_catalyst_slot)] &
                kvevict::slot_flag::catalyst,
            0);
  EXPECT_EQ(s.position(0, 0, s.chunk_slots(0, 0)[1]), 7);  // the catalyst continues the positions
  // Two catalyst queries over the 6 pot tokens and 2 catalyst tokens (stream order). Mass on pot
  // tokens 1, 4, 5 sums to 0.9, 0.5 + 0.2, 0.3: those three win.
  const kvevict::test::LayerRows rows{{{0.0f, 0.5f, 0.0f, 0.0f, 0.2f, 0.3f, 0.0f, 0.0f},
                                       {0.0f, 0.4f, 0.0f, 0.0f, 0.0f, 0.0f, 0.3f, 0.3f}}};
  kvevict::test::SlotRows slot_rows;
  observe_catalyst(s, 0, slot_rows.make(s, 0, rows, 6));
  s.end_catalyst();
  EXPECT_EQ(policy->last_trigger, kvevict::Trigger::pot_full);
  EXPECT_EQ(backend.applies, 1);  // the roll back and the distillation in one call
  EXPECT_EQ(backend.evicted, 2 + 3);
  EXPECT_EQ(kvevict::test::kept_positions(s.slots(), 0), (Positions{1, 4, 5}));
  EXPECT_EQ(kvevict::test::rope_positions(s.slots(), 0), (Positions{0, 1, 2}));
  // New tokens continue from C = 3, original positions from 6 (the catalyst never counted).
  s.begin_chunk(std::vector<std::int32_t>{16});
  EXPECT_EQ(s.position(0, 0, s.chunk_slots(0, 0)[0]), 3);
  EXPECT_EQ(s.slots().original_positions(0)[static_cast<std::size_t>(s.chunk_slots(0, 0)[0])], 6);
  EXPECT_EQ(*s.pot_room(), 2);
  EXPECT_EQ(s.stats().catalyst_runs, 1);
  EXPECT_EQ(s.stats().evicted_slots, 3);  // rolled-back catalyst slots are not evictions
}

// before_turn fires only at a turn start, and knows the incoming size.
class MakeRoomPolicy final : public kvevict::Policy {
 public:
  explicit MakeRoomPolicy(int capacity) : capacity_(capacity) {}
  std::string_view name() const override { return "make_room"; }
  kvevict::TriggerSet triggers() const override { return {kvevict::Trigger::before_turn}; }
  void select(const kvevict::EvictionContext& context, kvevict::Decision& decision) override {
    seen_incoming.push_back(context.incoming);
    keep_set_.begin(context.slots, 0, context.protection);
    keep_set_.keep_newest(capacity_ - context.incoming);
    keep_set_.evict_rest(decision);
  }
  std::vector<int> seen_incoming;

 private:
  int capacity_;
  kvevict::KeepSet keep_set_;
};

TEST(Sequence, BeforeTurnMakesRoomForTheIncomingTurn) {
  auto owned = std::make_unique<MakeRoomPolicy>(10);
  MakeRoomPolicy* policy = owned.get();
  SequenceConfig c = config(1, 1, 1, 8);
  c.position_mode = PositionMode::original;
  Sequence s(c, std::move(owned));
  for (int n : {6, 3}) {
    s.begin_chunk(ids(n), true);  // 0 + 6 and 6 + 3 fit in 10
    s.end_forward();
  }
  EXPECT_EQ(s.stats().decisions, 0);
  s.begin_chunk(ids(2), false);  // not a turn start: no trigger
  s.end_forward();
  EXPECT_EQ(s.live(0, 0), 11);
  s.begin_chunk(ids(4), true);  // keep the last 10 - 4, then the turn
  EXPECT_EQ(s.stats().decisions, 1);
  EXPECT_EQ(kvevict::test::kept_positions(s.slots(), 0).front(), 5);
  EXPECT_EQ(s.live(0, 0), 6 + 4);
  EXPECT_EQ(policy->seen_incoming, (std::vector<int>{6, 3, 4}));
  EXPECT_EQ(s.stats().turns, 3);
}

// cache_index and reset_on_compact assign the same positions: checked on an irregular pattern.
TEST(Sequence, CacheIndexAndResetOnCompactAgree) {
  const PolicyParams params = PolicyParams().set("sinks", 3).set("recent", 7);
  SequenceConfig a = config(1, 1, 1, 16);
  a.position_mode = PositionMode::cache_index;
  SequenceConfig b = a;
  b.position_mode = PositionMode::reset_on_compact;
  Sequence sa(a, kvevict::make_policy("streaming_llm", params));
  Sequence sb(b, kvevict::make_policy("streaming_llm", params));
  for (int n : {5, 1, 9, 1, 1, 13, 2, 1}) {
    feed(sa, n);
    feed(sb, n);
    EXPECT_EQ(kvevict::test::rope_positions(sa.slots(), 0),
              kvevict::test::rope_positions(sb.slots(), 0));
  }
}

// Policies are per-sequence objects: interleaving two sequences changes nothing.
TEST(Sequence, SequencesAreIndependent) {
  const PolicyParams params = PolicyParams().set("sinks", 1).set("recent", 4);
  Sequence alone(config(1, 1, 1), kvevict::make_policy("streaming_llm", params));
  Sequence x(config(1, 1, 1), kvevict::make_policy("streaming_llm", params));
  Sequence y(config(1, 1, 1), kvevict::make_policy("streaming_llm", params));
  for (int step = 0; step < 20; ++step) {
    for (Sequence* s : {&alone, &x, &y, &y}) feed(*s, 1);
  }
  EXPECT_EQ(kvevict::test::kept_positions(alone.slots(), 0),
            kvevict::test::kept_positions(x.slots(), 0));
  EXPECT_EQ(kvevict::test::kept_positions(y.slots(), 0).back(), 39);
}

// ---------------------------------------------------------------------------------------------
// Granularity
// ---------------------------------------------------------------------------------------------

TEST(Granularity, UnitsAndTheirHeads) {
  const kvevict::UnitLayout head(3, 2, kvevict::Granularity::head);
  const kvevict::UnitLayout layer(3, 2, kvevict::Granularity::layer);
  const kvevict::UnitLayout token(3, 2, kvevict::Granularity::token);
  EXPECT_EQ(head.units(), 6);
  EXPECT_EQ(layer.units(), 3);
  EXPECT_EQ(token.units(), 1);
  EXPECT_EQ(head.unit_of(2, 1), 5);
  EXPECT_EQ(layer.unit_of(2, 1), 2);
  EXPECT_EQ(token.unit_of(2, 1), 0);
  EXPECT_EQ(layer.heads_per_unit(), 2);
  EXPECT_EQ(token.heads_per_unit(), 6);
  EXPECT_EQ(kvevict::parse_granularity("layer"), kvevict::Granularity::layer);
  expect_error([] { (void)kvevict::parse_granularity("block"); }, "unknown granularity 'block'");
  expect_error([] { kvevict::UnitLayout(1 << 11, 1 << 10, kvevict::Granularity::head); },
               "layers * kv_heads exceeds");
}

// The policy's granularity is the default; an engine whose cells are shared by every head asks
// for token granularity and gets one keep-set (H2O then sums its scores over every head).
TEST(Granularity, AnEngineMayAskForOneKeepSetPerSequence) {
  SequenceConfig c = config(2, 2, 2);
  c.granularity = kvevict::Granularity::token;
  Sequence s(c, kvevict::make_policy("h2o", PolicyParams().set("heavy", 1).set("recent", 1)));
  EXPECT_EQ(s.slots().layout().units(), 1);
  s.begin_chunk(ids(3));
  // Token 0 gets .9 in layer 0, token 1 gets .9 in layer 1, from both KV heads: summed over the
  // model, 0 has 1.8 + .2 * 2, 1 has .1 * 2 + 1.8 -> equal; ties go to the lower position.
  kvevict::test::SlotRows rows;
  const kvevict::test::LayerRows first =
      kvevict::test::every_head(2, {{1.0f}, {0.5f, 0.5f}, {0.9f, 0.1f, 0.0f}});
  const kvevict::test::LayerRows second =
      kvevict::test::every_head(2, {{1.0f}, {0.5f, 0.5f}, {0.1f, 0.9f, 0.0f}});
  observe_attention(s, 0, rows.make(s, 0, first, 0));
  observe_attention(s, 1, rows.make(s, 1, second, 0));
  s.end_forward();
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g)
      EXPECT_EQ(kvevict::test::kept_positions(s.slots(), s.unit_of(l, g)), (Positions{0, 2}));
  }
}

// ---------------------------------------------------------------------------------------------
// Stage timing
// ---------------------------------------------------------------------------------------------

TEST(StageClock, NestedStagesAreChargedToTheInnermost) {
  kvevict::StageClock clock;
  {
    const kvevict::StageScope attention(&clock, kvevict::Stage::attention);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    {
      const kvevict::StageScope policy(&clock, kvevict::Stage::policy);
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
    }
  }
  // Attention holds only its own ~20 ms; the 40 ms inside went to policy.
  EXPECT_GE(clock.seconds(kvevict::Stage::policy), 0.035);
  EXPECT_GE(clock.seconds(kvevict::Stage::attention), 0.015);
  EXPECT_LT(clock.seconds(kvevict::Stage::attention), 0.035);
  EXPECT_DOUBLE_EQ(clock.seconds(), clock.seconds(kvevict::Stage::attention) +
                                        clock.seconds(kvevict::Stage::policy));
  const kvevict::StageScope nothing(nullptr, kvevict::Stage::head);  // no observer: no effect
}

// ---------------------------------------------------------------------------------------------
// Misuse
// ---------------------------------------------------------------------------------------------

TEST(Sequence, ClearErrorsForBadConfigurations) {
  expect_error([] { Sequence(config(0, 1, 1), kvevict::make_policy("full")); },
               "layers must be positive");
  expect_error([] { Sequence(config(1, 4, 3), kvevict::make_policy("full")); },
               "must be a positive multiple of kv_heads");
  expect_error([] { Sequence(config(1, 1, 1), nullptr); }, "policy is null");
  SequenceConfig c = config(1, 1, 1);
  c.max_chunk = 0;
  expect_error([&] { Sequence(c, kvevict::make_policy("full")); }, "max_chunk must be in [1, ");
  // A budget near INT_MAX plus a chunk does not wrap around: it is refused.
  c.max_chunk = 64;
  expect_error(
      [&] { Sequence(c, kvevict::make_policy("window", PolicyParams().set("recent", 268435450))); },
      "retained limit + max_chunk exceeds");
  CacheConfig cache;
  cache.shape = CacheShape{1, 4, 2, 8};
  cache.rope.head_dim = 16;
  expect_error([&] { EvictingCache(cache, kvevict::make_policy("full")); },
               "rope.head_dim (16) differs");
}

// Slots 1, 3 and 5 freed in that order (one evict() each; slot k holds position k):
// the stack gives them back 5, 3, 1 (newest freed first), the heap 1, 3, 5, as llama.cpp fills
// freed cells from the lowest; then the slots never used, from 8.
TEST(SlotTable, FreeSlotsAreReusedInTheTablesOrder) {
  const auto reused = [](kvevict::SlotReuse reuse) {
    SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original,
                    16, 0, reuse);
    std::vector<std::int32_t> out(8);
    slots.append(0, Positions{0, 1, 2, 3, 4, 5, 6, 7}, std::vector<std::int32_t>(8, 0),
                 std::vector<std::uint8_t>(8, 0), out);
    slots.evict(0, std::vector<std::int32_t>{1});
    slots.evict(0, std::vector<std::int32_t>{3});
    slots.evict(0, std::vector<std::int32_t>{5});
    out.resize(4);
    slots.append(0, Positions{8, 9, 10, 11}, std::vector<std::int32_t>(4, 0),
                 std::vector<std::uint8_t>(4, 0), out);
    return out;
  };
  EXPECT_EQ(reused(kvevict::SlotReuse::newest_freed_first),
            (std::vector<std::int32_t>{5, 3, 1, 8}));
  EXPECT_EQ(reused(kvevict::SlotReuse::lowest_first), (std::vector<std::int32_t>{1, 3, 5, 8}));
}

// Six tokens (slot k holds position k, score 10 k) under cache_index, 1 and 3 evicted: live 4,
// slots [0, 6) in use. compact() moves the live slots at or above 4 (4 and 5) into the holes below
// 4 (1 and 3), in ascending order: 4 -> 1, 5 -> 3. Everything a token has moves with it: its
// original position, score and RoPE position (the ranks 2 and 3 of positions 4 and 5); the stream
// order reads slots 0, 2, 1, 3; the next token takes slot 4.
TEST(SlotTable, CompactMovesTheNewestLiveSlotsIntoTheHoles) {
  SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::cache_index,
                  16, 1);
  std::vector<std::int32_t> out(6);
  slots.append(0, Positions{0, 1, 2, 3, 4, 5}, std::vector<std::int32_t>{10, 11, 12, 13, 14, 15},
               std::vector<std::uint8_t>(6, 0), out);
  for (int s = 0; s < 6; ++s) slots.scores(0, 0)[static_cast<std::size_t>(s)] = 10.0f * s;
  slots.evict(0, std::vector<std::int32_t>{1, 3});
  const std::int64_t position_of_4 = slots.position(0, 4);
  const std::int64_t position_of_5 = slots.position(0, 5);
  EXPECT_EQ(position_of_4, 2);
  EXPECT_EQ(position_of_5, 3);
  std::vector<kvevict::SlotMove> moves;
  slots.compact(0, moves);
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0].from, 4);
  EXPECT_EQ(moves[0].to, 1);
  EXPECT_EQ(moves[1].from, 5);
  EXPECT_EQ(moves[1].to, 3);
  EXPECT_EQ(slots.slot_limit(0), 4);
  EXPECT_EQ(slots.live(0), 4);
  EXPECT_EQ(std::vector<std::int32_t>(slots.stream_order(0).begin(), slots.stream_order(0).end()),
            (std::vector<std::int32_t>{0, 2, 1, 3}));
  EXPECT_EQ(slots.original_positions(0)[1], 4);
  EXPECT_EQ(slots.original_positions(0)[3], 5);
  EXPECT_EQ(slots.token_ids(0)[1], 14);
  EXPECT_EQ(slots.token_ids(0)[3], 15);
  EXPECT_EQ(slots.scores(0, 0)[1], 40.0f);
  EXPECT_EQ(slots.scores(0, 0)[3], 50.0f);
  EXPECT_EQ(slots.position(0, 1), position_of_4);
  EXPECT_EQ(slots.position(0, 3), position_of_5);
  EXPECT_FALSE(slots.is_live(0, 4));
  slots.compact(0, moves);  // nothing left to move
  EXPECT_EQ(moves.size(), 2u);
  out.resize(1);
  slots.append(0, Positions{6}, std::vector<std::int32_t>{16}, std::vector<std::uint8_t>(1, 0),
               out);
  EXPECT_EQ(out[0], 4);
  EXPECT_EQ(slots.position(0, 4), 4);  // rank 4 of five
}

TEST(SlotTable, RejectsBadChanges) {
  SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original, 4,
                  0);
  std::vector<std::int32_t> out(4);
  slots.append(0, Positions{0, 1, 2}, std::vector<std::int32_t>(3, 0),
               std::vector<std::uint8_t>(3, 0), out);
  expect_error(
      [&] {
        slots.append(0, Positions{3, 4}, std::vector<std::int32_t>(2, 0),
                     std::vector<std::uint8_t>(2, 0), out);
      },
      "would exceed its capacity");
  expect_error(
      [&] {
        slots.append(0, Positions{1}, std::vector<std::int32_t>(1, 0),
                     std::vector<std::uint8_t>(1, 0), out);
      },
      "original positions must increase");
  slots.evict(0, std::vector<std::int32_t>{1});
  expect_error([&] { slots.evict(0, std::vector<std::int32_t>{1}); }, "not live");
  expect_error([&] { slots.truncate(0, 3); }, "outside [0, 2]");
  expect_error(
      [] {
        SlotTable(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original, 0,
                  0);
      },
      "capacity must be positive");
}

// StreamOrder::find, which applying every decision goes through, finds every live entry and no
// absent one: originals dense, sparse, in runs with gaps of every size (up to near the largest
// int64), or packed just below the largest int64, over orders of 0 to 3,000 entries.
TEST(StreamOrder, FindsEveryEntryAndNoOther) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = trial < 20 ? trial : static_cast<int>(rng() % 3000);
    const bool near_largest = trial % 7 == 6;
    std::vector<std::int64_t> originals(static_cast<std::size_t>(n));
    std::int64_t next = near_largest ? std::numeric_limits<std::int64_t>::max() - 10'000
                                     : static_cast<std::int64_t>(rng() % 100);
    for (std::int64_t& original : originals) {
      original = next;
      const unsigned kind = static_cast<unsigned>(rng() % 10);
      next += near_largest ? 1 + static_cast<std::int64_t>(kind % 3)
              : kind < 6   ? 1
              : kind < 9   ? 2 + static_cast<std::int64_t>(rng() % 50)
                           : static_cast<std::int64_t>(rng() % (std::int64_t{1} << 40)) + 1;
    }
    // Slots are a shuffle: the order maps stream index to slot.
    std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<std::int64_t> by_slot(static_cast<std::size_t>(n));
    kvevict::detail::StreamOrder order;
    order.reserve(n);
    for (int i = 0; i < n; ++i) {
      by_slot[static_cast<std::size_t>(slots[static_cast<std::size_t>(i)])] =
          originals[static_cast<std::size_t>(i)];
      order.push_back(slots[static_cast<std::size_t>(i)]);
    }
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(order.find(originals[static_cast<std::size_t>(i)], by_slot.data()), i);
      const std::int64_t absent = originals[static_cast<std::size_t>(i)] + 1;
      if (i + 1 == n || originals[static_cast<std::size_t>(i) + 1] != absent) {
        ASSERT_EQ(order.find(absent, by_slot.data()), -1);
      }
    }
    if (n > 0) {
      EXPECT_EQ(order.find(originals.front() - 1, by_slot.data()), -1);
      EXPECT_EQ(order.find(std::numeric_limits<std::int64_t>::max(), by_slot.data()),
                originals.back() == std::numeric_limits<std::int64_t>::max() ? n - 1 : -1);
    }
  }
}

// StreamOrder leaves a gap where it removes an entry and moves it to the next removal (or closes
// it, whichever shifts fewer entries): whatever the removals, every reader sees the entries of a
// plain sorted list with the same pushes and removals. Removals come in the patterns of the
// policies (at one stream index step after step as H2O's, the oldest non-sink as a window's, the
// newest as a rolled-back catalyst's) and at random, with growth, pop_back and find between them.
// A view() makes the next removal leave the order in one piece.
TEST(StreamOrder, ReadsAsAListWhereverItsGapIs) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    kvevict::detail::StreamOrder order;
    std::vector<std::int32_t> list;  // the model
    std::vector<std::int64_t> originals;
    int capacity = 1 + static_cast<int>(rng() % 300);
    order.reserve(capacity);
    const int pattern = trial % 4;
    const int fixed_index = static_cast<int>(rng() % static_cast<unsigned>(capacity));
    for (int step = 0; step < 600; ++step) {
      const unsigned op = static_cast<unsigned>(rng() % 16);
      const int n = static_cast<int>(list.size());
      if (n < capacity && (op < 7 || n == 0)) {
        const auto slot = static_cast<std::int32_t>(originals.size());
        originals.push_back(static_cast<std::int64_t>(slot) * 3);  // ascending, with gaps
        order.push_back(slot);
        list.push_back(slot);
      } else if (op < 13) {
        const int i = pattern == 0   ? std::min(fixed_index, n - 1)
                      : pattern == 1 ? std::min(4, n - 1)
                      : pattern == 2 ? n - 1
                                     : static_cast<int>(rng() % static_cast<unsigned>(n));
        order.erase(i);
        list.erase(list.begin() + i);
      } else if (op == 13) {
        const std::span<const std::int32_t> view = order.view();
        ASSERT_TRUE(std::equal(view.begin(), view.end(), list.begin(), list.end()));
        if (n >= 3) {  // the next removal, in the middle, leaves one piece
          order.erase(n / 2);
          list.erase(list.begin() + n / 2);
          EXPECT_TRUE(order.pieces().back.empty());
        }
      } else if (op == 14) {
        const int count = static_cast<int>(rng() % static_cast<unsigned>(std::min(n, 3) + 1));
        order.pop_back(count);
        list.resize(list.size() - static_cast<std::size_t>(count));
      } else {
        capacity += 7;
        order.reserve(capacity);
      }
      const kvevict::detail::StreamOrderPieces pieces = order.pieces();
      ASSERT_EQ(order.size(), static_cast<int>(list.size()));
      ASSERT_EQ(pieces.size(), static_cast<int>(list.size()));
      for (int i = 0; i < order.size(); ++i) {
        ASSERT_EQ(order[i], list[static_cast<std::size_t>(i)]) << "trial " << trial;
        ASSERT_EQ(pieces[i], list[static_cast<std::size_t>(i)]);
      }
      if (!list.empty()) {
        const int i = static_cast<int>(rng() % list.size());
        ASSERT_EQ(order.find(originals[static_cast<std::size_t>(list[static_cast<std::size_t>(i)])],
                             originals.data()),
                  i);
        ASSERT_EQ(
            order.find(originals[static_cast<std::size_t>(list[static_cast<std::size_t>(i)])] + 1,
                       originals.data()),
            -1);
      }
    }
  }
}

// H2O's pattern (one push, one removal at the same stream index) moves no entry once the gap is
// open: the order stays in two pieces around it, until the buffer's room behind runs out.
TEST(StreamOrder, RemovalsAtOneIndexLeaveTheGapOpen) {
  kvevict::detail::StreamOrder order;
  order.reserve(100);
  for (std::int32_t slot = 0; slot < 100; ++slot) order.push_back(slot);
  for (int step = 0; step < 50; ++step) {
    order.erase(60);
    order.push_back(100 + step);
    const kvevict::detail::StreamOrderPieces pieces = order.pieces();
    ASSERT_EQ(pieces.front.size(), 60U);
    ASSERT_EQ(pieces.back.size(), 40U);
    ASSERT_EQ(pieces.front.back(), 59);
    ASSERT_EQ(pieces.back.front(), 61 + step);
  }
}

// SlotTable::locate_oldest runs every unit's halving search side by side: each unit's result is
// the stream index of the oldest slot it evicts (the slot found there is that slot), -1 for a
// unit that evicts nothing, over units of 0 to 600 live tokens (the slots a shuffle, the originals
// with gaps) and 1 to 3 evictions each. evict() with that index, or with a stale one, leaves the
// same stream order as a search would.
TEST(SlotTable, LocateOldestFindsEachUnitsOldestEvictedSlot) {
  std::mt19937_64 rng(5);
  constexpr int kUnits = 12;
  for (int trial = 0; trial < 40; ++trial) {
    SlotTable located(kvevict::UnitLayout(kUnits, 1, kvevict::Granularity::head),
                      PositionMode::original, 600, 0);
    SlotTable searched(kvevict::UnitLayout(kUnits, 1, kvevict::Granularity::head),
                       PositionMode::original, 600, 0);
    std::vector<std::vector<std::int32_t>> evicted(kUnits);
    for (int unit = 0; unit < kUnits; ++unit) {
      const int n = unit == 0 ? 0 : static_cast<int>(rng() % 601);
      Positions originals(static_cast<std::size_t>(n));
      std::int64_t next = static_cast<std::int64_t>(rng() % 50);
      for (std::int64_t& original : originals) {
        original = next;
        next += 1 + static_cast<std::int64_t>(rng() % 3);
      }
      std::vector<std::int32_t> out(static_cast<std::size_t>(n));
      for (SlotTable* table : {&located, &searched}) {
        table->append(unit, originals, std::vector<std::int32_t>(out.size(), 0),
                      std::vector<std::uint8_t>(out.size(), 0), out);
      }
      // Free slots in a scattered order, so that stream order and slot order differ.
      if (n > 8) {
        const std::vector<std::int32_t> holes{1, 5, 3};
        for (SlotTable* table : {&located, &searched}) table->evict(unit, holes);
        std::vector<std::int32_t> refill(3);
        Positions newer{next, next + 1, next + 2};
        for (SlotTable* table : {&located, &searched}) {
          table->append(unit, newer, std::vector<std::int32_t>(3, 0),
                        std::vector<std::uint8_t>(3, 0), refill);
        }
      }
      const std::span<const std::int32_t> order = located.stream_order(unit);
      if (unit % 5 == 4 || order.empty()) continue;  // some units evict nothing
      const int count = 1 + static_cast<int>(rng() % 3);
      std::vector<std::int32_t>& slots = evicted[static_cast<std::size_t>(unit)];
      for (int k = 0; k < count; ++k) {
        const std::int32_t slot = order[rng() % order.size()];
        if (std::find(slots.begin(), slots.end(), slot) == slots.end()) slots.push_back(slot);
      }
    }
    std::vector<int> at;
    located.locate_oldest(
        [&](int unit) {
          return std::span<const std::int32_t>(evicted[static_cast<std::size_t>(unit)]);
        },
        at);
    ASSERT_EQ(at.size(), static_cast<std::size_t>(kUnits));
    for (int unit = 0; unit < kUnits; ++unit) {
      const std::vector<std::int32_t>& slots = evicted[static_cast<std::size_t>(unit)];
      if (slots.empty()) {
        EXPECT_EQ(at[static_cast<std::size_t>(unit)], -1);
        continue;
      }
      const std::span<const std::int64_t> originals = located.original_positions(unit);
      const std::int32_t oldest =
          *std::min_element(slots.begin(), slots.end(), [&](std::int32_t a, std::int32_t b) {
            return originals[static_cast<std::size_t>(a)] < originals[static_cast<std::size_t>(b)];
          });
      const std::span<const std::int32_t> order = located.stream_order(unit);
      const int index = at[static_cast<std::size_t>(unit)];
      ASSERT_GE(index, 0);
      ASSERT_LT(index, static_cast<int>(order.size()));
      EXPECT_EQ(order[static_cast<std::size_t>(index)], oldest);
      // The located index, a stale one (the next entry) and none give the same order.
      const int stale = index + 1 < static_cast<int>(order.size()) ? index + 1 : 0;
      located.evict(unit, slots, trial % 2 == 0 ? index : stale);
      searched.evict(unit, slots);
      EXPECT_TRUE(std::ranges::equal(located.stream_order(unit), searched.stream_order(unit)));
    }
  }
}

// SlotTable::generation() changes with what a structure kept beside a unit cannot follow by itself
// (a truncation, a compaction that moves slots, an append at an original seen before), and not
// with evictions and appends above every original the unit has held.
TEST(SlotTable, GenerationChangesOnlyWithWhatAKeptStructureCannotFollow) {
  SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original, 16,
                  1);
  SlotTable other(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original, 16,
                  1);
  EXPECT_NE(slots.generation(0), other.generation(0));
  std::vector<std::int32_t> out(4);
  const auto append = [&](Positions originals) {
    const std::size_t n = originals.size();
    slots.append(0, originals, std::vector<std::int32_t>(n, 0), std::vector<std::uint8_t>(n, 0),
                 out);
  };
  std::uint64_t generation = slots.generation(0);
  append({0, 1, 2, 3});
  slots.evict(0, std::vector<std::int32_t>{1, 3});  // slots 1 and 3 (positions 1 and 3)
  append({4});
  EXPECT_EQ(slots.generation(0), generation);
  slots.evict(0, std::vector<std::int32_t>{out[0]});  // the newest, position 4, then 4 again
  append({4});
  EXPECT_NE(slots.generation(0), generation);
  generation = slots.generation(0);
  std::vector<kvevict::SlotMove> moves;
  slots.compact(0, moves);
  EXPECT_FALSE(moves.empty());
  EXPECT_NE(slots.generation(0), generation);
  generation = slots.generation(0);
  slots.compact(0, moves);  // nothing moves
  EXPECT_EQ(slots.generation(0), generation);
  slots.truncate(0, 1);
  EXPECT_NE(slots.generation(0), generation);
}

// WorstCandidates under ScoreTrend::never_falls (a heap kept between decisions) evicts what the
// pass over every candidate evicts (ScoreTrend::any), decision after decision, in a stream whose
// scores rise by steps with many ties (and stay put), with protected sinks and a recent window,
// while other things happen to the unit between decisions: evictions of any token by someone else
// (sinks and recent tokens included), decisions not applied, decisions of several tokens (the
// general path), truncations, compactions and an original position appended again. With sinks
// and without (H2O's shape); the stream order is read in its pieces, so that the gaps evictions
// leave stay open, and whole now and then.
TEST(WorstCandidates, AKeptHeapEvictsWhatThePassEvicts) {
  for (const int sinks : {3, 0}) {
    const kvevict::UnitLayout layout(1, 2, kvevict::Granularity::head);
    SlotTable slots(layout, PositionMode::original, 400, 1);
    const kvevict::Protection protection{sinks, 20, 0};
    kvevict::WorstCandidates kept(kvevict::ScoreTrend::never_falls);
    kvevict::WorstCandidates pass(kvevict::ScoreTrend::any);
    std::mt19937 rng(5);
    const auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
    std::array<std::int64_t, 2> next_original{0, 0};
    std::vector<std::int32_t> out(8);
    int compared = 0;
    for (int step = 0; step < 4000; ++step) {
      for (int unit = 0; unit < 2; ++unit) {
        const std::span<float> scores = slots.scores(unit, 0);
        // Scores rise (or stay): a step of 0, 0.25 or 1 for a random third of the live tokens.
        const kvevict::StreamOrderPieces live_now = slots.stream_order_pieces(unit);
        for (int i = 0; i < live_now.size(); ++i) {
          const std::int32_t slot = live_now[i];
          if (pick(3) == 0)
            scores[static_cast<std::size_t>(slot)] +=
                0.25f * static_cast<float>(pick(3) == 0 ? 4 : pick(2));
        }
        // New tokens, scored once.
        const int fed = pick(8) == 0 ? 1 + pick(5) : 1;
        if (slots.live(unit) + fed <= slots.capacity()) {
          Positions originals;
          for (int k = 0; k < fed; ++k) originals.push_back(next_original[unit]++);
          out.resize(static_cast<std::size_t>(fed));
          slots.append(unit, originals, std::vector<std::int32_t>(out.size(), 0),
                       std::vector<std::uint8_t>(out.size(), 0), out);
          const std::span<float> now = slots.scores(unit, 0);
          for (const std::int32_t slot : out)
            now[static_cast<std::size_t>(slot)] = static_cast<float>(pick(4));
        }
        // What else may happen to a unit between two decisions.
        const kvevict::StreamOrderPieces order = slots.stream_order_pieces(unit);
        const int event = pick(40);
        if (event == 0 && order.size() > 0) {  // someone else evicts any token
          slots.evict(unit, std::vector<std::int32_t>{order[pick(order.size())]});
        } else if (event == 1 && order.size() > 2) {  // a rollback, then the same originals again
          const int count = 1 + pick(2);
          slots.truncate(unit, count);
          next_original[unit] -= count;
        } else if (event == 2) {
          std::vector<kvevict::SlotMove> moves;
          slots.compact(unit, moves);
        } else if (event == 3 && order.size() > 0) {  // the newest evicted, its original fed again
          slots.evict(unit, std::vector<std::int32_t>{order[order.size() - 1]});
          --next_original[unit];
        } else if (event == 4) {  // read whole: the next eviction closes the gap
          EXPECT_EQ(static_cast<int>(slots.stream_order(unit).size()), slots.live(unit));
        }
        const int live = slots.live(unit);
        const int first = std::min(protection.oldest, live);
        const int candidates = live - first - std::min(protection.newest, live - first);
        if (candidates < 1 || live < 150) continue;
        const int count = pick(20) == 0 ? 1 + pick(std::min(candidates, 4)) : 1;
        kvevict::Decision by_heap;
        kvevict::Decision by_pass;
        by_heap.reset(2);
        by_pass.reset(2);
        const std::span<const float> view = slots.scores(unit, 0);
        ASSERT_EQ(kept.evict(slots, unit, protection, candidates - count, view, by_heap), count);
        ASSERT_EQ(pass.evict(slots, unit, protection, candidates - count, view, by_pass), count);
        std::vector<std::int32_t> a(by_heap.evicted(unit).begin(), by_heap.evicted(unit).end());
        std::vector<std::int32_t> b(by_pass.evicted(unit).begin(), by_pass.evicted(unit).end());
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        ASSERT_EQ(a, b) << "step " << step << ", unit " << unit;
        ++compared;
        if (pick(10) != 0) slots.evict(unit, a);  // now and then a decision is not applied
      }
    }
    EXPECT_GT(compared, 5000);
  }
}

// KnownWorst (the worst of every slot, found in slot order while a column is in cache) names the
// slot that the rule names (the lowest score; among equals the later original position), checked
// against that rule written out over the stream order; WorstCandidates given it evicts the worst
// candidate under random protection of the oldest and newest (the known worst, or, when that one
// is protected, the one its search finds), as its search alone does. Scores come from a few
// values, -0.0 beside 0.0 (equal), so that ties are common; freed slots are reused, so slot order
// is not stream order; unit sizes cross the 16-lane steps. It is none when a slot is free or a
// score is NaN, and stops holding once the unit changes.
TEST(WorstCandidates, AKnownWorstIsTheWorstOfEverySlot) {
  std::mt19937 rng(11);
  const auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const std::array<float, 5> values{0.0f, -0.0f, 0.25f, 0.5f, 1.0f};
  kvevict::WorstCandidates pass(kvevict::ScoreTrend::any);
  int compared = 0;
  int ties = 0;
  int protected_worst = 0;  // decisions where the known worst was protected
  for (int round = 0; round < 200; ++round) {
    const int capacity = 1 + (round * 7) % 70;
    SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original,
                    capacity, 1);
    std::int64_t next = 0;
    std::vector<std::int32_t> out;
    for (int step = 0; step < 30; ++step) {
      // Fill the unit, then give every slot a score.
      const int fed = capacity - slots.live(0);
      if (fed > 0) {
        Positions originals(static_cast<std::size_t>(fed));
        std::iota(originals.begin(), originals.end(), next);
        next += fed;
        out.resize(static_cast<std::size_t>(fed));
        slots.append(0, originals, std::vector<std::int32_t>(out.size(), 0),
                     std::vector<std::uint8_t>(out.size(), 0), out);
      }
      const std::span<float> scores = slots.scores(0, 0);
      for (float& score : scores) score = values[static_cast<std::size_t>(pick(5))];
      // The rule over the stream order [first, last), oldest first: the lowest, the later of
      // equals.
      const std::span<const std::int32_t> order = slots.stream_order(0);
      const auto worst_of = [&](int first, int last) {
        std::int32_t worst = order[static_cast<std::size_t>(first)];
        for (int i = first; i < last; ++i) {
          const std::int32_t slot = order[static_cast<std::size_t>(i)];
          if (scores[static_cast<std::size_t>(slot)] <= scores[static_cast<std::size_t>(worst)]) {
            worst = slot;
          }
        }
        return worst;
      };
      const std::int32_t expected = worst_of(0, capacity);
      const float lowest = scores[static_cast<std::size_t>(expected)];
      ties += std::count(scores.begin(), scores.end(), lowest) > 1 ? 1 : 0;
      const kvevict::KnownWorst known = kvevict::KnownWorst::of_every_slot(slots, 0, scores);
      ASSERT_EQ(known.slot, expected) << "round " << round << ", step " << step;
      ASSERT_TRUE(known.holds(slots, 0));
      // Now and then the oldest and the newest are protected: at least one candidate is left.
      const int oldest = pick(3) == 0 ? pick(capacity) : 0;
      const int newest = pick(3) == 0 ? pick(capacity - oldest) : 0;
      const kvevict::Protection protection{oldest, newest, 0};
      const int keep = capacity - oldest - newest - 1;
      kvevict::Decision with;
      kvevict::Decision without;
      with.reset(1);
      without.reset(1);
      ASSERT_EQ(pass.evict(slots, 0, protection, keep, scores, with,
                           std::numeric_limits<int>::max(), known),
                1);
      ASSERT_EQ(pass.evict(slots, 0, protection, keep, scores, without), 1);
      const std::int32_t worst_candidate = worst_of(oldest, capacity - newest);
      ASSERT_EQ(with.evicted(0)[0], worst_candidate) << "round " << round << ", step " << step;
      ASSERT_EQ(without.evicted(0)[0], worst_candidate);
      ++compared;
      protected_worst += worst_candidate != expected ? 1 : 0;
      // The worst candidate goes (or, now and then, a random token): the known worst no longer
      // holds, and with a slot free there is none until the unit is full again.
      const std::int32_t evicted =
          pick(4) == 0 ? order[static_cast<std::size_t>(pick(capacity))] : worst_candidate;
      slots.evict(0, std::vector<std::int32_t>{evicted});
      EXPECT_FALSE(known.holds(slots, 0));
      if (capacity > 1) {
        EXPECT_EQ(kvevict::KnownWorst::of_every_slot(slots, 0, scores).slot, -1);
      }
    }
    // A NaN: none (the search names it).
    out.resize(1);
    slots.append(0, Positions{next++}, std::vector<std::int32_t>(1, 0),
                 std::vector<std::uint8_t>(1, 0), out);
    slots.scores(0, 0)[static_cast<std::size_t>(pick(capacity))] = std::nanf("");
    EXPECT_EQ(kvevict::KnownWorst::of_every_slot(slots, 0, slots.scores(0, 0)).slot, -1);
  }
  EXPECT_EQ(compared, 200 * 30);
  EXPECT_GT(ties, 1000);
  EXPECT_GT(protected_worst, 100);
}

// A NaN score is named when its token becomes a candidate of the kept heap, as the pass names it.
TEST(WorstCandidates, AKeptHeapRefusesANaNScore) {
  SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original, 16,
                  1);
  std::vector<std::int32_t> out(6);
  slots.append(0, Positions{0, 1, 2, 3, 4, 5}, std::vector<std::int32_t>(6, 0),
               std::vector<std::uint8_t>(6, 0), out);
  kvevict::WorstCandidates kept(kvevict::ScoreTrend::never_falls);
  kvevict::Decision decision;
  decision.reset(1);
  const kvevict::Protection protection{0, 2, 0};
  EXPECT_EQ(kept.evict(slots, 0, protection, 3, slots.scores(0, 0), decision), 1);
  slots.scores(0, 0)[static_cast<std::size_t>(out[4])] = std::nanf("");  // leaves the window next
  out.resize(1);
  slots.append(0, Positions{6}, std::vector<std::int32_t>(1, 0), std::vector<std::uint8_t>(1, 0),
               out);
  expect_error([&] { (void)kept.evict(slots, 0, protection, 4, slots.scores(0, 0), decision); },
               "NaN at original position 4");
}

// KeepSet::keep_top_k keeps the k best candidates by score, ties to the lower original position:
// one set, however it is found. A few left out (a turn's evictions) take a one-pass search, more
// the partial sort; both must keep what sorting every candidate by that order keeps, ties
// included, with slots out of stream order (freed slots reused) and the oldest kept beforehand.
TEST(KeepSet, TopKKeepsTheBestByScoreThenOriginal) {
  std::mt19937 rng(5);
  for (int round = 0; round < 300; ++round) {
    const int n = 2 + (round * 37) % 200;
    SlotTable slots(kvevict::UnitLayout(1, 1, kvevict::Granularity::head), PositionMode::original,
                    n, 1);
    std::vector<std::int64_t> originals(static_cast<std::size_t>(n));
    std::iota(originals.begin(), originals.end(), std::int64_t{0});
    std::vector<std::int32_t> out(static_cast<std::size_t>(n));
    slots.append(0, originals, std::vector<std::int32_t>(static_cast<std::size_t>(n), 0),
                 std::vector<std::uint8_t>(static_cast<std::size_t>(n), 0), out);
    // A third of the slots freed and refilled by newer tokens: slot order is not stream order.
    std::vector<std::int32_t> freed;
    for (int s = 0; s < n; s += 3) freed.push_back(s);
    slots.evict(0, freed);
    std::vector<std::int64_t> newer(freed.size());
    std::iota(newer.begin(), newer.end(), std::int64_t{n});
    out.resize(freed.size());
    slots.append(0, newer, std::vector<std::int32_t>(freed.size(), 0),
                 std::vector<std::uint8_t>(freed.size(), 0), out);
    // Scores with many ties: a few values only.
    const std::span<float> scores = slots.scores(0, 0);
    std::uniform_int_distribution<int> value(0, 1 + round % 7);
    for (const std::int32_t slot : slots.stream_order(0)) {
      scores[static_cast<std::size_t>(slot)] = 0.5f * static_cast<float>(value(rng));
    }
    const int oldest = round % 3;
    const int candidates = n - std::min(oldest, n);
    std::uniform_int_distribution<int> pick(0, candidates + 1);
    for (const int k : {candidates - 1, candidates - 2, candidates - 16, candidates - 17, pick(rng),
                        candidates, candidates + 1}) {
      SCOPED_TRACE("n " + std::to_string(n) + ", k " + std::to_string(k));
      kvevict::KeepSet keep;
      keep.begin(slots, 0);
      keep.keep_oldest(oldest);
      keep.keep_top_k(scores, k);
      // The reference: every candidate sorted by (score descending, original ascending).
      const std::span<const std::int64_t> original_of = slots.original_positions(0);
      std::vector<std::int32_t> ranked(slots.stream_order(0).begin() + std::min(oldest, n),
                                       slots.stream_order(0).end());
      std::sort(ranked.begin(), ranked.end(), [&](std::int32_t a, std::int32_t b) {
        const float sa = scores[static_cast<std::size_t>(a)];
        const float sb = scores[static_cast<std::size_t>(b)];
        if (sa != sb) return sa > sb;
        return original_of[static_cast<std::size_t>(a)] < original_of[static_cast<std::size_t>(b)];
      });
      const int expected_kept = std::min(oldest, n) + std::clamp(k, 0, candidates);
      EXPECT_EQ(keep.kept(), expected_kept);
      for (int i = 0; i < static_cast<int>(ranked.size()); ++i) {
        EXPECT_EQ(keep.is_kept(ranked[static_cast<std::size_t>(i)]), i < k)
            << "rank " << i << ", original "
            << original_of[static_cast<std::size_t>(ranked[static_cast<std::size_t>(i)])];
      }
    }
  }
}

}  // namespace

// A fold's rotation of f32 keys (Rope::apply on floats) runs at the CPU's vector width; every width
// must give the rotation computed in double, each product rounded and never fused, then rounded
// once to float, as written out here, bit for bit, for both layouts and every length of tail.
TEST(RowPasses, EveryVectorWidthRotatesAsTheDoubleFormula) {
  namespace rp = kvevict::detail::row_pass;
  using HalfSplit = void (*)(float*, float*, int, const double*, const double*);
  using Interleaved = void (*)(float*, int, const double*, const double*);
  std::vector<std::tuple<std::string, HalfSplit, Interleaved>> widths{
      {"dispatch", &kvevict::detail::rotate_half_split, &kvevict::detail::rotate_interleaved},
      {"baseline", &rp::rotate_half_split, &rp::rotate_interleaved}};
#if KVEVICT_ROW_PASS_DISPATCH
  if (__builtin_cpu_supports("avx2")) {
    widths.emplace_back("avx2", &rp::rotate_half_split_avx2, &rp::rotate_interleaved_avx2);
  }
  if (__builtin_cpu_supports("avx512f")) {
    widths.emplace_back("avx512", &rp::rotate_half_split_avx512, &rp::rotate_interleaved_avx512);
  }
#endif
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::uniform_real_distribution<double> angle(-3.2, 3.2);
  for (const int pairs : {1, 3, 4, 7, 8, 9, 16, 17, 32, 64}) {
    std::vector<float> row(static_cast<std::size_t>(2 * pairs));
    for (float& x : row) x = value(rng);
    std::vector<double> cos(static_cast<std::size_t>(pairs));
    std::vector<double> sin(static_cast<std::size_t>(pairs));
    for (int i = 0; i < pairs; ++i) {
      const double theta = angle(rng);
      cos[static_cast<std::size_t>(i)] = std::cos(theta);
      sin[static_cast<std::size_t>(i)] = std::sin(theta);
    }
    // Pair i as (x[first], x[second]): (a cos - b sin, b cos + a sin), each product its own double.
    const auto expected = [&](bool interleaved) {
      std::vector<float> out = row;
      for (int i = 0; i < pairs; ++i) {
        const auto u = static_cast<std::size_t>(interleaved ? 2 * i : i);
        const auto v = static_cast<std::size_t>(interleaved ? 2 * i + 1 : pairs + i);
        const double a = row[u];
        const double b = row[v];
        const double a_cos = a * cos[static_cast<std::size_t>(i)];
        const double b_sin = b * sin[static_cast<std::size_t>(i)];
        const double b_cos = b * cos[static_cast<std::size_t>(i)];
        const double a_sin = a * sin[static_cast<std::size_t>(i)];
        out[u] = static_cast<float>(a_cos - b_sin);
        out[v] = static_cast<float>(b_cos + a_sin);
      }
      return out;
    };
    const std::vector<float> half_split = expected(false);
    const std::vector<float> interleaved = expected(true);
    for (const auto& [name, rotate_half, rotate_pairs] : widths) {
      SCOPED_TRACE(name + ", pairs " + std::to_string(pairs));
      std::vector<float> rotated = row;
      rotate_half(rotated.data(), rotated.data() + pairs, pairs, cos.data(), sin.data());
      EXPECT_EQ(std::memcmp(rotated.data(), half_split.data(), rotated.size() * sizeof(float)), 0);
      rotated = row;
      rotate_pairs(rotated.data(), pairs, cos.data(), sin.data());
      EXPECT_EQ(std::memcmp(rotated.data(), interleaved.data(), rotated.size() * sizeof(float)), 0);
    }
  }
}

// The row passes (detail/row_passes.hpp) run at the CPU's widest vector width; every width this
// CPU has must compute what the plain loop computes, bit for bit, tails included (lengths that are
// no multiple of 4, 8 or 16), or a decision would depend on the machine.
TEST(RowPasses, EveryVectorWidthComputesThePlainLoopsBits) {
  namespace rp = kvevict::detail::row_pass;
  using AddRows = bool (*)(const float* const*, int, std::size_t, float, const float*, float*);
  // The dispatching entry point and each width this CPU runs.
  std::vector<std::pair<std::string, AddRows>> widths{{"dispatch", &kvevict::detail::add_rows},
                                                      {"baseline", &rp::add_rows}};
#if KVEVICT_ROW_PASS_DISPATCH
  if (__builtin_cpu_supports("avx2")) widths.emplace_back("avx2", &rp::add_rows_avx2);
  if (__builtin_cpu_supports("avx512f")) widths.emplace_back("avx512", &rp::add_rows_avx512);
#endif
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> probability(0.0f, 1.0f);
  for (const std::size_t n : {0u, 1u, 3u, 7u, 15u, 17u, 33u, 4099u}) {
    std::vector<std::vector<float>> rows(4, std::vector<float>(n));
    for (std::vector<float>& r : rows) {
      for (float& p : r) p = probability(rng);
    }
    const std::array<const float*, 4> pointers{rows[0].data(), rows[1].data(), rows[2].data(),
                                               rows[3].data()};
    std::vector<float> start(n);
    for (float& s : start) s = 100.0f * probability(rng);
    for (const float weight : {1.0f, 1.0f / 3.0f, 1.0f / 24.0f}) {
      for (int count = 1; count <= 4; ++count) {
        // One row at a time, each product rounded before it is added, from `start` or from zero.
        std::vector<float> from_start = start;
        std::vector<float> from_zero(n, 0.0f);
        for (int r = 0; r < count; ++r) {
          for (std::size_t s = 0; s < n; ++s) {
            const float scaled = weight * rows[static_cast<std::size_t>(r)][s];
            from_start[s] += scaled;
            from_zero[s] += scaled;
          }
        }
        for (const auto& [name, add_rows] : widths) {
          SCOPED_TRACE(name + ", n = " + std::to_string(n) + ", " + std::to_string(count) +
                       " rows, weight " + std::to_string(weight));
          std::vector<float> in_place = start;
          EXPECT_TRUE(
              add_rows(pointers.data(), count, n, weight, in_place.data(), in_place.data()));
          EXPECT_EQ(in_place, from_start);
          std::vector<float> into(n, -1.0f);
          EXPECT_TRUE(add_rows(pointers.data(), count, n, weight, start.data(), into.data()));
          EXPECT_EQ(into, from_start);
          std::vector<float> zero_start(n, -1.0f);
          EXPECT_TRUE(add_rows(pointers.data(), count, n, weight, nullptr, zero_start.data()));
          EXPECT_EQ(zero_start, from_zero);
        }
      }
    }
    // A value that is no probability, in any of the rows at every position of the first and the
    // last 40 (the vector body, the blocks that prefetch ahead and the tail): found by the check
    // and by the sum's flag, at every width.
    std::vector<std::size_t> bad_positions;
    for (std::size_t bad = 0; bad < n; bad = bad + 1 == 40 && n > 80 ? n - 40 : bad + 1) {
      bad_positions.push_back(bad);
    }
    for (const std::size_t bad : bad_positions) {
      for (const float value :
           {-1e-9f, 1.01f, std::numeric_limits<float>::quiet_NaN(),
            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
        std::vector<float> broken = rows[0];
        broken[bad] = value;
        EXPECT_FALSE(kvevict::detail::all_probabilities(broken.data(), n));
        EXPECT_FALSE(rp::all_probabilities(broken.data(), n));
#if KVEVICT_ROW_PASS_DISPATCH
        if (__builtin_cpu_supports("avx2")) {
          EXPECT_FALSE(rp::all_probabilities_avx2(broken.data(), n));
        }
        if (__builtin_cpu_supports("avx512f")) {
          EXPECT_FALSE(rp::all_probabilities_avx512(broken.data(), n));
        }
#endif
        for (int count = 1; count <= 4; ++count) {
          std::array<const float*, 4> with_bad = pointers;
          with_bad[static_cast<std::size_t>(count - 1)] = broken.data();
          for (const auto& [name, add_rows] : widths) {
            std::vector<float> sum(n);
            EXPECT_FALSE(add_rows(with_bad.data(), count, n, 1.0f, nullptr, sum.data()))
                << name << ": " << value << " at " << bad << " of row " << count - 1;
          }
        }
      }
    }
    EXPECT_TRUE(kvevict::detail::all_probabilities(rows[0].data(), n));
  }
  // The edges of the accepted range: 0, -0.0, 1 and the slack above 1 for a half-precision softmax.
  const std::vector<float> edges{0.0f, -0.0f, 1.0f, kvevict::detail::kMaxProbability};
  EXPECT_TRUE(kvevict::detail::all_probabilities(edges.data(), edges.size()));
  const float above = std::nextafter(kvevict::detail::kMaxProbability, 2.0f);
  EXPECT_FALSE(kvevict::detail::all_probabilities(&above, 1));
  const std::array<const float*, 1> edge_row{edges.data()};
  std::vector<float> sum(edges.size());
  EXPECT_TRUE(
      kvevict::detail::add_rows(edge_row.data(), 1, edges.size(), 1.0f, nullptr, sum.data()));
  const std::array<const float*, 1> above_row{&above};
  EXPECT_FALSE(kvevict::detail::add_rows(above_row.data(), 1, 1, 1.0f, nullptr, sum.data()));
}

// Where a run of equal group ids ends (SlotTable::for_each_key_run's scan): the first index from
// `from` on whose value differs, or `last`, at every width; runs of every length, with the ends of
// 16-lane steps and the page-ahead prefetch's reach (1,024 ids) crossed.
TEST(RowPasses, FirstOtherEndsARunAtEveryWidth) {
  namespace rp = kvevict::detail::row_pass;
  std::mt19937 rng(5);
  for (const int length : {0, 1, 15, 16, 17, 100, 1100, 5000}) {
    std::vector<std::int32_t> ids;
    while (static_cast<int>(ids.size()) < length) {
      const auto value = static_cast<std::int32_t>(rng() % 4) - 1;  // -1: a free slot's id
      const int run = 1 + static_cast<int>(rng() % (rng() % 2 == 0 ? 3 : 2000));
      for (int i = 0; i < run && static_cast<int>(ids.size()) < length; ++i) ids.push_back(value);
    }
    for (int trial = 0; trial < 200; ++trial) {
      const int from = length == 0 ? 0 : static_cast<int>(rng() % static_cast<unsigned>(length));
      const int last = from + static_cast<int>(rng() % static_cast<unsigned>(length - from + 1));
      const std::int32_t value =
          from < last && trial % 2 == 0 ? ids[static_cast<std::size_t>(from)] : -1;
      int expected = from;
      while (expected < last && ids[static_cast<std::size_t>(expected)] == value) ++expected;
      SCOPED_TRACE("length " + std::to_string(length) + ", [" + std::to_string(from) + ", " +
                   std::to_string(last) + "), value " + std::to_string(value));
      EXPECT_EQ(kvevict::detail::first_other(ids.data(), from, last, value), expected);
      EXPECT_EQ(rp::first_other(ids.data(), from, last, value), expected);
#if KVEVICT_ROW_PASS_DISPATCH
      if (__builtin_cpu_supports("avx512f")) {
        EXPECT_EQ(rp::first_other_avx512(ids.data(), from, last, value), expected);
      }
#endif
    }
  }
}

// The budget rule's single eviction (WorstCandidates) at every width: the lowest score, the later
// candidate among equals, over a stream order that is no slot order; scores with many ties, both
// zeros and infinities; NaN flagged.
TEST(RowPasses, TheWorstCandidateIsTheSameAtEveryWidth) {
  namespace rp = kvevict::detail::row_pass;
  std::mt19937 rng(11);
  const std::vector<float> values{0.0f, -0.0f, 1.0f,
                                  2.0f, 3.0f,  std::numeric_limits<float>::infinity()};
  for (const int slots : {1, 2, 15, 16, 17, 31, 33, 100, 1000}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<std::int32_t> order(static_cast<std::size_t>(slots));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<float> scores(static_cast<std::size_t>(slots));
      for (float& score : scores) score = values[rng() % (trial < 10 ? 3 : values.size())];
      const int first = static_cast<int>(rng() % static_cast<unsigned>(slots));
      const int last = first + 1 + static_cast<int>(rng() % static_cast<unsigned>(slots - first));
      // The definition, written out: the lowest value, then the highest index holding it.
      int expected = first;
      for (int i = first; i < last; ++i) {
        const float s = scores[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])];
        const float e = scores[static_cast<std::size_t>(order[static_cast<std::size_t>(expected)])];
        if (s < e || (s == e && i > expected)) expected = i;
      }
      const rp::Worst any =
          kvevict::detail::worst_in_order(order.data(), first, last, scores.data());
      EXPECT_EQ(any.index, expected);
      EXPECT_FALSE(any.nan);
      EXPECT_EQ(rp::worst_in_order(order.data(), first, last, scores.data()).index, expected);
#if KVEVICT_ROW_PASS_DISPATCH
      if (__builtin_cpu_supports("avx512f")) {
        EXPECT_EQ(rp::worst_in_order_avx512(order.data(), first, last, scores.data()).index,
                  expected);
      }
#endif
      // The skip of a scan for a few lowest: the first candidate at most the bound.
      for (const float bound : {-1.0f, 0.0f, 1.0f, 2.5f}) {
        int at_most = first;
        while (at_most < last &&
               scores[static_cast<std::size_t>(order[static_cast<std::size_t>(at_most)])] > bound)
          ++at_most;
        EXPECT_EQ(kvevict::detail::first_not_above(order.data(), first, last, scores.data(), bound),
                  at_most);
      }
      scores[static_cast<std::size_t>(order[static_cast<std::size_t>(last - 1)])] =
          std::numeric_limits<float>::quiet_NaN();
      // NaN stops the skip (the scan then flags it).
      EXPECT_EQ(
          kvevict::detail::first_not_above(order.data(), last - 1, last, scores.data(), -1.0f),
          last - 1);
      EXPECT_TRUE(kvevict::detail::worst_in_order(order.data(), first, last, scores.data()).nan);
      EXPECT_TRUE(rp::worst_in_order(order.data(), first, last, scores.data()).nan);
    }
  }
}

// KnownWorst's passes in slot order at every width: the lowest value (NaN skipped and flagged; -0.0
// and 0.0 equal, either may come back), then the first slot at or after `from` holding it.
TEST(RowPasses, TheLowestAndItsSlotsAreTheSameAtEveryWidth) {
  namespace rp = kvevict::detail::row_pass;
  std::mt19937 rng(13);
  const std::vector<float> values{0.0f,
                                  -0.0f,
                                  1.0f,
                                  2.0f,
                                  std::numeric_limits<float>::infinity(),
                                  std::numeric_limits<float>::quiet_NaN()};
  for (const int n : {1, 2, 15, 16, 17, 31, 33, 100, 1000}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> scores(static_cast<std::size_t>(n));
      for (float& score : scores) score = values[rng() % (trial < 10 ? 4 : values.size())];
      // The definitions, written out.
      float lowest = std::numeric_limits<float>::infinity();
      bool nan = false;
      for (const float score : scores) {
        nan = nan || std::isnan(score);
        if (score < lowest) lowest = score;
      }
      const int from = static_cast<int>(rng() % static_cast<unsigned>(n));
      int equal = from;
      while (equal < n && scores[static_cast<std::size_t>(equal)] != lowest) ++equal;
      SCOPED_TRACE("n " + std::to_string(n) + ", trial " + std::to_string(trial));
      std::vector<rp::Lowest> found{kvevict::detail::lowest_of(scores.data(), n),
                                    rp::lowest_of(scores.data(), n)};
      std::vector<int> firsts{kvevict::detail::first_equal(scores.data(), from, n, lowest),
                              rp::first_equal(scores.data(), from, n, lowest)};
#if KVEVICT_ROW_PASS_DISPATCH
      if (__builtin_cpu_supports("avx512f")) {
        found.push_back(rp::lowest_of_avx512(scores.data(), n));
        firsts.push_back(rp::first_equal_avx512(scores.data(), from, n, lowest));
      }
#endif
      for (const rp::Lowest& each : found) {
        EXPECT_EQ(each.value, lowest);  // == : either zero
        EXPECT_EQ(each.nan, nan);
      }
      for (const int first : firsts) EXPECT_EQ(first, equal);
    }
  }
}

// KeyDiff's scoring pass at every width against its formula written out one slot and one term at
// a time (eight lanes of partial sums per head, then a fixed tree): the policy's decisions must
// not depend on the CPU nor on which slots a pass takes.
TEST(RowPasses, KeyDiffScoresComputeTheFormulasBits) {
  namespace rp = kvevict::detail::row_pass;
  using Score = void (*)(const float*, std::size_t, const std::int32_t*, int, int, int,
                         const double*, const double*, float*);
  std::vector<std::pair<std::string, Score>> widths{{"dispatch", &kvevict::detail::score_rows},
                                                    {"baseline", &rp::score_rows}};
#if KVEVICT_ROW_PASS_DISPATCH
  if (__builtin_cpu_supports("avx2")) widths.emplace_back("avx2", &rp::score_rows_avx2);
  if (__builtin_cpu_supports("avx512f")) widths.emplace_back("avx512", &rp::score_rows_avx512);
#endif
  std::mt19937 rng(5);
  // Values over many binades, so that rounding depends on the order of every sum.
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-30, 3);
  for (const int heads : {1, 2, 3}) {
    for (const int head_dim : {1, 7, 8, 13, 64}) {
      for (const int count : {0, 1, 7, 25, 100}) {
        const int capacity = count + 5;
        const auto row_floats =
            static_cast<std::size_t>(heads) * static_cast<std::size_t>(head_dim);
        std::vector<float> rows(static_cast<std::size_t>(capacity) * row_floats);
        for (float& x : rows) x = std::ldexp(mantissa(rng), binade(rng));
        std::vector<std::int32_t> slots(static_cast<std::size_t>(capacity));
        std::iota(slots.begin(), slots.end(), 0);
        std::shuffle(slots.begin(), slots.end(), rng);
        slots.resize(static_cast<std::size_t>(count));  // a few slots not scored
        std::vector<double> anchor(row_floats);
        for (double& x : anchor) x = std::ldexp(static_cast<double>(mantissa(rng)), binade(rng));
        std::vector<double> inverse_norms(static_cast<std::size_t>(heads));
        for (double& x : inverse_norms) x = std::ldexp(static_cast<double>(mantissa(rng)), 2);
        std::vector<float> expected(static_cast<std::size_t>(capacity), -7.0f);
        for (const std::int32_t slot : slots) {
          double total = 0.0;
          for (int h = 0; h < heads; ++h) {
            double lane[8] = {};
            for (int d = 0; d < head_dim; ++d) {
              const std::size_t i = static_cast<std::size_t>(h * head_dim + d);
              const double product =
                  static_cast<double>(rows[static_cast<std::size_t>(slot) * row_floats + i]) *
                  anchor[i];
              lane[d % 8] += product;
            }
            const double dot = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
                               ((lane[1] + lane[5]) + (lane[3] + lane[7]));
            const double weighted = dot * inverse_norms[static_cast<std::size_t>(h)];
            total += weighted;
          }
          expected[static_cast<std::size_t>(slot)] = static_cast<float>(-total / heads);
        }
        for (const auto& [name, score] : widths) {
          SCOPED_TRACE(name + ", heads " + std::to_string(heads) + ", head_dim " +
                       std::to_string(head_dim) + ", slots " + std::to_string(count));
          std::vector<float> got(static_cast<std::size_t>(capacity), -7.0f);  // others kept
          score(rows.data(), row_floats, slots.data(), count, heads, head_dim, anchor.data(),
                inverse_norms.data(), got.data());
          EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0);
        }
      }
    }
  }
}
