// What a cell's hash covers (cell_config_json): the grid, the model's and the text's checksums,
// the policy entry and the task without what only enumerates cells, and the cell's variant. A cell
// found on disk with another hash is another cell's result (runner.cpp refuses to resume it).
#include <string_view>

#include "eval/engine.hpp"
#include "eval/grid.hpp"

namespace kvevict::eval {
namespace {

using OrderedJson = nlohmann::ordered_json;

// The task entry without the lists that only enumerate variants (depths, lengths, turns), so that
// adding a variant leaves the existing cells' hashes as they are.
OrderedJson task_hash_json(const TaskConfig& task) {
  OrderedJson json = to_json(task);
  json.erase("depths");
  json.erase("lengths");
  json.erase("length_x_budget");
  json.erase("turns");
  return json;
}

// The policy entry without its label (cosmetic) and budgets (they enumerate cells).
OrderedJson policy_hash_json(const PolicyEntry& entry) {
  OrderedJson json = to_json(entry);
  json.erase("label");
  json.erase("budgets");
  return json;
}

}  // namespace

OrderedJson cell_config_json(const EvalConfig& config, std::string_view model_sha256,
                             std::string_view text_sha256, std::string_view engine,
                             const CellSpec& cell) {
  OrderedJson json;
  json["grid"] = config.name;
  // Paths are left out on purpose: the checksums say what was run, wherever it lies.
  json["model_sha256"] = model_sha256;
  json["text_sha256"] = text_sha256;
  json["seed"] = config.seed;
  json["chunk"] = config.chunk;
  json["anchors"] = config.anchors;
  json["policy"] = policy_hash_json(config.policies[cell.policy_index]);
  json["budget"] = cell.budget ? OrderedJson(*cell.budget) : OrderedJson(nullptr);
  json["task"] = task_hash_json(config.tasks[cell.task_index]);
  json["variant"] = cell.variant_json();
  // Only for another engine than kvevict's decoder, so that kvevict's cells keep their hashes and
  // neither engine resumes the other's cells.
  if (engine != kReferenceEngine) json["engine"] = engine;
  return json;
}

OrderedJson cell_config_json(const GridContext& grid, const CellSpec& cell) {
  return cell_config_json(grid.config, grid.model_checksum.sha256, grid.text_sha256,
                          grid.engine->name(), cell);
}

}  // namespace kvevict::eval
