// `kvevict-llama serve`: an OpenAI-style HTTP server over many sequences of one llama.cpp context,
// each under the policy its request picks (src/llama/serve, docs/serving.md). SIGTERM and SIGINT
// stop admitting requests, let the admitted ones finish (at most --drain-seconds), then exit.
#include <fmt/format.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <kvevict/error.hpp>
#include <kvevict/kv_type.hpp>
#include <kvevict/llama/llama_sequence_set.hpp>
#include <memory>
#include <string>
#include <thread>

#include "cli/options.hpp"
#include "llama/cli/commands.hpp"
#include "llama/cli/llama_options.hpp"
#include "llama/serve/server.hpp"

namespace kvevict::llama_cli {
namespace {

struct ServeCommandOptions {
  std::string model;
  llama_serve::ServeOptions serve;
  std::int64_t kv_pool_bytes = 0;  ///< --kv-pool-bytes: the pool in bytes of K and V
  int drain_seconds = 30;
};

// --kv-pool-bytes: the cells whose K and V (every layer, the context's cell type) fit in the bytes.
std::int64_t pool_cells_from_bytes(const LlamaModel& model, const llama_serve::ServeOptions& serve,
                                   std::int64_t bytes) {
  if (serve.kv_pool > 0) {
    throw Error("--kv-pool and --kv-pool-bytes: give the pool in cells or in bytes, not both");
  }
  const llama_context_params params =
      context_params(serve.llama, parse_kv_type(serve.policy.kv_type));
  const auto per_cell =
      static_cast<std::int64_t>(llama::cell_bytes(model.get(), params.type_k, params.type_v));
  if (bytes < per_cell) {
    throw Error(
        fmt::format("--kv-pool-bytes {} holds no cell: one cell of this model is {} bytes of K and "
                    "V ({} cells)",
                    bytes, per_cell, serve.policy.kv_type));
  }
  return bytes / per_cell;
}

int run_serve(ServeCommandOptions& options) {
  if (options.drain_seconds < 0) throw Error("--drain-seconds must be >= 0");
  llama_serve::ServeOptions& serve = options.serve;
  harness::validate_sampling(serve.sampling);
  harness::validate_policy_options(serve.policy);
  if (serve.alias.empty()) serve.alias = std::filesystem::path(options.model).stem().string();

  // Signals go to the waiting thread only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that left is an error of its write, not a signal

  const LlamaModel model(options.model, serve.llama.gpu_layers);
  if (options.kv_pool_bytes != 0) {
    if (options.kv_pool_bytes < 0) throw Error("--kv-pool-bytes must be positive");
    serve.kv_pool = pool_cells_from_bytes(model, serve, options.kv_pool_bytes);
  }
  llama_serve::Server server(model, serve);
  if (const std::string warning = llama_serve::exposure_warning(serve); !warning.empty()) {
    std::cerr << "kvevict-llama serve: " << warning << '\n';
  }
  if (!server.note().empty()) std::cerr << "kvevict-llama serve: " << server.note() << '\n';
  const int port = server.bind();
  std::cout << fmt::format(
                   "kvevict-llama serve: listening on http://{}:{} ({} slots, context {} cells, "
                   "{}, policy {})",
                   serve.host.find(':') != std::string::npos ? "[" + serve.host + "]" : serve.host,
                   port, serve.parallel, serve.llama.context,
                   serve.kv_pool > 0 ? fmt::format("KV pool of {} cells", serve.kv_pool)
                                     : std::string("no KV pool"),
                   serve.policy.policy)
            << std::endl;

  const auto drain = std::chrono::seconds(options.drain_seconds);
  std::atomic<bool> listener_ended{false};
  std::thread waiter([&server, &listener_ended, signals, drain] {
    int received = 0;
    sigwait(&signals, &received);
    if (listener_ended.load()) return;  // woken by the end below
    std::cerr << "kvevict-llama serve: signal " << received
              << ": draining (new requests get 503), then stopping\n";
    server.shutdown(drain);
  });
  server.run();
  // The listener stopped (after a signal, or because it failed): wake the waiter if it waits.
  listener_ended.store(true);
  pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  std::cerr << "kvevict-llama serve: stopped\n";
  return 0;
}

}  // namespace

Command add_serve_command(CLI::App& parent) {
  auto options = std::make_shared<ServeCommandOptions>();
  CLI::App* app = parent.add_subcommand(
      "serve",
      "OpenAI-style HTTP server (/v1/completions, /v1/chat/completions) whose conversations "
      "outlive their cache: each request under its own policy, many in one llama.cpp context");
  cli::add_model_option(*app, options->model);
  llama_serve::ServeOptions& serve = options->serve;
  const std::string group = "Server";
  app->add_option("--host", serve.host,
                  "address to listen on (loopback by default; beyond it, give --api-key)")
      ->group(group)
      ->capture_default_str();
  app->add_option("--port", serve.port, "port to listen on (0: any free port, printed)")
      ->group(group)
      ->capture_default_str();
  app->add_option("--np,--parallel", serve.parallel,
                  "slots: requests decoded together, each its own sequence of the context")
      ->group(group)
      ->capture_default_str();
  app->add_option("--queue", serve.queue,
                  "requests that may wait for a slot; beyond them, 503 with Retry-After")
      ->group(group)
      ->capture_default_str();
  app->add_option("--kv-pool", serve.kv_pool,
                  "one KV pool of this many cells for all slots (at most --ctx-size): slots over "
                  "their fair share are cut by their own policy when it fills; 0: each slot "
                  "holds at most --ctx-size / --parallel cells")
      ->group(group)
      ->capture_default_str();
  app->add_option("--kv-pool-bytes", options->kv_pool_bytes,
                  "the KV pool in bytes of K and V instead of cells: as many cells as fit (every "
                  "layer's K and V in the context's cell type)")
      ->group(group);
  app->add_option("--api-key", serve.api_key,
                  "every request but /health needs Authorization: Bearer KEY")
      ->group(group);
  app->add_option("--max-body-bytes", serve.max_body_bytes,
                  "largest request body (Content-Length), refused with 413 before it is read")
      ->group(group)
      ->capture_default_str();
  app->add_option("--max-tokens-limit", serve.max_tokens_limit,
                  "largest max_tokens a request may ask for (400 beyond)")
      ->group(group)
      ->capture_default_str();
  app->add_option("-n,--n-predict", serve.max_tokens, "max_tokens of a request that gives none")
      ->group(group)
      ->capture_default_str();
  app->add_option("--chat-template", serve.chat_template,
                  "chat template for /v1/chat/completions (a name llama_chat_apply_template "
                  "knows: chatml, llama3, ...); default: the model's, else chatml")
      ->group(group);
  app->add_option("--alias", serve.alias, "the model's id in responses (default: the file name)")
      ->group(group);
  app->add_option("--retry-after", serve.retry_after_seconds,
                  "seconds a 503's Retry-After asks clients to wait")
      ->group(group)
      ->capture_default_str();
  app->add_option("--drain-seconds", options->drain_seconds,
                  "on SIGTERM / SIGINT, how long admitted requests may run before the server stops")
      ->group(group)
      ->capture_default_str();
  cli::add_policy_options(*app, serve.policy);
  cli::add_sampling_options(*app, serve.sampling);
  add_llama_options(*app, serve.llama);
  return Command{app, [options] { return run_serve(*options); }};
}

}  // namespace kvevict::llama_cli
