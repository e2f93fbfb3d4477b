// `kvevict compare --model PATH --input FILE --budget N`: what eviction buys, in one table. The
// same text is streamed through the reference decoder once per policy (the full cache and bounded
// policies at the same budget), and each row gives bits per byte overall, within the model's
// trained context and after it, live and peak KV bytes, tokens/s and the share of time spent
// evicting. It is `kvevict stream` run several times with one report.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <kvevict/error.hpp>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/timing.hpp>
#include <memory>
#include <string>
#include <vector>

#include "cli/options.hpp"
#include "command.hpp"
#include "harness/log_loss.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"
#include "harness/text_stream.hpp"

namespace kvevict::cli {
namespace {

// compare's --limit-bytes: the full cache's attention grows with the text.
constexpr std::int64_t kDefaultLimitBytes = 8192;

struct CompareOptions {
  std::string model;
  StreamInputOptions input;  ///< --limit-bytes defaults to kDefaultLimitBytes
  int budget = 64;
  std::vector<std::string> policies = {"full", "window", "streaming_llm", "h2o", "tova"};
  int chunk = kDefaultChunk;
  std::string kv_type = "f32";
  int threads = 1;
  bool json = false;
};

struct CompareRow {
  std::string policy;  ///< as described by describe_policy
  LossTotals overall;
  LossTotals within_context;  ///< positions [0, trained context)
  LossTotals beyond_context;  ///< positions [trained context, end)
  std::int64_t turns = 0;     ///< pieces that started a turn (0 without --turn-separator)
  CacheReport report;
};

// Policy `name` as `kvevict stream --policy NAME --budget N --chunk C` sets it up.
PolicyOptions policy_options(const CompareOptions& options, const std::string& name) {
  PolicyOptions policy;
  policy.policy = name;
  if (name != "full") policy.budget = options.budget;
  policy.chunk = options.chunk;
  policy.kv_type = options.kv_type;
  return policy;
}

// Streams the input through `name` at the options' budget.
CompareRow run_policy(const CompareOptions& options, const model::Model& model,
                      const std::string& name) {
  const TextStreamOptions stream = text_stream_options(options.input);
  const bool turns = !stream.turn_separator.empty();
  PolicySetup setup = make_policy_setup(policy_options(options, name), model);
  warn_if_single_turn(*setup.policy, turns);
  StageClock clock;
  setup.decoder_options.observer = &clock;
  setup.decoder_options.threads = options.threads;
  const std::unique_ptr<model::Decoder> decoder = make_decoder(model, setup);
  // Windows as long as the trained context split the loss into within and beyond it.
  const std::int64_t context =
      model.config.context_length > 0 ? model.config.context_length : std::int64_t{1} << 62;
  StreamScorer scorer(*decoder, context,
                      token_byte_counts(model.tokenizer, model.config.vocab_size), -1);
  const TextStreamResult streamed =
      stream_text(stream, model.tokenizer, scorer, decoder->options().max_chunk);
  if (turns) warn_if_single_turn(decoder->cache().sequence().policy(), streamed.turns > 0);

  CompareRow row;
  row.policy = describe_policy(setup, *decoder);
  row.overall = scorer.loss().overall();
  for (const LossWindow& window : scorer.loss().windows()) {
    LossTotals& part = window.first_position == 0 ? row.within_context : row.beyond_context;
    part.tokens += window.totals.tokens;
    part.bits += window.totals.bits;
    part.bytes += window.totals.bytes;
  }
  row.turns = streamed.turns;
  row.report = make_cache_report(*decoder, name, streamed.seconds, &clock);
  return row;
}

std::string bits_text(const LossTotals& totals) {
  return totals.tokens > 0 ? fmt::format("{:.3f}", totals.bits_per_byte()) : "-";
}

nlohmann::ordered_json totals_json(const LossTotals& totals) {
  nlohmann::ordered_json json;
  json["tokens"] = totals.tokens;
  json["bytes"] = totals.bytes;
  json["bits_per_byte"] =
      totals.tokens > 0 ? nlohmann::ordered_json(totals.bits_per_byte()) : nullptr;
  return json;
}

int run_compare(const CompareOptions& options) {
  if (options.budget < 1) {
    throw Error(fmt::format("--budget must be at least 1, got {}", options.budget));
  }
  (void)text_stream_options(options.input);  // --limit-bytes
  if (options.policies.empty()) throw Error("--policies needs at least one policy");
  if (options.input.input == "-" && options.policies.size() > 1) {
    throw Error(
        "--input -: compare streams the text once per policy, and stdin can be read once: "
        "give a file");
  }
  check_threads(options.threads);
  for (const std::string& name : options.policies) {
    validate_policy_options(policy_options(options, name));  // before the model loads
  }
  const model::Model model = load_model_file(options.model);

  std::vector<CompareRow> rows;
  for (const std::string& name : options.policies) {
    rows.push_back(run_policy(options, model, name));
  }

  const int context = model.config.context_length;
  if (options.json) {
    nlohmann::ordered_json json;
    json["model"] = options.model;
    json["input"] = options.input.input;
    if (!options.input.turn_separator.empty()) json["turns"] = rows.front().turns;
    json["budget"] = options.budget;
    json["trained_context"] = context;
    json["rows"] = nlohmann::ordered_json::array();
    for (const CompareRow& row : rows) {
      nlohmann::ordered_json entry;
      entry["policy"] = row.policy;
      entry["overall"] = totals_json(row.overall);
      entry["within_context"] = totals_json(row.within_context);
      entry["beyond_context"] = totals_json(row.beyond_context);
      entry["cache"] = to_json(row.report);
      json["rows"].push_back(std::move(entry));
    }
    std::cout << dump_json(json) << '\n' << std::flush;
    if (!std::cout) throw Error("error while writing to stdout");
    return kExitOk;
  }

  std::string out;
  out += fmt::format("model   {} (trained context {} positions)\n", options.model, context);
  out += fmt::format("input   {}: {} tokens scored ({} bytes){}\n", options.input.input,
                     rows.front().overall.tokens, rows.front().overall.bytes,
                     options.input.turn_separator.empty()
                         ? std::string()
                         : fmt::format(", {} turns", rows.front().turns));
  out += fmt::format("budget  {} tokens (full: no budget)\n\n", options.budget);
  out += fmt::format("{:<15} {:>9} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9}\n", "", "bits/byte",
                     fmt::format("first {}", context), "after", "live KV", "peak KV", "tokens/s",
                     "evicting");
  for (const CompareRow& row : rows) {
    const double evicting =
        row.report.seconds > 0 ? row.report.eviction_seconds / row.report.seconds : 0.0;
    out += fmt::format("{:<15} {:>9} {:>9} {:>9} {:>11} {:>11} {:>9.0f} {:>8.1f}%\n",
                       row.report.policy, bits_text(row.overall), bits_text(row.within_context),
                       bits_text(row.beyond_context), format_bytes(row.report.live_kv_bytes),
                       format_bytes(row.report.peak_kv_bytes), row.report.tokens_per_second,
                       100.0 * evicting);
  }
  out += fmt::format(
      "\nbits/byte: lower is better; overall, over the first {} tokens (the model's trained\n"
      "context) and after them. Each row is `kvevict stream --policy P --budget N{}` with:\n",
      context,
      options.input.turn_separator.empty()
          ? std::string()
          : fmt::format(" --turn-separator '{}'", options.input.turn_separator));
  for (const CompareRow& row : rows) out += "  " + row.policy + '\n';
  std::cout << out << std::flush;
  return kExitOk;
}

}  // namespace

Command add_compare_command(CLI::App& parent) {
  auto options = std::make_shared<CompareOptions>();
  CLI::App* app = parent.add_subcommand(
      "compare",
      "Stream one text under several policies at one budget: what eviction buys, in one table");
  add_model_option(*app, options->model);
  options->input.limit_bytes = kDefaultLimitBytes;
  add_stream_input_options(*app, options->input);
  app->add_option("--budget", options->budget, "cache budget in tokens of every bounded policy")
      ->capture_default_str();
  app->add_option("--policies", options->policies, "policies to compare: " + policy_list())
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--kv-type", options->kv_type,
                  "how every policy's cache stores keys and values: f32, f16, bf16 or q8_0")
      ->capture_default_str();
  app->add_option("--chunk", options->chunk, "prefill chunk size: tokens per forward")
      ->capture_default_str();
  add_threads_option(*app, options->threads);
  app->add_flag("--json", options->json, "print one JSON object instead of the table");
  app->footer(
      "Streams the same text through the reference decoder once per policy, the full cache\n"
      "first, and prints one row each: bits per byte overall, within the model's trained\n"
      "context and after it, live and peak KV bytes, tokens/s and the share of the run spent\n"
      "evicting (policy, re-positioning and InfiniPot's catalyst). Past its trained context a\n"
      "model with a full cache attends to keys further back than it ever saw; a policy that\n"
      "keeps recent tokens at shifted positions keeps both the memory and the distances in\n"
      "range. --limit-bytes is 8192 by default: the full cache's attention grows with the text.\n"
      "With --turn-separator every policy gets the same turns (SirLLM evicts before them).\n"
      "\n"
      "Examples:\n"
      "  kvevict compare --model models/toy-base --input data/kjv-heldout.txt --budget 64\n"
      "  kvevict compare --model models/toy-base --input data/kjv-heldout.txt --budget 64 \\\n"
      "      --policies window,sirllm --chunk 32 --turn-separator '\\n\\n'");
  return Command{app, [options] { return run_compare(*options); }};
}

}  // namespace kvevict::cli
