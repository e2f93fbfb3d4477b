// `kvevict-llama stream`: `kvevict stream` over llama.cpp. Same options (plus llama.cpp's), same
// chunks, same scoring and the same report, so the two executables' results compare line by line.
#include <fmt/format.h>

#include <iostream>
#include <kvevict/error.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cli/options.hpp"
#include "harness/anchor_inserter.hpp"
#include "harness/log_loss.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"
#include "harness/text_stream.hpp"
#include "llama/cli/commands.hpp"
#include "llama/cli/llama_options.hpp"

namespace kvevict::llama_cli {
namespace {

struct StreamOptions {
  std::string model;
  harness::StreamInputOptions input;
  int window = 1024;
  harness::PolicyOptions policy;
  LlamaOptions llama;
  bool json = false;
  bool insert_anchors = false;
};

// kvevict's tokenizer where it holds the vocabulary (the text cut and encoded exactly as `kvevict
// stream` does); else llama.cpp's, the text cut only before a space and each piece encoded with
// its leading space (byte-level BPE: Llama 3, Qwen, SmolLM2).
harness::TextStreamResult stream_text(const harness::TextStreamOptions& stream,
                                      const LlamaModel& model, harness::StreamScorer& scorer,
                                      int chunk) {
  if (const model::Tokenizer* tokenizer = model.kvevict_tokenizer()) {
    return harness::stream_text(stream, *tokenizer, scorer, chunk);
  }
  const harness::PieceEncoder encoder{
      .encode = [&model](std::string_view text,
                         bool add_bos) { return model.encode(text, add_bos); },
      .cut_before_space = true,
      .drop_cut_space = false};
  return harness::stream_text(stream, encoder, std::nullopt, scorer, chunk);
}

int run_stream(const StreamOptions& options) {
  if (options.window < 1) {
    throw Error(fmt::format("--window must be at least 1, got {}", options.window));
  }
  harness::TextStreamOptions stream = harness::text_stream_options(options.input);
  stream.insert_anchors = options.insert_anchors;
  stream.progress = true;
  const bool turns = !stream.turn_separator.empty();
  harness::validate_policy_options(options.policy);

  const LlamaModel model(options.model, options.llama.gpu_layers);
  harness::PolicySetup setup = make_setup(options.policy, model);
  harness::warn_if_single_turn(*setup.policy, turns);
  StageClock clock;
  const std::unique_ptr<llama::LlamaSequence> sequence =
      make_llama_sequence(model, options.llama, setup, &clock);

  std::optional<std::int32_t> anchor_id;
  if (options.insert_anchors) {
    const model::Tokenizer* tokenizer = model.kvevict_tokenizer();
    if (tokenizer == nullptr) {
      throw Error("--insert-anchors needs a vocabulary with kvevict's <AC> anchor; '" +
                  options.model + "' has none");
    }
    anchor_id = harness::AnchorInserter::for_tokenizer(*tokenizer).anchor_id();
  }
  harness::StreamScorer scorer(
      [&sequence](std::span<const std::int32_t> tokens, bool turn_start) {
        return sequence->feed(tokens, turn_start, /*all_logits=*/true).values;
      },
      sequence->vocab(), options.window, model.token_bytes(), anchor_id.value_or(-1));
  const harness::TextStreamResult streamed =
      stream_text(stream, model, scorer, sequence->max_chunk());
  if (turns) {
    harness::warn_if_single_turn(sequence->sequence().policy(), streamed.turns > 0);
  }
  const harness::CacheReport report = cache_report(*sequence, setup.name, streamed.seconds, clock);
  harness::print_stream_report(
      options.json,
      harness::StreamReportHeader{.model = options.model,
                                  .input = options.input.input,
                                  .turns = turns,
                                  .insert_anchors = options.insert_anchors,
                                  .policy_description = describe_policy(setup, *sequence),
                                  .granularity = describe_granularity(setup, *sequence),
                                  .policy = policy_json(setup, *sequence)},
      scorer.loss(), streamed, report);
  return 0;
}

}  // namespace

Command add_stream_command(CLI::App& parent) {
  auto options = std::make_shared<StreamOptions>();
  CLI::App* app = parent.add_subcommand(
      "stream",
      "Stream a text file through llama.cpp under a kvevict policy: bits per byte, perplexity, "
      "memory (the report of `kvevict stream`)");
  cli::add_model_option(*app, options->model);
  cli::add_stream_input_options(*app, options->input);
  cli::add_window_option(*app, options->window);
  cli::add_policy_options(*app, options->policy);
  cli::add_insert_anchors_option(*app, options->insert_anchors,
                                 "the anchors are fed and take positions but are not scored");
  add_llama_options(*app, options->llama);
  app->add_flag("--json", options->json,
                "print one JSON object: overall and per-window loss, policy, cache statistics");
  app->footer(
      "The same stream, scoring and report as `kvevict stream`, computed by llama.cpp: token t\n"
      "is scored with the logits of position t - 1; the first token (BOS) is not scored. The\n"
      "KV memory reported is llama.cpp's cells in use (K and V of every layer). llama.cpp's\n"
      "cells are per token, so the policy decides once for the whole model (granularity token)\n"
      "where `kvevict stream` takes the policy's own (per KV head for h2o): give\n"
      "--granularity token to both for the same decisions; the report's granularity line says\n"
      "which.\n"
      "\n"
      "Example:\n"
      "  kvevict-llama stream --model model.gguf --input book.txt --policy h2o --budget 1024 \\\n"
      "      -c 2048 -t 1 --json");
  return Command{app, [options] { return run_stream(*options); }};
}

}  // namespace kvevict::llama_cli
