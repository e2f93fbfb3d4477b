#include "cli_common/policy_setup.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <kvevict/error.hpp>
#include <kvevict/policies/infinipot.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/positions.hpp>
#include <kvevict/signals.hpp>
#include <system_error>
#include <utility>

namespace kvevict::cli {
namespace {

// Parameters whose value is always a list, even with a single element ("anchor_ids=258").
bool is_list_param(std::string_view key) { return key == "anchor_ids"; }

// Policies with a `sinks` parameter (the protected first tokens).
bool has_sinks_param(std::string_view policy) {
  return policy == "streaming_llm" || policy == "sirllm" || policy == "random_llm" ||
         policy == "interval_llm" || policy == "tova";
}

// Policies whose --budget mapping subtracts the sinks (the sinks count against the budget).
bool budget_includes_sinks(std::string_view policy) {
  return policy == "streaming_llm" || policy == "sirllm" || policy == "random_llm" ||
         policy == "interval_llm";
}

bool is_known_policy(std::string_view policy) {
  for (std::string_view name : policy_names()) {
    if (name == policy) return true;
  }
  return false;
}

std::string trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t");
  return std::string(text.substr(first, last - first + 1));
}

double parse_number(std::string_view text, std::string_view context) {
  const std::string trimmed = trim(text);
  double value = 0.0;
  const char* end = trimmed.data() + trimmed.size();
  const auto [stop, error] = std::from_chars(trimmed.data(), end, value);
  if (trimmed.empty() || error != std::errc() || stop != end || !std::isfinite(value)) {
    throw Error(fmt::format("--param {}: '{}' is not a number", context, text));
  }
  return value;
}

std::int64_t parse_integer(std::string_view text, std::string_view context) {
  const std::string trimmed = trim(text);
  std::int64_t value = 0;
  const char* end = trimmed.data() + trimmed.size();
  const auto [stop, error] = std::from_chars(trimmed.data(), end, value);
  if (trimmed.empty() || error != std::errc() || stop != end) {
    throw Error(fmt::format("--param {}: '{}' is not an integer", context, text));
  }
  return value;
}

std::string format_number(double value) { return fmt::format("{}", value); }

// Parameters of each policy (policy_registry.hpp), for messages about a misspelt one.
std::vector<std::string_view> parameters_of(std::string_view policy) {
  if (policy == "window") return {"recent"};
  if (policy == "streaming_llm") return {"sinks", "recent"};
  if (policy == "infinipot") return {"pot", "keep", "novel"};
  if (policy == "h2o") return {"heavy", "recent"};
  if (policy == "tova") return {"budget", "sinks", "head_wise"};
  if (policy == "sirllm") return {"sinks", "entropy", "recent", "decay", "shifted"};
  if (policy == "random_llm") return {"sinks", "budget", "seed"};
  if (policy == "interval_llm") return {"sinks", "budget"};
  if (policy == "anllm") return {"anchor_ids", "max_slots"};
  return {};
}

// make_policy with the policy named in its messages, and hints for a missing or misspelt
// parameter.
std::unique_ptr<Policy> build_policy(const std::string& name, const ParamValues& values) {
  const std::vector<std::string_view> known = parameters_of(name);
  for (const auto& [key, value] : values.values()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      throw Error(fmt::format("policy '{}' has no parameter '{}' ({})", name, key,
                              known.empty() ? std::string("it takes none")
                                            : fmt::format("it takes {}", fmt::join(known, ", "))));
    }
  }
  try {
    return make_policy(name, values.to_policy_params());
  } catch (const Error& error) {
    const std::string message = error.what();
    const bool missing = message.find("missing parameter") != std::string::npos;
    throw Error(fmt::format("policy '{}': {}{}", name, message,
                            missing ? " (give --budget N, or --param KEY=VALUE)" : ""));
  }
}

}  // namespace

PolicyParams ParamValues::to_policy_params() const {
  PolicyParams params;
  for (const auto& [key, value] : values_) {
    if (const auto* number = std::get_if<double>(&value)) {
      params.set(key, *number);
    } else {
      params.set_list(key, std::get<std::vector<std::int64_t>>(value));
    }
  }
  return params;
}

std::string ParamValues::to_string() const {
  std::string text;
  for (const auto& [key, value] : values_) {
    if (!text.empty()) text += ' ';
    text += key + '=';
    if (const auto* number = std::get_if<double>(&value)) {
      text += format_number(*number);
    } else {
      text += fmt::format("{}", fmt::join(std::get<std::vector<std::int64_t>>(value), ","));
    }
  }
  return text;
}

nlohmann::ordered_json ParamValues::to_json() const {
  nlohmann::ordered_json json = nlohmann::ordered_json::object();
  for (const auto& [key, value] : values_) {
    if (const auto* number = std::get_if<double>(&value)) {
      // Integers as JSON integers: every parameter but sirllm's decay is one.
      const bool integral = *number == std::floor(*number) && std::fabs(*number) < 9.0e15;
      json[key] = integral ? nlohmann::ordered_json(static_cast<std::int64_t>(*number))
                           : nlohmann::ordered_json(*number);
    } else {
      json[key] = std::get<std::vector<std::int64_t>>(value);
    }
  }
  return json;
}

std::string policy_list() { return fmt::format("{}", fmt::join(policy_names(), ", ")); }

ParamValues budget_params(std::string_view policy, int budget, int sinks) {
  if (policy == "full") {
    throw Error("--budget does not apply to policy 'full', which keeps every token");
  }
  if (budget < 1) throw Error(fmt::format("--budget must be at least 1, got {}", budget));
  if (sinks < 0) throw Error(fmt::format("--sinks must be >= 0, got {}", sinks));
  if (budget_includes_sinks(policy) && budget <= sinks) {
    throw Error(
        fmt::format("budget {} is smaller than the protected set (sinks {})", budget, sinks));
  }
  ParamValues values;
  if (policy == "window") {
    values.set_number("recent", budget);
  } else if (policy == "streaming_llm") {
    values.set_number("sinks", sinks);
    values.set_number("recent", budget - sinks);
  } else if (policy == "h2o") {
    values.set_number("heavy", budget / 2);
    values.set_number("recent", budget - budget / 2);
  } else if (policy == "tova") {
    values.set_number("budget", budget);
  } else if (policy == "sirllm") {
    values.set_number("sinks", sinks);
    values.set_number("entropy", budget - sinks);
  } else if (policy == "random_llm" || policy == "interval_llm") {
    values.set_number("sinks", sinks);
    values.set_number("budget", budget - sinks);
  } else if (policy == "infinipot") {
    values.set_number("pot", budget);
    values.set_number("keep", budget / 2);
    values.set_number("novel", budget / 4);
  } else if (policy == "anllm") {
    values.set_number("max_slots", budget);
  } else {
    throw Error(fmt::format("unknown policy '{}' (known: {})", policy, policy_list()));
  }
  return values;
}

void apply_param(ParamValues& values, std::string_view key_value) {
  const auto equals = key_value.find('=');
  const std::string key =
      equals == std::string_view::npos ? std::string() : trim(key_value.substr(0, equals));
  if (key.empty()) {
    throw Error(fmt::format("--param '{}': expected KEY=VALUE, e.g. recent=256", key_value));
  }
  const std::string_view value = key_value.substr(equals + 1);
  if (is_list_param(key) || value.find(',') != std::string_view::npos) {
    std::vector<std::int64_t> list;
    std::size_t begin = 0;
    while (true) {
      const std::size_t comma = value.find(',', begin);
      list.push_back(parse_integer(value.substr(begin, comma - begin), key_value));
      if (comma == std::string_view::npos) break;
      begin = comma + 1;
    }
    values.set_list(key, std::move(list));
  } else {
    values.set_number(key, parse_number(value, key_value));
  }
}

ParamValues resolve_params(const PolicyOptions& options, const model::Tokenizer* tokenizer) {
  ParamValues values;
  if (options.budget) values = budget_params(options.policy, *options.budget, options.sinks);
  if (options.sinks_given) values.set_number("sinks", options.sinks);
  for (const std::string& param : options.params) apply_param(values, param);
  if (options.policy == "anllm" && !values.has("anchor_ids") && tokenizer != nullptr) {
    if (tokenizer->anchor_id < 0) {
      throw Error(
          "policy 'anllm' needs anchor token ids and the model's tokenizer has no <AC> anchor "
          "token: give --param anchor_ids=ID[,ID...]");
    }
    values.set_list("anchor_ids", {tokenizer->anchor_id});
  }
  return values;
}

void validate_policy_options(const PolicyOptions& options) {
  if (!is_known_policy(options.policy)) {
    throw Error(fmt::format("unknown policy '{}' (known: {})", options.policy, policy_list()));
  }
  if (options.chunk < 1 || options.chunk > kMaxChunk) {
    throw Error(fmt::format("--chunk must be in [1, {}], got {}", kMaxChunk, options.chunk));
  }
  if (options.sinks < 0) throw Error(fmt::format("--sinks must be >= 0, got {}", options.sinks));
  if (options.sinks_given && !has_sinks_param(options.policy)) {
    throw Error(
        fmt::format("--sinks does not apply to policy '{}' (it has no sinks)", options.policy));
  }
  try {
    if (!options.positions.empty()) (void)parse_position_mode(options.positions);
  } catch (const Error& error) {
    throw Error(fmt::format("--positions: {}", error.what()));
  }
  try {
    (void)parse_key_storage(options.keys);
  } catch (const Error& error) {
    throw Error(fmt::format("--keys: {}", error.what()));
  }
  const ParamValues values = resolve_params(options, nullptr);
  // AnLLM's default anchor ids come from the model; every other policy can be built now.
  if (options.policy == "anllm" && !values.has("anchor_ids")) return;
  const std::unique_ptr<Policy> policy = build_policy(options.policy, values);
  if (options.catalyst && !policy->signals().contains(Signal::catalyst_attention)) {
    throw Error(fmt::format(
        "--catalyst does not apply to policy '{}' (only infinipot runs a catalyst prompt)",
        options.policy));
  }
}

PolicySetup make_policy_setup(const PolicyOptions& options, const model::Model& model) {
  validate_policy_options(options);
  PolicySetup setup;
  setup.name = options.policy;
  setup.params = resolve_params(options, &model.tokenizer);
  setup.policy = build_policy(options.policy, setup.params);
  if (!options.positions.empty()) {
    setup.decoder_options.position_mode = parse_position_mode(options.positions);
  }
  setup.decoder_options.key_storage = parse_key_storage(options.keys);
  setup.decoder_options.max_chunk = options.chunk;
  if (setup.policy->signals().contains(Signal::catalyst_attention)) {
    const std::string text =
        options.catalyst.value_or(std::string(kInfiniPotGeneralCatalystPrompt));
    // No BOS: the catalyst continues the context, it does not start a sequence.
    setup.catalyst = model.tokenizer.encode(text, /*add_bos=*/false);
  }
  return setup;
}

std::unique_ptr<model::Decoder> make_decoder(const model::Model& model, PolicySetup& setup) {
  KVEVICT_REQUIRE(setup.policy != nullptr, "make_decoder: the setup's policy was already used");
  auto decoder =
      std::make_unique<model::Decoder>(model, std::move(setup.policy), setup.decoder_options);
  if (setup.catalyst) decoder->set_catalyst(*setup.catalyst);
  return decoder;
}

std::string describe_policy(const PolicySetup& setup, const model::Decoder& decoder) {
  const std::string params = setup.params.to_string();
  return fmt::format("{}{}, positions {}, keys {}, chunk {}", setup.name,
                     params.empty() ? std::string() : " (" + params + ")",
                     to_string(decoder.cache().pipeline().position_mode()),
                     to_string(decoder.options().key_storage), decoder.options().max_chunk);
}

nlohmann::ordered_json policy_json(const PolicySetup& setup, const model::Decoder& decoder) {
  nlohmann::ordered_json json;
  json["name"] = setup.name;
  json["params"] = setup.params.to_json();
  json["positions"] = std::string(to_string(decoder.cache().pipeline().position_mode()));
  json["keys"] = std::string(to_string(decoder.options().key_storage));
  json["chunk"] = decoder.options().max_chunk;
  if (setup.catalyst) json["catalyst_tokens"] = setup.catalyst->size();
  return json;
}

}  // namespace kvevict::cli
