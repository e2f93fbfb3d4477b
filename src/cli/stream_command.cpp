// `kvevict stream --model PATH --input FILE ...`: feeds a text of any length through the reference
// decoder under an eviction policy and measures how well the model predicts it: bits per byte and
// perplexity, overall and per window of positions, with the cache's memory and time.
//
// Memory is constant in the input's length: the text is read in 64 KiB blocks (TextPieces), at
// most one block's tokens and one chunk's logits are held, and the loss is summed as it goes.
//
// Scoring: token t of the stream is predicted by the logits of position t - 1. Within a forward
// those are row k - 1 of its logits; the first token of a forward uses the last row of the previous
// forward (the context as it stood then, before that forward's eviction). The stream's first
// token (BOS when the tokenizer has one) has no prediction and is not scored.
//
// --insert-anchors: AnchorInserter puts <AC> after every sentence end (across block and piece
// boundaries: the state carries over) and after the text's end. Anchors are fed like any token
// and take positions, but they are not scored: the loss, overall and per window, counts the text's
// tokens and bytes only, so a window's "tokens" is its scored text tokens, not its positions.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <kvevict/error.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cli/options.hpp"
#include "command.hpp"
#include "harness/anchor_inserter.hpp"
#include "harness/log_loss.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"
#include "harness/text_stream.hpp"

namespace kvevict::cli {
namespace {

struct StreamOptions {
  std::string model;
  StreamInputOptions input;
  int window = 1024;
  PolicyOptions policy;
  int threads = 1;
  bool json = false;
  bool insert_anchors = false;
};

int run_stream(const StreamOptions& options) {
  if (options.window < 1) {
    throw Error(fmt::format("--window must be at least 1, got {}", options.window));
  }
  TextStreamOptions stream = text_stream_options(options.input);
  stream.insert_anchors = options.insert_anchors;
  stream.progress = true;
  const bool turns = !stream.turn_separator.empty();
  validate_policy_options(options.policy);
  check_threads(options.threads);

  const model::Model model = load_model_file(options.model);
  const model::Tokenizer& tokenizer = model.tokenizer;
  PolicySetup setup = make_policy_setup(options.policy, model);
  warn_if_single_turn(*setup.policy, turns);
  StageClock clock;  // where the eviction time goes (the report's eviction seconds)
  setup.decoder_options.observer = &clock;
  setup.decoder_options.threads = options.threads;
  const std::unique_ptr<model::Decoder> decoder = make_decoder(model, setup);

  std::optional<std::int32_t> anchor_id;
  if (options.insert_anchors) anchor_id = AnchorInserter::for_tokenizer(tokenizer).anchor_id();
  StreamScorer scorer(*decoder, options.window,
                      token_byte_counts(tokenizer, model.config.vocab_size),
                      anchor_id.value_or(-1));
  const TextStreamResult streamed =
      stream_text(stream, tokenizer, scorer, decoder->options().max_chunk);
  if (turns) warn_if_single_turn(decoder->cache().sequence().policy(), streamed.turns > 0);
  const CacheReport report = make_cache_report(*decoder, setup.name, streamed.seconds, &clock);
  print_stream_report(options.json,
                      StreamReportHeader{.model = options.model,
                                         .input = options.input.input,
                                         .turns = turns,
                                         .insert_anchors = options.insert_anchors,
                                         .policy_description = describe_policy(setup, *decoder),
                                         .granularity = describe_granularity(setup, *decoder),
                                         .policy = policy_json(setup, *decoder)},
                      scorer.loss(), streamed, report);
  return kExitOk;
}

}  // namespace

Command add_stream_command(CLI::App& parent) {
  auto options = std::make_shared<StreamOptions>();
  CLI::App* app = parent.add_subcommand(
      "stream",
      "Stream a text file through the decoder under a policy: bits per byte, perplexity, memory");
  add_model_option(*app, options->model);
  add_stream_input_options(*app, options->input);
  add_window_option(*app, options->window);
  add_policy_options(*app, options->policy);
  add_threads_option(*app, options->threads);
  add_decode_activations_option(*app, options->policy.decode_activations);
  add_insert_anchors_option(*app, options->insert_anchors,
                            "the anchors are fed and take positions but are not scored: bits per "
                            "byte and the token counts, overall and per window, cover the text "
                            "only");
  app->add_flag("--json", options->json,
                "print one JSON object: overall and per-window loss, policy, cache statistics");
  app->footer(
      "Feed a text file of any length through the reference decoder under an eviction policy\n"
      "and report how well the model predicts it: bits per byte (sum of -log2 p over the tokens\n"
      "/ their bytes) and perplexity per token, overall and per window of positions, with\n"
      "tokens/s, live and peak KV bytes and time in eviction. Memory stays constant whatever\n"
      "the length (the file is read in 64 KiB blocks). Progress goes to stderr when it is a\n"
      "terminal. Token t is scored with the logits of position t - 1 (across chunk boundaries\n"
      "too); the first token (BOS) has no prediction and is not scored.\n"
      "\n"
      "--insert-anchors (AnLLM toy models): <AC> follows every sentence end and the end of the\n"
      "text. Anchors are fed to the model and the policy like any token and occupy positions\n"
      "(the windows are windows of positions), but they are not scored: \"tokens scored\" and\n"
      "each window's tokens count the text's tokens only, and bits per byte is the text's bits\n"
      "over the text's bytes, so it compares with a run without anchors.\n"
      "\n"
      "Examples:\n"
      "  kvevict stream --model models/toy-base --input data/kjv-heldout.txt \\\n"
      "      --policy streaming_llm --budget 64 --window 512\n"
      "  kvevict stream --model model.gguf --input chat.txt --turn-separator '\\n\\n' \\\n"
      "      --policy sirllm --budget 256 --json\n"
      "  kvevict stream models/toy-anchor --input data/kjv-heldout.txt --insert-anchors \\\n"
      "      --policy anllm --budget 256");
  return Command{app, [options] { return run_stream(*options); }};
}

}  // namespace kvevict::cli
