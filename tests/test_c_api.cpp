// The C API: same decisions as the C++ pipeline, plans an engine can apply, and every failure a
// status plus a message, never an exception.
#include <gtest/gtest.h>
#include <kvevict/c_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

struct PipelineDeleter {
  void operator()(kvevict_pipeline* pipeline) const { kvevict_pipeline_destroy(pipeline); }
};
using Pipeline = std::unique_ptr<kvevict_pipeline, PipelineDeleter>;

Pipeline create(const char* policy, const char* params, int layers, int kv_heads, int capacity,
                const char* mode = nullptr) {
  kvevict_pipeline* raw = nullptr;
  const kvevict_status status =
      kvevict_pipeline_create(policy, params, layers, kv_heads, capacity, mode, &raw);
  EXPECT_EQ(status, KVEVICT_OK) << kvevict_last_error();
  return Pipeline(raw);
}

std::vector<std::int64_t> kept(const kvevict_pipeline* pipeline, int layer, int kv_head) {
  const std::int64_t* original = nullptr;
  int count = 0;
  EXPECT_EQ(kvevict_pipeline_slots(pipeline, layer, kv_head, &original, nullptr, &count),
            KVEVICT_OK);
  return {original, original + count};
}

// StreamingLLM sinks 2 + recent 3, one token per forward: after token t >= 5 the sixth slot is
// evicted, and the plan tells the engine which rows to keep and how far to rotate them.
TEST(CApi, StreamingLlmPlansMatchTheRule) {
  Pipeline pipeline = create("streaming_llm", "sinks=2 recent=3", 2, 2, 16);
  ASSERT_NE(pipeline, nullptr);
  EXPECT_EQ(kvevict_pipeline_retained_limit(pipeline.get()), 5);
  EXPECT_EQ(kvevict_pipeline_signals(pipeline.get()), 0u);
  for (std::int32_t t = 0; t < 6; ++t) {
    int compacted = -1;
    ASSERT_EQ(kvevict_pipeline_before_chunk(pipeline.get(), 1, 0, &compacted), KVEVICT_OK);
    EXPECT_EQ(compacted, 0);
    ASSERT_EQ(kvevict_pipeline_append_chunk(pipeline.get(), &t, 1), KVEVICT_OK);
    ASSERT_EQ(kvevict_pipeline_end_forward(pipeline.get(), &compacted), KVEVICT_OK);
    EXPECT_EQ(compacted, t == 5 ? 1 : 0) << "token " << t;
  }
  // Slots 0..5 held tokens 0..5; the plan keeps slots {0, 1, 3, 4, 5}. cache_index positions:
  // slots 3, 4, 5 move to 2, 3, 4, a rotation of -1 each.
  int changes = 0, count = 0;
  const std::int32_t* keep = nullptr;
  const std::int64_t* deltas = nullptr;
  ASSERT_EQ(kvevict_pipeline_plan(pipeline.get(), 1, 1, &changes, &keep, &deltas, &count),
            KVEVICT_OK);
  ASSERT_EQ(changes, 1);
  EXPECT_EQ(std::vector<std::int32_t>(keep, keep + count),
            (std::vector<std::int32_t>{0, 1, 3, 4, 5}));
  EXPECT_EQ(std::vector<std::int64_t>(deltas, deltas + count),
            (std::vector<std::int64_t>{0, 0, -1, -1, -1}));
  EXPECT_EQ(kept(pipeline.get(), 0, 1), (std::vector<std::int64_t>{0, 1, 3, 4, 5}));
}

// H2O through the C API: attention rows in the documented layout drive the same heavy hitters.
TEST(CApi, AttentionRowsReachThePolicy) {
  // heavy 1 + recent 1; one layer, 2 query heads reading 1 KV head.
  Pipeline pipeline = create("h2o", "heavy=1 recent=1", 1, 1, 8);
  ASSERT_NE(pipeline, nullptr);
  EXPECT_EQ(kvevict_pipeline_signals(pipeline.get()), unsigned{KVEVICT_SIGNAL_ATTENTION_ROWS});
  const std::int32_t ids[3] = {7, 8, 9};
  ASSERT_EQ(kvevict_pipeline_before_chunk(pipeline.get(), 3, 0, nullptr), KVEVICT_OK);
  ASSERT_EQ(kvevict_pipeline_append_chunk(pipeline.get(), ids, 3), KVEVICT_OK);
  // [q_head][query][stride 3], causal. Column sums over both heads: token 0 gets 1 + 0.2 + 0.1 +
  // 1 + 0.2 + 0.1 = 2.6, token 1 gets 1.6, token 2 gets 0.8 (it is the recent one anyway).
  const std::vector<float> rows{1.0f, 0, 0, 0.2f, 0.8f, 0, 0.1f, 0.5f, 0.4f,
                                1.0f, 0, 0, 0.2f, 0.8f, 0, 0.1f, 0.5f, 0.4f};
  ASSERT_EQ(kvevict_pipeline_observe_attention(pipeline.get(), 0, rows.data(), 2, 3, 3),
            KVEVICT_OK);
  int compacted = 0;
  ASSERT_EQ(kvevict_pipeline_end_forward(pipeline.get(), &compacted), KVEVICT_OK);
  EXPECT_EQ(compacted, 1);
  EXPECT_EQ(kept(pipeline.get(), 0, 0), (std::vector<std::int64_t>{0, 2}));
}

TEST(CApi, FailuresAreStatusesWithMessages) {
  kvevict_pipeline* raw = nullptr;
  EXPECT_EQ(kvevict_pipeline_create("lru", nullptr, 1, 1, 8, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(raw, nullptr);
  EXPECT_NE(std::string(kvevict_last_error()).find("unknown policy 'lru'"), std::string::npos);
  EXPECT_EQ(kvevict_pipeline_create("window", "recent=abc", 1, 1, 8, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("malformed"), std::string::npos);
  EXPECT_EQ(kvevict_pipeline_create("streaming_llm", "sinks=4 recent=0", 1, 1, 8, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_create("window", "recent=4", 1, 1, 8, "sideways", &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_create("window", "recent=4", 1, 1, 0, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_create(nullptr, nullptr, 1, 1, 8, nullptr, &raw),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_create("window", "recent=4", 1, 1, 8, nullptr, nullptr),
            KVEVICT_INVALID_ARGUMENT);

  Pipeline pipeline = create("h2o", "heavy=2 recent=2", 1, 2, 4);
  const std::int32_t ids[5] = {1, 2, 3, 4, 5};
  // More tokens than the capacity: an error, not an overflow.
  EXPECT_EQ(kvevict_pipeline_append_chunk(pipeline.get(), ids, 5), KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("do not fit"), std::string::npos);
  ASSERT_EQ(kvevict_pipeline_append_chunk(pipeline.get(), ids, 2), KVEVICT_OK);
  // NaN attention is reported, not ranked.
  std::vector<float> rows(2 * 2 * 2, 0.25f);
  rows[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(kvevict_pipeline_observe_attention(pipeline.get(), 0, rows.data(), 2, 2, 2),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvevict_last_error()).find("NaN"), std::string::npos);
  // Query heads that do not divide into the KV heads, a stride shorter than the cache, bad heads.
  EXPECT_EQ(kvevict_pipeline_observe_attention(pipeline.get(), 0, rows.data(), 3, 1, 2),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_observe_attention(pipeline.get(), 0, rows.data(), 2, 1, 1),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_observe_attention(pipeline.get(), 3, rows.data(), 2, 1, 2),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_plan(pipeline.get(), 0, 9, nullptr, nullptr, nullptr, nullptr),
            KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_live(pipeline.get(), 0, 9), -1);
  EXPECT_EQ(kvevict_pipeline_end_catalyst(pipeline.get(), nullptr), KVEVICT_INVALID_ARGUMENT);
  EXPECT_EQ(kvevict_pipeline_end_forward(nullptr, nullptr), KVEVICT_INVALID_ARGUMENT);
  // A successful call clears the message.
  EXPECT_EQ(kvevict_pipeline_reserve(pipeline.get(), 8), KVEVICT_OK);
  EXPECT_STREQ(kvevict_last_error(), "");
}

}  // namespace
