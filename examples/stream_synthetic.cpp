// stream_synthetic: streams random keys, values and queries through any kvevict policy and prints,
// as it goes, the cache size per head, the bytes it holds and which positions survive.
//
//   stream_synthetic [POLICY] [KEY=VALUE ...] [tokens=N] [storage=pre_rope|post_rope]
//   stream_synthetic streaming_llm sinks=4 recent=12 tokens=48
//   stream_synthetic h2o heavy=8 recent=8
//
// Attention is real (softmax of q.k over the cache, per query head), so attention-scored policies
// see genuine rows; surprisal is random. This is a demo of the data flow, not a quality test: the
// reference decoder runs the policies on trained models.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <kvevict/kvevict.hpp>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using Cache = kvevict::EvictingCache;
using Matrix = Cache::Matrix;

constexpr kvevict::CacheShape kShape{2, 4, 2, 64};  // layers, query heads, KV heads, head_dim

Matrix random_rows(std::mt19937& rng, int rows) {
  std::normal_distribution<float> normal;
  Matrix m(rows, kShape.head_dim);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

// Writes the chunk's K/V, attends with random queries (causal within the chunk) and hands the rows
// to the policy if it asked for them. `catalyst` selects the catalyst-prompt variant.
void forward(Cache& cache, std::mt19937& rng, bool catalyst) {
  const int n = cache.sequence().chunk_size();
  const bool all_rows = cache.sequence().wants(kvevict::Signal::attention_rows) ||
                        (catalyst && cache.sequence().wants(kvevict::Signal::catalyst_attention));
  const bool wants_rows = all_rows || cache.sequence().wants(kvevict::Signal::last_attention_row);
  const int query_rows = all_rows ? n : 1;
  std::vector<float> rows;
  std::vector<int> keys_per_kv_head(static_cast<std::size_t>(kShape.kv_heads));
  for (int l = 0; l < kShape.layers; ++l) {
    int stride = 0;
    for (int g = 0; g < kShape.kv_heads; ++g) {
      cache.write_chunk(l, g, random_rows(rng, n), random_rows(rng, n));
      keys_per_kv_head[static_cast<std::size_t>(g)] = cache.sequence().slot_limit(l, g);
      stride = std::max(stride, cache.sequence().slot_limit(l, g));
    }
    if (!wants_rows) continue;
    rows.assign(static_cast<std::size_t>(kShape.q_heads) * query_rows * stride, 0.0f);
    for (int h = 0; h < kShape.q_heads; ++h) {
      const int g = kShape.kv_head_of(h);
      const std::span<const std::int32_t> chunk = cache.sequence().chunk_slots(l, g);
      for (int q = 0; q < query_rows; ++q) {
        const int i = n - query_rows + q;  // the query's index in the chunk
        const Matrix query = random_rows(rng, 1);
        float* row = rows.data() + (static_cast<std::size_t>(h) * query_rows + q) * stride;
        cache.dot_products(l, g, std::span<const float>(query.data(), kShape.head_dim),
                           cache.sequence().position(l, g, chunk[static_cast<std::size_t>(i)]),
                           std::span<float>(row, static_cast<std::size_t>(stride)));
        // Causal: the chunk's later tokens are not visible to this query.
        for (int j = i + 1; j < n; ++j) {
          row[chunk[static_cast<std::size_t>(j)]] = -std::numeric_limits<float>::infinity();
        }
        const float max = *std::max_element(row, row + stride);
        float sum = 0;
        for (int s = 0; s < stride; ++s) {
          sum += row[s] =
              std::isinf(row[s])
                  ? 0.0f
                  : std::exp((row[s] - max) / std::sqrt(static_cast<float>(kShape.head_dim)));
        }
        for (int s = 0; s < stride; ++s) row[s] /= sum;
      }
    }
    if (catalyst) {
      cache.sequence().observe_catalyst(l, rows.data(), query_rows, stride);
    } else {
      cache.sequence().observe_attention(l, rows.data(), query_rows, stride);
    }
  }
}

int run(int argc, char** argv) {
  std::string policy_name = "streaming_llm";
  kvevict::PolicyParams params;
  int tokens = 48;
  kvevict::KeyStorage storage = kvevict::KeyStorage::pre_rope;
  bool defaults = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      policy_name = arg;
      continue;
    }
    const std::string key = arg.substr(0, eq);
    const std::string value = arg.substr(eq + 1);
    if (key == "tokens") {
      tokens = std::stoi(value);
    } else if (key == "storage") {
      storage = kvevict::parse_key_storage(value);
    } else {
      params.parse_pair(arg);  // typed by the policy's spec when the policy is built
      defaults = false;
    }
  }
  if (defaults && policy_name == "streaming_llm") params.set("sinks", 4).set("recent", 12);

  kvevict::CacheConfig config;
  config.shape = kShape;
  config.sequence.key_storage = storage;
  config.sequence.max_chunk = 8;
  Cache cache(config, kvevict::make_policy(policy_name, params));
  fmt::print("policy {} | {} layers, {} query / {} KV heads, head_dim {} | positions {}, keys {}\n",
             policy_name, kShape.layers, kShape.q_heads, kShape.kv_heads, kShape.head_dim,
             kvevict::to_string(cache.sequence().position_mode()), kvevict::to_string(storage));
  fmt::print("{:>6} {:>10} {:>12} {:>12}  kept original positions (layer 0, KV head 0)\n", "fed",
             "live/head", "live bytes", "peak bytes");

  std::mt19937 rng(1);
  std::uniform_real_distribution<float> surprisal(0.5f, 6.0f);
  int fed = 0;
  while (fed < tokens) {
    const int n = fed == 0 ? 8 : 1;  // a short prefill, then one token per forward
    cache.sequence().begin_chunk(std::vector<std::int32_t>(static_cast<std::size_t>(n), 0), true);
    forward(cache, rng, false);
    if (cache.sequence().wants(kvevict::Signal::surprisal)) {
      std::vector<float> values(static_cast<std::size_t>(n));
      for (float& v : values) v = surprisal(rng);
      cache.sequence().observe_surprisal(values);
    }
    cache.sequence().end_forward();
    if (cache.sequence().catalyst_pending()) {
      cache.sequence().begin_catalyst(std::vector<std::int32_t>(4, 0));
      forward(cache, rng, true);
      cache.sequence().end_catalyst();
    }
    fed += n;
    if (fed % 8 == 0 || fed == tokens) {
      const kvevict::SlotTable& slots = cache.sequence().slots();
      const int unit = cache.sequence().unit_of(0, 0);
      std::vector<std::int64_t> kept;
      for (const std::int32_t slot : slots.stream_order(unit)) {
        kept.push_back(slots.original_positions(unit)[static_cast<std::size_t>(slot)]);
      }
      const kvevict::MemoryStats memory = cache.memory();
      fmt::print("{:>6} {:>10} {:>12} {:>12}  {}\n", fed, slots.live(unit), memory.live_bytes(),
                 memory.peak_live_bytes, fmt::join(kept, " "));
    }
  }
  const kvevict::SequenceStats& stats = cache.sequence().stats();
  fmt::print("decisions {}, evicted slots {} (all heads), keys re-rotated {}, reserved {} bytes\n",
             stats.decisions, stats.evicted_slots, stats.rotated_keys,
             cache.memory().reserved_bytes);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    fmt::print(stderr, "stream_synthetic: error: {}\n", error.what());
    return 2;
  }
}
