// The C API: the same decisions as the C++ Sequence, applied through an engine's own backend
// callbacks, and every failure a status plus a message, never an exception.
#include <gtest/gtest.h>
#include <kvevict/c_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <kvevict/engine.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/version.hpp>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "support/policy_harness.hpp"

namespace {

using kvevict::test::observe_attention;

struct SequenceDeleter {
  void operator()(kvevict_sequence* sequence) const { kvevict_sequence_destroy(sequence); }
};
using CSequence = std::unique_ptr<kvevict_sequence, SequenceDeleter>;

kvevict_config config(int layers, int q_heads, int kv_heads, int max_chunk = 4) {
  kvevict_config c;
  kvevict_config_init(&c);
  c.layers = layers;
  c.q_heads = q_heads;
  c.kv_heads = kv_heads;
  c.max_chunk = max_chunk;
  return c;
}

CSequence create(const char* policy, const char* params, const kvevict_config& c,
                 const kvevict_backend* backend = nullptr) {
  kvevict_sequence* raw = nullptr;
  const kvevict_status status = kvevict_sequence_create(policy, params, &c, backend, &raw);
  EXPECT_EQ(status, KVEVICT_OK) << kvevict_last_error();
  return CSequence(raw);
}

// An engine with its own token-major buffer: one value per (slot, layer, KV head) standing for the
// token's K/V (its original position, so that the test can see which token a slot holds), and a
// record of what each decision asked.
struct Engine {
  Engine(int layer_count, int kv_head_count) : layers(layer_count), kv_heads(kv_head_count) {}
  int layers = 0;
  int kv_heads = 0;
  int capacity = 0;
  std::vector<std::int64_t> rows;  // [capacity][layers][kv_heads]
  int applies = 0;
  std::int64_t evicted = 0;
  int fail_apply = 0;
  int fail_reserve = 0;

  std::int64_t& at(std::int32_t slot, int l, int g) {
    return rows[(static_cast<std::size_t>(slot) * layers + l) * kv_heads + g];
  }
  static int reserve(void* self, int capacity) {
    Engine& e = *static_cast<Engine*>(self);
    if (e.fail_reserve != 0) return e.fail_reserve;
    e.rows.resize(static_cast<std::size_t>(capacity) * e.layers * e.kv_heads, -1);
    e.capacity = capacity;
    return 0;
  }
  static int apply(void* self, const kvevict_decision* decision) {
    Engine& e = *static_cast<Engine*>(self);
    ++e.applies;
    for (int l = 0; l < e.layers; ++l) {
      for (int g = 0; g < e.kv_heads; ++g) {
        const kvevict_evicted* evicted = nullptr;
        int count = 0;
        if (kvevict_decision_evicted(decision, l, g, &evicted, &count) != KVEVICT_OK) return 1;
        for (int i = 0; i < count; ++i) {
          if (e.at(evicted[i].slot, l, g) != evicted[i].original_position) return 2;  // stale
          e.at(evicted[i].slot, l, g) = -1;
        }
        e.evicted += count;
      }
    }
    return e.fail_apply;
  }
  kvevict_backend backend() { return kvevict_backend{this, &Engine::reserve, &Engine::apply}; }
};

// Feeds `n` tokens: writes each token's "K/V" (its original position) at the slots kvevict gives.
void feed(kvevict_sequence* s, Engine& engine, std::int64_t& fed, int n, int turn_start = 0) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n), 5);
  ASSERT_EQ(kvevict_sequence_begin_chunk(s, ids.data(), n, turn_start), KVEVICT_OK)
      << kvevict_last_error();
  for (int l = 0; l < engine.layers; ++l) {
    for (int g = 0; g < engine.kv_heads; ++g) {
      const std::int32_t* slots = nullptr;
      int count = 0;
      ASSERT_EQ(kvevict_sequence_chunk_slots(s, l, g, &slots, &count), KVEVICT_OK);
      ASSERT_EQ(count, n);
      for (int i = 0; i < n; ++i) {
        ASSERT_LT(slots[i], engine.capacity);
        engine.at(slots[i], l, g) = fed + i;
      }
    }
  }
  ASSERT_EQ(kvevict_sequence_end_forward(s), KVEVICT_OK) << kvevict_last_error();
  fed += n;
}

// The tokens head (l, g) of the engine holds, ascending.
std::vector<std::int64_t> held(const Engine& engine, int l, int g) {
  std::vector<std::int64_t> out;
  for (int slot = 0; slot < engine.capacity; ++slot) {
    const std::int64_t v =
        engine.rows[(static_cast<std::size_t>(slot) * engine.layers + l) * engine.kv_heads + g];
    if (v >= 0) out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// StreamingLLM sinks 2 + recent 3 over an engine's own buffer: the engine ends up holding exactly
// the tokens the rule keeps, and never had to move a row.
TEST(CApi, StreamingLlmOverAnEnginesOwnBuffers) {
  Engine engine(2, 2);
  const kvevict_backend backend = engine.backend();
  const kvevict_config c = config(2, 2, 2, 1);
  CSequence s = create("streaming_llm", "sinks=2 recent=3", c, &backend);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(engine.capacity, 2 + 3 + 1);  // retained limit + max_chunk, reserved at creation
  EXPECT_EQ(kvevict_sequence_retained_limit(s.get()), 5);
  EXPECT_EQ(kvevict_sequence_signals(s.get()), 0u);
  std::int64_t fed = 0;
  for (int t = 0; t < 12; ++t) feed(s.get(), engine, fed, 1);
  for (int l = 0; l < 2; ++l) {
    for (int g = 0; g < 2; ++g) {
      EXPECT_EQ(held(engine, l, g), (std::vector<std::int64_t>{0, 1, 9, 10, 11}));
    }
  }
  EXPECT_EQ(engine.applies, 7);  // one call per decision, tokens 5..11
  EXPECT_EQ(engine.evicted, 7 * 4);
  // cache_index positions: the window sits at 2, 3, 4 whatever its slots.
  for (int slot = 0; slot < kvevict_sequence_slot_limit(s.get(), 1, 1); ++slot) {
    std::int64_t position = -1, key_position = -1;
    if (kvevict_sequence_position(s.get(), 1, 1, slot, &position, &key_position) != KVEVICT_OK) {
      continue;  // free
    }
    const std::int64_t token = engine.at(slot, 1, 1);
    EXPECT_EQ(position, token < 2 ? token : token - 9 + 2);
    EXPECT_EQ(key_position, token);  // rotated once, to its original position; never re-rotated
  }
  // Key runs and the live mask exist during a forward only, and cover exactly the live slots:
  // the 5 kept and the chunk's new token.
  const kvevict_key_run* runs = nullptr;
  int count = -1;
  EXPECT_EQ(kvevict_sequence_key_runs(s.get(), 1, 1, &runs, &count), KVEVICT_INVALID_ARGUMENT);
  const int32_t id = 12;
  ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_OK);
  ASSERT_EQ(kvevict_sequence_key_runs(s.get(), 1, 1, &runs, &count), KVEVICT_OK);
  EXPECT_LE(count, 3);  // sinks and window (the window may wrap around the slots)
  const uint8_t* mask = nullptr;
  int mask_size = -1;
  ASSERT_EQ(kvevict_sequence_live_mask(s.get(), 1, 1, &mask, &mask_size), KVEVICT_OK);
  ASSERT_EQ(mask_size, kvevict_sequence_slot_limit(s.get(), 1, 1));
  int in_runs = 0;
  for (int r = 0; r < count; ++r) {
    in_runs += runs[r].end - runs[r].begin;
    for (int slot = runs[r].begin; slot < runs[r].end; ++slot) EXPECT_EQ(mask[slot], 1);
  }
  EXPECT_EQ(in_runs, 6);
  EXPECT_EQ(std::count(mask, mask + mask_size, 1), 6);
}

// The same decisions as the C++ Sequence, for a policy driven by attention rows.
TEST(CApi, H2oDecidesAsTheCppSequence) {
  const kvevict_config c = config(1, 2, 1, 2);
  CSequence s = create("h2o", "heavy=3 recent=2", c);
  kvevict::SequenceConfig cpp_config;
  cpp_config.layers = 1;
  cpp_config.q_heads = 2;
  cpp_config.kv_heads = 1;
  cpp_config.max_chunk = 2;
  kvevict::Sequence cpp(
      cpp_config,
      kvevict::make_policy("h2o", kvevict::PolicyParams().set("heavy", 3).set("recent", 2)));
  EXPECT_EQ(kvevict_sequence_signals(s.get()),
            static_cast<uint32_t>(KVEVICT_SIGNAL_ATTENTION_ROWS));
  std::uint64_t x = 7;
  for (int step = 0; step < 40; ++step) {
    const int n = 1 + step % 2;
    const std::vector<std::int32_t> ids(static_cast<std::size_t>(n), 1);
    ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), ids.data(), n, 0), KVEVICT_OK);
    cpp.begin_chunk(ids);
    // Rows over slots: both sides give the same tokens the same slots (same decisions so far).
    const int limit = kvevict_sequence_slot_limit(s.get(), 0, 0);
    ASSERT_EQ(limit, cpp.slot_limit(0, 0));
    std::vector<float> rows(static_cast<std::size_t>(2 * n * limit), 0.0f);
    for (const std::int32_t slot : cpp.slots().stream_order(0)) {
      for (int r = 0; r < 2 * n; ++r) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        rows[static_cast<std::size_t>(r * limit + slot)] =
            static_cast<float>(x >> 40) / 16777216.0f;
      }
    }
    ASSERT_EQ(kvevict_sequence_observe_attention(s.get(), 0, rows.data(), n, limit), KVEVICT_OK)
        << kvevict_last_error();
    const std::vector<int> keys{limit};
    observe_attention(cpp, 0, kvevict::AttentionRows(rows.data(), 2, 2, n, limit, keys, 0));
    ASSERT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK);
    cpp.end_forward();
    for (int slot = 0; slot < limit; ++slot) {
      std::int64_t position = -1;
      const bool live =
          kvevict_sequence_position(s.get(), 0, 0, slot, &position, nullptr) == KVEVICT_OK;
      ASSERT_EQ(live, cpp.slots().is_live(0, slot)) << "step " << step << " slot " << slot;
    }
  }
  EXPECT_EQ(kvevict_sequence_live(s.get(), 0, 0), 5);
}

// One anchor id is a list of one: the parameter's type comes from the policy's spec.
TEST(CApi, AnLlmTakesASingleAnchorId) {
  const kvevict_config c = config(1, 1, 1);
  CSequence single = create("anllm", "anchor_ids=29889", c);
  ASSERT_NE(single, nullptr);
  CSequence pair = create("anllm", "anchor_ids=29889,32001", c);
  ASSERT_NE(pair, nullptr);
  const std::int32_t tokens[] = {1, 2, 29889, 3};
  ASSERT_EQ(kvevict_sequence_begin_chunk(single.get(), tokens, 4, 0), KVEVICT_OK);
  ASSERT_EQ(kvevict_sequence_end_forward(single.get()), KVEVICT_OK);
  EXPECT_EQ(kvevict_sequence_live(single.get(), 0, 0), 2);  // the anchor and the token after it
}

TEST(CApi, BudgetParamsAndVersion) {
  char buffer[64];
  ASSERT_EQ(kvevict_budget_params("h2o", 101, 4, buffer, sizeof buffer), KVEVICT_OK);
  EXPECT_STREQ(buffer, "heavy=50 recent=51");
  ASSERT_EQ(kvevict_budget_params("streaming_llm", 64, 4, buffer, sizeof buffer), KVEVICT_OK);
  EXPECT_STREQ(buffer, "recent=60 sinks=4");
  EXPECT_EQ(kvevict_budget_params("streaming_llm", 64, 4, buffer, 5), KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_budget_params("full", 64, 4, buffer, sizeof buffer), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("full"), std::string::npos);
  EXPECT_STREQ(kvevict_version(), kvevict::kVersionString);
}

// A catalyst run through the C API: the rolled-back catalyst and the distillation reach the
// backend in one apply.
// A sequence budget in bytes of the engine's KV type, split by pyramid: 2 layers x 1 KV head of
// head_dim 32 in f16, 128 bytes a token's K and V. h2o heavy 8 recent 0 (per head): 2,048 bytes
// hold 16 tokens, 8 per head on average; beta 2: lo = 4, hi = 12, step 8: 12 and 4.
TEST(CApi, ByteBudgetAndAllocation) {
  kvevict_config c;
  kvevict_config_init(&c);
  EXPECT_EQ(c.pyramid_beta, 20);
  EXPECT_EQ(c.adaptive_floor, 0.2);
  c.layers = 2;
  c.q_heads = 1;
  c.kv_heads = 1;
  c.max_chunk = 4;
  c.head_dim = 32;
  c.budget_bytes = 2048;
  c.kv_type = "f16";
  c.allocation = "pyramid";
  c.pyramid_beta = 2;
  kvevict_sequence* raw = nullptr;
  ASSERT_EQ(kvevict_sequence_create("h2o", "heavy=8 recent=0", &c, nullptr, &raw), KVEVICT_OK)
      << kvevict_last_error();
  EXPECT_EQ(kvevict_sequence_retained_limit(raw), 12);
  kvevict_sequence_destroy(raw);
  c.allocation = "lopsided";
  EXPECT_NE(kvevict_sequence_create("h2o", "heavy=8 recent=0", &c, nullptr, &raw), KVEVICT_OK);
  EXPECT_NE(std::string(kvevict_last_error()).find("unknown allocation 'lopsided'"),
            std::string::npos);
  c.allocation = "uniform";
  c.budget_bytes = 100;  // below one 128-byte token per head
  EXPECT_NE(kvevict_sequence_create("h2o", "heavy=8 recent=0", &c, nullptr, &raw), KVEVICT_OK);
  EXPECT_NE(std::string(kvevict_last_error()).find("smaller than one row per unit"),
            std::string::npos);
}

TEST(CApi, CatalystThroughTheCApi) {
  Engine engine(1, 1);
  const kvevict_backend backend = engine.backend();
  kvevict_config c = config(1, 1, 1, 3);
  CSequence s = create("infinipot", "pot=6 keep=3 novel=0", c, &backend);
  std::int64_t fed = 0;
  for (int t = 0; t < 2; ++t) feed(s.get(), engine, fed, 3);
  EXPECT_EQ(kvevict_sequence_pot_room(s.get()), 0);
  ASSERT_EQ(kvevict_sequence_catalyst_pending(s.get()), 1);
  const std::int32_t catalyst[] = {9, 9};
  ASSERT_EQ(kvevict_sequence_begin_catalyst(s.get(), catalyst, 2), KVEVICT_OK);
  const std::int32_t* slots = nullptr;
  int count = 0;
  ASSERT_EQ(kvevict_sequence_chunk_slots(s.get(), 0, 0, &slots, &count), KVEVICT_OK);
  ASSERT_EQ(count, 2);
  for (int i = 0; i < 2; ++i) engine.at(slots[i], 0, 0) = fed + i;
  // The catalyst attends to pot tokens 1, 3, 5 only.
  const int limit = kvevict_sequence_slot_limit(s.get(), 0, 0);
  std::vector<float> rows(static_cast<std::size_t>(2 * limit), 0.0f);
  for (int slot = 0; slot < limit; ++slot) {
    const std::int64_t token = engine.at(slot, 0, 0);
    if (token == 1 || token == 3 || token == 5) rows[static_cast<std::size_t>(slot)] = 0.3f;
  }
  ASSERT_EQ(kvevict_sequence_observe_catalyst(s.get(), 0, rows.data(), 2, limit), KVEVICT_OK)
      << kvevict_last_error();
  ASSERT_EQ(kvevict_sequence_end_catalyst(s.get()), KVEVICT_OK) << kvevict_last_error();
  EXPECT_EQ(engine.applies, 1);
  EXPECT_EQ(engine.evicted, 2 + 3);  // catalyst rolled back, pot 6 -> 3
  EXPECT_EQ(held(engine, 0, 0), (std::vector<std::int64_t>{1, 3, 5}));
}

// An empty catalyst prompt (InfiniPot's "w/o CaP" ablation) has no slots. fuzz_c_api found the
// previous chunk's slots still listed (regressions/c_api/empty-catalyst-keeps-chunk-slots): an
// engine writing the catalyst's K/V at them would overwrite three live tokens.
TEST(CApi, AnEmptyCatalystHasNoSlots) {
  Engine engine(1, 1);
  const kvevict_backend backend = engine.backend();
  CSequence s = create("infinipot", "pot=6 keep=3 novel=0", config(1, 1, 1, 3), &backend);
  std::int64_t fed = 0;
  for (int t = 0; t < 2; ++t) feed(s.get(), engine, fed, 3);
  ASSERT_EQ(kvevict_sequence_catalyst_pending(s.get()), 1);
  ASSERT_EQ(kvevict_sequence_begin_catalyst(s.get(), nullptr, 0), KVEVICT_OK);
  const std::int32_t* slots = nullptr;
  int count = -1;
  ASSERT_EQ(kvevict_sequence_chunk_slots(s.get(), 0, 0, &slots, &count), KVEVICT_OK);
  EXPECT_EQ(count, 0);
  ASSERT_EQ(kvevict_sequence_end_catalyst(s.get()), KVEVICT_OK) << kvevict_last_error();
  EXPECT_EQ(held(engine, 0, 0).size(), 3u);  // the pot distilled to keep = 3
}

// Surprisal the policy rejects (NaN) is not observed: end_forward still asks for it, and the engine
// may give it again. fuzz_c_api found the rejected call counted as the chunk's surprisal, a retry
// refused as "already observed", and InfiniPot's pot unable to distil ever after (no surprisal for
// those tokens) (regressions/c_api/rejected-surprisal-counts-as-observed).
TEST(CApi, RejectedSurprisalCanBeGivenAgain) {
  Engine engine(1, 1);
  const kvevict_backend backend = engine.backend();
  CSequence s = create("infinipot", "pot=4 keep=2 novel=1", config(1, 1, 1, 2), &backend);
  std::int64_t fed = 0;
  const auto forward = [&](float first_surprisal) {
    const std::int32_t ids[] = {5, 6};
    ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 2, 0), KVEVICT_OK);
    const std::int32_t* slots = nullptr;
    int count = 0;
    ASSERT_EQ(kvevict_sequence_chunk_slots(s.get(), 0, 0, &slots, &count), KVEVICT_OK);
    for (int i = 0; i < count; ++i) engine.at(slots[i], 0, 0) = fed++;
    const float bad[] = {first_surprisal, 1.0f};
    if (std::isnan(first_surprisal)) {
      EXPECT_EQ(kvevict_sequence_observe_surprisal(s.get(), bad, 2), KVEVICT_INVALID_ARGUMENT);
      EXPECT_NE(std::string(kvevict_last_error())
                    .find("token 0 of the chunk (original position " + std::to_string(fed - 2) +
                          ") is NaN"),
                std::string::npos)
          << kvevict_last_error();
      EXPECT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_INVALID_ARGUMENT);
      EXPECT_NE(std::string(kvevict_last_error()).find("needs the surprisal"), std::string::npos);
    }
    const float good[] = {2.0f, 1.0f};
    ASSERT_EQ(kvevict_sequence_observe_surprisal(s.get(), good, 2), KVEVICT_OK)
        << kvevict_last_error();
    ASSERT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK) << kvevict_last_error();
  };
  forward(std::numeric_limits<float>::quiet_NaN());
  forward(3.0f);
  ASSERT_EQ(kvevict_sequence_catalyst_pending(s.get()), 1);
  ASSERT_EQ(kvevict_sequence_begin_catalyst(s.get(), nullptr, 0), KVEVICT_OK);
  ASSERT_EQ(kvevict_sequence_end_catalyst(s.get()), KVEVICT_OK) << kvevict_last_error();
  EXPECT_EQ(kvevict_sequence_live(s.get(), 0, 0), 2);  // the pot of 4 distilled to keep = 2
}

TEST(CApi, EveryFailureIsAStatusAndAMessage) {
  const kvevict_config c = config(1, 1, 1);
  kvevict_sequence* raw = nullptr;
  EXPECT_EQ(kvevict_sequence_create("lru", nullptr, &c, nullptr, &raw), KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(raw, nullptr);
  EXPECT_NE(std::string(kvevict_last_error()).find("unknown policy 'lru'"), std::string::npos);
  EXPECT_EQ(kvevict_sequence_create("window", "recent=x", &c, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("malformed value"), std::string::npos);
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4 recnt=2", &c, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("unknown parameter 'recnt'"), std::string::npos);
  // A policy that cannot run on the configured heads is refused at creation, not at its first
  // forward: SnapKV's gqa = repeat needs one KV head per query head.
  const kvevict_config grouped = config(2, 4, 2);
  EXPECT_EQ(kvevict_sequence_create("snapkv", "capacity=8 window=2", &grouped, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("build it with kv_heads = q_heads"),
            std::string::npos);
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4", nullptr, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_sequence_create(nullptr, "", &c, nullptr, &raw), KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4", &c, nullptr, nullptr),
            KVEVICT_INVALID_ARGUMENT);
  kvevict_config bad = c;
  bad.kv_heads = 0;
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4", &bad, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  bad = c;
  bad.kv_heads = std::numeric_limits<int>::max();
  bad.layers = std::numeric_limits<int>::max();
  bad.q_heads = std::numeric_limits<int>::max();
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4", &bad, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);  // layers * kv_heads would overflow: refused
  bad = c;
  bad.position_mode = "sideways";
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4", &bad, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  // Budgets whose sums leave int range are refused, not wrapped.
  EXPECT_EQ(kvevict_sequence_create("h2o", "heavy=2147483647 recent=2147483647", &c, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_sequence_create("streaming_llm", "sinks=268435456 recent=268435456", &c,
                                    nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);

  // NULL handles: sentinels, never a crash.
  EXPECT_EQ(kvevict_sequence_signals(nullptr), 0u);
  EXPECT_EQ(kvevict_sequence_retained_limit(nullptr), -1);
  EXPECT_EQ(kvevict_sequence_capacity(nullptr), -1);
  EXPECT_EQ(kvevict_sequence_live(nullptr, 0, 0), -1);
  EXPECT_EQ(kvevict_sequence_slot_limit(nullptr, 0, 0), -1);
  EXPECT_EQ(kvevict_sequence_tokens_fed(nullptr), -1);
  EXPECT_EQ(kvevict_sequence_pot_room(nullptr), -1);
  EXPECT_EQ(kvevict_sequence_catalyst_pending(nullptr), 0);
  EXPECT_EQ(kvevict_sequence_end_forward(nullptr), KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_decision_rotation_count(nullptr, 0, 0), -1);
  kvevict_sequence_destroy(nullptr);

  CSequence s = create("sirllm", "entropy=8", c);
  EXPECT_EQ(kvevict_sequence_live(s.get(), 1, 0), -1);
  const std::int32_t ids[] = {1, 2};
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), nullptr, 2, 1), KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 0, 1), KVEVICT_INVALID_ARGUMENT);
  ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 2, 1), KVEVICT_OK);
  const float surprisal[] = {1.0f, 2.0f};
  EXPECT_EQ(kvevict_sequence_observe_surprisal(s.get(), surprisal, -1), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("count must be >= 0, got -1"), std::string::npos)
      << kvevict_last_error();
  EXPECT_EQ(kvevict_sequence_observe_surprisal(s.get(), nullptr, 2), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("surprisal is NULL"), std::string::npos);
  // The signal contract: SirLLM needs surprisal before the forward ends.
  EXPECT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("needs the surprisal"), std::string::npos);
  ASSERT_EQ(kvevict_sequence_observe_surprisal(s.get(), surprisal, 2), KVEVICT_OK);
  ASSERT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK);
  EXPECT_STREQ(kvevict_last_error(), "");
}

TEST(CApi, ABackendFailureIsReportedAndFinal) {
  Engine engine(1, 1);
  engine.fail_apply = 7;
  const kvevict_backend backend = engine.backend();
  CSequence s = create("window", "recent=2", config(1, 1, 1, 1), &backend);
  std::int64_t fed = 0;
  for (int t = 0; t < 2; ++t) feed(s.get(), engine, fed, 1);  // nothing evicted yet
  const std::int32_t id = 1;
  ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_OK);
  EXPECT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_BACKEND_ERROR);
  EXPECT_NE(std::string(kvevict_last_error()).find("apply() returned 7"), std::string::npos);
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("unusable"), std::string::npos);
}

// A reserve callback that fails fails the call with KVEVICT_BACKEND_ERROR and leaves the sequence
// unusable (the engine's buffers may be anywhere between the two sizes), as a failed apply does.
TEST(CApi, AFailedReserveIsReportedAndFinal) {
  Engine engine(1, 1);
  const kvevict_backend backend = engine.backend();
  CSequence s = create("full", nullptr, config(1, 1, 1, 4), &backend);
  const int capacity = kvevict_sequence_capacity(s.get());
  std::int64_t fed = 0;
  while (fed < capacity) feed(s.get(), engine, fed, 4);
  engine.fail_reserve = 9;
  const std::int32_t id = 1;
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_BACKEND_ERROR);
  const std::string reserve = "reserve(" + std::to_string(2 * capacity) + ") returned 9";
  EXPECT_NE(std::string(kvevict_last_error()).find(reserve), std::string::npos)
      << kvevict_last_error();
  engine.fail_reserve = 0;
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("unusable after growing"), std::string::npos)
      << kvevict_last_error();
  EXPECT_EQ(kvevict_sequence_capacity(s.get()), capacity);
}

// Rows the policy reads hold probabilities: a NaN, an infinity, a negative value or one above 1
// fails with a message naming where it is, and the layer can be observed again.
TEST(CApi, AttentionOutsideZeroToOneIsAnErrorThatChangesNothing) {
  CSequence s = create("h2o", "heavy=2 recent=2", config(1, 2, 1, 2));
  const std::int32_t ids[] = {1, 2};
  ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 2, 0), KVEVICT_OK);
  const int limit = kvevict_sequence_slot_limit(s.get(), 0, 0);
  ASSERT_EQ(limit, 2);
  std::vector<float> rows(static_cast<std::size_t>(2 * 2 * limit), 0.5f);  // [2 heads][2][limit]
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::infinity(), -1.0f, 2.0f}) {
    rows[3 * limit + 1] = bad;  // query head 1, query 1, slot 1
    EXPECT_EQ(kvevict_sequence_observe_attention(s.get(), 0, rows.data(), 2, limit),
              KVEVICT_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvevict_last_error())
                  .find("observe_attention: layer 0, query head 1, query 1 (original position 1), "
                        "slot 1: "),
              std::string::npos)
        << kvevict_last_error();
  }
  rows[3 * limit + 1] = 0.5f;
  ASSERT_EQ(kvevict_sequence_observe_attention(s.get(), 0, rows.data(), 2, limit), KVEVICT_OK)
      << kvevict_last_error();
  ASSERT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK) << kvevict_last_error();
}

// An engine may hand H2O each KV head's rows apart (observe_attention_heads), with the decisions
// of one call per layer; a policy that reads a layer at once, a range outside the layer and a
// NULL sequence get a status and a message.
TEST(CApi, AttentionPerKvHeadDecidesAsOneCallPerLayer) {
  const kvevict_config c = config(1, 4, 2, 2);
  CSequence whole = create("h2o", "heavy=3 recent=2", c);
  CSequence apart = create("h2o", "heavy=3 recent=2", c);
  EXPECT_EQ(kvevict_sequence_attention_per_kv_head(apart.get()), 1);
  EXPECT_EQ(kvevict_sequence_attention_per_kv_head(nullptr), 0);
  std::uint64_t x = 11;
  for (int step = 0; step < 30; ++step) {
    const int n = 1 + step % 2;
    const std::vector<std::int32_t> ids(static_cast<std::size_t>(n), 1);
    ASSERT_EQ(kvevict_sequence_begin_chunk(whole.get(), ids.data(), n, 0), KVEVICT_OK);
    ASSERT_EQ(kvevict_sequence_begin_chunk(apart.get(), ids.data(), n, 0), KVEVICT_OK);
    const int limit = kvevict_sequence_slot_limit(whole.get(), 0, 0);
    // [4 query heads][n][limit], values in [0, 1) on the live slots (free slots 0).
    std::vector<float> rows(static_cast<std::size_t>(4 * n * limit), 0.0f);
    for (int r = 0; r < 4 * n; ++r) {
      const int kv_head = r / (2 * n);
      for (int slot = 0; slot < limit; ++slot) {
        std::int64_t position = 0;
        if (kvevict_sequence_position(whole.get(), 0, kv_head, slot, &position, nullptr) !=
            KVEVICT_OK) {
          continue;
        }
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        rows[static_cast<std::size_t>(r * limit + slot)] =
            static_cast<float>(x >> 40) / 16777216.0f;
      }
    }
    ASSERT_EQ(kvevict_sequence_observe_attention(whole.get(), 0, rows.data(), n, limit), KVEVICT_OK)
        << kvevict_last_error();
    for (int g = 0; g < 2; ++g) {
      ASSERT_EQ(kvevict_sequence_observe_attention_heads(apart.get(), 0, g, g + 1,
                                                         rows.data() + 2 * g * n * limit, n, limit),
                KVEVICT_OK)
          << kvevict_last_error();
    }
    ASSERT_EQ(kvevict_sequence_end_forward(whole.get()), KVEVICT_OK);
    ASSERT_EQ(kvevict_sequence_end_forward(apart.get()), KVEVICT_OK);
    for (int g = 0; g < 2; ++g) {
      for (int slot = 0; slot < limit; ++slot) {
        std::int64_t a = -1;
        std::int64_t b = -1;
        (void)kvevict_sequence_position(whole.get(), 0, g, slot, &a, nullptr);
        (void)kvevict_sequence_position(apart.get(), 0, g, slot, &b, nullptr);
        ASSERT_EQ(a, b) << "step " << step << " KV head " << g << " slot " << slot;
      }
    }
  }
  EXPECT_EQ(kvevict_sequence_live(apart.get(), 0, 1), 5);

  const std::int32_t id = 1;
  const float row[] = {1.0f, 1.0f};
  ASSERT_EQ(kvevict_sequence_begin_chunk(apart.get(), &id, 1, 0), KVEVICT_OK);
  EXPECT_EQ(kvevict_sequence_observe_attention_heads(apart.get(), 0, 1, 3, row, 1, 1),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("KV heads [1, 3) are not a range"),
            std::string::npos)
      << kvevict_last_error();
  EXPECT_EQ(kvevict_sequence_observe_attention_heads(nullptr, 0, 0, 1, row, 1, 1),
            KVEVICT_INVALID_ARGUMENT);

  CSequence tova = create("tova", "budget=4", config(1, 2, 2, 2));
  EXPECT_EQ(kvevict_sequence_attention_per_kv_head(tova.get()), 1);
  CSequence window = create("window", "recent=4", config(1, 2, 2, 2));
  EXPECT_EQ(kvevict_sequence_attention_per_kv_head(window.get()), 0);
  CSequence snapkv = create("snapkv", "capacity=4 window=1", config(1, 2, 2, 2));
  EXPECT_EQ(kvevict_sequence_attention_per_kv_head(snapkv.get()), 0);
  ASSERT_EQ(kvevict_sequence_begin_chunk(snapkv.get(), &id, 1, 0), KVEVICT_OK);
  EXPECT_EQ(kvevict_sequence_observe_attention_heads(snapkv.get(), 0, 0, 1, row, 1, 1),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("reads a layer's attention rows in one call"),
            std::string::npos)
      << kvevict_last_error();
}

// Without a reserve callback the engine sized its buffers for kvevict_sequence_capacity(): an
// unbounded policy that outgrows it fails as a failed reserve does, with a message naming the fix.
// A window of 4 fed chunks of 4: the second chunk (slots 4-7) evicts slots 0-3, freed oldest
// first; the third chunk takes them back last-freed first (3, 2, 1, 0), or lowest first.
TEST(CApi, SlotReuseOrder) {
  const auto third_chunk = [](const char* reuse) {
    kvevict_config c = config(1, 1, 1);
    c.slot_reuse = reuse;
    CSequence s = create("window", "recent=4", c);
    const std::int32_t ids[4] = {1, 2, 3, 4};
    for (int chunk = 0; chunk < 2; ++chunk) {
      EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 4, 0), KVEVICT_OK);
      EXPECT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK);
    }
    EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 4, 0), KVEVICT_OK);
    const std::int32_t* slots = nullptr;
    int count = 0;
    EXPECT_EQ(kvevict_sequence_chunk_slots(s.get(), 0, 0, &slots, &count), KVEVICT_OK);
    return std::vector<std::int32_t>(slots, slots + count);
  };
  EXPECT_EQ(third_chunk(nullptr), (std::vector<std::int32_t>{3, 2, 1, 0}));
  EXPECT_EQ(third_chunk("newest_freed_first"), (std::vector<std::int32_t>{3, 2, 1, 0}));
  EXPECT_EQ(third_chunk("lowest_first"), (std::vector<std::int32_t>{0, 1, 2, 3}));
  kvevict_config c = config(1, 1, 1);
  c.slot_reuse = "lowest";
  kvevict_sequence* raw = nullptr;
  EXPECT_EQ(kvevict_sequence_create("window", "recent=4", &c, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(raw, nullptr);
  EXPECT_NE(std::string(kvevict_last_error()).find("slot_reuse"), std::string::npos);
}

TEST(CApi, NoReserveCallbackMeansAFixedCapacity) {
  kvevict_backend backend{nullptr, nullptr, nullptr};
  CSequence s = create("full", nullptr, config(1, 1, 1, 1), &backend);
  const int capacity = kvevict_sequence_capacity(s.get());
  const std::int32_t id = 1;
  for (int t = 0; t < capacity; ++t) {
    ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_OK);
    ASSERT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK);
  }
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_BACKEND_ERROR);
  EXPECT_NE(std::string(kvevict_last_error()).find("reserve callback"), std::string::npos);
  EXPECT_EQ(kvevict_sequence_begin_chunk(s.get(), &id, 1, 0), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("unusable"), std::string::npos);
}

}  // namespace

// K-norm through the C API: the keys of each layer come in through observe_keys (head_dim in the
// config). Norms 5, 1, 3 with budget 2: tokens 1 and 2 stay (the smallest norms).
TEST(CApi, KnormReadsTheKeysOfEveryLayer) {
  Engine engine(2, 1);
  const kvevict_backend backend = engine.backend();
  kvevict_config c = config(2, 1, 1, 3);
  {
    kvevict_sequence* raw = nullptr;
    EXPECT_EQ(kvevict_sequence_create("knorm", "budget=2", &c, &backend, &raw),
              KVEVICT_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvevict_last_error()).find("head_dim"), std::string::npos);
  }
  c.head_dim = 2;
  CSequence s = create("knorm", "budget=2", c, &backend);
  EXPECT_EQ(kvevict_sequence_signals(s.get()), static_cast<uint32_t>(KVEVICT_SIGNAL_KEYS));
  const std::int32_t ids[] = {7, 8, 9};
  ASSERT_EQ(kvevict_sequence_begin_chunk(s.get(), ids, 3, 0), KVEVICT_OK);
  for (int l = 0; l < 2; ++l) {
    const std::int32_t* slots = nullptr;
    int count = 0;
    ASSERT_EQ(kvevict_sequence_chunk_slots(s.get(), l, 0, &slots, &count), KVEVICT_OK);
    for (int i = 0; i < count; ++i) engine.at(slots[i], l, 0) = i;
  }
  const float keys[] = {3, 4, 0, 1, 3, 0};  // [kv_heads = 1][3 tokens][head_dim = 2]
  const float bad[] = {3, 4, 0, 1, 3, std::numeric_limits<float>::infinity()};
  EXPECT_EQ(kvevict_sequence_observe_keys(s.get(), 0, bad, 2), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("inf is not finite"), std::string::npos)
      << kvevict_last_error();
  ASSERT_EQ(kvevict_sequence_observe_keys(s.get(), 0, keys, 2), KVEVICT_OK) << kvevict_last_error();
  EXPECT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_INVALID_ARGUMENT);  // layer 1 missing
  EXPECT_NE(std::string(kvevict_last_error()).find("needs the keys of every layer"),
            std::string::npos);
  ASSERT_EQ(kvevict_sequence_observe_keys(s.get(), 1, keys, 2), KVEVICT_OK);
  ASSERT_EQ(kvevict_sequence_end_forward(s.get()), KVEVICT_OK) << kvevict_last_error();
  for (int l = 0; l < 2; ++l) EXPECT_EQ(held(engine, l, 0), (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(kvevict_sequence_observe_keys(nullptr, 0, keys, 2), KVEVICT_INVALID_ARGUMENT);
}

// --- one KV pool for many sequences (kvevict_pool_*)
// ----------------------------------------------

namespace {

struct PoolDeleter {
  void operator()(kvevict_pool* pool) const { kvevict_pool_destroy(pool); }
};
using CPool = std::unique_ptr<kvevict_pool, PoolDeleter>;

CPool create_pool(std::int64_t cells) {
  kvevict_pool* raw = nullptr;
  EXPECT_EQ(kvevict_pool_create(cells, &raw), KVEVICT_OK) << kvevict_last_error();
  return CPool(raw);
}

int join(kvevict_pool* pool, kvevict_sequence* sequence, int minimum = 0) {
  int member = -2;
  EXPECT_EQ(kvevict_pool_join(pool, sequence, minimum, &member), KVEVICT_OK)
      << kvevict_last_error();
  return member;
}

kvevict_pool_stats pool_stats(const kvevict_pool* pool) {
  kvevict_pool_stats stats{-1, -1, -1, -1};
  EXPECT_EQ(kvevict_pool_get_stats(pool, &stats), KVEVICT_OK) << kvevict_last_error();
  return stats;
}

// The call failed with `status` and a message naming `fragment`.
void expect_failure(kvevict_status got, kvevict_status status, const std::string& fragment) {
  EXPECT_EQ(got, status) << kvevict_last_error();
  EXPECT_NE(std::string(kvevict_last_error()).find(fragment), std::string::npos)
      << "message: " << kvevict_last_error() << "\nexpected to mention: " << fragment;
}

// One sequence of a pool with its own engine (one layer, one KV head).
struct Member {
  explicit Member(const char* policy, const char* params, int max_chunk = 1)
      : engine(1, 1),
        backend(engine.backend()),
        sequence(create(policy, params, config(1, 1, 1, max_chunk), &backend)) {}
  Engine engine;
  kvevict_backend backend;
  CSequence sequence;
  std::int64_t fed = 0;
  int id = -1;
  void step(int tokens) { feed(sequence.get(), engine, fed, tokens); }
  [[nodiscard]] std::vector<std::int64_t> kept() const { return held(engine, 0, 0); }
};

std::vector<std::int64_t> range(std::int64_t first, std::int64_t last) {
  std::vector<std::int64_t> out;
  for (std::int64_t t = first; t <= last; ++t) out.push_back(t);
  return out;
}

}  // namespace

// test_kv_pool's ThreeWindowsShareTwelveCellsEvenly through the C API, over three engines' own
// buffers. Window 8, one token per step each, pool 12: steps 1-4 fit (3k cells at step k); from
// step 5 each holds 4 before the step, 12 + 3 > 12, so every member is cut to L = 3 (its oldest
// token evicted through its backend's apply) and fed back to 4.
TEST(CApiPool, ThreeWindowsShareTwelveCellsEvenly) {
  CPool pool = create_pool(12);
  std::vector<std::unique_ptr<Member>> members;
  std::vector<kvevict_pool_feed> feeds;
  for (int i = 0; i < 3; ++i) {
    members.push_back(std::make_unique<Member>("window", "recent=8"));
    members.back()->id = join(pool.get(), members.back()->sequence.get());
    EXPECT_EQ(members.back()->id, i);
    feeds.push_back({i, 1});
  }
  // Window keeps at least its newest token: minimum 1, charged 1 + one chunk of 1 each.
  std::int64_t minimum = -1;
  ASSERT_EQ(kvevict_pool_minimum(pool.get(), 2, &minimum), KVEVICT_OK);
  EXPECT_EQ(minimum, 1);
  EXPECT_EQ(kvevict_pool_cells(pool.get()), 12);
  EXPECT_EQ(kvevict_pool_charged(pool.get()), 6);
  for (int k = 1; k <= 20; ++k) {
    ASSERT_EQ(kvevict_pool_make_room(pool.get(), feeds.data(), feeds.size()), KVEVICT_OK)
        << kvevict_last_error();
    for (auto& member : members) {
      EXPECT_EQ(kvevict_sequence_max_live(member->sequence.get()), std::min(k - 1, 3))
          << "step " << k;
      member->step(1);
    }
    EXPECT_EQ(kvevict_pool_used(pool.get()), std::min(3 * k, 12));
  }
  for (auto& member : members) {
    EXPECT_EQ(member->kept(), range(16, 19));
    EXPECT_EQ(member->engine.applies, 16);  // one cut per pressed step, never the window's own
  }
  const kvevict_pool_stats stats = pool_stats(pool.get());
  EXPECT_EQ(stats.steps, 20);
  EXPECT_EQ(stats.pressed_steps, 16);  // steps 5 to 20
  EXPECT_EQ(stats.cuts, 48);
  EXPECT_EQ(stats.peak_cells, 12);
}

// Max-min fairness: only the member over the common level is cut. Pool 10; A (window 8) grows
// alone to 8 cells (8 + 1 fed fits); then B (window 4) holds 1, and a step feeding both needs
// 8 + 1 + 2 = 11: 8 cells may be kept, L + min(L, 1) <= 8 gives L = 7, so A loses its oldest
// token and B keeps everything.
TEST(CApiPool, OnlyTheMemberOverTheLevelIsCut) {
  CPool pool = create_pool(10);
  Member a("window", "recent=8");
  Member b("window", "recent=4");
  a.id = join(pool.get(), a.sequence.get());
  b.id = join(pool.get(), b.sequence.get());
  for (int k = 0; k < 8; ++k) {
    const kvevict_pool_feed feed{a.id, 1};
    ASSERT_EQ(kvevict_pool_make_room(pool.get(), &feed, 1), KVEVICT_OK) << kvevict_last_error();
    a.step(1);
  }
  const kvevict_pool_feed feed_b{b.id, 1};
  ASSERT_EQ(kvevict_pool_make_room(pool.get(), &feed_b, 1), KVEVICT_OK);
  b.step(1);
  EXPECT_EQ(pool_stats(pool.get()).pressed_steps, 0);
  const kvevict_pool_feed both[] = {{a.id, 1}, {b.id, 1}};
  ASSERT_EQ(kvevict_pool_make_room(pool.get(), both, 2), KVEVICT_OK) << kvevict_last_error();
  EXPECT_EQ(a.kept(), range(1, 7));
  EXPECT_EQ(b.kept(), range(0, 0));
  EXPECT_EQ(kvevict_pool_used(pool.get()), 8);
  const kvevict_pool_stats stats = pool_stats(pool.get());
  EXPECT_EQ(stats.pressed_steps, 1);
  EXPECT_EQ(stats.cuts, 1);
  EXPECT_EQ(stats.peak_cells, 10);
}

// kvevict_sequence_shrink_to by hand: StreamingLLM (sinks 2, recent 6) over 8 tokens pressed to 5
// keeps its sinks and the 3 newest; the eviction reaches the engine through apply().
TEST(CApiPool, ShrinkToEvictsByThePolicysOwnRule) {
  Member s("streaming_llm", "sinks=2 recent=6", 8);
  s.step(8);
  EXPECT_EQ(kvevict_sequence_max_live(s.sequence.get()), 8);
  ASSERT_EQ(kvevict_sequence_shrink_to(s.sequence.get(), 5), KVEVICT_OK) << kvevict_last_error();
  EXPECT_EQ(s.kept(), (std::vector<std::int64_t>{0, 1, 5, 6, 7}));
  EXPECT_EQ(kvevict_sequence_max_live(s.sequence.get()), 5);
  EXPECT_EQ(s.engine.applies, 1);
  // Below its protected sinks it keeps the sinks.
  ASSERT_EQ(kvevict_sequence_shrink_to(s.sequence.get(), 0), KVEVICT_OK);
  EXPECT_EQ(s.kept(), (std::vector<std::int64_t>{0, 1}));
  expect_failure(kvevict_sequence_shrink_to(s.sequence.get(), -1), KVEVICT_INVALID_ARGUMENT,
                 "max_live must be >= 0, got -1");
  const std::int32_t id = 1;
  ASSERT_EQ(kvevict_sequence_begin_chunk(s.sequence.get(), &id, 1, 0), KVEVICT_OK);
  expect_failure(kvevict_sequence_shrink_to(s.sequence.get(), 1), KVEVICT_INVALID_ARGUMENT,
                 "end the forward");
  ASSERT_EQ(kvevict_sequence_end_forward(s.sequence.get()), KVEVICT_OK);
  CSequence sirllm = create("sirllm", "entropy=8", config(1, 1, 1, 1));
  expect_failure(kvevict_sequence_shrink_to(sirllm.get(), 4), KVEVICT_INVALID_ARGUMENT,
                 "no keep rule that evicts below its own budget");
  expect_failure(kvevict_sequence_shrink_to(nullptr, 4), KVEVICT_INVALID_ARGUMENT,
                 "sequence is NULL");
  EXPECT_EQ(kvevict_sequence_max_live(nullptr), -1);
}

// Admission: a pool of no cells, a budget the pool can never grant, a pool smaller than the sum
// of the minimums, a minimum beyond the pool, a policy a pool cannot hold, a sequence in two
// pools: each a status and a message, and the members already in the pool unaffected.
TEST(CApiPool, AdmissionErrorsAreClearAndLeaveTheMembersAlone) {
  kvevict_pool* raw = reinterpret_cast<kvevict_pool*>(&raw);  // overwritten with NULL
  expect_failure(kvevict_pool_create(0, &raw), KVEVICT_INVALID_ARGUMENT,
                 "cells must be positive, got 0");
  EXPECT_EQ(raw, nullptr);
  expect_failure(kvevict_pool_create(-5, &raw), KVEVICT_INVALID_ARGUMENT, "got -5");
  expect_failure(kvevict_pool_create(5, nullptr), KVEVICT_INVALID_ARGUMENT, "out is NULL");

  CPool pool = create_pool(10);
  // H2O heavy 4 + recent 4, chunk 1: minimum 4 (its recent window), charged 5.
  Member a("h2o", "heavy=4 recent=4");
  Member b("h2o", "heavy=4 recent=4");
  Member c("h2o", "heavy=4 recent=4");
  a.id = join(pool.get(), a.sequence.get());
  b.id = join(pool.get(), b.sequence.get());
  EXPECT_EQ(kvevict_pool_charged(pool.get()), 10);
  int member = 7;
  expect_failure(kvevict_pool_join(pool.get(), c.sequence.get(), 0, &member),
                 KVEVICT_INVALID_ARGUMENT,
                 "needs 5 cells it can never give up (its minimum plus one chunk), and the "
                 "members already hold 10 of the pool's 10");
  EXPECT_EQ(member, -1);
  CSequence wide = create("window", "recent=20", config(1, 1, 1, 1));
  expect_failure(kvevict_pool_join(pool.get(), wide.get(), 0, &member), KVEVICT_INVALID_ARGUMENT,
                 "its budget of 20 tokens plus a chunk of 1 exceeds the pool's 10 cells, which "
                 "can never grant it");
  CSequence small = create("window", "recent=4", config(1, 1, 1, 1));
  expect_failure(kvevict_pool_join(pool.get(), small.get(), 20, &member), KVEVICT_INVALID_ARGUMENT,
                 "its minimum of 20 cells plus a chunk of 1 exceeds the pool's 10 cells");
  expect_failure(kvevict_pool_join(pool.get(), small.get(), -1, &member), KVEVICT_INVALID_ARGUMENT,
                 "minimum must be >= 0, got -1");
  CSequence full = create("full", nullptr, config(1, 1, 1, 1));
  expect_failure(kvevict_pool_join(pool.get(), full.get(), 0, &member), KVEVICT_INVALID_ARGUMENT,
                 "has no bound and no pressed form");
  // A sequence belongs to one pool, once.
  expect_failure(kvevict_pool_join(pool.get(), a.sequence.get(), 0, &member),
                 KVEVICT_INVALID_ARGUMENT, "already member 0 of this pool");
  CPool other = create_pool(100);
  expect_failure(kvevict_pool_join(other.get(), b.sequence.get(), 0, &member),
                 KVEVICT_INVALID_ARGUMENT, "already member 1 of another pool");
  expect_failure(kvevict_pool_join(nullptr, c.sequence.get(), 0, &member), KVEVICT_INVALID_ARGUMENT,
                 "pool is NULL");
  expect_failure(kvevict_pool_join(pool.get(), nullptr, 0, &member), KVEVICT_INVALID_ARGUMENT,
                 "sequence is NULL");
  expect_failure(kvevict_pool_join(pool.get(), c.sequence.get(), 0, nullptr),
                 KVEVICT_INVALID_ARGUMENT, "member is NULL");
  // Nothing changed: the two members step on, and a member that leaves makes room for c.
  EXPECT_EQ(kvevict_pool_charged(pool.get()), 10);
  EXPECT_EQ(kvevict_pool_is_member(pool.get(), 2), 0);
  const kvevict_pool_feed feeds[] = {{a.id, 1}, {b.id, 1}};
  ASSERT_EQ(kvevict_pool_make_room(pool.get(), feeds, 2), KVEVICT_OK) << kvevict_last_error();
  ASSERT_EQ(kvevict_pool_leave(pool.get(), b.id), KVEVICT_OK);
  EXPECT_EQ(join(pool.get(), c.sequence.get()), 1);  // b's id, free again
  EXPECT_EQ(join(other.get(), b.sequence.get()), 0);
}

// Feeding: a member id out of range, a member fed after it left, too many tokens, a member fed
// twice, a member inside a forward: refused before anything changes, the message naming the
// member, and the other members step on as if nothing had been asked.
TEST(CApiPool, BadFeedsAreRefusedAndChangeNothing) {
  CPool pool = create_pool(8);
  Member a("window", "recent=4", 2);
  Member b("window", "recent=4", 2);
  a.id = join(pool.get(), a.sequence.get());
  b.id = join(pool.get(), b.sequence.get());
  const auto refused = [&](std::vector<kvevict_pool_feed> feeds, const std::string& fragment) {
    expect_failure(kvevict_pool_make_room(pool.get(), feeds.data(), feeds.size()),
                   KVEVICT_INVALID_ARGUMENT, fragment);
  };
  // Fill the pool: a and b hold 4 each, so any step must cut.
  for (int k = 0; k < 2; ++k) {
    const kvevict_pool_feed feeds[] = {{a.id, 2}, {b.id, 2}};
    ASSERT_EQ(kvevict_pool_make_room(pool.get(), feeds, 2), KVEVICT_OK) << kvevict_last_error();
    a.step(2);
    b.step(2);
  }
  EXPECT_EQ(kvevict_pool_used(pool.get()), 8);
  refused({{a.id, 1}, {5, 1}}, "KV pool: make_room: member 5 is not in the pool");
  refused({{-1, 1}}, "member -1 is not in the pool");
  refused({{a.id, 3}}, "member 0 is fed 3 tokens, outside [0, 2] (its max_chunk)");
  refused({{a.id, -1}}, "outside [0, 2]");
  refused({{b.id, 1}, {a.id, 1}, {b.id, 1}}, "member 1 is fed twice in one step");
  expect_failure(kvevict_pool_make_room(pool.get(), nullptr, 1), KVEVICT_INVALID_ARGUMENT,
                 "feeds is NULL");
  expect_failure(kvevict_pool_make_room(nullptr, nullptr, 0), KVEVICT_INVALID_ARGUMENT,
                 "pool is NULL");
  // A member inside a forward: make_room runs between steps.
  const std::int32_t id = 3;
  ASSERT_EQ(kvevict_sequence_begin_chunk(b.sequence.get(), &id, 1, 0), KVEVICT_OK);
  refused({{a.id, 1}}, "member 1 is inside a forward (end it first");
  ASSERT_EQ(kvevict_sequence_end_forward(b.sequence.get()), KVEVICT_OK);  // b is fed no more
  // A member that left: fed after it was closed.
  ASSERT_EQ(kvevict_pool_leave(pool.get(), b.id), KVEVICT_OK);
  refused({{b.id, 1}}, "member 1 is not in the pool (it left, or never joined)");
  expect_failure(kvevict_pool_leave(pool.get(), b.id), KVEVICT_INVALID_ARGUMENT,
                 "KV pool: leave: member 1 is not in the pool");
  expect_failure(kvevict_pool_leave(pool.get(), 99), KVEVICT_INVALID_ARGUMENT,
                 "member 99 is not in the pool");
  std::int64_t minimum = -1;
  expect_failure(kvevict_pool_minimum(pool.get(), b.id, &minimum), KVEVICT_INVALID_ARGUMENT,
                 "KV pool: minimum: member 1 is not in the pool");
  EXPECT_EQ(kvevict_pool_is_member(pool.get(), b.id), 0);
  // Nothing was cut, no step counted; a's next step goes as if none of that had been asked.
  EXPECT_EQ(a.kept(), range(0, 3));
  EXPECT_EQ(a.engine.applies, 0);
  kvevict_pool_stats stats = pool_stats(pool.get());
  EXPECT_EQ(stats.steps, 2);
  EXPECT_EQ(stats.cuts, 0);
  const kvevict_pool_feed feed{a.id, 2};
  ASSERT_EQ(kvevict_pool_make_room(pool.get(), &feed, 1), KVEVICT_OK) << kvevict_last_error();
  a.step(2);
  EXPECT_EQ(a.kept(), range(2, 5));  // a window of 4: b left, so no cut
  stats = pool_stats(pool.get());
  EXPECT_EQ(stats.steps, 3);
  EXPECT_EQ(stats.pressed_steps, 0);
}

// A C user destroys in the wrong order. A member sequence destroyed before it left: it leaves the
// pool as it goes (its charge and cells released), its id stays reserved and every call naming it
// says what happened until kvevict_pool_leave releases it. A pool destroyed before its members:
// they stay usable and may join another pool. (Under ASan, any dangling pointer is a failure.)
TEST(CApiPool, DestroyingInTheWrongOrderIsSafe) {
  CPool pool = create_pool(12);
  std::vector<std::unique_ptr<Member>> members;
  for (int i = 0; i < 3; ++i) {
    members.push_back(std::make_unique<Member>("window", "recent=8"));
    members.back()->id = join(pool.get(), members.back()->sequence.get());
  }
  const auto step_all = [&](std::vector<kvevict_pool_feed> feeds) {
    ASSERT_EQ(kvevict_pool_make_room(pool.get(), feeds.data(), feeds.size()), KVEVICT_OK)
        << kvevict_last_error();
    for (const kvevict_pool_feed& feed : feeds) {
      for (auto& member : members) {
        if (member && member->id == feed.member) member->step(feed.tokens);
      }
    }
  };
  for (int k = 0; k < 4; ++k) step_all({{0, 1}, {1, 1}, {2, 1}});
  EXPECT_EQ(kvevict_pool_used(pool.get()), 12);
  EXPECT_EQ(kvevict_pool_charged(pool.get()), 6);

  members[1].reset();  // kvevict_sequence_destroy on member 1, still in the pool
  EXPECT_EQ(kvevict_pool_is_member(pool.get(), 1), 0);
  EXPECT_EQ(kvevict_pool_used(pool.get()), 8);
  EXPECT_EQ(kvevict_pool_charged(pool.get()), 4);
  const kvevict_pool_feed stale[] = {{0, 1}, {1, 1}};
  expect_failure(kvevict_pool_make_room(pool.get(), stale, 2), KVEVICT_INVALID_ARGUMENT,
                 "KV pool: make_room: member 1's sequence was destroyed while it was in the pool "
                 "(kvevict_sequence_destroy before kvevict_pool_leave): it has left; "
                 "kvevict_pool_leave(pool, 1) releases its id");
  std::int64_t minimum = -1;
  expect_failure(kvevict_pool_minimum(pool.get(), 1, &minimum), KVEVICT_INVALID_ARGUMENT,
                 "member 1's sequence was destroyed");
  // The others go on, with the destroyed member's cells free: 4 + 4 + 2 fits 12, no cut.
  step_all({{0, 1}, {2, 1}});
  EXPECT_EQ(members[0]->kept(), range(0, 4));
  EXPECT_EQ(pool_stats(pool.get()).pressed_steps, 0);
  // A new member does not take the reserved id.
  members.push_back(std::make_unique<Member>("window", "recent=8"));
  members.back()->id = join(pool.get(), members.back()->sequence.get());
  EXPECT_EQ(members.back()->id, 3);
  // Leaving releases it (the right call, late); a second leave is refused.
  ASSERT_EQ(kvevict_pool_leave(pool.get(), 1), KVEVICT_OK) << kvevict_last_error();
  expect_failure(kvevict_pool_leave(pool.get(), 1), KVEVICT_INVALID_ARGUMENT,
                 "member 1 is not in the pool");
  members[1] = std::make_unique<Member>("window", "recent=8");
  members[1]->id = join(pool.get(), members[1]->sequence.get());
  EXPECT_EQ(members[1]->id, 1);
  step_all({{0, 1}, {1, 1}, {2, 1}, {3, 1}});

  // The pool destroyed first: its members stay valid sequences and join another pool.
  pool.reset();
  members[0]->step(1);
  CPool next = create_pool(20);
  EXPECT_EQ(join(next.get(), members[0]->sequence.get()), 0);
  EXPECT_EQ(join(next.get(), members[2]->sequence.get()), 1);
  members[2].reset();  // destroyed as a member of the new pool
  EXPECT_EQ(kvevict_pool_is_member(next.get(), 1), 0);
  next.reset();
  members.clear();  // the rest destroyed after their pool: nothing dangles

  // NULL handles: sentinels, never a crash.
  kvevict_pool_destroy(nullptr);
  EXPECT_EQ(kvevict_pool_cells(nullptr), -1);
  EXPECT_EQ(kvevict_pool_used(nullptr), -1);
  EXPECT_EQ(kvevict_pool_charged(nullptr), -1);
  EXPECT_EQ(kvevict_pool_is_member(nullptr, 0), 0);
  expect_failure(kvevict_pool_leave(nullptr, 0), KVEVICT_INVALID_ARGUMENT, "pool is NULL");
  expect_failure(kvevict_pool_get_stats(nullptr, nullptr), KVEVICT_INVALID_ARGUMENT,
                 "stats is NULL");
}

// A member's apply() failing while the pool cuts it: KVEVICT_BACKEND_ERROR naming the member,
// which is unusable from then on. make_room refuses (before cutting anyone) while it is a member;
// once it left, the others step on.
TEST(CApiPool, AMemberWhoseBackendFailsIsNamedAndMustLeave) {
  CPool pool = create_pool(8);
  Member a("window", "recent=4");
  Member b("window", "recent=4");
  a.id = join(pool.get(), a.sequence.get());
  b.id = join(pool.get(), b.sequence.get());
  for (int k = 0; k < 4; ++k) {
    const kvevict_pool_feed feeds[] = {{a.id, 1}, {b.id, 1}};
    ASSERT_EQ(kvevict_pool_make_room(pool.get(), feeds, 2), KVEVICT_OK);
    a.step(1);
    b.step(1);
  }
  b.engine.fail_apply = 7;
  const kvevict_pool_feed feeds[] = {{a.id, 1}, {b.id, 1}};
  // 8 held + 2 fed: both cut to 3; a first (applied), then b's apply fails.
  expect_failure(
      kvevict_pool_make_room(pool.get(), feeds, 2), KVEVICT_BACKEND_ERROR,
      "KV pool: make_room: member 1, cut to make room: the backend's apply() returned 7");
  EXPECT_EQ(a.kept(), range(1, 3));
  expect_failure(kvevict_pool_make_room(pool.get(), feeds, 1), KVEVICT_INVALID_ARGUMENT,
                 "member 1's sequence is unusable (its backend failed)");
  ASSERT_EQ(kvevict_pool_leave(pool.get(), b.id), KVEVICT_OK);
  int member = -2;
  expect_failure(kvevict_pool_join(pool.get(), b.sequence.get(), 0, &member),
                 KVEVICT_INVALID_ARGUMENT, "unusable");
  ASSERT_EQ(kvevict_pool_make_room(pool.get(), feeds, 1), KVEVICT_OK) << kvevict_last_error();
  a.step(1);
  EXPECT_EQ(a.kept(), range(1, 4));
}
