// The eval grid: policies x budgets x task variants over one model, each cell run in its own
// fork()ed child (per-cell RSS, a crash is reported and the grid goes on), written to
// <out>/cells/<id>.json atomically, and aggregated into results.json / results.csv / results.md.
// docs/eval.md describes the outputs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <kvevict/model/model.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "eval/config.hpp"
#include "eval/documents.hpp"

namespace kvevict::eval {

/// One cell: a policy entry at one budget (or none) on one variant of one task.
struct CellSpec {
  std::string id;  ///< file-name safe and unique in the grid, e.g. "t1-passkey-p2-b64-L1024-d0.5"
  std::size_t task_index = 0;
  std::size_t policy_index = 0;
  std::optional<int> budget;           ///< nullopt: an unbounded policy (full)
  std::optional<std::int64_t> length;  ///< passkey, grocery
  std::optional<double> depth;         ///< passkey
  std::optional<int> turns;            ///< grocery

  /// {"length": ..., "depth": ..., "turns": ...} (only those the task has).
  [[nodiscard]] nlohmann::ordered_json variant_json() const;
  /// "passkey streaming_llm budget=64 length=1024 depth=0.5" (progress lines).
  [[nodiscard]] std::string describe(const EvalConfig& config) const;
};

/// Every cell of the grid, in a fixed order: task by task, policy by policy, budget by budget,
/// then the task's variants. An unbounded policy runs each variant once; passkey lengths given as
/// length_x_budget run, for an unbounded policy, at every length any budget gives (their union).
[[nodiscard]] std::vector<CellSpec> enumerate_cells(const EvalConfig& config);

/// The checksum of a model file, or of every file a model directory / safetensors model holds.
struct ModelChecksum {
  std::string sha256;  ///< of the file; of "sha256  name\n" lines (sha256sum style) for several
  nlohmann::ordered_json files;  ///< [{"path", "bytes", "sha256"}]
};
[[nodiscard]] ModelChecksum checksum_model(const std::filesystem::path& path);

/// Everything a cell needs, loaded and checked once by the parent before any child is forked.
struct GridContext {
  EvalConfig config;
  model::Model model;
  ModelChecksum model_checksum;
  std::string text;  ///< the text file's bytes
  std::string text_sha256;
  std::vector<std::int32_t> text_tokens;  ///< the text, encoded without BOS (streams cycle it)
  FillerText filler;
  std::string config_sha256;  ///< of the normalised config (to_json) as compact text
  std::vector<CellSpec> cells;
};

/// Loads the model and the text, checksums them, and checks what needs the model: the tokenizer
/// (byte-level with BOS for passkey and grocery; an anchor token with "anchors") and every policy
/// at every budget (make_policy_setup). Throws kvevict::Error naming the problem.
[[nodiscard]] GridContext prepare_grid(EvalConfig config);

/// What a cell's result is recorded against: the model and text checksums, seed, chunk, anchors,
/// the policy entry, budget, task and variant. Its SHA-256 is the cell's config hash.
[[nodiscard]] nlohmann::ordered_json cell_config_json(const GridContext& grid,
                                                      const CellSpec& cell);

/// Runs one cell in this process and returns its result (see docs/eval.md: id, grid, cell_hash,
/// task, policy, label, budget, variant, config, policy_setup, metrics, details).
[[nodiscard]] nlohmann::ordered_json run_cell(const GridContext& grid, const CellSpec& cell);

/// The headline metric of a finished cell for progress lines: {"per-digit", 0.62}.
struct Headline {
  std::string name;
  double value = 0;
  std::string text;  ///< "per-digit 0.620"
};
[[nodiscard]] Headline headline(const nlohmann::ordered_json& cell_result);

struct GridOptions {
  std::filesystem::path out;
  int jobs = 2;
  bool fresh = false;                ///< discard the output directory's cells and results first
  std::ostream* progress = nullptr;  ///< progress lines; nullptr = none
  /// Called in the child before the cell runs (tests make a cell crash here).
  std::function<void(const CellSpec&)> before_cell;
};

struct GridSummary {
  std::size_t cells = 0;
  std::size_t run = 0;                ///< computed now
  std::size_t resumed = 0;            ///< found done in <out>/cells
  std::vector<std::string> failures;  ///< "<id>: <why>"
};

/// Runs the grid's missing cells with up to `jobs` children at once, then writes the aggregate.
/// Throws kvevict::Error for bad options and for an output directory holding another grid's cells
/// or cells computed with a different configuration (unless `fresh`).
GridSummary run_grid(const GridContext& grid, const GridOptions& options);

/// Reads every cell present in <out>/cells and writes results.json, results.csv, results.md.
void write_results(const GridContext& grid, const std::filesystem::path& out);

/// The aggregate's parts, for tests and tools: all cells found, with the derived columns.
[[nodiscard]] nlohmann::ordered_json aggregate_json(const GridContext& grid,
                                                    const std::filesystem::path& out);
[[nodiscard]] std::string results_csv(const nlohmann::ordered_json& aggregate);
[[nodiscard]] std::string results_markdown(const GridContext& grid,
                                           const nlohmann::ordered_json& aggregate);

}  // namespace kvevict::eval
