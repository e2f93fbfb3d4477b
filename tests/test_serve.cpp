// `kvevict-llama serve` (src/llama/serve) on loopback, over GGUFs kvevict writes: a random-weight
// model and toy-base. Every server listens on 127.0.0.1 at a port the system picks; every request
// has a bounded size and every wait a deadline.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <llama.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <kvevict/error.hpp>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/llama/llama_sequence_set.hpp>
#include <kvevict/model/random_model.hpp>
#include <kvevict/policy_registry.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness/sampling.hpp"
#include "llama/cli/llama_model.hpp"
#include "llama/cli/llama_options.hpp"
#include "llama/serve/openai.hpp"
#include "llama/serve/server.hpp"
#include "llama/serve/text.hpp"
#include "model/model_io.hpp"

// After Eigen (model_io.hpp): httplib.h includes <resolv.h>, whose _res macro breaks Eigen's
// parameters of that name.
#include <httplib.h>

namespace {

namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

using kvevict::llama_cli::LlamaModel;
using kvevict::llama_serve::ServeOptions;
using kvevict::llama_serve::Server;
using nlohmann::json;
using namespace std::chrono_literals;

class Models : public ::testing::Environment {
 public:
  void SetUp() override {
    kvevict::llama_cli::quiet_llama_log();
    kvevict::model::ModelConfig config;
    config.dim = 64;
    config.hidden_dim = 160;
    config.layers = 2;
    config.heads = 4;
    config.kv_heads = 2;
    config.vocab_size = 259;
    config.context_length = 2048;
    const std::string pid = std::to_string(getpid());
    random_path = fs::temp_directory_path() / ("kvevict_test_serve_random_" + pid + ".gguf");
    kvevict::model::write_gguf(kvevict::model::make_random_model(config, 21), random_path);
    random = std::make_unique<LlamaModel>(random_path.string(), 0);
    toy_path = fs::temp_directory_path() / ("kvevict_test_serve_toy_" + pid + ".gguf");
    kvevict::model::write_gguf(
        kvevict::model::load_model(fs::path(KVEVICT_SOURCE_DIR) / "models/toy-base"), toy_path);
    toy = std::make_unique<LlamaModel>(toy_path.string(), 0);
  }
  void TearDown() override {
    random.reset();
    toy.reset();
    std::error_code ignored;
    fs::remove(random_path, ignored);
    fs::remove(toy_path, ignored);
  }
  static inline fs::path random_path;
  static inline fs::path toy_path;
  static inline std::unique_ptr<LlamaModel> random;
  static inline std::unique_ptr<LlamaModel> toy;
};

const auto* const kModels = ::testing::AddGlobalTestEnvironment(new Models);

ServeOptions small_options() {
  ServeOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.parallel = 2;
  options.queue = 4;
  options.llama.context = 512;
  options.llama.flash_attention = "off";  // softmax rows as llama.cpp computes them
  options.policy.chunk = 16;
  options.alias = "test-model";
  return options;
}

// A server on a free loopback port, run on its own thread; shut down (drained) at the end.
class RunningServer {
 public:
  RunningServer(const LlamaModel& model, ServeOptions options)
      : server_(std::make_unique<Server>(model, std::move(options))), port_(server_->bind()) {
    thread_ = std::thread([this] { server_->run(); });
  }
  ~RunningServer() {
    server_->shutdown(10s);
    thread_.join();
  }
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;

  [[nodiscard]] httplib::Client client() const {
    httplib::Client client("127.0.0.1", port_);
    client.set_read_timeout(60, 0);
    client.set_connection_timeout(5, 0);
    return client;
  }
  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] Server& server() { return *server_; }

 private:
  std::unique_ptr<Server> server_;
  int port_;
  std::thread thread_;
};

struct Reply {
  int status = 0;
  json body;
  std::string raw;
  std::string retry_after;
};

Reply post(const RunningServer& server, const std::string& path, const std::string& body,
           const httplib::Headers& headers = {}) {
  httplib::Client client = server.client();
  const httplib::Result result = client.Post(path, headers, body, "application/json");
  Reply reply;
  if (!result) {
    ADD_FAILURE() << "no response from " << path << ": " << httplib::to_string(result.error());
    return reply;
  }
  reply.status = result->status;
  reply.raw = result->body;
  reply.retry_after = result->get_header_value("Retry-After");
  reply.body = json::parse(result->body, nullptr, /*allow_exceptions=*/false);
  return reply;
}

Reply post(const RunningServer& server, const std::string& path, const char* body) {
  return post(server, path, std::string(body), {});
}

Reply post(const RunningServer& server, const std::string& path, const json& body) {
  return post(server, path, body.dump(), {});
}

std::string error_message(const Reply& reply) {
  if (!reply.body.is_object() || !reply.body.contains("error")) return "(no error object)";
  return reply.body["error"].value("message", std::string());
}

template <typename Predicate>
bool eventually(Predicate predicate, std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return predicate();
}

std::vector<std::int32_t> token_range(int count, int seed) {
  std::vector<std::int32_t> tokens;
  for (int i = 0; i < count; ++i) tokens.push_back((seed * 37 + i * 11 + 3) % 256);
  return tokens;
}

// A connected loopback socket with a receive timeout, or -1.
int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` as it is and returns what arrives until `until` or the end (or a timeout).
std::string raw_exchange(int port, const std::string& request,
                         const std::string& until = "\r\n\r\n") {
  const int fd = connect_loopback(port);
  if (fd < 0) return {};
  std::string received;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    char buffer[4096];
    while (received.find(until) == std::string::npos) {
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n <= 0) break;
      received.append(buffer, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  return received;
}

// ---------------------------------------------------------------------------------------------
// Pieces without a server.

TEST(ServeText, StopStringsAndWholeCharactersAreHeldBack) {
  using kvevict::llama_serve::emittable;
  using kvevict::llama_serve::find_stop;
  const std::vector<std::string> stops = {"END", "\n\n"};
  EXPECT_EQ(find_stop("abc END x", stops, 0), std::optional<std::size_t>(4));
  EXPECT_EQ(find_stop("a\n\nEND", stops, 0), std::optional<std::size_t>(1));
  EXPECT_EQ(find_stop("abc EN", stops, 0), std::nullopt);
  // "abc EN" may become "abc END": "EN" waits; "abc E\n" may become a "\n\n".
  EXPECT_EQ(emittable("abc EN", 0, stops), 4U);
  EXPECT_EQ(emittable("abc E\n", 0, stops), 5U);
  EXPECT_EQ(emittable("abc", 0, stops), 3U);
  // U+00E9 is C3 A9: a lone C3 at the end waits for its second byte; a whole one goes.
  EXPECT_EQ(emittable("caf\xC3", 0, {}), 3U);
  EXPECT_EQ(emittable("caf\xC3\xA9", 0, {}), 5U);
  // U+20AC is E2 82 AC: two of three bytes wait.
  EXPECT_EQ(emittable("x\xE2\x82", 0, {}), 1U);
  // Never before what was sent already.
  EXPECT_EQ(emittable("abc EN", 6, stops), 6U);
}

TEST(ServeAuth, ConstantTimeCompareAndExposureWarning) {
  using kvevict::llama_serve::constant_time_equal;
  EXPECT_TRUE(constant_time_equal("Bearer k1", "Bearer k1"));
  EXPECT_FALSE(constant_time_equal("Bearer k1", "Bearer k2"));
  EXPECT_FALSE(constant_time_equal("Bearer k1", "Bearer k1x"));
  EXPECT_FALSE(constant_time_equal("", "Bearer k1"));
  ServeOptions options;
  options.host = "127.0.0.1";
  EXPECT_EQ(kvevict::llama_serve::exposure_warning(options), "");
  options.host = "0.0.0.0";
  EXPECT_NE(kvevict::llama_serve::exposure_warning(options).find("without --api-key"),
            std::string::npos);
  options.api_key = "k";
  EXPECT_EQ(kvevict::llama_serve::exposure_warning(options), "");
  options.host = "::1";
  options.api_key.clear();
  EXPECT_EQ(kvevict::llama_serve::exposure_warning(options), "");
}

// ---------------------------------------------------------------------------------------------
// Endpoints.

TEST(Serve, HealthModelsAndUnknownEndpoints) {
  RunningServer server(*Models::random, small_options());
  httplib::Client client = server.client();
  const httplib::Result health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(json::parse(health->body)["status"], "ok");
  const httplib::Result models = client.Get("/v1/models");
  ASSERT_TRUE(models);
  const json list = json::parse(models->body);
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 1U);
  EXPECT_EQ(list["data"][0]["id"], "test-model");
  const httplib::Result missing = client.Get("/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(json::parse(missing->body)["error"]["code"], 404);
}

// The chatml fallback of a model without a template: the prompt is BOS plus the rendered bytes.
TEST(Serve, ChatWithoutATemplateUsesChatml) {
  RunningServer server(*Models::random, small_options());
  EXPECT_NE(server.server().note().find("chatml"), std::string::npos);
  const Reply reply =
      post(server, "/v1/chat/completions",
           json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 3}});
  ASSERT_EQ(reply.status, 200) << reply.raw;
  const std::string rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(reply.body["usage"]["prompt_tokens"], 1 + rendered.size());  // BOS + one per byte
  EXPECT_EQ(reply.body["object"], "chat.completion");
  EXPECT_EQ(reply.body["choices"][0]["message"]["role"], "assistant");
  const int completion = reply.body["usage"]["completion_tokens"];
  EXPECT_EQ(reply.body["usage"]["total_tokens"], 1 + rendered.size() + completion);
}

// One conversation of three turns through the server, each turn re-sending the whole history
// plus new tokens, against LlamaSequence alone fed the same way: the same greedy tokens, the same
// evictions, the same kept positions; and the reuse the usage reports is the history's length.
void expect_conversation_as_alone(const std::string& policy, int budget) {
  ServeOptions options = small_options();
  options.parallel = 3;
  RunningServer server(*Models::random, options);

  kvevict::harness::PolicyOptions policy_options = options.policy;
  policy_options.policy = policy;
  policy_options.budget = budget;
  kvevict::harness::PolicySetup setup =
      kvevict::llama_cli::make_setup(policy_options, *Models::random);
  kvevict::llama_cli::LlamaOptions llama = options.llama;
  const auto alone =
      kvevict::llama_cli::make_llama_sequence(*Models::random, llama, setup, nullptr);

  std::vector<std::int32_t> conversation;  // what the client sends back
  std::vector<std::int32_t> fed;           // what `alone` has consumed
  for (int turn = 0; turn < 3; ++turn) {
    const std::vector<std::int32_t> user = token_range(turn == 0 ? 40 : 25, turn);
    conversation.insert(conversation.end(), user.begin(), user.end());
    const std::size_t history = fed.size();
    const int live_before = history == 0 ? 0 : alone->sequence().max_live();
    // The reference: the new tokens (after what it consumed) as one turn, then greedy generation,
    // the last token not fed (as `kvevict-llama generate`).
    const std::span<const std::int32_t> fresh =
        std::span<const std::int32_t>(conversation).subspan(history);
    kvevict::llama::LlamaLogits logits = alone->feed(fresh, /*turn_start=*/true);
    fed.insert(fed.end(), fresh.begin(), fresh.end());
    std::vector<std::int32_t> expected;
    constexpr int kMaxTokens = 30;
    for (int i = 0; i < kMaxTokens; ++i) {
      const std::int32_t token = kvevict::harness::argmax(logits.last());
      if (token == Models::random->eos_id()) break;
      expected.push_back(token);
      if (i + 1 == kMaxTokens) break;
      logits = alone->forward(std::span<const std::int32_t>(&expected.back(), 1));
      fed.push_back(token);
    }

    const Reply reply = post(server, "/v1/completions",
                             json{{"prompt", conversation},
                                  {"max_tokens", kMaxTokens},
                                  {"temperature", 0},
                                  {"kv_policy", policy},
                                  {"kv_budget", budget},
                                  {"return_tokens", true}});
    ASSERT_EQ(reply.status, 200) << reply.raw;
    const json& choice = reply.body["choices"][0];
    EXPECT_EQ(choice["tokens"].get<std::vector<std::int32_t>>(), expected)
        << policy << " turn " << turn;
    EXPECT_EQ(choice["finish_reason"],
              static_cast<int>(expected.size()) == kMaxTokens ? "length" : "stop");
    const json& usage = reply.body["usage"];
    EXPECT_EQ(usage["prompt_tokens"], conversation.size());
    EXPECT_EQ(usage["completion_tokens"], expected.size());
    EXPECT_EQ(usage["kvevict"]["reused_prompt_tokens"], history) << policy << " turn " << turn;
    EXPECT_EQ(usage["kvevict"]["evicted_prompt_tokens"], history - live_before);
    EXPECT_EQ(usage["kvevict"]["evicted_tokens"], fed.size() - alone->sequence().max_live());
    EXPECT_EQ(usage["kvevict"]["cache_tokens"], alone->sequence().max_live());
    const int slot = usage["kvevict"]["slot"];
    httplib::Client client = server.client();
    const httplib::Result slots = client.Get("/slots?kept=1");
    ASSERT_TRUE(slots);
    std::vector<std::int64_t> kept_alone;
    const kvevict::SlotTable& table = alone->sequence().slots();
    for (const std::int32_t s : table.stream_order(0)) {
      kept_alone.push_back(table.original_positions(0)[static_cast<std::size_t>(s)]);
    }
    EXPECT_EQ(json::parse(slots->body)[slot]["kept_positions"].get<std::vector<std::int64_t>>(),
              kept_alone)
        << policy << " turn " << turn;
    conversation.insert(conversation.end(), expected.begin(), expected.end());
  }
  // The conversation outgrew the budget: something was evicted and reused prompts lost tokens.
  EXPECT_GT(alone->sequence().stats().evicted_slots, 0) << policy;
  EXPECT_GT(fed.size(), static_cast<std::size_t>(alone->sequence().max_live()));
}

TEST(Serve, ConversationMatchesLlamaSequenceAloneStreamingLlm) {
  expect_conversation_as_alone("streaming_llm", 48);
}

TEST(Serve, ConversationMatchesLlamaSequenceAloneH2o) { expect_conversation_as_alone("h2o", 48); }

TEST(Serve, ConversationMatchesLlamaSequenceAloneWindow) {
  expect_conversation_as_alone("window", 40);
}

// Three conversations at once (one llama_decode per step for all): after every turn each keeps
// exactly the positions LlamaSequence alone keeps when fed the same tokens (the server's own
// generated tokens: batching may move a logit by llama.cpp's batch-vs-single rounding).
TEST(Serve, BatchedConversationsKeepWhatEachKeepsAlone) {
  ServeOptions options = small_options();
  options.parallel = 3;
  options.llama.context = 768;
  RunningServer server(*Models::random, options);
  const std::vector<std::string> policies = {"h2o", "streaming_llm", "tova"};
  std::vector<std::vector<std::vector<std::int32_t>>> sent(3);       // [client][turn] prompt
  std::vector<std::vector<std::vector<std::int32_t>>> generated(3);  // [client][turn]
  std::vector<std::vector<std::vector<std::int64_t>>> kept(3);       // [client][turn]
  std::vector<std::string> failures(3);
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&, c] {
      std::vector<std::int32_t> conversation;
      for (int turn = 0; turn < 3; ++turn) {
        const std::vector<std::int32_t> user = token_range(turn == 0 ? 100 : 30, 7 * c + turn);
        conversation.insert(conversation.end(), user.begin(), user.end());
        json request = {
            {"prompt", conversation}, {"max_tokens", 20},
            {"ignore_eos", true},     {"kv_policy", policies[static_cast<std::size_t>(c)]},
            {"kv_budget", 48},        {"return_tokens", true}};
        if (policies[static_cast<std::size_t>(c)] == "tova")
          request["kv_positions"] = "cache_index";
        const Reply reply = post(server, "/v1/completions", request);
        if (reply.status != 200) {
          failures[static_cast<std::size_t>(c)] = reply.raw;
          return;
        }
        const auto tokens = reply.body["choices"][0]["tokens"].get<std::vector<std::int32_t>>();
        const int slot = reply.body["usage"]["kvevict"]["slot"];
        httplib::Client client = server.client();
        const httplib::Result slots = client.Get("/slots?kept=1");
        if (!slots) return;
        sent[static_cast<std::size_t>(c)].push_back(conversation);
        generated[static_cast<std::size_t>(c)].push_back(tokens);
        kept[static_cast<std::size_t>(c)].push_back(
            json::parse(slots->body)[slot]["kept_positions"].get<std::vector<std::int64_t>>());
        conversation.insert(conversation.end(), tokens.begin(), tokens.end());
      }
    });
  }
  for (std::thread& client : clients) client.join();
  std::int64_t forwards_alone = 0;
  for (int c = 0; c < 3; ++c) {
    const auto index = static_cast<std::size_t>(c);
    ASSERT_EQ(failures[index], "") << policies[index];
    ASSERT_EQ(kept[index].size(), 3U);
    kvevict::harness::PolicyOptions policy = options.policy;
    policy.policy = policies[index];
    policy.budget = 48;
    if (policy.policy == "tova") policy.positions = "cache_index";
    kvevict::harness::PolicySetup setup = kvevict::llama_cli::make_setup(policy, *Models::random);
    const auto alone =
        kvevict::llama_cli::make_llama_sequence(*Models::random, options.llama, setup, nullptr);
    std::size_t fed = 0;
    for (std::size_t turn = 0; turn < 3; ++turn) {
      const std::vector<std::int32_t>& prompt = sent[index][turn];
      (void)alone->feed(std::span<const std::int32_t>(prompt).subspan(fed), true);
      const std::vector<std::int32_t>& tokens = generated[index][turn];
      for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
        (void)alone->forward(std::span<const std::int32_t>(&tokens[i], 1));
      }
      fed = prompt.size() + tokens.size() - 1;
      std::vector<std::int64_t> expected;
      const kvevict::SlotTable& table = alone->sequence().slots();
      for (const std::int32_t s : table.stream_order(0)) {
        expected.push_back(table.original_positions(0)[static_cast<std::size_t>(s)]);
      }
      EXPECT_EQ(kept[index][turn], expected) << policies[index] << " turn " << turn;
    }
    forwards_alone += alone->stats().forwards;
  }
  // They shared steps: fewer llama_decode calls than the three alone.
  EXPECT_LT(server.server().engine().metrics().steps, forwards_alone);
}

// A chat client re-sends the whole conversation, the assistant's answer included: the second turn
// continues the slot (the chatml rendering of turn one is a prefix of turn two's, and toy-base
// writes ASCII, one token per byte), and feeds only what is new.
TEST(Serve, ChatSecondTurnReusesTheSlot) {
  RunningServer server(*Models::toy, small_options());
  json messages = {{{"role", "user"}, {"content", "Once upon a time"}}};
  const json first_request = {{"messages", messages},
                              {"max_tokens", 20},
                              {"kv_policy", "streaming_llm"},
                              {"kv_budget", 64}};
  const Reply first = post(server, "/v1/chat/completions", first_request);
  ASSERT_EQ(first.status, 200) << first.raw;
  const std::string answer = first.body["choices"][0]["message"]["content"];
  const int completion = first.body["usage"]["completion_tokens"];
  ASSERT_EQ(answer.size(), static_cast<std::size_t>(completion));  // one byte per token
  // What the slot consumed: the prompt and the answer, but its last token when cut by length.
  const int consumed = first.body["usage"]["prompt_tokens"].get<int>() + completion -
                       (first.body["choices"][0]["finish_reason"] == "length" ? 1 : 0);
  messages.push_back({{"role", "assistant"}, {"content", answer}});
  messages.push_back({{"role", "user"}, {"content", "And then?"}});
  json second_request = first_request;
  second_request["messages"] = messages;
  const Reply second = post(server, "/v1/chat/completions", second_request);
  ASSERT_EQ(second.status, 200) << second.raw;
  EXPECT_EQ(second.body["usage"]["kvevict"]["reused_prompt_tokens"], consumed);
  EXPECT_EQ(second.body["usage"]["kvevict"]["slot"], first.body["usage"]["kvevict"]["slot"]);
}

// Streams: OpenAI's framing (role first, content deltas, finish_reason, usage when asked, then
// data: [DONE]), and the same text as the request without stream (toy-base writes ASCII).
TEST(Serve, ChatStreamFramingEndsWithDone) {
  RunningServer server(*Models::toy, small_options());
  const json request = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                        {"max_tokens", 24},
                        {"kv_policy", "streaming_llm"},
                        {"kv_budget", 64}};
  const Reply whole = post(server, "/v1/chat/completions", request);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  json streaming = request;
  streaming["stream"] = true;
  streaming["stream_options"] = {{"include_usage", true}};
  const Reply stream = post(server, "/v1/chat/completions", streaming.dump());
  ASSERT_EQ(stream.status, 200);
  const std::string& raw = stream.raw;
  ASSERT_GE(raw.size(), 14U);
  EXPECT_EQ(raw.substr(raw.size() - 14), "data: [DONE]\n\n");
  std::vector<json> events;
  std::size_t at = 0;
  while (at < raw.size()) {
    const std::size_t end = raw.find("\n\n", at);
    ASSERT_NE(end, std::string::npos) << "an event not ended by a blank line";
    const std::string event = raw.substr(at, end - at);
    ASSERT_EQ(event.rfind("data: ", 0), 0U) << event;
    if (event != "data: [DONE]") events.push_back(json::parse(event.substr(6)));
    at = end + 2;
  }
  ASSERT_GE(events.size(), 3U);
  EXPECT_EQ(events.front()["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  for (std::size_t i = 1; i + 2 < events.size(); ++i) {
    EXPECT_EQ(events[i]["object"], "chat.completion.chunk");
    EXPECT_TRUE(events[i]["choices"][0]["finish_reason"].is_null());
    content += events[i]["choices"][0]["delta"].value("content", std::string());
  }
  const json& last = events[events.size() - 2];
  EXPECT_EQ(last["choices"][0]["finish_reason"], whole.body["choices"][0]["finish_reason"]);
  EXPECT_TRUE(events.back()["choices"].empty());
  EXPECT_EQ(events.back()["usage"]["completion_tokens"], whole.body["usage"]["completion_tokens"]);
  EXPECT_EQ(content, whole.body["choices"][0]["message"]["content"]);
  EXPECT_FALSE(content.empty());
}

// A stop string ends the text before it, streamed or not.
TEST(Serve, StopStringEndsTheTextBeforeIt) {
  RunningServer server(*Models::toy, small_options());
  const json plain = {{"prompt", "The"}, {"max_tokens", 40}};
  const Reply free_run = post(server, "/v1/completions", plain);
  ASSERT_EQ(free_run.status, 200) << free_run.raw;
  const std::string text = free_run.body["choices"][0]["text"];
  ASSERT_GE(text.size(), 6U);
  const std::string stop = text.substr(3, 2);  // occurs first at 3, or earlier
  const std::size_t first = text.find(stop);
  json stopped = plain;
  stopped["stop"] = {stop};
  const Reply reply = post(server, "/v1/completions", stopped);
  ASSERT_EQ(reply.status, 200);
  EXPECT_EQ(reply.body["choices"][0]["text"], text.substr(0, first));
  EXPECT_EQ(reply.body["choices"][0]["finish_reason"], "stop");
  stopped["stream"] = true;
  const Reply stream = post(server, "/v1/completions", stopped.dump());
  std::string content;
  for (std::size_t at = stream.raw.find("data: {"); at != std::string::npos;
       at = stream.raw.find("data: {", at + 1)) {
    const std::size_t end = stream.raw.find("\n\n", at);
    content += json::parse(stream.raw.substr(at + 6, end - at - 6))["choices"][0].value(
        "text", std::string());
  }
  EXPECT_EQ(content, text.substr(0, first)) << stream.raw;
}

// ---------------------------------------------------------------------------------------------
// Bad input: a clear error, and the server lives on.

TEST(Serve, BadRequestsNameTheField) {
  ServeOptions options = small_options();
  options.max_tokens_limit = 100;
  RunningServer server(*Models::random, options);
  const auto expect_400 = [&](const std::string& body, const std::string& words) {
    const Reply reply = post(server, "/v1/completions", body);
    EXPECT_EQ(reply.status, 400) << body;
    EXPECT_NE(error_message(reply).find(words), std::string::npos)
        << body << " -> " << error_message(reply);
    EXPECT_EQ(reply.body["error"]["type"], "invalid_request_error");
  };
  expect_400(R"({"prompt": "a", )", "not valid JSON");
  expect_400(R"([1, 2])", "JSON object");
  expect_400(R"({"max_tokens": 5})", "prompt: required");
  expect_400(R"({"prompt": "a", "max_tokens": "ten"})", "max_tokens: expected an integer");
  expect_400(R"({"prompt": "a", "max_tokens": 0})", "max_tokens: must be at least 1");
  expect_400(R"({"prompt": "a", "max_tokens": 101})", "--max-tokens-limit");
  expect_400(R"({"prompt": "a", "temperature": -1})", "temperature");
  expect_400(R"({"prompt": "a", "top_p": 0})", "top_p");
  expect_400(R"({"prompt": "a", "stop": [1]})", "stop[0]: expected a string");
  expect_400(R"({"prompt": [1, 999]})", "prompt[1]: token 999 is outside the vocabulary");
  expect_400(R"({"prompt": "a", "n": 2})", "n:");
  expect_400(R"({"prompt": "a", "kv_policy": "nope"})", "unknown policy 'nope'");
  expect_400(R"({"prompt": "a", "kv_policy": "window", "kv_budget": 0})", "kv_budget");
  // A slot holds 512 / 2 cells: a budget of 300 can never fit.
  expect_400(R"({"prompt": "a", "kv_policy": "window", "kv_budget": 300})", "256 cells");
  expect_400(R"({"prompt": "a", "kv_granularity": "sideways"})", "kv_granularity");
  const Reply chat = post(server, "/v1/chat/completions", R"({"messages": [{"content": "x"}]})");
  EXPECT_EQ(chat.status, 400);
  EXPECT_NE(error_message(chat).find("messages[0].role: required"), std::string::npos);
  // Still serving.
  EXPECT_EQ(post(server, "/v1/completions", R"({"prompt": "a", "max_tokens": 2})").status, 200);
}

// Longer than the context: 400 under full (it keeps every token), streamed through the cache in
// chunks under a bounded policy.
TEST(Serve, PromptLongerThanTheContext) {
  RunningServer server(*Models::random, small_options());  // 256 cells a slot
  const std::vector<std::int32_t> prompt = token_range(600, 5);
  const Reply full = post(server, "/v1/completions",
                          json{{"prompt", prompt}, {"max_tokens", 4}, {"kv_policy", "full"}});
  EXPECT_EQ(full.status, 400);
  EXPECT_NE(error_message(full).find("does not fit"), std::string::npos) << error_message(full);
  const Reply bounded =
      post(server, "/v1/completions",
           json{{"prompt", prompt}, {"max_tokens", 4}, {"kv_policy", "window"}, {"kv_budget", 64}});
  ASSERT_EQ(bounded.status, 200) << bounded.raw;
  const json& usage = bounded.body["usage"];
  EXPECT_EQ(usage["prompt_tokens"], 600);
  // Window keeps its last 64 tokens of the 600 fed plus the generated ones but the last (or all
  // of them, ended by EOS).
  const int generated = usage["completion_tokens"];
  const bool by_length = bounded.body["choices"][0]["finish_reason"] == "length";
  const int fed = 600 + (by_length ? generated - 1 : generated);
  EXPECT_EQ(usage["kvevict"]["cache_tokens"], 64);
  EXPECT_EQ(usage["kvevict"]["evicted_tokens"], fed - 64);
}

// A pool cannot hold a policy that keeps every token: refused at startup as the server's own
// policy, with 400 as a request's.
TEST(Serve, PoolRefusesUnboundedPolicies) {
  ServeOptions options = small_options();
  options.kv_pool = 256;
  EXPECT_THROW(Server(*Models::random, options), kvevict::Error);
  options.policy.policy = "window";
  options.policy.budget = 64;
  RunningServer server(*Models::random, options);
  const Reply full =
      post(server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1, "kv_policy": "full"})");
  EXPECT_EQ(full.status, 400);
  EXPECT_NE(error_message(full).find("cannot share the KV pool"), std::string::npos)
      << error_message(full);
  EXPECT_EQ(post(server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1})").status, 200);
}

TEST(Serve, BodyLimitsAreEnforcedBeforeReading) {
  ServeOptions options = small_options();
  options.max_body_bytes = 1000;
  RunningServer server(*Models::random, options);
  const std::string big = json{{"prompt", std::string(2000, 'a')}, {"max_tokens", 1}}.dump();
  const Reply too_big = post(server, "/v1/completions", big);
  EXPECT_EQ(too_big.status, 413);
  EXPECT_NE(error_message(too_big).find("--max-body-bytes"), std::string::npos);
  // A chunked body has no Content-Length to check: refused.
  const std::string chunk = R"({"prompt":"a","max_tokens":1})";
  std::ostringstream chunked;
  chunked
      << "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      << "Transfer-Encoding: chunked\r\n\r\n"
      << std::hex << chunk.size() << "\r\n"
      << chunk << "\r\n0\r\n\r\n";
  EXPECT_EQ(raw_exchange(server.port(), chunked.str()).rfind("HTTP/1.1 411", 0), 0U);
  // So is a body without a length.
  EXPECT_EQ(raw_exchange(server.port(),
                         "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Connection: close\r\n\r\n")
                .rfind("HTTP/1.1 411", 0),
            0U);
  EXPECT_EQ(post(server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1})").status, 200);
}

TEST(Serve, ApiKeyIsRequiredButNotForHealth) {
  ServeOptions options = small_options();
  options.api_key = "s3cret";
  RunningServer server(*Models::random, options);
  const std::string body = R"({"prompt": "a", "max_tokens": 1})";
  const Reply missing = post(server, "/v1/completions", body);
  EXPECT_EQ(missing.status, 401);
  EXPECT_EQ(missing.body["error"]["type"], "authentication_error");
  EXPECT_EQ(post(server, "/v1/completions", body, {{"Authorization", "Bearer s3cre"}}).status, 401);
  EXPECT_EQ(post(server, "/v1/completions", body, {{"Authorization", "Bearer s3cret"}}).status,
            200);
  httplib::Client client = server.client();
  const httplib::Result health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  const httplib::Result metrics = client.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 401);
}

// parallel 1 + queue 1: a third request while two are in gets 503 with Retry-After.
TEST(Serve, FullQueueGets503WithRetryAfter) {
  ServeOptions options = small_options();
  options.parallel = 1;
  options.queue = 1;
  RunningServer server(*Models::random, options);
  const std::string slow = json{
      {"prompt", "go"},
      {"max_tokens", 3000},
      {"ignore_eos", true},
      {"kv_policy", "window"},
      {"kv_budget", 32}}.dump();
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&] {
      if (post(server, "/v1/completions", slow).status == 200) ++ok;
    });
  }
  ASSERT_TRUE(eventually([&] {
    const auto metrics = server.server().engine().metrics();
    return metrics.active == 1 && metrics.queued == 1;
  }));
  const Reply refused = post(server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1})");
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(refused.retry_after, "1");
  EXPECT_NE(error_message(refused).find("queue is full"), std::string::npos);
  for (std::thread& client : clients) client.join();
  EXPECT_EQ(ok.load(), 2);
  EXPECT_EQ(post(server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1})").status, 200);
}

// ---------------------------------------------------------------------------------------------
// Clients that leave mid-stream.

std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  std::size_t resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

// Sends a streaming request on a raw socket, reads until the first event, and closes.
bool stream_and_leave(int port, const std::string& body) {
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  // A client whose slot is still being freed by its previous, cancelled request may find the
  // queue full: it retries after a while, as an OpenAI client does on 503 (bounded).
  for (int attempt = 0; attempt < 500; ++attempt) {
    const std::string reply = raw_exchange(port, request, "data: ");
    if (reply.find("data: ") != std::string::npos) return true;
    if (reply.rfind("HTTP/1.1 503", 0) != 0) return false;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

TEST(Serve, ClientsLeavingMidStreamFreeTheirSlots) {
  ServeOptions options = small_options();
  options.parallel = 4;
  options.queue = 8;
  options.llama.context = 1024;
  options.kv_pool = 512;
  options.policy.policy = "streaming_llm";
  options.policy.budget = 64;
  RunningServer server(*Models::random, options);
  const auto baseline = server.server().engine().metrics();
  EXPECT_EQ(baseline.pool_used, 0);
  const std::string body =
      json{{"prompt", "leave me"}, {"max_tokens", 4000},           {"ignore_eos", true},
           {"stream", true},       {"kv_policy", "streaming_llm"}, {"kv_budget", 64}}
          .dump();
  const auto settle = [&] {
    return eventually([&] {
      const auto metrics = server.server().engine().metrics();
      return metrics.active == 0 && metrics.queued == 0 && metrics.pool_used == 0;
    });
  };
  const auto leave = [&](int count) {
    std::atomic<int> events{0};
    std::vector<std::thread> clients;
    for (int c = 0; c < 4; ++c) {
      clients.emplace_back([&] {
        for (int i = 0; i < count / 4; ++i) events += stream_and_leave(server.port(), body) ? 1 : 0;
      });
    }
    for (std::thread& client : clients) client.join();
    return events.load();
  };
  EXPECT_EQ(leave(100), 100);
  ASSERT_TRUE(settle());
  const std::size_t warm = resident_bytes();
  EXPECT_EQ(leave(1000), 1000);
  ASSERT_TRUE(settle()) << "slots or pool cells still held after the clients left";
  const auto after = server.server().engine().metrics();
  EXPECT_EQ(after.pool_used, 0);
  for (const auto& slot : after.slots) {
    EXPECT_FALSE(slot.busy);
    EXPECT_EQ(slot.live_cells, 0);
  }
  EXPECT_GE(after.requests_cancelled, 1100 - after.requests_finished)
      << "failed: " << after.requests_failed << " (a request that streamed and then failed)";
  // 1,000 more requests leave the process's memory where 100 left it (within 16 MiB: allocator
  // slack, not a per-request leak of any size that matters). Under AddressSanitizer freed memory
  // waits in its quarantine (up to 256 MiB), so RSS says nothing there: LeakSanitizer checks for
  // leaks at exit instead.
  if (!kAddressSanitizer) {
    EXPECT_LT(resident_bytes(), warm + (std::size_t{16} << 20));
  }
  // And it still answers.
  EXPECT_EQ(post(server, "/v1/completions",
                 R"({"prompt": "a", "max_tokens": 2, "kv_policy": "window", "kv_budget": 32})")
                .status,
            200);
}

// Shutdown: the request in flight finishes; new ones are refused.
TEST(Serve, ShutdownDrainsAdmittedRequests) {
  ServeOptions options = small_options();
  auto server = std::make_unique<RunningServer>(*Models::random, options);
  Reply in_flight;
  std::thread client([&] {
    in_flight = post(*server, "/v1/completions",
                     json{{"prompt", "drain"},
                          {"max_tokens", 2000},
                          {"ignore_eos", true},
                          {"kv_policy", "window"},
                          {"kv_budget", 32}}
                         .dump());
  });
  ASSERT_TRUE(eventually([&] { return server->server().engine().metrics().active == 1; }));
  std::thread stopper([&] { server->server().shutdown(30s); });
  ASSERT_TRUE(eventually([&] { return server->server().engine().draining(); }));
  const Reply refused = post(*server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1})");
  EXPECT_EQ(refused.status, 503);
  client.join();
  stopper.join();
  EXPECT_EQ(in_flight.status, 200) << in_flight.raw;
  EXPECT_EQ(in_flight.body["choices"][0]["finish_reason"], "length");
  server.reset();
}

// The command: SIGTERM lets the request in flight finish, then the process exits with 0.
TEST(ServeCommand, SigtermDrainsThenExits) {
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  const std::string model = Models::random_path.string();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execl(KVEVICT_LLAMA_CLI, KVEVICT_LLAMA_CLI, "serve", model.c_str(), "--port", "0", "-c",
            "512", "--np", "2", "--chunk", "16", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  // "kvevict-llama serve: listening on http://127.0.0.1:PORT (...)"
  std::string printed;
  char buffer[256];
  while (printed.find('\n') == std::string::npos) {
    const ssize_t n = ::read(out[0], buffer, sizeof buffer);
    if (n <= 0) break;
    printed.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(out[0]);
  const std::string marker = "http://127.0.0.1:";
  const std::size_t at = printed.find(marker);
  if (at == std::string::npos) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    FAIL() << "no listening line: " << printed;
  }
  const int port = std::stoi(printed.substr(at + marker.size()));
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(60, 0);
  int reply_status = 0;
  std::string reply_body;
  std::thread request([&] {
    const httplib::Result reply = client.Post("/v1/completions",
                                              json{{"prompt", "drain"},
                                                   {"max_tokens", 3000},
                                                   {"ignore_eos", true},
                                                   {"kv_policy", "window"},
                                                   {"kv_budget", 32}}
                                                  .dump(),
                                              "application/json");
    if (reply) {
      reply_status = reply->status;
      reply_body = reply->body;
    }
  });
  httplib::Client probe("127.0.0.1", port);
  const bool active = eventually([&] {
    const httplib::Result metrics = probe.Get("/metrics");
    return metrics && metrics->body.find("kvevict_requests_active 1") != std::string::npos;
  });
  EXPECT_TRUE(active);
  ::kill(child, SIGTERM);
  request.join();
  EXPECT_EQ(reply_status, 200);
  const json body = json::parse(reply_body, nullptr, false);
  EXPECT_TRUE(body.is_object() && body.contains("choices") &&
              body["choices"][0]["finish_reason"] == "length")
      << reply_body;
  int status = -1;
  const bool exited = eventually([&] { return ::waitpid(child, &status, WNOHANG) == child; });
  if (!exited) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
  }
  EXPECT_TRUE(exited);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace

namespace {

// Runs `kvevict-llama serve` on the random model with `extra` arguments; returns the line that
// says it listens (or why it failed), and stops it.
std::string first_line_of_serve(std::vector<std::string> extra) {
  int out[2];
  if (::pipe(out) != 0) return "pipe failed";
  const std::string model = Models::random_path.string();
  std::vector<std::string> args{
      KVEVICT_LLAMA_CLI, "serve", model, "--port", "0", "-c", "512", "--np", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execv(KVEVICT_LLAMA_CLI, argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  std::string printed;
  char buffer[256];
  // llama.cpp's loader and the server's notes come first: read until it listens or fails.
  const auto outcome = [&] {
    std::size_t at = printed.find("listening on");
    if (at == std::string::npos) at = printed.find("error:");
    return at;
  };
  while (outcome() == std::string::npos || printed.find('\n', outcome()) == std::string::npos) {
    const ssize_t n = ::read(out[0], buffer, sizeof buffer);
    if (n <= 0) break;
    printed.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(out[0]);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const std::size_t at = outcome();
  return at == std::string::npos ? printed : printed.substr(at, printed.find('\n', at) - at);
}

// --kv-pool-bytes B: the pool is the cells whose K and V fit in B (f32 cells of the random model:
// layers x 2 x kv_width x 4 bytes each), and a pool given twice or below one cell is refused.
TEST(ServeCommand, KvPoolInBytesIsTheCellsThatFit) {
  const std::size_t cell =
      kvevict::llama::cell_bytes(Models::random->get(), GGML_TYPE_F32, GGML_TYPE_F32);
  const std::string bytes = std::to_string(100 * cell + cell / 2);
  EXPECT_NE(first_line_of_serve({"--kv-pool-bytes", bytes, "--policy", "window", "--budget", "32",
                                 "--kv-type", "f32"})
                .find("KV pool of 100 cells"),
            std::string::npos);
  EXPECT_NE(first_line_of_serve({"--kv-pool-bytes", std::to_string(cell - 1), "--kv-type", "f32"})
                .find("holds no cell"),
            std::string::npos);
  EXPECT_NE(first_line_of_serve({"--kv-pool-bytes", bytes, "--kv-pool", "100"})
                .find("in cells or in bytes, not both"),
            std::string::npos);
}

}  // namespace
