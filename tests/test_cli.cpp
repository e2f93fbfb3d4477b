// The `kvevict` decoder subcommands (generate, stream, info, random-model) and their shared option
// parsing (src/harness, src/cli/options.hpp). The support code is tested directly; the commands run
// as the built binary against a random model the suite writes to a temporary directory.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <kvevict/model/model.hpp>
#include <kvevict/policy_registry.hpp>
#include <kvevict/version.hpp>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "harness/anchor_inserter.hpp"
#include "harness/log_loss.hpp"
#include "harness/policy_setup.hpp"
#include "harness/sampling.hpp"
#include "harness/text_pieces.hpp"
#include "support/expect_error.hpp"

namespace {

namespace fs = std::filesystem;
using kvevict::Error;
using kvevict::PolicyParams;
using kvevict::harness::PolicyOptions;
using nlohmann::json;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Deterministic English-like text of `bytes` bytes (words from a small list, spaces, newlines and
// a blank line every few sentences, so turn separators have something to split at).
std::string sample_text(std::size_t bytes) {
  static const char* const words[] = {"the",   "cache", "keeps", "recent", "tokens",
                                      "and",   "a",     "few",   "sinks",  "while",
                                      "older", "ones",  "are",   "evicted"};
  std::string text;
  std::uint64_t state = 12345;
  int sentence = 0;
  while (text.size() < bytes) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    text += words[(state >> 33) % std::size(words)];
    if ((state >> 20) % 9 == 0) {
      text += ".";
      text += (++sentence % 4 == 0) ? "\n\n" : " ";
    } else {
      text += " ";
    }
  }
  text.resize(bytes);
  return text;
}

// --- Policy options ---------------------------------------------------------------------------

PolicyParams budget(const std::string& policy, int n, int sinks = 4) {
  return kvevict::budget_params(policy, n, sinks);
}

TEST(PolicyOptions, BudgetMapsToEachPolicysParameters) {
  EXPECT_EQ(budget("window", 100).to_string(), "recent=100");
  EXPECT_EQ(budget("streaming_llm", 100).to_string(), "recent=96 sinks=4");
  EXPECT_EQ(budget("streaming_llm", 100, 8).to_string(), "recent=92 sinks=8");
  EXPECT_EQ(budget("h2o", 101).to_string(), "heavy=50 recent=51");
  EXPECT_EQ(budget("tova", 100).to_string(), "budget=100");
  EXPECT_EQ(budget("sirllm", 100).to_string(), "entropy=96 sinks=4");
  EXPECT_EQ(budget("random_llm", 100).to_string(), "budget=96 sinks=4");
  EXPECT_EQ(budget("interval_llm", 100).to_string(), "budget=96 sinks=4");
  EXPECT_EQ(budget("infinipot", 100).to_string(), "keep=50 novel=25 pot=100");
  EXPECT_EQ(budget("anllm", 100).to_string(), "max_slots=100");
  // Every mapping gives a policy make_policy accepts (anllm also needs its anchor ids).
  for (std::string_view name : kvevict::policy_names()) {
    if (name == "full") continue;
    PolicyParams values = budget(std::string(name), 64);
    if (name == "anllm") values.set_list("anchor_ids", {258});
    EXPECT_NO_THROW((void)kvevict::make_policy(name, values)) << name;
  }
}

TEST(PolicyOptions, BudgetErrors) {
  EXPECT_THROW((void)budget("full", 10), Error);
  EXPECT_THROW((void)budget("window", 0), Error);
  try {
    (void)budget("streaming_llm", 4, 4);
    FAIL() << "no error for a budget that holds only the sinks";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(),
                 "budget 4 leaves no room beside the 4 protected sinks: the budget must be larger "
                 "than the sinks (at least 5)");
  }
}

TEST(PolicyOptions, ParamsParseNumbersAndLists) {
  PolicyParams values;
  values.parse_pair("recent=28");
  values.parse_pair("decay=0.5");
  values.parse_pair("anchor_ids=258");
  values.parse_pair("ids=1, 2,3");
  EXPECT_EQ(values.to_string(), "anchor_ids=258 decay=0.5 ids=1,2,3 recent=28");
  EXPECT_EQ(kvevict::harness::params_json(values).dump(),
            R"({"anchor_ids":258,"decay":0.5,"ids":[1,2,3],"recent":28})");
  // The policy's spec types them: one anchor id is a list of one (the C API could not say so).
  const PolicyParams typed =
      kvevict::policy_spec("anllm").resolve(PolicyParams::parse("anchor_ids=258"));
  EXPECT_EQ(kvevict::harness::params_json(typed).dump(), R"({"anchor_ids":[258],"max_slots":0})");
  for (const char* bad : {"recent", "=3", "recent=", "recent=a-c", "recent=1e999", "ids=1,x"}) {
    EXPECT_THROW(values.parse_pair(bad), Error) << bad;
  }
  // A word is a value too (a choice parameter's: pooling=max); where the spec wants a number, the
  // spec refuses it.
  PolicyParams words;
  words.parse_pair("pooling=max");
  EXPECT_EQ(kvevict::harness::params_json(words).dump(), R"({"pooling":"max"})");
  EXPECT_THROW((void)kvevict::policy_spec("window").resolve(PolicyParams::parse("recent=abc")),
               Error);
}

TEST(PolicyOptions, ParamsOverrideTheBudgetAndSinksApply) {
  PolicyOptions options;
  options.policy = "streaming_llm";
  options.budget = 64;
  options.params = {"recent=10"};
  EXPECT_EQ(kvevict::harness::resolve_params(options, nullptr).to_string(), "recent=10 sinks=4");
  options.sinks = 2;
  options.sinks_given = true;
  EXPECT_EQ(kvevict::harness::resolve_params(options, nullptr).to_string(), "recent=10 sinks=2");
}

TEST(PolicyOptions, ValidationNamesTheProblem) {
  const auto message = [](const PolicyOptions& options) -> std::string {
    try {
      kvevict::harness::validate_policy_options(options);
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  PolicyOptions options;
  EXPECT_EQ(message(options), "");
  options.policy = "lru";
  EXPECT_NE(message(options).find("unknown policy 'lru' (known: full, window"), std::string::npos);
  options.policy = "window";
  EXPECT_NE(message(options).find("missing parameter 'recent'"), std::string::npos);
  options.budget = 16;
  EXPECT_EQ(message(options), "");
  options.params = {"recnt=3"};
  EXPECT_NE(message(options).find("unknown parameter 'recnt' for policy 'window' (known: recent)"),
            std::string::npos);
  options.params.clear();
  options.chunk = 0;
  EXPECT_NE(message(options).find("--chunk"), std::string::npos);
  options.chunk = 16;
  options.catalyst = "question";
  EXPECT_NE(message(options).find("--catalyst does not apply"), std::string::npos);
  options.catalyst.reset();
  options.positions = "sideways";
  EXPECT_NE(message(options).find("--positions"), std::string::npos);
  options.positions = "reset_on_compact";
  options.keys = "rotated";
  EXPECT_NE(message(options).find("--keys"), std::string::npos);
}

// --- Sampling -----------------------------------------------------------------------------------

TEST(Sampling, UniformUnitUsesTheTop53Bits) {
  std::mt19937_64 engine(1);
  std::mt19937_64 copy(1);
  for (int i = 0; i < 1000; ++i) {
    const double u = kvevict::harness::uniform_unit(engine);
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    EXPECT_EQ(u, static_cast<double>(copy() >> 11) / 9007199254740992.0);
  }
}

TEST(Sampling, GreedyTopPAndSeeds) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f, 1.5f};
  kvevict::harness::Sampler greedy({0.0, 1.0, 1});
  EXPECT_EQ(greedy.sample(logits), 1);  // ties go to the lower id
  // A tiny nucleus holds only the most likely token.
  kvevict::harness::Sampler narrow({1.0, 1e-6, 3});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(narrow.sample(logits), 1);
  // The same seed gives the same draws; every token can come out at a high temperature.
  kvevict::harness::Sampler a({2.0, 1.0, 7});
  kvevict::harness::Sampler b({2.0, 1.0, 7});
  std::set<std::int32_t> seen;
  for (int i = 0; i < 400; ++i) {
    const std::int32_t token = a.sample(logits);
    EXPECT_EQ(token, b.sample(logits));
    seen.insert(token);
  }
  EXPECT_EQ(seen.size(), logits.size());
  // top_p = 0.5 keeps ids 1 and 2 (each ~0.3 of the mass), never the others.
  kvevict::harness::Sampler nucleus({1.0, 0.5, 11});
  for (int i = 0; i < 200; ++i) {
    const std::int32_t token = nucleus.sample(logits);
    EXPECT_TRUE(token == 1 || token == 2) << token;
  }
  EXPECT_THROW(kvevict::harness::validate_sampling({-0.1, 1.0, 1}), Error);
  EXPECT_THROW(kvevict::harness::validate_sampling({1.0, 0.0, 1}), Error);
  EXPECT_THROW(kvevict::harness::validate_sampling({1.0, 1.01, 1}), Error);
  EXPECT_THROW(kvevict::harness::validate_sampling({1.0, 1.0, 1, -1}), Error);
}

TEST(Sampling, TopKKeepsTheKMostLikelyBeforeTopP) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f, 1.5f};
  // top_k = 1 is greedy, ties to the lower id.
  kvevict::harness::Sampler one({1.0, 1.0, 5, 1});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(one.sample(logits), 1);
  // top_k = 3 keeps ids 1, 2 and 4 (logits 2.0, 2.0, 1.5): each comes out, ids 0 and 3 never.
  kvevict::harness::Sampler three({1.0, 1.0, 5, 3});
  std::set<std::int32_t> seen;
  for (int i = 0; i < 300; ++i) seen.insert(three.sample(logits));
  EXPECT_EQ(seen, (std::set<std::int32_t>{1, 2, 4}));
  // Then top_p = 0.5 of the kept mass (1 + 1 + e^-0.5 = 2.61, half is 1.30): ids 1 and 2 reach it.
  kvevict::harness::Sampler both({1.0, 0.5, 5, 3});
  seen.clear();
  for (int i = 0; i < 300; ++i) seen.insert(both.sample(logits));
  EXPECT_EQ(seen, (std::set<std::int32_t>{1, 2}));
}

// --- Loss bookkeeping ---------------------------------------------------------------------------

TEST(LogLoss, SurprisalAndWindows) {
  const std::vector<float> uniform(8, 0.25f);
  EXPECT_NEAR(kvevict::harness::surprisal_bits(uniform, 3), 3.0, 1e-12);  // log2(8)
  kvevict::harness::WindowedLoss loss(4);
  for (int position = 1; position < 10; ++position) loss.add(position, 2.0, 1);
  ASSERT_EQ(loss.windows().size(), 3u);
  EXPECT_EQ(loss.windows()[0].totals.tokens, 3);  // position 0 is never scored
  EXPECT_EQ(loss.windows()[1].first_position, 4);
  EXPECT_EQ(loss.windows()[2].totals.tokens, 2);
  EXPECT_EQ(loss.overall().tokens, 9);
  EXPECT_DOUBLE_EQ(loss.overall().bits_per_byte(), 2.0);
  EXPECT_DOUBLE_EQ(loss.overall().perplexity(), 4.0);
}

// --- Reading text in pieces ---------------------------------------------------------------------

kvevict::harness::TextPiecesOptions piece_options(std::size_t block_bytes,
                                                  std::string separator = "",
                                                  bool cut_before_space = false,
                                                  std::uint64_t limit_bytes = 0) {
  kvevict::harness::TextPiecesOptions options;
  options.block_bytes = block_bytes;
  options.turn_separator = std::move(separator);
  options.cut_before_space = cut_before_space;
  options.limit_bytes = limit_bytes;
  return options;
}

class TextPiecesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("kvevict_test_cli_pieces_{}", getpid());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<kvevict::harness::TextPiece> pieces(
      const std::string& text, const kvevict::harness::TextPiecesOptions& options) {
    const fs::path path = dir_ / "text.txt";
    write_text(path, text);
    kvevict::harness::TextPieces reader(path.string(), options);
    std::vector<kvevict::harness::TextPiece> out;
    kvevict::harness::TextPiece piece;
    while (reader.next(piece)) {
      EXPECT_FALSE(piece.text.empty());
      out.push_back(piece);
    }
    return out;
  }
  static std::string joined(const std::vector<kvevict::harness::TextPiece>& pieces) {
    std::string text;
    for (const auto& piece : pieces) text += piece.text;
    return text;
  }

  fs::path dir_;
};

TEST_F(TextPiecesTest, BlocksCoverTheTextExactly) {
  const std::string text = sample_text(1000);
  const auto list = pieces(text, piece_options(64));
  EXPECT_EQ(joined(list), text);
  EXPECT_GE(list.size(), 15u);
  for (const auto& piece : list) EXPECT_FALSE(piece.turn_start);
  EXPECT_EQ(joined(pieces(text, piece_options(64, "", false, 100))), text.substr(0, 100));
}

TEST_F(TextPiecesTest, TurnsEndAfterEachSeparatorEvenAcrossBlocks) {
  const std::string text = "first turn--second--third-";
  // Blocks of 3 bytes split "--" across blocks several times.
  const auto list = pieces(text, piece_options(3, "--"));
  EXPECT_EQ(joined(list), text);
  std::vector<std::string> turns;
  for (const auto& piece : list) {
    if (piece.turn_start) turns.emplace_back();
    ASSERT_FALSE(turns.empty()) << "the first piece starts a turn";
    turns.back() += piece.text;
  }
  EXPECT_EQ(turns, (std::vector<std::string>{"first turn--", "second--", "third-"}));
}

TEST_F(TextPiecesTest, SentencePieceCutsGiveTheTokensOfTheWholeText) {
  // A SentencePiece vocabulary with multi-character and "▁word" pieces (scores: longer is better).
  const std::string space = "\xe2\x96\x81";
  kvevict::model::Tokenizer tokenizer;
  tokenizer.kind = kvevict::model::Tokenizer::Kind::sentencepiece;
  tokenizer.pieces = {"<unk>", "<s>",        "</s>",        space, "t",
                      "h",     "e",          "c",           "a",   "k",
                      "s",     ".",          "\n",          "th",  "he",
                      "the",   space + "th", space + "the", "ca",  space + "cache"};
  for (std::size_t i = 0; i < tokenizer.pieces.size(); ++i) {
    tokenizer.scores.push_back(static_cast<float>(tokenizer.pieces[i].size()));
    tokenizer.types.push_back(i == 0 ? 2 : (i <= 2 ? 3 : 1));
  }
  tokenizer.bos_id = 1;
  tokenizer.eos_id = 2;
  tokenizer.vocab_size = static_cast<int>(tokenizer.pieces.size());
  const std::string text = "the cache  the\nthe cache. cache  the  the cache thecache the";
  for (std::size_t block : {5, 7, 11}) {
    const auto list = pieces(text, piece_options(block, "", true));
    EXPECT_EQ(joined(list), text);
    std::vector<std::int32_t> tokens;
    for (const auto& piece : list) {
      const std::string_view encoded =
          piece.space_cut ? std::string_view(piece.text).substr(1) : std::string_view(piece.text);
      if (piece.space_cut) {
        EXPECT_EQ(piece.text.front(), ' ');
      }
      for (std::int32_t id : tokenizer.encode(encoded, false)) tokens.push_back(id);
    }
    EXPECT_EQ(tokens, tokenizer.encode(text, false)) << "block " << block;
  }
}

// A cut falls only before a space that follows a character other than whitespace: a run of
// whitespace ("\n    " of indented text) is one pre-token for byte-level BPE and stays whole.
TEST_F(TextPiecesTest, CutsOnlyBeforeASpaceAfterANonWhitespaceCharacter) {
  using kvevict::harness::may_cut_before;
  EXPECT_TRUE(may_cut_before("a b", 1));
  EXPECT_TRUE(may_cut_before(".  b", 1));
  EXPECT_FALSE(may_cut_before("a  b", 2));  // after a space
  EXPECT_FALSE(may_cut_before("a\n b", 2));
  EXPECT_FALSE(may_cut_before("a\t b", 2));
  EXPECT_FALSE(may_cut_before("a\r b", 2));
  EXPECT_FALSE(may_cut_before("ab c", 1));  // not a space
  const std::string text = "def f():\n    return 1\n\n    \n  x = 2  # two words\n";
  for (std::size_t block : {3, 4, 5}) {
    const auto list = pieces(text, piece_options(block, "", true));
    EXPECT_EQ(joined(list), text);
    std::size_t offset = 0;
    for (std::size_t i = 0; i + 1 < list.size(); ++i) {
      offset += list[i].text.size();
      EXPECT_TRUE(may_cut_before(text, offset)) << "block " << block << ", cut at " << offset;
    }
  }
}

TEST_F(TextPiecesTest, TextWithoutSpacesIsCutBetweenUtf8Characters) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "\xc3\xa9";  // "é" x 100, no space anywhere
  const auto list = pieces(text, piece_options(4, "", true));
  EXPECT_EQ(joined(list), text);
  EXPECT_GT(list.size(), 1u);
  for (const auto& piece : list) {
    EXPECT_EQ(piece.text.size() % 2, 0u) << "a piece splits a character";
    EXPECT_LE(piece.text.size(), 16u * 4u);
    EXPECT_FALSE(piece.space_cut);
  }
}

// --- The binary ---------------------------------------------------------------------------------

#ifdef KVEVICT_CLI_PATH

std::string quote(const std::string& argument) {
  std::string quoted = "'";
  for (char c : argument) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

struct CommandResult {
  int code = -1;
  std::string out;
  std::string err;
};

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / fmt::format("kvevict_test_cli_{}", getpid()));
    fs::create_directories(*dir_);
    model_ = new std::string((*dir_ / "tiny.gguf").string());
    const CommandResult made = run({"random-model", "--out", *model_});
    ASSERT_EQ(made.code, 0) << made.err;
    write_text(*dir_ / "text4k.txt", sample_text(4096));
    write_text(*dir_ / "text2k.txt", sample_text(2048));
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete model_;
    delete dir_;
  }

  static CommandResult run(const std::vector<std::string>& arguments) {
    static int counter = 0;
    const fs::path out = *dir_ / fmt::format("out{}.txt", counter);
    const fs::path err = *dir_ / fmt::format("err{}.txt", counter++);
    std::string command = quote(KVEVICT_CLI_PATH);
    for (const std::string& argument : arguments) command.append(" ").append(quote(argument));
    command += fmt::format(" >{} 2>{} </dev/null", quote(out.string()), quote(err.string()));
    const int status = std::system(command.c_str());
    CommandResult result;
    result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = read_text(out);
    result.err = read_text(err);
    return result;
  }
  // Runs a command that must succeed with --json output, and parses it.
  static json run_json(std::vector<std::string> arguments) {
    arguments.emplace_back("--json");
    const CommandResult result = run(arguments);
    EXPECT_EQ(result.code, 0) << result.err;
    try {
      return json::parse(result.out);
    } catch (const json::exception& error) {
      ADD_FAILURE() << "not JSON: " << error.what() << "\n" << result.out;
      return json::object();
    }
  }
  static std::string file(const std::string& name) { return (*dir_ / name).string(); }

  static fs::path* dir_;
  static std::string* model_;
};
fs::path* Cli::dir_ = nullptr;
std::string* Cli::model_ = nullptr;

// --budget-bytes and --allocation (policies/allocated.hpp) on the tiny model: 2 layers x 2 KV
// heads of head_dim 16, f32: 128 bytes a token's K and V per head, 512 over the four heads.
TEST_F(Cli, BudgetBytesAndAllocation) {
  const auto stream = [&](std::vector<std::string> extra) {
    std::vector<std::string> arguments{"stream",           "--model", *model_, "--input",
                                       file("text2k.txt"), "--chunk", "8"};
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    return run_json(arguments);
  };
  // Uniform: 16,484 bytes hold 32 tokens per head (100 bytes left over): --budget 32 exactly.
  const json tokens = stream({"--policy", "h2o", "--budget", "32"});
  const json bytes = stream({"--policy", "h2o", "--budget-bytes", "16484"});
  EXPECT_EQ(tokens["bits"], bytes["bits"]);
  EXPECT_EQ(tokens["cache"]["unit_tokens"], bytes["cache"]["unit_tokens"]);
  EXPECT_EQ(bytes["cache"]["unit_tokens"], json::parse("[[32, 32], [32, 32]]"));
  EXPECT_LE(bytes["cache"]["peak_kv_bytes"].get<std::int64_t>(), 16484 + 8 * 512);
  // Pyramid, beta 2: h2o's recent 16 protected, m = 16: lo = 8, hi = 24, step 16: layer 0 keeps
  // 24 + 16, layer 1 8 + 16.
  const json pyramid = stream({"--policy", "h2o", "--budget-bytes", "16384", "--allocation",
                               "pyramid", "--pyramid-beta", "2"});
  EXPECT_EQ(pyramid["cache"]["unit_tokens"], json::parse("[[40, 40], [24, 24]]"));
  EXPECT_EQ(pyramid["policy"]["allocation"], "pyramid");
  EXPECT_EQ(pyramid["policy"]["budget_bytes"], 16384);
  EXPECT_LE(pyramid["cache"]["peak_kv_bytes"].get<std::int64_t>(), 16384 + 8 * 512);
  // Adaptive: the two heads of a layer share 64 tokens.
  const json adaptive = stream({"--policy", "tova", "--param", "head_wise=1", "--budget-bytes",
                                "16384", "--allocation", "adaptive"});
  for (const json& layer : adaptive["cache"]["unit_tokens"]) {
    EXPECT_EQ(layer[0].get<int>() + layer[1].get<int>(), 64) << adaptive["cache"];
  }
  EXPECT_LE(adaptive["cache"]["peak_kv_bytes"].get<std::int64_t>(), 16384 + 8 * 512);
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused{
      {{"--policy", "h2o", "--budget", "32", "--budget-bytes", "16384"},
       "--budget 32 and --budget-bytes 16384: give the budget in tokens or in bytes, not both"},
      {{"--policy", "h2o", "--budget", "32", "--allocation", "lopsided"},
       "--allocation: unknown allocation 'lopsided'"},
      {{"--policy", "streaming_llm", "--budget", "32", "--allocation", "pyramid"},
       "policy 'streaming_llm' has no keep rule"},
      {{"--policy", "keydiff", "--budget", "32", "--param", "interval=8", "--allocation",
        "pyramid"},
       "knorm and keydiff at interval 1 have one"},
      {{"--policy", "knorm", "--budget", "32", "--param", "interval=0"},
       "policy 'knorm': parameter 'interval' must be in [1, 268435456], got 0"},
      {{"--policy", "h2o", "--budget-bytes", "500"},
       "--budget-bytes 500 is smaller than one row per head"},
      {{"--policy", "tova", "--budget", "32", "--allocation", "adaptive"}, "tova: head_wise=1"},
      {{"--policy", "h2o", "--budget", "32", "--allocation", "adaptive", "--adaptive-floor", "2"},
       "--adaptive-floor must be in [0, 1], got 2"},
  };
  for (const auto& [extra, message] : refused) {
    std::vector<std::string> arguments{"stream", "--model", *model_, "--input", file("text2k.txt")};
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    const CommandResult result = run(arguments);
    EXPECT_NE(result.code, 0) << message;
    EXPECT_NE(result.err.find(message), std::string::npos) << result.err;
  }
}

TEST_F(Cli, InfoReportsTheDimensions) {
  const json info = run_json({"info", "--model", *model_});
  EXPECT_EQ(info["format"], "gguf");
  const json& config = info["config"];
  EXPECT_EQ(config["dim"], 64);
  EXPECT_EQ(config["hidden_dim"], 172);
  EXPECT_EQ(config["layers"], 2);
  EXPECT_EQ(config["heads"], 4);
  EXPECT_EQ(config["kv_heads"], 2);
  EXPECT_EQ(config["head_dim"], 16);
  EXPECT_EQ(config["vocab_size"], 259);
  EXPECT_EQ(config["context_length"], 256);
  EXPECT_EQ(info["tokenizer"]["anchor_id"], 258);
  // layers * kv_heads * head_dim * (K + V) * sizeof(float)
  EXPECT_EQ(info["kv_cache"]["kv_bytes_per_token"], 2 * 2 * 16 * 2 * 4);
  EXPECT_GT(info["kv_cache"]["metadata_bytes_per_token"].get<int>(), 0);
  EXPECT_EQ(info["weights"]["bytes_by_dtype"]["f32"], info["weights"]["total_bytes"]);
  const CommandResult text = run({"info", "--model", *model_});
  EXPECT_EQ(text.code, 0);
  EXPECT_NE(text.out.find("4 heads, 2 KV heads, head_dim 16"), std::string::npos) << text.out;
}

TEST_F(Cli, RandomModelWritesEveryFormat) {
  const json gguf_info = run_json({"info", "--model", *model_});
  for (const char* format : {"safetensors", "llama2c"}) {
    const std::string path = file(fmt::format("tiny-{}", format));
    const CommandResult made = run({"random-model", "--out", path, "--format", format});
    ASSERT_EQ(made.code, 0) << made.err;
    const json info = run_json({"info", "--model", path});
    EXPECT_EQ(info["format"], format);
    EXPECT_EQ(info["config"]["dim"], 64);
    EXPECT_EQ(info["weights"]["total_bytes"], gguf_info["weights"]["total_bytes"]);
  }
  // The same options give the same bytes.
  ASSERT_EQ(run({"random-model", "--out", file("again.gguf")}).code, 0);
  EXPECT_EQ(read_text(file("again.gguf")), read_text(*model_));
}

TEST_F(Cli, GreedyGenerationIsDeterministicAndKeyStorageAgnostic) {
  const std::vector<std::string> base = {"generate", "--model",         *model_,
                                         "--prompt", "the cache keeps", "--max-tokens",
                                         "24",       "--chunk",         "8"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> arguments = base;
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    return run_json(arguments);
  };
  const json first = with({"--policy", "window", "--budget", "64", "--keys", "pre_rope"});
  const json second = with({"--policy", "window", "--budget", "64", "--keys", "pre_rope"});
  const json post = with({"--policy", "window", "--budget", "64", "--keys", "post_rope"});
  ASSERT_EQ(first["generated_tokens"], 24) << first.dump();
  EXPECT_EQ(first["prompt_tokens"], 16);  // BOS + 15 bytes
  EXPECT_EQ(first["token_ids"], second["token_ids"]);
  EXPECT_EQ(first["token_ids"], post["token_ids"]);  // budget 64 > 16 + 24: nothing evicted
  EXPECT_EQ(first["cache"]["evicted_slots"], 0);
  EXPECT_EQ(first["policy"]["params"]["recent"], 64);
  // Sampling: same seed, same text; the stats line goes to stderr without --json.
  const json hot = with({"--temperature", "0.9", "--top-p", "0.9", "--seed", "5"});
  EXPECT_EQ(hot["token_ids"],
            with({"--temperature", "0.9", "--top-p", "0.9", "--seed", "5"})["token_ids"]);
  const CommandResult plain = run(base);
  EXPECT_EQ(plain.code, 0) << plain.err;
  EXPECT_NE(plain.err.find("peak KV"), std::string::npos) << plain.err;
  EXPECT_NE(plain.err.find("tokens/s"), std::string::npos) << plain.err;
}

TEST_F(Cli, StreamReportsLossPerWindow) {
  const json result =
      run_json({"stream", "--model", *model_, "--input", file("text4k.txt"), "--window", "1000",
                "--policy", "streaming_llm", "--budget", "32", "--chunk", "16"});
  const double bits_per_byte = result["bits_per_byte"].get<double>();
  EXPECT_TRUE(std::isfinite(bits_per_byte));
  EXPECT_GT(bits_per_byte, 0.0);
  EXPECT_EQ(result["tokens"], 4096);  // byte-level: BOS is fed but not scored
  EXPECT_EQ(result["bytes"], 4096);
  EXPECT_EQ(result["cache"]["tokens"], 4097);
  std::int64_t tokens = 0;
  for (const json& window : result["windows"]) tokens += window["tokens"].get<std::int64_t>();
  EXPECT_EQ(tokens, result["tokens"].get<std::int64_t>());
  EXPECT_EQ(result["windows"].size(), 5u);  // positions 0..4096 in windows of 1000

  // Bounded policy: the cache never holds more than budget + one chunk.
  const json info = run_json({"info", "--model", *model_});
  const auto kv_per_token = info["kv_cache"]["kv_bytes_per_token"].get<std::int64_t>();
  const auto peak = result["cache"]["peak_kv_bytes"].get<std::int64_t>();
  EXPECT_LE(peak, (32 + 16) * kv_per_token);
  EXPECT_GT(result["cache"]["evicted_slots"].get<std::int64_t>(), 0);

  // Full cache: the peak grows with the input.
  const auto full_peak = [&](const std::string& name) {
    return run_json({"stream", "--model", *model_, "--input", file(name)})["cache"]["peak_kv_bytes"]
        .get<std::int64_t>();
  };
  const std::int64_t peak2k = full_peak("text2k.txt");
  const std::int64_t peak4k = full_peak("text4k.txt");
  EXPECT_EQ(peak4k, 4097 * kv_per_token);
  EXPECT_GT(peak4k, peak2k);

  // The same tokens whatever the chunk size when nothing is evicted.
  const json chunked =
      run_json({"stream", "--model", *model_, "--input", file("text2k.txt"), "--chunk", "7"});
  const json whole =
      run_json({"stream", "--model", *model_, "--input", file("text2k.txt"), "--chunk", "64"});
  EXPECT_NEAR(chunked["bits"].get<double>(), whole["bits"].get<double>(),
              1e-5 * whole["bits"].get<double>());
}

TEST_F(Cli, StreamWithTurnsAndCatalyst) {
  const json sirllm = run_json({"stream", "--model", *model_, "--input", file("text4k.txt"),
                                "--turn-separator", "\\n\\n", "--policy", "sirllm", "--budget",
                                "64", "--chunk", "16", "--limit-bytes", "3000"});
  EXPECT_GT(sirllm["turns"].get<int>(), 1);
  EXPECT_EQ(sirllm["input_bytes"], 3000);
  EXPECT_GT(sirllm["cache"]["decisions"].get<int>(), 0);
  const json infinipot =
      run_json({"stream", "--model", *model_, "--input", file("text2k.txt"), "--policy",
                "infinipot", "--budget", "64", "--catalyst", "Summarize the key points."});
  EXPECT_GT(infinipot["cache"]["catalyst_runs"].get<int>(), 0);
  EXPECT_EQ(infinipot["policy"]["catalyst_tokens"], 25);
  EXPECT_TRUE(std::isfinite(infinipot["bits_per_byte"].get<double>()));
  // AnLLM takes the tokenizer's anchor by default.
  const json anllm = run_json({"stream", "--model", *model_, "--input", file("text2k.txt"),
                               "--policy", "anllm", "--budget", "48"});
  EXPECT_EQ(anllm["policy"]["params"]["anchor_ids"], json::array({258}));
}

TEST_F(Cli, BadOptionsExitWithCode2AndSayWhy) {
  const std::string text = file("text2k.txt");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"generate", "--model", file("missing.gguf"), "--prompt", "x"}, "does not exist"},
      {{"generate", "--model", *model_, "--prompt", "x", "--max-tokens", "0"}, "--max-tokens"},
      {{"generate", "--model", *model_, "--prompt", "x", "--temperature", "-1"}, "--temperature"},
      {{"generate", "--model", *model_, "--prompt", "x", "--top-p", "0"}, "--top-p"},
      {{"generate", "--model", *model_, "--prompt", "x", "--top-p", "1.5"}, "--top-p"},
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "lru"}, "known: full"},
      // The budget must be larger than the sinks it holds; the message says the smallest.
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "streaming_llm", "--budget",
        "4"},
       "keeps its 4 sinks (--sinks 4) inside the budget, and it needs at least one slot besides "
       "them: --budget 5 at least"},
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "streaming_llm", "--budget",
        "2", "--sinks", "2"},
       "--budget 3 at least"},
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "tova", "--budget", "4",
        "--sinks", "4"},
       "tova keeps its 4 sinks (--sinks 4) inside the budget, and it needs at least one slot "
       "besides them: --budget 5 at least"},
      // A policy that evicts only before turns also holds a turn's first chunk.
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "sirllm", "--budget", "4",
        "--chunk", "16"},
       "sinks plus one chunk (--chunk 16): --budget 20 at least"},
      {{"stream", "--model", *model_, "--input", text, "--threads", "0"}, "--threads"},
      {{"stream", "--model", *model_, "--input", text, "--limit-bytes", "-1"}, "--limit-bytes"},
      {{"compare", "--model", *model_, "--input", "-"}, "stdin can be read once"},
      {{"policies", "lru"}, "unknown policy 'lru'"},
      {{"generate", "--model", *model_, "--prompt", "x", "--chunk", "0"}, "--chunk"},
      {{"generate", "--model", *model_, "--prompt", "x", "--budget", "8"}, "'full'"},
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "window", "--budget", "-2"},
       "--budget"},
      {{"generate", "--model", *model_, "--prompt", "x", "--policy", "window", "--param",
        "recnt=3"},
       "unknown parameter 'recnt'"},
      {{"stream", "--model", *model_, "--input", file("missing.txt")}, "missing.txt"},
      {{"stream", "--model", *model_, "--input", text, "--window", "0"}, "--window"},
      {{"stream", "--model", *model_, "--input", text, "--chunk", "-1"}, "--chunk"},
      {{"info", "--model", file("missing.gguf")}, "does not exist"},
      {{"random-model", "--out", file("bad.gguf"), "--dim", "0"}, "--dim"},
      {{"generate", "--model", *model_}, "--prompt"},
  };
  for (const auto& [arguments, expected] : cases) {
    const CommandResult result = run(arguments);
    std::string shown;
    for (const auto& argument : arguments) shown += argument + " ";
    EXPECT_EQ(result.code, 2) << shown << "\n" << result.err;
    EXPECT_NE(result.err.find("kvevict: error: "), std::string::npos) << shown << result.err;
    EXPECT_NE(result.err.find(expected), std::string::npos)
        << shown << "\nexpected '" << expected << "' in: " << result.err;
  }
  // AnLLM on a vocabulary without an anchor token asks for the ids.
  ASSERT_EQ(run({"random-model", "--out", file("no-anchor.gguf"), "--vocab", "258"}).code, 0);
  const CommandResult anllm = run({"generate", "--model", file("no-anchor.gguf"), "--prompt", "x",
                                   "--policy", "anllm", "--budget", "16"});
  EXPECT_EQ(anllm.code, 2);
  EXPECT_NE(anllm.err.find("--param anchor_ids="), std::string::npos) << anllm.err;
}

TEST_F(Cli, CompareStreamsTheSameTextUnderEachPolicy) {
  const json compared =
      run_json({"compare", "--model", *model_, "--input", file("text2k.txt"), "--budget", "32",
                "--policies", "full,window,h2o", "--limit-bytes", "1024"});
  EXPECT_EQ(compared["trained_context"], 256);
  ASSERT_EQ(compared["rows"].size(), 3u);
  // The tiny model's K/V per token: layers 2 x KV heads 2 x head_dim 16 x (K + V) x 4 bytes.
  const int bytes_per_token = 2 * 2 * 16 * 2 * 4;
  for (const json& row : compared["rows"]) {
    // 1024 byte tokens after BOS: 1024 scored, 255 of them at positions [1, 256).
    EXPECT_EQ(row["overall"]["tokens"], 1024) << row;
    EXPECT_EQ(row["within_context"]["tokens"], 255) << row;
    EXPECT_EQ(row["beyond_context"]["tokens"], 1024 - 255) << row;
    EXPECT_EQ(row["cache"]["tokens"], 1025) << row;
  }
  EXPECT_EQ(compared["rows"][0]["cache"]["live_kv_bytes"], 1025 * bytes_per_token);
  EXPECT_EQ(compared["rows"][1]["cache"]["live_kv_bytes"], 32 * bytes_per_token);  // window
  EXPECT_EQ(compared["rows"][2]["cache"]["live_kv_bytes"], 32 * bytes_per_token);  // h2o
  const CommandResult text = run({"compare", "--model", *model_, "--input", file("text2k.txt"),
                                  "--budget", "32", "--limit-bytes", "512"});
  EXPECT_EQ(text.code, 0) << text.err;
  for (const char* policy : {"full", "window", "streaming_llm", "h2o", "tova"}) {
    EXPECT_NE(text.out.find(policy), std::string::npos) << policy << text.out;
  }
}

TEST_F(Cli, PitfallsAreWarnedAbout) {
  // A turn-evicting policy over a stream without turns never evicts.
  const CommandResult one_turn = run({"stream", "--model", *model_, "--input", file("text2k.txt"),
                                      "--policy", "sirllm", "--budget", "32", "--chunk", "16"});
  EXPECT_EQ(one_turn.code, 0) << one_turn.err;
  EXPECT_NE(one_turn.err.find("evicts only before a turn"), std::string::npos) << one_turn.err;
  // generate: the prompt is one turn, the continuation another, so SirLLM evicts before the
  // continuation once the prompt (60 tokens) overfills its 32 slots.
  const json two_turns =
      run_json({"generate", "--model", *model_, "--prompt", std::string(60, 'a'), "--policy",
                "sirllm", "--budget", "32", "--chunk", "16", "--max-tokens", "4"});
  EXPECT_GE(two_turns["cache"]["decisions"].get<int>(), 1);
  // A prompt longer than the trained context (256) under the full cache.
  write_text(*dir_ / "prompt300.txt", sample_text(300));
  const CommandResult long_prompt =
      run({"generate", "--model", *model_, "-f", file("prompt300.txt"), "--max-tokens", "1"});
  EXPECT_EQ(long_prompt.code, 0) << long_prompt.err;
  EXPECT_NE(long_prompt.err.find("past the model's trained context of 256"), std::string::npos)
      << long_prompt.err;
  // The same prompt under StreamingLLM at cache_index positions stays within it.
  const CommandResult bounded =
      run({"generate", "--model", *model_, "-f", file("prompt300.txt"), "--max-tokens", "1",
           "--policy", "streaming_llm", "--budget", "64"});
  EXPECT_EQ(bounded.code, 0) << bounded.err;
  EXPECT_EQ(bounded.err.find("trained context"), std::string::npos) << bounded.err;
}

// --kv-type on stream, generate, compare and eval: the cache in that type (half the bytes in
// bf16), and bad values are errors naming the option (the tiny model's head_dim of 16 holds no
// Q8_0 block of 32).
TEST_F(Cli, KvTypeStoresTheCacheInThatTypeAndBadValuesNameTheOption) {
  const std::vector<std::string> stream = {"stream",  "--model",          *model_,
                                           "--input", file("text2k.txt"), "--policy",
                                           "window",  "--budget",         "32"};
  const json f32 = run_json(stream);
  std::vector<std::string> bf16_stream = stream;
  bf16_stream.insert(bf16_stream.end(), {"--kv-type", "bf16"});
  const json bf16 = run_json(bf16_stream);
  EXPECT_EQ(f32["policy"]["kv_type"], "f32");
  EXPECT_EQ(bf16["policy"]["kv_type"], "bf16");
  EXPECT_EQ(2 * bf16["cache"]["peak_kv_bytes"].get<std::int64_t>(),
            f32["cache"]["peak_kv_bytes"].get<std::int64_t>());
  std::vector<std::string> bad = stream;
  bad.insert(bad.end(), {"--kv-type", "q4_0"});
  CommandResult result = run(bad);
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("--kv-type: unknown K/V storage type 'q4_0'"), std::string::npos)
      << result.err;
  bad.back() = "q8_0";
  result = run(bad);
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("--kv-type: K/V storage type q8_0 needs head_dim a multiple of 32, "
                            "got 16"),
            std::string::npos)
      << result.err;
  result = run({"generate", "--model", *model_, "--prompt", "abc", "--max-tokens", "1", "--kv-type",
                "int8"});
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("--kv-type: unknown K/V storage type 'int8'"), std::string::npos)
      << result.err;
  const json compared = run_json({"compare", "--model", *model_, "--input", file("text2k.txt"),
                                  "--budget", "32", "--policies", "window", "--kv-type", "f16"});
  ASSERT_EQ(compared["rows"].size(), 1u);
  EXPECT_NE(compared["rows"][0]["policy"].get<std::string>().find("kv f16"), std::string::npos);
  result = run({"eval", "../eval/configs/tiny.json", "--kv-type", "f16", "--list"});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_NE(result.out.find("kv=f16"), std::string::npos) << result.out;
  result = run({"eval", "../eval/configs/kv-types-toy-base.json", "--kv-type", "f16", "--list"});
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("--kv-type: the config already sets a K/V type"), std::string::npos)
      << result.err;
}

// --decode-activations on stream and generate: recorded in the report; on this f32 model it
// changes nothing (only Q8_0 / Q4_0 weights have integer products: test_decoder's
// DecoderActivations); a bad value is an error naming the option.
TEST_F(Cli, DecodeActivationsAreReportedAndBadValuesNameTheOption) {
  std::vector<std::string> stream = {"stream",  "--model",          *model_,
                                     "--input", file("text2k.txt"), "--policy",
                                     "window",  "--budget",         "32"};
  const json f32 = run_json(stream);
  stream.insert(stream.end(), {"--decode-activations", "q8_0"});
  const json q8 = run_json(stream);
  EXPECT_EQ(f32["policy"]["decode_activations"], "f32");
  EXPECT_EQ(q8["policy"]["decode_activations"], "q8_0");
  EXPECT_EQ(q8["bits_per_byte"], f32["bits_per_byte"]);
  stream.back() = "int8";
  CommandResult result = run(stream);
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("--decode-activations: unknown decode activations 'int8' (expected "
                            "f32 or q8_0)"),
            std::string::npos)
      << result.err;
  result = run({"generate", "--model", *model_, "--prompt", "abc", "--max-tokens", "1",
                "--decode-activations", "q8_0"});
  EXPECT_EQ(result.code, 0) << result.err;
  EXPECT_NE(result.err.find("decode activations q8_0"), std::string::npos) << result.err;
}

TEST_F(Cli, MistakesSayWhatToDo) {
  const CommandResult typo = run({"strem", "--model", *model_});
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.err.find("unknown command 'strem' (did you mean 'stream'?)"), std::string::npos)
      << typo.err;
  const CommandResult text_model = run({"info", "--model", file("text2k.txt")});
  EXPECT_EQ(text_model.code, 2);
  EXPECT_NE(text_model.err.find("looks like text, not a model"), std::string::npos)
      << text_model.err;
  // SirLLM at budget 64 (4 sinks, 60 for entropy + recent) cannot make room for a 64-token chunk.
  const CommandResult chunk = run({"generate", "--model", *model_, "--prompt",
                                   std::string(200, 'a'), "--policy", "sirllm", "--budget", "64"});
  EXPECT_EQ(chunk.code, 2);
  EXPECT_NE(chunk.err.find("--chunk"), std::string::npos) << chunk.err;
  const CommandResult version = run({"--version"});
  EXPECT_EQ(version.code, 0);
  EXPECT_EQ(version.out.rfind(std::string("kvevict ") + kvevict::kVersionString, 0), 0u)
      << version.out;
}

TEST_F(Cli, PoliciesListsEverySpec) {
  const CommandResult listed = run({"policies"});
  EXPECT_EQ(listed.code, 0) << listed.err;
  for (const std::string_view name : kvevict::policy_names()) {
    EXPECT_NE(listed.out.find(std::string(name) + "\n"), std::string::npos) << name;
  }
  const CommandResult markdown = run({"policies", "--markdown"});
  EXPECT_NE(markdown.out.find("| `h2o` | `heavy` | integer"), std::string::npos) << markdown.out;
}

TEST_F(Cli, EverySubcommandHasHelpWithAnExample) {
  for (const char* command :
       {"generate", "stream", "info", "random-model", "compare", "policies"}) {
    const CommandResult help = run({command, "--help"});
    EXPECT_EQ(help.code, 0) << command;
    EXPECT_NE(help.out.find("Example"), std::string::npos) << command << help.out;
  }
}

// The examples run from a checkout as the README builds it (`--target kvevict_cli` writes no
// model): every model and text they name is committed.
TEST_F(Cli, HelpExamplesNameCommittedFiles) {
  const fs::path root = fs::path(KVEVICT_TEST_DATA_DIR).parent_path().parent_path();
  for (const char* command : {"generate", "stream", "info", "compare", "eval"}) {
    const CommandResult help = run({command, "--help"});
    ASSERT_EQ(help.code, 0) << command;
    const std::string examples = help.out.substr(help.out.find("Example"));
    EXPECT_EQ(examples.find("build/"), std::string::npos) << command << examples;
    std::istringstream words(examples);
    int committed = 0;
    for (std::string word; words >> word;) {
      if (word.starts_with("models/") || word.starts_with("data/") ||
          word.starts_with("eval/configs/")) {
        EXPECT_TRUE(fs::exists(root / word)) << command << ": " << word;
        ++committed;
      }
    }
    EXPECT_GT(committed, 0) << command << examples;
  }
}

TEST_F(Cli, TheModelIsAPositionalPathOrMinusMinusModel) {
  const json positional = run_json({"info", *model_});
  const json named = run_json({"info", "--model", *model_});
  EXPECT_EQ(positional, named);
  EXPECT_EQ(positional["format"], "gguf");
  const json streamed = run_json({"stream", *model_, "--input", file("text2k.txt")});
  EXPECT_EQ(streamed["tokens"], 2048);
  const CommandResult generated =
      run({"generate", *model_, "--prompt", "ab", "--max-tokens", "2", "--json"});
  EXPECT_EQ(generated.code, 0) << generated.err;
  const CommandResult missing = run({"info"});
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("model"), std::string::npos) << missing.err;
}

TEST_F(Cli, PoliciesShowsTheOnesNamed) {
  const CommandResult h2o = run({"policies", "h2o"});
  EXPECT_EQ(h2o.code, 0) << h2o.err;
  EXPECT_EQ(h2o.out.rfind("h2o\n", 0), 0u) << h2o.out;
  EXPECT_NE(h2o.out.find("heavy"), std::string::npos) << h2o.out;
  EXPECT_NE(h2o.out.find("granularity head"), std::string::npos) << h2o.out;
  EXPECT_EQ(h2o.out.find("tova"), std::string::npos) << h2o.out;
  const CommandResult two = run({"policies", "h2o", "tova", "--markdown"});
  EXPECT_EQ(two.code, 0) << two.err;
  EXPECT_NE(two.out.find("| `tova` | `budget`"), std::string::npos) << two.out;
  EXPECT_EQ(two.out.find("`window`"), std::string::npos) << two.out;
}

// stream, compare (and kvevict-llama stream) register their input options once: same help.
TEST_F(Cli, StreamAndCompareShareTheirInputOptions) {
  const auto option_lines = [&](const char* command) {
    const CommandResult help = run({command, "--help"});
    std::string lines;
    std::istringstream in(help.out);
    for (std::string line; std::getline(in, line);) {
      const bool input_option = line.starts_with("  -i,--input ") ||
                                line.starts_with("  --turn-separator ") ||
                                line.starts_with("  --limit-bytes ");
      if (!input_option) continue;
      // --limit-bytes' default is the command's own (compare: 8192): its description only.
      const bool limit = line.starts_with("  --limit-bytes ");
      lines += (limit ? line.substr(std::min(line.find("read only"), line.size())) : line) + "\n";
    }
    return lines;
  };
  const std::string stream = option_lines("stream");
  EXPECT_NE(stream.find("--turn-separator"), std::string::npos) << stream;
  EXPECT_EQ(option_lines("compare"), stream);
}

TEST_F(Cli, CompareFeedsTurnsToTurnEvictingPolicies) {
  write_text(file("turns.txt"), [] {
    std::string text;
    for (int i = 0; i < 24; ++i) {
      std::string turn = sample_text(60);  // one turn each: its own blank lines become spaces
      std::replace(turn.begin(), turn.end(), '\n', ' ');
      text += turn + "\n\n";
    }
    return text;
  }());
  const std::vector<std::string> arguments = {
      "compare", *model_,   "--input", file("turns.txt"), "--budget",
      "24",      "--chunk", "8",       "--policies",      "full,sirllm"};
  std::vector<std::string> with_turns = arguments;
  with_turns.insert(with_turns.end(), {"--turn-separator", "\\n\\n"});
  const json turns = run_json(with_turns);
  EXPECT_EQ(turns["turns"], 24);
  const json& sirllm = turns["rows"][1];
  EXPECT_GT(sirllm["cache"]["evicted_slots"].get<std::int64_t>(), 0) << sirllm;
  EXPECT_LT(sirllm["cache"]["peak_kv_bytes"], turns["rows"][0]["cache"]["peak_kv_bytes"]);
  // Without turns SirLLM never evicts, and says so.
  const CommandResult one_turn = run(arguments);
  EXPECT_EQ(one_turn.code, 0) << one_turn.err;
  EXPECT_NE(one_turn.err.find("evicts only before a turn"), std::string::npos) << one_turn.err;
}

// The text report's granularity line: what a keep-set covers, and where it came from.
TEST_F(Cli, StreamSaysItsGranularity) {
  const auto granularity_line = [&](std::vector<std::string> extra) {
    std::vector<std::string> arguments = {"stream",           *model_,         "--input",
                                          file("text2k.txt"), "--limit-bytes", "256"};
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    const CommandResult result = run(arguments);
    EXPECT_EQ(result.code, 0) << result.err;
    const std::size_t at = result.out.find("granularity    ");
    return at == std::string::npos ? std::string()
                                   : result.out.substr(at, result.out.find('\n', at) - at);
  };
  const std::string h2o = granularity_line({"--policy", "h2o", "--budget", "32"});
  EXPECT_NE(h2o.find("head: one keep-set per KV head (h2o's default; kvevict-llama decides per "
                     "token"),
            std::string::npos)
      << h2o;
  EXPECT_NE(h2o.find("--granularity token"), std::string::npos) << h2o;
  EXPECT_NE(granularity_line({"--policy", "window", "--budget", "32"})
                .find("token: one keep-set for the whole model, per token (window's default"),
            std::string::npos);
  EXPECT_NE(granularity_line({"--policy", "h2o", "--budget", "32", "--granularity", "token"})
                .find("(--granularity)"),
            std::string::npos);
}

#endif  // KVEVICT_CLI_PATH

// --- --insert-anchors: AnchorInserter ---------------------------------------------------------

constexpr std::int32_t kAnchor = 258;

// The bytes of `text` as byte-level tokens, fed in blocks cut at `cuts` (offsets into the text);
// the output rendered with "<AC>" for each anchor. `finish`: the text is a whole document.
std::string with_anchors(const std::string& text, const std::vector<std::size_t>& cuts = {},
                         bool finish = true) {
  kvevict::harness::AnchorInserter inserter(kAnchor);
  std::vector<std::int32_t> out;
  std::size_t begin = 0;
  std::vector<std::size_t> ends = cuts;
  ends.push_back(text.size());
  for (const std::size_t end : ends) {
    std::vector<std::int32_t> block;
    for (std::size_t i = begin; i < end; ++i) block.push_back(static_cast<unsigned char>(text[i]));
    inserter.push(block, out);
    begin = end;
  }
  if (finish) inserter.finish(out);
  std::string rendered;
  for (const std::int32_t token : out) {
    rendered += token == kAnchor ? std::string("<AC>") : std::string(1, static_cast<char>(token));
  }
  return rendered;
}

TEST(AnchorInserter, AnchorsFollowSentenceEnds) {
  // '.' after "beginning" and '!' after "said" are followed by a space, '?' after "Yes" by '\n':
  // three sentence ends, each anchor right after the terminator (before the whitespace). The
  // "\n" left after the last one is a unit of its own, closed by the document's end.
  EXPECT_EQ(with_anchors("In the beginning. And God said! Yes?\n"),
            "In the beginning.<AC> And God said!<AC> Yes?<AC>\n<AC>");
  // Closing quotes / brackets belong to the sentence: the anchor goes after '"', before ' '.
  // "Then" is the document's last unit: anchor at the end.
  EXPECT_EQ(with_anchors("He said, \"Go.\" Then"), "He said, \"Go.\"<AC> Then<AC>");
  EXPECT_EQ(with_anchors("(Really?) 'Yes!' [Done.]\tok"),
            "(Really?)<AC> 'Yes!'<AC> [Done.]<AC>\tok<AC>");
  // '.' followed by '1' is no sentence end; the only anchor is the document's end.
  EXPECT_EQ(with_anchors("3.14 is pi", {}, /*finish=*/false), "3.14 is pi");
  EXPECT_EQ(with_anchors("3.14 is pi"), "3.14 is pi<AC>");
  // "e.g.x": each '.' is followed by a letter: none.
  EXPECT_EQ(with_anchors("e.g.x", {}, /*finish=*/false), "e.g.x");
  // A quote followed by a letter is no end either ('.' '"' 'x').
  EXPECT_EQ(with_anchors("a.\"x b", {}, /*finish=*/false), "a.\"x b");
  // "Wait..." at the end of the input: the last '.' is followed by the end ($). Nothing yet
  // before the end is known; one anchor after the last '.' (the regex matches only that one).
  EXPECT_EQ(with_anchors("Wait...", {}, /*finish=*/false), "Wait...");
  EXPECT_EQ(with_anchors("Wait..."), "Wait...<AC>");
  EXPECT_EQ(with_anchors("Wait... no"), "Wait...<AC> no<AC>");
  // Every kind of \s (Python's bytes \s: space \t \n \v \f \r) ends a sentence.
  for (const char space : std::string(" \t\n\v\f\r")) {
    EXPECT_EQ(with_anchors(std::string("A.") + space + "B", {}, false),
              std::string("A.<AC>") + space + "B");
  }
}

TEST(AnchorInserter, SentenceEndSplitAcrossBlocks) {
  // '.' ends block 1, ' ' starts block 2: after block 1 the end is pending (no anchor yet) ...
  kvevict::harness::AnchorInserter inserter(kAnchor);
  std::vector<std::int32_t> out;
  inserter.push(std::vector<std::int32_t>{'O', 'n', 'e', '.'}, out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{'O', 'n', 'e', '.'}));
  EXPECT_TRUE(inserter.pending());
  inserter.push(std::vector<std::int32_t>{' ', 'T'}, out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{'O', 'n', 'e', '.', kAnchor, ' ', 'T'}));
  // ... and block 2's first byte decides it: the same tokens as in one block.
  EXPECT_EQ(with_anchors("One. Two", {4}), with_anchors("One. Two"));
  EXPECT_EQ(with_anchors("One. Two", {4}), "One.<AC> Two<AC>");
  // A '.' ending a block and a digit starting the next: no end ("3." + "14").
  EXPECT_EQ(with_anchors("3.14", {2}), "3.14<AC>");
  // Every cut point (and every byte its own block) gives the one-block result.
  for (const std::string text :
       {"In the beginning. And God said! Yes?\n", "He said, \"Go.\" Then", "Wait...", "e.g.x"}) {
    const std::string whole = with_anchors(text);
    std::vector<std::size_t> every;
    for (std::size_t cut = 1; cut < text.size(); ++cut) {
      EXPECT_EQ(with_anchors(text, {cut}), whole) << text << " cut at " << cut;
      every.push_back(cut);
    }
    EXPECT_EQ(with_anchors(text, every), whole) << text;
  }
}

TEST(AnchorInserter, DocumentEndIsASentenceEnd) {
  EXPECT_EQ(with_anchors("No full stop"), "No full stop<AC>");
  EXPECT_EQ(with_anchors("The end."), "The end.<AC>");        // pending end closed by $
  EXPECT_EQ(with_anchors("The end.\""), "The end.\"<AC>");    // with its closing quote
  EXPECT_EQ(with_anchors("The end. "), "The end.<AC> <AC>");  // the trailing space is a unit
  EXPECT_EQ(with_anchors(""), "");                            // nothing, no anchor
  // An anchor already in the input closes the unit: none twice.
  kvevict::harness::AnchorInserter inserter(kAnchor);
  std::vector<std::int32_t> out;
  inserter.push(std::vector<std::int32_t>{256, 'A', '.', kAnchor, ' ', 'B', '.', kAnchor}, out);
  inserter.finish(out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{256, 'A', '.', kAnchor, ' ', 'B', '.', kAnchor}));
  EXPECT_EQ(inserter.inserted(), 0);
  // BOS is transparent; inserted() counts the anchors added.
  out.clear();
  inserter.push(std::vector<std::int32_t>{256, 'H', 'i', '.', ' ', 'O', 'k'}, out);
  inserter.finish(out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{256, 'H', 'i', '.', kAnchor, ' ', 'O', 'k', kAnchor}));
  EXPECT_EQ(inserter.inserted(), 2);
}

TEST(AnchorInserter, ByteLevelTokenizersWithAnAnchorOnly) {
  kvevict::model::Tokenizer tokenizer;
  tokenizer.kind = kvevict::model::Tokenizer::Kind::byte_level;
  tokenizer.anchor_id = 258;
  EXPECT_EQ(kvevict::harness::AnchorInserter::for_tokenizer(tokenizer).anchor_id(), 258);
  tokenizer.anchor_id = -1;
  kvevict::test::expect_error(
      [&] { (void)kvevict::harness::AnchorInserter::for_tokenizer(tokenizer); },
      "--insert-anchors");
  tokenizer.kind = kvevict::model::Tokenizer::Kind::sentencepiece;
  tokenizer.anchor_id = 258;
  kvevict::test::expect_error(
      [&] { (void)kvevict::harness::AnchorInserter::for_tokenizer(tokenizer); }, "SentencePiece");
}

#ifdef KVEVICT_CLI_PATH

TEST_F(Cli, StreamInsertAnchorsFeedsAnLLMAndScoresTheTextOnly) {
  const std::string text = read_text(file("text4k.txt"));
  const json anchored =
      run_json({"stream", "--model", *model_, "--input", file("text4k.txt"), "--insert-anchors",
                "--policy", "anllm", "--budget", "48", "--window", "512"});
  EXPECT_EQ(anchored["policy"]["params"]["anchor_ids"], json::array({258}));
  EXPECT_GT(anchored["cache"]["decisions"].get<int>(), 0);
  // The anchors the command inserted are the inserter's on the same text.
  const std::string expected = with_anchors(text);
  std::size_t count = 0;
  for (std::size_t at = expected.find("<AC>"); at != std::string::npos;
       at = expected.find("<AC>", at + 1)) {
    ++count;
  }
  EXPECT_GT(count, 10U);
  EXPECT_EQ(anchored["anchors"], count);
  // Fed: BOS + the bytes + the anchors; scored: the bytes only, overall and per window.
  EXPECT_EQ(anchored["cache"]["tokens"], 1 + text.size() + count);
  EXPECT_EQ(anchored["input_bytes"], text.size());
  EXPECT_EQ(anchored["tokens"], text.size());
  EXPECT_EQ(anchored["bytes"], text.size());
  std::int64_t window_tokens = 0;
  std::uint64_t window_bytes = 0;
  for (const json& window : anchored["windows"]) {
    window_tokens += window["tokens"].get<std::int64_t>();
    window_bytes += window["bytes"].get<std::uint64_t>();
  }
  EXPECT_EQ(window_tokens, static_cast<std::int64_t>(text.size()));
  EXPECT_EQ(window_bytes, text.size());
  EXPECT_TRUE(std::isfinite(anchored["bits_per_byte"].get<double>()));

  // generate: anchors in the prompt ("One.<AC> Two.<AC> Three" + pending "."), then generation.
  const json generated =
      run_json({"generate", "--model", *model_, "--prompt", "One. Two. Three.", "--insert-anchors",
                "--policy", "anllm", "--budget", "16", "--max-tokens", "24"});
  EXPECT_EQ(generated["anchors"]["prompt"], 2);
  EXPECT_EQ(generated["prompt_tokens"], 1 + 16 + 2);

  // A model without an anchor token: exit 2.
  ASSERT_EQ(run({"random-model", "--out", file("no-anchor-ia.gguf"), "--vocab", "258"}).code, 0);
  for (const char* command : {"stream", "generate"}) {
    std::vector<std::string> arguments = {command, "--model", file("no-anchor-ia.gguf"),
                                          "--insert-anchors"};
    if (std::string(command) == "stream") {
      arguments.insert(arguments.end(), {"--input", file("text2k.txt")});
    } else {
      arguments.insert(arguments.end(), {"--prompt", "x"});
    }
    const CommandResult result = run(arguments);
    EXPECT_EQ(result.code, 2) << command << result.err;
    EXPECT_NE(result.err.find("kvevict: error: --insert-anchors"), std::string::npos) << result.err;
  }
  const CommandResult help = run({"stream", "--help"});
  EXPECT_NE(help.out.find("--insert-anchors"), std::string::npos);
}

#endif  // KVEVICT_CLI_PATH

}  // namespace
