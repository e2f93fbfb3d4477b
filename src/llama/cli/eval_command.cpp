// `kvevict-llama eval CONFIG --model FILE.gguf`: `kvevict eval`'s grid harness (src/eval) over
// llama.cpp. The engine seam of the harness (eval/engine.hpp) implemented over LlamaSequence:
// the same documents, chunks, turns, scoring and outputs as `kvevict eval`; results record the
// engine and each cell's granularity (token unless the entry says otherwise: llama.cpp's cells
// are shared by every layer and head).
#include <ggml.h>

#include <chrono>
#include <iostream>
#include <kvevict/error.hpp>
#include <memory>
#include <string>
#include <utility>

#include "cli/options.hpp"
#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "harness/policy_setup.hpp"
#include "llama/cli/commands.hpp"
#include "llama/cli/llama_options.hpp"

namespace kvevict::llama_cli {
namespace {

using Clock = std::chrono::steady_clock;

class LlamaEvalSequence final : public eval::EvalSequence {
 public:
  LlamaEvalSequence(std::unique_ptr<llama::LlamaSequence> sequence, harness::PolicySetup& setup,
                    const StageClock& clock)
      : sequence_(std::move(sequence)), clock_(clock) {
    // What policy_json records; the policy itself now belongs to the sequence.
    setup_.name = setup.name;
    setup_.params = setup.params;
    setup_.catalyst = setup.catalyst;
    setup_.decoder_options.kv_type = setup.decoder_options.kv_type;
  }

  eval::FeedLogits feed(std::span<const std::int32_t> tokens, bool turn_start,
                        bool all_logits) override {
    const Clock::time_point start = Clock::now();
    const llama::LlamaLogits logits = sequence_->feed(tokens, turn_start, all_logits);
    feed_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
    return {logits.values, logits.vocab};
  }

  [[nodiscard]] eval::SequenceCounters counters() const override {
    const harness::CacheReport report = cache_report(*sequence_, setup_.name, 0, clock_);
    eval::SequenceCounters counters;
    counters.tokens_fed = report.tokens;
    counters.forwards = sequence_->stats().forwards;
    counters.catalyst_runs = report.catalyst_runs;
    counters.live_kv_bytes = report.live_kv_bytes;
    counters.peak_kv_bytes = report.peak_kv_bytes;
    counters.evicted_slots = report.evicted_slots;
    counters.decisions = report.decisions;
    // llama_decode is not split into stages; the eviction stages run inside feed().
    counters.eviction_seconds = report.eviction_seconds;
    counters.forward_seconds = feed_seconds_ - report.eviction_seconds;
    for (const Stage stage : {Stage::policy, Stage::reposition, Stage::catalyst}) {
      counters.stage_seconds.emplace_back(std::string(to_string(stage)) + "_seconds",
                                          clock_.seconds(stage));
    }
    return counters;
  }

  [[nodiscard]] nlohmann::ordered_json policy_json() const override {
    return llama_cli::policy_json(setup_, *sequence_);
  }

 private:
  std::unique_ptr<llama::LlamaSequence> sequence_;
  const StageClock& clock_;
  harness::PolicySetup setup_;
  double feed_seconds_ = 0;
};

class LlamaEvalEngine final : public eval::EvalEngine {
 public:
  LlamaEvalEngine(const std::string& path, LlamaOptions options)
      : model_(path, options.gpu_layers), options_(std::move(options)) {}

  [[nodiscard]] std::string name() const override {
    return std::string("llama.cpp ggml ") + ggml_version() + " commit " + ggml_commit();
  }
  [[nodiscard]] nlohmann::ordered_json model_json() const override {
    return {{"format", "gguf"}, {"context_length", llama_model_n_ctx_train(model_.get())}};
  }

  [[nodiscard]] const model::Tokenizer* kvevict_tokenizer() const override {
    return model_.kvevict_tokenizer();
  }
  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text,
                                                 bool add_bos) const override {
    return model_.encode(text, add_bos);
  }
  [[nodiscard]] std::string decode(std::int32_t id) const override { return model_.decode(id); }
  [[nodiscard]] std::int32_t bos_id() const override { return model_.bos_id(); }
  [[nodiscard]] std::int32_t eos_id() const override { return model_.eos_id(); }
  [[nodiscard]] std::vector<std::uint32_t> token_bytes() const override {
    return model_.token_bytes();
  }

  [[nodiscard]] harness::PolicySetup make_setup(
      const harness::PolicyOptions& options) const override {
    return llama_cli::make_setup(options, model_);
  }
  // The sequence the cell would build, built and dropped: LlamaSequence's own checks
  // (granularity, V cells and flash attention, position shifts, budget plus a chunk within
  // -c), once.
  [[nodiscard]] std::optional<std::int64_t> check(harness::PolicySetup& setup) const override {
    const std::unique_ptr<llama::LlamaSequence> sequence =
        make_llama_sequence(model_, options_, setup, nullptr);
    return llama_n_ctx(sequence->context());  // -c as llama.cpp rounds it
  }
  [[nodiscard]] std::unique_ptr<eval::EvalSequence> start(harness::PolicySetup& setup, int threads,
                                                          StageClock& clock) const override {
    std::unique_ptr<llama::LlamaSequence> sequence =
        make_llama_sequence(model_, with_threads(threads), setup, &clock);
    return std::make_unique<LlamaEvalSequence>(std::move(sequence), setup, clock);
  }

 private:
  // The entry's kv_type sets llama.cpp's cells through the setup (make_llama_sequence).
  [[nodiscard]] LlamaOptions with_threads(int threads) const {
    LlamaOptions options = options_;
    options.threads = threads;
    return options;
  }

  LlamaModel model_;
  LlamaOptions options_;
};

struct EvalOptions {
  eval::EvalCommand command;
  LlamaOptions llama;
};

int run_eval(EvalOptions options) {
  options.command.threads = options.llama.threads;
  const LlamaOptions llama = options.llama;
  const bool complete = eval::run_eval_command(
      options.command,
      [&llama](const std::string& path) { return std::make_unique<LlamaEvalEngine>(path, llama); },
      std::cout, std::cerr);
  return complete ? 0 : 1;
}

}  // namespace

Command add_eval_command(CLI::App& parent) {
  auto options = std::make_shared<EvalOptions>();
  CLI::App* app = parent.add_subcommand(
      "eval",
      "Run a `kvevict eval` benchmark grid (policies x budgets x tasks) on a GGUF through "
      "llama.cpp, resumable");
  eval::EvalCommand& command = options->command;
  cli::add_grid_options(*app, command)->required();
  app->add_option("-m,--model", command.model,
                  "the GGUF llama.cpp loads (replaces the config's \"model\")")
      ->required();
  add_llama_options(*app, options->llama);
  app->footer(
      "The grid, documents, scoring and outputs of `kvevict eval` (docs/eval.md), computed by\n"
      "llama.cpp. Entries without \"granularity\" run at token granularity (llama.cpp's cells are\n"
      "shared by every layer and head); head and layer are refused before the grid runs, as\n"
      "are budgets that with one chunk exceed -c. Every policy runs under --fa on, off or auto\n"
      "(with flash attention on, kvevict computes the attention rows a policy reads itself).\n"
      "results.json and every cell record \"engine\": \"llama.cpp ...\". passkey and grocery\n"
      "need kvevict's byte-level vocabulary; stream_bpb and cost run on any GGUF.\n"
      "\n"
      "Example:\n"
      "  kvevict-llama eval eval/configs/tiny.json --model model.gguf --out /tmp/tiny -c 2048");
  return Command{app, [options] { return run_eval(*options); }};
}

}  // namespace kvevict::llama_cli
