// `kvevict-llama generate`: `kvevict generate` over llama.cpp: the prompt is the first turn, then
// tokens are sampled (harness/sampling.hpp) and fed one by one under the policy.
#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <kvevict/error.hpp>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cli/options.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"
#include "harness/sampling.hpp"
#include "llama/cli/commands.hpp"
#include "llama/cli/llama_options.hpp"

namespace kvevict::llama_cli {
namespace {

using Clock = std::chrono::steady_clock;

struct GenerateOptions {
  std::string model;
  std::string prompt;
  int max_tokens = 128;
  harness::PolicyOptions policy;
  harness::SamplingOptions sampling;
  LlamaOptions llama;
  bool json = false;
};

double seconds_between(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double>(end - begin).count();
}

int run_generate(const GenerateOptions& options) {
  if (options.max_tokens < 1) {
    throw Error(fmt::format("--max-tokens must be at least 1, got {}", options.max_tokens));
  }
  harness::validate_sampling(options.sampling);
  harness::validate_policy_options(options.policy);
  const LlamaModel model(options.model, options.llama.gpu_layers);
  harness::PolicySetup setup = make_setup(options.policy, model);
  StageClock clock;
  const std::unique_ptr<llama::LlamaSequence> sequence =
      make_llama_sequence(model, options.llama, setup, &clock);

  const std::vector<std::int32_t> prompt = model.encode(options.prompt, /*add_bos=*/true);
  if (prompt.empty()) {
    throw Error("the prompt is empty and the model has no BOS token: give a non-empty --prompt");
  }
  harness::Sampler sampler(options.sampling);
  const Clock::time_point start = Clock::now();
  llama::LlamaLogits logits = sequence->feed(prompt, /*turn_start=*/true);
  const Clock::time_point prefilled = Clock::now();
  std::vector<std::int32_t> generated;
  std::string text;
  bool stopped_at_eos = false;
  for (int i = 0; i < options.max_tokens; ++i) {
    const std::int32_t token = sampler.sample(logits.last());
    if (token == model.eos_id()) {
      stopped_at_eos = true;
      break;
    }
    generated.push_back(token);
    const std::string piece = model.decode(token);
    text += piece;
    if (!options.json) std::cout << piece << std::flush;
    if (i + 1 == options.max_tokens) break;  // nothing is sampled after the last token
    logits = sequence->forward(std::span<const std::int32_t>(&generated.back(), 1));
  }
  const Clock::time_point done = Clock::now();
  const harness::CacheReport report =
      cache_report(*sequence, setup.name, seconds_between(start, done), clock);
  const double decode_seconds = seconds_between(prefilled, done);
  const double decode_rate =
      decode_seconds > 0 ? static_cast<double>(generated.size()) / decode_seconds : 0.0;
  if (options.json) {
    nlohmann::ordered_json json;
    json["model"] = options.model;
    json["prompt"] = options.prompt;
    json["text"] = text;
    json["prompt_tokens"] = prompt.size();
    json["generated_tokens"] = generated.size();
    json["token_ids"] = generated;
    json["stop_reason"] = stopped_at_eos ? "eos" : "max_tokens";
    json["sampling"] = {{"temperature", options.sampling.temperature},
                        {"top_p", options.sampling.top_p},
                        {"seed", options.sampling.seed}};
    json["policy"] = policy_json(setup, *sequence);
    json["prefill_seconds"] = seconds_between(start, prefilled);
    json["decode_tokens_per_second"] = decode_rate;
    json["cache"] = harness::to_json(report);
    std::cout << harness::dump_json(json) << '\n' << std::flush;
  } else {
    std::cout << '\n'
              << fmt::format("[{} prompt tokens, {} generated ({:.1f} tokens/s), stop: {}]\n",
                             prompt.size(), generated.size(), decode_rate,
                             stopped_at_eos ? "eos" : "max_tokens")
              << harness::format_cache_report(report) << '\n'
              << std::flush;
  }
  return 0;
}

}  // namespace

Command add_generate_command(CLI::App& parent) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* app = parent.add_subcommand(
      "generate", "Generate text with llama.cpp under a kvevict policy (`kvevict generate`)");
  cli::add_model_option(*app, options->model);
  app->add_option("-p,--prompt", options->prompt, "prompt text")->required();
  app->add_option("-n,--max-tokens", options->max_tokens, "most tokens to generate")
      ->capture_default_str();
  cli::add_policy_options(*app, options->policy);
  cli::add_sampling_options(*app, options->sampling);
  add_llama_options(*app, options->llama);
  app->add_flag("--json", options->json,
                "print one JSON object (text, token ids, policy, cache statistics)");
  return Command{app, [options] { return run_generate(*options); }};
}

}  // namespace kvevict::llama_cli
