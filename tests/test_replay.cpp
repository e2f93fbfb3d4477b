// The replay tool (docs/replay-format.md): every conformance fixture in tests/data/replay against
// its `expected`, hostile input of every kind, hand-checked keep-sets and attention rows, the
// catalyst / pot-splitting path through a test policy, and the `kvevict replay` CLI.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <kvevict/error.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/selection.hpp>
#include <kvevict/signals.hpp>
#include <kvevict/slot_table.hpp>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "replay/replay.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Positions = std::vector<std::int64_t>;

fs::path replay_data_dir() { return fs::path(KVEVICT_TEST_DATA_DIR) / "replay"; }

std::vector<fs::path> fixture_files() {
  std::vector<fs::path> files;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(replay_data_dir(), error)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << text;
}

// The message of the kvevict::Error that parsing and running `document` throws, or "" if none.
// Any other exception type escaping is a bug and fails the test.
std::string replay_error(const json& document) {
  try {
    const kvevict::replay::Replay replay = kvevict::replay::parse_replay(document);
    (void)kvevict::replay::run_replay(replay);
  } catch (const kvevict::Error& error) {
    return error.what();
  } catch (const std::exception& error) {
    ADD_FAILURE() << "non-kvevict exception: " << error.what();
    return "";
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// (a) Conformance fixtures
// ---------------------------------------------------------------------------------------------

class ReplayFixture : public ::testing::TestWithParam<fs::path> {};

TEST_P(ReplayFixture, AgreesWithExpected) {
  const kvevict::replay::Replay replay = kvevict::replay::load_replay(GetParam());
  ASSERT_TRUE(replay.expected.has_value()) << GetParam() << " has no \"expected\"";
  kvevict::replay::ReplayResult actual;
  // A policy missing from the registry is a failure, not a skip: the fixture says it should work.
  try {
    actual = kvevict::replay::run_replay(replay);
  } catch (const kvevict::Error& error) {
    FAIL() << replay.name << ": " << error.what();
  }
  const kvevict::replay::Comparison comparison =
      kvevict::replay::compare_results(*replay.expected, actual);
  EXPECT_TRUE(comparison.agree) << replay.name << " (" << replay.source << "):\n"
                                << kvevict::replay::describe(comparison, replay.chunks);
}

std::string fixture_test_name(const ::testing::TestParamInfo<fs::path>& info) {
  std::string name = info.param.stem().string();
  for (char& c : name) {
    if (std::isalnum(static_cast<unsigned char>(c)) == 0) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ReplayFixture, ::testing::ValuesIn(fixture_files()),
                         fixture_test_name);

TEST(ReplayFixtures, DirectoryHoldsEveryPublishedFixture) {
  // The 24 conformance files; a missing one must not silently shrink the suite.
  EXPECT_GE(fixture_files().size(), 24u) << replay_data_dir();
}

// SnapKV, PyramidKV, Ada-KV: "pooling" and "gqa" are words; under gqa = repeat the cache lays out
// one head per query head, so a layer's result has q_heads lists.
TEST(ReplayPromptCompression, ChoiceParametersAndOneListPerQueryHeadUnderRepeat) {
  const json fixture = json::parse(read_text(replay_data_dir() / "snapkv_gqa_maxpool_chunks.json"));
  ASSERT_EQ(fixture["shape"]["q_heads"], 4);
  ASSERT_EQ(fixture["shape"]["kv_heads"], 2);
  const kvevict::replay::ReplayResult repeat =
      kvevict::replay::run_replay(kvevict::replay::parse_replay(fixture));
  EXPECT_EQ(repeat.after_chunk[0].kept[0].size(), 4u);
  json mean = fixture;
  mean["policy"]["gqa"] = "mean";
  mean.erase("expected");
  const kvevict::replay::ReplayResult per_kv_head =
      kvevict::replay::run_replay(kvevict::replay::parse_replay(mean));
  EXPECT_EQ(per_kv_head.after_chunk[0].kept[0].size(), 2u);
  // Each unit keeps capacity = 20 of the 44-token prompt either way.
  EXPECT_EQ(per_kv_head.after_chunk[0].kept[0][0].size(), 20u);
  EXPECT_EQ(repeat.after_chunk[0].kept[0][3].size(), 20u);

  json bad = fixture;
  bad["policy"]["pooling"] = "median";
  const std::string unknown_word = replay_error(bad);
  EXPECT_NE(unknown_word.find("policy.pooling"), std::string::npos) << unknown_word;
  EXPECT_NE(unknown_word.find("expected one of avg, max"), std::string::npos) << unknown_word;
  bad["policy"]["pooling"] = 3;
  const std::string number = replay_error(bad);
  EXPECT_NE(number.find("parameter 'pooling' must be one of avg, max, got 3"), std::string::npos)
      << number;
  bad["policy"]["pooling"] = "max";
  bad["policy"]["window"] = "6";  // a word where a number goes
  const std::string word = replay_error(bad);
  EXPECT_NE(word.find("policy.window"), std::string::npos) << word;
  EXPECT_NE(word.find("expected a number or an array of integers"), std::string::npos) << word;
}

TEST(ReplayResultFormat, FormattedResultParsesBackToTheSameLists) {
  const kvevict::replay::Replay replay =
      kvevict::replay::load_replay(replay_data_dir() / "window_gqa_prefill_chunks.json");
  const kvevict::replay::ReplayResult result = kvevict::replay::run_replay(replay);
  const json text_form = json::parse(kvevict::replay::format_result(result));
  EXPECT_EQ(text_form, kvevict::replay::result_to_json(result));
  EXPECT_EQ(text_form.at("format"), "kvevict-replay-result/1");
  const kvevict::replay::ReplayResult reparsed = kvevict::replay::parse_result(text_form);
  EXPECT_TRUE(kvevict::replay::compare_results(result, reparsed).agree);
  EXPECT_EQ(reparsed.after_chunk.size(), replay.chunks.size());
}

TEST(ReplayCompare, ReportsFirstDisagreementAsSets) {
  kvevict::replay::ReplayResult expected;
  expected.after_chunk = {{{{{0, 1, 2}, {0, 1, 2}}}}, {{{{0, 2, 3}, {1, 2, 3}}}}};
  kvevict::replay::ReplayResult actual = expected;
  actual.after_chunk[0].kept[0][1] = {2, 1, 0, 0};  // same set, other order, a duplicate
  EXPECT_TRUE(kvevict::replay::compare_results(expected, actual).agree);

  actual.after_chunk[1].kept[0][1] = {0, 2, 3};  // expected {1, 2, 3}
  const kvevict::replay::Comparison comparison = kvevict::replay::compare_results(expected, actual);
  ASSERT_FALSE(comparison.agree);
  ASSERT_TRUE(comparison.first.has_value());
  EXPECT_EQ(comparison.first->chunk, 1);
  EXPECT_EQ(comparison.first->layer, 0);
  EXPECT_EQ(comparison.first->kv_head, 1);
  EXPECT_EQ(comparison.first->only_expected, Positions({1}));
  EXPECT_EQ(comparison.first->only_actual, Positions({0}));
  EXPECT_EQ(comparison.lists_disagreeing, 1);
  EXPECT_EQ(comparison.lists_compared, 4);
  const std::string report = kvevict::replay::describe(comparison, std::vector<int>{3, 1});
  EXPECT_NE(report.find("chunk 1 (positions [3, 4)), layer 0, KV head 1"), std::string::npos)
      << report;
  EXPECT_NE(report.find("only in expected: 1"), std::string::npos) << report;
  EXPECT_NE(report.find("only in actual:   0"), std::string::npos) << report;

  actual.after_chunk.pop_back();
  const kvevict::replay::Comparison shorter = kvevict::replay::compare_results(expected, actual);
  EXPECT_FALSE(shorter.agree);
  EXPECT_NE(kvevict::replay::describe(shorter).find("2 chunks, actual has 1"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// A tiny valid replay: 1 layer, 2 query heads on 1 KV head, 4 tokens fed as [2, 1, 1].
// ---------------------------------------------------------------------------------------------

json logits_tensor(int layers, int q_heads, int tokens,
                   const std::function<double(int, int, int, int)>& value) {
  json tensor = json::array();
  for (int l = 0; l < layers; ++l) {
    json heads = json::array();
    for (int h = 0; h < q_heads; ++h) {
      json rows = json::array();
      for (int i = 0; i < tokens; ++i) {
        json row = json::array();
        for (int j = 0; j < tokens; ++j) row.push_back(j <= i ? value(l, h, i, j) : 0.0);
        rows.push_back(std::move(row));
      }
      heads.push_back(std::move(rows));
    }
    tensor.push_back(std::move(heads));
  }
  return tensor;
}

json tiny_replay() {
  return json{
      {"format", "kvevict-replay/1"},
      {"name", "tiny"},
      {"shape", {{"layers", 1}, {"q_heads", 2}, {"kv_heads", 1}}},
      {"tokens", 4},
      {"chunks", {2, 1, 1}},
      {"logits",
       logits_tensor(1, 2, 4, [](int, int h, int i, int j) { return 0.25 * (h + 1) * (i - j); })},
      {"policy", {{"name", "window"}, {"recent", 2}}},
      {"expected",
       {{"format", "kvevict-replay-result/1"},
        {"after_chunk", {{{"kept", {{{0, 1}}}}}, {{"kept", {{{1, 2}}}}}, {{"kept", {{{2, 3}}}}}}}}},
  };
}

TEST(ReplayHostileInput, TinyReplayIsValidAndAgrees) {
  const kvevict::replay::Replay replay = kvevict::replay::parse_replay(tiny_replay());
  EXPECT_EQ(replay.name, "tiny");
  ASSERT_TRUE(replay.expected.has_value());
  const kvevict::replay::ReplayResult result = kvevict::replay::run_replay(replay);
  EXPECT_TRUE(kvevict::replay::compare_results(*replay.expected, result).agree);
}

struct BadInput {
  std::string description;
  std::function<void(json&)> mutate;
  std::vector<std::string> message_parts;  // each must occur in the error message
};

std::vector<BadInput> bad_inputs() {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return {
      // Document and format
      {"not an object",
       [](json& d) {
         d = json::array({1, 2});
       },
       {"expected an object"}},
      {"wrong format",
       [](json& d) { d["format"] = "kvevict-replay/2"; },
       {"format", "kvevict-replay/1", "kvevict-replay/2"}},
      {"missing format", [](json& d) { d.erase("format"); }, {"format", "missing"}},
      {"format not a string", [](json& d) { d["format"] = 1; }, {"format", "expected a string"}},
      {"missing name", [](json& d) { d.erase("name"); }, {"name", "missing"}},
      // Shape
      {"missing shape", [](json& d) { d.erase("shape"); }, {"shape", "missing"}},
      {"shape not an object",
       [](json& d) {
         d["shape"] = json::array({1, 2, 1});
       },
       {"shape", "expected an object"}},
      {"missing kv_heads",
       [](json& d) { d["shape"].erase("kv_heads"); },
       {"shape.kv_heads", "missing"}},
      {"zero layers", [](json& d) { d["shape"]["layers"] = 0; }, {"shape.layers", "outside"}},
      {"negative q_heads",
       [](json& d) { d["shape"]["q_heads"] = -2; },
       {"shape.q_heads", "outside"}},
      {"q_heads not a multiple of kv_heads",
       [](json& d) { d["shape"]["kv_heads"] = 3; },
       {"shape", "q_heads (2) is not a multiple of kv_heads (3)"}},
      {"layers as a string",
       [](json& d) { d["shape"]["layers"] = "1"; },
       {"shape.layers", "expected an integer", "string"}},
      {"too many layer heads",
       [](json& d) { d["shape"]["layers"] = 1 << 16; },
       {"shape", "layers * q_heads", "limit"}},
      // Tokens and chunks
      {"missing tokens", [](json& d) { d.erase("tokens"); }, {"tokens", "missing"}},
      {"tokens not an integer",
       [](json& d) { d["tokens"] = 4.5; },
       {"tokens", "expected an integer", "4.5"}},
      {"tokens past the limit",
       [](json& d) { d["tokens"] = (1 << 16) + 1; },
       {"tokens", "outside [1, 65536]"}},
      {"logits past the limit",
       [](json& d) {
         d["tokens"] = 60000;
         d["chunks"] = {60000};
       },
       {"logits", "limit"}},
      {"chunks not summing to tokens",
       [](json& d) {
         d["chunks"] = {2, 1};
       },
       {"chunks", "sum to 3", "tokens is 4"}},
      {"chunks summing past tokens",
       [](json& d) {
         d["chunks"] = {2, 1, 2};
       },
       {"chunks", "past tokens"}},
      {"zero-size chunk",
       [](json& d) {
         d["chunks"] = {2, 0, 1, 1};
       },
       {"chunks[1]", "positive"}},
      {"negative chunk",
       [](json& d) {
         d["chunks"] = {2, -1, 3};
       },
       {"chunks[1]", "positive"}},
      {"no chunks", [](json& d) { d["chunks"] = json::array(); }, {"chunks", "at least one"}},
      {"chunks not an array", [](json& d) { d["chunks"] = 4; }, {"chunks", "expected an array"}},
      // Logits
      {"missing logits", [](json& d) { d.erase("logits"); }, {"logits", "missing"}},
      {"logits not an array", [](json& d) { d["logits"] = 0; }, {"logits", "expected an array"}},
      {"logits missing a layer",
       [](json& d) { d["logits"] = json::array(); },
       {"logits", "expected 1 entries (layers), got 0"}},
      {"logits missing a head",
       [](json& d) { d["logits"][0].erase(1); },
       {"logits[0]", "expected 2 entries (q_heads), got 1"}},
      {"logits missing a row",
       [](json& d) { d["logits"][0][1].erase(3); },
       {"logits[0][1]", "expected 4 entries", "got 3"}},
      {"logits row too long",
       [](json& d) { d["logits"][0][1][2].push_back(0.0); },
       {"logits[0][1][2]", "expected 4 entries", "got 5"}},
      {"logits row not an array",
       [](json& d) { d["logits"][0][0][2] = 1.0; },
       {"logits[0][0][2]", "expected an array"}},
      {"logit not a number",
       [](json& d) { d["logits"][0][0][2][1] = "x"; },
       {"logits[0][0][2][1]", "expected a number"}},
      {"ignored logit not a number",
       [](json& d) { d["logits"][0][0][1][3] = nullptr; },
       {"logits[0][0][1][3]", "expected a number"}},
      {"infinite logit",
       [inf](json& d) { d["logits"][0][1][3][0] = inf; },
       {"logits[0][1][3][0]", "finite"}},
      {"NaN logit",
       [nan](json& d) { d["logits"][0][0][0][0] = nan; },
       {"logits[0][0][0][0]", "finite"}},
      // Optional per-token arrays
      {"surprisal too short",
       [](json& d) {
         d["surprisal"] = {0.1, 0.2, 0.3};
       },
       {"surprisal", "expected 4 entries", "got 3"}},
      {"surprisal entry not a number",
       [](json& d) {
         d["surprisal"] = {0.1, "a", 0.3, 0.4};
       },
       {"surprisal[1]", "expected a number"}},
      {"surprisal past float range",
       [](json& d) {
         d["surprisal"] = {1e300, 0.2, 0.3, 0.4};
       },
       {"surprisal[0]", "float"}},
      {"infinite surprisal",
       [inf](json& d) {
         d["surprisal"] = {0.1, 0.2, 0.3, -inf};
       },
       {"surprisal[3]", "finite"}},
      {"token_ids too long",
       [](json& d) {
         d["token_ids"] = {1, 2, 3, 4, 5};
       },
       {"token_ids", "expected 4 entries", "got 5"}},
      {"token id not an integer",
       [](json& d) {
         d["token_ids"] = {1, 2, 3.5, 4};
       },
       {"token_ids[2]", "expected an integer"}},
      {"token id past int32",
       [](json& d) {
         d["token_ids"] = {std::int64_t{1} << 40, 2, 3, 4};
       },
       {"token_ids[0]", "outside"}},
      // Catalyst
      {"catalyst not an object",
       [](json& d) { d["catalyst"] = 5; },
       {"catalyst", "expected an object"}},
      {"catalyst without logits",
       [](json& d) {
         d["catalyst"] = {{"length", 2}};
       },
       {"catalyst.logits", "missing"}},
      {"catalyst of length 0",
       [](json& d) {
         d["catalyst"] = {{"length", 0}, {"logits", json::array()}};
       },
       {"catalyst.length", "outside"}},
      {"catalyst logits with T columns instead of T + P",
       [](json& d) {
         // [1][2][2][4]: every row one catalyst token short.
         json rows = json::array({json::array({0, 0, 0, 0}), json::array({0, 0, 0, 0})});
         d["catalyst"] = {{"length", 2}, {"logits", json::array({json::array({rows, rows})})}};
       },
       {"catalyst.logits[0][0][0]", "expected 6 entries", "got 4"}},
      {"catalyst past the limit",
       [](json& d) {
         d["catalyst"] = {{"length", 1 << 16}, {"logits", json::array()}};
       },
       {"catalyst", "limit"}},
      // Policy
      {"missing policy", [](json& d) { d.erase("policy"); }, {"policy", "missing"}},
      {"policy without a name",
       [](json& d) { d["policy"].erase("name"); },
       {"policy.name", "missing"}},
      {"policy name not a string",
       [](json& d) { d["policy"]["name"] = 3; },
       {"policy.name", "expected a string"}},
      {"unknown policy",
       [](json& d) { d["policy"]["name"] = "no_such_policy"; },
       {"policy", "unknown policy 'no_such_policy'"}},
      {"invalid parameter value",
       [](json& d) { d["policy"]["recent"] = -1; },
       {"policy", "recent"}},
      {"missing parameter",
       [](json& d) { d["policy"].erase("recent"); },
       {"policy", "missing parameter 'recent'"}},
      {"misspelt parameter",
       [](json& d) { d["policy"]["recnt"] = 3; },
       {"policy", "unknown parameter 'recnt'"}},
      {"parameter as a string",
       [](json& d) { d["policy"]["recent"] = "2"; },
       {"policy.recent", "expected a number or an array of integers"}},
      {"parameter as a boolean",
       [](json& d) { d["policy"]["recent"] = true; },
       {"policy.recent", "expected a number or an array of integers"}},
      {"list parameter with a non-integer",
       [](json& d) {
         d["policy"]["ids"] = {1, 2.5};
       },
       {"policy.ids[1]", "expected an integer"}},
      // Expected result
      {"expected with the wrong format",
       [](json& d) { d["expected"]["format"] = "x"; },
       {"expected.format", "kvevict-replay-result/1"}},
      {"expected missing a chunk",
       [](json& d) { d["expected"]["after_chunk"].erase(2); },
       {"expected.after_chunk", "one per chunk"}},
      {"expected with a layer too many",
       [](json& d) { d["expected"]["after_chunk"][0]["kept"].push_back({{0}}); },
       {"expected.after_chunk[0].kept", "expected 1 entries (layers)"}},
      {"expected with a KV head too many",
       [](json& d) { d["expected"]["after_chunk"][1]["kept"][0].push_back({0}); },
       {"expected.after_chunk[1].kept[0]", "kv_heads"}},
      {"expected position past tokens",
       [](json& d) {
         d["expected"]["after_chunk"][1]["kept"][0][0] = {1, 4};
       },
       {"expected.after_chunk[1].kept[0][0]", "position 4", "outside [0, 4)"}},
      {"expected negative position",
       [](json& d) {
         d["expected"]["after_chunk"][2]["kept"][0][0] = {-1, 3};
       },
       {"expected.after_chunk[2].kept[0][0][0]", "outside"}},
      {"expected list not an array",
       [](json& d) { d["expected"]["after_chunk"][0]["kept"][0][0] = "0 1"; },
       {"expected.after_chunk[0].kept[0][0]", "expected an array"}},
  };
}

TEST(ReplayHostileInput, EveryBadInputNamesTheProblemAndItsPath) {
  for (const BadInput& bad : bad_inputs()) {
    SCOPED_TRACE(bad.description);
    json document = tiny_replay();
    bad.mutate(document);
    const std::string message = replay_error(document);
    ASSERT_FALSE(message.empty()) << "no error for: " << bad.description;
    for (const std::string& part : bad.message_parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message \"" << message << "\" lacks \"" << part << "\"";
    }
  }
}

TEST(ReplayHostileInput, IgnoredUpperTriangleMayHoldAnyNumber) {
  json document = tiny_replay();
  document["logits"][0][0][0][3] = 1e308;
  document["logits"][0][1][2][3] = std::numeric_limits<double>::quiet_NaN();
  document["unknown_key"] = {{"anything", true}};
  EXPECT_EQ(replay_error(document), "");
}

TEST(ReplayHostileInput, InvalidJsonTextReportsTheByteOffset) {
  const auto message_of = [](const std::string& text) -> std::string {
    try {
      (void)kvevict::replay::parse_replay_text(text);
    } catch (const kvevict::Error& error) {
      return error.what();
    }
    return "";
  };
  const std::string truncated = message_of(R"({"format": "kvevict-replay/1", "name": )");
  EXPECT_NE(truncated.find("invalid JSON at byte"), std::string::npos) << truncated;
  EXPECT_NE(message_of("").find("invalid JSON"), std::string::npos);
  EXPECT_NE(message_of("{\"format\": nan}").find("invalid JSON"), std::string::npos);
  // A number past double range: nlohmann refuses it rather than storing infinity.
  const std::string overflow = message_of(R"({"format": "kvevict-replay/1", "tokens": 1e400})");
  EXPECT_NE(overflow.find("invalid JSON"), std::string::npos) << overflow;
  EXPECT_NE(message_of("{} trailing").find("invalid JSON"), std::string::npos);
  // Deep nesting: an error, not a stack overflow.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_NE(message_of(deep).find("deeper than"), std::string::npos) << message_of(deep);
}

TEST(ReplayHostileInput, TruncatedFixtureIsAnErrorAtEveryCut) {
  std::string text = read_text(replay_data_dir() / "h2o_gqa_decode.json");
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())) != 0) {
    text.pop_back();
  }
  ASSERT_GT(text.size(), 1000u);
  const std::size_t n = text.size();
  for (std::size_t cut :
       {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{17}, std::size_t{200}, n / 7,
        n / 3, n / 2, 2 * n / 3, n - 100, n - 2, n - 1}) {
    SCOPED_TRACE("cut at byte " + std::to_string(cut));
    EXPECT_THROW((void)kvevict::replay::parse_replay_text(text.substr(0, cut)), kvevict::Error);
  }
  // Byte-level corruption in the middle of the logits.
  std::string corrupted = text;
  corrupted[n / 2] = '}';
  EXPECT_THROW((void)kvevict::replay::parse_replay_text(corrupted), kvevict::Error);
}

TEST(ReplayHostileInput, MissingOrUnreadableFile) {
  EXPECT_THROW((void)kvevict::replay::load_replay(replay_data_dir() / "no_such_file.json"),
               kvevict::replay::ReplayError);
  EXPECT_THROW((void)kvevict::replay::load_replay(replay_data_dir()), kvevict::Error);
}

// ---------------------------------------------------------------------------------------------
// (c) Hand-checked keep-sets through the registry
// ---------------------------------------------------------------------------------------------

json hand_replay(int layers, int q_heads, int kv_heads, int tokens, const std::vector<int>& chunks,
                 json policy) {
  return json{
      {"format", "kvevict-replay/1"},
      {"name", "hand"},
      {"shape", {{"layers", layers}, {"q_heads", q_heads}, {"kv_heads", kv_heads}}},
      {"tokens", tokens},
      {"chunks", chunks},
      {"logits", logits_tensor(layers, q_heads, tokens,
                               [](int l, int h, int i, int j) { return 0.1 * (l + h + i * j); })},
      {"policy", std::move(policy)},
  };
}

// Every (layer, KV head) list of every chunk must equal `per_chunk[k]` (these policies decide the
// same for every head).
void expect_same_in_every_head(const kvevict::replay::ReplayResult& result,
                               const std::vector<Positions>& per_chunk) {
  ASSERT_EQ(result.after_chunk.size(), per_chunk.size());
  for (std::size_t k = 0; k < per_chunk.size(); ++k) {
    for (std::size_t l = 0; l < result.after_chunk[k].kept.size(); ++l) {
      for (std::size_t g = 0; g < result.after_chunk[k].kept[l].size(); ++g) {
        EXPECT_EQ(result.after_chunk[k].kept[l][g], per_chunk[k])
            << "chunk " << k << ", layer " << l << ", KV head " << g;
      }
    }
  }
}

TEST(ReplayHandChecked, WindowKeepsTheLastRecentAfterEveryForward) {
  // recent = 3, chunks [2, 1, 2, 1]: 0..1 fits; 0..2 fits; 0..4 -> {2, 3, 4}; 2..5 -> {3, 4, 5}.
  const auto replay = kvevict::replay::parse_replay(
      hand_replay(1, 2, 2, 6, {2, 1, 2, 1}, {{"name", "window"}, {"recent", 3}}));
  expect_same_in_every_head(kvevict::replay::run_replay(replay),
                            {{0, 1}, {0, 1, 2}, {2, 3, 4}, {3, 4, 5}});
}

TEST(ReplayHandChecked, WindowTrimsAChunkLongerThanTheWindowAfterItsForward) {
  // recent = 2, one chunk of 5 then one of 1: {3, 4}, then {4, 5}.
  const auto replay = kvevict::replay::parse_replay(
      hand_replay(2, 2, 1, 6, {5, 1}, {{"name", "window"}, {"recent", 2}}));
  expect_same_in_every_head(kvevict::replay::run_replay(replay), {{3, 4}, {4, 5}});
}

TEST(ReplayHandChecked, StreamingLlmKeepsSinksAndTheLastRecent) {
  // sinks = 1, recent = 2, chunks [3, 2, 1, 1]: 0..2 fits (3 <= 1 + 2); 0..4 -> {0} + {3, 4};
  // {0, 3, 4, 5} -> {0, 4, 5}; {0, 4, 5, 6} -> {0, 5, 6}. GQA: 4 query heads on 2 KV heads.
  const auto replay = kvevict::replay::parse_replay(hand_replay(
      2, 4, 2, 7, {3, 2, 1, 1}, {{"name", "streaming_llm"}, {"sinks", 1}, {"recent", 2}}));
  expect_same_in_every_head(kvevict::replay::run_replay(replay),
                            {{0, 1, 2}, {0, 3, 4}, {0, 4, 5}, {0, 5, 6}});
}

TEST(ReplayHandChecked, StreamingLlmDefaultSinksAreFour) {
  // sinks default 4, recent = 2, chunks [7, 1]: 0..6 -> {0..3} + {5, 6}; then {0..3} + {6, 7}.
  const auto replay = kvevict::replay::parse_replay(
      hand_replay(1, 1, 1, 8, {7, 1}, {{"name", "streaming_llm"}, {"recent", 2}}));
  expect_same_in_every_head(kvevict::replay::run_replay(replay),
                            {{0, 1, 2, 3, 5, 6}, {0, 1, 2, 3, 6, 7}});
}

// ---------------------------------------------------------------------------------------------
// Attention rows and the catalyst / pot path, through test policies
// ---------------------------------------------------------------------------------------------

// What a policy saw of one AttentionRows call.
struct SeenRows {
  int layer = 0;
  int queries = 0;
  std::int64_t first_query_position = 0;
  std::vector<int> keys;                              // per query head
  std::vector<std::vector<std::vector<float>>> rows;  // [q_head][query][slot]
};

// The rows as the policy saw them, each in stream order (oldest live token first), so that the
// expectations do not depend on which slots the tokens took.
SeenRows copy_rows(const kvevict::SlotTable& slots, int layer, const kvevict::AttentionRows& rows) {
  SeenRows seen{layer, rows.queries(), rows.first_query_position(), {}, {}};
  for (int h = 0; h < rows.q_heads(); ++h) {
    seen.keys.push_back(rows.keys(h));
    const auto order = slots.stream_order(slots.layout().unit_of(layer, h / rows.group_size()));
    seen.rows.emplace_back();
    for (int q = 0; q < rows.queries(); ++q) {
      const std::span<const float> row = rows.row(h, q);
      std::vector<float> by_age;
      for (const std::int32_t slot : order) by_age.push_back(row[static_cast<std::size_t>(slot)]);
      seen.rows.back().push_back(std::move(by_age));
    }
  }
  return seen;
}

// Records the attention rows it is given and keeps the last `keep` tokens after every forward.
class RecordingPolicy final : public kvevict::Policy {
 public:
  RecordingPolicy(kvevict::Signal signal, int keep) : signal_(signal), keep_(keep) {}
  [[nodiscard]] std::string_view name() const override { return "recording"; }
  [[nodiscard]] kvevict::SignalSet signals() const override { return {signal_}; }
  void observe_attention(kvevict::SlotTable& slots, int layer,
                         const kvevict::AttentionRows& rows) override {
    seen->push_back(copy_rows(slots, layer, rows));
  }
  void select(const kvevict::EvictionContext& context, kvevict::Decision& decision) override {
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      keep_set_.begin(context.slots, unit, context.protection);
      keep_set_.keep_newest(keep_);
      keep_set_.evict_rest(decision);
    }
  }
  std::shared_ptr<std::vector<SeenRows>> seen = std::make_shared<std::vector<SeenRows>>();

 private:
  kvevict::Signal signal_;
  int keep_;
  kvevict::KeepSet keep_set_;
};

// 1 layer, 2 query heads on 1 KV head, 4 tokens as [2, 1, 1]; logits chosen so that every row
// has a hand-computable softmax. logits[h][i][j]:
//   h 0: i=1: (0, ln 3)        -> (1/4, 3/4)
//        i=2: (0, 0, ln 2)     -> (1/4, 1/4, 1/2)
//        i=3: (99, 0, ln 3, 0) -> key 0 is evicted by then: over {1, 2, 3}: (1/5, 3/5, 1/5)
//   h 1: all 0                 -> uniform over the keys present
json attention_replay() {
  json document = tiny_replay();
  document.erase("expected");
  document["logits"] = logits_tensor(1, 2, 4, [](int, int h, int i, int j) {
    if (h == 1) return 0.0;
    if (i == 1 && j == 1) return std::log(3.0);
    if (i == 2 && j == 2) return std::log(2.0);
    if (i == 3 && j == 0) return 99.0;
    if (i == 3 && j == 2) return std::log(3.0);
    return 0.0;
  });
  return document;
}

TEST(ReplayAttentionRows, RowsAreSoftmaxOverLiveSlotsAtOriginalPositions) {
  auto policy = std::make_unique<RecordingPolicy>(kvevict::Signal::attention_rows, 2);
  const auto seen = policy->seen;
  const auto replay = kvevict::replay::parse_replay(attention_replay());
  const auto result = kvevict::replay::run_replay(replay, std::move(policy));
  expect_same_in_every_head(result, {{0, 1}, {1, 2}, {2, 3}});

  ASSERT_EQ(seen->size(), 3u);  // one call per forward (one layer)
  const SeenRows& first = (*seen)[0];
  EXPECT_EQ(first.queries, 2);
  EXPECT_EQ(first.first_query_position, 0);
  EXPECT_EQ(first.keys, std::vector<int>({2, 2}));
  // Query 0 sees only key 0; query 1's later chunk-mate is masked for query 0.
  EXPECT_EQ(first.rows[0][0], std::vector<float>({1.0f, 0.0f}));
  EXPECT_EQ(first.rows[0][1], std::vector<float>({0.25f, 0.75f}));
  EXPECT_EQ(first.rows[1][1], std::vector<float>({0.5f, 0.5f}));

  const SeenRows& second = (*seen)[1];
  EXPECT_EQ(second.queries, 1);
  EXPECT_EQ(second.first_query_position, 2);
  EXPECT_EQ(second.keys, std::vector<int>({3, 3}));
  EXPECT_EQ(second.rows[0][0], std::vector<float>({0.25f, 0.25f, 0.5f}));

  // Slot 0 now holds original position 1 (position 0 was evicted with its logit of 99).
  const SeenRows& third = (*seen)[2];
  EXPECT_EQ(third.first_query_position, 3);
  ASSERT_EQ(third.rows[0][0].size(), 3u);
  EXPECT_NEAR(third.rows[0][0][0], 0.2f, 1e-7);
  EXPECT_NEAR(third.rows[0][0][1], 0.6f, 1e-7);
  EXPECT_NEAR(third.rows[0][0][2], 0.2f, 1e-7);
  EXPECT_NEAR(third.rows[1][0][1], 1.0f / 3.0f, 1e-7);
}

TEST(ReplayAttentionRows, ExtremeButFiniteLogitsGiveValidRows) {
  // Logits far apart must not overflow the softmax (differences to the row maximum reach -inf,
  // whose exponential is 0). Query 3 sees keys {1, 2, 3} (window of 2 plus itself).
  json document = attention_replay();
  document["logits"][0][0][3] = {-1e308, 1e308, -1e308, 0.0};
  auto policy = std::make_unique<RecordingPolicy>(kvevict::Signal::attention_rows, 2);
  const auto seen = policy->seen;
  (void)kvevict::replay::run_replay(kvevict::replay::parse_replay(document), std::move(policy));
  ASSERT_EQ(seen->size(), 3u);
  EXPECT_EQ((*seen)[2].rows[0][0], std::vector<float>({1.0f, 0.0f, 0.0f}));
}

TEST(ReplayAttentionRows, LastRowPolicyGetsOnlyTheChunksLastQuery) {
  auto policy = std::make_unique<RecordingPolicy>(kvevict::Signal::last_attention_row, 2);
  const auto seen = policy->seen;
  const auto replay = kvevict::replay::parse_replay(attention_replay());
  (void)kvevict::replay::run_replay(replay, std::move(policy));
  ASSERT_EQ(seen->size(), 3u);
  EXPECT_EQ((*seen)[0].queries, 1);
  EXPECT_EQ((*seen)[0].first_query_position, 1);
  EXPECT_EQ((*seen)[0].rows[0][0], std::vector<float>({0.25f, 0.75f}));
}

// A small pot policy in the shape of InfiniPot: the pot holds `pot` slots; when full, a catalyst
// prompt runs and the `keep` slots with the most catalyst attention (summed over catalyst queries
// and the group's query heads) survive. Records chunk sizes, surprisal and catalyst rows.
class PotPolicy final : public kvevict::Policy {
 public:
  PotPolicy(int pot, int keep) : pot_(pot), keep_(keep) {}
  [[nodiscard]] std::string_view name() const override { return "test_pot"; }
  [[nodiscard]] kvevict::SignalSet signals() const override {
    return {kvevict::Signal::catalyst_attention, kvevict::Signal::surprisal};
  }
  [[nodiscard]] kvevict::TriggerSet triggers() const override {
    return {kvevict::Trigger::pot_full};
  }
  [[nodiscard]] int score_columns() const override { return 1; }
  [[nodiscard]] std::optional<int> pot_room(const kvevict::SlotTable& slots) const override {
    return pot_ - slots.max_live();
  }
  void on_append(kvevict::SlotTable&, const kvevict::ChunkInfo& chunk) override {
    log->chunk_sizes.push_back(chunk.size());
    log->turn_starts.push_back(chunk.turn_start);
  }
  void observe_surprisal(kvevict::SlotTable&, const kvevict::ChunkInfo&,
                         std::span<const float> surprisal) override {
    log->surprisal.insert(log->surprisal.end(), surprisal.begin(), surprisal.end());
  }
  void observe_catalyst(kvevict::SlotTable& slots, int layer,
                        const kvevict::AttentionRows& rows) override {
    log->catalyst.push_back(copy_rows(slots, layer, rows));
    const kvevict::UnitLayout& layout = slots.layout();
    for (int g = 0; g < layout.kv_heads(); ++g) {
      const std::span<float> score = slots.scores(layout.unit_of(layer, g), 0);
      std::fill(score.begin(), score.end(), 0.0f);
    }
    for (int h = 0; h < rows.q_heads(); ++h) {
      const std::span<float> score = slots.scores(layout.unit_of(layer, h / rows.group_size()), 0);
      for (int q = 0; q < rows.queries(); ++q) {
        const std::span<const float> row = rows.row(h, q);
        for (std::size_t s = 0; s < row.size(); ++s) score[s] += row[s];
      }
    }
  }
  void select(const kvevict::EvictionContext& context, kvevict::Decision& decision) override {
    for (int unit = 0; unit < context.slots.units(); ++unit) {
      keep_set_.begin(context.slots, unit, context.protection);
      keep_set_.keep_top_k(context.slots.scores(unit, 0), keep_);
      keep_set_.evict_rest(decision);
    }
  }

  struct Log {
    std::vector<int> chunk_sizes;
    std::vector<bool> turn_starts;
    std::vector<float> surprisal;
    std::vector<SeenRows> catalyst;
  };
  std::shared_ptr<Log> log = std::make_shared<Log>();

 private:
  int pot_;
  int keep_;
  kvevict::KeepSet keep_set_;
};

// 1 layer, 2 query heads on 1 KV head, 7 tokens as [3, 4], catalyst of 2 tokens. Catalyst logits
// (every query head and query): ln 2 for token 1, ln 4 for token 3, ln 8 for token 5, ln 2 for
// catalyst token 1, 0 elsewhere.
json pot_replay() {
  json document = hand_replay(1, 2, 1, 7, {3, 4}, {{"name", "unused"}});
  document["surprisal"] = {0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5};
  const auto catalyst_logit = [](int column) {
    switch (column) {
      case 1:
        return std::log(2.0);
      case 3:
        return std::log(4.0);
      case 5:
        return std::log(8.0);
      case 7 + 1:
        return std::log(2.0);
      default:
        return 0.0;
    }
  };
  json query_rows = json::array();
  for (int p = 0; p < 2; ++p) {
    json row = json::array();
    for (int column = 0; column < 7 + 2; ++column) row.push_back(catalyst_logit(column));
    query_rows.push_back(std::move(row));
  }
  document["catalyst"] = {{"length", 2},
                          {"logits", json::array({json::array({query_rows, query_rows})})}};
  return document;
}

TEST(ReplayCatalyst, ChunksSplitAtThePotBoundaryAndCatalystRowsAreCausal) {
  auto policy = std::make_unique<PotPolicy>(/*pot=*/4, /*keep=*/2);
  const auto log = policy->log;
  const auto replay = kvevict::replay::parse_replay(pot_replay());
  const auto result = kvevict::replay::run_replay(replay, std::move(policy));

  // [3] fits the pot of 4. [4] is split: 1 token fills the pot (distill to 2), 2 more fill it
  // again (distill to 2), the last token stays.
  EXPECT_EQ(log->chunk_sizes, std::vector<int>({3, 1, 2, 1}));
  EXPECT_EQ(log->turn_starts, std::vector<bool>({true, true, false, false}));
  EXPECT_EQ(log->surprisal, std::vector<float>({0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f}));

  // First distillation over pot {0, 1, 2, 3}: catalyst weights 1, 2, 1, 4 -> keep {1, 3}.
  // Second over {1, 3, 4, 5}: weights 2, 4, 1, 8 -> keep {3, 5}; then 6 is appended.
  // One result per input chunk, not per sub-chunk.
  expect_same_in_every_head(result, {{0, 1, 2}, {3, 5, 6}});

  ASSERT_EQ(log->catalyst.size(), 2u);
  const SeenRows& first = log->catalyst[0];
  EXPECT_EQ(first.queries, 2);
  EXPECT_EQ(first.keys, std::vector<int>({6, 6}));  // 4 pot slots + 2 catalyst slots
  // Catalyst query 0 sees the pot and catalyst token 0: weights 1, 2, 1, 4, 1 (sum 9); catalyst
  // token 1 (weight 2) is masked. Query 1 also sees catalyst token 1: sum 11.
  const std::vector<float> query0 = first.rows[0][0];
  const std::vector<float> query1 = first.rows[1][1];
  const std::vector<double> weights0 = {1, 2, 1, 4, 1, 0};
  const std::vector<double> weights1 = {1, 2, 1, 4, 1, 2};
  for (std::size_t s = 0; s < 6; ++s) {
    EXPECT_NEAR(query0[s], weights0[s] / 9.0, 1e-7) << "slot " << s;
    EXPECT_NEAR(query1[s], weights1[s] / 11.0, 1e-7) << "slot " << s;
  }
  // The second catalyst sees the pot {1, 3, 4, 5}: query 0 weights 2, 4, 1, 8 and 1 (sum 16).
  const SeenRows& second = log->catalyst[1];
  EXPECT_NEAR(second.rows[0][0][3], 8.0 / (2 + 4 + 1 + 8 + 1), 1e-7);
}

TEST(ReplayCatalyst, PotPolicyWithoutCatalystOrSurprisalIsAnError) {
  json document = pot_replay();
  document.erase("catalyst");
  const auto without_catalyst = kvevict::replay::parse_replay(document);
  try {
    (void)kvevict::replay::run_replay(without_catalyst, std::make_unique<PotPolicy>(4, 2));
    ADD_FAILURE() << "no error without a catalyst";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("\"catalyst\""), std::string::npos) << error.what();
  }
  document = pot_replay();
  document.erase("surprisal");
  const auto without_surprisal = kvevict::replay::parse_replay(document);
  try {
    (void)kvevict::replay::run_replay(without_surprisal, std::make_unique<PotPolicy>(4, 2));
    ADD_FAILURE() << "no error without surprisal";
  } catch (const kvevict::Error& error) {
    EXPECT_NE(std::string(error.what()).find("\"surprisal\""), std::string::npos) << error.what();
  }
}

// ---------------------------------------------------------------------------------------------
// (d) The CLI
// ---------------------------------------------------------------------------------------------

#ifdef KVEVICT_CLI_PATH

class ReplayCli : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("kvevict_test_replay_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // Runs `kvevict <arguments>`; returns the exit code, stdout and stderr in out_/err_.
  int kvevict(const std::string& arguments) {
    const fs::path out = dir_ / "stdout.txt";
    const fs::path err = dir_ / "stderr.txt";
    const std::string command = "\"" + std::string(KVEVICT_CLI_PATH) + "\" " + arguments + " >\"" +
                                out.string() + "\" 2>\"" + err.string() + "\"";
    const int status = std::system(command.c_str());
    out_ = read_text(out);
    err_ = read_text(err);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  static std::string quoted(const fs::path& path) { return "\"" + path.string() + "\""; }

  fs::path dir_;
  std::string out_;
  std::string err_;
};

TEST_F(ReplayCli, CheckPassesOnAFixture) {
  EXPECT_EQ(kvevict("replay --check " + quoted(replay_data_dir() / "window_mha_decode.json")), 0)
      << err_;
  EXPECT_EQ(out_, "OK: window_mha_decode: 41 chunks agree\n");
  EXPECT_EQ(err_, "");
}

TEST_F(ReplayCli, PrintsTheResultOrWritesItToAFile) {
  const fs::path fixture = replay_data_dir() / "streaming_llm_gqa_prefill_chunks.json";
  ASSERT_EQ(kvevict("replay " + quoted(fixture)), 0) << err_;
  const json expected = json::parse(read_text(fixture)).at("expected");
  const auto printed = kvevict::replay::parse_result(json::parse(out_));
  EXPECT_TRUE(
      kvevict::replay::compare_results(kvevict::replay::parse_result(expected), printed).agree);

  // With --check the result goes only to --output; stdout has the one-line verdict.
  const std::string printed_text = out_;
  const fs::path output = dir_ / "result.json";
  ASSERT_EQ(kvevict("replay " + quoted(fixture) + " --check --output " + quoted(output)), 0)
      << err_;
  EXPECT_EQ(out_, "OK: streaming_llm_gqa_prefill_chunks: 15 chunks agree\n");
  EXPECT_EQ(read_text(output), printed_text);
}

TEST_F(ReplayCli, CorruptedFileIsAnErrorWithExitCode2) {
  const std::string text = read_text(replay_data_dir() / "window_mha_decode.json");
  const fs::path corrupted = dir_ / "corrupted.json";
  write_text(corrupted, text.substr(0, text.size() / 2));
  EXPECT_EQ(kvevict("replay --check " + quoted(corrupted)), 2);
  EXPECT_EQ(err_.rfind("kvevict: error: ", 0), 0u) << err_;
  EXPECT_NE(err_.find("invalid JSON at byte"), std::string::npos) << err_;
  EXPECT_NE(err_.find("corrupted.json"), std::string::npos) << err_;
}

TEST_F(ReplayCli, TamperedExpectedIsAMismatchWithExitCode1) {
  json document = json::parse(read_text(replay_data_dir() / "window_mha_decode.json"));
  // After chunk 3 all 11 tokens are kept; drop position 0 from layer 1, KV head 2.
  json& list = document["expected"]["after_chunk"][3]["kept"][1][2];
  ASSERT_EQ(list.front(), 0);
  list.erase(0);
  const fs::path tampered = dir_ / "tampered.json";
  write_text(tampered, document.dump());
  EXPECT_EQ(kvevict("replay --check " + quoted(tampered)), 1) << err_;
  EXPECT_NE(err_.find("FAIL: window_mha_decode"), std::string::npos) << err_;
  EXPECT_NE(err_.find("chunk 3 (positions [10, 11)), layer 1, KV head 2"), std::string::npos)
      << err_;
  EXPECT_NE(err_.find("only in expected: (none)"), std::string::npos) << err_;
  EXPECT_NE(err_.find("only in actual:   0"), std::string::npos) << err_;
  EXPECT_EQ(out_, "");
}

TEST_F(ReplayCli, UsageAndInputErrorsExitWith2) {
  EXPECT_EQ(kvevict("replay " + quoted(dir_ / "missing.json")), 2);
  EXPECT_EQ(err_.rfind("kvevict: error: ", 0), 0u) << err_;

  json document = json::parse(read_text(replay_data_dir() / "window_mha_decode.json"));
  document.erase("expected");
  const fs::path no_expected = dir_ / "no_expected.json";
  write_text(no_expected, document.dump());
  EXPECT_EQ(kvevict("replay --check " + quoted(no_expected)), 2);
  EXPECT_NE(err_.find("\"expected\""), std::string::npos) << err_;
  EXPECT_EQ(kvevict("replay " + quoted(no_expected)), 0) << err_;

  document["policy"]["name"] = "no_such_policy";
  write_text(no_expected, document.dump());
  EXPECT_EQ(kvevict("replay " + quoted(no_expected)), 2);
  EXPECT_NE(err_.find("unknown policy 'no_such_policy'"), std::string::npos) << err_;

  EXPECT_EQ(kvevict(""), 2);
  EXPECT_EQ(err_.rfind("kvevict: error: ", 0), 0u) << err_;
  EXPECT_EQ(kvevict("replay"), 2);
  EXPECT_EQ(kvevict("replay --no-such-flag x.json"), 2);
  EXPECT_EQ(kvevict("--help"), 0);
  EXPECT_NE(out_.find("replay"), std::string::npos);
}

#endif  // KVEVICT_CLI_PATH

}  // namespace
