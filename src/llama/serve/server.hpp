// `kvevict-llama serve`: the HTTP side (cpp-httplib) over the decode Engine (engine.hpp).
// Endpoints, fields, errors and metrics: docs/serving.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "harness/policy_setup.hpp"
#include "harness/sampling.hpp"
#include "llama/cli/llama_model.hpp"
#include "llama/cli/llama_options.hpp"
#include "llama/serve/engine.hpp"

namespace kvevict::llama_serve {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  ///< 0: any free port (Server::bind says which)
  int parallel = 4;
  int queue = 16;
  std::int64_t kv_pool = 0;
  std::string api_key;
  std::size_t max_body_bytes = std::size_t{1} << 20;
  int max_tokens_limit = 4096;
  int max_tokens = 256;  ///< -n: a request's max_tokens when it gives none
  std::string chat_template;
  std::string alias;  ///< the model's id in /v1/models and responses
  int retry_after_seconds = 1;
  harness::PolicyOptions policy;
  harness::SamplingOptions sampling;
  llama_cli::LlamaOptions llama;
};

/// Whether `host` is a loopback address (127.0.0.0/8, ::1, localhost).
[[nodiscard]] bool is_loopback(const std::string& host);
/// Equal strings, in a time that depends on their lengths only.
[[nodiscard]] bool constant_time_equal(const std::string& a, const std::string& b);
/// The warning printed when serving beyond loopback without --api-key, or empty.
[[nodiscard]] std::string exposure_warning(const ServeOptions& options);

class Server {
 public:
  /// Checks the options, creates the engine (the llama_context) and the routes. `model` must
  /// outlive the server. Throws kvevict::Error.
  Server(const llama_cli::LlamaModel& model, ServeOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Binds host:port and returns the port. Throws kvevict::Error.
  int bind();
  /// Serves until shutdown() (call bind() first).
  void run();
  /// Stops admitting requests (503), lets the admitted ones finish and their responses end (at
  /// most `drain`), then stops the listener. Any thread; safe before run() and more than once.
  void shutdown(std::chrono::milliseconds drain);

  [[nodiscard]] const Engine& engine() const;
  /// Notes for the operator (chat template fallback), printed by the command.
  [[nodiscard]] const std::string& note() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvevict::llama_serve
