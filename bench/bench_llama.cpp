// What driving llama.cpp with kvevict costs (issue 11, docs/engines.md "Cost"), two modes:
//
// 1. Decode steps (default): for each budget N (--budgets, 1024 and 4096) and each policy of the
//    registry, single-token llama_decode steps of plain llama.cpp against the same steps through
//    kvevict::llama::LlamaSequence, in one process, one after the other:
//
//      build/release/bin/bench_llama --threads 1 --steps 64
//
//    - plain: a llama_context alone (no kvevict, no graph callback), filled with N - steps/2
//      tokens, then `steps` timed llama_decode calls of one token: it attends over N cells on
//      average. It runs first and again last for each budget, so that a drift of the machine's
//      load between the two shows.
//    - each policy, configured as `kvevict-llama stream --policy P --budget N` does (the harness's
//      policy setup: the --budget mapping, 4 sinks, chunk 64, its position mode, token
//      granularity, InfiniPot's general catalyst; TOVA under cache_index at token granularity),
//      filled with N + 128 tokens (every bounded policy has evicted; InfiniPot: filled so that
//      one catalyst falls within the timed steps), then `steps` timed LlamaSequence::forward
//      calls of one token.
//      `full` is filled like plain.
//    Per step: the wall time of the call, and the policy's time inside it from kvevict's
//    StageClock (policy + reposition: scoring, selection, handing over the attention rows,
//    llama_memory_seq_rm / seq_add; the reposition part alone in its own column, and the rest,
//    kvevict's own work, in another: the median of each step's policy minus reposition).
//    llama.cpp's decode is the rest of the step. Reported:
//    medians over the steps (the machine is shared: medians resist other jobs' bursts), the
//    policy's share of a step (median of the per-step ratios) and tokens/s against plain; and,
//    for costs that come once per several steps (a block's eviction under --granularity block:B,
//    and the K-shift it triggers in the next decode), the mean step and the amortised share
//    (policy time over step time, each summed over the steps).
//    InfiniPot's catalyst steps are reported apart (the catalyst's forward and distillation).
//    Flash attention (--fa off, the default, or on) is the same for every run, plain included:
//    one attention kernel for all keeps the steps comparable. With it on, the policies that read
//    attention get their rows computed by kvevict from each layer's flash-attention node (one
//    q.K pass for the queries they read), timed as the policy stage.
//
// 2. Memory over a long stream (--memory-tokens T): one policy (--memory-policy, budget
//    --memory-budget) streamed for T tokens in chunks of 64, printing at checkpoints the cells
//    the sequence holds, their K/V bytes and the process's resident memory (VmRSS, VmHWM):
//
//      build/release/bin/bench_llama --model models/toy-base --memory-tokens 100000
//          --memory-policy streaming_llm --memory-budget 1024   (one command line)
//
// 3. Many sequences (--sequences N1,N2,...): for each N and budget, N sequences of one context
//    decoded together, one token each per step (continuous batching's steady state): plain
//    llama.cpp (n_seq_max N, one unified cache, no kvevict) against a kvevict::llama::
//    LlamaSequenceSet with every sequence under the same policy (as in mode 1, chunks of 16 for
//    the fill):
//
//      build/release/bin/bench_llama --threads 1 --steps 64 --budgets 1024 --sequences 1,4,8,16
//
//    Each sequence is filled like mode 1's (plain: N - steps/2 tokens; a policy: budget + 128),
//    every sequence in the same steps. Reported per step (medians): wall time, tokens/s of all
//    sequences together and its ratio to plain, and kvevict's time (StageClock's policy +
//    reposition over all sequences: scoring, the rows gathered from cells to each sequence's
//    slots, selection, llama_memory_seq_rm / seq_add), its reposition part alone, and their
//    shares of the step (`own share`: without the reposition, i.e. kvevict's own work). With
//    --granularity block:B every policy run decides in blocks (those without a block form are
//    skipped), as docs/engines.md recommends for the re-numbering policies.
//
// 4. A pool under pressure (--pool-trace FILE): 16 sequences of one LlamaSequenceSet share a
//    KvPool that holds 4 of them at full length (4 x (budget + 4) cells, budget the first of
//    --budgets), under window, streaming_llm, h2o and tova in turn (cache_index positions).
//    Sequence i opens at step 8i; every open sequence is fed 1 to 4 tokens per step, for
//    --pool-steps steps. Writes every sequence's live cells after every step as CSV (step,
//    sequence, policy, live_cells, minimum, pool_cells) and prints whether any sequence failed,
//    was cut below its minimum, or the pool was exceeded (tools/plot_pool.py draws the CSV):
//
//      build/release/bin/bench_llama --budgets 128 --pool-trace pool.csv
//
// 5. The flash-attention row kernels alone (--kernels): kvevict's q.K pass and softmax
//    (src/llama/attention_kernels.cpp) on the rows TOVA reads in a decode step of the default
//    model, no llama.cpp: per layer (8) and KV head (2), the 4 query rows of its group against
//    every cell (gathered_scores, head_dim 64, f16 cells laid out as llama.cpp's K cache: a cell's
//    two heads side by side), then each row's softmax (scale 1/8, nothing masked). For each of
//    --budgets (the cells), with queries drawn N(0, 1) (logits within a few units) and N(0, 30^2)
//    (logits spread over about +-100: most probabilities under 2^-126, float's subnormals); the
//    fastest of 200 repetitions, as the pass would run on a quiet core:
//
//      build/release/bin/bench_llama --kernels --budgets 1024,4096
//
// Model (--model): a GGUF, or any model kvevict loads (written to a temporary GGUF by kvevict's
// writer). Default: the random Llama of bench_decode_step (dim 512, 8 layers, 8 query / 2 KV
// heads, hidden 1536, vocabulary 259, f32, seed 512). Tokens: bench_decode_step's stream (bytes
// from an LCG, the <AC> anchor every 16th token); SirLLM, RandomLLM and IntervalLLM get a turn
// every --turn-tokens steps (default 1: every step evicts, their worst case; a turn of N tokens
// makes room for them at its start, one decision per N tokens as block:N would be).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <llama.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <kvevict/detail/half.hpp>
#include <kvevict/error.hpp>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/llama/llama_sequence_set.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/timing.hpp>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "harness/policy_setup.hpp"
#include "llama/attention_kernels.hpp"
#include "llama/cli/llama_model.hpp"
#include "llama/cli/llama_options.hpp"
#include "model/model_io.hpp"

namespace {

namespace fs = std::filesystem;
using kvevict::Stage;
using kvevict::StageClock;
using Clock = std::chrono::steady_clock;

constexpr std::int32_t kAnchor = 258;  // <AC> in the byte-level tokenizer of a 259-id vocabulary
constexpr int kChunk = 64;

struct Options {
  std::string model;
  std::vector<int> budgets{1024, 4096};
  std::vector<std::string> policies;
  int steps = 64;
  int turn_tokens = 1;  // policies that evict before a turn: a turn starts every N steps
  int threads = 1;
  std::string positions;            // empty: each policy's own position mode
  std::string granularity;          // empty: token
  std::vector<std::string> params;  // KEY=VALUE, every policy run
  std::int64_t memory_tokens = 0;
  std::string memory_policy = "streaming_llm";
  int memory_budget = 1024;
  int memory_context = 0;               // 0: the budget plus a chunk and the catalyst
  std::string flash_attention = "off";  // on or off, every decode-step run
  std::vector<int> sequences;           // mode 3: sequences per context
  std::string pool_trace;               // mode 4: CSV of every sequence's cells per step
  int pool_steps = 400;
  bool kernels = false;  // mode 5: the flash-attention row kernels alone
};

llama_flash_attn_type flash_type(const std::string& flash) {
  if (flash == "on") return LLAMA_FLASH_ATTN_TYPE_ENABLED;
  if (flash == "off") return LLAMA_FLASH_ATTN_TYPE_DISABLED;
  throw kvevict::Error("--fa must be on or off, got '" + flash + "'");
}

// Token `index` of bench_decode_step's stream: a byte from an LCG, or the anchor every 16th.
std::int32_t stream_token(std::int64_t index) {
  if (index % 16 == 15) return kAnchor;
  const auto mixed =
      static_cast<std::uint64_t>(index) * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<std::int32_t>((mixed >> 33) % 256);
}

std::vector<std::int32_t> stream_tokens(std::int64_t first, std::int64_t count) {
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i)
    tokens[static_cast<std::size_t>(i)] = stream_token(first + i);
  return tokens;
}

// The GGUF llama.cpp loads: --model itself when it is one, else a temporary copy written by
// kvevict (removed at exit).
class ModelFile {
 public:
  explicit ModelFile(const std::string& requested) {
    if (!requested.empty() && requested.ends_with(".gguf")) {
      path_ = requested;
      return;
    }
    kvevict::model::Model model;
    if (requested.empty()) {
      kvevict::model::ModelConfig config;
      config.dim = 512;
      config.hidden_dim = 1536;
      config.layers = 8;
      config.heads = 8;
      config.kv_heads = 2;
      config.vocab_size = 259;
      config.context_length = 16384;
      model = kvevict::model::make_random_model(config, 512, kvevict::model::DType::f32);
    } else {
      model = kvevict::model::load_model(requested);
    }
    path_ = fs::temp_directory_path() / fmt::format("kvevict_bench_llama_{}.gguf", ::getpid());
    kvevict::model::write_gguf(model, path_);
    temporary_ = true;
  }
  ~ModelFile() {
    if (!temporary_) return;
    std::error_code ignored;
    fs::remove(path_, ignored);
  }
  ModelFile(const ModelFile&) = delete;
  ModelFile& operator=(const ModelFile&) = delete;
  [[nodiscard]] std::string path() const { return path_.string(); }

 private:
  fs::path path_;
  bool temporary_ = false;
};

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Resident memory of this process in bytes: VmRSS (now) and VmHWM (peak), from /proc.
std::pair<std::int64_t, std::int64_t> resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  std::int64_t rss = 0;
  std::int64_t peak = 0;
  while (std::getline(status, line)) {
    std::istringstream fields(line);
    std::string key;
    std::int64_t kib = 0;
    fields >> key >> kib;
    if (key == "VmRSS:") rss = kib * 1024;
    if (key == "VmHWM:") peak = kib * 1024;
  }
  return {rss, peak};
}

struct Row {
  std::string name;
  int live = 0;            // cells held after the steps
  double step = 0;         // median step, seconds
  double policy = 0;       // median policy time per step, seconds
  double reposition = 0;   // median of its reposition part (slot metadata, seq_rm / seq_add)
  double own = 0;          // median of policy minus reposition per step: kvevict's own work
  double share = 0;        // median of policy / step over the steps
  double own_share = 0;    // median of own / step over the steps
  double mean_step = 0;    // mean step, seconds: periodic costs (a block's eviction) included
  double amortised = 0;    // policy time over step time, summed over the steps
  int catalyst_steps = 0;  // InfiniPot: steps that ran the catalyst (not in the medians)
  double catalyst_step = 0;
};

double mean(const std::vector<double>& values) {
  double sum = 0;
  for (const double value : values) sum += value;
  return values.empty() ? 0.0 : sum / static_cast<double>(values.size());
}

llama_context_params context_params(int n_ctx, int threads, const std::string& flash) {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = static_cast<std::uint32_t>(n_ctx);
  params.n_batch = kChunk;
  params.n_ubatch = kChunk;
  params.n_threads = threads;
  params.n_threads_batch = threads;
  params.n_seq_max = 1;
  params.no_perf = true;
  params.flash_attn_type = flash_type(flash);
  return params;
}

// Plain llama.cpp: N - steps/2 tokens, then `steps` single-token decodes.
Row run_plain(llama_model* model, int budget, const Options& options) {
  llama_context* context = llama_init_from_model(
      model,
      context_params(budget + options.steps + kChunk, options.threads, options.flash_attention));
  KVEVICT_REQUIRE(context != nullptr, "llama_init_from_model failed");
  llama_batch batch = llama_batch_init(kChunk, 0, 1);
  std::int64_t position = 0;
  const auto decode = [&](std::span<const std::int32_t> tokens) {
    batch.n_tokens = static_cast<std::int32_t>(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      batch.token[i] = tokens[i];
      batch.pos[i] = static_cast<llama_pos>(position++);
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = 0;
      batch.logits[i] = static_cast<std::int8_t>(i + 1 == tokens.size());
    }
    KVEVICT_REQUIRE(llama_decode(context, batch) == 0, "llama_decode failed");
  };
  const std::int64_t fill = budget - options.steps / 2;
  for (std::int64_t offset = 0; offset < fill; offset += kChunk) {
    decode(stream_tokens(offset, std::min<std::int64_t>(kChunk, fill - offset)));
  }
  std::vector<double> steps;
  for (int s = 0; s < options.steps; ++s) {
    const std::int32_t token = stream_token(position);
    const Clock::time_point start = Clock::now();
    decode(std::span<const std::int32_t>(&token, 1));
    (void)llama_get_logits_ith(context, -1);
    steps.push_back(seconds_since(start));
  }
  Row row;
  row.name = "plain llama.cpp";
  row.live = static_cast<int>(llama_memory_seq_pos_max(llama_get_memory(context), 0) + 1);
  row.step = median(steps);
  row.mean_step = mean(steps);
  llama_batch_free(batch);
  llama_free(context);
  return row;
}

kvevict::harness::PolicySetup setup_for(const std::string& policy, int budget, const Options& bench,
                                        const kvevict::llama_cli::LlamaModel& model) {
  kvevict::harness::PolicyOptions options;  // chunk 64, keys post_rope, 4 sinks: the CLI's defaults
  options.policy = policy;
  options.kv_type = "f16";  // llama.cpp's default cells, as plain's context
  if (policy != "full") options.budget = budget;
  options.positions = bench.positions;
  options.granularity = bench.granularity;
  options.params = bench.params;
  // TOVA can evict the newest token, which llama.cpp cannot represent under `original`
  // (docs/engines.md, limits): it runs under cache_index, as in test_llama. In blocks it cannot
  // (the newest block is kept whole), so there it keeps its original positions.
  if (policy == "tova" && bench.positions.empty() && !bench.granularity.starts_with("block")) {
    options.positions = "cache_index";
  }
  return kvevict::llama_cli::make_setup(options, model);
}

std::unique_ptr<kvevict::llama::LlamaSequence> open_sequence(
    const kvevict::llama_cli::LlamaModel& model, kvevict::harness::PolicySetup& setup, int n_ctx,
    int threads, const std::string& flash, StageClock& clock) {
  kvevict::llama_cli::LlamaOptions llama;
  llama.threads = threads;
  llama.context = n_ctx;
  llama.flash_attention = flash;
  return kvevict::llama_cli::make_llama_sequence(model, llama, setup, &clock);
}

double eviction_seconds(const StageClock& clock) {
  return clock.seconds(Stage::policy) + clock.seconds(Stage::reposition);
}

Row run_policy(const kvevict::llama_cli::LlamaModel& model, const std::string& policy, int budget,
               const Options& options) {
  kvevict::harness::PolicySetup setup = setup_for(policy, budget, options, model);
  const int catalyst = setup.catalyst ? static_cast<int>(setup.catalyst->size()) : 0;
  StageClock clock;
  const std::unique_ptr<kvevict::llama::LlamaSequence> sequence =
      open_sequence(model, setup, budget + options.steps + kChunk + catalyst, options.threads,
                    options.flash_attention, clock);
  const kvevict::Sequence& kv = sequence->sequence();
  const bool turns = kv.policy().triggers().contains(kvevict::Trigger::before_turn);

  std::int64_t next = 0;
  const auto feed = [&](std::int64_t count) {
    const std::vector<std::int32_t> tokens = stream_tokens(next, count);
    (void)sequence->feed(tokens, turns);
    next += count;
  };
  if (policy == "full") {
    feed(budget - options.steps / 2);
  } else if (kv.pot_room()) {
    // InfiniPot: stop the fill half the timed steps before the pot is full.
    while (*kv.pot_room() > options.steps / 2) {
      feed(std::min(kChunk, *kv.pot_room() - options.steps / 2));
    }
  } else {
    for (std::int64_t filled = 0; filled < budget + 128; filled += kChunk) feed(kChunk);
  }

  std::vector<double> steps;
  std::vector<double> policy_times;
  std::vector<double> reposition_times;
  std::vector<double> own_times;
  std::vector<double> shares;
  std::vector<double> own_shares;
  Row row;
  row.name = fmt::format(
      "{} ({}{}){}", policy, kvevict::to_string(kv.position_mode()),
      kv.granularity() == kvevict::Granularity::token ? ""
                                                      : ", " + kvevict::to_string(kv.granularity()),
      options.params.empty() ? "" : fmt::format(" {}", fmt::join(options.params, " ")));
  for (int s = 0; s < options.steps; ++s) {
    const std::int32_t token = stream_token(next++);
    const double policy_before = eviction_seconds(clock);
    const double reposition_before = clock.seconds(Stage::reposition);
    const std::int64_t catalysts_before = sequence->stats().catalyst_runs;
    const Clock::time_point start = Clock::now();
    (void)sequence->forward(std::span<const std::int32_t>(&token, 1),
                            turns && s % options.turn_tokens == 0);
    const double step = seconds_since(start);
    if (sequence->stats().catalyst_runs != catalysts_before) {
      ++row.catalyst_steps;
      row.catalyst_step += step;
      continue;
    }
    const double in_policy = eviction_seconds(clock) - policy_before;
    const double in_reposition = clock.seconds(Stage::reposition) - reposition_before;
    steps.push_back(step);
    policy_times.push_back(in_policy);
    reposition_times.push_back(in_reposition);
    // Per step, not a difference of medians: the reposition time of a cache_index policy depends
    // on where the evicted token was (seq_add moves every newer cell), so its distribution is
    // not the policy total's shifted.
    own_times.push_back(in_policy - in_reposition);
    shares.push_back(in_policy / step);
    own_shares.push_back((in_policy - in_reposition) / step);
  }
  row.live = sequence->live_cells();
  row.step = median(steps);
  row.policy = median(policy_times);
  row.reposition = median(reposition_times);
  row.own = median(own_times);
  row.share = median(shares);
  row.own_share = median(own_shares);
  row.mean_step = mean(steps);
  row.amortised = mean(policy_times) / row.mean_step;
  if (row.catalyst_steps > 0) row.catalyst_step /= row.catalyst_steps;
  return row;
}

void print_rows(int budget, const std::vector<Row>& rows, double plain_step) {
  std::cout << fmt::format("\n## budget {}\n\n", budget);
  std::cout << "| run | live cells | step ms | tokens/s | vs plain | policy µs/step | of which "
               "reposition | kvevict's own µs/step | policy share | own share | catalyst step ms | "
               "mean step ms | amortised share |\n"
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Row& row : rows) {
    const std::string catalyst =
        row.catalyst_steps > 0
            ? fmt::format("{:.2f} ({} step)", row.catalyst_step * 1e3, row.catalyst_steps)
            : std::string("-");
    std::cout << fmt::format(
        "| {} | {} | {:.3f} | {:.1f} | {:.3f} | {:.1f} | {:.1f} | {:.1f} | {:.2f}% | {:.2f}% | {} "
        "| "
        "{:.3f} | {:.2f}% |\n",
        row.name, row.live, row.step * 1e3, 1.0 / row.step, plain_step / row.step, row.policy * 1e6,
        row.reposition * 1e6, row.own * 1e6, row.share * 100.0, row.own_share * 100.0, catalyst,
        row.mean_step * 1e3, row.amortised * 100.0);
  }
}

void run_steps(const kvevict::llama_cli::LlamaModel& model, const Options& options) {
  std::vector<std::string> policies = options.policies;
  if (policies.empty()) {
    for (const std::string_view name : kvevict::policy_names()) policies.emplace_back(name);
  }
  for (const int budget : options.budgets) {
    std::vector<Row> rows;
    rows.push_back(run_plain(model.get(), budget, options));
    for (const std::string& policy : policies) {
      try {
        rows.push_back(run_policy(model, policy, budget, options));
      } catch (const kvevict::Error& error) {
        std::cerr << fmt::format("budget {} {}: {}\n", budget, policy, error.what());
        continue;
      }
      std::cerr << fmt::format("budget {} {}: done\n", budget, policy);
    }
    Row last = run_plain(model.get(), budget, options);
    last.name = "plain llama.cpp (again)";
    rows.push_back(last);
    print_rows(budget, rows, (rows.front().step + last.step) / 2);
  }
}

void run_memory(const kvevict::llama_cli::LlamaModel& model, const Options& options) {
  kvevict::harness::PolicySetup setup =
      setup_for(options.memory_policy, options.memory_budget, options, model);
  const int catalyst = setup.catalyst ? static_cast<int>(setup.catalyst->size()) : 0;
  const int n_ctx = options.memory_context > 0 ? options.memory_context
                                               : options.memory_budget + kChunk + catalyst;
  StageClock clock;
  const std::unique_ptr<kvevict::llama::LlamaSequence> sequence =
      open_sequence(model, setup, n_ctx, options.threads, options.flash_attention, clock);
  const bool turns =
      sequence->sequence().policy().triggers().contains(kvevict::Trigger::before_turn);
  const std::int64_t rss_before = resident_bytes().first;
  const auto cells = static_cast<int>(llama_n_ctx(sequence->context()));  // rounded up by llama.cpp
  std::cout << fmt::format(
      "policy {} budget {}, context {} cells ({:.2f} MiB of K/V allocated), {} bytes per cell; "
      "resident before streaming {:.1f} MiB\n\n",
      options.memory_policy, options.memory_budget, cells,
      static_cast<double>(cells) * static_cast<double>(sequence->bytes_per_cell()) / 1048576.0,
      sequence->bytes_per_cell(), static_cast<double>(rss_before) / 1048576.0);
  std::cout << "| tokens streamed | live cells | peak cells | live K/V MiB | VmRSS MiB | VmHWM MiB "
               "| tokens/s |\n|---:|---:|---:|---:|---:|---:|---:|\n";
  std::int64_t next = 0;
  std::int64_t checkpoint = 1000;
  const Clock::time_point start = Clock::now();
  while (next < options.memory_tokens) {
    const std::int64_t count = std::min<std::int64_t>(kChunk, options.memory_tokens - next);
    (void)sequence->feed(stream_tokens(next, count), turns);
    next += count;
    if (next >= checkpoint || next == options.memory_tokens) {
      const auto [rss, peak] = resident_bytes();
      std::cout << fmt::format("| {} | {} | {} | {:.2f} | {:.1f} | {:.1f} | {:.0f} |\n", next,
                               sequence->live_cells(), sequence->stats().peak_cells,
                               static_cast<double>(sequence->live_cells()) *
                                   static_cast<double>(sequence->bytes_per_cell()) / 1048576.0,
                               static_cast<double>(rss) / 1048576.0,
                               static_cast<double>(peak) / 1048576.0,
                               static_cast<double>(next) / seconds_since(start));
      while (checkpoint <= next) checkpoint = checkpoint < 10000 ? checkpoint * 10 : checkpoint * 2;
    }
  }
}

constexpr int kBatchChunk = 16;  // mode 3's fill chunk per sequence

struct BatchRow {
  std::string name;
  double step = 0;        // median step, seconds
  double policy = 0;      // median kvevict time per step (policy + reposition), seconds
  double reposition = 0;  // median of its reposition part (llama_memory_seq_rm / seq_add)
  double share = 0;       // median of policy / step
  double own_share = 0;   // median of (policy - reposition) / step: kvevict's own work
  int cells = 0;          // cells held by all sequences after the steps
};

// Plain llama.cpp: `n` sequences of one unified cache, each filled with budget - steps/2 tokens,
// then `steps` decodes of one token per sequence.
BatchRow run_plain_batch(llama_model* model, int n, int budget, const Options& options) {
  llama_context_params params = context_params(n * (budget + options.steps + kBatchChunk),
                                               options.threads, options.flash_attention);
  params.n_seq_max = static_cast<std::uint32_t>(n);
  params.kv_unified = true;
  params.n_batch = params.n_ubatch = static_cast<std::uint32_t>(n * kBatchChunk);
  llama_context* context = llama_init_from_model(model, params);
  KVEVICT_REQUIRE(context != nullptr, "llama_init_from_model failed");
  llama_batch batch = llama_batch_init(n * kBatchChunk, 0, 1);
  std::vector<std::int64_t> next(static_cast<std::size_t>(n), 0);
  // Every sequence `count` tokens of its own stream in one decode.
  const auto decode = [&](int count) {
    batch.n_tokens = 0;
    for (int s = 0; s < n; ++s) {
      std::int64_t& position = next[static_cast<std::size_t>(s)];
      for (int i = 0; i < count; ++i) {
        const int k = batch.n_tokens++;
        batch.token[k] = stream_token(std::int64_t{s} * 1000003 + position);
        batch.pos[k] = static_cast<llama_pos>(position++);
        batch.n_seq_id[k] = 1;
        batch.seq_id[k][0] = s;
        batch.logits[k] = static_cast<std::int8_t>(i + 1 == count);
      }
    }
    KVEVICT_REQUIRE(llama_decode(context, batch) == 0, "llama_decode failed");
  };
  for (int filled = 0; filled < budget - options.steps / 2; filled += kBatchChunk) {
    decode(std::min(kBatchChunk, budget - options.steps / 2 - filled));
  }
  std::vector<double> steps;
  for (int s = 0; s < options.steps; ++s) {
    const Clock::time_point start = Clock::now();
    decode(1);
    (void)llama_get_logits_ith(context, -1);
    steps.push_back(seconds_since(start));
  }
  BatchRow row;
  row.name = "plain llama.cpp";
  row.step = median(steps);
  for (int s = 0; s < n; ++s) {
    row.cells += static_cast<int>(llama_memory_seq_pos_max(llama_get_memory(context), s) + 1);
  }
  llama_batch_free(batch);
  llama_free(context);
  return row;
}

// The same through a LlamaSequenceSet, every sequence under `policy` at `budget`.
BatchRow run_policy_batch(const kvevict::llama_cli::LlamaModel& model, const std::string& policy,
                          int n, int budget, const Options& options) {
  StageClock clock;
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = n;
  set_options.max_chunk = kBatchChunk;
  llama_context_params params =
      context_params(n * (budget + 2 * kBatchChunk), options.threads, options.flash_attention);
  kvevict::llama::LlamaSequenceSet set(model.get(), params, set_options);
  bool turns = false;
  for (int s = 0; s < n; ++s) {
    kvevict::harness::PolicySetup setup = setup_for(policy, budget, options, model);
    KVEVICT_REQUIRE(!setup.catalyst, "--sequences: " + policy +
                                         " runs a catalyst prompt, which this mode does not time");
    kvevict::llama::LlamaSequenceOptions sequence;
    sequence.position_mode = setup.decoder_options.position_mode;
    sequence.granularity = setup.decoder_options.granularity;
    sequence.max_chunk = kBatchChunk;
    sequence.observer = &clock;
    turns = setup.policy->triggers().contains(kvevict::Trigger::before_turn);
    KVEVICT_REQUIRE(set.open(std::move(setup.policy), sequence) == s, "unexpected sequence id");
  }
  std::vector<std::int64_t> next(static_cast<std::size_t>(n), 0);
  std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(n));
  std::vector<kvevict::llama::LlamaFeed> feeds(static_cast<std::size_t>(n));
  const auto step = [&](int count) {
    for (int s = 0; s < n; ++s) {
      const auto i = static_cast<std::size_t>(s);
      tokens[i] = stream_tokens(std::int64_t{s} * 1000003 + next[i], count);
      next[i] += count;
      feeds[i] = {s, tokens[i], turns, false};
    }
    set.step(feeds);
    for (int s = 0; s < n; ++s) {
      if (const std::optional<std::string>& failure = set.failed(s)) throw kvevict::Error(*failure);
    }
  };
  for (int filled = 0; filled < budget + 128; filled += kBatchChunk) step(kBatchChunk);
  std::vector<double> steps;
  std::vector<double> policy_times;
  std::vector<double> repositions;
  std::vector<double> shares;
  std::vector<double> own_shares;
  for (int s = 0; s < options.steps; ++s) {
    const double before = eviction_seconds(clock);
    const double reposition_before = clock.seconds(Stage::reposition);
    const Clock::time_point start = Clock::now();
    step(1);
    steps.push_back(seconds_since(start));
    policy_times.push_back(eviction_seconds(clock) - before);
    repositions.push_back(clock.seconds(Stage::reposition) - reposition_before);
    shares.push_back(policy_times.back() / steps.back());
    own_shares.push_back((policy_times.back() - repositions.back()) / steps.back());
  }
  BatchRow row;
  row.name = policy + (options.granularity.empty() ? "" : " " + options.granularity);
  row.step = median(steps);
  row.policy = median(policy_times);
  row.reposition = median(repositions);
  row.share = median(shares);
  row.own_share = median(own_shares);
  for (int s = 0; s < n; ++s) row.cells += set.live_cells(s);
  return row;
}

void run_sequences(const kvevict::llama_cli::LlamaModel& model, const Options& options) {
  std::vector<std::string> policies = options.policies;
  if (policies.empty()) policies = {"window", "streaming_llm", "h2o", "tova", "sirllm"};
  for (const int budget : options.budgets) {
    std::cout << fmt::format(
        "\n### budget {} per sequence, one token per sequence per step\n\n"
        "| sequences | run | cells | step ms | tokens/s | vs plain | kvevict µs/step | of which "
        "reposition | kvevict share | own share "
        "|\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
        "\n",
        budget);
    for (const int n : options.sequences) {
      const BatchRow plain = run_plain_batch(model.get(), n, budget, options);
      const auto print = [&](const BatchRow& row) {
        std::cout << fmt::format(
            "| {} | {} | {} | {:.3f} | {:.0f} | {:.2f} | {:.1f} | {:.1f} | {:.2f}% | {:.2f}% |\n",
            n, row.name, row.cells, row.step * 1e3, n / row.step, plain.step / row.step,
            row.policy * 1e6, row.reposition * 1e6, row.share * 100, row.own_share * 100);
      };
      print(plain);
      for (const std::string& policy : policies) {
        try {
          print(run_policy_batch(model, policy, n, budget, options));
        } catch (const kvevict::Error& error) {
          std::cerr << fmt::format("{} sequences, budget {}, {}: {}\n", n, budget, policy,
                                   error.what());
        }
      }
      BatchRow again = run_plain_batch(model.get(), n, budget, options);
      again.name = "plain llama.cpp (again)";
      print(again);
    }
  }
}

void run_pool_trace(const kvevict::llama_cli::LlamaModel& model, const Options& options) {
  constexpr int kSequences = 16;
  constexpr int kChunk = 4;
  const int budget = options.budgets.front();
  const std::int64_t pool = 4 * (std::int64_t{budget} + kChunk);
  kvevict::llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = kSequences;
  set_options.max_chunk = kChunk;
  set_options.pool_cells = pool;
  kvevict::llama::LlamaSequenceSet set(
      model.get(),
      context_params(static_cast<int>(pool) + kChunk, options.threads, options.flash_attention),
      set_options);
  const char* const policies[] = {"window", "streaming_llm", "h2o", "tova"};
  std::ofstream csv(options.pool_trace);
  KVEVICT_REQUIRE(csv.good(), "cannot write " + options.pool_trace);
  csv << "step,sequence,policy,live_cells,minimum,pool_cells\n";
  std::vector<int> ids(kSequences, -1);
  std::vector<std::int64_t> fed(kSequences, 0);
  std::vector<std::vector<std::int32_t>> tokens(kSequences);
  std::vector<kvevict::llama::LlamaFeed> feeds;
  int failures = 0;
  int below_minimum = 0;
  std::int64_t peak = 0;
  const Clock::time_point start = Clock::now();
  for (int step = 0; step < options.pool_steps; ++step) {
    feeds.clear();
    for (int i = 0; i < kSequences; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (step < 8 * i) continue;
      if (ids[k] < 0) {
        kvevict::harness::PolicyOptions policy_options;
        policy_options.policy = policies[i % 4];
        policy_options.kv_type = "f16";
        policy_options.budget = budget;
        policy_options.positions = "cache_index";
        policy_options.chunk = kChunk;
        kvevict::harness::PolicySetup setup = kvevict::llama_cli::make_setup(policy_options, model);
        kvevict::llama::LlamaSequenceOptions sequence;
        sequence.position_mode = setup.decoder_options.position_mode;
        sequence.max_chunk = kChunk;
        ids[k] = set.open(std::move(setup.policy), sequence);
      }
      const int n = 1 + (step * 7 + i * 3) % kChunk;
      tokens[k] = stream_tokens(std::int64_t{i} * 1000003 + fed[k], n);
      fed[k] += n;
      feeds.push_back({ids[k], tokens[k]});
    }
    set.step(feeds);
    std::int64_t held = 0;
    for (int i = 0; i < kSequences; ++i) {
      const int id = ids[static_cast<std::size_t>(i)];
      if (id < 0) continue;
      failures += set.failed(id) ? 1 : 0;
      const int live = set.live_cells(id);
      const std::int64_t minimum = set.pool()->minimum(id);
      below_minimum += live < std::min<std::int64_t>(minimum, fed[static_cast<std::size_t>(i)]);
      held += live;
      csv << fmt::format("{},{},{},{},{},{}\n", step, i, policies[i % 4], live, minimum, pool);
    }
    peak = std::max(peak, held);
  }
  const kvevict::PoolStats& stats = set.pool()->stats();
  std::cout << fmt::format(
      "{} sequences, budget {}, pool {} cells (4 at full length), {} steps in {:.1f} s: {} failed "
      "steps, {} cuts below a minimum; cells held plus fed at most {} (pool {}), held after a "
      "step at most {}; {} steps pressed, {} cuts; CSV in {}\n",
      kSequences, budget, pool, options.pool_steps, seconds_since(start), failures, below_minimum,
      stats.peak_cells, pool, peak, stats.pressed_steps, stats.cuts, options.pool_trace);
  KVEVICT_REQUIRE(failures == 0 && below_minimum == 0 && stats.peak_cells <= pool,
                  "the pool's rule was broken (see above)");
}

}  // namespace

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string line;
  std::getline(in, line);
  return line;
}

// Mode 5 (header comment): the flash-attention row kernels on TOVA's rows of a decode step.
void run_kernels(const Options& options) {
  namespace kernels = kvevict::llama::kernels;
  constexpr int kLayers = 8;
  constexpr int kKvHeads = 2;
  constexpr int kGroup = 4;  // query heads per KV head: TOVA's rows of one KV head
  constexpr int kDim = 64;
  constexpr int kRepetitions = 200;
  constexpr float kScale = 0.125f;  // 1 / sqrt(head_dim)
  using Clock = std::chrono::steady_clock;
  std::cout << "\n| cells | queries | q.K µs/step | G multiply-adds/s | softmax µs/step |\n"
               "|---:|---|---:|---:|---:|\n";
  for (const int cells : options.budgets) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto layer_values = static_cast<std::size_t>(cells) * kKvHeads * kDim;
    std::vector<std::vector<std::uint16_t>> keys(kLayers, std::vector<std::uint16_t>(layer_values));
    for (auto& layer : keys) {
      for (std::uint16_t& value : layer) value = kvevict::detail::float_to_f16(normal(rng));
    }
    std::vector<std::int32_t> index(static_cast<std::size_t>(cells));
    std::iota(index.begin(), index.end(), 0);
    const std::vector<float> bias(static_cast<std::size_t>(cells), 0.0f);
    std::vector<float> rows(static_cast<std::size_t>(kGroup) * cells);
    for (const float spread : {1.0f, 30.0f}) {
      // q rounded to f16, as against f16 cells.
      std::vector<float> queries(static_cast<std::size_t>(kLayers) * kKvHeads * kGroup * kDim);
      for (float& value : queries) {
        value = kvevict::detail::f16_to_float(kvevict::detail::float_to_f16(spread * normal(rng)));
      }
      double best_scores = std::numeric_limits<double>::infinity();
      double best_softmax = best_scores;
      for (int repetition = 0; repetition < kRepetitions; ++repetition) {
        double scores = 0.0;
        double softmax = 0.0;
        for (int layer = 0; layer < kLayers; ++layer) {
          for (int head = 0; head < kKvHeads; ++head) {
            const kernels::CellRows cell_rows{
                kernels::CellType::f16,
                reinterpret_cast<const std::uint8_t*>(keys[static_cast<std::size_t>(layer)].data() +
                                                      static_cast<std::size_t>(head) * kDim),
                static_cast<std::size_t>(kKvHeads) * kDim * 2};
            const float* q =
                queries.data() + static_cast<std::size_t>(layer * kKvHeads + head) * kGroup * kDim;
            const auto start = Clock::now();
            kernels::gathered_scores(q, kDim, kGroup, cell_rows, index.data(), cells, kDim,
                                     rows.data(), cells);
            const auto scored = Clock::now();
            for (int r = 0; r < kGroup; ++r) {
              kernels::softmax_row(rows.data() + static_cast<std::size_t>(r) * cells, bias.data(),
                                   kScale, cells);
            }
            const auto done = Clock::now();
            scores += std::chrono::duration<double>(scored - start).count();
            softmax += std::chrono::duration<double>(done - scored).count();
          }
        }
        best_scores = std::min(best_scores, scores);
        best_softmax = std::min(best_softmax, softmax);
      }
      const double multiply_adds = static_cast<double>(kLayers) * kKvHeads * kGroup * cells * kDim;
      std::cout << fmt::format("| {} | {} | {:.1f} | {:.1f} | {:.1f} |\n", cells,
                               spread == 1.0f ? "N(0, 1)" : "N(0, 30^2)", 1e6 * best_scores,
                               multiply_adds / best_scores / 1e9, 1e6 * best_softmax);
    }
  }
}

int main(int argc, char** argv) {
  Options options;
  CLI::App app("kvevict over llama.cpp: decode-step cost per policy, memory over a long stream");
  app.add_option("--model", options.model,
                 "a GGUF, or a model kvevict loads (default: bench_decode_step's random Llama)");
  app.add_option("--budgets", options.budgets, "budgets of the decode-step runs")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--policies", options.policies, "policies (default: every registry policy)")
      ->delimiter(',');
  app.add_option("--positions", options.positions,
                 "position mode of every policy run (default: each policy's own; TOVA's is "
                 "cache_index here at token granularity)");
  app.add_option("--granularity", options.granularity,
                 "token (default) or block:B for every policy run (policies without a block form "
                 "are reported as errors and skipped)");
  app.add_option("--param", options.params,
                 "policy parameter KEY=VALUE for every policy run, repeatable (e.g. interval=64 "
                 "for knorm and keydiff); a policy without it is reported as an error and skipped");
  app.add_option("--steps", options.steps, "timed single-token steps per run")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  app.add_option("--turn-tokens", options.turn_tokens,
                 "policies that evict before each turn (sirllm, random_llm, interval_llm): a turn "
                 "starts every N timed steps")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--fa,--flash-attn", options.flash_attention,
                 "flash attention of every decode-step run, plain included: on or off")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("-t,--threads", options.threads, "llama.cpp threads")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--memory-tokens", options.memory_tokens,
                 "memory mode: stream this many tokens through --memory-policy")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  app.add_option("--memory-policy", options.memory_policy)->capture_default_str();
  app.add_option("--memory-budget", options.memory_budget)
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--memory-context", options.memory_context,
                 "cells of the context (default: budget + 64 + catalyst)")
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("--sequences", options.sequences,
                 "many-sequences mode: sequences per context, e.g. 1,4,8,16 (one token each per "
                 "step)")
      ->delimiter(',')
      ->check(CLI::Range(1, 256));
  app.add_option("--pool-trace", options.pool_trace,
                 "pool mode: 16 sequences in a pool for 4, every sequence's cells per step to "
                 "this CSV");
  app.add_option("--pool-steps", options.pool_steps)
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_flag("--kernels", options.kernels,
               "the flash-attention row kernels alone, on TOVA's rows (cells: --budgets)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (options.kernels) {
      std::cout << fmt::format("kvevict's flash-attention row kernels, load average {}\n",
                               load_average());
      run_kernels(options);
      std::cout << "\nload average at the end: " << load_average() << '\n';
      return 0;
    }
    kvevict::llama_cli::quiet_llama_log();
    llama_backend_init();
    const ModelFile file(options.model);
    const kvevict::llama_cli::LlamaModel model(file.path(), 0);
    const double load = [] {
      std::ifstream in("/proc/loadavg");
      double value = 0;
      in >> value;
      return value;
    }();
    std::cout << fmt::format(
        "model {}, {} thread(s), flash attention {}, load average {:.2f} at start\n",
        options.model.empty() ? "bench_decode_step's random Llama" : options.model, options.threads,
        options.flash_attention, load);
    if (options.memory_tokens > 0) {
      run_memory(model, options);
    } else if (!options.pool_trace.empty()) {
      run_pool_trace(model, options);
    } else if (!options.sequences.empty()) {
      run_sequences(model, options);
    } else {
      run_steps(model, options);
    }
    std::ifstream in("/proc/loadavg");
    std::string end_load;
    std::getline(in, end_load);
    std::cout << "\nload average at the end: " << end_load << '\n';
    llama_backend_free();
  } catch (const std::exception& error) {
    std::cerr << "bench_llama: " << error.what() << '\n';
    return 2;
  }
  return 0;
}
