// serve_load: K concurrent multi-turn conversations against a server on loopback
// (docs/serving.md, "Load").
//
//     serve_load --port 8080 --clients 8 --turns 6 --first-tokens 200 --turn-tokens 60
//         --max-tokens 64 --kv-policy streaming_llm --kv-budget 256 --server-pid PID
//
// Each client is one conversation. Every turn re-sends the whole conversation so far (prompt and
// the generated tokens, as token ids) plus new tokens, streamed, so the conversation grows past
// the per-sequence budget and every turn after the first can reuse the slot's cache. Measured:
// conversations completed (every turn answered 200), requests failed (by status), generated
// tokens/s over all clients (wall time), time to first token and the gap between stream events
// (per-token latency) p50/p99, the server's peak RSS (/proc/PID/status), and with kvevict's
// /metrics the pool's use over time. Protocols: kvevict (POST /v1/completions with return_tokens)
// and llama-server (its POST /completion with return_tokens, which sends token ids per event).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

// After everything that may include Eigen: httplib.h includes <resolv.h>, whose _res macro
// breaks Eigen's parameters of that name.
#include <httplib.h>

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Options {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string protocol = "kvevict";
  int clients = 4;
  int turns = 4;
  int first_tokens = 128;
  int turn_tokens = 32;
  int max_tokens = 32;
  int min_id = 0;  // new tokens are drawn from [min_id, vocab)
  int vocab = 256;
  std::string kv_policy;
  int kv_budget = 0;
  std::string api_key;
  int server_pid = 0;
  int sample_ms = 100;
  int timeout_seconds = 600;
  std::string series;  // CSV of samples (seconds, rss_mib, pool_used_cells)
  bool json = false;
};

struct Turn {
  int status = 0;  // HTTP status, 0 when no response
  double ttft = 0;
  std::vector<double> gaps;
  int generated = 0;
};

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto index = static_cast<std::size_t>(p * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(index, values.size() - 1)];
}

std::int64_t rss_kib(int pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// kvevict_pool_used_cells from kvevict's /metrics; -1 when absent.
std::int64_t pool_used(httplib::Client& client) {
  const httplib::Result metrics = client.Get("/metrics");
  if (!metrics || metrics->status != 200) return -1;
  const std::string key = "\nkvevict_pool_used_cells ";
  const std::size_t at = metrics->body.find(key);
  if (at == std::string::npos) return -1;
  return std::stoll(metrics->body.substr(at + key.size()));
}

// One streamed request: the events' times and the generated token ids.
Turn run_turn(const Options& options, const std::vector<std::int32_t>& prompt,
              std::vector<std::int32_t>& generated) {
  httplib::Client client(options.host, options.port);
  client.set_read_timeout(options.timeout_seconds, 0);
  json body;
  httplib::Request request;
  request.method = "POST";
  if (options.protocol == "kvevict") {
    request.path = "/v1/completions";
    body = {{"prompt", prompt},   {"max_tokens", options.max_tokens},
            {"stream", true},     {"temperature", 0},
            {"ignore_eos", true}, {"return_tokens", true}};
    if (!options.kv_policy.empty()) body["kv_policy"] = options.kv_policy;
    if (options.kv_budget > 0) body["kv_budget"] = options.kv_budget;
  } else {
    request.path = "/completion";
    body = {{"prompt", prompt},    {"n_predict", options.max_tokens},
            {"stream", true},      {"temperature", 0},
            {"ignore_eos", true},  {"return_tokens", true},
            {"cache_prompt", true}};
  }
  request.body = body.dump();
  request.set_header("Content-Type", "application/json");
  request.set_header("Host", options.host);
  if (!options.api_key.empty()) request.set_header("Authorization", "Bearer " + options.api_key);
  Turn turn;
  const Clock::time_point sent = Clock::now();
  Clock::time_point last = sent;
  std::string pending;
  generated.clear();
  const auto on_event = [&](const std::string& data) {
    if (data == "[DONE]") return;
    const json event = json::parse(data, nullptr, false);
    if (!event.is_object()) return;
    const Clock::time_point now = Clock::now();
    bool has_tokens = false;
    if (options.protocol == "kvevict") {
      if (!event.contains("choices") || event["choices"].empty()) return;
      const json& choice = event["choices"][0];
      if (choice.contains("tokens")) generated = choice["tokens"].get<std::vector<std::int32_t>>();
      has_tokens = choice.value("text", std::string()).size() > 0;
    } else if (event.contains("tokens")) {
      const auto tokens = event["tokens"].get<std::vector<std::int32_t>>();
      generated.insert(generated.end(), tokens.begin(), tokens.end());
      has_tokens = !tokens.empty();
    }
    if (!has_tokens) return;
    if (turn.ttft == 0) {
      turn.ttft = std::chrono::duration<double>(now - sent).count();
    } else {
      turn.gaps.push_back(std::chrono::duration<double>(now - last).count());
    }
    last = now;
  };
  request.content_receiver = [&](const char* data, std::size_t length, std::uint64_t,
                                 std::uint64_t) {
    pending.append(data, length);
    for (std::size_t end = pending.find("\n\n"); end != std::string::npos;
         end = pending.find("\n\n")) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) == 0) on_event(event.substr(6));
    }
    return true;
  };
  httplib::Response response;
  httplib::Error error = httplib::Error::Success;
  if (client.send(request, response, error)) turn.status = response.status;
  turn.generated = static_cast<int>(generated.size());
  return turn;
}

int run(const Options& options) {
  if (options.host != "127.0.0.1" && options.host != "localhost" && options.host != "::1") {
    std::fprintf(stderr, "serve_load: loopback only (--host 127.0.0.1)\n");
    return 2;
  }
  if (options.protocol != "kvevict" && options.protocol != "llama-server") {
    std::fprintf(stderr, "serve_load: --protocol is kvevict or llama-server\n");
    return 2;
  }
  std::mutex mutex;
  std::vector<Turn> turns;
  int completed = 0;
  std::atomic<bool> done{false};
  std::int64_t peak_rss = -1;
  std::int64_t peak_pool = -1;
  double pool_sum = 0;
  int pool_samples = 0;
  std::vector<std::string> series;
  const Clock::time_point start = Clock::now();
  std::thread sampler([&] {
    httplib::Client client(options.host, options.port);
    client.set_read_timeout(5, 0);
    if (!options.api_key.empty()) {
      client.set_default_headers({{"Authorization", "Bearer " + options.api_key}});
    }
    while (!done.load()) {
      const std::int64_t rss = options.server_pid > 0 ? rss_kib(options.server_pid) : -1;
      const std::int64_t pool = options.protocol == "kvevict" ? pool_used(client) : -1;
      peak_rss = std::max(peak_rss, rss);
      if (pool >= 0) {
        peak_pool = std::max(peak_pool, pool);
        pool_sum += static_cast<double>(pool);
        ++pool_samples;
      }
      series.push_back(std::to_string(std::chrono::duration<double>(Clock::now() - start).count()) +
                       "," + std::to_string(static_cast<double>(rss) / 1024.0) + "," +
                       std::to_string(pool));
      std::this_thread::sleep_for(std::chrono::milliseconds(options.sample_ms));
    }
  });
  std::vector<std::thread> clients;
  for (int c = 0; c < options.clients; ++c) {
    clients.emplace_back([&, c] {
      std::vector<std::int32_t> conversation;
      std::vector<std::int32_t> generated;
      bool all_ok = true;
      for (int t = 0; t < options.turns; ++t) {
        const int fresh = t == 0 ? options.first_tokens : options.turn_tokens;
        for (int i = 0; i < fresh; ++i) {
          // Deterministic, different per client and turn.
          const std::int64_t span = options.vocab - options.min_id;
          conversation.push_back(static_cast<std::int32_t>(
              options.min_id +
              (static_cast<std::int64_t>(c) * 7919 + t * 104729 + i * 31 + 1) % span));
        }
        const Turn turn = run_turn(options, conversation, generated);
        {
          const std::lock_guard lock(mutex);
          turns.push_back(turn);
        }
        if (turn.status != 200) {
          all_ok = false;
          break;
        }
        conversation.insert(conversation.end(), generated.begin(), generated.end());
      }
      if (all_ok) {
        const std::lock_guard lock(mutex);
        ++completed;
      }
    });
  }
  for (std::thread& client : clients) client.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  done.store(true);
  sampler.join();

  std::vector<double> ttft;
  std::vector<double> gaps;
  std::int64_t generated = 0;
  std::vector<std::pair<int, int>> failures;  // status, count
  for (const Turn& turn : turns) {
    if (turn.status == 200) {
      ttft.push_back(turn.ttft);
      gaps.insert(gaps.end(), turn.gaps.begin(), turn.gaps.end());
      generated += turn.generated;
      continue;
    }
    auto it = std::find_if(failures.begin(), failures.end(),
                           [&](const auto& f) { return f.first == turn.status; });
    if (it == failures.end()) {
      failures.emplace_back(turn.status, 1);
    } else {
      ++it->second;
    }
  }
  json failed = json::object();
  int failed_total = 0;
  for (const auto& [status, count] : failures) {
    failed[std::to_string(status)] = count;
    failed_total += count;
  }
  const json result = {
      {"protocol", options.protocol},
      {"clients", options.clients},
      {"turns", options.turns},
      {"conversations_completed", completed},
      {"requests", turns.size()},
      {"requests_failed", failed_total},
      {"failed_by_status", failed},
      {"generated_tokens", generated},
      {"seconds", seconds},
      {"tokens_per_second", seconds > 0 ? static_cast<double>(generated) / seconds : 0.0},
      {"ttft_p50_ms", percentile(ttft, 0.5) * 1e3},
      {"ttft_p99_ms", percentile(ttft, 0.99) * 1e3},
      {"token_latency_p50_ms", percentile(gaps, 0.5) * 1e3},
      {"token_latency_p99_ms", percentile(gaps, 0.99) * 1e3},
      {"peak_rss_mib", peak_rss >= 0 ? static_cast<double>(peak_rss) / 1024.0 : -1.0},
      {"pool_peak_cells", peak_pool},
      {"pool_mean_cells", pool_samples > 0 ? pool_sum / pool_samples : -1.0}};
  if (!options.series.empty()) {
    std::ofstream out(options.series);
    out << "seconds,rss_mib,pool_used_cells\n";
    for (const std::string& line : series) out << line << '\n';
  }
  if (options.json) {
    std::printf("%s\n", result.dump().c_str());
  } else {
    std::printf(
        "%s: %d/%d conversations completed, %zu requests (%d failed), %lld tokens in %.2f s: "
        "%.1f tokens/s; first token p50 %.1f ms p99 %.1f ms; per token p50 %.2f ms p99 %.2f ms; "
        "peak RSS %.1f MiB; pool peak %lld cells, mean %.0f\n",
        options.protocol.c_str(), completed, options.clients, turns.size(), failed_total,
        static_cast<long long>(generated), seconds, result["tokens_per_second"].get<double>(),
        result["ttft_p50_ms"].get<double>(), result["ttft_p99_ms"].get<double>(),
        result["token_latency_p50_ms"].get<double>(), result["token_latency_p99_ms"].get<double>(),
        result["peak_rss_mib"].get<double>(), static_cast<long long>(peak_pool),
        result["pool_mean_cells"].get<double>());
  }
  return completed == options.clients ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"serve_load: concurrent multi-turn conversations against a server on loopback",
               "serve_load"};
  app.add_option("--host", options.host, "server address (loopback only)")->capture_default_str();
  app.add_option("--port", options.port, "server port")->capture_default_str();
  app.add_option("--protocol", options.protocol, "kvevict or llama-server")->capture_default_str();
  app.add_option("--clients", options.clients, "concurrent conversations")->capture_default_str();
  app.add_option("--turns", options.turns, "turns per conversation")->capture_default_str();
  app.add_option("--first-tokens", options.first_tokens, "prompt tokens of the first turn")
      ->capture_default_str();
  app.add_option("--turn-tokens", options.turn_tokens, "new prompt tokens of each later turn")
      ->capture_default_str();
  app.add_option("--max-tokens", options.max_tokens, "tokens generated per turn")
      ->capture_default_str();
  app.add_option("--min-id", options.min_id, "prompt token ids are drawn from [min-id, vocab)")
      ->capture_default_str();
  app.add_option("--vocab", options.vocab, "prompt token ids are drawn from [min-id, vocab)")
      ->capture_default_str();
  app.add_option("--kv-policy", options.kv_policy, "kvevict: the requests' kv_policy");
  app.add_option("--kv-budget", options.kv_budget, "kvevict: the requests' kv_budget");
  app.add_option("--api-key", options.api_key, "Authorization: Bearer KEY");
  app.add_option("--server-pid", options.server_pid, "the server's pid, for its RSS");
  app.add_option("--sample-ms", options.sample_ms, "RSS / pool sampling period")
      ->capture_default_str();
  app.add_option("--timeout", options.timeout_seconds, "read timeout of a request, seconds")
      ->capture_default_str();
  app.add_option("--series", options.series, "write the samples as CSV to this file");
  app.add_flag("--json", options.json, "print one JSON object");
  CLI11_PARSE(app, argc, argv);
  if (options.clients < 1 || options.turns < 1 || options.first_tokens < 1 ||
      options.turn_tokens < 0 || options.max_tokens < 1 || options.min_id < 0 ||
      options.vocab <= options.min_id || options.sample_ms < 1 || options.timeout_seconds < 1) {
    std::fprintf(stderr, "serve_load: counts must be positive\n");
    return 2;
  }
  return run(options);
}
