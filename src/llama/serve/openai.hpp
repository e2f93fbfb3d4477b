// The OpenAI-style request and response bodies of `kvevict-llama serve` (docs/serving.md):
// POST /v1/completions and /v1/chat/completions as their clients send them, plus kvevict's fields
// (kv_policy, kv_budget, kv_granularity, kv_positions). Every problem with a request is a
// RequestError whose message names the field.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "harness/policy_setup.hpp"
#include "harness/sampling.hpp"
#include "llama/cli/llama_model.hpp"
#include "llama/serve/engine.hpp"

namespace kvevict::llama_serve {

enum class Endpoint { completions, chat };

/// What requests get when they do not say (the server's command line).
struct RequestDefaults {
  harness::PolicyOptions policy;
  harness::SamplingOptions sampling;
  int max_tokens = 256;         ///< -n / --n-predict
  int max_tokens_limit = 4096;  ///< --max-tokens-limit: larger max_tokens are refused
  std::int64_t slot_cells = 0;  ///< cells one slot may hold (Engine::slot_cells)
  bool pool = false;            ///< slots share a KvPool
  std::string chat_template;    ///< for llama_chat_apply_template (a template or a name)
};

struct ParsedRequest {
  std::shared_ptr<Job> job;
  bool stream = false;
  bool include_usage = false;  ///< stream_options.include_usage
  bool return_tokens = false;  ///< llama-server's field: the generated token ids too
};

/// Renders `messages` ({role, content}) with `chat_template` and the assistant's turn opened.
/// Throws kvevict::Error when llama.cpp does not know the template.
[[nodiscard]] std::string apply_chat_template(
    const std::string& chat_template,
    const std::vector<std::pair<std::string, std::string>>& messages);

/// The template the server uses: `requested` (--chat-template) when given, else the GGUF's when
/// llama_chat_apply_template knows it, else chatml (what llama-server falls back to). `note` says
/// what was chosen when it was not the GGUF's. Throws when `requested` is unknown.
[[nodiscard]] std::string choose_chat_template(const llama_cli::LlamaModel& model,
                                               const std::string& requested, std::string& note);

class RequestParser {
 public:
  RequestParser(const llama_cli::LlamaModel& model, RequestDefaults defaults);
  /// Throws RequestError (status 400) naming the field at fault.
  [[nodiscard]] ParsedRequest parse(std::string_view body, Endpoint endpoint) const;
  [[nodiscard]] const RequestDefaults& defaults() const { return defaults_; }

 private:
  [[nodiscard]] std::vector<std::int32_t> prompt_tokens(const nlohmann::json& body,
                                                        Endpoint endpoint) const;
  void set_policy(const nlohmann::json& body, Job& job, std::size_t prompt_tokens,
                  bool max_tokens_given) const;

  const llama_cli::LlamaModel& model_;
  RequestDefaults defaults_;
};

/// {"error": {"code", "message", "type"}}, as llama-server and OpenAI send it.
[[nodiscard]] nlohmann::json error_body(const RequestError& error);

/// OpenAI's usage plus "kvevict": {reused_prompt_tokens, evicted_prompt_tokens, cache_tokens,
/// evicted_tokens, slot}.
[[nodiscard]] nlohmann::json usage_json(const Usage& usage);

/// JSON text with invalid UTF-8 replaced (a byte-level model may generate any byte).
[[nodiscard]] std::string dump(const nlohmann::json& json);

}  // namespace kvevict::llama_serve
