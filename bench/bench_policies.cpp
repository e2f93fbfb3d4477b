// Per-step cost of every policy beside the cost of attention over the same cache.
//
//   build/release/bin/bench_policies --benchmark_counters_tabular=true
//
// BM_PolicyStep/<policy>/<budget>/<head_dim>: one decode step of a cache held at its budget, 1
// layer, 8 KV heads (8 query heads), keys stored after RoPE: append the token's K/V, hand the
// policy its signals (precomputed attention rows / surprisal), score, select, compact and
// re-position. The attention itself is not in it: BM_Attention/<budget>/<head_dim> times q.K,
// softmax and softmax.V for the same cache, so overhead = PolicyStep / Attention
// (docs/benchmarks.md).
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <random>
#include <string>
#include <vector>

namespace {

using Cache = kvevict::EvictingCache<float>;
using Matrix = Cache::Matrix;

constexpr int kKvHeads = 8;
constexpr int kQueryHeads = 8;

// Parameters that hold each policy at `budget` slots per head.
kvevict::PolicyParams params_for(const std::string& policy, int budget) {
  kvevict::PolicyParams params;
  if (policy == "window") params.set("recent", budget);
  if (policy == "streaming_llm") params.set("sinks", 4).set("recent", budget - 4);
  if (policy == "h2o") params.set("heavy", budget / 2).set("recent", budget - budget / 2);
  if (policy == "tova") params.set("budget", budget);
  if (policy == "sirllm") params.set("sinks", 4).set("entropy", budget - 4).set("decay", 0.9);
  if (policy == "anllm") params.set_list("anchor_ids", {1}).set("max_slots", budget);
  if (policy == "infinipot")
    params.set("pot", budget).set("keep", budget / 2).set("novel", budget / 4);
  return params;
}

const std::vector<std::string>& policies() {
  static const std::vector<std::string> names{"window", "streaming_llm", "h2o",      "tova",
                                              "sirllm", "anllm",         "infinipot"};
  return names;
}

struct StepInputs {
  Matrix key, value;        // [1, head_dim]
  std::vector<float> rows;  // [q_heads][1][stride], a valid softmax row per head
  std::vector<int> keys;    // per KV head
  int stride = 0;
};

StepInputs make_inputs(int budget, int head_dim) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  StepInputs in;
  in.key = Matrix(1, head_dim);
  in.value = Matrix(1, head_dim);
  for (int c = 0; c < head_dim; ++c) {
    in.key(0, c) = normal(rng);
    in.value(0, c) = normal(rng);
  }
  in.stride = budget + 8;
  in.rows.assign(static_cast<std::size_t>(kQueryHeads) * in.stride, 0.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (float& x : in.rows) x = uniform(rng) / static_cast<float>(budget);
  in.keys.assign(kKvHeads, 0);
  return in;
}

// One forward of one token; `turn` marks it as a turn start (SirLLM evicts there).
void step(Cache& cache, StepInputs& in, std::int32_t token, std::mt19937& rng) {
  const std::int32_t ids[1] = {token};
  cache.begin_chunk(ids, /*turn_start=*/true);
  for (int g = 0; g < kKvHeads; ++g) cache.write_chunk(0, g, in.key, in.value);
  const bool wants_rows = cache.wants(kvevict::Signal::attention_rows) ||
                          cache.wants(kvevict::Signal::last_attention_row);
  if (wants_rows) {
    for (int g = 0; g < kKvHeads; ++g) in.keys[static_cast<std::size_t>(g)] = cache.live(0, g);
    cache.observe_attention(
        0, kvevict::AttentionRows(in.rows.data(), kQueryHeads, 1, 1, in.stride, in.keys, 0));
  }
  if (cache.wants(kvevict::Signal::surprisal)) {
    const float surprisal[1] = {static_cast<float>(rng() % 1000) / 100.0f};
    cache.observe_surprisal(surprisal);
  }
  cache.end_forward();
  if (cache.catalyst_pending()) {
    const std::int32_t catalyst[1] = {0};
    cache.begin_catalyst(catalyst);
    for (int g = 0; g < kKvHeads; ++g) {
      cache.write_chunk(0, g, in.key, in.value);
      in.keys[static_cast<std::size_t>(g)] = cache.live(0, g);
    }
    cache.observe_catalyst(
        0, kvevict::AttentionRows(in.rows.data(), kQueryHeads, 1, 1, in.stride, in.keys, 0));
    cache.end_catalyst();
  }
}

// Args: policy index, budget, head_dim.
void BM_PolicyStep(benchmark::State& state) {
  const std::string& policy = policies()[static_cast<std::size_t>(state.range(0))];
  const int budget = static_cast<int>(state.range(1));
  const int head_dim = static_cast<int>(state.range(2));
  kvevict::CacheConfig config;
  config.shape = kvevict::CacheShape{1, kQueryHeads, kKvHeads, head_dim};
  config.key_storage = kvevict::KeyStorage::post_rope;
  config.max_chunk = 2;
  Cache cache(config, kvevict::make_policy(policy, params_for(policy, budget)));
  StepInputs in = make_inputs(budget, head_dim);
  std::mt19937 rng(3);
  std::int32_t token = 2;
  // Warm up past the budget (and one InfiniPot distillation) so every timed step is steady state.
  for (int t = 0; t < 2 * budget + 8; ++t) step(cache, in, (token++ % 16 == 0) ? 1 : 2, rng);
  for (auto _ : state) step(cache, in, (token++ % 16 == 0) ? 1 : 2, rng);
  state.SetLabel(policy);
  state.SetItemsProcessed(state.iterations());
}

// q.K^T, softmax and softmax.V of one query per head over `budget` cached keys, 8 heads.
void BM_Attention(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  const int head_dim = static_cast<int>(state.range(1));
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<Matrix> keys, values;
  for (int g = 0; g < kKvHeads; ++g) {
    keys.emplace_back(budget, head_dim);
    values.emplace_back(budget, head_dim);
    for (Eigen::Index i = 0; i < keys.back().size(); ++i) {
      keys.back().data()[i] = normal(rng);
      values.back().data()[i] = normal(rng);
    }
  }
  Eigen::RowVectorXf query = Eigen::RowVectorXf::Random(head_dim);
  Eigen::RowVectorXf scores(budget), output(head_dim);
  for (auto _ : state) {
    for (int h = 0; h < kQueryHeads; ++h) {
      const Matrix& k = keys[static_cast<std::size_t>(h)];
      scores.noalias() = query * k.transpose();             // [budget]
      scores = (scores.array() - scores.maxCoeff()).exp();  // softmax numerator
      scores /= scores.sum();
      output.noalias() = scores * values[static_cast<std::size_t>(h)];  // [head_dim]
      benchmark::DoNotOptimize(output.data());
    }
  }
  state.SetItemsProcessed(state.iterations());
}

void PolicyArgs(benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"policy", "budget", "head_dim"});
  for (int p = 0; p < static_cast<int>(policies().size()); ++p) {
    for (int budget : {256, 1024, 4096, 8192}) {
      for (int head_dim : {64, 128}) bench->Args({p, budget, head_dim});
    }
  }
}
BENCHMARK(BM_PolicyStep)->Apply(PolicyArgs);
BENCHMARK(BM_Attention)
    ->ArgsProduct({{256, 1024, 4096, 8192}, {64, 128}})
    ->ArgNames({"budget", "head_dim"});

}  // namespace

BENCHMARK_MAIN();
