// The eval harness's configuration: a small JSON file naming a model, a text, policies, budgets
// and tasks, whose cross product is the grid `kvevict eval` runs (docs/eval.md has the schema).
//
// Parsing validates every field and names the JSON path of the first problem
// ("grid.json: tasks[1].depths[0]: must be in [0, 1], got 1.5"); unknown keys are errors. Checks
// that need the model (tokenizer kind, policy parameters that depend on it) happen when the grid
// is prepared (grid.hpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "harness/policy_setup.hpp"

namespace kvevict::eval {

enum class TaskKind { stream_bpb, passkey, grocery, cost };

[[nodiscard]] std::string_view to_string(TaskKind kind);

/// One entry of "policies": a policy as the CLI's --policy / --sinks / --param / --positions /
/// --granularity / --keys / --kv-type / --catalyst would give it; the budget comes from the grid.
/// The grid's "kv_types" (an axis) turns an entry without its own "kv_type" into one entry per
/// type.
struct PolicyEntry {
  std::string policy;
  std::string label;  ///< unique row name in the tables; default: policy plus sinks and params
  std::optional<int> sinks;
  std::vector<std::string> params;  ///< "key=value", applied after the budget mapping
  std::string positions;            ///< empty: the policy's own mode
  /// head, layer, token or block:B; empty: the engine's default (kvevict's decoder: the policy's
  /// own; llama.cpp: token)
  std::string granularity;
  std::string keys = "post_rope";
  std::string kv_type = "f32";          ///< --kv-type: how the cache stores keys and values
  std::optional<std::string> catalyst;  ///< InfiniPot's prompt; default: the task's question
  /// --allocation: uniform (default), pyramid or adaptive (policies/allocated.hpp)
  std::string allocation = "uniform";
  /// The budgets this policy runs with: the grid's, or the entry's own "budgets" /
  /// "budget_bytes"; empty = no budget (`full` always; e.g. an unbounded anllm), run once per task
  /// variant.
  std::vector<int> budgets;
  /// Whether `budgets` are bytes of the sequence's keys and values (--budget-bytes, "budget_bytes")
  /// rather than tokens per keep-set (--budget, "budgets").
  bool budgets_in_bytes = false;

  [[nodiscard]] bool bounded() const { return !budgets.empty(); }
  /// "budget 64" or "budget 262144 bytes" (messages).
  [[nodiscard]] std::string budget_text(int budget) const;
  /// The CLI's policy options for this entry at `budget` (nullopt: no budget; else --budget, or
  /// --budget-bytes when budgets_in_bytes) and `chunk`.
  [[nodiscard]] harness::PolicyOptions options(std::optional<int> budget, int chunk) const;
};

struct TaskConfig {
  TaskKind kind = TaskKind::stream_bpb;
  std::int64_t tokens = 0;  ///< stream_bpb, cost: tokens fed (BOS and anchors too)
  int window = 256;         ///< stream_bpb: positions per loss window
  /// stream_bpb, cost, passkey: the token after each occurrence of this text starts a turn
  /// (SirLLM evicts before turns); "" = the stream (the passkey prompt) is one turn.
  std::string turn_separator;
  std::vector<std::int64_t> checkpoints;      ///< cost: ascending token counts, the last <= tokens
  std::vector<double> depths;                 ///< passkey
  std::vector<std::int64_t> lengths;          ///< passkey: absolute document lengths (tokens)
  std::vector<std::int64_t> length_x_budget;  ///< passkey: lengths as multiples of the budget
  int documents = 20;                         ///< passkey, grocery: documents per cell
  int items = 5;                              ///< grocery: shopping-list items
  std::vector<int> turns;                     ///< grocery: filler turns (odd)
  std::int64_t length = 0;                    ///< grocery: document length (tokens)
};

struct EvalConfig {
  std::string source;  ///< where it came from (messages)
  std::string name;
  std::string model;
  std::string text = "data/kjv-heldout.txt";
  std::uint64_t seed = 1;
  int chunk = 16;
  bool anchors = false;
  std::vector<PolicyEntry> policies;
  std::vector<int> budgets;
  bool budgets_in_bytes = false;  ///< the grid's "budget_bytes" instead of "budgets"
  std::vector<TaskConfig> tasks;
};

/// The passkey prompt template's fixed tokens (BOS, intro, key statement, question), i.e. the
/// shortest passkey document (no filler).
[[nodiscard]] std::int64_t passkey_template_tokens();
/// The grocery template's fixed tokens with the `items` longest groceries and `turns` empty
/// filler turns: the shortest document that fits any list.
[[nodiscard]] std::int64_t grocery_template_tokens(int items, int turns);

/// Validates and normalises a parsed config. `source` prefixes every message.
[[nodiscard]] EvalConfig parse_eval_config(const nlohmann::json& json, const std::string& source);
/// Parses config text (JSON; // and /* */ comments allowed). `source` names it in messages.
[[nodiscard]] EvalConfig parse_eval_config_text(std::string_view text, const std::string& source);
/// Reads and parses a config file: a regular file of at most 16 MiB (a FIFO or a directory is an
/// error naming the path, never a hang).
[[nodiscard]] EvalConfig load_eval_config(const std::filesystem::path& path);

/// The normalised config (every default filled in): what results record and hash.
[[nodiscard]] nlohmann::ordered_json to_json(const EvalConfig& config);
[[nodiscard]] nlohmann::ordered_json to_json(const PolicyEntry& entry);
[[nodiscard]] nlohmann::ordered_json to_json(const TaskConfig& task);

}  // namespace kvevict::eval
