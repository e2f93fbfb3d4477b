// The eval grid: policies x budgets x task variants over one model, each cell run in its own
// fork()ed child (per-cell RSS, a crash is reported and the grid goes on), written to
// <out>/cells/<id>.json atomically, and aggregated into results.json / results.csv / results.md.
// A grid may run as shards (deterministic slices) on several machines, whose outputs merge into
// what one run writes (shards.cpp). docs/eval.md describes the outputs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "eval/config.hpp"
#include "eval/documents.hpp"
#include "eval/engine.hpp"

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
/// The passkey lengths a cell list of `task` uses at `budget` (nullopt: the union over every
/// budget of the config): the task's lengths, or its length_x_budget factors times the budget.
[[nodiscard]] std::vector<std::int64_t> passkey_lengths(const EvalConfig& config,
                                                        const TaskConfig& task,
                                                        std::optional<int> budget);

/// The checksum of a model file, or of every file a model directory / safetensors model holds.
struct ModelChecksum {
  std::string sha256;  ///< of the file; of "sha256  name\n" lines (sha256sum style) for several
  nlohmann::ordered_json files;  ///< [{"path", "bytes", "sha256"}]
};
[[nodiscard]] ModelChecksum checksum_model(const std::filesystem::path& path);

/// Everything a cell needs, loaded and checked once by the parent before any child is forked.
struct GridContext {
  EvalConfig config;
  std::shared_ptr<const EvalEngine> engine;  ///< the model, its tokenizer and its sequences
  ModelChecksum model_checksum;
  std::string text;  ///< the text file's bytes
  std::string text_sha256;
  std::vector<std::int32_t> text_tokens;  ///< the text, encoded without BOS (streams cycle it)
  FillerText filler;
  std::string config_sha256;  ///< of the normalised config (to_json) as compact text
  std::vector<CellSpec> cells;
  /// Threads of each cell's sequence (`-t`): not part of the config, since kvevict's results are
  /// bit-identical for any number (only tokens/s change).
  int threads = 1;
};

/// Loads the model (with `load`: kvevict's reference decoder by default) and the text, checksums
/// them, and checks what needs the model: the tokenizer (kvevict's byte-level one with BOS for
/// passkey and grocery; an anchor token with "anchors"), every policy at every budget (the
/// engine's make_setup and check) and that unbounded policies fit an engine of bounded capacity.
/// Throws kvevict::Error naming the problem (the task or the policy entry, and the model).
[[nodiscard]] GridContext prepare_grid(EvalConfig config);
[[nodiscard]] GridContext prepare_grid(EvalConfig config, const EngineLoader& load);

/// What a cell's result is recorded against: the model and text checksums, seed, chunk, anchors,
/// the policy entry, budget, task and variant, and the engine when it is not kvevict's decoder.
/// Its SHA-256 is the cell's config hash.
[[nodiscard]] nlohmann::ordered_json cell_config_json(const EvalConfig& config,
                                                      std::string_view model_sha256,
                                                      std::string_view text_sha256,
                                                      std::string_view engine,
                                                      const CellSpec& cell);
[[nodiscard]] nlohmann::ordered_json cell_config_json(const GridContext& grid,
                                                      const CellSpec& cell);

/// A deterministic slice of the grid for one of `count` machines or jobs: the cell at position k
/// (0-based, grid order) belongs to shard k mod count + 1, so shards differ by at most one cell
/// and each mixes the grid's cheap and dear cells. `index` is 1-based: shards 1/N .. N/N.
struct ShardSpec {
  int index = 1;
  int count = 1;

  [[nodiscard]] bool holds(std::size_t cell_position) const {
    return static_cast<int>(cell_position % static_cast<std::size_t>(count)) + 1 == index;
  }
  [[nodiscard]] std::string text() const;  ///< "2/8"
};
/// Parses "I/N" (1 <= I <= N). Throws kvevict::Error naming --shard.
[[nodiscard]] ShardSpec parse_shard(std::string_view text);
/// The cells of `cells` (a whole grid, in grid order) that `shard` holds, in grid order.
[[nodiscard]] std::vector<CellSpec> shard_cells(const std::vector<CellSpec>& cells,
                                                const ShardSpec& shard);

/// What an output directory's results describe besides the cells' own files: the config, the
/// model and text as recorded, and which cells belong there. A run builds it from its GridContext;
/// `eval merge` reads it back from the shards' results.json, so neither needs the model.
struct GridRecord {
  EvalConfig config;
  std::string config_sha256;
  nlohmann::ordered_json model;          ///< {path, sha256, files, format, context_length}
  nlohmann::ordered_json text;           ///< {path, sha256, bytes}
  std::string engine{kReferenceEngine};  ///< EvalEngine::name()
  std::vector<CellSpec> cells;  ///< the cells of this output, in grid order (a shard's slice)
  std::optional<ShardSpec> shard;
};
/// The record of `grid`, or of its slice `shard`.
[[nodiscard]] GridRecord grid_record(const GridContext& grid,
                                     std::optional<ShardSpec> shard = std::nullopt);
/// The SHA-256 of cell_config_json: what a cell file must record as its "cell_hash".
[[nodiscard]] std::string cell_hash(const GridRecord& record, const CellSpec& cell);

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
  std::optional<ShardSpec> shard;    ///< run only this slice of the grid; nullopt: every cell
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

/// Runs the grid's (or its shard's) missing cells with up to `jobs` children at once, then writes
/// the aggregate. Throws kvevict::Error for bad options and for an output directory holding
/// another grid's cells or cells computed with a different configuration (unless `fresh`).
GridSummary run_grid(const GridContext& grid, const GridOptions& options);

/// Reads the record's cells present in <out>/cells and writes results.json, results.csv and
/// results.md (`extra` keys, e.g. a merge's "shards", are added to results.json).
void write_results(const GridRecord& record, const std::filesystem::path& out,
                   const nlohmann::ordered_json& extra = nlohmann::ordered_json::object());

/// The aggregate's parts, for tests and tools: all cells found, with the derived columns.
[[nodiscard]] nlohmann::ordered_json aggregate_json(const GridRecord& record,
                                                    const std::filesystem::path& out);
[[nodiscard]] std::string results_csv(const nlohmann::ordered_json& aggregate);
[[nodiscard]] std::string results_markdown(const GridRecord& record,
                                           const nlohmann::ordered_json& aggregate);

/// A cell file's JSON as the current version names it: results written before the core stopped
/// compacting call the eviction-decision count "compactions"; it is read as "decisions". Throws
/// kvevict::Error for a file that is not JSON.
[[nodiscard]] nlohmann::ordered_json read_cell_file(const std::filesystem::path& path);
/// Writes `text` to `path` through `path`.tmp and a rename: readers see the whole file or none.
void write_file_atomically(const std::filesystem::path& path, const std::string& text);
/// <out>/cells, created if need be; with `fresh`, the cells and results `out` held are deleted
/// first.
std::filesystem::path prepare_cells_directory(const std::filesystem::path& out, bool fresh);

/// Where the committed results of the grids live, relative to the checkout's root.
inline constexpr std::string_view kCommittedResults = "eval/results";

/// Where a grid's results go by default: <build>/eval-results, in the build tree kvevict was built
/// in (<build>/eval-results/<grid name>).
[[nodiscard]] std::filesystem::path default_output_root();

/// The output directory of grid `grid_name`: `out` when given; with `committed` (--committed),
/// eval/results/<grid name>, the committed results (run from the checkout's root to reproduce or
/// update them); else <build>/eval-results/<grid name>, in the build tree kvevict was built in, so
/// that a run leaves the checkout's committed folders as they are. Throws kvevict::Error for both
/// --out and --committed, and when the build tree is gone (an installed kvevict: give --out).
[[nodiscard]] std::filesystem::path output_directory(const std::filesystem::path& out,
                                                     bool committed, std::string_view grid_name);

/// What `kvevict eval` and `kvevict-llama eval` are given on the command line.
struct EvalCommand {
  std::string config;
  std::string out;         ///< empty: output_directory's default
  bool committed = false;  ///< --committed: eval/results/<grid name>
  int jobs = 2;
  int threads = 1;
  std::string shard;  ///< "I/N"; empty: every cell
  bool fresh = false;
  bool list = false;                        ///< print the cells (of the shard) and load nothing
  std::string model;                        ///< replaces the config's "model" when not empty
  std::string text;                         ///< replaces the config's "text" when not empty
  std::function<void(EvalConfig&)> adjust;  ///< applied to the loaded config (--kv-type)
};
/// Loads the config, prepares the grid over the engine `load` gives, runs it (or lists its cells
/// on `out`) and prints the summary on `out`, progress on `progress`. Returns whether every cell
/// has a result. Throws kvevict::Error for bad options, configs, models and output directories.
bool run_eval_command(const EvalCommand& command, const EngineLoader& load, std::ostream& out,
                      std::ostream& progress);

struct MergeOptions {
  std::vector<std::filesystem::path> shards;  ///< output directories of `eval --shard` runs
  std::filesystem::path out;                  ///< empty: output_directory's default
  bool committed = false;                     ///< --committed: eval/results/<grid name>
  bool fresh = false;                         ///< discard what `out` holds first
};
struct MergeSummary {
  std::filesystem::path out;
  std::size_t cells = 0;
  std::vector<std::string> notes;  ///< e.g. shards built from different git revisions
};
/// Combines shard outputs into `out` (cells/ and the results a single run writes, plus "shards":
/// where each came from). Throws kvevict::Error, before writing anything, when the shards record
/// different grids, configs, models or texts (naming what differs), when two shards hold the same
/// cell, when a cell of the grid is in none of them, or when `out` already holds cells.
MergeSummary merge_shards(const MergeOptions& options);

}  // namespace kvevict::eval
