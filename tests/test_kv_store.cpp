// KvStore and SlotTable: alignment under compaction, in-place stability, exact memory accounting,
// roll back, growth, and clear errors for misuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <numeric>
#include <random>
#include <vector>

namespace {

using kvevict::CacheShape;
using kvevict::CompactionPlan;
using kvevict::KvStore;
using Matrix = KvStore<float>::Matrix;

// Appends original positions [first, first + n) to head (l, g), every row tagged with its position:
// key row = (p, p + 0.25, ...), value row = (-p, ...), token id = 1000 + p, flags = p % 3,
// score column c = p * (c + 1).
void append_tagged(KvStore<float>& store, int l, int g, std::int64_t first, int n) {
  const int d = store.shape().head_dim;
  Matrix keys(n, d), values(n, d);
  std::vector<std::int64_t> original(static_cast<std::size_t>(n));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  std::vector<std::uint8_t> flags(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const auto p = first + i;
    for (int c = 0; c < d; ++c) {
      keys(i, c) = static_cast<float>(p) + 0.25f * static_cast<float>(c);
      values(i, c) = -static_cast<float>(p) - 0.5f * static_cast<float>(c);
    }
    original[static_cast<std::size_t>(i)] = p;
    ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(1000 + p);
    flags[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(p % 3);
  }
  const int live_before = store.live(l, g);
  store.append(l, g, keys, values, original, original, ids, flags);
  for (int c = 0; c < store.slots().score_columns(); ++c) {
    auto scores = store.slots().scores(l, g, c);
    for (int i = 0; i < n; ++i) {
      scores[static_cast<std::size_t>(live_before + i)] = static_cast<float>((first + i) * (c + 1));
    }
  }
}

// Every live slot of (l, g) still carries the tags of its original position.
void expect_aligned(const KvStore<float>& store, int l, int g) {
  const auto& slots = store.slots();
  const auto original = slots.original_positions(l, g);
  const Eigen::Map<const Matrix> keys = store.keys(l, g);
  const Eigen::Map<const Matrix> values = store.values(l, g);
  for (int s = 0; s < store.live(l, g); ++s) {
    const auto p = original[static_cast<std::size_t>(s)];
    ASSERT_EQ(keys(s, 0), static_cast<float>(p)) << "slot " << s;
    ASSERT_EQ(keys(s, keys.cols() - 1), static_cast<float>(p) + 0.25f * (keys.cols() - 1));
    ASSERT_EQ(values(s, 1), -static_cast<float>(p) - 0.5f);
    ASSERT_EQ(slots.token_ids(l, g)[static_cast<std::size_t>(s)], 1000 + p);
    ASSERT_EQ(slots.flags(l, g)[static_cast<std::size_t>(s)], p % 3);
    for (int c = 0; c < slots.score_columns(); ++c) {
      ASSERT_EQ(slots.scores(l, g, c)[static_cast<std::size_t>(s)],
                static_cast<float>(p * (c + 1)));
    }
  }
}

void set_plan(CompactionPlan& plan, const kvevict::SlotTable& slots, int l, int g,
              const std::vector<std::int32_t>& keep) {
  std::copy(keep.begin(), keep.end(), plan.keep_buffer(l, g).begin());
  plan.set_keep_count(l, g, static_cast<int>(keep.size()));
  (void)slots;
}

TEST(KvStore, HeadsHoldDifferentTokensAndCounts) {
  KvStore<float> store(CacheShape{2, 4, 2, 8}, 16, 1);
  append_tagged(store, 0, 0, 0, 5);
  append_tagged(store, 0, 1, 0, 3);
  append_tagged(store, 1, 1, 10, 7);
  EXPECT_EQ(store.live(0, 0), 5);
  EXPECT_EQ(store.live(0, 1), 3);
  EXPECT_EQ(store.live(1, 0), 0);
  EXPECT_EQ(store.live(1, 1), 7);
  EXPECT_EQ(store.keys(1, 1).rows(), 7);
  EXPECT_EQ(store.keys(1, 1).cols(), 8);
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g) expect_aligned(store, l, g);
  }
}

TEST(KvStore, CompactionIsStableInPlaceAndKeepsEverythingAligned) {
  KvStore<float> store(CacheShape{1, 1, 1, 4}, 10, 2);
  append_tagged(store, 0, 0, 100, 10);
  const float* keys_before = store.keys(0, 0).data();
  CompactionPlan plan(1, 1, store.capacity());
  set_plan(plan, store.slots(), 0, 0, {0, 3, 4, 8});
  kvevict::assign_positions(kvevict::PositionMode::original, store.slots(), plan);
  store.apply(plan);
  EXPECT_EQ(store.keys(0, 0).data(), keys_before);  // same buffer: no reallocation
  const std::vector<std::int64_t> expected{100, 103, 104, 108};
  EXPECT_EQ(std::vector<std::int64_t>(store.slots().original_positions(0, 0).begin(),
                                      store.slots().original_positions(0, 0).end()),
            expected);
  expect_aligned(store, 0, 0);
}

// Thousands of random compactions and appends over several heads: every column stays aligned.
TEST(KvStore, RandomCompactionsNeverMisalign) {
  std::mt19937 rng(42);
  const CacheShape shape{2, 6, 3, 5};
  KvStore<float> store(shape, 64, 2);
  CompactionPlan plan(shape.layers, shape.kv_heads, store.capacity());
  std::vector<std::int64_t> next(static_cast<std::size_t>(shape.head_caches()), 0);
  for (int step = 0; step < 3000; ++step) {
    for (int l = 0; l < shape.layers; ++l) {
      for (int g = 0; g < shape.kv_heads; ++g) {
        const int room = store.capacity() - store.live(l, g);
        const int n = std::min(room, static_cast<int>(rng() % 6));
        auto& first = next[static_cast<std::size_t>(l * shape.kv_heads + g)];
        if (n > 0) append_tagged(store, l, g, first, n);
        first += n;
      }
    }
    plan.clear();
    for (int l = 0; l < shape.layers; ++l) {
      for (int g = 0; g < shape.kv_heads; ++g) {
        if (rng() % 3 == 0) continue;  // head left unchanged
        std::vector<std::int32_t> keep;
        for (int s = 0; s < store.live(l, g); ++s) {
          if (rng() % 4 != 0) keep.push_back(s);
        }
        set_plan(plan, store.slots(), l, g, keep);
      }
    }
    kvevict::assign_positions(kvevict::PositionMode::cache_index, store.slots(), plan);
    store.apply(plan);
    for (int l = 0; l < shape.layers; ++l) {
      for (int g = 0; g < shape.kv_heads; ++g) {
        expect_aligned(store, l, g);
        const auto original = store.slots().original_positions(l, g);
        ASSERT_TRUE(std::is_sorted(original.begin(), original.end()));
        ASSERT_TRUE(std::adjacent_find(original.begin(), original.end()) == original.end());
      }
    }
  }
}

// bytes per slot = keys + values (2 * head_dim * sizeof(float)) + metadata (original position 8,
// position 8, token id 4, flags 1, one float per score column).
TEST(KvStore, MemoryAccountingIsExact) {
  const CacheShape shape{3, 8, 2, 16};  // 6 (layer, KV head) caches
  KvStore<float> store(shape, 32, 2);
  const std::size_t kv_per_slot = 2 * 16 * 4;               // 128
  const std::size_t meta_per_slot = 8 + 8 + 4 + 1 + 2 * 4;  // 29
  EXPECT_EQ(store.kv_bytes_per_slot(), kv_per_slot);
  EXPECT_EQ(store.bytes_per_slot(), kv_per_slot + meta_per_slot);
  EXPECT_EQ(store.memory().reserved_bytes, 6 * 32 * (kv_per_slot + meta_per_slot));
  EXPECT_EQ(store.memory().live_bytes(), 0u);

  append_tagged(store, 0, 0, 0, 10);
  append_tagged(store, 2, 1, 0, 4);  // 14 live slots
  EXPECT_EQ(store.memory().live_kv_bytes, 14 * kv_per_slot);
  EXPECT_EQ(store.memory().live_metadata_bytes, 14 * meta_per_slot);
  EXPECT_EQ(store.memory(0, 0).live_bytes(), 10 * (kv_per_slot + meta_per_slot));
  EXPECT_EQ(store.memory(2, 1).live_kv_bytes, 4 * kv_per_slot);
  EXPECT_EQ(store.memory(1, 0).live_bytes(), 0u);
  EXPECT_EQ(store.memory(1, 0).reserved_bytes, 32 * (kv_per_slot + meta_per_slot));

  CompactionPlan plan(3, 2, store.capacity());
  set_plan(plan, store.slots(), 0, 0, {1, 2});  // 10 -> 2: 6 live slots remain
  kvevict::assign_positions(kvevict::PositionMode::original, store.slots(), plan);
  store.apply(plan);
  store.truncate(2, 1, 1);  // 4 -> 1: 3 live slots remain
  EXPECT_EQ(store.memory().live_bytes(), 3 * (kv_per_slot + meta_per_slot));
  EXPECT_EQ(store.memory().peak_live_bytes, 14 * (kv_per_slot + meta_per_slot));
  EXPECT_EQ(store.memory().peak_kv_bytes, 14 * kv_per_slot);

  store.reserve(64);  // growth doubles the reservation and keeps contents
  EXPECT_EQ(store.memory().reserved_bytes, 6 * 64 * (kv_per_slot + meta_per_slot));
  EXPECT_EQ(store.memory().live_bytes(), 3 * (kv_per_slot + meta_per_slot));
  expect_aligned(store, 0, 0);
  expect_aligned(store, 2, 1);
}

TEST(KvStore, TruncateRollsBackTheNewestSlots) {
  KvStore<float> store(CacheShape{1, 2, 2, 4}, 16, 1);
  append_tagged(store, 0, 1, 0, 6);
  append_tagged(store, 0, 1, 6, 3);  // e.g. a catalyst prompt
  store.truncate(0, 1, 6);
  EXPECT_EQ(store.live(0, 1), 6);
  append_tagged(store, 0, 1, 6, 2);  // new tokens land where the rolled-back ones were
  EXPECT_EQ(store.live(0, 1), 8);
  expect_aligned(store, 0, 1);
  EXPECT_THROW(store.truncate(0, 1, 9), kvevict::Error);
  EXPECT_THROW(store.truncate(0, 1, -1), kvevict::Error);
}

TEST(KvStore, ReserveKeepsContents) {
  KvStore<float> store(CacheShape{2, 2, 1, 3}, 4, 1);
  append_tagged(store, 0, 0, 0, 4);
  append_tagged(store, 1, 0, 50, 2);
  store.reserve(9);
  EXPECT_EQ(store.capacity(), 9);
  append_tagged(store, 0, 0, 4, 5);
  expect_aligned(store, 0, 0);
  expect_aligned(store, 1, 0);
}

// With keys stored after RoPE, compaction re-rotates each kept key by (new - old position): the
// result equals rotating the pre-RoPE key straight to its new position.
TEST(KvStore, PostRopeCompactionReRotatesByTheDelta) {
  const kvevict::Rope rope(kvevict::RopeConfig{8, 0, 10000.0, kvevict::RopeLayout::half_split});
  KvStore<float> store(CacheShape{1, 1, 1, 8}, 8, 0);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  Matrix raw(6, 8);
  for (int i = 0; i < raw.size(); ++i) raw.data()[i] = normal(rng);
  Matrix rotated = raw;
  const std::vector<std::int64_t> positions{0, 1, 2, 3, 4, 5};
  rope.rotate_rows(rotated.data(), 8, std::span<const std::int64_t>(positions));
  const std::vector<std::int32_t> ids(6, 0);
  const std::vector<std::uint8_t> flags(6, 0);
  store.append(0, 0, rotated, raw, positions, positions, ids, flags);

  CompactionPlan plan(1, 1, 8);
  set_plan(plan, store.slots(), 0, 0, {0, 2, 5});
  kvevict::assign_positions(kvevict::PositionMode::cache_index, store.slots(), plan);
  EXPECT_EQ(std::vector<std::int64_t>(plan.position_deltas(0, 0).begin(),
                                      plan.position_deltas(0, 0).end()),
            (std::vector<std::int64_t>{0, -1, -3}));
  store.apply(plan, &rope);
  const std::vector<int> kept_rows{0, 2, 5};
  for (int i = 0; i < 3; ++i) {
    std::vector<float> expected(raw.row(kept_rows[static_cast<std::size_t>(i)]).data(),
                                raw.row(kept_rows[static_cast<std::size_t>(i)]).data() + 8);
    rope.rotate(expected.data(), i);
    for (int c = 0; c < 8; ++c)
      EXPECT_NEAR(store.keys(0, 0)(i, c), expected[static_cast<std::size_t>(c)], 1e-6);
  }
  EXPECT_EQ(store.slots().positions(0, 0)[2], 2);
}

TEST(KvStore, RejectsBadShapesCapacitiesAndKeepLists) {
  EXPECT_THROW(KvStore<float>(CacheShape{1, 6, 4, 8}, 8), kvevict::Error);  // 6 % 4 != 0
  EXPECT_THROW(KvStore<float>(CacheShape{1, 4, 2, 8}, 0), kvevict::Error);  // zero capacity
  EXPECT_THROW(KvStore<float>(CacheShape{0, 4, 2, 8}, 8), kvevict::Error);
  EXPECT_THROW(KvStore<float>(CacheShape{1, 4, 2, 0}, 8), kvevict::Error);
  try {
    KvStore<float>(CacheShape{1, 6, 4, 8}, 8);
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("not a multiple"), std::string::npos);
  }

  KvStore<float> store(CacheShape{1, 1, 1, 4}, 4, 0);
  append_tagged(store, 0, 0, 0, 4);
  EXPECT_THROW(append_tagged(store, 0, 0, 4, 1), kvevict::Error);  // over capacity
  for (const std::vector<std::int32_t>& bad :
       {std::vector<std::int32_t>{2, 1}, {1, 1}, {0, 4}, {-1, 2}}) {
    CompactionPlan plan(1, 1, 4);
    set_plan(plan, store.slots(), 0, 0, bad);
    EXPECT_THROW(store.apply(plan), kvevict::Error);
  }
  expect_aligned(store, 0, 0);  // a rejected plan changed nothing
  EXPECT_EQ(store.live(0, 0), 4);
}

}  // namespace
