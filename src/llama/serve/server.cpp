#include "llama/serve/server.hpp"

#include <fmt/format.h>
#include <httplib.h>

#include <atomic>
#include <charconv>
#include <ctime>
#include <filesystem>
#include <kvevict/error.hpp>
#include <kvevict/version.hpp>
#include <mutex>
#include <thread>
#include <utility>

#include "llama/serve/openai.hpp"

namespace kvevict::llama_serve {
namespace {

using nlohmann::json;
using Milliseconds = std::chrono::milliseconds;

// Requests being answered (streams included until their last byte), so that shutdown lets them
// end before the listener stops.
class InFlight {
 public:
  class Token {
   public:
    explicit Token(InFlight& owner) : owner_(owner) {
      const std::lock_guard lock(owner_.mutex_);
      ++owner_.count_;
    }
    ~Token() {
      {
        const std::lock_guard lock(owner_.mutex_);
        --owner_.count_;
      }
      owner_.changed_.notify_all();
    }
    Token(const Token&) = delete;
    Token& operator=(const Token&) = delete;

   private:
    InFlight& owner_;
  };
  bool wait_none(Milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return count_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int count_ = 0;
};

void send_json(httplib::Response& response, int status, const json& body) {
  response.status = status;
  response.set_content(dump(body), "application/json");
}

void send_error(httplib::Response& response, const RequestError& error) {
  send_json(response, error.status, error_body(error));
}

std::int64_t now_seconds() { return static_cast<std::int64_t>(std::time(nullptr)); }

std::string sse(const json& value) { return "data: " + dump(value) + "\n\n"; }

}  // namespace

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  // Every byte of the longer string is read whatever the contents.
  const std::size_t length = std::max(a.size(), b.size());
  unsigned difference = a.size() == b.size() ? 0U : 1U;
  for (std::size_t i = 0; i < length; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    difference |= static_cast<unsigned>(x ^ y);
  }
  return difference == 0;
}

std::string exposure_warning(const ServeOptions& options) {
  if (is_loopback(options.host) || !options.api_key.empty()) return {};
  return fmt::format(
      "warning: serving on {} without --api-key: anyone who can reach this address can use the "
      "model",
      options.host);
}

struct Server::Impl {
  Impl(const llama_cli::LlamaModel& model, ServeOptions serve_options)
      : options(std::move(serve_options)),
        engine(
            model, options.llama, options.policy,
            EngineOptions{options.parallel, options.queue, options.kv_pool, options.policy.chunk}),
        parser(model, make_defaults(model)),
        created(now_seconds()) {}

  RequestDefaults make_defaults(const llama_cli::LlamaModel& model) {
    RequestDefaults defaults;
    defaults.policy = options.policy;
    defaults.sampling = options.sampling;
    defaults.max_tokens = options.max_tokens;
    defaults.max_tokens_limit = options.max_tokens_limit;
    defaults.slot_cells = engine.slot_cells();
    defaults.pool = options.kv_pool > 0;
    defaults.chat_template = choose_chat_template(model, options.chat_template, note);
    return defaults;
  }

  void routes();
  httplib::Server::HandlerResponse before_routing(const httplib::Request& request,
                                                  httplib::Response& response) const;
  void generate(const httplib::Request& request, httplib::Response& response, Endpoint endpoint);
  [[nodiscard]] std::string metrics_text() const;
  [[nodiscard]] json slots_json(bool kept) const;

  ServeOptions options;
  std::string note;
  Engine engine;
  RequestParser parser;
  std::int64_t created;
  httplib::Server http;
  InFlight in_flight;
  std::atomic<std::uint64_t> next_id{1};
  std::mutex run_mutex;
  bool shutdown_requested = false;
  bool running = false;
};

httplib::Server::HandlerResponse Server::Impl::before_routing(const httplib::Request& request,
                                                              httplib::Response& response) const {
  using Handled = httplib::Server::HandlerResponse;
  if (!options.api_key.empty() && request.path != "/health") {
    if (!constant_time_equal(request.get_header_value("Authorization"),
                             "Bearer " + options.api_key)) {
      response.set_header("WWW-Authenticate", "Bearer");
      send_error(response, {401, "invalid or missing API key (Authorization: Bearer KEY)",
                            "authentication_error"});
      return Handled::Handled;
    }
  }
  if (request.method == "POST") {
    // The body is not read yet: its size is checked from Content-Length, which httplib's own
    // limit does not apply to chunked bodies, so those are refused.
    if (request.has_header("Transfer-Encoding")) {
      send_error(response, {411, "chunked request bodies are not accepted: send Content-Length"});
      return Handled::Handled;
    }
    const std::string length = request.get_header_value("Content-Length");
    std::size_t bytes = 0;
    const auto [end, status] = std::from_chars(length.data(), length.data() + length.size(), bytes);
    if (length.empty() || status != std::errc() || end != length.data() + length.size()) {
      send_error(response, {411, "a request body needs a valid Content-Length"});
      return Handled::Handled;
    }
    if (bytes > options.max_body_bytes) {
      send_error(response, {413, fmt::format("the request body of {} bytes exceeds the server's "
                                             "limit of {} bytes (--max-body-bytes)",
                                             bytes, options.max_body_bytes)});
      return Handled::Handled;
    }
  }
  return Handled::Unhandled;
}

void Server::Impl::generate(const httplib::Request& request, httplib::Response& response,
                            Endpoint endpoint) {
  auto token = std::make_shared<InFlight::Token>(in_flight);
  ParsedRequest parsed;
  try {
    parsed = parser.parse(request.body, endpoint);
  } catch (const RequestError& error) {
    send_error(response, error);
    return;
  }
  const std::shared_ptr<Job> job = parsed.job;
  switch (engine.submit(job)) {
    case Engine::Admission::accepted:
      break;
    case Engine::Admission::queue_full:
      response.set_header("Retry-After", std::to_string(options.retry_after_seconds));
      send_error(response, {503,
                            fmt::format("every slot is busy and the queue is full ({} slots, "
                                        "queue of {}): retry later",
                                        options.parallel, options.queue),
                            "server_error"});
      return;
    case Engine::Admission::draining:
      response.set_header("Retry-After", std::to_string(options.retry_after_seconds));
      send_error(response, {503, "the server is shutting down", "server_error"});
      return;
  }
  const bool started = job->wait_started();
  const bool chat = endpoint == Endpoint::chat;
  const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id.fetch_add(1));
  const std::int64_t created_at = now_seconds();
  const std::string model_id = options.alias;

  if (!parsed.stream) {
    while (!job->wait(Milliseconds(1000)).done) {
    }
    if (job->error()) {
      send_error(response, *job->error());
      return;
    }
    json choice = {{"index", 0}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", job->text()}};
    } else {
      choice["text"] = job->text();
    }
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = job->finish_reason();
    if (parsed.return_tokens) choice["tokens"] = job->tokens();
    send_json(response, 200,
              json{{"id", id},
                   {"object", chat ? "chat.completion" : "text_completion"},
                   {"created", created_at},
                   {"model", model_id},
                   {"choices", json::array({choice})},
                   {"usage", usage_json(job->usage())}});
    return;
  }
  if (!started) {  // refused before it had a slot: a plain error response
    send_error(response, *job->error());
    return;
  }
  // The chunks as OpenAI streams them; `text` is pending output taken from the job.
  const auto chunk = [id, created_at, model_id, chat](const json& delta_or_text,
                                                      const json& finish_reason) {
    json choice = {{"index", 0}};
    if (chat) {
      choice["delta"] = delta_or_text;
    } else {
      choice["text"] = delta_or_text;
    }
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = finish_reason;
    return json{{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created_at},
                {"model", model_id},
                {"choices", json::array({choice})}};
  };
  auto head_sent = std::make_shared<bool>(false);
  const bool include_usage = parsed.include_usage;
  const bool return_tokens = parsed.return_tokens;
  response.set_header("Cache-Control", "no-cache");
  response.set_chunked_content_provider(
      "text/event-stream",
      [job, chunk, head_sent, chat, include_usage, return_tokens, id, created_at, model_id, token](
          std::size_t /*offset*/, httplib::DataSink& sink) {
        const auto write = [&](const std::string& text) {
          return sink.write(text.data(), text.size());
        };
        if (!sink.is_writable()) {
          job->cancel();
          return false;
        }
        if (!*head_sent) {
          *head_sent = true;
          if (chat && !write(sse(chunk({{"role", "assistant"}, {"content", ""}}, nullptr)))) {
            job->cancel();
            return false;
          }
        }
        const Job::Update update = job->wait(Milliseconds(100));
        if (!update.text.empty()) {
          const json delta = chat ? json{{"content", update.text}} : json(update.text);
          if (!write(sse(chunk(delta, nullptr)))) {
            job->cancel();
            return false;
          }
        }
        if (!update.done) return true;
        std::string tail;
        if (job->error()) {
          tail += sse(error_body(*job->error()));
        } else {
          json last = chunk(chat ? json::object() : json(""), job->finish_reason());
          if (return_tokens) last["choices"][0]["tokens"] = job->tokens();
          tail += sse(last);
          if (include_usage) {
            tail += sse(json{{"id", id},
                             {"object", chat ? "chat.completion.chunk" : "text_completion"},
                             {"created", created_at},
                             {"model", model_id},
                             {"choices", json::array()},
                             {"usage", usage_json(job->usage())}});
          }
        }
        tail += "data: [DONE]\n\n";
        if (!write(tail)) return false;
        sink.done();
        return true;
      },
      [job](bool /*success*/) {
        // A stream that ended early (its reader left): the engine frees the slot.
        job->cancel();
      });
}

json Server::Impl::slots_json(bool kept) const {
  const EngineMetrics metrics = engine.metrics();
  json slots = json::array();
  for (std::size_t i = 0; i < metrics.slots.size(); ++i) {
    const SlotMetrics& slot = metrics.slots[i];
    json entry = {{"id", i},
                  {"busy", slot.busy},
                  {"open", slot.open},
                  {"policy", slot.policy},
                  {"history_tokens", slot.history_tokens},
                  {"live_cells", slot.live_cells},
                  {"peak_cells", slot.peak_cells},
                  {"evicted_tokens", slot.evicted_tokens},
                  {"tokens_per_second", slot.tokens_per_second},
                  {"requests", slot.requests}};
    if (kept) entry["kept_positions"] = slot.kept_positions;
    slots.push_back(std::move(entry));
  }
  return slots;
}

std::string Server::Impl::metrics_text() const {
  const EngineMetrics m = engine.metrics();
  std::string out;
  const auto family = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP kvevict_{} {}\n# TYPE kvevict_{} {}\n", name, help, name, type);
  };
  const auto per_slot = [&](const char* name, const char* type, const char* help,
                            const auto& value) {
    family(name, type, help);
    for (std::size_t i = 0; i < m.slots.size(); ++i) {
      out += fmt::format("kvevict_{}{{slot=\"{}\"}} {}\n", name, i, value(m.slots[i]));
    }
  };
  const auto bytes = static_cast<std::int64_t>(m.bytes_per_cell);
  per_slot("slot_busy", "gauge", "1 while the slot serves a request",
           [](const SlotMetrics& s) { return s.busy ? 1 : 0; });
  per_slot("slot_live_kv_cells", "gauge", "KV cells the slot's sequence holds",
           [](const SlotMetrics& s) { return s.live_cells; });
  per_slot("slot_live_kv_bytes", "gauge", "K and V bytes of the cells the slot holds",
           [&](const SlotMetrics& s) { return s.live_cells * bytes; });
  per_slot("slot_peak_kv_cells", "gauge", "most KV cells the slot held",
           [](const SlotMetrics& s) { return s.peak_cells; });
  per_slot("slot_peak_kv_bytes", "gauge", "K and V bytes of the most cells the slot held",
           [&](const SlotMetrics& s) { return s.peak_cells * bytes; });
  per_slot("slot_history_tokens", "gauge",
           "tokens the slot's conversation has consumed (reusable by its next request)",
           [](const SlotMetrics& s) { return s.history_tokens; });
  per_slot("slot_evicted_tokens_total", "counter", "tokens evicted from the slot's sequences",
           [](const SlotMetrics& s) { return s.evicted_tokens; });
  per_slot("slot_tokens_per_second", "gauge", "decode rate of the slot's last request",
           [](const SlotMetrics& s) { return fmt::format("{:.3f}", s.tokens_per_second); });
  per_slot("slot_requests_total", "counter", "requests the slot served",
           [](const SlotMetrics& s) { return s.requests; });
  const auto single = [&](const char* name, const char* type, const char* help, auto value) {
    family(name, type, help);
    out += fmt::format("kvevict_{} {}\n", name, value);
  };
  single("kv_bytes_per_cell", "gauge", "K and V bytes of one cell over all layers", bytes);
  single("context_cells", "gauge", "cells of the llama.cpp context (--ctx-size)", m.context_cells);
  single("pool_cells", "gauge", "cells of the KV pool (--kv-pool; 0: none)", m.pool_cells);
  single("pool_used_cells", "gauge", "cells the pool's members hold", m.pool_used);
  single("pool_charged_cells", "gauge", "cells the pool's members can never give up",
         m.pool_charged);
  single("pool_peak_cells", "gauge", "largest step peak of the pool (cells held plus fed)",
         m.pool_peak);
  single("pool_cuts_total", "counter", "members the pool cut to make room", m.pool_cuts);
  single("pool_pressed_steps_total", "counter", "steps in which the pool cut a member",
         m.pool_pressed_steps);
  single("steps_total", "counter", "llama_decode steps", m.steps);
  single("requests_queued", "gauge", "requests waiting for a slot", m.queued);
  single("requests_active", "gauge", "requests in a slot", m.active);
  single("requests_finished_total", "counter", "requests answered", m.requests_finished);
  single("requests_failed_total", "counter", "admitted requests that ended in an error",
         m.requests_failed);
  single("requests_cancelled_total", "counter", "requests whose client left", m.requests_cancelled);
  single("prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens);
  single("reused_prompt_tokens_total", "counter",
         "prompt tokens a slot had consumed already (not fed again)", m.reused_prompt_tokens);
  single("generated_tokens_total", "counter", "tokens generated by finished requests",
         m.generated_tokens);
  return out;
}

void Server::Impl::routes() {
  http.set_pre_routing_handler(
      [this](const httplib::Request& request, httplib::Response& response) {
        return before_routing(request, response);
      });
  http.set_payload_max_length(options.max_body_bytes);
  const int threads = options.parallel + options.queue + 8;
  http.new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<std::size_t>(threads));
  };
  http.set_error_handler([](const httplib::Request& /*request*/, httplib::Response& response) {
    if (!response.body.empty()) return;
    const int status = response.status;
    send_error(
        response,
        {status, status == 404 ? std::string("no such endpoint") : fmt::format("HTTP {}", status),
         status >= 500 ? "server_error" : "invalid_request_error"});
  });
  http.set_exception_handler([](const httplib::Request& /*request*/, httplib::Response& response,
                                std::exception_ptr error) {
    std::string message = "internal error";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    send_error(response, {500, message, "server_error"});
  });
  for (const char* path : {"/v1/completions", "/completions"}) {
    http.Post(path, [this](const httplib::Request& request, httplib::Response& response) {
      generate(request, response, Endpoint::completions);
    });
  }
  for (const char* path : {"/v1/chat/completions", "/chat/completions"}) {
    http.Post(path, [this](const httplib::Request& request, httplib::Response& response) {
      generate(request, response, Endpoint::chat);
    });
  }
  http.Get("/health", [this](const httplib::Request& /*request*/, httplib::Response& response) {
    if (engine.draining()) {
      send_json(response, 503, {{"status", "shutting down"}});
    } else {
      send_json(response, 200, {{"status", "ok"}});
    }
  });
  http.Get("/v1/models", [this](const httplib::Request& /*request*/, httplib::Response& response) {
    const json model = {{"id", options.alias},
                        {"object", "model"},
                        {"created", created},
                        {"owned_by", "kvevict"},
                        {"meta",
                         {{"n_ctx", options.llama.context},
                          {"parallel", options.parallel},
                          {"kv_pool", options.kv_pool},
                          {"policy", options.policy.policy},
                          {"kvevict_version", kVersionString}}}};
    send_json(response, 200, {{"object", "list"}, {"data", json::array({model})}});
  });
  http.Get("/slots", [this](const httplib::Request& request, httplib::Response& response) {
    send_json(response, 200, slots_json(request.get_param_value("kept") == "1"));
  });
  http.Get("/metrics", [this](const httplib::Request& /*request*/, httplib::Response& response) {
    response.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
}

Server::Server(const llama_cli::LlamaModel& model, ServeOptions options) {
  if (options.max_tokens < 1) throw Error("-n/--n-predict must be at least 1");
  if (options.max_tokens_limit < 1) throw Error("--max-tokens-limit must be at least 1");
  if (options.max_body_bytes < 2) throw Error("--max-body-bytes must be at least 2");
  if (options.retry_after_seconds < 1) throw Error("--retry-after must be at least 1");
  if (options.port < 0 || options.port > 65535) throw Error("--port must be in [0, 65535]");
  harness::validate_sampling(options.sampling);
  harness::validate_policy_options(options.policy);
  if (options.alias.empty()) {
    options.alias = "model";
  }
  impl_ = std::make_unique<Impl>(model, std::move(options));
  // The server's own policy must serve a request that names none.
  const harness::PolicySetup setup = llama_cli::make_setup(impl_->options.policy, model);
  const std::int64_t cells = impl_->engine.slot_cells();
  const std::optional<int> limit = setup.policy->retained_limit();
  if (!limit && impl_->options.kv_pool > 0) {
    throw Error(
        fmt::format("--policy {} keeps every token, so it cannot share --kv-pool: give a "
                    "bounded policy (--policy with --budget) as the server's default",
                    setup.name));
  }
  if (limit && std::int64_t{*limit} + impl_->options.policy.chunk > cells) {
    throw Error(
        fmt::format("--policy {} keeps up to {} tokens: with --chunk {} that exceeds the {} "
                    "cells a slot may hold ({})",
                    setup.name, *limit, impl_->options.policy.chunk, cells,
                    impl_->options.kv_pool > 0 ? "--kv-pool" : "--ctx-size / --parallel"));
  }
  impl_->routes();
}

Server::~Server() = default;

int Server::bind() {
  const int port = impl_->options.port == 0
                       ? impl_->http.bind_to_any_port(impl_->options.host)
                       : (impl_->http.bind_to_port(impl_->options.host, impl_->options.port)
                              ? impl_->options.port
                              : -1);
  if (port < 0) {
    throw Error(fmt::format("cannot listen on {}:{} (in use, or not an address of this machine)",
                            impl_->options.host, impl_->options.port));
  }
  return port;
}

void Server::run() {
  {
    const std::lock_guard lock(impl_->run_mutex);
    if (impl_->shutdown_requested) return;
    impl_->running = true;
  }
  impl_->http.listen_after_bind();
  const std::lock_guard lock(impl_->run_mutex);
  impl_->running = false;
}

void Server::shutdown(std::chrono::milliseconds drain) {
  const auto deadline = std::chrono::steady_clock::now() + drain;
  bool running = false;
  {
    const std::lock_guard lock(impl_->run_mutex);
    impl_->shutdown_requested = true;
    running = impl_->running;
  }
  (void)impl_->engine.drain(drain);
  const auto left = [&] {
    return std::max(Milliseconds(0), std::chrono::duration_cast<Milliseconds>(
                                         deadline - std::chrono::steady_clock::now()));
  };
  (void)impl_->in_flight.wait_none(left());
  if (!running) return;
  // stop() does nothing until the listener runs.
  while (!impl_->http.is_running()) {
    {
      const std::lock_guard lock(impl_->run_mutex);
      if (!impl_->running) return;
    }
    std::this_thread::sleep_for(Milliseconds(5));
  }
  impl_->http.stop();
}

const Engine& Server::engine() const { return impl_->engine; }
const std::string& Server::note() const { return impl_->note; }

}  // namespace kvevict::llama_serve
