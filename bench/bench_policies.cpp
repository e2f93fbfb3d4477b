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
#include <algorithm>
#include <cstdint>
#include <kvevict/kvevict.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

using Cache = kvevict::EvictingCache;
using Matrix = Cache::Matrix;

constexpr int kKvHeads = 8;
constexpr int kQueryHeads = 8;
constexpr int kMaxChunk = 64;

// Parameters that hold each policy at `budget` slots per head: the CLI's --budget mapping (4
// sinks), with AnLLM's anchor id and SirLLM's decay 0.9.
kvevict::PolicyParams params_for(const std::string& policy, int budget) {
  kvevict::PolicyParams params = kvevict::budget_params(policy, budget);
  if (policy == "sirllm") params.set("decay", 0.9);
  if (policy == "anllm") params.set_list("anchor_ids", {1});
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
  in.stride = budget + kMaxChunk;  // at least every head's slot limit
  in.rows.assign(static_cast<std::size_t>(kQueryHeads) * kMaxChunk * in.stride, 0.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (float& x : in.rows) x = uniform(rng) / static_cast<float>(budget);
  return in;
}

// One forward of `n` tokens (n <= kMaxChunk), with the attention rows the policy reads (the same
// random probabilities for every query: the timed steps are single tokens anyway).
// `turn_start` is always set, so SirLLM and its baselines evict at every step (their worst case).
void step(Cache& cache, StepInputs& in, int n, std::int32_t token, std::mt19937& rng) {
  const std::vector<std::int32_t> ids(static_cast<std::size_t>(n), token);
  cache.sequence().begin_chunk(ids, /*turn_start=*/true);
  const Matrix keys = in.key.replicate(n, 1);
  const Matrix values = in.value.replicate(n, 1);
  for (int g = 0; g < kKvHeads; ++g) cache.write_chunk(0, g, keys, values);
  if (cache.sequence().wants_attention()) {
    cache.sequence().observe_attention(0, in.rows.data(), cache.sequence().attention_queries(),
                                       in.stride);
  }
  if (cache.sequence().wants(kvevict::Signal::surprisal)) {
    std::vector<float> surprisal(static_cast<std::size_t>(n));
    for (float& s : surprisal) s = static_cast<float>(rng() % 1000) / 100.0f;
    cache.sequence().observe_surprisal(surprisal);
  }
  cache.sequence().end_forward();
  if (cache.sequence().catalyst_pending()) {
    const std::int32_t catalyst[1] = {0};
    cache.sequence().begin_catalyst(catalyst);
    for (int g = 0; g < kKvHeads; ++g) cache.write_chunk(0, g, in.key, in.value);
    cache.sequence().observe_catalyst(0, in.rows.data(), 1, in.stride);
    cache.sequence().end_catalyst();
  }
}

// Args: policy index, budget, head_dim.
void BM_PolicyStep(benchmark::State& state) {
  const std::string& policy = policies()[static_cast<std::size_t>(state.range(0))];
  const int budget = static_cast<int>(state.range(1));
  const int head_dim = static_cast<int>(state.range(2));
  kvevict::CacheConfig config;
  config.shape = kvevict::CacheShape{1, kQueryHeads, kKvHeads, head_dim};
  config.sequence.key_storage = kvevict::KeyStorage::post_rope;
  config.sequence.max_chunk = kMaxChunk;
  Cache cache(config, kvevict::make_policy(policy, params_for(policy, budget)));
  StepInputs in = make_inputs(budget, head_dim);
  std::mt19937 rng(3);
  // Warm up in chunks to the budget and past one InfiniPot distillation, never crossing a pot
  // boundary, so every timed step is steady state. Warm-up tokens are all AnLLM anchors (id 1),
  // which fills AnLLM to its cap: the steady state of a capped endless stream.
  std::int64_t fed = 0;
  while (fed < budget + 2 * kMaxChunk) {
    const std::optional<int> room = cache.sequence().pot_room();
    const int n = std::min(kMaxChunk, room && *room > 0 ? *room : kMaxChunk);
    step(cache, in, n, 1, rng);
    fed += n;
  }
  // InfiniPot distills once per pot - keep tokens: one timed iteration feeds a whole cycle, so the
  // distillation is amortised over the tokens it serves. Others: one token per iteration. One
  // token in 16 is an anchor.
  const int tokens_per_iteration = policy == "infinipot" ? budget - budget / 2 : 1;
  std::int32_t token = 0;
  for (auto _ : state) {
    for (int t = 0; t < tokens_per_iteration; ++t) {
      step(cache, in, 1, (++token % 16 == 0) ? 1 : 2, rng);
    }
  }
  state.counters["time_per_token"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * tokens_per_iteration,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetLabel(policy);
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
  state.counters["time_per_token"] =
      benchmark::Counter(static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
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
