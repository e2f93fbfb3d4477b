// Running one cell: the record every cell carries (id, hash, revision, engine, policy, budget,
// variant, config), the task's body (task_*.cpp) and the process's memory after it; and the
// headline metric of each task for progress lines.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "eval/machine_info.hpp"
#include "eval/sha256.hpp"
#include "eval/task_support.hpp"
#include "harness/report.hpp"

namespace kvevict::eval {

using OrderedJson = nlohmann::ordered_json;

OrderedJson run_cell(const GridContext& grid, const CellSpec& cell) {
  const EvalConfig& config = grid.config;
  const TaskConfig& task = config.tasks[cell.task_index];
  const PolicyEntry& entry = config.policies[cell.policy_index];
  OrderedJson result;
  const OrderedJson cell_config = cell_config_json(grid, cell);
  result["id"] = cell.id;
  result["grid"] = config.name;
  result["cell_hash"] = sha256_hex(cell_config.dump());
  result["git_revision"] = git_revision();
  result["engine"] = grid.engine->name();
  result["task"] = std::string(to_string(task.kind));
  result["task_index"] = cell.task_index;
  result["policy"] = entry.policy;
  result["label"] = entry.label;
  result["policy_index"] = cell.policy_index;
  result["budget"] = cell.budget ? OrderedJson(*cell.budget) : OrderedJson(nullptr);
  // Only for bytes, so that token grids' cells keep their form.
  if (entry.budgets_in_bytes) result["budget_unit"] = "bytes";
  result["variant"] = cell.variant_json();
  result["config"] = cell_config;
  result["policy_setup"] = nullptr;
  result["metrics"] = OrderedJson::object();
  result["details"] = OrderedJson::object();
  switch (task.kind) {
    case TaskKind::stream_bpb:
      tasks::run_stream_bpb(grid, cell, result);
      break;
    case TaskKind::passkey:
      tasks::run_passkey(grid, cell, result);
      break;
    case TaskKind::grocery:
      tasks::run_grocery(grid, cell, result);
      break;
    case TaskKind::cost:
      tasks::run_cost(grid, cell, result);
      break;
  }
  if (entry.budgets_in_bytes && cell.budget) result["metrics"]["budget_bytes"] = *cell.budget;
  const ProcessMemory memory = process_memory();
  result["metrics"]["rss_bytes"] = memory.rss_bytes;
  result["metrics"]["peak_rss_bytes"] = memory.peak_rss_bytes;
  return result;
}

Headline headline(const OrderedJson& cell_result) {
  const std::string task = cell_result.value("task", "");
  const OrderedJson& metrics = cell_result.at("metrics");
  Headline line;
  const auto number = [&](const char* key) {
    return metrics.contains(key) && metrics.at(key).is_number() ? metrics.at(key).get<double>()
                                                                : std::nan("");
  };
  if (task == "stream_bpb") {
    line = {"bits/byte", number("bits_per_byte"), ""};
    line.text = fmt::format("bits/byte {:.4f}", line.value);
  } else if (task == "passkey") {
    line = {"per-digit", number("per_digit"), ""};
    line.text = fmt::format("per-digit {:.3f}, exact {:.3f}", line.value, number("exact"));
  } else if (task == "grocery") {
    line = {"recall", number("item_recall"), ""};
    line.text = fmt::format("recall {:.3f}, exact {:.3f}", line.value, number("exact"));
  } else {
    line = {"tokens/s", number("tokens_per_second"), ""};
    line.text =
        fmt::format("{:.0f} tokens/s, peak RSS {}", line.value,
                    harness::format_bytes(static_cast<std::uint64_t>(number("peak_rss_bytes"))));
  }
  return line;
}

}  // namespace kvevict::eval
