// Hostile input (docs/reliability.md, "Regression cases"): every finding of the fuzzing campaign
// and of the hand-made hostile files in the loaders, the replay reader and the eval configs is a
// clean kvevict::Error naming the problem, never a crash, a hang or an allocation out of proportion
// to the input; and the CLI turns each into exit status 2 with a message naming the file or option,
// within a second and under 100 MB.
//
// Each finding's code runs in a fork()ed child (run_isolated) with a time limit, so that a crash,
// a hang or a balloon fails its test instead of the suite. The inputs are the regression files of
// tests/fuzz/regressions/ (written by tests/fuzz/make_seeds.cpp), which the fuzz targets' corpus
// tests also replay.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/model/random_model.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/bounded_json.hpp"
#include "common/input_files.hpp"
#include "eval/config.hpp"
#include "fuzz/fuzz_input.hpp"
#include "model/model_io.hpp"
#include "model/safetensors.hpp"
#include "replay/replay.hpp"
#include "support/expect_error.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace std::chrono_literals;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

const fs::path kRegressions = fs::path(KVEVICT_TEST_DATA_DIR) / ".." / "fuzz" / "regressions";

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

std::string regression(const std::string& target, const std::string& name) {
  const fs::path path = kRegressions / target / name;
  EXPECT_TRUE(fs::is_regular_file(path)) << path;
  return read_text(path);
}

// --- Running code that may crash, hang or balloon ----------------------------------------------

struct Outcome {
  enum class Kind { error, returned, other_exception, crashed, timed_out };
  Kind kind = Kind::crashed;
  std::string message;  ///< the exception's what(), or the signal
  long growth_mb = 0;   ///< peak RSS growth while `action` ran
  double seconds = 0;   ///< wall time
};

// gtest prints kinds by these names in failed expectations.
void PrintTo(Outcome::Kind kind, std::ostream* out) {
  static const char* const kKinds[] = {"kvevict::Error", "returned", "another exception", "crashed",
                                       "timed out"};
  *out << kKinds[static_cast<int>(kind)];
}

std::ostream& operator<<(std::ostream& out, const Outcome& outcome) {
  PrintTo(outcome.kind, &out);
  return out << " (" << outcome.message << "; +" << outcome.growth_mb << " MB, " << outcome.seconds
             << " s)";
}

long peak_rss_kb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

// Runs `action` in a fork()ed child, which reports how it ended through a pipe. The child resets
// its peak RSS (Linux 4.0+: writing 5 to clear_refs) so that the growth is `action`'s alone.
Outcome run_isolated(const std::function<void()>& action, std::chrono::seconds limit = 10s) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return {Outcome::Kind::crashed, "pipe failed"};
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    std::ofstream("/proc/self/clear_refs") << "5";
    const long before = peak_rss_kb();
    char kind = 'r';
    std::string message;
    try {
      action();
    } catch (const kvevict::Error& error) {
      kind = 'e';
      message = error.what();
    } catch (const std::exception& error) {
      kind = 'x';
      message = error.what();
    }
    const std::string report =
        std::string(1, kind) + std::to_string((peak_rss_kb() - before) / 1024) + "\n" + message;
    std::size_t written = 0;
    while (written < report.size()) {
      const ssize_t n = write(pipe_fds[1], report.data() + written, report.size() - written);
      if (n <= 0) break;
      written += static_cast<std::size_t>(n);
    }
    _exit(0);
  }
  close(pipe_fds[1]);
  Outcome outcome;
  int status = 0;
  bool exited = false;
  while (!exited) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) {
      exited = true;
    } else if (std::chrono::steady_clock::now() - start > limit) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      close(pipe_fds[0]);
      outcome.kind = Outcome::Kind::timed_out;
      outcome.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return outcome;
    } else {
      std::this_thread::sleep_for(2ms);
    }
  }
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string report;
  char buffer[4096];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof buffer)) > 0;) report.append(buffer, n);
  close(pipe_fds[0]);
  if (!WIFEXITED(status) || report.empty()) {
    outcome.kind = Outcome::Kind::crashed;
    outcome.message = WIFSIGNALED(status) ? strsignal(WTERMSIG(status)) : "no report";
    return outcome;
  }
  const std::size_t newline = report.find('\n');
  outcome.kind = report[0] == 'e'   ? Outcome::Kind::error
                 : report[0] == 'x' ? Outcome::Kind::other_exception
                                    : Outcome::Kind::returned;
  outcome.growth_mb = std::stol(report.substr(1, newline - 1));
  outcome.message = report.substr(newline + 1);
  return outcome;
}

// `action` ends in a kvevict::Error whose message holds `fragment`, without growing the RSS by
// more than `max_growth_mb`.
void expect_clean_error(const std::function<void()>& action, std::string_view fragment,
                        long max_growth_mb = 64) {
  const Outcome outcome = run_isolated(action);
  ASSERT_EQ(outcome.kind, Outcome::Kind::error) << outcome;
  EXPECT_NE(outcome.message.find(fragment), std::string::npos)
      << "message: " << outcome.message << "\nexpected to mention: " << fragment;
  EXPECT_LE(outcome.growth_mb, max_growth_mb) << outcome;
}

kvevict::model::Model load_two_files(const std::string& input) {
  const kvevict::fuzz::TwoFiles files = kvevict::fuzz::split_two(kvevict::fuzz::as_bytes(input));
  return kvevict::model::load_safetensors(files.second, kvevict::fuzz::as_text(files.first));
}

class HostileFiles : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        fmt::format("kvevict_test_hostile_input_{}", getpid()));
    fs::create_directories(*dir_);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static fs::path path(const std::string& name) { return *dir_ / name; }
  static fs::path fifo(const std::string& name) {
    const fs::path fifo_path = path(name);
    fs::remove(fifo_path);
    EXPECT_EQ(mkfifo(fifo_path.c_str(), 0600), 0) << std::strerror(errno);
    return fifo_path;
  }
  // A safetensors model directory holding a two-file fuzz input (config.json first).
  static fs::path model_dir(const std::string& name, const std::string& input) {
    const fs::path dir = path(name);
    fs::create_directories(dir);
    const kvevict::fuzz::TwoFiles files = kvevict::fuzz::split_two(kvevict::fuzz::as_bytes(input));
    write_text(dir / "config.json", kvevict::fuzz::as_text(files.first));
    write_text(dir / "model.safetensors", kvevict::fuzz::as_text(files.second));
    return dir;
  }
  static fs::path* dir_;
};
fs::path* HostileFiles::dir_ = nullptr;

// --- Zero dimension: safetensors divided by a zero element count (SIGFPE) ------------------------

// The safetensors format allows empty tensors: [0, 5] holds 0 elements in 0 bytes.
TEST(Safetensors, ZeroDimensionIsAnEmptyTensor) {
  const Outcome outcome = run_isolated([] {
    const std::string input = regression("safetensors", "zero-dimension");
    const kvevict::fuzz::TwoFiles files = kvevict::fuzz::split_two(kvevict::fuzz::as_bytes(input));
    const auto file = kvevict::model::safetensors::parse(files.second);
    if (file.tensors.size() != 1 || file.tensors[0].shape != std::vector<std::int64_t>{0, 5} ||
        !file.data(file.tensors[0]).empty()) {
      throw std::runtime_error("not one empty [0, 5] tensor");
    }
    // A zero anywhere, followed by any count, is still 0 elements.
    json header = {
        {"t", {{"dtype", "F32"}, {"shape", {3, 0, 7, 1ULL << 50}}, {"data_offsets", {0, 0}}}}};
    const std::string text = header.dump();
    std::vector<std::byte> bytes(8 + text.size());
    const std::uint64_t length = text.size();
    std::memcpy(bytes.data(), &length, 8);
    std::memcpy(bytes.data() + 8, text.data(), text.size());
    (void)kvevict::model::safetensors::parse(bytes);
  });
  EXPECT_EQ(outcome.kind, Outcome::Kind::returned) << outcome;
}

TEST(Safetensors, ZeroDimensionBesideAValidConfigIsAShapeError) {
  expect_clean_error([] { (void)load_two_files(regression("safetensors", "zero-dimension")); },
                     "'model.embed_tokens.weight' has shape [0, 5], expected [260, 4]");
}

// --- Fuzzing finding: tensors over shared bytes
// -----------------------------------------------------

// fuzz_gguf's round trip found output.weight pointing at token_embd.weight's bytes: it loaded as
// an untied classifier aliasing the embedding, and weight_bytes() counted the two once.
TEST(SharedTensorBytes, GgufTensorsThatOverlapAreRefused) {
  expect_clean_error(
      [] {
        const std::string file = regression("gguf", "output-aliases-embedding");
        (void)kvevict::model::load_gguf(kvevict::fuzz::as_bytes(file));
      },
      "GGUF: tensors 'token_embd.weight' and 'output.weight' overlap in the data section");
}

TEST(SharedTensorBytes, SafetensorsTensorsThatOverlapAreRefused) {
  expect_clean_error(
      [] { (void)load_two_files(regression("safetensors", "lm-head-aliases-embedding")); },
      "overlap in the data section");
}

// --- Deeply nested JSON: error messages that recursed once per level -----------------------------

TEST(NestedJson, ConfigJsonHiddenActNested100000DeepIsAnError) {
  expect_clean_error(
      [] { (void)load_two_files(regression("safetensors", "hidden-act-nested-100000")); },
      "config.json nests arrays and objects deeper than 64 levels");
}

TEST(NestedJson, ConfigJsonTokenizerNested100000DeepIsAnError) {
  expect_clean_error(
      [] { (void)load_two_files(regression("safetensors", "kvevict-tokenizer-nested-100000")); },
      "config.json nests arrays and objects deeper than 64 levels");
}

TEST_F(HostileFiles, EvalConfigNameNested100000DeepIsAnError) {
  const fs::path config = path("nested-name.json");
  write_text(config, regression("eval_config", "name-nested-100000"));
  expect_clean_error([&] { (void)kvevict::eval::load_eval_config(config); },
                     "nests arrays and objects deeper than 64 levels");
}

// A document that was parsed elsewhere (no nesting limit) is still described in a bounded way.
TEST(NestedJson, EvalConfigMessagePreviewsADeepValue) {
  const Outcome outcome = run_isolated([] {
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    json config = {{"model", "m.gguf"},
                   {"policies", {{{"policy", "full"}}}},
                   {"tasks", {{{"task", "stream_bpb"}}}}};
    config["name"] = json::parse(deep);
    (void)kvevict::eval::parse_eval_config(config, "grid.json");
  });
  ASSERT_EQ(outcome.kind, Outcome::Kind::error) << outcome;
  EXPECT_NE(outcome.message.find("grid.json: name: expected a string, got array [[[[...]]]]"),
            std::string::npos)
      << outcome.message;
}

// --- Replay reader: its allocation before its logits were found ----------------------------------

TEST(Replay, LogitsOfTheWrongTypeAreFoundBeforeAnythingIsAllocated) {
  expect_clean_error(
      [] {
        (void)kvevict::replay::parse_replay_text(
            regression("replay", "logits-not-an-array-8192-tokens"));
      },
      "logits: expected an array, got the number 0", /*max_growth_mb=*/16);
}

// A short logits array for a large shape fails at the first short array, without the buffer.
TEST(Replay, ShortLogitsForALargeShapeCostNoMemory) {
  json document = json::parse(regression("replay", "logits-not-an-array-8192-tokens"));
  document["logits"] = {{{{0.5}}}};
  expect_clean_error([&] { (void)kvevict::replay::parse_replay(document); },
                     "logits[0][0]: expected 8192 entries", /*max_growth_mb=*/16);
  document.erase("logits");
  expect_clean_error([&] { (void)kvevict::replay::parse_replay(document); },
                     "logits: required key is missing", /*max_growth_mb=*/16);
}

// --- Eval configs asking for documents, turns, budgets or cells beyond reason --------------------

TEST_F(HostileFiles, EvalConfigLimits) {
  const auto load = [&](const std::string& name, const std::string& text) {
    const fs::path config = path(name);
    write_text(config, text);
    return [config] { (void)kvevict::eval::load_eval_config(config); };
  };
  expect_clean_error(load("length.json", regression("eval_config", "passkey-length-2pow40")),
                     "tasks[0].lengths[0]: must be in [1, 1048576], got 1099511627776");
  expect_clean_error(load("turns.json", regression("eval_config", "grocery-turns-2pow20-1")),
                     "tasks[0].turns[0]: must be in [1, 65535], got 1048575");
  expect_clean_error(load("cells.json", regression("eval_config", "passkey-4-million-cells")),
                     "the grid's cells (tasks x policies x budgets x task variants) exceeds the "
                     "limit of 65536");

  json grid = {{"name", "g"},
               {"model", "m.gguf"},
               {"budgets", {64}},
               {"policies", {{{"policy", "window"}}}},
               {"tasks", {{{"task", "stream_bpb"}}}}};
  const auto with = [&](const std::string& pointer, const json& value) {
    json changed = grid;
    changed[json::json_pointer(pointer)] = value;
    return changed.dump();
  };
  expect_clean_error(load("budget.json", with("/budgets/0", 1 << 24)),
                     "budgets[0]: must be in [1, 1048576], got 16777216");
  expect_clean_error(load("chunk.json", with("/chunk", 65536)),
                     "chunk: must be in [1, 4096], got 65536");
  expect_clean_error(load("tokens.json", with("/tasks/0/tokens", 1LL << 33)),
                     "tasks[0].tokens: must be in [2, 4294967296], got 8589934592");
  json unbounded = json::parse(with("/tasks/0/tokens", 1 << 21));
  unbounded["policies"].push_back({{"policy", "full"}});
  expect_clean_error(load("unbounded.json", unbounded.dump()),
                     "tasks[0].tokens: 2097152 tokens, but policy 'full' has no budget");
  json relative =
      json::parse(with("/tasks/0", {{"task", "passkey"}, {"length_x_budget", {32768}}}));
  expect_clean_error(load("relative.json", relative.dump()),
                     "length 32768 x budget 64 = 2097152 is longer than the document limit");
}

// --- FIFOs and directories where a file belongs --------------------------------------------------

TEST_F(HostileFiles, FifoAsModelIsRefusedWithoutBlocking) {
  const fs::path model = fifo("model.gguf");
  expect_clean_error([&] { (void)kvevict::model::load_model(model); },
                     "cannot open model file '" + model.string() + "': it is a FIFO");
  expect_clean_error([&] { (void)kvevict::model::load_gguf(model); }, "it is a FIFO");
}

TEST_F(HostileFiles, FifoInsideASafetensorsDirectoryIsRefused) {
  const fs::path weights = path("st-weights");
  fs::create_directories(weights);
  const auto files = kvevict::model::serialize_safetensors(kvevict::model::make_random_model(
      [] {
        kvevict::model::ModelConfig config;
        config.dim = 4;
        config.hidden_dim = 8;
        config.layers = 1;
        config.heads = 2;
        config.kv_heads = 1;
        config.vocab_size = 260;
        return config;
      }(),
      1));
  write_text(weights / "config.json", files.config_json);
  fs::remove(weights / "model.safetensors");
  ASSERT_EQ(mkfifo((weights / "model.safetensors").c_str(), 0600), 0);
  expect_clean_error([&] { (void)kvevict::model::load_model(weights); },
                     "model.safetensors': it is a FIFO");

  const fs::path config = path("st-config");
  fs::create_directories(config);
  write_text(config / "model.safetensors", kvevict::fuzz::as_text(files.tensors));
  ASSERT_EQ(mkfifo((config / "config.json").c_str(), 0600), 0);
  expect_clean_error([&] { (void)kvevict::model::load_model(config); },
                     "config.json': it is a FIFO");
}

TEST_F(HostileFiles, FifoOrDirectoryAsEvalConfigIsAnErrorNamingIt) {
  const fs::path config = fifo("grid.json");
  expect_clean_error([&] { (void)kvevict::eval::load_eval_config(config); },
                     "cannot open eval config '" + config.string() + "': it is a FIFO");
  expect_clean_error([&] { (void)kvevict::eval::load_eval_config(*dir_); },
                     "cannot open eval config '" + dir_->string() + "': it is a directory");
}

TEST_F(HostileFiles, FifoAsReplayIsRefused) {
  const fs::path replay = fifo("replay.json");
  expect_clean_error([&] { (void)kvevict::replay::load_replay(replay); }, "it is a FIFO");
}

// --- The shared helpers the fixes use (src/common)
// ------------------------------------------------

TEST(JsonPreview, IsBoundedInLengthAndDepthWhateverTheValue) {
  using kvevict::common::json_preview;
  // Iterative: a value nested 100,000 deep shows its first 3 levels.
  const json deep = json::parse(std::string(100000, '[') + std::string(100000, ']'));
  EXPECT_EQ(json_preview(deep), "[[[[...]]]]");
  EXPECT_EQ(json_preview(json::parse(R"({"a":1,"b":[1,2,{"c":[1]}],"d":{}})")),
            R"({"a":1,"b":[1,2,{"c":[...]}],"d":{}})");
  EXPECT_EQ(json_preview(json(nullptr)), "null");
  EXPECT_EQ(json_preview(json(1.5)), "1.5");
  EXPECT_EQ(json_preview(json::array()), "[]");
  EXPECT_EQ(json_preview(nlohmann::ordered_json::parse(R"({"z":1,"a":2})")), R"({"z":1,"a":2})");
  // 60 bytes, then "...": a long array and a long string alike.
  json numbers = json::array();
  for (int i = 0; i < 100000; ++i) numbers.push_back(i);
  const std::string shown = json_preview(numbers);
  // "[" and ten "d," (21 bytes), then thirteen "dd," (39 bytes): 60 bytes end after "22,".
  EXPECT_EQ(shown, "[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,...");
  EXPECT_EQ(json_preview(json(std::string(1 << 20, 'x'))), '"' + std::string(59, 'x') + "...");
}

TEST(JsonPreview, CutsAtACharacterBoundary) {
  // "é" is 2 bytes: after the opening quote, byte 60 is the first byte of the 30th "é".
  std::string accents;
  for (int i = 0; i < 100; ++i) accents += "\xc3\xa9";
  const std::string shown = kvevict::common::json_preview(json(accents));
  std::string expected = "\"";
  for (int i = 0; i < 29; ++i) expected += "\xc3\xa9";
  EXPECT_EQ(shown, expected + "...");
}

TEST(BoundedParse, RefusesNestingDeeperThan64Levels) {
  using kvevict::common::parse_json_bounded;
  const auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_NO_THROW((void)parse_json_bounded<json>(nested(64), "x"));
  kvevict::test::expect_error([&] { (void)parse_json_bounded<json>(nested(65), "config.json"); },
                              "config.json nests arrays and objects deeper than 64 levels");
  EXPECT_THROW((void)parse_json_bounded<json>("{", "x"), json::parse_error);
  EXPECT_EQ(parse_json_bounded<json>("// a comment\n[1]", "x", /*ignore_comments=*/true),
            json::array({1}));
}

TEST_F(HostileFiles, RegularFileChecks) {
  using kvevict::common::read_regular_file;
  const fs::path file = path("ten-bytes.txt");
  write_text(file, "0123456789");
  EXPECT_EQ(read_regular_file(file, "test file", 10), "0123456789");
  kvevict::test::expect_error(
      [&] { (void)read_regular_file(file, "test file", 9); },
      "test file '" + file.string() + "' is 10 bytes, more than the limit of 9");
  kvevict::test::expect_error(
      [&] { (void)read_regular_file(path("absent"), "test file", 9); },
      "cannot open test file '" + path("absent").string() + "': it does not exist");
  kvevict::test::expect_error(
      [&] { kvevict::common::require_regular_file<kvevict::replay::ReplayError>(*dir_, "dir"); },
      "it is a directory, not a regular file");
}

// --- The CLI: exit 2, naming the file or option, within a second and under 100 MB
// ------------------

#ifdef KVEVICT_CLI_PATH

struct CliRun {
  int code = -1;  ///< exit status; -1 when killed by a signal or the time limit
  bool timed_out = false;
  double seconds = 0;
  long max_rss_mb = 0;  ///< an upper bound: the larger of the CLI's peak and this test's RSS
  std::string err;
};

// fork + exec with a time limit; the exit status, wall time and peak RSS come from wait4.
CliRun run_cli(const std::vector<std::string>& arguments, const fs::path& err_file) {
  std::vector<std::string> argv_strings = {KVEVICT_CLI_PATH};
  argv_strings.insert(argv_strings.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (std::string& argument : argv_strings) argv.push_back(argument.data());
  argv.push_back(nullptr);
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_RDWR);
    const int err = open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(null, STDIN_FILENO);
    dup2(null, STDOUT_FILENO);
    dup2(err, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  CliRun run;
  int status = 0;
  rusage usage{};
  while (wait4(pid, &status, WNOHANG, &usage) != pid) {
    if (std::chrono::steady_clock::now() - start > 20s) {
      kill(pid, SIGKILL);
      wait4(pid, &status, 0, &usage);
      run.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(2ms);
  }
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.max_rss_mb = usage.ru_maxrss / 1024;
  run.err = read_text(err_file);
  return run;
}

class HostileCli : public HostileFiles {
 protected:
  // The CLI exits 2 with "kvevict: error: ..." holding `fragment`. Sanitized builds run slower and
  // keep shadow memory and a quarantine: they are held to looser limits.
  static void expect_exit_2(const std::vector<std::string>& arguments,
                            const std::string& fragment) {
    const CliRun run = run_cli(arguments, path("cli-stderr.txt"));
    std::string command = "kvevict";
    for (const std::string& argument : arguments) command.append(" ").append(argument, 0, 80);
    EXPECT_FALSE(run.timed_out) << command;
    EXPECT_EQ(run.code, 2) << command << "\n" << run.err;
    EXPECT_EQ(run.err.rfind("kvevict: error: ", 0), 0u) << command << "\n" << run.err;
    EXPECT_NE(run.err.find(fragment), std::string::npos)
        << command << "\nstderr: " << run.err << "\nexpected to mention: " << fragment;
    EXPECT_LT(run.seconds, kSanitized ? 10.0 : 1.0) << command;
    EXPECT_LT(run.max_rss_mb, kSanitized ? 400 : 100) << command;
  }
};

TEST_F(HostileCli, ModelFindings) {
  const fs::path zero = model_dir("zero", regression("safetensors", "zero-dimension"));
  expect_exit_2({"info", "--model", zero.string()},
                "cannot load model '" + zero.string() + "': safetensors: tensor");
  for (const char* name : {"hidden-act-nested-100000", "kvevict-tokenizer-nested-100000"}) {
    const fs::path nested = model_dir(name, regression("safetensors", name));
    expect_exit_2({"info", "--model", nested.string()},
                  "cannot load model '" + nested.string() + "': safetensors: config.json nests");
  }
  const fs::path aliased = path("aliased.gguf");
  write_text(aliased, regression("gguf", "output-aliases-embedding"));
  expect_exit_2({"info", "--model", aliased.string()},
                "cannot load model '" + aliased.string() + "': GGUF: tensors");
  const fs::path model = fifo("cli-model.gguf");
  expect_exit_2({"info", "--model", model.string()},
                "cannot open model file '" + model.string() + "': it is a FIFO");
  const fs::path text = path("text.txt");
  write_text(text, "some text\n");
  expect_exit_2({"stream", "--model", model.string(), "--input", text.string()},
                "cannot open model file '" + model.string() + "': it is a FIFO");
  expect_exit_2({"stream", "--model", zero.string(), "--input", text.string()},
                "cannot load model '" + zero.string() + "'");
}

TEST_F(HostileCli, EvalFindings) {
  const fs::path config = fifo("cli-grid.json");
  expect_exit_2({"eval", config.string()},
                "cannot open eval config '" + config.string() + "': it is a FIFO");
  expect_exit_2({"eval", dir_->string()},
                "cannot open eval config '" + dir_->string() + "': it is a directory");
  for (const auto& [name, fragment] : std::vector<std::pair<std::string, std::string>>{
           {"name-nested-100000", "nests arrays and objects deeper than 64 levels"},
           {"passkey-length-2pow40", "tasks[0].lengths[0]: must be in [1, 1048576]"},
           {"grocery-turns-2pow20-1", "tasks[0].turns[0]: must be in [1, 65535]"},
           {"passkey-4-million-cells", "exceeds the limit of 65536"}}) {
    const fs::path file = path(name + ".json");
    write_text(file, regression("eval_config", name));
    expect_exit_2({"eval", file.string(), "--out", path("out").string()}, file.string());
    expect_exit_2({"eval", file.string(), "--list"}, fragment);
  }
}

// Sizes from the command line: sums of policy parameters that would leave int range
// (`--budget 2147483647` wrapped in the decoder's capacity) and chunks beyond the limit are
// refused before any model is loaded.
TEST_F(HostileCli, OptionFindings) {
  const fs::path text = path("text.txt");
  write_text(text, "some text\n");
  const std::string model = path("absent.gguf").string();
  expect_exit_2({"stream", "--model", model, "--policy", "h2o", "--budget", "2147483647", "--input",
                 text.string()},
                "--budget must be at most 268435456, got 2147483647");
  expect_exit_2({"stream", "--model", model, "--policy", "streaming_llm", "--budget", "-1",
                 "--input", text.string()},
                "--budget must be at least 1, got -1");
  expect_exit_2({"stream", "--model", model, "--chunk", "65537", "--input", text.string()},
                "--chunk must be in [1, 65536], got 65537");
}

TEST_F(HostileCli, ReplayFindings) {
  const fs::path file = path("logits-not-an-array.json");
  write_text(file, regression("replay", "logits-not-an-array-8192-tokens"));
  expect_exit_2({"replay", file.string()}, file.string() + ": logits: expected an array");
  const fs::path replay = fifo("cli-replay.json");
  expect_exit_2({"replay", replay.string()}, "it is a FIFO");
}

#endif  // KVEVICT_CLI_PATH

}  // namespace
