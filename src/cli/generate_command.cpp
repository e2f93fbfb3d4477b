// `kvevict generate --model PATH --prompt TEXT ...`: feeds a prompt through the reference decoder
// under an eviction policy, then samples a continuation token by token and streams it to stdout;
// the cache statistics follow on stderr (or everything as one JSON object with --json).
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <iostream>
#include <kvevict/error.hpp>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cli_support/cli_options.hpp"
#include "cli_support/policy_setup.hpp"
#include "cli_support/report.hpp"
#include "cli_support/sampling.hpp"
#include "command.hpp"
#include "model/decoder.hpp"
#include "model/model.hpp"

namespace kvevict::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct GenerateOptions {
  std::string model;
  std::string prompt;
  int max_tokens = 128;
  SamplingOptions sampling;
  PolicyOptions policy;
  bool json = false;
};

double seconds_between(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double>(end - begin).count();
}

int run_generate(const GenerateOptions& options) {
  // Everything that does not need the model first: a typo should not wait for a load.
  if (options.max_tokens < 1) {
    throw Error(fmt::format("--max-tokens must be at least 1, got {}", options.max_tokens));
  }
  validate_sampling(options.sampling);
  validate_policy_options(options.policy);

  const model::Model model = load_model_file(options.model);
  PolicySetup setup = make_policy_setup(options.policy, model);
  const std::unique_ptr<model::Decoder> decoder = make_decoder(model, setup);
  const model::Tokenizer& tokenizer = model.tokenizer;

  const std::vector<std::int32_t> prompt = tokenizer.encode(options.prompt, /*add_bos=*/true);
  if (prompt.empty()) {
    throw Error("the prompt is empty and the model has no BOS token: give a non-empty --prompt");
  }
  Sampler sampler(options.sampling);

  const Clock::time_point start = Clock::now();
  // The prompt is the first turn (SirLLM-style policies evict before turns).
  model::ForwardResult result = decoder->feed(prompt, model::ForwardRequest{.turn_start = true});
  const Clock::time_point prefilled = Clock::now();

  std::vector<std::int32_t> generated;
  std::string text;
  bool stopped_at_eos = false;
  for (int i = 0; i < options.max_tokens; ++i) {
    const std::int32_t token = sampler.sample(result.last());
    if (token == tokenizer.eos_id) {
      stopped_at_eos = true;
      break;
    }
    generated.push_back(token);
    const std::string piece = tokenizer.decode(token);
    text += piece;
    if (!options.json) std::cout << piece << std::flush;
    // The last sampled token needs no forward: nothing will be sampled after it.
    if (i + 1 < options.max_tokens) result = decoder->forward(std::span(&token, 1));
  }
  const Clock::time_point done = Clock::now();

  const CacheReport report = make_cache_report(*decoder, setup.name, seconds_between(start, done));
  const double decode_seconds = seconds_between(prefilled, done);
  const double decode_rate =
      decode_seconds > 0 ? static_cast<double>(generated.size()) / decode_seconds : 0.0;
  const char* stop_reason = stopped_at_eos ? "eos" : "max_tokens";

  if (options.json) {
    nlohmann::ordered_json json;
    json["model"] = options.model;
    json["prompt"] = options.prompt;
    json["text"] = text;
    json["prompt_tokens"] = prompt.size();
    json["generated_tokens"] = generated.size();
    json["token_ids"] = generated;
    json["stop_reason"] = stop_reason;
    json["sampling"] = {{"temperature", options.sampling.temperature},
                        {"top_p", options.sampling.top_p},
                        {"seed", options.sampling.seed}};
    json["policy"] = policy_json(setup, *decoder);
    json["prefill_seconds"] = seconds_between(start, prefilled);
    json["decode_tokens_per_second"] = decode_rate;
    json["cache"] = to_json(report);
    std::cout << dump_json(json) << '\n' << std::flush;
  } else {
    if (!text.empty() && text.back() != '\n') std::cout << '\n';
    std::cout << std::flush;
    std::cerr << fmt::format(
                     "[{}] {} prompt + {} generated tokens (stop: {}), {:.1f} tokens/s "
                     "decoding\n",
                     describe_policy(setup, *decoder), prompt.size(), generated.size(), stop_reason,
                     decode_rate)
              << format_cache_report(report) << '\n';
  }
  if (!std::cout) throw Error("error while writing to stdout");
  return kExitOk;
}

}  // namespace

Command add_generate_command(CLI::App& parent) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* app = parent.add_subcommand(
      "generate", "Generate text with the reference decoder under an eviction policy");
  add_model_option(*app, options->model);
  app->add_option("-p,--prompt", options->prompt, "prompt text")->required();
  app->add_option("-n,--max-tokens", options->max_tokens, "most tokens to generate")
      ->capture_default_str();
  add_sampling_options(*app, options->sampling);
  add_policy_options(*app, options->policy);
  app->add_flag("--json", options->json,
                "print one JSON object (text, token ids, policy, cache statistics) instead of "
                "streaming the text");
  app->footer(
      "Generate text with the reference decoder under an eviction policy: the prompt (with BOS)\n"
      "is fed in chunks, then tokens are sampled one by one (greedy at --temperature 0) until\n"
      "EOS or --max-tokens. The continuation streams to stdout; cache statistics (tokens, live\n"
      "and peak KV bytes, evicted slots, compactions, tokens/s, eviction time) go to stderr, or\n"
      "everything into one JSON object with --json.\n"
      "\n"
      "Examples:\n"
      "  kvevict generate --model build/release/models/random-tiny.gguf --prompt 'Once upon' \\\n"
      "      --max-tokens 64 --policy streaming_llm --budget 32\n"
      "  kvevict generate --model model.gguf --prompt 'Hi' --temperature 0.8 --top-p 0.95 "
      "--seed 7 \\\n"
      "      --policy h2o --param heavy=128 --param recent=128 --json");
  return Command{app, [options] { return run_generate(*options); }};
}

}  // namespace kvevict::cli
