// kvevict C API (include/kvevict/c_api.h): a thin layer over EvictionPipeline. Every entry point
// runs inside guarded(), which turns any exception into a status and a thread-local message, so
// nothing ever unwinds into C.
#include <cstdint>
#include <exception>
#include <kvevict/pipeline.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kvevict/c_api.h"

struct kvevict_pipeline {
  kvevict_pipeline(int layers, int kv_heads, int capacity, std::unique_ptr<kvevict::Policy> policy,
                   std::optional<kvevict::PositionMode> mode)
      : slots(layers, kv_heads, capacity, policy->score_columns()),
        pipeline(slots, std::move(policy), mode),
        keys_per_kv_head(static_cast<std::size_t>(kv_heads)) {}

  kvevict::SlotTable slots;  // declared before `pipeline`, which refers to it
  kvevict::EvictionPipeline pipeline;
  std::vector<int> keys_per_kv_head;  // outlives each AttentionRows built over it
  const kvevict::CompactionPlan* last_plan = nullptr;
};

namespace {

thread_local std::string last_error;

template <class Body>
kvevict_status guarded(Body&& body) noexcept {
  try {
    last_error.clear();
    body();
    return KVEVICT_OK;
  } catch (const kvevict::Error& error) {
    last_error = error.what();
    return KVEVICT_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
    return KVEVICT_OUT_OF_MEMORY;
  } catch (const std::exception& error) {
    last_error = std::string("internal error: ") + error.what();
    return KVEVICT_INTERNAL_ERROR;
  } catch (...) {
    last_error = "internal error: unknown exception";
    return KVEVICT_INTERNAL_ERROR;
  }
}

kvevict_pipeline& checked(kvevict_pipeline* pipeline) {
  KVEVICT_REQUIRE(pipeline != nullptr, "pipeline is NULL");
  return *pipeline;
}

void check_head(const kvevict_pipeline& handle, int layer, int kv_head) {
  KVEVICT_REQUIRE(layer >= 0 && layer < handle.slots.layers() && kv_head >= 0 &&
                      kv_head < handle.slots.kv_heads(),
                  "head (" + std::to_string(layer) + ", " + std::to_string(kv_head) +
                      ") is outside the pipeline's " + std::to_string(handle.slots.layers()) +
                      " layers x " + std::to_string(handle.slots.kv_heads()) + " KV heads");
}

// "key=value key=value", lists comma-separated.
kvevict::PolicyParams parse_params(const char* text) {
  kvevict::PolicyParams params;
  if (text == nullptr) return params;
  std::istringstream stream(text);
  std::string pair;
  while (stream >> pair) {
    const std::size_t eq = pair.find('=');
    KVEVICT_REQUIRE(eq != std::string::npos && eq > 0 && eq + 1 < pair.size(),
                    "policy parameter '" + pair + "' is not key=value");
    const std::string key = pair.substr(0, eq);
    const std::string value = pair.substr(eq + 1);
    try {
      if (value.find(',') != std::string::npos) {
        std::vector<std::int64_t> list;
        std::istringstream items(value);
        for (std::string item; std::getline(items, item, ',');) {
          std::size_t used = 0;
          list.push_back(std::stoll(item, &used));
          KVEVICT_REQUIRE(used == item.size(), "trailing characters");
        }
        params.set_list(key, std::move(list));
      } else {
        std::size_t used = 0;
        const double number = std::stod(value, &used);
        KVEVICT_REQUIRE(used == value.size(), "trailing characters");
        params.set(key, number);
      }
    } catch (const std::logic_error&) {  // stoll / stod: invalid_argument, out_of_range
      throw kvevict::Error("policy parameter '" + key + "' has a malformed value '" + value + "'");
    } catch (const kvevict::Error&) {
      throw kvevict::Error("policy parameter '" + key + "' has a malformed value '" + value + "'");
    }
  }
  return params;
}

kvevict::AttentionRows attention_view(kvevict_pipeline& handle, int layer, const float* rows,
                                      int q_heads, int queries, std::ptrdiff_t row_stride) {
  check_head(handle, layer, 0);
  KVEVICT_REQUIRE(rows != nullptr, "attention rows are NULL");
  const int kv_heads = handle.slots.kv_heads();
  KVEVICT_REQUIRE(q_heads > 0 && q_heads % kv_heads == 0,
                  "q_heads (" + std::to_string(q_heads) + ") is not a positive multiple of " +
                      "kv_heads (" + std::to_string(kv_heads) + ")");
  KVEVICT_REQUIRE(queries > 0, "attention rows need at least one query");
  for (int g = 0; g < kv_heads; ++g) {
    const int live = handle.slots.live(layer, g);
    KVEVICT_REQUIRE(row_stride >= live, "row_stride (" + std::to_string(row_stride) +
                                            ") is shorter than the " + std::to_string(live) +
                                            " slots of KV head " + std::to_string(g));
    handle.keys_per_kv_head[static_cast<std::size_t>(g)] = live;
  }
  return {rows,
          q_heads,
          q_heads / kv_heads,
          queries,
          row_stride,
          handle.keys_per_kv_head,
          handle.pipeline.stats().tokens_fed - queries};
}

void report(kvevict_pipeline& handle, const kvevict::CompactionPlan* plan, int* compacted) {
  handle.last_plan = plan;
  if (compacted != nullptr) *compacted = plan != nullptr ? 1 : 0;
}

}  // namespace

extern "C" {

const char* kvevict_last_error(void) { return last_error.c_str(); }

kvevict_status kvevict_pipeline_create(const char* policy, const char* params, int layers,
                                       int kv_heads, int capacity, const char* position_mode,
                                       kvevict_pipeline** out) {
  return guarded([&] {
    KVEVICT_REQUIRE(out != nullptr, "out is NULL");
    *out = nullptr;
    KVEVICT_REQUIRE(policy != nullptr, "policy name is NULL");
    std::optional<kvevict::PositionMode> mode;
    if (position_mode != nullptr) mode = kvevict::parse_position_mode(position_mode);
    KVEVICT_REQUIRE(layers > 0 && kv_heads > 0, "layers and kv_heads must be positive");
    KVEVICT_REQUIRE(capacity > 0, "capacity must be positive");
    *out = new kvevict_pipeline(layers, kv_heads, capacity,
                                kvevict::make_policy(policy, parse_params(params)), mode);
  });
}

void kvevict_pipeline_destroy(kvevict_pipeline* pipeline) { delete pipeline; }

uint32_t kvevict_pipeline_signals(const kvevict_pipeline* pipeline) {
  return pipeline != nullptr ? pipeline->pipeline.policy().signals().bits() : 0u;
}

int kvevict_pipeline_retained_limit(const kvevict_pipeline* pipeline) {
  if (pipeline == nullptr) return -1;
  return pipeline->pipeline.policy().retained_limit().value_or(-1);
}

kvevict_status kvevict_pipeline_reserve(kvevict_pipeline* pipeline, int capacity) {
  return guarded([&] { checked(pipeline).slots.reserve(capacity); });
}

int kvevict_pipeline_live(const kvevict_pipeline* pipeline, int layer, int kv_head) {
  if (pipeline == nullptr || layer < 0 || layer >= pipeline->slots.layers() || kv_head < 0 ||
      kv_head >= pipeline->slots.kv_heads()) {
    return -1;
  }
  return pipeline->slots.live(layer, kv_head);
}

kvevict_status kvevict_pipeline_slots(const kvevict_pipeline* pipeline, int layer, int kv_head,
                                      const int64_t** original_positions, const int64_t** positions,
                                      int* count) {
  return guarded([&] {
    KVEVICT_REQUIRE(pipeline != nullptr, "pipeline is NULL");
    check_head(*pipeline, layer, kv_head);
    if (original_positions != nullptr) {
      *original_positions = pipeline->slots.original_positions(layer, kv_head).data();
    }
    if (positions != nullptr) *positions = pipeline->slots.positions(layer, kv_head).data();
    if (count != nullptr) *count = pipeline->slots.live(layer, kv_head);
  });
}

kvevict_status kvevict_pipeline_before_chunk(kvevict_pipeline* pipeline, int incoming,
                                             int turn_start, int* compacted) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    report(handle, handle.pipeline.before_chunk(incoming, turn_start != 0), compacted);
  });
}

kvevict_status kvevict_pipeline_append_chunk(kvevict_pipeline* pipeline, const int32_t* token_ids,
                                             int count) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    KVEVICT_REQUIRE(token_ids != nullptr && count > 0, "append_chunk needs at least one token id");
    handle.pipeline.append_chunk({token_ids, static_cast<std::size_t>(count)});
  });
}

kvevict_status kvevict_pipeline_observe_attention(kvevict_pipeline* pipeline, int layer,
                                                  const float* rows, int q_heads, int queries,
                                                  ptrdiff_t row_stride) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    handle.pipeline.observe_attention(
        layer, attention_view(handle, layer, rows, q_heads, queries, row_stride));
  });
}

kvevict_status kvevict_pipeline_observe_surprisal(kvevict_pipeline* pipeline,
                                                  const float* surprisal, int count) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    KVEVICT_REQUIRE(surprisal != nullptr && count >= 0, "surprisal is NULL");
    handle.pipeline.observe_surprisal({surprisal, static_cast<std::size_t>(count)});
  });
}

kvevict_status kvevict_pipeline_end_forward(kvevict_pipeline* pipeline, int* compacted) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    report(handle, handle.pipeline.end_forward(), compacted);
  });
}

int kvevict_pipeline_catalyst_pending(const kvevict_pipeline* pipeline) {
  return pipeline != nullptr && pipeline->pipeline.catalyst_pending() ? 1 : 0;
}

kvevict_status kvevict_pipeline_begin_catalyst(kvevict_pipeline* pipeline, const int32_t* token_ids,
                                               int count) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    KVEVICT_REQUIRE(count >= 0 && (count == 0 || token_ids != nullptr),
                    "catalyst token ids are NULL");
    handle.pipeline.begin_catalyst({token_ids, static_cast<std::size_t>(count)});
  });
}

kvevict_status kvevict_pipeline_observe_catalyst(kvevict_pipeline* pipeline, int layer,
                                                 const float* rows, int q_heads, int queries,
                                                 ptrdiff_t row_stride) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    handle.pipeline.observe_catalyst(
        layer, attention_view(handle, layer, rows, q_heads, queries, row_stride));
  });
}

kvevict_status kvevict_pipeline_end_catalyst(kvevict_pipeline* pipeline, int* compacted) {
  return guarded([&] {
    kvevict_pipeline& handle = checked(pipeline);
    report(handle, handle.pipeline.end_catalyst(), compacted);
  });
}

kvevict_status kvevict_pipeline_plan(const kvevict_pipeline* pipeline, int layer, int kv_head,
                                     int* changes, const int32_t** keep,
                                     const int64_t** position_deltas, int* count) {
  return guarded([&] {
    KVEVICT_REQUIRE(pipeline != nullptr, "pipeline is NULL");
    check_head(*pipeline, layer, kv_head);
    const kvevict::CompactionPlan* plan = pipeline->last_plan;
    const bool changed = plan != nullptr && plan->changes(layer, kv_head);
    if (changes != nullptr) *changes = changed ? 1 : 0;
    if (keep != nullptr) *keep = changed ? plan->keep(layer, kv_head).data() : nullptr;
    if (position_deltas != nullptr) {
      *position_deltas = changed ? plan->position_deltas(layer, kv_head).data() : nullptr;
    }
    if (count != nullptr)
      *count = changed ? static_cast<int>(plan->keep(layer, kv_head).size()) : 0;
  });
}

}  // extern "C"
