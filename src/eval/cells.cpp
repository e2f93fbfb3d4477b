// The grid's cells: what a cell is (CellSpec) and their enumeration, a cell per policy entry,
// budget, task and task variant (passkey length and depth, grocery turn count).
#include <fmt/format.h>

#include <cstdint>
#include <kvevict/error.hpp>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "eval/grid.hpp"

namespace kvevict::eval {
namespace {

using OrderedJson = nlohmann::ordered_json;

// Letters, digits, '.', '_' and '-' kept; anything else becomes '_'.
std::string slug(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const bool safe = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-';
    out += safe ? c : '_';
  }
  return out.substr(0, 60);
}

}  // namespace

std::vector<std::int64_t> passkey_lengths(const EvalConfig& config, const TaskConfig& task,
                                          std::optional<int> budget) {
  if (!task.lengths.empty()) return task.lengths;
  std::set<std::int64_t> lengths;
  if (budget) {
    for (const std::int64_t factor : task.length_x_budget) lengths.insert(factor * *budget);
  } else {
    for (const PolicyEntry& entry : config.policies) {
      for (const int b : entry.budgets) {
        for (const std::int64_t factor : task.length_x_budget) lengths.insert(factor * b);
      }
    }
  }
  return {lengths.begin(), lengths.end()};
}

OrderedJson CellSpec::variant_json() const {
  OrderedJson json = OrderedJson::object();
  if (length) json["length"] = *length;
  if (depth) json["depth"] = *depth;
  if (turns) json["turns"] = *turns;
  return json;
}

std::string CellSpec::describe(const EvalConfig& config) const {
  const PolicyEntry& entry = config.policies[policy_index];
  std::string text = fmt::format("{} {} {}={}", to_string(config.tasks[task_index].kind),
                                 entry.label, entry.budgets_in_bytes ? "budget_bytes" : "budget",
                                 budget ? std::to_string(*budget) : std::string("-"));
  if (length) text += fmt::format(" length={}", *length);
  if (depth) text += fmt::format(" depth={}", *depth);
  if (turns) text += fmt::format(" turns={}", *turns);
  return text;
}

std::vector<CellSpec> enumerate_cells(const EvalConfig& config) {
  std::vector<CellSpec> cells;
  std::map<std::string, std::string> slugs;  // slug -> label, to refuse two labels with one id
  for (const PolicyEntry& entry : config.policies) {
    const auto [it, inserted] = slugs.emplace(slug(entry.label), entry.label);
    if (!inserted) {
      throw Error(
          fmt::format("{}: policy labels '{}' and '{}' give the same cell file name '{}': "
                      "rename one",
                      config.source, it->second, entry.label, it->first));
    }
  }
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskConfig& task = config.tasks[t];
    for (std::size_t p = 0; p < config.policies.size(); ++p) {
      const PolicyEntry& entry = config.policies[p];
      std::vector<std::optional<int>> budgets;
      for (const int budget : entry.budgets) budgets.emplace_back(budget);
      if (budgets.empty()) budgets.emplace_back(std::nullopt);
      for (const std::optional<int> budget : budgets) {
        CellSpec base;
        base.task_index = t;
        base.policy_index = p;
        base.budget = budget;
        const std::string prefix =
            fmt::format("t{}-{}-{}-{}", t, to_string(task.kind), slug(entry.label),
                        !budget                  ? std::string("full")
                        : entry.budgets_in_bytes ? fmt::format("bytes{}", *budget)
                                                 : fmt::format("b{}", *budget));
        switch (task.kind) {
          case TaskKind::stream_bpb:
          case TaskKind::cost:
            base.id = prefix;
            cells.push_back(base);
            break;
          case TaskKind::passkey:
            for (const std::int64_t length : passkey_lengths(config, task, budget)) {
              for (const double depth : task.depths) {
                CellSpec cell = base;
                cell.length = length;
                cell.depth = depth;
                cell.id = fmt::format("{}-L{}-d{}", prefix, length, depth);
                cells.push_back(cell);
              }
            }
            break;
          case TaskKind::grocery:
            for (const int turns : task.turns) {
              CellSpec cell = base;
              cell.length = task.length;
              cell.turns = turns;
              cell.id = fmt::format("{}-T{}", prefix, turns);
              cells.push_back(cell);
            }
            break;
        }
      }
    }
  }
  return cells;
}

}  // namespace kvevict::eval
