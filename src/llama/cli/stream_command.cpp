// `kvevict-llama stream`: `kvevict stream` over llama.cpp. Same options (plus llama.cpp's), same
// chunks, same scoring and the same report, so the two executables' results compare line by line.
#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <kvevict/error.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cli_common/anchor_inserter.hpp"
#include "cli_common/cli_options.hpp"
#include "cli_common/log_loss.hpp"
#include "cli_common/policy_setup.hpp"
#include "cli_common/report.hpp"
#include "cli_common/text_pieces.hpp"
#include "llama/cli/commands.hpp"
#include "llama/cli/llama_options.hpp"

namespace kvevict::llama_cli {
namespace {

struct StreamOptions {
  std::string model;
  std::string input;
  int window = 1024;
  std::string turn_separator;
  cli::PolicyOptions policy;
  LlamaOptions llama;
  bool json = false;
  bool insert_anchors = false;
  std::int64_t limit_bytes = 0;
};

// The text read in pieces, tokenized (anchors inserted when asked) and fed in chunks of exactly
// `chunk` tokens, a turn start flushing the partial chunk first: what `kvevict stream` does (to be
// replaced by cli_common's stream_text once that is committed).
StreamedText stream_text(const StreamOptions& options, const model::Tokenizer& tokenizer,
                         cli::StreamScorer& scorer, int chunk) {
  const auto start = std::chrono::steady_clock::now();
  cli::TextPieces pieces(
      options.input,
      cli::TextPiecesOptions{
          .turn_separator = unescape(options.turn_separator),
          .cut_before_space = tokenizer.kind == model::Tokenizer::Kind::sentencepiece,
          .limit_bytes = static_cast<std::uint64_t>(options.limit_bytes)});
  std::optional<cli::AnchorInserter> anchors;
  if (options.insert_anchors) anchors = cli::AnchorInserter::for_tokenizer(tokenizer);
  StreamedText result;
  std::vector<std::int32_t> pending;
  bool pending_turn = false;
  const auto flush = [&] {
    if (!pending.empty()) scorer.feed(pending, pending_turn);
    pending.clear();
    pending_turn = false;
  };
  const auto add = [&](std::span<const std::int32_t> tokens, bool turn_start) {
    if (turn_start) {
      flush();
      pending_turn = true;
    }
    for (const std::int32_t token : tokens) {
      pending.push_back(token);
      if (static_cast<int>(pending.size()) == chunk) flush();
    }
  };
  cli::TextPiece piece;
  std::vector<std::int32_t> anchored;
  bool first = true;
  while (pieces.next(piece)) {
    // A piece cut before a space is encoded without it: the dummy prefix stands for it.
    const std::string_view text =
        piece.space_cut ? std::string_view(piece.text).substr(1) : std::string_view(piece.text);
    const std::vector<std::int32_t> tokens = tokenizer.encode(text, /*add_bos=*/first);
    first = false;
    if (piece.turn_start) ++result.turns;
    if (anchors) {
      anchored.clear();
      anchors->push(tokens, anchored);
      add(anchored, piece.turn_start);
    } else {
      add(tokens, piece.turn_start);
    }
  }
  if (anchors) {
    anchored.clear();
    anchors->finish(anchored);
    add(anchored, false);
  }
  flush();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.input_bytes = pieces.bytes_read();
  result.anchors = anchors ? anchors->inserted() : 0;
  if (result.input_bytes == 0) throw Error(fmt::format("input '{}' is empty", options.input));
  if (scorer.loss().overall().tokens == 0) {
    throw Error(fmt::format("input '{}' holds a single token: nothing to score", options.input));
  }
  return result;
}

int run_stream(const StreamOptions& options) {
  if (options.window < 1) {
    throw Error(fmt::format("--window must be at least 1, got {}", options.window));
  }
  if (options.limit_bytes < 0) {
    throw Error(
        fmt::format("--limit-bytes must be >= 0 (0 = no limit), got {}", options.limit_bytes));
  }
  const std::string separator = unescape(options.turn_separator);
  cli::validate_policy_options(options.policy);

  const LlamaModel model(options.model, options.llama.gpu_layers);
  const model::Tokenizer* tokenizer = model.kvevict_tokenizer();
  if (tokenizer == nullptr) {
    throw Error("stream reads its text with kvevict's tokenizers (byte-level, SentencePiece); '" +
                options.model + "' has another vocabulary: use generate");
  }
  cli::PolicySetup setup = make_setup(options.policy, model);
  StageClock clock;
  const std::unique_ptr<llama::LlamaSequence> sequence =
      make_llama_sequence(model, options.llama, setup, &clock);

  cli::StreamScorer scorer(
      [&sequence](std::span<const std::int32_t> tokens, bool turn_start) {
        return sequence->feed(tokens, turn_start, /*all_logits=*/true).values;
      },
      sequence->vocab(), options.window, model.token_bytes(),
      options.insert_anchors ? tokenizer->anchor_id : -1);
  const StreamedText streamed = stream_text(options, *tokenizer, scorer, sequence->max_chunk());
  const cli::CacheReport report = cache_report(*sequence, setup.name, streamed.seconds, clock);
  print_stream_report(options.json, options.model, options.input, separator, options.insert_anchors,
                      describe_policy(setup, *sequence), policy_json(setup, *sequence),
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
  app->add_option("-i,--input", options->input, "text file to stream (\"-\" = stdin)")->required();
  app->add_option("-w,--window", options->window,
                  "report the loss per window of this many positions")
      ->capture_default_str();
  app->add_option("--turn-separator", options->turn_separator,
                  "split the text after each occurrence of this string and feed each piece as a "
                  "new turn; \\n, \\t, \\r and \\\\ are unescaped");
  app->add_option("--limit-bytes", options->limit_bytes,
                  "read only the first N bytes of the input (0 = all)")
      ->capture_default_str();
  cli::add_policy_options(*app, options->policy);
  cli::add_insert_anchors_option(*app, options->insert_anchors,
                                 "the anchors are fed and take positions but are not scored");
  add_llama_options(*app, options->llama);
  app->add_flag("--json", options->json,
                "print one JSON object: overall and per-window loss, policy, cache statistics");
  app->footer(
      "The same stream, scoring and report as `kvevict stream`, computed by llama.cpp: token t\n"
      "is scored with the logits of position t - 1; the first token (BOS) is not scored. The\n"
      "KV memory reported is llama.cpp's cells in use (K and V of every layer).\n"
      "\n"
      "Example:\n"
      "  kvevict-llama stream --model model.gguf --input book.txt --policy h2o --budget 1024 \\\n"
      "      -c 2048 -t 1 --json");
  return Command{app, [options] { return run_stream(*options); }};
}

}  // namespace kvevict::llama_cli
