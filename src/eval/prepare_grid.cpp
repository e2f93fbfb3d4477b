// Preparing a grid before any cell runs: the model loaded and checksummed, the text read and
// encoded, and every policy entry at every budget set up once on the engine, so that a bad config
// fails before the first cell (and not in a child process).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <kvevict/error.hpp>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "eval/documents.hpp"
#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "eval/sha256.hpp"
#include "harness/anchor_inserter.hpp"
#include "harness/policy_setup.hpp"

namespace kvevict::eval {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

// Throws when an unbounded policy at `budget` would feed a sequence more tokens than the engine's
// `capacity` (llama.cpp's context): the longest stream or document of any task, answer tokens
// included (anchors, when inserted, add more).
void check_capacity(const EvalConfig& config, std::optional<int> budget, std::int64_t capacity) {
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskConfig& task = config.tasks[t];
    std::int64_t longest = task.tokens;  // stream_bpb, cost
    if (task.kind == TaskKind::passkey) {
      const std::vector<std::int64_t> lengths = passkey_lengths(config, task, budget);
      if (lengths.empty()) continue;  // no cell
      longest = *std::max_element(lengths.begin(), lengths.end()) + kPasskeyDigits - 1;
    } else if (task.kind == TaskKind::grocery) {
      longest = task.length + kGroceryMaxAnswerTokens - 1;
    }
    if (longest > capacity) {
      throw Error(
          fmt::format("the policy keeps every token and tasks[{}] ({}) feeds up to {} "
                      "tokens, more than the engine's {} cells (kvevict-llama -c)",
                      t, to_string(task.kind), longest, capacity));
    }
  }
}

bool is_file(const fs::path& path) {
  std::error_code error;
  return fs::is_regular_file(path, error);
}

}  // namespace

ModelChecksum checksum_model(const fs::path& path) {
  std::vector<fs::path> files;
  std::error_code error;
  if (fs::is_directory(path, error)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
    // A .safetensors model reads config.json beside it (model.cpp): part of the model too.
    const fs::path config = path.parent_path() / "config.json";
    if (path.extension() == ".safetensors" && is_file(config)) files.push_back(config);
  }
  if (files.empty()) throw Error(fmt::format("model directory '{}' holds no files", path.string()));
  ModelChecksum checksum;
  checksum.files = OrderedJson::array();
  std::string listing;
  for (const fs::path& file : files) {
    const std::string sha = sha256_file(file);
    checksum.files.push_back(
        {{"path", file.string()}, {"bytes", fs::file_size(file)}, {"sha256", sha}});
    listing += sha + "  " + file.filename().string() + "\n";
  }
  checksum.sha256 =
      files.size() == 1 ? checksum.files[0]["sha256"].get<std::string>() : sha256_hex(listing);
  return checksum;
}

GridContext prepare_grid(EvalConfig config) {
  return prepare_grid(std::move(config), reference_engine);
}

GridContext prepare_grid(EvalConfig config, const EngineLoader& load) {
  std::vector<CellSpec> cells = enumerate_cells(config);
  std::shared_ptr<const EvalEngine> engine = load(config.model);
  ModelChecksum model_checksum = checksum_model(config.model);

  if (!is_file(config.text)) {
    throw Error(fmt::format("{}: text file '{}' does not exist", config.source, config.text));
  }
  std::ifstream in(config.text, std::ios::binary);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (text.empty())
    throw Error(fmt::format("{}: text file '{}' is empty", config.source, config.text));
  std::vector<std::int32_t> text_tokens = engine->encode(text, /*add_bos=*/false);
  if (text_tokens.empty()) {
    throw Error(fmt::format("{}: text file '{}' holds no tokens", config.source, config.text));
  }
  std::optional<FillerText> filler;
  try {
    filler.emplace(text);
  } catch (const Error& error) {
    throw Error(fmt::format("{}: text file '{}': {}", config.source, config.text, error.what()));
  }

  const model::Tokenizer* tokenizer = engine->kvevict_tokenizer();
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskKind kind = config.tasks[t].kind;
    if ((kind == TaskKind::passkey || kind == TaskKind::grocery) &&
        (tokenizer == nullptr || tokenizer->kind != model::Tokenizer::Kind::byte_level ||
         tokenizer->bos_id < 0)) {
      throw Error(fmt::format(
          "{}: tasks[{}]: the {} task builds byte-level documents and needs a "
          "byte-level tokenizer with BOS; model '{}' has {}",
          config.source, t, to_string(kind), config.model,
          tokenizer == nullptr ? "a vocabulary only llama.cpp tokenizes" : "neither or not both"));
    }
  }
  if (config.anchors) {
    try {
      if (tokenizer == nullptr) {
        throw Error(
            fmt::format("model '{}' has a vocabulary only llama.cpp tokenizes, without "
                        "kvevict's <AC> anchor",
                        config.model));
      }
      (void)harness::AnchorInserter::for_tokenizer(*tokenizer);
    } catch (const Error& error) {
      throw Error(fmt::format("{}: anchors: {}", config.source, error.what()));
    }
  }
  for (std::size_t p = 0; p < config.policies.size(); ++p) {
    const PolicyEntry& entry = config.policies[p];
    std::vector<std::optional<int>> budgets(entry.budgets.begin(), entry.budgets.end());
    if (budgets.empty()) budgets.emplace_back(std::nullopt);
    for (const std::optional<int> budget : budgets) {
      try {
        harness::PolicySetup setup = engine->make_setup(entry.options(budget, config.chunk));
        const bool keeps_every_token = !setup.policy->retained_limit();
        const std::optional<std::int64_t> capacity = engine->check(setup);
        if (keeps_every_token && capacity) check_capacity(config, budget, *capacity);
      } catch (const Error& error) {
        throw Error(fmt::format("{}: policies[{}] ({}){}: {}", config.source, p, entry.label,
                                budget ? " at " + entry.budget_text(*budget) : std::string(),
                                error.what()));
      }
    }
  }
  std::string config_sha256 = sha256_hex(to_json(config).dump());
  std::string text_sha256 = sha256_hex(text);
  return GridContext{std::move(config),  std::move(engine),        std::move(model_checksum),
                     std::move(text),    std::move(text_sha256),   std::move(text_tokens),
                     std::move(*filler), std::move(config_sha256), std::move(cells)};
}

}  // namespace kvevict::eval
