#include "llama/serve/openai.hpp"

#include <fmt/format.h>
#include <llama.h>

#include <cmath>
#include <kvevict/error.hpp>
#include <kvevict/policy_registry.hpp>
#include <limits>

namespace kvevict::llama_serve {
namespace {

using nlohmann::json;

RequestError bad(std::string message) { return RequestError{400, std::move(message)}; }

const char* type_name(const json& value) {
  if (value.is_number_integer()) return "an integer";
  if (value.is_number()) return "a number";
  return value.type_name();
}

// The field, or null when absent (JSON null counts as absent, as OpenAI's clients send it).
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

double number_field(const json& value, const char* name) {
  if (!value.is_number()) {
    throw bad(fmt::format("{}: expected a number, got {}", name, type_name(value)));
  }
  const double number = value.get<double>();
  if (!std::isfinite(number)) throw bad(fmt::format("{}: must be finite", name));
  return number;
}

std::int64_t integer_field(const json& value, const char* name) {
  if (value.is_number_float()) {
    const double number = value.get<double>();
    if (std::isfinite(number) && number == std::floor(number) && std::fabs(number) < 9e15) {
      return static_cast<std::int64_t>(number);
    }
  }
  if (value.is_number_unsigned()) {
    const auto number = value.get<std::uint64_t>();
    if (number > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      throw bad(fmt::format("{}: {} is too large", name, number));
    }
    return static_cast<std::int64_t>(number);
  }
  if (!value.is_number_integer()) {
    throw bad(fmt::format("{}: expected an integer, got {}", name, type_name(value)));
  }
  return value.get<std::int64_t>();
}

bool bool_field(const json& value, const char* name) {
  if (!value.is_boolean()) {
    throw bad(fmt::format("{}: expected true or false, got {}", name, type_name(value)));
  }
  return value.get<bool>();
}

std::string string_field(const json& value, const std::string& name) {
  if (!value.is_string()) {
    throw bad(fmt::format("{}: expected a string, got {}", name, type_name(value)));
  }
  return value.get<std::string>();
}

// A message's content: a string, or OpenAI's array of parts of which only text is read.
std::string message_content(const json& content, const std::string& name) {
  if (content.is_null()) return {};
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    throw bad(fmt::format("{}: expected a string or an array of text parts, got {}", name,
                          type_name(content)));
  }
  std::string text;
  for (std::size_t i = 0; i < content.size(); ++i) {
    const std::string part = fmt::format("{}[{}]", name, i);
    if (!content[i].is_object()) throw bad(part + ": expected an object");
    const json* type = field(content[i], "type");
    if (type == nullptr || string_field(*type, part + ".type") != "text") {
      throw bad(part + ".type: only \"text\" parts are supported");
    }
    const json* part_text = field(content[i], "text");
    if (part_text == nullptr) throw bad(part + ".text: required");
    text += string_field(*part_text, part + ".text");
  }
  return text;
}

// Replaces the command line's names in a harness message by the request's.
std::string request_names(std::string message) {
  for (const auto& [flag, name] :
       {std::pair{"--budget", "kv_budget"}, std::pair{"--granularity", "kv_granularity"},
        std::pair{"--positions", "kv_positions"}, std::pair{"--policy", "kv_policy"}}) {
    for (std::size_t at = message.find(flag); at != std::string::npos;
         at = message.find(flag, at)) {
      message.replace(at, std::string_view(flag).size(), name);
    }
  }
  return message;
}

}  // namespace

std::string apply_chat_template(const std::string& chat_template,
                                const std::vector<std::pair<std::string, std::string>>& messages) {
  std::vector<llama_chat_message> chat;
  std::size_t length = 256;
  for (const auto& [role, content] : messages) {
    chat.push_back({role.c_str(), content.c_str()});
    length += 2 * (role.size() + content.size()) + 64;
  }
  std::string text(length, '\0');
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::int32_t written =
        llama_chat_apply_template(chat_template.c_str(), chat.data(), chat.size(), true,
                                  text.data(), static_cast<std::int32_t>(text.size()));
    if (written < 0) {
      throw Error(
          "llama_chat_apply_template does not know the chat template (it reads a fixed "
          "list of templates, not Jinja)");
    }
    if (static_cast<std::size_t>(written) <= text.size()) {
      text.resize(static_cast<std::size_t>(written));
      return text;
    }
    text.assign(static_cast<std::size_t>(written), '\0');
  }
  throw Error("llama_chat_apply_template: the rendered chat did not fit");
}

std::string choose_chat_template(const llama_cli::LlamaModel& model, const std::string& requested,
                                 std::string& note) {
  const std::vector<std::pair<std::string, std::string>> probe = {{"user", "hello"}};
  if (!requested.empty()) {
    try {
      (void)apply_chat_template(requested, probe);
    } catch (const Error& error) {
      throw Error("--chat-template '" + requested + "': " + error.what());
    }
    return requested;
  }
  const char* own = llama_model_chat_template(model.get(), nullptr);
  if (own != nullptr) {
    try {
      (void)apply_chat_template(own, probe);
      return own;
    } catch (const Error&) {
      note =
          "the model's chat template is not one llama_chat_apply_template knows: chat "
          "requests use chatml (give --chat-template NAME to choose)";
      return "chatml";
    }
  }
  note =
      "the model has no chat template: chat requests use chatml (--chat-template NAME to "
      "choose)";
  return "chatml";
}

RequestParser::RequestParser(const llama_cli::LlamaModel& model, RequestDefaults defaults)
    : model_(model), defaults_(std::move(defaults)) {}

std::vector<std::int32_t> RequestParser::prompt_tokens(const json& body, Endpoint endpoint) const {
  const int vocab = model_.vocab_size();
  std::string text;
  if (endpoint == Endpoint::completions) {
    const json* prompt = field(body, "prompt");
    if (prompt == nullptr) throw bad("prompt: required");
    if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
      // Token ids, fed as they are.
      std::vector<std::int32_t> tokens;
      for (std::size_t i = 0; i < prompt->size(); ++i) {
        const std::string name = fmt::format("prompt[{}]", i);
        const std::int64_t id = integer_field((*prompt)[i], name.c_str());
        if (id < 0 || id >= vocab) {
          throw bad(fmt::format("{}: token {} is outside the vocabulary [0, {})", name, id, vocab));
        }
        tokens.push_back(static_cast<std::int32_t>(id));
      }
      return tokens;
    }
    if (prompt->is_array()) {
      if (prompt->size() != 1) {
        throw bad("prompt: one prompt per request (an array of several prompts is not supported)");
      }
      text = string_field((*prompt)[0], "prompt[0]");
    } else {
      text = string_field(*prompt, "prompt");
    }
    std::vector<std::int32_t> tokens = model_.encode(text, /*add_bos=*/true);
    if (tokens.empty()) throw bad("prompt: empty, and the model has no BOS token to start from");
    return tokens;
  }
  const json* messages = field(body, "messages");
  if (messages == nullptr) throw bad("messages: required");
  if (!messages->is_array() || messages->empty()) {
    throw bad("messages: expected a non-empty array of {role, content}");
  }
  std::vector<std::pair<std::string, std::string>> chat;
  for (std::size_t i = 0; i < messages->size(); ++i) {
    const std::string name = fmt::format("messages[{}]", i);
    const json& message = (*messages)[i];
    if (!message.is_object()) throw bad(name + ": expected an object {role, content}");
    const json* role = field(message, "role");
    if (role == nullptr) throw bad(name + ".role: required");
    const auto content = message.find("content");
    chat.emplace_back(
        string_field(*role, name + ".role"),
        content == message.end() ? std::string() : message_content(*content, name + ".content"));
  }
  try {
    text = apply_chat_template(defaults_.chat_template, chat);
  } catch (const Error& error) {
    throw RequestError{500, std::string("messages: ") + error.what(), "server_error"};
  }
  // The template's special tokens are tokens (llama.cpp's vocabularies); kvevict's byte-level
  // vocabulary has none but BOS, EOS and <AC>.
  const model::Tokenizer* tokenizer = model_.kvevict_tokenizer();
  if (tokenizer != nullptr && tokenizer->kind == model::Tokenizer::Kind::byte_level) {
    return model_.encode(text, /*add_bos=*/true);
  }
  const llama_vocab* llama_vocab = llama_model_get_vocab(model_.get());
  std::vector<llama_token> tokens(text.size() + 8);
  const auto length = static_cast<std::int32_t>(text.size());
  std::int32_t count = llama_tokenize(llama_vocab, text.data(), length, tokens.data(),
                                      static_cast<std::int32_t>(tokens.size()), true, true);
  if (count < 0) {
    tokens.resize(static_cast<std::size_t>(-count));
    count = llama_tokenize(llama_vocab, text.data(), length, tokens.data(),
                           static_cast<std::int32_t>(tokens.size()), true, true);
  }
  if (count <= 0) throw bad("messages: the rendered chat has no tokens");
  tokens.resize(static_cast<std::size_t>(count));
  return tokens;
}

void RequestParser::set_policy(const json& body, Job& job, std::size_t prompt_tokens,
                               bool max_tokens_given) const {
  harness::PolicyOptions& options = job.policy;
  options = defaults_.policy;
  std::string given;  // the request's kvevict fields, for messages
  if (const json* policy = field(body, "kv_policy")) {
    const std::string name = string_field(*policy, "kv_policy");
    if (name != options.policy) {
      // The server's --param and --sinks belong to its own policy, and so does --budget when
      // the request's policy takes none (full).
      options.params.clear();
      options.sinks_given = false;
      try {
        if (policy_spec(name).budget == nullptr) {
          options.budget.reset();
          options.budget_bytes.reset();
        }
      } catch (const Error&) {
        // An unknown name: validate_policy_options says so below.
      }
    }
    options.policy = name;
    given += fmt::format(" kv_policy \"{}\"", name);
  }
  if (const json* budget = field(body, "kv_budget")) {
    const std::int64_t tokens = integer_field(*budget, "kv_budget");
    if (tokens < 1 || tokens > std::numeric_limits<int>::max()) {
      throw bad(fmt::format("kv_budget: must be a positive number of tokens, got {}", tokens));
    }
    options.budget = static_cast<int>(tokens);
    options.budget_bytes.reset();
    given += fmt::format(" kv_budget {}", tokens);
  }
  if (const json* granularity = field(body, "kv_granularity")) {
    options.granularity = string_field(*granularity, "kv_granularity");
    given += fmt::format(" kv_granularity \"{}\"", options.granularity);
  }
  if (const json* positions = field(body, "kv_positions")) {
    options.positions = string_field(*positions, "kv_positions");
    given += fmt::format(" kv_positions \"{}\"", options.positions);
  }
  const std::string where = given.empty() ? "the server's policy" : given.substr(1);
  harness::PolicySetup setup;
  try {
    harness::validate_policy_options(options);
    setup = llama_cli::make_setup(options, model_);
  } catch (const Error& error) {
    throw bad(where + ": " + request_names(error.what()));
  }
  const std::int64_t cells = defaults_.slot_cells;
  const int chunk = options.chunk;
  if (const std::optional<int> limit = setup.policy->retained_limit()) {
    const std::int64_t catalyst =
        setup.catalyst ? static_cast<std::int64_t>(setup.catalyst->size()) : 0;
    if (std::int64_t{*limit} + chunk + catalyst > cells) {
      throw bad(fmt::format(
          "{}: policy {} keeps up to {} tokens; with a chunk of {}{} that exceeds the {} cells a "
          "slot may hold ({})",
          where, setup.name, *limit, chunk,
          catalyst > 0 ? fmt::format(" and a catalyst of {}", catalyst) : std::string(), cells,
          defaults_.pool ? "--kv-pool" : "--ctx-size / --parallel"));
    }
  } else if (defaults_.pool) {
    throw bad(
        fmt::format("{}: policy {} keeps every token, so it cannot share the KV pool "
                    "(--kv-pool): give a bounded policy (kv_policy with kv_budget)",
                    where, setup.name));
  } else {
    // Unbounded: the whole conversation must fit in the slot.
    const std::int64_t room = cells - static_cast<std::int64_t>(prompt_tokens);
    if (room < 1 || (max_tokens_given && job.max_tokens > room)) {
      throw bad(fmt::format(
          "{}: policy {} keeps every token, and the prompt of {} tokens{} does not fit in the {} "
          "cells of a slot: a bounded policy (kv_policy with kv_budget) streams it through its "
          "cache",
          where, setup.name, prompt_tokens,
          room >= 1 ? fmt::format(" plus max_tokens {}", job.max_tokens) : std::string(), cells));
    }
    job.max_tokens = static_cast<int>(std::min<std::int64_t>(job.max_tokens, room));
  }
  job.policy_key = fmt::format("{} ({}) positions {} granularity {}", setup.name,
                               setup.params.to_string(), options.positions, options.granularity);
}

ParsedRequest RequestParser::parse(std::string_view text, Endpoint endpoint) const {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::parse_error& error) {
    throw bad(std::string("the request body is not valid JSON: ") + error.what());
  }
  if (!body.is_object()) throw bad("the request body must be a JSON object");
  ParsedRequest parsed;
  parsed.job = std::make_shared<Job>();
  Job& job = *parsed.job;

  if (const json* n = field(body, "n"); n != nullptr && integer_field(*n, "n") != 1) {
    throw bad("n: only one choice per request (n = 1)");
  }
  if (const json* stream = field(body, "stream")) parsed.stream = bool_field(*stream, "stream");
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) throw bad("stream_options: expected an object");
    if (const json* usage = field(*options, "include_usage")) {
      parsed.include_usage = bool_field(*usage, "stream_options.include_usage");
    }
  }
  if (const json* ignore_eos = field(body, "ignore_eos")) {
    job.ignore_eos = bool_field(*ignore_eos, "ignore_eos");
  }
  if (const json* tokens = field(body, "return_tokens")) {
    parsed.return_tokens = bool_field(*tokens, "return_tokens");
  }

  job.max_tokens = defaults_.max_tokens;
  const json* max_tokens = field(body, "max_completion_tokens");
  const char* max_name = "max_completion_tokens";
  if (max_tokens == nullptr) {
    max_tokens = field(body, "max_tokens");
    max_name = "max_tokens";
  }
  if (max_tokens != nullptr) {
    const std::int64_t count = integer_field(*max_tokens, max_name);
    if (count < 1) throw bad(fmt::format("{}: must be at least 1, got {}", max_name, count));
    if (count > defaults_.max_tokens_limit) {
      throw bad(fmt::format("{}: {} exceeds the server's limit of {} (--max-tokens-limit)",
                            max_name, count, defaults_.max_tokens_limit));
    }
    job.max_tokens = static_cast<int>(count);
  }
  job.max_tokens = std::min(job.max_tokens, defaults_.max_tokens_limit);

  job.sampling = defaults_.sampling;
  if (const json* temperature = field(body, "temperature")) {
    job.sampling.temperature = number_field(*temperature, "temperature");
    if (job.sampling.temperature < 0) throw bad("temperature: must be >= 0 (0: greedy)");
  }
  if (const json* top_p = field(body, "top_p")) {
    job.sampling.top_p = number_field(*top_p, "top_p");
    if (!(job.sampling.top_p > 0 && job.sampling.top_p <= 1)) {
      throw bad(fmt::format("top_p: must be in (0, 1], got {}", job.sampling.top_p));
    }
  }
  if (const json* top_k = field(body, "top_k")) {
    const std::int64_t k = integer_field(*top_k, "top_k");
    if (k < 0 || k > std::numeric_limits<int>::max()) {
      throw bad(fmt::format("top_k: must be >= 0 (0: no cut), got {}", k));
    }
    job.sampling.top_k = static_cast<int>(k);
  }
  if (const json* seed = field(body, "seed")) {
    job.sampling.seed = static_cast<std::uint64_t>(integer_field(*seed, "seed"));
  }
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      job.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (std::size_t i = 0; i < stop->size(); ++i) {
        job.stop.push_back(string_field((*stop)[i], fmt::format("stop[{}]", i)));
      }
    } else {
      throw bad(
          fmt::format("stop: expected a string or an array of strings, got {}", type_name(*stop)));
    }
    if (job.stop.size() > 16) throw bad("stop: at most 16 strings");
    for (const std::string& s : job.stop) {
      if (s.empty()) throw bad("stop: an empty string would stop before the first token");
    }
  }

  job.prompt = prompt_tokens(body, endpoint);
  set_policy(body, job, job.prompt.size(), max_tokens != nullptr);
  return parsed;
}

nlohmann::json error_body(const RequestError& error) {
  return json{
      {"error", {{"code", error.status}, {"message", error.message}, {"type", error.type}}}};
}

nlohmann::json usage_json(const Usage& usage) {
  return json{{"prompt_tokens", usage.prompt_tokens},
              {"completion_tokens", usage.completion_tokens},
              {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
              {"kvevict",
               {{"reused_prompt_tokens", usage.reused_prompt_tokens},
                {"evicted_prompt_tokens", usage.evicted_prompt_tokens},
                {"cache_tokens", usage.cache_tokens},
                {"evicted_tokens", usage.evicted_tokens},
                {"slot", usage.slot}}}};
}

std::string dump(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace kvevict::llama_serve
