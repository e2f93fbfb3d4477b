// EvictionPipeline and EvictingCache: position modes, pre/post-RoPE equivalence under eviction,
// the before_turn and pot_full/catalyst triggers, capacity planning, independence of sequences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <kvevict/kvevict.hpp>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using kvevict::CacheConfig;
using kvevict::CacheShape;
using kvevict::EvictingCache;
using kvevict::EvictionPipeline;
using kvevict::KeyStorage;
using kvevict::PolicyParams;
using kvevict::PositionMode;
using kvevict::SlotTable;
using Matrix = EvictingCache<float>::Matrix;

Matrix random_matrix(std::mt19937& rng, int rows, int cols) {
  std::normal_distribution<float> normal;
  Matrix m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

// Attention logits of a query (pre-RoPE, at the position of the head's newest slot) against every
// cached key rotated to its position: the quantity pre- and post-RoPE storage must agree on.
std::vector<double> scores(const EvictingCache<float>& cache, int l, int g,
                           const std::vector<float>& query) {
  Matrix scratch;
  const Eigen::Map<const Matrix> keys = cache.attention_keys(l, g, scratch);
  std::vector<float> q = query;
  cache.rope().rotate(q.data(), cache.positions(l, g).back());
  std::vector<double> out;
  for (Eigen::Index r = 0; r < keys.rows(); ++r) {
    double s = 0;
    for (Eigen::Index c = 0; c < keys.cols(); ++c)
      s += double(keys(r, c)) * q[static_cast<std::size_t>(c)];
    out.push_back(s);
  }
  return out;
}

struct EquivalenceCase {
  const char* policy;
  PolicyParams params;
  PositionMode mode;
  kvevict::RopeLayout layout;
  int rotary_dim;
};

// Pre-RoPE keys rotated at every attention and post-RoPE keys delta-rotated at compaction give the
// same scores to ~1e-5 of |q||k|, over long runs with many evictions and re-positionings.
TEST(EvictingCache, PreAndPostRopeStorageGiveTheSameScores) {
  const std::vector<EquivalenceCase> cases{
      {"streaming_llm", PolicyParams().set("sinks", 4).set("recent", 20), PositionMode::cache_index,
       kvevict::RopeLayout::half_split, 0},
      {"streaming_llm", PolicyParams().set("sinks", 2).set("recent", 9),
       PositionMode::reset_on_compact, kvevict::RopeLayout::interleaved, 16},
      {"window", PolicyParams().set("recent", 17), PositionMode::original,
       kvevict::RopeLayout::half_split, 0},
      {"window", PolicyParams().set("recent", 33), PositionMode::cache_index,
       kvevict::RopeLayout::interleaved, 0},
  };
  std::mt19937 rng(2024);
  for (const EquivalenceCase& test_case : cases) {
    const CacheShape shape{2, 4, 2, 32};
    CacheConfig config;
    config.shape = shape;
    config.rope = kvevict::RopeConfig{32, test_case.rotary_dim, 10000.0, test_case.layout};
    config.position_mode = test_case.mode;
    config.max_chunk = 8;
    config.key_storage = KeyStorage::pre_rope;
    EvictingCache<float> pre(config, kvevict::make_policy(test_case.policy, test_case.params));
    config.key_storage = KeyStorage::post_rope;
    EvictingCache<float> post(config, kvevict::make_policy(test_case.policy, test_case.params));
    double worst = 0;
    for (int step = 0; step < 2000; ++step) {
      const int n = step % 50 == 0 ? 1 + static_cast<int>(rng() % 8) : 1;
      const std::vector<std::int32_t> ids(static_cast<std::size_t>(n), 1);
      pre.begin_chunk(ids);
      post.begin_chunk(ids);
      for (int l = 0; l < shape.layers; ++l) {
        for (int g = 0; g < shape.kv_heads; ++g) {
          const Matrix k = random_matrix(rng, n, 32);
          const Matrix v = random_matrix(rng, n, 32);
          pre.write_chunk(l, g, k, v);
          post.write_chunk(l, g, k, v);
        }
      }
      pre.end_forward();
      post.end_forward();
      if (step % 97 != 0) continue;
      const Matrix q = random_matrix(rng, 1, 32);
      const std::vector<float> query(q.data(), q.data() + 32);
      for (int l = 0; l < shape.layers; ++l) {
        for (int g = 0; g < shape.kv_heads; ++g) {
          const std::vector<double> a = scores(pre, l, g, query);
          const std::vector<double> b = scores(post, l, g, query);
          ASSERT_EQ(a.size(), b.size());
          // Keys and queries are standard normal in 32 dims: |q||k| ~ 32.
          for (std::size_t i = 0; i < a.size(); ++i)
            worst = std::max(worst, std::fabs(a[i] - b[i]) / 32.0);
        }
      }
    }
    std::printf("[ measured ] %s %s: worst |score difference| / (|q||k|) %.3g\n", test_case.policy,
                std::string(kvevict::to_string(test_case.mode)).c_str(), worst);
    EXPECT_LT(worst, 1e-5) << test_case.policy << " " << kvevict::to_string(test_case.mode);
  }
}

// A bounded policy never reallocates: buffers are sized from retained_limit() + max_chunk.
TEST(EvictingCache, BoundedPolicyNeverReallocates) {
  CacheConfig config;
  config.shape = CacheShape{1, 2, 1, 8};
  config.max_chunk = 4;
  EvictingCache<float> cache(
      config,
      kvevict::make_policy("streaming_llm", PolicyParams().set("sinks", 4).set("recent", 12)));
  EXPECT_EQ(cache.store().capacity(), 4 + 12 + 4);
  const std::size_t reserved = cache.memory().reserved_bytes;
  std::mt19937 rng(1);
  for (int step = 0; step < 1000; ++step) {
    const int n = 1 + step % 4;
    cache.begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 0));
    cache.write_chunk(0, 0, random_matrix(rng, n, 8), random_matrix(rng, n, 8));
    cache.end_forward();
  }
  EXPECT_EQ(cache.memory().reserved_bytes, reserved);
  EXPECT_EQ(cache.live(0, 0), 16);
  EXPECT_EQ(cache.memory().peak_live_bytes, 20 * cache.store().bytes_per_slot());
}

// Pre-RoPE attention rotates a copy of the keys into the caller's scratch; the scratch is sized to
// the capacity once, so a growing cache does not reallocate it at every forward.
TEST(EvictingCache, AttentionKeysReuseTheirScratch) {
  CacheConfig config;
  config.shape = CacheShape{1, 1, 1, 8};
  config.key_storage = KeyStorage::pre_rope;
  config.initial_capacity = 32;
  EvictingCache<float> cache(config, kvevict::make_policy("full", PolicyParams()));
  std::mt19937 rng(4);
  Matrix scratch;
  const float* first_buffer = nullptr;
  for (int step = 0; step < 20; ++step) {
    cache.begin_chunk(std::vector<std::int32_t>{0});
    cache.write_chunk(0, 0, random_matrix(rng, 1, 8), random_matrix(rng, 1, 8));
    const Eigen::Map<const Matrix> keys = cache.attention_keys(0, 0, scratch);
    EXPECT_EQ(keys.rows(), step + 1);
    if (step == 0) first_buffer = scratch.data();
    EXPECT_EQ(scratch.data(), first_buffer) << "step " << step;
    cache.end_forward();
  }
}

TEST(EvictingCache, UnboundedPolicyGrowsAndKeepsContents) {
  CacheConfig config;
  config.shape = CacheShape{1, 1, 1, 4};
  EvictingCache<float> cache(config, kvevict::make_policy("full", PolicyParams()));
  std::mt19937 rng(9);
  std::vector<float> first_key;
  for (int step = 0; step < 700; ++step) {
    cache.begin_chunk(std::vector<std::int32_t>{0});
    const Matrix k = random_matrix(rng, 1, 4);
    if (step == 0) first_key.assign(k.data(), k.data() + 4);
    cache.write_chunk(0, 0, k, k);
    cache.end_forward();
  }
  EXPECT_EQ(cache.live(0, 0), 700);
  EXPECT_GE(cache.store().capacity(), 700);
  for (int c = 0; c < 4; ++c)
    EXPECT_EQ(cache.store().keys(0, 0)(0, c), first_key[static_cast<std::size_t>(c)]);
}

// A test policy with a pot: when M slots are cached it asks for a catalyst, then keeps the C pot
// slots the catalyst attended to most (summed over its queries and the group's query heads).
class TestPotPolicy final : public kvevict::Policy {
 public:
  TestPotPolicy(int pot, int keep) : pot_(pot), keep_(keep) {}
  std::string_view name() const override { return "test_pot"; }
  kvevict::SignalSet signals() const override { return {kvevict::Signal::catalyst_attention}; }
  kvevict::TriggerSet triggers() const override { return {kvevict::Trigger::pot_full}; }
  int score_columns() const override { return 1; }
  PositionMode default_position_mode() const override { return PositionMode::reset_on_compact; }
  bool pot_full(const SlotTable& slots) const override { return slots.max_live() >= pot_; }
  std::optional<int> pot_room(const SlotTable& slots) const override {
    return pot_ - slots.max_live();
  }
  void observe_catalyst(SlotTable& slots, int layer, const kvevict::AttentionRows& rows) override {
    for (int g = 0; g < slots.kv_heads(); ++g) {
      kvevict::add_attention_of_group(rows, g, kvevict::HeadReduction::sum,
                                      slots.scores(layer, g, 0));
    }
  }
  bool select(const kvevict::EvictionContext& context, kvevict::CompactionPlan& plan) override {
    last_trigger = context.trigger;
    for (int l = 0; l < context.slots.layers(); ++l) {
      for (int g = 0; g < context.slots.kv_heads(); ++g) {
        builder_.begin(context.slots.live(l, g));
        builder_.keep_top_k(context.slots.scores(l, g, 0), keep_);
        builder_.write(plan, l, g);
      }
    }
    return true;
  }
  kvevict::Trigger last_trigger = kvevict::Trigger::after_forward;

 private:
  int pot_, keep_;
  kvevict::KeepSetBuilder builder_;
};

TEST(EvictionPipeline, CatalystIsAttendedRolledBackAndDistilled) {
  SlotTable slots(1, 1, 16, 1);
  auto owned = std::make_unique<TestPotPolicy>(6, 3);
  TestPotPolicy* policy = owned.get();
  EvictionPipeline pipeline(slots, std::move(owned));
  EXPECT_EQ(pipeline.position_mode(), PositionMode::reset_on_compact);
  pipeline.before_chunk(6, true);
  pipeline.append_chunk(std::vector<std::int32_t>{10, 11, 12, 13, 14, 15});
  EXPECT_EQ(pipeline.end_forward(), nullptr);  // no after_forward trigger
  ASSERT_TRUE(pipeline.catalyst_pending());

  pipeline.begin_catalyst(std::vector<std::int32_t>{90, 91});
  EXPECT_EQ(slots.live(0, 0), 8);
  EXPECT_EQ(slots.flags(0, 0)[6] & kvevict::slot_flag::catalyst, kvevict::slot_flag::catalyst);
  EXPECT_EQ(slots.positions(0, 0)[7], 7);  // the catalyst continues the positions
  // Two catalyst queries, one query head; rows over 8 slots. Attention mass on pot slots 1, 4, 5
  // sums to 0.9, 0.5 + 0.2, 0.3: those three win.
  std::vector<float> rows{0.0f, 0.5f, 0.0f, 0.0f, 0.2f, 0.3f, 0.0f, 0.0f,
                          0.0f, 0.4f, 0.0f, 0.0f, 0.0f, 0.0f, 0.3f, 0.3f};
  const std::vector<int> keys{8};
  pipeline.observe_catalyst(0, kvevict::AttentionRows(rows.data(), 1, 1, 2, 8, keys, 6));
  const kvevict::CompactionPlan* plan = pipeline.end_catalyst();
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(policy->last_trigger, kvevict::Trigger::pot_full);
  const auto original = slots.original_positions(0, 0);
  EXPECT_EQ(std::vector<std::int64_t>(original.begin(), original.end()),
            (std::vector<std::int64_t>{1, 4, 5}));
  const auto positions = slots.positions(0, 0);
  EXPECT_EQ(std::vector<std::int64_t>(positions.begin(), positions.end()),
            (std::vector<std::int64_t>{0, 1, 2}));
  // New tokens continue from C = 3, original positions from 6 (the catalyst never counted).
  pipeline.before_chunk(1, false);
  pipeline.append_chunk(std::vector<std::int32_t>{16});
  EXPECT_EQ(slots.positions(0, 0)[3], 3);
  EXPECT_EQ(slots.original_positions(0, 0)[3], 6);
  EXPECT_EQ(*policy->pot_room(slots), 2);
}

// before_turn fires only at a turn start, and knows the incoming size.
class MakeRoomPolicy final : public kvevict::Policy {
 public:
  explicit MakeRoomPolicy(int capacity) : capacity_(capacity) {}
  std::string_view name() const override { return "make_room"; }
  kvevict::TriggerSet triggers() const override { return {kvevict::Trigger::before_turn}; }
  bool select(const kvevict::EvictionContext& context, kvevict::CompactionPlan& plan) override {
    seen_incoming.push_back(context.incoming);
    const int live = context.slots.live(0, 0);
    builder_.begin(live);
    builder_.keep_range(live - (capacity_ - context.incoming), live);
    return builder_.write(plan, 0, 0);
  }
  std::vector<int> seen_incoming;

 private:
  int capacity_;
  kvevict::KeepSetBuilder builder_;
};

TEST(EvictionPipeline, BeforeTurnMakesRoomForTheIncomingTurn) {
  SlotTable slots(1, 1, 16, 0);
  auto owned = std::make_unique<MakeRoomPolicy>(10);
  MakeRoomPolicy* policy = owned.get();
  EvictionPipeline pipeline(slots, std::move(owned), PositionMode::original);
  for (int n : {6, 3}) {
    EXPECT_EQ(pipeline.before_chunk(n, true), nullptr);  // 0 + 6 and 6 + 3 fit in 10
    pipeline.append_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 0));
    pipeline.end_forward();
  }
  pipeline.before_chunk(2, false);  // not a turn start: no trigger
  pipeline.append_chunk(std::vector<std::int32_t>{0, 0});
  EXPECT_EQ(slots.live(0, 0), 11);
  const kvevict::CompactionPlan* plan = pipeline.before_chunk(4, true);  // keep the last 10 - 4
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->trigger, kvevict::Trigger::before_turn);
  EXPECT_EQ(slots.live(0, 0), 6);
  EXPECT_EQ(slots.original_positions(0, 0)[0], 5);
  EXPECT_EQ(policy->seen_incoming, (std::vector<int>{6, 3, 4}));
}

// cache_index and reset_on_compact assign the same positions (kvevict re-positions only at
// compaction): documented in positions.hpp, checked here on an irregular eviction pattern.
TEST(EvictionPipeline, CacheIndexAndResetOnCompactAgree) {
  SlotTable a(1, 1, 64, 0), b(1, 1, 64, 0);
  const PolicyParams params = PolicyParams().set("sinks", 3).set("recent", 7);
  EvictionPipeline pa(a, kvevict::make_policy("streaming_llm", params), PositionMode::cache_index);
  EvictionPipeline pb(b, kvevict::make_policy("streaming_llm", params),
                      PositionMode::reset_on_compact);
  for (int n : {5, 1, 9, 1, 1, 13, 2, 1}) {
    for (EvictionPipeline* p : {&pa, &pb}) {
      p->before_chunk(n, false);
      p->append_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 0));
      p->end_forward();
    }
    EXPECT_TRUE(std::equal(a.positions(0, 0).begin(), a.positions(0, 0).end(),
                           b.positions(0, 0).begin(), b.positions(0, 0).end()));
  }
}

// Policies are per-sequence objects: interleaving two sequences changes nothing.
TEST(EvictionPipeline, SequencesAreIndependent) {
  const PolicyParams params = PolicyParams().set("sinks", 1).set("recent", 4);
  SlotTable alone(1, 1, 32, 0), x(1, 1, 32, 0), y(1, 1, 32, 0);
  EvictionPipeline p_alone(alone, kvevict::make_policy("streaming_llm", params));
  EvictionPipeline px(x, kvevict::make_policy("streaming_llm", params));
  EvictionPipeline py(y, kvevict::make_policy("streaming_llm", params));
  for (int step = 0; step < 20; ++step) {
    for (EvictionPipeline* p : {&p_alone, &px, &py, &py}) {
      p->before_chunk(1, false);
      p->append_chunk(std::vector<std::int32_t>{step});
      p->end_forward();
    }
  }
  EXPECT_TRUE(std::equal(alone.original_positions(0, 0).begin(),
                         alone.original_positions(0, 0).end(), x.original_positions(0, 0).begin(),
                         x.original_positions(0, 0).end()));
  EXPECT_EQ(y.original_positions(0, 0).back(), 39);
}

TEST(EvictionPipeline, ClearErrorsForMisuse) {
  SlotTable slots(1, 1, 4, 0);
  EvictionPipeline pipeline(slots, kvevict::make_policy("full", PolicyParams()));
  EXPECT_THROW(pipeline.before_chunk(0, false), kvevict::Error);
  pipeline.append_chunk(std::vector<std::int32_t>{1, 2, 3});
  try {
    pipeline.append_chunk(std::vector<std::int32_t>{4, 5});
    FAIL() << "expected a capacity error";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("do not fit"), std::string::npos) << error.what();
  }
  EXPECT_THROW(pipeline.observe_surprisal(std::vector<float>{1.0f}), kvevict::Error);  // 3 expected
  EXPECT_THROW(pipeline.end_catalyst(), kvevict::Error);
  EXPECT_THROW(EvictionPipeline(slots, nullptr), kvevict::Error);
  CacheConfig config;
  config.shape = CacheShape{1, 4, 3, 8};  // 4 query heads do not divide into 3 KV heads
  EXPECT_THROW(EvictingCache<float>(config, kvevict::make_policy("full", PolicyParams())),
               kvevict::Error);
  config.shape = CacheShape{1, 4, 2, 8};
  config.rope.head_dim = 16;
  EXPECT_THROW(EvictingCache<float>(config, kvevict::make_policy("full", PolicyParams())),
               kvevict::Error);
}

}  // namespace
