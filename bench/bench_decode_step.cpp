// One decode step of the reference decoder with the cache at its budget, split into the model's
// stages and the policy's (an injected StageClock), for every policy at budgets 1K and 4K.
//
//   build/release/bin/bench_decode_step --benchmark_counters_tabular=true
//       --benchmark_repetitions=3 --benchmark_min_time=1   (one command line)
//
// BM_DecodeStepKv/<policy>/<kv_type>/budget:4096: the same step with the cache stored as f32, f16,
// bf16 or Q8_0 (--kv-type), for full, streaming_llm and h2o.
//
// BM_DecodeStepInterval/<policy>/interval:<I>/budget:<N> (N = 1K and 4K): knorm and keydiff with
// `interval` I = 10 (kvpress DecodingPress's default) and 64: one step in I brings each unit back
// to the budget, the others only append; the counters are means over the run's steps.
//
// BM_DecodeStepAlloc/<policy>/<allocation>/budget:<N> (N = 1K and 4K): the same step under
// --allocation uniform, pyramid and adaptive (policies/allocated.hpp) for h2o and tova per KV head
// (head_wise=1, so that adaptive applies; uniform is the plain policy, bit for bit), the sequence
// budget being the policy's own (N per head on average). `overhead` is comparable across the three
// of one policy and budget in one run: adaptive re-splits each layer's budget from the current
// scores at every decision.
//
// BM_DecodeStep/<policy>/budget:<N>, for every policy of the registry: a single-token forward()
// with the cache full at the budget, so every step of a bounded policy evicts. Policies are
// configured exactly as `kvevict stream --policy P --budget N` does (harness/policy_setup.hpp:
// the --budget mapping, 4 sinks, chunk 64, keys post_rope, each policy's own position mode and
// granularity, InfiniPot's default catalyst prompt).
//
// The cache is filled before timing by real forwards (chunks of 64) of the stream below, so the
// policies' scores come from the model's own attention and surprisal. One decoder per
// (policy, budget) is kept across Google Benchmark's runs of that benchmark (iteration estimation,
// repetitions): the fill is paid once, and later runs continue the same stream. The first runs are
// the first steps after a prompt of N tokens, where H2O's kept heap re-ranks the most
// (docs/benchmarks.md); later repetitions are further into the generation.
//
// `full` is the reference at the same live size: after each step, outside the timing, the token
// just fed is rolled back (Sequence::roll_back), so that every step attends over N + 1 slots.
//
// Stream: byte tokens from an LCG with the <AC> anchor (id 258) every 16th token, the same for
// every policy (AnLLM reduces at each anchor). AnLLM is filled with anchors only, the steady state
// of an endless stream under its max_slots cap (a cache of anchors, oldest dropped at the cap).
// SirLLM, RandomLLM and IntervalLLM evict before a turn: every step is a turn start (their worst
// case: every step evicts, as with the other bounded policies).
// InfiniPot (pot N, keep N/2, novel N/4) distils once per pot fill, i.e. every N/2 tokens, with a
// catalyst prompt forward: each run is exactly N/2 steps (one pot cycle, one distillation), so
// its figures are the per-step average with the distillation amortised; its live size cycles from
// N/2 to N.
//
// Model: a random Llama, dim 512, 8 layers, 8 query / 2 KV heads (head_dim 64, GQA 4:1), hidden
// 1536 (Llama's 8/3 x dim rounded up to 256), vocabulary 259 (the byte-level tokenizer of the toy
// models, with bos, eos and <AC>), untied, f32: 24.4 M parameters, 98 MB of weights. The KV side
// matches small Llamas (head_dim 64 and GQA as TinyLlama / Llama 3.2 1B), so attention and the
// policies see realistic rows; the weights are far larger than the last-level cache, so the MLP
// and projections stream from memory as in a real model; 8 layers (not 22+) keep the fill of a
// 4K cache at seconds. The vocabulary is tiny, so the head is cheaper than in a real model.
//
// Counters, per step (µs of wall time, steady_clock, from the StageClock injected into the decoder,
// deltas over the run; stages are exclusive, so nested policy hooks are not in attention):
//   step_us        every stage: the whole forward()
//   attention_us   attention blocks (norm, QKV, K/V write, RoPE, q.K, softmax, .V, out-proj)
//   mlp_us         MLP blocks (norm, gate/up, SwiGLU, down)
//   head_us        embedding, final norm, classifier, surprisal
//   policy_us      observe_* scoring + select (the policy's decision)
//   reposition_us  applying decisions: slot metadata, the KvStore's folds (key rotations)
//   catalyst_us    InfiniPot's catalyst prompt forward (amortised over the pot cycle)
//   overhead       (policy + reposition) / (attention + mlp)
//   catalyst       catalyst / (attention + mlp)
//   moved_bytes_per_evicted  K/V bytes rewritten or copied (folds, growth) per evicted slot
//   live           tokens of head (0, 0) after the run; evictions: decisions per step
//   runs_per_unit  runs of live slots sharing a pending rotation, per (layer, KV head), after
//                  the run: attention's q.K and p.V calls per head
//   from_reference KeyDiff only: the share of its decisions made from the scores of an earlier
//                  anchor, without scoring every key (policies/key_scores.hpp)
//
// BM_AttentionVsRead/budget:<N> (N = 4K and 16K; `--benchmark_filter=AttentionVsRead` runs only
// these): the attention stage of a decode step of `full` over N + 1 slots against the time one
// read of its bytes takes (the attention weights wq, wk, wv, wo and norms of every layer plus the
// live K/V) at the read bandwidth measured in the same run: the best of three sums of a 1 GiB
// buffer (larger than any last-level cache), one thread, right after the steps. Counters:
//   attention_us      the attention stage per step (as above)
//   bytes_MB          attention weights + live K/V
//   read_GBps         the measured read bandwidth
//   read_us           bytes / read bandwidth
//   attention_vs_read attention_us / read_us (1 = the stage runs at the read bandwidth)
//   cpu_share         the thread's CPU time / wall time over the steps (1 on an idle machine)
//   cpu_vs_read       the same ratio in CPU time: attention_us x cpu_share against the read at
//                     its bandwidth per CPU second (what a loaded machine can still compare)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policies/key_scores.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "harness/policy_setup.hpp"
#include "model/kernels/kernels.hpp"

namespace {

using kvevict::model::Decoder;
using kvevict::model::Model;
using kvevict::model::ModelConfig;

constexpr std::int32_t kAnchor = 258;  // <AC> in the byte-level tokenizer of a 259-id vocabulary

const Model& model() {
  static const Model model = [] {
    ModelConfig config;
    config.dim = 512;
    config.hidden_dim = 1536;
    config.layers = 8;
    config.heads = 8;
    config.kv_heads = 2;
    config.vocab_size = 259;
    // Sizes the RoPE table (16384 positions): every position of these runs is in it.
    config.context_length = 16384;
    return kvevict::model::make_random_model(config, 512, kvevict::model::DType::f32);
  }();
  return model;
}

// Token `index` of the stream: a byte from an LCG, or the anchor every 16th token.
std::int32_t stream_token(std::int64_t index) {
  if (index % 16 == 15) return kAnchor;
  const auto mixed =
      static_cast<std::uint64_t>(index) * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<std::int32_t>((mixed >> 33) % 256);
}

// The decoder of the benchmark being run, kept across its runs (see the header comment).
struct Running {
  std::string policy;
  int budget = 0;
  std::string kv_type;
  std::string allocation;
  std::vector<std::string> params;
  kvevict::StageClock clock;  // the decoder's observer
  std::unique_ptr<Decoder> decoder;
  std::int64_t next = 0;  // index of the next stream token
};

Running& running_for(const std::string& policy, int budget, const std::string& kv_type,
                     const std::string& allocation = "uniform",
                     const std::vector<std::string>& params = {}) {
  static Running running;
  if (running.decoder && running.policy == policy && running.budget == budget &&
      running.kv_type == kv_type && running.allocation == allocation && running.params == params) {
    return running;
  }
  running.decoder.reset();                  // free the previous cache first
  kvevict::harness::PolicyOptions options;  // chunk 64, keys post_rope, 4 sinks: the CLI's defaults
  options.policy = policy;
  options.kv_type = kv_type;
  options.allocation = allocation;
  options.params = params;
  if (policy != "full") options.budget = budget;
  kvevict::harness::PolicySetup setup = kvevict::harness::make_policy_setup(options, model());
  setup.decoder_options.observer = &running.clock;
  running.decoder = kvevict::harness::make_decoder(model(), setup);
  running.policy = policy;
  running.budget = budget;
  running.kv_type = kv_type;
  running.allocation = allocation;
  running.params = params;

  std::vector<std::int32_t> fill(static_cast<std::size_t>(budget));
  for (int i = 0; i < budget; ++i) {
    fill[static_cast<std::size_t>(i)] = policy == "anllm" ? kAnchor : stream_token(i);
  }
  (void)running.decoder->feed(fill);
  running.next = budget;
  return running;
}

void BM_DecodeStep(benchmark::State& state, const std::string& policy, const std::string& kv_type,
                   const std::string& allocation, const std::vector<std::string>& params) {
  using kvevict::Stage;
  const int budget = static_cast<int>(state.range(0));
  Running& running = running_for(policy, budget, kv_type, allocation, params);
  Decoder& decoder = *running.decoder;
  // SirLLM and its baselines (RandomLLM, IntervalLLM) evict before a turn: every step is one.
  const bool turns =
      decoder.cache().sequence().policy().triggers().contains(kvevict::Trigger::before_turn);
  const kvevict::model::ForwardRequest request{turns, false};
  kvevict::Sequence& sequence = decoder.cache().sequence();

  const kvevict::StageClock before = running.clock;
  const kvevict::SequenceStats stats_before = sequence.stats();
  const auto* keydiff = dynamic_cast<const kvevict::KeyDiffPolicy*>(&sequence.policy());
  const std::int64_t decisions_before = keydiff != nullptr ? keydiff->decisions() : 0;
  const std::int64_t from_reference_before =
      keydiff != nullptr ? keydiff->decisions_from_reference() : 0;
  const std::size_t moved_before =
      decoder.cache().store().bytes_rotated() + decoder.cache().store().bytes_copied();
  for (auto _ : state) {
    const std::int32_t token = stream_token(running.next++);
    benchmark::DoNotOptimize(decoder.forward(std::span<const std::int32_t>(&token, 1), request));
    if (policy == "full") {
      // Back to N tokens for the next step, outside the timing (and outside the clock).
      state.PauseTiming();
      sequence.roll_back(1);
      --running.next;
      state.ResumeTiming();
    }
  }
  const double steps = static_cast<double>(state.iterations());
  const auto per_step_us = [&](Stage stage) {
    return std::chrono::duration<double>(running.clock.total(stage) - before.total(stage)).count() /
           steps * 1e6;
  };
  const double attention = per_step_us(Stage::attention);
  const double mlp = per_step_us(Stage::mlp);
  const double head = per_step_us(Stage::head);
  const double policy_us = per_step_us(Stage::policy);
  const double reposition = per_step_us(Stage::reposition);
  const double catalyst = per_step_us(Stage::catalyst);
  state.counters["step_us"] = attention + mlp + head + policy_us + reposition + catalyst;
  state.counters["attention_us"] = attention;
  state.counters["mlp_us"] = mlp;
  state.counters["head_us"] = head;
  state.counters["policy_us"] = policy_us;
  state.counters["reposition_us"] = reposition;
  state.counters["catalyst_us"] = catalyst;
  state.counters["overhead"] = (policy_us + reposition) / (attention + mlp);
  state.counters["catalyst"] = catalyst / (attention + mlp);
  const std::int64_t evicted = sequence.stats().evicted_slots - stats_before.evicted_slots;
  const std::size_t moved = decoder.cache().store().bytes_rotated() +
                            decoder.cache().store().bytes_copied() - moved_before;
  state.counters["moved_bytes_per_evicted"] =
      evicted > 0 ? static_cast<double>(moved) / static_cast<double>(evicted) : 0.0;
  state.counters["live"] = decoder.cache().sequence().live(0, 0);
  // Runs of live slots sharing a pending rotation, per unit after the last step: what attention
  // walks (one q.K and one p.V call each).
  const kvevict::SlotTable& slots = sequence.slots();
  std::int64_t runs = 0;
  for (int unit = 0; unit < slots.units(); ++unit) {
    slots.for_each_key_run(unit, [&](int, int, std::int64_t) { ++runs; });
  }
  state.counters["runs_per_unit"] = static_cast<double>(runs) / slots.units();
  state.counters["evictions"] =
      static_cast<double>(sequence.stats().decisions - stats_before.decisions) / steps;
  if (keydiff != nullptr && keydiff->decisions() > decisions_before) {
    // KeyDiff: the share of its decisions that scored only the keys near the lowest reference
    // score (policies/key_scores.hpp).
    state.counters["from_reference"] =
        static_cast<double>(keydiff->decisions_from_reference() - from_reference_before) /
        static_cast<double>(keydiff->decisions() - decisions_before);
  }
}

// Seconds of CPU time this thread has used.
double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

struct Bandwidth {
  double wall = 0.0;  // bytes per second of wall time
  double cpu = 0.0;   // bytes per second of this thread's CPU time
};

// Read bandwidth of one thread: the best of three sums of a buffer larger than any last-level
// cache.
Bandwidth read_bandwidth() {
  constexpr std::size_t kFloats = std::size_t{1} << 28;  // 1 GiB
  static const std::vector<float> buffer(kFloats, 1.0f);
  constexpr auto kBytes = static_cast<double>(kFloats * sizeof(float));
  Bandwidth best;
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = thread_cpu_seconds();
    float total = kvevict::model::kernels::sum(buffer.data(), static_cast<std::int64_t>(kFloats));
    benchmark::DoNotOptimize(total);
    const double cpu = thread_cpu_seconds() - cpu_start;
    const std::chrono::duration<double> wall = std::chrono::steady_clock::now() - start;
    best.wall = std::max(best.wall, kBytes / wall.count());
    best.cpu = std::max(best.cpu, kBytes / cpu);
  }
  return best;
}

// Bytes of the attention blocks' weights: wq, wk, wv, wo and the attention norm of every layer.
std::size_t attention_weight_bytes(const Model& m) {
  std::size_t bytes = 0;
  for (const kvevict::model::LayerWeights& layer : m.layers) {
    bytes += layer.wq.bytes() + layer.wk.bytes() + layer.wv.bytes() + layer.wo.bytes() +
             layer.attention_norm.size() * sizeof(float);
  }
  return bytes;
}

void BM_AttentionVsRead(benchmark::State& state) {
  const int budget = static_cast<int>(state.range(0));
  Running& running = running_for("full", budget, "f32");
  Decoder& decoder = *running.decoder;
  // One untimed step first: the step after the fill may grow the slots (a copy of every K/V row).
  const std::int32_t first = stream_token(running.next);
  (void)decoder.forward(std::span<const std::int32_t>(&first, 1));
  decoder.cache().sequence().roll_back(1);
  const kvevict::StageClock before = running.clock;
  std::size_t live_kv_bytes = 0;
  const auto wall_start = std::chrono::steady_clock::now();
  const double cpu_start = thread_cpu_seconds();
  for (auto _ : state) {
    const std::int32_t token = stream_token(running.next);
    benchmark::DoNotOptimize(decoder.forward(std::span<const std::int32_t>(&token, 1)));
    state.PauseTiming();
    live_kv_bytes = decoder.cache().memory().live_kv_bytes;  // N + 1 slots, as attended
    decoder.cache().sequence().roll_back(1);
    state.ResumeTiming();
  }
  // The share of the steps' wall time this thread ran: on a loaded machine, the stage's CPU time
  // is about its wall time times this share.
  const double cpu_share =
      (thread_cpu_seconds() - cpu_start) /
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  const double attention_us =
      std::chrono::duration<double>(running.clock.total(kvevict::Stage::attention) -
                                    before.total(kvevict::Stage::attention))
          .count() /
      static_cast<double>(state.iterations()) * 1e6;
  const Bandwidth bandwidth = read_bandwidth();
  const double bytes = static_cast<double>(attention_weight_bytes(model()) + live_kv_bytes);
  const double read_us = bytes / bandwidth.wall * 1e6;
  const double read_cpu_us = bytes / bandwidth.cpu * 1e6;
  state.counters["attention_us"] = attention_us;
  state.counters["bytes_MB"] = bytes / 1e6;
  state.counters["read_GBps"] = bandwidth.wall / 1e9;
  state.counters["read_us"] = read_us;
  state.counters["attention_vs_read"] = attention_us / read_us;
  state.counters["cpu_share"] = cpu_share;
  state.counters["cpu_vs_read"] = attention_us * cpu_share / read_cpu_us;
}

// BM_DecodeStep/<policy>/budget:<N> for every policy of the registry, the KV types, the
// key-scored policies with an interval, the allocations, then BM_AttentionVsRead.
void register_benchmarks() {
  for (const int budget : {1024, 4096}) {
    for (const std::string_view name : kvevict::policy_names()) {
      // Prompt compression (SnapKV, PyramidKV, Ada-KV) decides once, after the prompt, and never
      // while decoding: it has no decode step to measure (and its default gqa = repeat needs a
      // cache of query heads, which the decoder does not lay out).
      if (name == "snapkv" || name == "pyramidkv" || name == "adakv") continue;
      const std::string policy(name);
      benchmark::internal::Benchmark* b =
          benchmark::RegisterBenchmark(("BM_DecodeStep/" + policy).c_str(), BM_DecodeStep, policy,
                                       std::string("f32"), std::string("uniform"),
                                       std::vector<std::string>{})
              ->ArgNames({"budget"})
              ->Args({budget})
              ->Unit(benchmark::kMicrosecond);
      // One pot cycle per run: exactly one distillation, amortised over the tokens it serves.
      if (policy == "infinipot") b->Iterations(budget / 2);
    }
  }
  // The K/V storage types at budget 4K: the full cache (attention over 4K slots) and two evicting
  // policies, f32 again beside the others so that ratios come from one run.
  for (const std::string policy : {"full", "streaming_llm", "h2o"}) {
    for (const std::string kv_type : {"f32", "f16", "bf16", "q8_0"}) {
      benchmark::RegisterBenchmark(("BM_DecodeStepKv/" + policy + "/" + kv_type).c_str(),
                                   BM_DecodeStep, policy, kv_type, std::string("uniform"),
                                   std::vector<std::string>{})
          ->ArgNames({"budget"})
          ->Args({4096})
          ->Unit(benchmark::kMicrosecond);
    }
  }
  // The key-scored policies deciding once per `interval` tokens (kvpress DecodingPress's
  // compression_steps; 10 is its default), at 1K and 4K: the step's stages amortised over them.
  for (const int budget : {1024, 4096}) {
    for (const std::string policy : {"knorm", "keydiff"}) {
      for (const int interval : {10, 64}) {
        benchmark::RegisterBenchmark(
            ("BM_DecodeStepInterval/" + policy + "/interval:" + std::to_string(interval)).c_str(),
            BM_DecodeStep, policy, std::string("f32"), std::string("uniform"),
            std::vector<std::string>{"interval=" + std::to_string(interval)})
            ->ArgNames({"budget"})
            ->Args({budget})
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  // The three allocations of one budget, per KV head, at 1K and 4K.
  for (const int budget : {1024, 4096}) {
    for (const auto& [label, policy, params] :
         {std::tuple<std::string, std::string, std::vector<std::string>>{"h2o", "h2o", {}},
          {"tova_head_wise", "tova", {"head_wise=1"}}}) {
      for (const std::string allocation : {"uniform", "pyramid", "adaptive"}) {
        benchmark::RegisterBenchmark(("BM_DecodeStepAlloc/" + label + "/" + allocation).c_str(),
                                     BM_DecodeStep, policy, std::string("f32"), allocation, params)
            ->ArgNames({"budget"})
            ->Args({budget})
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  benchmark::RegisterBenchmark("BM_AttentionVsRead", BM_AttentionVsRead)
      ->ArgNames({"budget"})
      ->Args({4096})
      ->Args({16384})
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) {
  register_benchmarks();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
