// Throughput of the reference decoder (src/lib/model/decoder.hpp), single thread.
//
//   build/release/bin/bench_decoder --benchmark_counters_tabular=true
//
// Rates are per CPU second of this thread (clock_gettime(CLOCK_THREAD_CPUTIME_ID)) on both sides
// of every fraction: the machine may be shared, and a descheduled thread is not memory-bound.
// Built with the project's flags (Release: -O3, no -march); the decoder's kernels pick the best
// SIMD target of the CPU at run time (src/model/kernels, docs/kernels.md).
//
// BM_ReadBandwidth<S>: single-thread read bandwidth, summing a 512 MiB float array with Eigen
// packet accumulators, read as S sequential streams at once (S = 1: the plain sum; S = 8: the
// array cut in 8 parts read side by side, which keeps more cache lines in flight).
//
// BM_Decode15M/dtype:<0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0>: decode tokens/s of a stories15M-shaped
// Llama (dim 288, 6 layers, 6 heads, 6 KV heads, hidden 768, vocab 32000, tied classifier: 15.2M
// parameters) with random weights, full cache, a context of 16 to 271 tokens (the decoder is reset
// every 256 steps, outside the timing), greedy next token. Counters: tokens_per_s; weight_GBps =
// weight_bytes x tokens/s (every weight is read once per token); read1_GBps / read8_GBps: the
// bandwidths above, measured once in this process before the first decode (best of 5 passes);
// fraction1 / fraction8 = weight_GBps over them. readW_GBps: an array the size of the f32 weights
// read repeatedly as 8 streams (best of 10), and fractionW = weight_GBps over it: on a CPU whose
// last-level cache holds the 61 MB of weights, a decode step reads them from that cache, and the
// DRAM figures above understate what it can get.
//
// BM_PrefillProduct/dtype:<0 f32, 4 q4_0>/which:<0 w_gate, 1 w_down>: one prefill product of the
// 15M model (512 rows of X), GFLOPs per CPU second. BM_FmaPeak (x86 with AVX-512): the core's
// multiply-add peak in the same unit.
//
// BM_DecodeAtContext/setup:<s>/streamed:<tokens>: decode tokens/s after <tokens> tokens were
// streamed, for "full" (setup 0) and streaming_llm with 4 sinks + 1020 recent, keys stored after
// RoPE (1, the decoder's default) or before (2), 256 decode steps each, on a small model (dim 64, 2
// layers, 4 heads, 4 KV heads, hidden 128, vocab 300): the 15M model spends most of a step on its
// weights and would hide the attention. The context is streamed through the cache and its policy in
// chunks of 1024 random keys / values (begin_chunk, write_chunk, end_forward: the decoder's path
// without the model's compute), because a real prefill of 64K tokens through a full cache is
// quadratic and takes minutes. The decode steps timed are real forwards. eviction_share: the part
// of a step spent in begin_chunk + end_forward (DecoderStats).
#include <benchmark/benchmark.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <ctime>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <map>
#include <memory>
#include <numeric>
#include <span>
#include <vector>

#include "model/matmul.hpp"

namespace {

using kvevict::model::Decoder;
using kvevict::model::DecoderOptions;
using kvevict::model::DType;
using kvevict::model::ForwardResult;
using kvevict::model::Model;
using kvevict::model::ModelConfig;

// CPU time of this thread: the machine is shared, so rates are taken per CPU second on both sides
// of a fraction (wall time is in Google Benchmark's Time column).
double thread_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

constexpr int kBlock = 16;  // floats per stream and step: 4 SSE packets

// Sum of `data` read as `Streams` sequential streams at once (the array cut in `Streams` parts),
// with independent packet accumulators. One stream is the plain sum of an array; several keep
// more cache lines in flight, which a single core needs to approach its memory bandwidth.
template <int Streams>
float sum_floats(const std::vector<float>& data) {
  const std::size_t part = data.size() / Streams / kBlock * kBlock;
  Eigen::Array<float, kBlock * 4, Streams> accumulator =
      Eigen::Array<float, kBlock * 4, Streams>::Zero();
  for (std::size_t i = 0; i < part; i += kBlock * 4) {
    for (int s = 0; s < Streams; ++s) {
      accumulator.col(s) += Eigen::Map<const Eigen::Array<float, kBlock * 4, 1>>(
          data.data() + static_cast<std::size_t>(s) * part + i);
    }
  }
  return accumulator.sum();
}

// Bytes per CPU second of reading `bytes` of floats, best of `passes` (pages touched first).
template <int Streams>
double read_bandwidth(std::size_t bytes, int passes) {
  const std::vector<float> data(
      bytes / sizeof(float) / (Streams * kBlock * 4) * (Streams * kBlock * 4), 1.0f);
  double best = 0.0;
  for (int pass = 0; pass < passes; ++pass) {
    const double start = thread_seconds();
    float sum = sum_floats<Streams>(data);
    benchmark::DoNotOptimize(sum);
    best = std::max(best,
                    static_cast<double>(data.size() * sizeof(float)) / (thread_seconds() - start));
  }
  return best;
}

ModelConfig config_15m() {
  ModelConfig config;
  config.dim = 288;
  config.hidden_dim = 768;
  config.layers = 6;
  config.heads = 6;
  config.kv_heads = 6;
  config.vocab_size = 32000;
  config.context_length = 256;
  config.rope_layout = kvevict::RopeLayout::interleaved;  // as llama2.c checkpoints
  config.tied_embeddings = true;
  return config;
}

// One model per weight type, made on first use.
const Model& model_15m(DType dtype) {
  static std::map<DType, Model> models;
  auto it = models.find(dtype);
  if (it == models.end()) {
    it = models.emplace(dtype, kvevict::model::make_random_model(config_15m(), 15, dtype)).first;
  }
  return it->second;
}

struct Bandwidths {
  double one_stream = 0.0;     // bytes per CPU second, 512 MiB array read front to back
  double eight_streams = 0.0;  // the same array read as 8 streams at once
  // An array as large as the f32 model's weights, read again and again as 8 streams: where the
  // weights fit in the last-level cache (61 MB here), this is the bandwidth a decode step can
  // actually get, and the fair reference for it.
  double weights_sized = 0.0;
};

// Measured once, before the first decode benchmark.
const Bandwidths& bandwidths() {
  static const Bandwidths measured{read_bandwidth<1>(std::size_t{512} << 20, 5),
                                   read_bandwidth<8>(std::size_t{512} << 20, 5),
                                   read_bandwidth<8>(model_15m(DType::f32).weight_bytes(), 10)};
  return measured;
}

template <int Streams>
void BM_ReadBandwidth(benchmark::State& state) {
  const std::vector<float> data((std::size_t{512} << 20) / sizeof(float), 1.0f);
  for (auto _ : state) benchmark::DoNotOptimize(sum_floats<Streams>(data));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(data.size() * sizeof(float)));
}
BENCHMARK(BM_ReadBandwidth<1>)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ReadBandwidth<8>)->Unit(benchmark::kMillisecond);

std::int32_t argmax(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

void BM_Decode15M(benchmark::State& state) {
  const auto dtype = static_cast<DType>(state.range(0));
  const Model& model = model_15m(dtype);
  const Bandwidths& bandwidth = bandwidths();
  DecoderOptions options;
  options.max_chunk = 16;
  std::vector<std::int32_t> prompt(16);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(1 + 37 * i);

  std::unique_ptr<Decoder> decoder;
  std::int32_t token = 0;
  int context = 0;
  const auto reset = [&] {
    decoder = std::make_unique<Decoder>(
        model, kvevict::make_policy("full", kvevict::PolicyParams()), options);
    token = argmax(decoder->forward(prompt).last());
    context = static_cast<int>(prompt.size());
  };
  reset();
  double seconds = 0.0;
  for (auto _ : state) {
    if (context >= 16 + 256) {
      state.PauseTiming();
      reset();
      state.ResumeTiming();
    }
    const double start = thread_seconds();
    const ForwardResult result = decoder->forward(std::span<const std::int32_t>(&token, 1));
    token = argmax(result.last());
    seconds += thread_seconds() - start;
    ++context;
  }
  const double tokens_per_s = static_cast<double>(state.iterations()) / seconds;
  const double weight_bytes_per_s = static_cast<double>(model.weight_bytes()) * tokens_per_s;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  state.counters["tokens_per_s"] = tokens_per_s;
  state.counters["weight_MB"] = static_cast<double>(model.weight_bytes()) / 1e6;
  state.counters["weight_GBps"] = weight_bytes_per_s / 1e9;
  state.counters["read1_GBps"] = bandwidth.one_stream / 1e9;
  state.counters["read8_GBps"] = bandwidth.eight_streams / 1e9;
  state.counters["fraction1"] = weight_bytes_per_s / bandwidth.one_stream;
  state.counters["fraction8"] = weight_bytes_per_s / bandwidth.eight_streams;
  state.counters["readW_GBps"] = bandwidth.weights_sized / 1e9;
  state.counters["fractionW"] = weight_bytes_per_s / bandwidth.weights_sized;
}
BENCHMARK(BM_Decode15M)
    ->ArgName("dtype")
    ->Arg(static_cast<int>(DType::f32))
    ->Arg(static_cast<int>(DType::f16))
    ->Arg(static_cast<int>(DType::bf16))
    ->Arg(static_cast<int>(DType::q8_0))
    ->Arg(static_cast<int>(DType::q4_0))
    ->Unit(benchmark::kMillisecond);

// Prefill's products alone: Y = X W^T with 512 rows of X (a pp512 chunk) and W the 15M model's
// w_gate [768, 288] (which: 0) or w_down [288, 768] (which: 1), in each weight type, one thread
// (kvevict::model::matmul). GFLOPs counts 2 m n k per CPU second: with the clock rate (perf stat
// -e cycles) it gives the FLOPs per cycle to set against the core's peak (docs/kernels.md).
void BM_PrefillProduct(benchmark::State& state) {
  const auto dtype = static_cast<DType>(state.range(0));
  const kvevict::model::WeightMatrix& w =
      state.range(1) == 0 ? model_15m(dtype).layers[0].w_gate : model_15m(dtype).layers[0].w_down;
  const std::int64_t m = 512;
  kvevict::model::RowMatrix x = kvevict::model::RowMatrix::Random(m, w.cols);
  kvevict::model::RowMatrix y(m, w.rows);
  double seconds = 0.0;
  for (auto _ : state) {
    const double start = thread_seconds();
    kvevict::model::matmul(w, x, y);
    benchmark::DoNotOptimize(y.data());
    seconds += thread_seconds() - start;
  }
  state.counters["GFLOPs"] = 2.0 * static_cast<double>(m * w.rows * w.cols) *
                             static_cast<double>(state.iterations()) / seconds / 1e9;
}
BENCHMARK(BM_PrefillProduct)
    ->ArgNames({"dtype", "which"})
    ->ArgsProduct({{static_cast<int>(DType::f32), static_cast<int>(DType::q4_0)}, {0, 1}})
    ->Unit(benchmark::kMillisecond);

#if defined(__x86_64__) && defined(__GNUC__)
// The core's multiply-add peak, for BM_PrefillProduct's fraction: 24 independent AVX-512
// accumulators (as many as the product's tile) and nothing else, FLOPs per CPU second. Compiled
// for AVX-512 here only; skipped on a CPU without it.
__attribute__((target("avx512f"))) float fma_chains(std::int64_t steps) {
  __m512 acc[24];
  const __m512 a = _mm512_set1_ps(0.999f);
  const __m512 b = _mm512_set1_ps(1e-4f);
  for (__m512& v : acc) v = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 24
    for (__m512& v : acc) v = _mm512_fmadd_ps(v, a, b);
  }
  __m512 total = acc[0];
  for (int i = 1; i < 24; ++i) total = _mm512_add_ps(total, acc[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, total);
  return std::accumulate(lanes, lanes + 16, 0.0f);
}

void BM_FmaPeak(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512 on this CPU");
    return;
  }
  constexpr std::int64_t kSteps = 1 << 16;
  double seconds = 0.0;
  for (auto _ : state) {
    const double start = thread_seconds();
    benchmark::DoNotOptimize(fma_chains(kSteps));
    seconds += thread_seconds() - start;
  }
  state.counters["GFLOPs"] =
      2.0 * 16 * 24 * kSteps * static_cast<double>(state.iterations()) / seconds / 1e9;
}
BENCHMARK(BM_FmaPeak)->Unit(benchmark::kMillisecond);
#endif

const Model& small_model() {
  static const Model model = [] {
    ModelConfig config;
    config.dim = 64;
    config.hidden_dim = 128;
    config.layers = 2;
    config.heads = 4;
    config.kv_heads = 4;
    config.vocab_size = 300;
    config.context_length = 2048;
    return kvevict::model::make_random_model(config, 64, DType::f32);
  }();
  return model;
}

// Streams `tokens` tokens of random keys / values through the decoder's cache and policy.
void stream_context(Decoder& decoder, int tokens) {
  kvevict::EvictingCache& cache = decoder.cache();
  const ModelConfig& c = decoder.model().config;
  const int chunk = decoder.options().max_chunk;
  kvevict::model::RowMatrix keys = kvevict::model::RowMatrix::Random(chunk, c.head_dim());
  kvevict::model::RowMatrix values = kvevict::model::RowMatrix::Random(chunk, c.head_dim());
  std::vector<std::int32_t> ids(static_cast<std::size_t>(chunk));
  for (int done = 0; done < tokens; done += chunk) {
    const int n = std::min(chunk, tokens - done);
    for (int i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = (done + i) % 256;
    cache.sequence().begin_chunk(
        std::span<const std::int32_t>(ids).first(static_cast<std::size_t>(n)));
    for (int l = 0; l < c.layers; ++l) {
      for (int g = 0; g < c.kv_heads; ++g) {
        cache.write_chunk(l, g, keys.topRows(n), values.topRows(n));
      }
    }
    cache.sequence().end_forward();
  }
}

void BM_DecodeAtContext(benchmark::State& state) {
  const int setup = static_cast<int>(state.range(0));  // 0 full, 1 / 2 streaming_llm post / pre
  const int context = static_cast<int>(state.range(1));
  kvevict::StageClock clock;
  DecoderOptions options;
  options.max_chunk = 1024;
  options.key_storage = setup == 2 ? kvevict::KeyStorage::pre_rope : kvevict::KeyStorage::post_rope;
  options.observer = &clock;
  Decoder decoder(small_model(),
                  setup == 0 ? kvevict::make_policy("full", kvevict::PolicyParams())
                             : kvevict::make_policy(
                                   "streaming_llm",
                                   kvevict::PolicyParams().set("sinks", 4).set("recent", 1020)),
                  options);
  stream_context(decoder, context);
  clock.reset();  // time the decode steps only
  std::int32_t token = 1;
  for (auto _ : state) {
    const ForwardResult result = decoder.forward(std::span<const std::int32_t>(&token, 1));
    token = argmax(result.last());
  }
  const double eviction =
      clock.seconds(kvevict::Stage::policy) + clock.seconds(kvevict::Stage::reposition);
  const double compute = clock.seconds() - eviction;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  state.counters["eviction_share"] = eviction / (eviction + compute);
  state.counters["slots_per_head"] = decoder.cache().sequence().live(0, 0);
  state.counters["kv_MB"] = static_cast<double>(decoder.cache().memory().live_kv_bytes) / 1e6;
}
// The bounded runs first: after the 64K full cache was freed, later runs in the process measured
// up to 30% slower (allocator / page state), which would blur the flat line.
BENCHMARK(BM_DecodeAtContext)
    ->ArgNames({"setup", "streamed"})
    ->ArgsProduct({{1, 2}, {1024, 4096, 16384, 65536}})
    ->Iterations(256)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeAtContext)
    ->ArgNames({"setup", "streamed"})
    ->ArgsProduct({{0}, {1024, 4096, 16384, 65536}})
    ->Iterations(256)  // the full cache grows by one slot per step: small beside 1K
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
