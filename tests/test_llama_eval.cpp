// `kvevict eval` (kvevict's reference decoder) against `kvevict-llama eval` (llama.cpp through
// kvevict::llama) on toy-base converted to GGUF by kvevict's writer: both executables run the same
// small grid. The two engines compute the same f32 model (llama.cpp's cells f32 too: the entries'
// default kv_type) with different kernels, so bits per byte agree within 1e-4 relative (as
// tests/test_llama.cpp finds for streams), and at token granularity both keep the same tokens: the
// same evictions, the same live K/V bytes (K and V of every layer, f32, per kept token) and the
// same greedy passkey answers.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <kvevict/model/model.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>

#include "model/model_io.hpp"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Outcome {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs `command` through the shell; its output goes to a file in `dir`.
Outcome run(const std::string& command, const fs::path& dir) {
  const fs::path log = dir / "command.log";
  const int raw = std::system((command + " > '" + log.string() + "' 2>&1").c_str());
  Outcome outcome;
  outcome.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  outcome.output = read_text(log);
  return outcome;
}

class LlamaEval : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("kvevict_test_llama_eval_" + std::to_string(getpid()));
    fs::create_directories(dir_);
    gguf_ = dir_ / "toy-base.gguf";
    kvevict::model::write_gguf(
        kvevict::model::load_model(fs::path(KVEVICT_SOURCE_DIR) / "models/toy-base"), gguf_);
  }
  static void TearDownTestSuite() {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // A grid over the GGUF: `policies` (JSON array text), one stream and one passkey task.
  static fs::path write_config(const std::string& name, const std::string& policies) {
    const Json config = {
        {"name", name},
        {"model", gguf_.string()},
        {"text", (fs::path(KVEVICT_SOURCE_DIR) / "data/kjv-heldout.txt").string()},
        {"chunk", 16},
        {"policies", Json::parse(policies)},
        {"budgets", {64}},
        {"tasks",
         {{{"task", "stream_bpb"}, {"tokens", 1024}, {"window", 256}},
          {{"task", "passkey"}, {"depths", {0.5}}, {"lengths", {256}}, {"documents", 2}}}}};
    const fs::path path = dir_ / (name + ".json");
    std::ofstream(path) << config.dump(2);
    return path;
  }

  static Json results(const fs::path& out) { return Json::parse(read_text(out / "results.json")); }

  static inline fs::path dir_;
  static inline fs::path gguf_;
};

TEST_F(LlamaEval, BothEnginesGiveTheSameGrid) {
  const fs::path config = write_config("llama-eval", R"([
      {"policy": "full", "granularity": "token"},
      {"policy": "window", "granularity": "token"},
      {"policy": "streaming_llm", "sinks": 4, "granularity": "token"}])");
  const fs::path reference_out = dir_ / "reference";
  const fs::path llama_out = dir_ / "llama";
  const Outcome reference = run(std::string(KVEVICT_CLI) + " eval '" + config.string() +
                                    "' --out '" + reference_out.string() + "' --fresh --jobs 2",
                                dir_);
  ASSERT_EQ(reference.status, 0) << reference.output;
  const Outcome llama =
      run(std::string(KVEVICT_LLAMA_CLI) + " eval '" + config.string() + "' --model '" +
              gguf_.string() + "' --out '" + llama_out.string() + "' --fresh --jobs 2 -c 1100",
          dir_);
  ASSERT_EQ(llama.status, 0) << llama.output;

  const Json expected = results(reference_out);
  const Json actual = results(llama_out);
  EXPECT_EQ(expected.at("engine"), "kvevict");
  EXPECT_EQ(actual.at("engine").get<std::string>().rfind("llama.cpp ", 0), 0u);
  EXPECT_EQ(expected.at("model").at("sha256"), actual.at("model").at("sha256"));
  ASSERT_EQ(expected.at("cells").size(), 6u);  // 3 policies x (1 stream + 1 passkey variant)
  ASSERT_EQ(actual.at("cells").size(), expected.at("cells").size());
  std::int64_t evicted = 0;
  for (std::size_t i = 0; i < expected.at("cells").size(); ++i) {
    const Json& a = expected.at("cells")[i];
    const Json& b = actual.at("cells")[i];
    SCOPED_TRACE(a.at("id").get<std::string>());
    ASSERT_EQ(a.at("id"), b.at("id"));
    EXPECT_EQ(b.at("engine"), actual.at("engine"));
    EXPECT_EQ(a.at("policy_setup").at("granularity"), "token");
    EXPECT_EQ(b.at("policy_setup").at("granularity"), "token");
    EXPECT_EQ(a.at("policy_setup").at("positions"), b.at("policy_setup").at("positions"));
    // Different engines: neither may resume the other's cells.
    EXPECT_NE(a.at("cell_hash"), b.at("cell_hash"));
    const Json& ma = a.at("metrics");
    const Json& mb = b.at("metrics");
    EXPECT_EQ(ma.at("tokens_fed"), mb.at("tokens_fed"));
    EXPECT_EQ(ma.at("evicted_slots"), mb.at("evicted_slots"));
    EXPECT_EQ(ma.at("decisions"), mb.at("decisions"));
    EXPECT_EQ(ma.at("live_kv_bytes"), mb.at("live_kv_bytes"));
    EXPECT_EQ(ma.at("peak_kv_bytes"), mb.at("peak_kv_bytes"));
    evicted += ma.at("evicted_slots").get<std::int64_t>();
    if (a.at("task") == "stream_bpb") {
      const double bpb = ma.at("bits_per_byte").get<double>();
      EXPECT_NEAR(mb.at("bits_per_byte").get<double>(), bpb, 1e-4 * bpb);
      EXPECT_EQ(ma.at("bytes_scored"), mb.at("bytes_scored"));
    } else {
      const Json& documents = a.at("details").at("documents");
      ASSERT_EQ(documents.size(), 2u);
      for (std::size_t d = 0; d < documents.size(); ++d) {
        const Json& other = b.at("details").at("documents")[d];
        EXPECT_EQ(documents[d].at("key"), other.at("key"));
        EXPECT_EQ(documents[d].at("answer"), other.at("answer"));
        EXPECT_EQ(documents[d].at("answer").get<std::string>().size(), 5u);
      }
      EXPECT_EQ(ma.at("per_digit"), mb.at("per_digit"));
    }
  }
  EXPECT_GT(evicted, 0);  // the bounded cells evicted: the comparison covers eviction

  // The reference decoder's output directory is another engine's: kvevict-llama refuses it.
  const Outcome mixed =
      run(std::string(KVEVICT_LLAMA_CLI) + " eval '" + config.string() + "' --model '" +
              gguf_.string() + "' --out '" + reference_out.string() + "' -c 1100",
          dir_);
  EXPECT_EQ(mixed.status, 2) << mixed.output;
  EXPECT_NE(mixed.output.find("different configuration"), std::string::npos) << mixed.output;
}

TEST_F(LlamaEval, RefusesHeadGranularityBeforeTheGridRuns) {
  const fs::path config = write_config("llama-eval-head", R"([
      {"policy": "full"},
      {"policy": "window", "granularity": "head", "label": "window per head"}])");
  const fs::path out = dir_ / "head";
  const Outcome outcome = run(std::string(KVEVICT_LLAMA_CLI) + " eval '" + config.string() +
                                  "' --model '" + gguf_.string() + "' --out '" + out.string() + "'",
                              dir_);
  EXPECT_EQ(outcome.status, 2) << outcome.output;
  EXPECT_NE(outcome.output.find("policies[1] (window per head) at budget 64"), std::string::npos)
      << outcome.output;
  EXPECT_NE(outcome.output.find("granularity head"), std::string::npos) << outcome.output;
  EXPECT_FALSE(fs::exists(out)) << "nothing may be written before the refusal";
}

// `--kv-type` sets llama.cpp's cells in `kvevict-llama stream` as it sets kvevict's K/V: with the
// same type on both sides the two executables report the same cache (toy-base: 4 layers x 2 KV
// heads x 32 dimensions, K and V: 512 values per kept token, 4 bytes each in f32, 2 in bf16) and
// bits per byte within 1e-4. llama.cpp's own default is f16: f32 would show its cells' size.
TEST_F(LlamaEval, StreamCellsFollowKvType) {
  const fs::path errors = dir_ / "stream.err";
  for (const auto& [kv_type, bytes_per_token] :
       {std::pair<std::string, int>{"f32", 2048}, std::pair<std::string, int>{"bf16", 1024}}) {
    SCOPED_TRACE(kv_type);
    const std::string flags = " stream --model '" + gguf_.string() + "' --input '" +
                              (fs::path(KVEVICT_SOURCE_DIR) / "data/kjv-heldout.txt").string() +
                              "' --limit-bytes 1500 --policy window --budget 128 --positions "
                              "original --granularity token --json --kv-type " +
                              kv_type;
    const auto stream = [&](const std::string& executable, const std::string& extra) {
      // stdout alone is the JSON: llama.cpp logs to stderr.
      const Outcome outcome =
          run("(" + executable + flags + extra + " 2> '" + errors.string() + "')", dir_);
      EXPECT_EQ(outcome.status, 0) << read_text(errors);
      return Json::parse(outcome.output);
    };
    const Json reference = stream(KVEVICT_CLI, "");
    const Json llama = stream(KVEVICT_LLAMA_CLI, " -c 512");
    EXPECT_EQ(reference.at("policy").at("kv_type"), kv_type);
    EXPECT_EQ(llama.at("policy").at("kv_type"), kv_type);
    EXPECT_EQ(llama.at("cache").at("live_kv_bytes"), 128 * bytes_per_token);
    EXPECT_EQ(reference.at("cache").at("live_kv_bytes"), llama.at("cache").at("live_kv_bytes"));
    EXPECT_EQ(reference.at("cache").at("evicted_slots"), llama.at("cache").at("evicted_slots"));
    const double bpb = reference.at("bits_per_byte").get<double>();
    EXPECT_NEAR(llama.at("bits_per_byte").get<double>(), bpb, 1e-4 * bpb);
  }
}

// Both streams say their granularity; kvevict-llama says that llama.cpp's cells, per token, make
// its default differ from kvevict's own for a policy that decides per KV head.
TEST_F(LlamaEval, StreamsSayTheirGranularity) {
  const std::string flags = " stream '" + gguf_.string() + "' --input '" +
                            (fs::path(KVEVICT_SOURCE_DIR) / "data/kjv-heldout.txt").string() +
                            "' --limit-bytes 600 --policy h2o --budget 64";
  const Outcome llama =
      run(std::string("(") + KVEVICT_LLAMA_CLI + flags + " -c 512 2>/dev/null)", dir_);
  EXPECT_EQ(llama.status, 0) << llama.output;
  EXPECT_NE(llama.output.find("granularity    token: one keep-set for the whole model, per token, "
                              "as llama.cpp's cells are; kvevict stream decides at h2o's default, "
                              "head (one keep-set per KV head), so the decisions differ: "
                              "--granularity token on both makes them agree"),
            std::string::npos)
      << llama.output;
  const Outcome reference = run(std::string("(") + KVEVICT_CLI + flags + " 2>/dev/null)", dir_);
  EXPECT_EQ(reference.status, 0) << reference.output;
  EXPECT_NE(reference.output.find("granularity    head: one keep-set per KV head (h2o's default; "
                                  "kvevict-llama decides per token"),
            std::string::npos)
      << reference.output;
}

// `kvevict-llama stream` registers its input options as `kvevict stream` does: the same help.
TEST_F(LlamaEval, StreamInputOptionsAreKvevicts) {
  const auto input_options = [&](const std::string& executable) {
    const Outcome help = run(executable + " stream --help", dir_);
    EXPECT_EQ(help.status, 0) << help.output;
    std::istringstream in(help.output);
    std::string lines;
    for (std::string line; std::getline(in, line);) {
      if (line.starts_with("  -i,--input ") || line.starts_with("  --turn-separator ") ||
          line.starts_with("  --limit-bytes ") || line.starts_with("  -w,--window ")) {
        lines += line + "\n";
      }
    }
    return lines;
  };
  const std::string reference = input_options(KVEVICT_CLI);
  EXPECT_NE(reference.find("--turn-separator"), std::string::npos) << reference;
  EXPECT_EQ(input_options(KVEVICT_LLAMA_CLI), reference);
}

}  // namespace
