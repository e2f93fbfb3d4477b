// The eval harness (src/lib/eval, `kvevict eval`): SHA-256 against the FIPS 180-2 vectors, the
// task documents against tools/toy_data.py's templates, scoring arithmetic, config validation,
// and a tiny grid on a tiny random model, in-process and through the CLI, with resume.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <kvevict/model/random_model.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "eval/config.hpp"
#include "eval/documents.hpp"
#include "eval/grid.hpp"
#include "eval/sha256.hpp"
#include "model/model_io.hpp"
#include "support/expect_error.hpp"

namespace {

namespace fs = std::filesystem;
using kvevict::test::expect_error;
using nlohmann::json;
using namespace kvevict::eval;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Prose in the held-out KJV's shape: verses on their own lines, chapters split by a blank line,
// sentences ending in . ? ! (one with a closing quote), and a digit that the filler must drop.
std::string sample_text() {
  static const char* const sentences[] = {
      "And the man went out into the field, and he saw the sheep.",
      " Who is he that cometh in the name of the Lord?",
      " Behold, the days come, saith the preacher.",
      " And she said, \"Whither thou goest, I will go.\"",
      " Vanity of vanities; all is vanity!",
      " The wind goeth toward the south, and turneth about unto the north.",
      " In the beginning was the Word, and the Word was with God."};
  std::string text;
  for (int verse = 0; verse < 120; ++verse) {
    text += sentences[verse % 7];
    if (verse % 11 == 3) text += " There were 12 baskets.";
    text += (verse % 9 == 8) ? "\n\n" : "\n";
  }
  return text;
}

std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  return fields;
}

// --- SHA-256 ------------------------------------------------------------------------------------

TEST(Sha256, FipsTestVectors) {
  // FIPS 180-2, appendix B.1 and B.2; the empty message from NIST's examples.
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, MillionAsInUnevenPieces) {
  // FIPS 180-2 B.3: one million 'a', fed in pieces that straddle the 64-byte blocks.
  Sha256 hash;
  const std::string piece(37, 'a');
  std::size_t fed = 0;
  while (fed + piece.size() <= 1000000) {
    hash.update(piece);
    fed += piece.size();
  }
  hash.update(std::string(1000000 - fed, 'a'));
  EXPECT_EQ(hash.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// --- Documents ----------------------------------------------------------------------------------

TEST(Documents, RngIsDeterministicAndBounded) {
  Rng a(42), b(42), c(43);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const std::uint64_t x = a.next();
    EXPECT_EQ(x, b.next());
    differs |= x != c.next();
  }
  EXPECT_TRUE(differs);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(a.below(7), 7u);
}

TEST(Documents, FillerHasExactSizeNoDigitsNoBlankLine) {
  const FillerText filler(sample_text());
  Rng rng(7);
  for (const std::int64_t bytes : {0, 1, 5, 17, 100, 999, 5000}) {
    const std::string text = filler.take(bytes, rng);
    EXPECT_EQ(static_cast<std::int64_t>(text.size()), bytes);
    EXPECT_EQ(text.find_first_of("0123456789"), std::string::npos) << text;
    EXPECT_EQ(text.find("\n\n"), std::string::npos) << text;
  }
  // Units are sentences: each ends in a terminator (plus closing quotes).
  for (std::size_t u = 0; u < filler.units(); ++u) {
    const std::string& unit = filler.unit(u);
    if (unit.find_first_not_of(" \n") == std::string::npos) continue;  // the text's final newline
    const std::string trimmed = unit.substr(0, unit.find_last_not_of("\"')]") + 1);
    EXPECT_NE(std::string(".?!").find(trimmed.back()), std::string::npos) << unit;
  }
}

TEST(Documents, PasskeyDocumentFollowsToyDataTemplate) {
  const FillerText filler(sample_text());
  for (const double depth : {0.0, 0.1, 0.5, 0.9, 1.0}) {
    for (const std::int64_t length :
         {passkey_template_tokens(), std::int64_t{300}, std::int64_t{1024}}) {
      Rng rng(mix_seed({1, 2, 3}));
      const PasskeyDocument doc = make_passkey_document(filler, length, depth, rng);
      // Exactly `length` tokens with BOS (byte-level: one token per byte).
      EXPECT_EQ(1 + static_cast<std::int64_t>(doc.text.size()), length);
      ASSERT_EQ(doc.key.size(), 5u);
      EXPECT_GE(std::stoi(doc.key), 10000);
      EXPECT_LE(std::stoi(doc.key), 99999);
      EXPECT_EQ(
          doc.text.rfind("There is a pass key hidden in this text. Find it and remember it.", 0),
          0u);
      const std::string statement =
          " The pass key is " + doc.key + ". Remember it. " + doc.key + " is the pass key.";
      const std::string question = " What is the pass key? The pass key is ";
      ASSERT_GE(doc.text.size(), question.size());
      EXPECT_EQ(doc.text.substr(doc.text.size() - question.size()), question);
      // The statement starts after round(depth * filler) filler bytes (token index: BOS + intro).
      const std::int64_t filler_bytes = length - passkey_template_tokens();
      EXPECT_EQ(doc.filler_bytes, filler_bytes);
      EXPECT_EQ(doc.key_position, 1 + 65 + std::llround(depth * static_cast<double>(filler_bytes)));
      EXPECT_EQ(doc.text.substr(static_cast<std::size_t>(doc.key_position - 1), statement.size()),
                statement);
      // The key is the only number in the document.
      std::string without_key = doc.text;
      for (std::size_t at; (at = without_key.find(doc.key)) != std::string::npos;) {
        without_key.erase(at, doc.key.size());
      }
      EXPECT_EQ(without_key.find_first_of("0123456789"), std::string::npos);
    }
  }
  Rng rng(1);
  expect_error(
      [&] { (void)make_passkey_document(filler, passkey_template_tokens() - 1, 0.5, rng); },
      "cannot hold the template");
}

TEST(Documents, GroceryDocumentFollowsToyDataTemplate) {
  const FillerText filler(sample_text());
  for (const int turns : {1, 3, 9}) {
    Rng rng(mix_seed({5, static_cast<std::uint64_t>(turns)}));
    const GroceryDocument doc = make_grocery_document(filler, 600, 4, turns, rng);
    EXPECT_EQ(doc.tokens(), 600);
    ASSERT_EQ(doc.items.size(), 4u);
    EXPECT_EQ(std::set<std::string>(doc.items.begin(), doc.items.end()).size(), 4u);
    for (const std::string& item : doc.items) {
      EXPECT_NE(std::find(kGroceries.begin(), kGroceries.end(), item), kGroceries.end()) << item;
    }
    const std::string list =
        doc.items[0] + ", " + doc.items[1] + ", " + doc.items[2] + ", " + doc.items[3];
    EXPECT_EQ(doc.expected_answer, list + ".");
    ASSERT_EQ(doc.turns.size(), static_cast<std::size_t>(turns) + 3);
    EXPECT_EQ(doc.turns.front(), "User: Remember my shopping list: " + list + ".\n\n");
    for (int t = 0; t < turns; ++t) {
      const std::string& turn = doc.turns[static_cast<std::size_t>(t) + 1];
      EXPECT_EQ(turn.rfind(t % 2 == 0 ? "Assistant: " : "User: ", 0), 0u) << turn;
      ASSERT_GE(turn.size(), 2u);
      EXPECT_EQ(turn.substr(turn.size() - 2), "\n\n");
      EXPECT_EQ(turn.find("\n\n"), turn.size() - 2) << "a blank line inside a turn: " << turn;
    }
    EXPECT_EQ(doc.turns[doc.turns.size() - 2], "User: What was on my shopping list?\n\n");
    EXPECT_EQ(doc.turns.back(), "Assistant: ");
  }
  EXPECT_EQ(kGroceries.size(), 53u);
  EXPECT_EQ(kGroceries.front(), "apples");
  EXPECT_EQ(kGroceries.back(), "beans");
  Rng rng(1);
  expect_error([&] { (void)make_grocery_document(filler, 600, 3, 2, rng); }, "odd");
  expect_error([&] { (void)make_grocery_document(filler, 50, 3, 3, rng); }, "cannot hold");
}

TEST(Documents, SameSeedSameDocument) {
  const FillerText filler(sample_text());
  Rng a(mix_seed({1, hash_name("passkey"), 0, double_bits(0.5), 512}));
  Rng b(mix_seed({1, hash_name("passkey"), 0, double_bits(0.5), 512}));
  Rng c(mix_seed({1, hash_name("passkey"), 1, double_bits(0.5), 512}));
  const PasskeyDocument first = make_passkey_document(filler, 512, 0.5, a);
  EXPECT_EQ(first.text, make_passkey_document(filler, 512, 0.5, b).text);
  EXPECT_NE(first.text, make_passkey_document(filler, 512, 0.5, c).text);
}

TEST(Scoring, PerDigitAccuracy) {
  EXPECT_DOUBLE_EQ(per_digit_accuracy("48213", "48213"), 1.0);
  EXPECT_DOUBLE_EQ(per_digit_accuracy("48203", "48213"), 4.0 / 5.0);  // one digit wrong
  EXPECT_DOUBLE_EQ(per_digit_accuracy("84213", "48213"), 3.0 / 5.0);  // two swapped
  EXPECT_DOUBLE_EQ(per_digit_accuracy("4821", "48213"), 4.0 / 5.0);   // short answer
  EXPECT_DOUBLE_EQ(per_digit_accuracy("", "48213"), 0.0);
  EXPECT_DOUBLE_EQ(per_digit_accuracy("x8213", "48213"), 4.0 / 5.0);
}

TEST(Scoring, ItemRecallCountsWholeWords) {
  const std::vector<std::string> items = {"oil", "salt", "soap"};
  EXPECT_DOUBLE_EQ(item_recall("oil, salt, soap.", items), 1.0);
  EXPECT_DOUBLE_EQ(item_recall("salt, oil.", items), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(item_recall("soil, salty soaps.", items), 0.0);
  EXPECT_DOUBLE_EQ(item_recall("pears.", {"peas"}), 0.0);
  EXPECT_DOUBLE_EQ(item_recall("", items), 0.0);
}

// --- The grid -----------------------------------------------------------------------------------

class Grid : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / fmt::format("kvevict_test_eval_{}", getpid()));
    fs::create_directories(*dir_);
    write_tiny_model(*dir_ / "tiny.gguf", /*seed=*/1);
    write_text(*dir_ / "text.txt", sample_text());
    write_text(*dir_ / "empty.txt", "");
  }
  static void write_tiny_model(const fs::path& path, std::uint64_t seed) {
    kvevict::model::ModelConfig config;
    config.dim = 32;
    config.hidden_dim = 64;
    config.layers = 1;
    config.heads = 2;
    config.kv_heads = 1;
    config.vocab_size = 259;  // bytes, BOS, EOS, <AC>
    config.context_length = 256;
    kvevict::model::write_gguf(kvevict::model::make_random_model(config, seed), path);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  static json tiny_config() {
    return json::parse(fmt::format(R"({{
      "name": "tiny", "model": "{}", "text": "{}", "seed": 3, "chunk": 8,
      "policies": [{{"policy": "full"}}, {{"policy": "streaming_llm", "sinks": 4}},
                   {{"policy": "sirllm", "params": ["decay=0.9"], "label": "sirllm, d=0.9"}},
                   {{"policy": "infinipot"}}],
      "budgets": [32],
      "tasks": [{{"task": "stream_bpb", "tokens": 200, "window": 64}},
                {{"task": "passkey", "lengths": [180], "depths": [0.5], "documents": 2}},
                {{"task": "grocery", "items": 2, "turns": [1], "length": 150, "documents": 2}},
                {{"task": "cost", "tokens": 150, "checkpoints": [50, 100]}}]}})",
                                   (*dir_ / "tiny.gguf").string(), (*dir_ / "text.txt").string()));
  }
  static EvalConfig parse(const json& config) { return parse_eval_config(config, "test.json"); }
  static fs::path out(const std::string& name) { return *dir_ / name; }

  static GridSummary run(const GridContext& grid, const fs::path& out, bool fresh = false,
                         std::function<void(const CellSpec&)> hook = {}) {
    GridOptions options;
    options.out = out;
    options.jobs = 2;
    options.fresh = fresh;
    options.before_cell = std::move(hook);
    return run_grid(grid, options);
  }

  static inline fs::path* dir_ = nullptr;
};

// Checks the three outputs parse and agree on the number of cells.
void expect_parsable_results(const fs::path& out, std::size_t cells) {
  const json results = json::parse(read_text(out / "results.json"));
  EXPECT_EQ(results.at("cells").size(), cells);
  EXPECT_EQ(results.at("model").at("sha256").get<std::string>().size(), 64u);
  EXPECT_FALSE(results.at("git_revision").get<std::string>().empty());
  EXPECT_GE(results.at("machine").at("nproc").get<int>(), 1);
  std::istringstream csv(read_text(out / "results.csv"));
  std::string line;
  ASSERT_TRUE(std::getline(csv, line));
  const std::vector<std::string> header = split_csv_line(line);
  EXPECT_EQ(header.front(), "id");
  std::size_t rows = 0;
  while (std::getline(csv, line)) {
    EXPECT_EQ(split_csv_line(line).size(), header.size()) << line;
    ++rows;
  }
  EXPECT_EQ(rows, cells);
  const std::string markdown = read_text(out / "results.md");
  EXPECT_NE(markdown.find("| policy"), std::string::npos);
  EXPECT_NE(markdown.find("|---|"), std::string::npos);
}

TEST_F(Grid, RunsWritesParsableResultsAndResumes) {
  const GridContext grid = prepare_grid(parse(tiny_config()));
  // 4 tasks x (full + 3 policies at one budget), one variant each.
  ASSERT_EQ(grid.cells.size(), 16u);
  const GridSummary first = run(grid, out("grid"));
  EXPECT_TRUE(first.failures.empty()) << first.failures.front();
  EXPECT_EQ(first.run, 16u);
  expect_parsable_results(out("grid"), 16);
  const std::string aggregate = read_text(out("grid") / "results.json");

  const GridSummary second = run(grid, out("grid"));
  EXPECT_EQ(second.run, 0u);
  EXPECT_EQ(second.resumed, 16u);
  EXPECT_EQ(read_text(out("grid") / "results.json"), aggregate);

  const json results = json::parse(aggregate);
  for (const json& cell : results.at("cells")) {
    const json& metrics = cell.at("metrics");
    const std::string task = cell.at("task");
    if (task == "stream_bpb") {
      EXPECT_EQ(metrics.at("tokens_fed"), 200);
      EXPECT_EQ(metrics.at("tokens_scored"), 199);             // every token but BOS
      EXPECT_EQ(cell.at("details").at("windows").size(), 4u);  // 200 positions / 64
    } else if (task == "passkey") {
      // Each document: 180 prompt tokens, then 4 of the 5 answer digits fed back.
      EXPECT_EQ(metrics.at("tokens_fed"), 2 * (180 + 4));
      for (const json& document : cell.at("details").at("documents")) {
        EXPECT_NEAR(document.at("per_digit").get<double>() * 5,
                    std::round(document.at("per_digit").get<double>() * 5), 1e-9);
      }
    } else if (task == "cost") {
      const json& checkpoints = cell.at("details").at("checkpoints");
      ASSERT_EQ(checkpoints.size(), 3u);  // 50, 100 and the end, 150
      EXPECT_EQ(checkpoints[2].at("tokens"), 150);
      EXPECT_GT(checkpoints[2].at("peak_rss_bytes").get<double>(), 0);
    }
    if (cell.at("task") != "cost" && cell.at("policy") == "streaming_llm") {
      // Derived column: 1 - live KV / full's live KV on the same task variant.
      const json* full = nullptr;
      for (const json& other : results.at("cells")) {
        if (other.at("policy") == "full" && other.at("task_index") == cell.at("task_index"))
          full = &other;
      }
      ASSERT_NE(full, nullptr);
      EXPECT_NEAR(metrics.at("kv_reduction_vs_full").get<double>(),
                  1.0 - metrics.at("live_kv_bytes").get<double>() /
                            full->at("metrics").at("live_kv_bytes").get<double>(),
                  1e-12);
    }
  }
}

TEST_F(Grid, DocumentsDoNotDependOnThePolicy) {
  const GridContext grid = prepare_grid(parse(tiny_config()));
  std::vector<json> keys;
  for (const CellSpec& cell : grid.cells) {
    if (grid.config.tasks[cell.task_index].kind != TaskKind::passkey) continue;
    json documents = run_cell(grid, cell).at("details").at("documents");
    for (json& document : documents) {
      document.erase("answer");
      document.erase("per_digit");
    }
    keys.push_back(documents);
  }
  ASSERT_EQ(keys.size(), 4u);
  for (const json& other : keys) EXPECT_EQ(other, keys.front());
}

TEST_F(Grid, CrashingCellIsReportedAndRerunOnResume) {
  const GridContext grid = prepare_grid(parse(tiny_config()));
  const std::string victim = grid.cells[1].id;
  const std::string thrower = grid.cells[2].id;
  const GridSummary first = run(grid, out("crash"), false, [&](const CellSpec& cell) {
    if (cell.id == victim) std::abort();
    if (cell.id == thrower) throw kvevict::Error("boom in the cell");
  });
  ASSERT_EQ(first.failures.size(), 2u);
  EXPECT_EQ(first.run, 14u);
  std::string failures = first.failures[0] + "\n" + first.failures[1];
  EXPECT_NE(failures.find(victim + ": crashed: signal " + std::to_string(SIGABRT)),
            std::string::npos)
      << failures;
  EXPECT_NE(failures.find(thrower + ": boom in the cell"), std::string::npos) << failures;
  const json results = json::parse(read_text(out("crash") / "results.json"));
  EXPECT_EQ(results.at("missing").size(), 2u);
  EXPECT_EQ(results.at("cells").size(), 14u);

  const GridSummary second = run(grid, out("crash"));
  EXPECT_TRUE(second.failures.empty());
  EXPECT_EQ(second.run, 2u);
  EXPECT_EQ(second.resumed, 14u);
}

TEST_F(Grid, ChangedConfigOrAnotherGridIsAnError) {
  json config = tiny_config();
  config["tasks"] = json::parse(R"([{"task": "stream_bpb", "tokens": 40, "window": 16}])");
  const GridContext grid = prepare_grid(parse(config));
  EXPECT_EQ(run(grid, out("changed")).run, 4u);

  config["seed"] = 4;
  const GridContext reseeded = prepare_grid(parse(config));
  expect_error([&] { (void)run(reseeded, out("changed")); }, "different configuration");
  EXPECT_EQ(run(reseeded, out("changed"), /*fresh=*/true).run, 4u);

  config["name"] = "other";
  const GridContext other = prepare_grid(parse(config));
  expect_error([&] { (void)run(other, out("changed")); }, "another grid");

  // A new budget adds cells and leaves the old ones valid.
  config["name"] = "tiny";
  config["budgets"] = json::array({32, 48});
  const GridContext wider = prepare_grid(parse(config));
  const GridSummary widened = run(wider, out("changed"));
  EXPECT_EQ(widened.resumed, 4u);
  EXPECT_EQ(widened.run, 3u);

  GridOptions options;
  options.out = out("changed");
  options.jobs = 0;
  expect_error([&] { (void)run_grid(grid, options); }, "--jobs must be at least 1");
}

TEST_F(Grid, AnchorsAreInsertedInEverythingFed) {
  json config = tiny_config();
  config["anchors"] = true;
  config["policies"] = json::parse(R"([{"policy": "full"}, {"policy": "anllm"}])");
  config["tasks"] = json::parse(R"([{"task": "passkey", "lengths": [180], "depths": [0.5],
                                     "documents": 1}])");
  const GridContext grid = prepare_grid(parse(config));
  ASSERT_EQ(grid.cells.size(), 2u);
  const json full = run_cell(grid, grid.cells[0]);
  const json anllm = run_cell(grid, grid.cells[1]);
  // The template alone has 6 sentence ends before the answer (intro 2, statement 3, question 1).
  EXPECT_GE(full.at("metrics").at("tokens_fed").get<int>(), 180 + 4 + 6);
  EXPECT_EQ(full.at("metrics").at("tokens_fed"), anllm.at("metrics").at("tokens_fed"));
  EXPECT_LT(anllm.at("metrics").at("live_kv_bytes").get<double>(),
            full.at("metrics").at("live_kv_bytes").get<double>());
}

TEST_F(Grid, GranularityAndEngineAreRecorded) {
  // Without the key the normalised entry is as before it existed (configs keep their hashes).
  EXPECT_FALSE(to_json(parse(tiny_config()).policies[1]).contains("granularity"));
  json config = tiny_config();
  config["policies"] = json::parse(R"([
      {"policy": "streaming_llm", "sinks": 4, "granularity": "head"},
      {"policy": "streaming_llm", "sinks": 4, "granularity": "token"}])");
  config["tasks"] = json::parse(R"([{"task": "stream_bpb", "tokens": 120, "window": 64}])");
  const EvalConfig parsed = parse(config);
  EXPECT_EQ(to_json(parsed.policies[1]).at("granularity"), "token");
  EXPECT_EQ(parsed.policies[1].label, "streaming_llm sinks=4 granularity=token");
  const GridContext grid = prepare_grid(parsed);
  ASSERT_EQ(grid.cells.size(), 2u);
  const json per_head = run_cell(grid, grid.cells[0]);
  const json per_token = run_cell(grid, grid.cells[1]);
  EXPECT_EQ(per_head.at("policy_setup").at("granularity"), "head");
  EXPECT_EQ(per_token.at("policy_setup").at("granularity"), "token");
  // StreamingLLM keeps the sinks and the newest tokens in every head: one keep-set per head or
  // one for the model is the same cache.
  EXPECT_GT(per_token.at("metrics").at("evicted_slots").get<int>(), 0);
  EXPECT_EQ(per_head.at("metrics").at("bits_per_byte"),
            per_token.at("metrics").at("bits_per_byte"));
  // kvevict's decoder is the engine; its cells' config does not name it (hashes as before).
  EXPECT_EQ(per_head.at("engine"), "kvevict");
  EXPECT_FALSE(per_head.at("config").contains("engine"));

  const auto bad = [&](const std::string& granularity) {
    json entry = config;
    entry["policies"][1]["granularity"] = granularity;
    return entry;
  };
  expect_error([&] { (void)parse(bad("rows")); }, "policies[1]");
  expect_error([&] { (void)parse(bad("block:0")); }, "policies[1]");
}

TEST_F(Grid, TurnSeparatorStartsTurnsInStreams) {
  json config = tiny_config();
  config["policies"] = json::parse(R"([{"policy": "full"}, {"policy": "sirllm"}])");
  config["tasks"] = json::parse(R"([{"task": "stream_bpb", "tokens": 300, "window": 100,
                                     "turn_separator": "\n"}])");
  const GridContext grid = prepare_grid(parse(config));
  const json full = run_cell(grid, grid.cells[0]);
  const json sirllm = run_cell(grid, grid.cells[1]);
  // One turn per "\n" among the 299 text tokens after BOS.
  const std::string text = sample_text().substr(0, 299);
  EXPECT_EQ(sirllm.at("metrics").at("turns"), std::count(text.begin(), text.end(), '\n'));
  // SirLLM evicts before turns: at budget 32 its cache stays below the full cache's.
  EXPECT_LT(sirllm.at("metrics").at("peak_kv_bytes").get<double>(),
            full.at("metrics").at("peak_kv_bytes").get<double>());
}

TEST_F(Grid, TurnSeparatorStartsTurnsInPasskeyPrompts) {
  json config = tiny_config();
  config["policies"] = json::parse(R"([{"policy": "full"}, {"policy": "sirllm"}])");
  config["tasks"] = json::parse(R"([{"task": "passkey", "lengths": [400], "depths": [0.5],
                                     "documents": 1},
                                    {"task": "passkey", "lengths": [400], "depths": [0.5],
                                     "documents": 1, "turn_separator": "\n"}])");
  const GridContext grid = prepare_grid(parse(config));
  ASSERT_EQ(grid.cells.size(), 4u);  // task by task, then policy by policy
  const json full = run_cell(grid, grid.cells[0]);
  const json one_turn = run_cell(grid, grid.cells[1]);
  const json turns = run_cell(grid, grid.cells[3]);
  // Without a separator the prompt is one turn: SirLLM (which evicts only before a turn) keeps
  // every slot, like the full cache.
  EXPECT_EQ(one_turn.at("metrics").at("evicted_slots"), 0);
  EXPECT_EQ(one_turn.at("metrics").at("live_kv_bytes"), full.at("metrics").at("live_kv_bytes"));
  // With "\n" every line of filler starts a turn, so it evicts inside the prompt.
  EXPECT_GT(turns.at("metrics").at("evicted_slots").get<double>(), 0);
  EXPECT_LT(turns.at("metrics").at("live_kv_bytes").get<double>(),
            full.at("metrics").at("live_kv_bytes").get<double>());
}

// --- Shards and merge ---------------------------------------------------------------------------

TEST(OutputDirectory, OutOrCommittedOrTheBuildTree) {
  EXPECT_EQ(output_directory("somewhere", false, "grid"), fs::path("somewhere"));
  EXPECT_EQ(output_directory("", true, "grid"), fs::path("eval/results/grid"));
  const fs::path by_default = output_directory("", false, "grid");
  EXPECT_EQ(by_default, default_output_root() / "grid");
  EXPECT_EQ(default_output_root().filename(), "eval-results");
  EXPECT_NE(by_default, fs::path("eval/results/grid"));
  expect_error([] { (void)output_directory("somewhere", true, "grid"); }, "give one");
}

TEST_F(Grid, ShardSpecParsesAndRefuses) {
  const ShardSpec shard = parse_shard("2/8");
  EXPECT_EQ(shard.index, 2);
  EXPECT_EQ(shard.count, 8);
  EXPECT_EQ(shard.text(), "2/8");
  EXPECT_EQ(parse_shard("1/1").count, 1);
  for (const char* bad : {"0/3", "4/3", "1/0", "3", "", "/3", "1/", "a/b", "-1/3", "1/3x", " 1/3",
                          "1//3", "99999999999/99999999999"}) {
    expect_error([&] { (void)parse_shard(bad); }, "--shard: expected I/N");
  }
}

TEST_F(Grid, ShardsPartitionTheGrid) {
  const std::vector<CellSpec> cells = enumerate_cells(parse(tiny_config()));
  ASSERT_EQ(cells.size(), 16u);
  for (const int count : {1, 2, 3, 5, 16, 20}) {
    std::map<std::string, int> owners;
    std::size_t smallest = cells.size();
    std::size_t largest = 0;
    for (int index = 1; index <= count; ++index) {
      const std::vector<CellSpec> slice = shard_cells(cells, ShardSpec{index, count});
      smallest = std::min(smallest, slice.size());
      largest = std::max(largest, slice.size());
      for (std::size_t k = 0; k < slice.size(); ++k) {
        ++owners[slice[k].id];
        // Round robin: the slice's k-th cell is the grid's cell (index - 1) + k * count.
        EXPECT_EQ(slice[k].id, cells[static_cast<std::size_t>(index - 1 + k * count)].id);
      }
    }
    EXPECT_EQ(owners.size(), cells.size()) << count << " shards";
    for (const auto& [id, times] : owners) EXPECT_EQ(times, 1) << id << " in " << count;
    EXPECT_LE(largest - smallest, 1u) << count << " shards";
  }
}

// Drops what depends on the machine and the moment (times, speeds, RSS) from a cell or results.
json deterministic(json value) {
  if (value.is_object()) {
    json kept = json::object();
    for (auto& [key, item] : value.items()) {
      if (key.find("seconds") != std::string::npos || key.find("per_second") != std::string::npos ||
          key.find("rss") != std::string::npos) {
        continue;
      }
      kept[key] = deterministic(item);
    }
    return kept;
  }
  if (value.is_array()) {
    for (json& item : value) item = deterministic(item);
  }
  return value;
}

// The CSV's rows without the timing columns (named as deterministic() names them).
std::vector<std::vector<std::string>> deterministic_csv(const std::string& text) {
  std::istringstream csv(text);
  std::string line;
  std::vector<std::vector<std::string>> rows;
  std::vector<bool> keep;
  while (std::getline(csv, line)) {
    const std::vector<std::string> fields = split_csv_line(line);
    if (keep.empty()) {
      for (const std::string& column : fields) {
        keep.push_back(deterministic(json{{column, 0}}).contains(column));
      }
    }
    std::vector<std::string> row;
    for (std::size_t i = 0; i < fields.size() && i < keep.size(); ++i) {
      if (keep[i]) row.push_back(fields[i]);
    }
    rows.push_back(row);
  }
  return rows;
}

TEST_F(Grid, ThreeShardsMergedEqualOneRun) {
  const GridContext grid = prepare_grid(parse(tiny_config()));
  ASSERT_TRUE(run(grid, out("whole")).failures.empty());
  std::vector<fs::path> shard_dirs;
  for (int index = 1; index <= 3; ++index) {
    GridOptions options;
    options.out = out(fmt::format("shard{}", index));
    options.jobs = 2;
    options.shard = ShardSpec{index, 3};
    const GridSummary summary = run_grid(grid, options);
    EXPECT_TRUE(summary.failures.empty());
    EXPECT_EQ(summary.cells, index == 1 ? 6u : 5u);  // 16 cells: 6 + 5 + 5
    const json results = json::parse(read_text(options.out / "results.json"));
    EXPECT_EQ(results.at("shard").at("index"), index);
    EXPECT_EQ(results.at("shard").at("count"), 3);
    EXPECT_EQ(results.at("cells").size(), summary.cells);
    EXPECT_TRUE(results.at("missing").empty());
    shard_dirs.push_back(options.out);
  }
  MergeOptions merge;
  merge.shards = {shard_dirs[2], shard_dirs[0], shard_dirs[1]};  // any order
  merge.out = out("merged");
  const MergeSummary summary = merge_shards(merge);
  EXPECT_EQ(summary.cells, 16u);
  EXPECT_TRUE(summary.notes.empty());

  const json whole = json::parse(read_text(out("whole") / "results.json"));
  const json merged = json::parse(read_text(out("merged") / "results.json"));
  for (const char* key : {"name", "config", "config_sha256", "model", "text", "missing"}) {
    EXPECT_EQ(merged.at(key), whole.at(key)) << key;
  }
  EXPECT_FALSE(merged.contains("shard"));
  ASSERT_EQ(merged.at("shards").size(), 3u);
  EXPECT_EQ(merged.at("shards")[0].at("shard"), "3/3");
  EXPECT_EQ(merged.at("shards")[0].at("cells"), 5);
  ASSERT_EQ(merged.at("cells").size(), 16u);
  EXPECT_EQ(deterministic(merged.at("cells")), deterministic(whole.at("cells")));
  EXPECT_EQ(deterministic_csv(read_text(out("merged") / "results.csv")),
            deterministic_csv(read_text(out("whole") / "results.csv")));
  // results.md: every table but the cost task's (tokens/s, RSS) is deterministic.
  const auto before_cost = [](const std::string& markdown) {
    return markdown.substr(0, markdown.find("### Task 3: cost"));
  };
  EXPECT_EQ(before_cost(read_text(out("merged") / "results.md")),
            before_cost(read_text(out("whole") / "results.md")));
  // The merged directory is a run's: resuming it runs nothing.
  const GridSummary resumed = run(grid, out("merged"));
  EXPECT_EQ(resumed.run, 0u);
  EXPECT_EQ(resumed.resumed, 16u);
}

TEST_F(Grid, MergeRefusesShardsOfAnotherGridOrIncompleteShards) {
  json config = tiny_config();
  config["tasks"] = json::parse(R"([{"task": "stream_bpb", "tokens": 40, "window": 16}])");
  const auto run_shard = [&](const json& grid_config, int index, const std::string& name) {
    const GridContext grid = prepare_grid(parse(grid_config));
    GridOptions options;
    options.out = out(name);
    options.jobs = 2;
    options.shard = ShardSpec{index, 2};
    EXPECT_TRUE(run_grid(grid, options).failures.empty());
    return options.out;
  };
  const fs::path first = run_shard(config, 1, "refuse1");
  const fs::path second = run_shard(config, 2, "refuse2");
  const auto merge = [&](std::vector<fs::path> shards, const std::string& name,
                         bool fresh = false) {
    MergeOptions options;
    options.shards = std::move(shards);
    options.out = out(name);
    options.fresh = fresh;
    return merge_shards(options);
  };
  expect_error([&] { (void)merge({first}, "refused"); },
               "2 of the 4 cells of grid 'tiny' have no result");
  expect_error([&] { (void)merge({first}, "refused"); }, "no directory holds shard 2/2");
  expect_error([&] { (void)merge({first, second, first}, "refused"); }, "is given twice");
  fs::copy(second, out("copy2"), fs::copy_options::recursive);
  expect_error(
      [&] {
        (void)merge({first, second, out("copy2")}, "refused");
      },
      "is in both '" + second.string() + "' (shard 2/2) and '" + out("copy2").string());

  json reseeded = config;
  reseeded["seed"] = 4;
  expect_error(
      [&] {
        (void)merge({first, run_shard(reseeded, 2, "seed4")}, "refused");
      },
      "the configs differ at \"seed\" (3 vs 4");
  json other_model = config;
  write_tiny_model(out("other.gguf"), /*seed=*/2);
  other_model["model"] = out("other.gguf").string();
  expect_error(
      [&] {
        (void)merge({first, run_shard(other_model, 2, "other_model")}, "refused");
      },
      "model sha256");
  json renamed = config;
  renamed["name"] = "tiny2";
  expect_error(
      [&] {
        (void)merge({first, run_shard(renamed, 2, "renamed")}, "refused");
      },
      "grid name 'tiny' vs 'tiny2'");
  expect_error([&] { (void)merge({first, out("absent")}, "refused"); }, "holds no results.json");
  // A shard another engine computed (kvevict-llama eval records "llama.cpp ..."): not one grid.
  fs::copy(second, out("llama2"), fs::copy_options::recursive);
  json llama_results = json::parse(read_text(out("llama2") / "results.json"));
  llama_results["engine"] = "llama.cpp ggml test";
  write_text(out("llama2") / "results.json", llama_results.dump());
  expect_error(
      [&] {
        (void)merge({first, out("llama2")}, "refused");
      },
      "engine 'kvevict' vs 'llama.cpp ggml test'");
  EXPECT_FALSE(fs::exists(out("refused")));  // nothing written by a refused merge

  // A shard written before the rename of "compactions" (the decision count) merges as
  // "decisions".
  std::string old_cell;
  for (const fs::directory_entry& entry : fs::directory_iterator(second / "cells")) {
    if (entry.path().filename().string().find("streaming_llm") != std::string::npos) {
      old_cell = entry.path().filename().string();
    }
  }
  ASSERT_FALSE(old_cell.empty());
  json cell = json::parse(read_text(second / "cells" / old_cell));
  const json decisions = cell.at("metrics").at("decisions");
  EXPECT_GT(decisions.get<int>(), 0);  // 40 tokens through 32 slots: it had to evict
  cell["metrics"].erase("decisions");
  cell["metrics"]["compactions"] = decisions;
  write_text(second / "cells" / old_cell, cell.dump());
  EXPECT_EQ(merge({first, second}, "merged2").cells, 4u);
  const json merged = json::parse(read_text(out("merged2") / "results.json"));
  for (const json& merged_cell : merged.at("cells")) {
    EXPECT_FALSE(merged_cell.at("metrics").contains("compactions"));
    if (merged_cell.at("id").get<std::string>() + ".json" == old_cell) {
      EXPECT_EQ(merged_cell.at("metrics").at("decisions"), decisions);
    }
  }
  EXPECT_EQ(read_text(out("merged2") / "results.csv").find("compactions"), std::string::npos);

  expect_error([&] { (void)merge({first, second}, "merged2"); }, "already holds cells");
  EXPECT_EQ(merge({first, second}, "merged2", /*fresh=*/true).cells, 4u);
  expect_error(
      [&] {
        (void)merge({first, second}, "refuse1", /*fresh=*/true);
      },
      "is one of the shard directories");
}

// --- Bad input ----------------------------------------------------------------------------------

TEST_F(Grid, ByteBudgetsAreAnAxisOfEqualMemory) {
  // The tiny model: 1 layer, 1 KV head of dimension 32 / 2 = 16, f32: a token's key and value are
  // 2 x 16 x 4 = 128 bytes, so 4096 bytes hold 32 tokens, and a cell peaks at 32 + one chunk of 8
  // tokens = 5120 bytes.
  const auto config_with = [](const json& budgets) {
    json config = tiny_config();
    config["name"] = "tiny-bytes";
    config.erase("budgets");
    config["policies"] = json::array({json{{"policy", "window"}}, json{{"policy", "h2o"}}});
    config["tasks"] = json::array({json{{"task", "stream_bpb"}, {"tokens", 200}, {"window", 64}}});
    for (const auto& [key, value] : budgets.items()) config[key] = value;
    return config;
  };
  const EvalConfig bytes = parse(config_with(json{{"budget_bytes", {4096}}}));
  ASSERT_EQ(bytes.policies.size(), 2u);
  EXPECT_TRUE(bytes.policies[0].budgets_in_bytes);
  EXPECT_EQ(bytes.policies[0].options(4096, 8).budget_bytes, 4096);
  EXPECT_FALSE(bytes.policies[0].options(4096, 8).budget.has_value());
  EXPECT_EQ(to_json(bytes.policies[0]).at("budget_unit"), "bytes");
  const EvalConfig tokens = parse(config_with(json{{"budgets", {32}}}));
  // Token grids keep their normalised form, so their cells keep their hashes.
  EXPECT_FALSE(to_json(tokens.policies[0]).contains("budget_unit"));

  const GridContext grid = prepare_grid(bytes);
  ASSERT_EQ(grid.cells.size(), 2u);
  EXPECT_EQ(grid.cells[0].id, "t0-stream_bpb-window-bytes4096");
  const GridSummary summary = run(grid, out("bytes"), /*fresh=*/true);
  ASSERT_TRUE(summary.failures.empty()) << summary.failures.front();
  const GridSummary same_in_tokens = run(prepare_grid(tokens), out("bytes-as-tokens"), true);
  ASSERT_TRUE(same_in_tokens.failures.empty());
  const json results = json::parse(read_text(out("bytes") / "results.json"));
  const json in_tokens = json::parse(read_text(out("bytes-as-tokens") / "results.json"));
  for (std::size_t i = 0; i < 2; ++i) {
    const json& cell = results.at("cells").at(i);
    EXPECT_EQ(cell.at("budget"), 4096);
    EXPECT_EQ(cell.at("budget_unit"), "bytes");
    EXPECT_EQ(cell.at("metrics").at("budget_bytes"), 4096);
    EXPECT_EQ(cell.at("policy_setup").at("budget_bytes"), 4096);
    EXPECT_EQ(cell.at("metrics").at("peak_kv_bytes"), 5120) << cell.at("id");
    // 4096 bytes are budget 32 here: the same cache, the same bits per byte.
    EXPECT_EQ(cell.at("metrics").at("bits_per_byte"),
              in_tokens.at("cells").at(i).at("metrics").at("bits_per_byte"));
  }
  EXPECT_EQ(results.at("cells").at(0).at("policy_setup").at("params").at("recent"), 32);
  EXPECT_NE(read_text(out("bytes") / "results.md").find("| 4 KiB |"), std::string::npos);
  EXPECT_NE(read_text(out("bytes") / "results.csv").find(",budget_bytes"), std::string::npos);

  expect_error(
      [&] {
        (void)parse(config_with(json{{"budgets", {32}}, {"budget_bytes", {4096}}}));
      },
      "not both");
  json entry_both = config_with(json{{"budgets", {32}}});
  entry_both["policies"][1]["budgets"] = json::array({16});
  entry_both["policies"][1]["budget_bytes"] = json::array({2048});
  expect_error([&] { (void)parse(entry_both); }, "policies[1].budget_bytes: give");
  json multiply = config_with(json{{"budget_bytes", {4096}}});
  multiply["tasks"] = json::array({json{{"task", "passkey"}, {"length_x_budget", {2}}}});
  expect_error([&] { (void)parse(multiply); }, "budgets in bytes");
  // An entry's own byte budgets beside the grid's token budgets.
  json mixed = config_with(json{{"budgets", {32}}});
  mixed["policies"][1]["budget_bytes"] = json::array({2048});
  const EvalConfig both = parse(mixed);
  EXPECT_FALSE(both.policies[0].budgets_in_bytes);
  EXPECT_TRUE(both.policies[1].budgets_in_bytes);
  EXPECT_EQ(both.policies[1].budget_text(2048), "budget 2048 bytes");
}

TEST_F(Grid, BadConfigsAreClearErrors) {
  const auto with = [](const std::string& pointer, const json& value) {
    json config = tiny_config();
    config[json::json_pointer(pointer)] = value;
    return config;
  };
  expect_error([&] { (void)parse(with("/colour", "red")); }, "colour: unknown key");
  expect_error([&] { (void)parse(with("/tasks/1/depth", 0.5)); }, "tasks[1].depth: unknown key");
  expect_error([&] { (void)parse(with("/tasks/0/task", "sudoku")); }, "unknown task 'sudoku'");
  expect_error([&] { (void)parse(with("/policies/1/policy", "lru")); }, "unknown policy 'lru'");
  expect_error([&] { (void)parse(with("/policies/1/sinks", 32)); }, "policies[1]");
  expect_error([&] { (void)parse(with("/budgets", json::array({"64"}))); },
               "budgets[0]: expected an integer");
  expect_error([&] { (void)parse(with("/budgets", json::array({0}))); }, "budgets[0]: must be in");
  expect_error([&] { (void)parse(with("/tasks/1/lengths", json::array({100}))); },
               "shorter than the passkey template");
  json relative = tiny_config();
  relative["tasks"][1].erase("lengths");
  relative["tasks"][1]["length_x_budget"] = json::array({1, 8});
  expect_error([&] { (void)parse(relative); }, "length 1 x budget 32 = 32 is shorter");
  expect_error([&] { (void)parse(with("/tasks/1/depths", json::array({1.5}))); },
               "tasks[1].depths[0]: must be in [0, 1]");
  expect_error([&] { (void)parse(with("/tasks/2/turns", json::array({2}))); }, "even");
  expect_error([&] { (void)parse(with("/tasks/2/length", 40)); }, "cannot hold the grocery");
  expect_error(
      [&] {
        (void)parse(with("/tasks/3/checkpoints", json::array({100, 50})));
      },
      "ascending");
  expect_error([&] { (void)parse(with("/policies/2/label", "full")); }, "used twice");
  expect_error([&] { (void)parse(with("/chunk", 0)); }, "chunk: must be in");
  expect_error([&] { (void)parse(with("/anchors", "yes")); }, "anchors: expected true or false");
  expect_error([&] { (void)parse(with("/name", "a/b")); }, "may hold only");
  expect_error([&] { (void)parse(with("/tasks", json::array())); }, "tasks: must not be empty");
  json nameless = tiny_config();
  nameless.erase("model");
  expect_error([&] { (void)parse(nameless); }, "model: required");
  expect_error([&] { (void)parse(json::array()); }, "expected an object");

  expect_error([&] { (void)prepare_grid(parse(with("/model", (*dir_ / "none.gguf").string()))); },
               "does not exist");
  expect_error([&] { (void)prepare_grid(parse(with("/text", (*dir_ / "none.txt").string()))); },
               "text file");
  expect_error([&] { (void)prepare_grid(parse(with("/text", (*dir_ / "empty.txt").string()))); },
               "is empty");

  write_text(*dir_ / "broken.json", "{\"name\": \"x\",");
  expect_error([&] { (void)load_eval_config(*dir_ / "broken.json"); }, "is not valid JSON");
  expect_error([&] { (void)load_eval_config(*dir_ / "absent.json"); }, "cannot open");
}

#ifdef KVEVICT_CLI_PATH

struct CommandResult {
  int code = -1;
  std::string out;
  std::string err;
};

CommandResult run_cli(const fs::path& dir, const std::string& arguments) {
  const fs::path out = dir / "cli_out.txt";
  const fs::path err = dir / "cli_err.txt";
  // Run from `dir`: the defaults relative to the working directory land there.
  const std::string command =
      fmt::format("cd '{}' && '{}' {} >'{}' 2>'{}' </dev/null", dir.string(), KVEVICT_CLI_PATH,
                  arguments, out.string(), err.string());
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text(out), read_text(err)};
}

TEST_F(Grid, CommandLineRunsAndResumes) {
  write_text(*dir_ / "tiny.json", tiny_config().dump());
  const std::string arguments = fmt::format("eval '{}' --out '{}' --jobs 2",
                                            (*dir_ / "tiny.json").string(), out("cli").string());
  const CommandResult first = run_cli(*dir_, arguments);
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_NE(first.out.find("cells    16 (run 16, resumed 0, failed 0)"), std::string::npos)
      << first.out;
  EXPECT_NE(first.err.find("[16/16] "), std::string::npos) << first.err;
  expect_parsable_results(out("cli"), 16);
  const std::string aggregate = read_text(out("cli") / "results.json");

  const CommandResult second = run_cli(*dir_, arguments);
  ASSERT_EQ(second.code, 0) << second.err;
  EXPECT_NE(second.out.find("(run 0, resumed 16, failed 0)"), std::string::npos) << second.out;
  EXPECT_EQ(read_text(out("cli") / "results.json"), aggregate);
}

TEST_F(Grid, CommandLineShardsAndMerge) {
  json config = tiny_config();
  config["tasks"] = json::parse(R"([{"task": "stream_bpb", "tokens": 40, "window": 16}])");
  write_text(*dir_ / "small.json", config.dump());
  const std::string small = (*dir_ / "small.json").string();
  const CommandResult listed = run_cli(*dir_, fmt::format("eval '{}' --list --shard 2/3", small));
  ASSERT_EQ(listed.code, 0) << listed.err;
  EXPECT_NE(listed.out.find("\n1 cells\n"), std::string::npos) << listed.out;  // of 4: 2, 1, 1
  for (const int index : {1, 2}) {
    const CommandResult shard =
        run_cli(*dir_, fmt::format("eval '{}' --shard {}/2 --out '{}' --jobs 1", small, index,
                                   out(fmt::format("cli-shard{}", index)).string()));
    ASSERT_EQ(shard.code, 0) << shard.err;
    EXPECT_NE(shard.out.find("cells    2 (run 2, resumed 0, failed 0)"), std::string::npos)
        << shard.out;
  }
  const CommandResult merged =
      run_cli(*dir_, fmt::format("eval merge '{}' '{}' -o '{}'", out("cli-shard2").string(),
                                 out("cli-shard1").string(), out("cli-merged").string()));
  ASSERT_EQ(merged.code, 0) << merged.err;
  EXPECT_NE(merged.out.find("cells    4 from 2 shard directories"), std::string::npos)
      << merged.out;
  expect_parsable_results(out("cli-merged"), 4);

  for (const auto& [arguments, message] : std::vector<std::pair<std::string, std::string>>{
           {fmt::format("eval '{}' --shard 3/2", small), "--shard: expected I/N"},
           {fmt::format("eval '{}' --shard 0/2 --list", small), "--shard: expected I/N"},
           {fmt::format("eval merge '{}'", out("cli-shard1").string()), "have no result"},
           {fmt::format("eval merge '{}'", out("nowhere").string()), "holds no results.json"},
           {"eval merge", "shard_dirs is required"}}) {
    const CommandResult result = run_cli(*dir_, arguments);
    EXPECT_EQ(result.code, 2) << arguments;
    EXPECT_NE(result.err.find("kvevict: error: "), std::string::npos) << result.err;
    EXPECT_NE(result.err.find(message), std::string::npos) << arguments << ": " << result.err;
  }
}

// A user's run leaves the checkout's committed results alone: without --out the results go to
// the build tree, and only --committed writes eval/results/<name> (from the working directory).
TEST_F(Grid, CommandLineWritesTheBuildTreeUnlessToldCommitted) {
  json config = tiny_config();
  config["name"] = fmt::format("default-out-{}", getpid());
  config["tasks"] = json::parse(R"([{"task": "stream_bpb", "tokens": 40, "window": 16}])");
  write_text(*dir_ / "default.json", config.dump());
  const std::string path = (*dir_ / "default.json").string();
  const std::string name = config["name"];

  const CommandResult by_default = run_cli(*dir_, fmt::format("eval '{}' --jobs 1", path));
  ASSERT_EQ(by_default.code, 0) << by_default.err;
  const std::string marker = "results  ";
  const std::size_t at = by_default.out.find(marker);
  ASSERT_NE(at, std::string::npos) << by_default.out;
  const std::string results =
      by_default.out.substr(at + marker.size(), by_default.out.find(',', at) - at - marker.size());
  const fs::path written = fs::path(results).parent_path();
  EXPECT_EQ(written.filename(), name);
  EXPECT_EQ(written.parent_path().filename(), "eval-results");
  EXPECT_TRUE(fs::exists(written / "results.json")) << written;
  EXPECT_FALSE(fs::exists(*dir_ / "eval")) << "wrote into the working directory";
  fs::remove_all(written);

  // --committed: eval/results/<name> of the working directory (a checkout's root).
  const CommandResult committed =
      run_cli(*dir_, fmt::format("eval '{}' --jobs 1 --committed", path));
  ASSERT_EQ(committed.code, 0) << committed.err;
  EXPECT_TRUE(fs::exists(*dir_ / "eval" / "results" / name / "results.json")) << committed.out;

  const CommandResult both =
      run_cli(*dir_, fmt::format("eval '{}' --committed --out '{}'", path, out("both").string()));
  EXPECT_EQ(both.code, 2);
  EXPECT_NE(both.err.find("give one"), std::string::npos) << both.err;
}

TEST_F(Grid, CommandLineBadInputExitsTwo) {
  write_text(*dir_ / "tiny.json", tiny_config().dump());
  write_text(*dir_ / "broken.json", "{");
  json missing = tiny_config();
  missing["model"] = (*dir_ / "none.gguf").string();
  write_text(*dir_ / "missing.json", missing.dump());
  const std::string tiny = (*dir_ / "tiny.json").string();
  for (const auto& [arguments, message] : std::vector<std::pair<std::string, std::string>>{
           {fmt::format("eval '{}' --jobs 0", tiny), "--jobs must be at least 1"},
           {fmt::format("eval '{}'", (*dir_ / "broken.json").string()), "is not valid JSON"},
           {fmt::format("eval '{}'", (*dir_ / "missing.json").string()), "does not exist"},
           {"eval", "config is required"}}) {
    const CommandResult result = run_cli(*dir_, arguments);
    EXPECT_EQ(result.code, 2) << arguments;
    EXPECT_NE(result.err.find("kvevict: error: "), std::string::npos) << result.err;
    EXPECT_NE(result.err.find(message), std::string::npos) << arguments << ": " << result.err;
  }
}

#endif  // KVEVICT_CLI_PATH

}  // namespace
