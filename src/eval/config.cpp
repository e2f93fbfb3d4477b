#include "eval/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <kvevict/allocation.hpp>
#include <kvevict/checked.hpp>
#include <kvevict/error.hpp>
#include <kvevict/kv_type.hpp>
#include <kvevict/policy_registry.hpp>
#include <limits>
#include <set>

#include "common/bounded_json.hpp"
#include "common/input_files.hpp"
#include "eval/documents.hpp"

namespace kvevict::eval {
namespace {

using Json = nlohmann::json;

// Reads one JSON object, naming `path` (e.g. "tasks[1]") in every message.
class ObjectReader {
 public:
  ObjectReader(const Json& json, std::string source, std::string path,
               std::initializer_list<std::string_view> known)
      : json_(json), source_(std::move(source)), path_(std::move(path)) {
    if (!json_.is_object()) fail(path_, fmt::format("expected an object, got {}", describe(json_)));
    for (const auto& [key, value] : json_.items()) {
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::string list;
        for (const std::string_view name : known)
          list += (list.empty() ? "" : ", ") + std::string(name);
        fail(child(key), fmt::format("unknown key (known keys here: {})", list));
      }
    }
  }

  [[nodiscard]] bool has(const std::string& key) const { return json_.contains(key); }
  [[nodiscard]] std::string child(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }

  [[noreturn]] void fail(const std::string& path, const std::string& message) const {
    throw Error(fmt::format("{}: {}: {}", source_, path.empty() ? "(top level)" : path, message));
  }

  static std::string describe(const Json& value) {
    return fmt::format("{} {}", value.type_name(), common::json_preview(value));
  }

  std::string string(const std::string& key, std::optional<std::string> fallback) const {
    if (!has(key)) {
      if (!fallback) fail(child(key), "required");
      return *fallback;
    }
    const Json& value = json_.at(key);
    if (!value.is_string())
      fail(child(key), fmt::format("expected a string, got {}", describe(value)));
    return value.get<std::string>();
  }

  std::int64_t integer_at(const Json& value, const std::string& path, std::int64_t min,
                          std::int64_t max) const {
    if (!value.is_number_integer()) {
      fail(path, fmt::format("expected an integer, got {}", describe(value)));
    }
    if (value.is_number_unsigned() &&
        value.get<std::uint64_t>() > static_cast<std::uint64_t>(max)) {
      fail(path, fmt::format("must be in [{}, {}], got {}", min, max, value.get<std::uint64_t>()));
    }
    const auto number = value.get<std::int64_t>();
    if (number < min || number > max) {
      fail(path, fmt::format("must be in [{}, {}], got {}", min, max, number));
    }
    return number;
  }

  std::int64_t integer(const std::string& key, std::optional<std::int64_t> fallback,
                       std::int64_t min, std::int64_t max) const {
    if (!has(key)) {
      if (!fallback) fail(child(key), "required");
      return *fallback;
    }
    return integer_at(json_.at(key), child(key), min, max);
  }

  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const Json& value = json_.at(key);
    if (!value.is_boolean())
      fail(child(key), fmt::format("expected true or false, got {}", describe(value)));
    return value.get<bool>();
  }

  const Json& array(const std::string& key, bool allow_empty) const {
    const Json& value = json_.at(key);
    if (!value.is_array())
      fail(child(key), fmt::format("expected an array, got {}", describe(value)));
    if (!allow_empty && value.empty()) fail(child(key), "must not be empty");
    return value;
  }

  std::vector<std::int64_t> integers(const std::string& key, bool allow_empty, std::int64_t min,
                                     std::int64_t max) const {
    const Json& values = array(key, allow_empty);
    std::vector<std::int64_t> out;
    for (std::size_t i = 0; i < values.size(); ++i) {
      out.push_back(integer_at(values[i], fmt::format("{}[{}]", child(key), i), min, max));
    }
    return out;
  }

  std::vector<double> numbers(const std::string& key, double min, double max) const {
    const Json& values = array(key, false);
    std::vector<double> out;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const std::string path = fmt::format("{}[{}]", child(key), i);
      if (!values[i].is_number())
        fail(path, fmt::format("expected a number, got {}", describe(values[i])));
      const double number = values[i].get<double>();
      if (!(number >= min && number <= max))
        fail(path, fmt::format("must be in [{}, {}], got {}", min, max, number));
      out.push_back(number);
    }
    return out;
  }

  std::vector<std::string> strings(const std::string& key) const {
    const Json& values = array(key, true);
    std::vector<std::string> out;
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!values[i].is_string()) {
        fail(fmt::format("{}[{}]", child(key), i),
             fmt::format("expected a string, got {}", describe(values[i])));
      }
      out.push_back(values[i].get<std::string>());
    }
    return out;
  }

  template <class T>
  void require_distinct(const std::string& key, const std::vector<T>& values) const {
    std::vector<T> sorted = values;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      fail(child(key), "holds a value twice");
    }
  }

  [[nodiscard]] const std::string& source() const { return source_; }
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  const Json& json_;
  std::string source_;
  std::string path_;
};

// Limits on what a grid may ask for (docs/reliability.md says why each is what it is). A config
// is a few hundred bytes; these keep it from asking for memory or cells out of proportion to
// anything it could mean, and are checked before anything is sized from it.
constexpr std::int64_t kMaxStreamTokens = std::int64_t{1} << 32;    // stream_bpb, cost tokens
constexpr std::int64_t kMaxDocumentTokens = std::int64_t{1} << 20;  // passkey, grocery lengths
constexpr int kMaxBudget = 1 << 20;
// A byte budget of 1 GiB is 512K tokens per head of the smallest model here: far past any grid.
constexpr int kMaxBudgetBytes = 1 << 30;
constexpr int kMaxChunk = 4096;
constexpr int kMaxTurns = (1 << 16) - 1;
constexpr int kMaxDocuments = 100000;
constexpr std::int64_t kMaxCells = std::int64_t{1} << 16;
// Eval configs are hand-written grids of a few kilobytes.
constexpr std::uintmax_t kMaxConfigBytes = std::uintmax_t{1} << 24;

std::string default_label(const PolicyEntry& entry) {
  std::string label = entry.policy;
  if (entry.sinks) label += fmt::format(" sinks={}", *entry.sinks);
  for (const std::string& param : entry.params) label += " " + param;
  if (!entry.positions.empty()) label += " positions=" + entry.positions;
  if (!entry.granularity.empty()) label += " granularity=" + entry.granularity;
  if (entry.keys != "post_rope") label += " keys=" + entry.keys;
  if (entry.kv_type != "f32") label += " kv=" + entry.kv_type;
  if (entry.allocation != "uniform") label += " allocation=" + entry.allocation;
  return label;
}

// The entry at `path`, once per K/V type: its own "kv_type", or each of the grid's `kv_types`
// (labels of the non-f32 ones get " kv=TYPE").
std::vector<PolicyEntry> parse_policy(const Json& json, const std::string& source,
                                      const std::string& path, const std::vector<int>& grid_budgets,
                                      bool grid_budgets_in_bytes, int chunk,
                                      const std::vector<std::string>& kv_types) {
  const ObjectReader reader(
      json, source, path,
      {"policy", "label", "sinks", "params", "positions", "granularity", "keys", "kv_type",
       "catalyst", "budgets", "budget_bytes", "allocation"});
  PolicyEntry entry;
  entry.policy = reader.string("policy", std::nullopt);
  const std::vector<std::string_view> names = policy_names();
  if (std::find(names.begin(), names.end(), entry.policy) == names.end()) {
    reader.fail(reader.child("policy"),
                fmt::format("unknown policy '{}' (known: {})", entry.policy, policy_list()));
  }
  if (reader.has("sinks"))
    entry.sinks = static_cast<int>(reader.integer("sinks", std::nullopt, 0, kMaxBudget));
  if (reader.has("params")) entry.params = reader.strings("params");
  entry.positions = reader.string("positions", std::string());
  entry.granularity = reader.string("granularity", std::string());
  entry.keys = reader.string("keys", std::string("post_rope"));
  if (reader.has("kv_type")) entry.kv_type = reader.string("kv_type", std::nullopt);
  if (reader.has("catalyst")) entry.catalyst = reader.string("catalyst", std::nullopt);
  entry.allocation = reader.string("allocation", std::string("uniform"));
  try {
    (void)parse_allocation(entry.allocation);
  } catch (const Error& error) {
    reader.fail(reader.child("allocation"), error.what());
  }
  if (reader.has("budgets") && reader.has("budget_bytes")) {
    reader.fail(reader.child("budget_bytes"),
                "give \"budgets\" (tokens) or \"budget_bytes\" (bytes), not both");
  }
  const char* own_key = reader.has("budget_bytes") ? "budget_bytes" : "budgets";
  if (entry.policy == "full") {
    if (reader.has(own_key) && !reader.array(own_key, true).empty()) {
      reader.fail(reader.child(own_key), "policy 'full' has no budget");
    }
  } else if (reader.has(own_key)) {
    entry.budgets_in_bytes = reader.has("budget_bytes");
    for (const std::int64_t budget :
         reader.integers(own_key, true, 1, entry.budgets_in_bytes ? kMaxBudgetBytes : kMaxBudget)) {
      entry.budgets.push_back(static_cast<int>(budget));
    }
    reader.require_distinct(own_key, entry.budgets);
  } else {
    entry.budgets = grid_budgets;
    entry.budgets_in_bytes = grid_budgets_in_bytes;
  }
  entry.label = reader.string("label", default_label(entry));
  if (entry.label.empty()) reader.fail(reader.child("label"), "must not be empty");
  std::vector<PolicyEntry> entries;
  for (const std::string& kv_type :
       reader.has("kv_type") ? std::vector<std::string>{reader.string("kv_type", std::nullopt)}
                             : kv_types) {
    PolicyEntry typed = entry;
    typed.kv_type = kv_type;
    if (!reader.has("kv_type") && kv_type != "f32") typed.label += " kv=" + kv_type;
    entries.push_back(std::move(typed));
  }
  // Everything the CLI would check before loading a model, at every budget of the entry.
  std::vector<std::optional<int>> budgets;
  for (const int budget : entry.budgets) budgets.emplace_back(budget);
  if (budgets.empty()) budgets.emplace_back(std::nullopt);
  for (const PolicyEntry& typed : entries) {
    for (const std::optional<int> budget : budgets) {
      try {
        harness::validate_policy_options(typed.options(budget, chunk));
      } catch (const Error& error) {
        reader.fail(path, fmt::format("policy '{}'{}: {}", typed.policy,
                                      budget ? " at " + typed.budget_text(*budget) : std::string(),
                                      error.what()));
      }
    }
  }
  return entries;
}

// A policy without a budget keeps every token, so its cache grows with the stream: such a grid is
// held to the document limit.
void require_bounded_cache(const ObjectReader& reader, std::int64_t tokens,
                           const std::vector<PolicyEntry>& policies) {
  if (tokens <= kMaxDocumentTokens) return;
  for (const PolicyEntry& policy : policies) {
    if (policy.bounded()) continue;
    reader.fail(reader.child("tokens"),
                fmt::format("{} tokens, but policy '{}' has no budget and would keep every one; "
                            "without a budget the limit is {} tokens",
                            tokens, policy.label, kMaxDocumentTokens));
  }
}

// The grid's cells, counted before anything enumerates them (enumerate_cells in cells.cpp): an
// upper bound where passkey lengths are multiples of every budget (unbudgeted policies).
void require_cells_within_limit(const EvalConfig& config) {
  std::set<int> all_budgets;
  for (const PolicyEntry& entry : config.policies) {
    all_budgets.insert(entry.budgets.begin(), entry.budgets.end());
  }
  const std::string what = fmt::format(
      "{}: the grid's cells (tasks x policies x budgets x task variants)", config.source);
  const auto count = [](std::size_t size) { return static_cast<std::int64_t>(size); };
  std::int64_t cells = 0;
  for (const TaskConfig& task : config.tasks) {
    for (const PolicyEntry& entry : config.policies) {
      std::int64_t variants = 1;
      if (task.kind == TaskKind::passkey) {
        const std::int64_t lengths =
            !task.lengths.empty() ? count(task.lengths.size())
            : entry.bounded()
                ? count(task.length_x_budget.size())
                : checked_product({count(task.length_x_budget.size()), count(all_budgets.size())},
                                  what, kMaxCells);
        variants = checked_product({lengths, count(task.depths.size())}, what, kMaxCells);
      } else if (task.kind == TaskKind::grocery) {
        variants = count(task.turns.size());
      }
      const std::int64_t budgets = std::max<std::int64_t>(1, count(entry.budgets.size()));
      cells = checked_sum({cells, checked_product({budgets, variants}, what, kMaxCells)}, what,
                          kMaxCells);
    }
  }
}

TaskConfig parse_task(const Json& json, const std::string& source, const std::string& path,
                      const std::vector<PolicyEntry>& policies) {
  if (!json.is_object() || !json.contains("task") || !json.at("task").is_string()) {
    throw Error(
        fmt::format("{}: {}: expected an object with \"task\": one of stream_bpb, passkey, "
                    "grocery, cost",
                    source, path));
  }
  const std::string kind = json.at("task").get<std::string>();
  TaskConfig task;
  if (kind == "stream_bpb") {
    const ObjectReader reader(json, source, path, {"task", "tokens", "window", "turn_separator"});
    task.kind = TaskKind::stream_bpb;
    task.tokens = reader.integer("tokens", 4096, 2, kMaxStreamTokens);
    require_bounded_cache(reader, task.tokens, policies);
    task.window = static_cast<int>(reader.integer("window", 256, 1, kMaxBudget));
    task.turn_separator = reader.string("turn_separator", std::string());
  } else if (kind == "cost") {
    const ObjectReader reader(json, source, path,
                              {"task", "tokens", "checkpoints", "turn_separator"});
    task.kind = TaskKind::cost;
    task.tokens = reader.integer("tokens", std::nullopt, 1, kMaxStreamTokens);
    require_bounded_cache(reader, task.tokens, policies);
    task.turn_separator = reader.string("turn_separator", std::string());
    if (reader.has("checkpoints")) {
      task.checkpoints = reader.integers("checkpoints", false, 1, task.tokens);
      if (!std::is_sorted(task.checkpoints.begin(), task.checkpoints.end()) ||
          std::adjacent_find(task.checkpoints.begin(), task.checkpoints.end()) !=
              task.checkpoints.end()) {
        reader.fail(reader.child("checkpoints"), "must be strictly ascending");
      }
    }
    if (task.checkpoints.empty() || task.checkpoints.back() != task.tokens) {
      task.checkpoints.push_back(task.tokens);  // the end is always a checkpoint
    }
  } else if (kind == "passkey") {
    const ObjectReader reader(
        json, source, path,
        {"task", "depths", "lengths", "length_x_budget", "documents", "turn_separator"});
    task.kind = TaskKind::passkey;
    task.turn_separator = reader.string("turn_separator", std::string());
    task.depths = reader.has("depths") ? reader.numbers("depths", 0.0, 1.0)
                                       : std::vector<double>{0.1, 0.5, 0.9};
    reader.require_distinct("depths", task.depths);
    task.documents = static_cast<int>(reader.integer("documents", 20, 1, kMaxDocuments));
    if (reader.has("lengths") == reader.has("length_x_budget")) {
      reader.fail(path, "give exactly one of \"lengths\" (tokens) and \"length_x_budget\"");
    }
    const std::int64_t shortest = passkey_template_tokens();
    if (reader.has("lengths")) {
      task.lengths = reader.integers("lengths", false, 1, kMaxDocumentTokens);
      reader.require_distinct("lengths", task.lengths);
      for (std::size_t i = 0; i < task.lengths.size(); ++i) {
        if (task.lengths[i] < shortest) {
          reader.fail(fmt::format("{}[{}]", reader.child("lengths"), i),
                      fmt::format("length {} is shorter than the passkey template ({} tokens)",
                                  task.lengths[i], shortest));
        }
      }
    } else {
      task.length_x_budget = reader.integers("length_x_budget", false, 1, kMaxDocumentTokens);
      reader.require_distinct("length_x_budget", task.length_x_budget);
      // Only the extremes can fail: the shortest length is the smallest factor times the
      // smallest budget, the longest the largest times the largest.
      const auto [min_factor, max_factor] =
          std::minmax_element(task.length_x_budget.begin(), task.length_x_budget.end());
      std::optional<int> min_budget;
      std::optional<int> max_budget;
      for (const PolicyEntry& policy : policies) {
        if (policy.budgets_in_bytes && policy.bounded()) {
          reader.fail(reader.child("length_x_budget"),
                      fmt::format("policy '{}' has budgets in bytes, which are no token count to "
                                  "multiply: give \"lengths\"",
                                  policy.label));
        }
        for (const int budget : policy.budgets) {
          min_budget = std::min(budget, min_budget.value_or(budget));
          max_budget = std::max(budget, max_budget.value_or(budget));
        }
      }
      if (!min_budget) {
        reader.fail(reader.child("length_x_budget"),
                    "no policy has a budget to multiply: give \"lengths\"");
      }
      if (*min_factor * *min_budget < shortest) {
        reader.fail(reader.child("length_x_budget"),
                    fmt::format("length {} x budget {} = {} is shorter than the passkey "
                                "template ({} tokens)",
                                *min_factor, *min_budget, *min_factor * *min_budget, shortest));
      }
      if (*max_factor * *max_budget > kMaxDocumentTokens) {
        reader.fail(
            reader.child("length_x_budget"),
            fmt::format("length {} x budget {} = {} is longer than the document limit "
                        "of {} tokens",
                        *max_factor, *max_budget, *max_factor * *max_budget, kMaxDocumentTokens));
      }
    }
  } else if (kind == "grocery") {
    const ObjectReader reader(json, source, path,
                              {"task", "items", "turns", "length", "documents"});
    task.kind = TaskKind::grocery;
    task.items = static_cast<int>(
        reader.integer("items", 5, 1, static_cast<std::int64_t>(kGroceries.size())));
    for (const std::int64_t turns : reader.has("turns")
                                        ? reader.integers("turns", false, 1, kMaxTurns)
                                        : std::vector<std::int64_t>{3}) {
      if (turns % 2 == 0) {
        reader.fail(reader.child("turns"),
                    fmt::format("{} is even: the filler turns alternate Assistant / User and end "
                                "with an assistant turn, so their number is odd",
                                turns));
      }
      task.turns.push_back(static_cast<int>(turns));
    }
    reader.require_distinct("turns", task.turns);
    task.length = reader.integer("length", std::nullopt, 1, kMaxDocumentTokens);
    task.documents = static_cast<int>(reader.integer("documents", 20, 1, kMaxDocuments));
    for (const int turns : task.turns) {
      const std::int64_t shortest = grocery_template_tokens(task.items, turns);
      if (task.length < shortest) {
        reader.fail(reader.child("length"),
                    fmt::format("length {} cannot hold the grocery template with {} items and {} "
                                "turns ({} tokens)",
                                task.length, task.items, turns, shortest));
      }
    }
  } else {
    throw Error(
        fmt::format("{}: {}.task: unknown task '{}' (known: stream_bpb, passkey, grocery, "
                    "cost)",
                    source, path, kind));
  }
  return task;
}

}  // namespace

std::string_view to_string(TaskKind kind) {
  switch (kind) {
    case TaskKind::stream_bpb:
      return "stream_bpb";
    case TaskKind::passkey:
      return "passkey";
    case TaskKind::grocery:
      return "grocery";
    case TaskKind::cost:
      return "cost";
  }
  return "unknown";
}

std::string PolicyEntry::budget_text(int budget) const {
  return budgets_in_bytes ? fmt::format("budget {} bytes", budget)
                          : fmt::format("budget {}", budget);
}

harness::PolicyOptions PolicyEntry::options(std::optional<int> budget, int chunk) const {
  harness::PolicyOptions options;
  options.policy = policy;
  if (budget && budgets_in_bytes) {
    options.budget_bytes = *budget;
  } else {
    options.budget = budget;
  }
  if (sinks) {
    options.sinks = *sinks;
    options.sinks_given = true;
  }
  options.params = params;
  options.positions = positions;
  options.granularity = granularity;
  options.keys = keys;
  options.kv_type = kv_type;
  options.chunk = chunk;
  options.catalyst = catalyst;
  options.allocation = allocation;
  return options;
}

std::int64_t passkey_template_tokens() {
  const std::string key(kPasskeyDigits, '0');
  return static_cast<std::int64_t>(1 + kPasskeyIntro.size() + kPasskeyStatementPrefix.size() +
                                   key.size() + kPasskeyEcho.size() + key.size() +
                                   kPasskeyEchoSuffix.size() + kPasskeyQuestion.size() +
                                   kPasskeyAnswerPrefix.size());
}

std::int64_t grocery_template_tokens(int items, int turns) {
  std::vector<std::size_t> sizes;
  for (const std::string_view item : kGroceries) sizes.push_back(item.size());
  std::sort(sizes.rbegin(), sizes.rend());
  std::size_t list = 0;
  for (int k = 0; k < items && k < static_cast<int>(sizes.size()); ++k) {
    list += sizes[static_cast<std::size_t>(k)] + (k > 0 ? 2 : 0);  // ", " between items
  }
  std::size_t total = 1 + kGroceryListPrefix.size() + list + 1 + kTurnSeparator.size() +
                      kGroceryQuestion.size() + kTurnSeparator.size() + kGroceryAnswerPrefix.size();
  // Filler turns alternate Assistant / User from an Assistant turn (counted, not looped: a config
  // may list many turn counts).
  const auto assistant_turns = static_cast<std::size_t>(turns + 1) / 2;
  const auto user_turns = static_cast<std::size_t>(turns) / 2;
  total += assistant_turns * (kGrocerySpeakers[0].size() + kTurnSeparator.size()) +
           user_turns * (kGrocerySpeakers[1].size() + kTurnSeparator.size());
  return static_cast<std::int64_t>(total);
}

EvalConfig parse_eval_config(const nlohmann::json& json, const std::string& source) {
  const ObjectReader reader(json, source, "",
                            {"name", "model", "text", "seed", "chunk", "anchors", "policies",
                             "budgets", "budget_bytes", "kv_types", "tasks"});
  EvalConfig config;
  config.source = source;
  config.name = reader.string("name", std::nullopt);
  if (config.name.empty()) reader.fail("name", "must not be empty");
  for (const char c : config.name) {
    const bool safe = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '-' || c == '_' || c == '.';
    if (!safe) {
      reader.fail("name", fmt::format("'{}' may hold only letters, digits, '-', '_' and '.' (it "
                                      "names the output directory)",
                                      config.name));
    }
  }
  config.model = reader.string("model", std::nullopt);
  if (config.model.empty()) reader.fail("model", "must not be empty");
  config.text = reader.string("text", config.text);
  if (config.text.empty()) reader.fail("text", "must not be empty");
  config.seed = static_cast<std::uint64_t>(
      reader.integer("seed", 1, 0, std::numeric_limits<std::int64_t>::max()));
  config.chunk = static_cast<int>(reader.integer("chunk", 16, 1, kMaxChunk));
  config.anchors = reader.boolean("anchors", false);
  if (reader.has("budgets") && reader.has("budget_bytes")) {
    reader.fail("budget_bytes", "give \"budgets\" (tokens) or \"budget_bytes\" (bytes), not both");
  }
  // "budget_bytes": the grid's budgets are bytes of each sequence's keys and values, over every
  // layer and KV head in the entry's K/V type (--budget-bytes): the axis of equal memory.
  config.budgets_in_bytes = reader.has("budget_bytes");
  const char* budgets_key = config.budgets_in_bytes ? "budget_bytes" : "budgets";
  if (reader.has(budgets_key)) {
    for (const std::int64_t budget : reader.integers(
             budgets_key, true, 1, config.budgets_in_bytes ? kMaxBudgetBytes : kMaxBudget)) {
      config.budgets.push_back(static_cast<int>(budget));
    }
    reader.require_distinct(budgets_key, config.budgets);
  }
  // The K/V storage axis: every policy entry without its own "kv_type" runs once per type.
  std::vector<std::string> kv_types{"f32"};
  if (reader.has("kv_types")) {
    kv_types = reader.strings("kv_types");
    if (kv_types.empty()) reader.fail("kv_types", "must not be empty");
    reader.require_distinct("kv_types", kv_types);
    for (const std::string& kv_type : kv_types) {
      try {
        (void)parse_kv_type(kv_type);
      } catch (const Error& error) {
        reader.fail("kv_types", error.what());
      }
    }
  }
  if (!reader.has("policies")) reader.fail("policies", "required");
  const Json& policies = reader.array("policies", false);
  std::set<std::string> labels;
  for (std::size_t i = 0; i < policies.size(); ++i) {
    const std::string path = fmt::format("policies[{}]", i);
    for (PolicyEntry& entry : parse_policy(policies[i], source, path, config.budgets,
                                           config.budgets_in_bytes, config.chunk, kv_types)) {
      if (entry.policy != "full" && !policies[i].contains("budgets") &&
          !policies[i].contains("budget_bytes") && config.budgets.empty()) {
        reader.fail(path, fmt::format("policy '{}' needs a budget: give the grid's \"budgets\" "
                                      "or \"budget_bytes\", or the entry's own (\"budgets\": [] "
                                      "runs it unbounded)",
                                      entry.policy));
      }
      if (!labels.insert(entry.label).second) {
        reader.fail(path + ".label",
                    fmt::format("label '{}' is used twice: give each entry its own \"label\"",
                                entry.label));
      }
      config.policies.push_back(std::move(entry));
    }
  }
  if (!reader.has("tasks")) reader.fail("tasks", "required");
  const Json& tasks = reader.array("tasks", false);
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    config.tasks.push_back(
        parse_task(tasks[i], source, fmt::format("tasks[{}]", i), config.policies));
  }
  require_cells_within_limit(config);
  return config;
}

EvalConfig parse_eval_config_text(std::string_view text, const std::string& source) {
  Json json;
  try {
    json = common::parse_json_bounded<Json>(text, fmt::format("eval config '{}'", source),
                                            /*ignore_comments=*/true);
  } catch (const Json::exception& error) {
    throw Error(fmt::format("eval config '{}' is not valid JSON: {}", source, error.what()));
  }
  return parse_eval_config(json, source);
}

EvalConfig load_eval_config(const std::filesystem::path& path) {
  return parse_eval_config_text(common::read_regular_file(path, "eval config", kMaxConfigBytes),
                                path.string());
}

nlohmann::ordered_json to_json(const PolicyEntry& entry) {
  nlohmann::ordered_json json;
  json["policy"] = entry.policy;
  json["label"] = entry.label;
  json["sinks"] =
      entry.sinks ? nlohmann::ordered_json(*entry.sinks) : nlohmann::ordered_json(nullptr);
  json["params"] = entry.params;
  json["positions"] = entry.positions;
  // Only when given, so that configs without it keep their normalised form (and hash).
  if (!entry.granularity.empty()) json["granularity"] = entry.granularity;
  json["keys"] = entry.keys;
  // Only when not f32, so that configs without the axis keep their normalised form (and hash).
  if (entry.kv_type != "f32") json["kv_type"] = entry.kv_type;
  // Only when not uniform, so that the cells of earlier grids keep their hashes.
  if (entry.allocation != "uniform") json["allocation"] = entry.allocation;
  json["catalyst"] =
      entry.catalyst ? nlohmann::ordered_json(*entry.catalyst) : nlohmann::ordered_json(nullptr);
  // Only for bytes, so that the cells of token grids keep their hashes.
  if (entry.budgets_in_bytes) json["budget_unit"] = "bytes";
  json["budgets"] = entry.budgets;
  return json;
}

nlohmann::ordered_json to_json(const TaskConfig& task) {
  nlohmann::ordered_json json;
  json["task"] = std::string(to_string(task.kind));
  switch (task.kind) {
    case TaskKind::stream_bpb:
      json["tokens"] = task.tokens;
      json["window"] = task.window;
      json["turn_separator"] = task.turn_separator;
      break;
    case TaskKind::cost:
      json["tokens"] = task.tokens;
      json["checkpoints"] = task.checkpoints;
      json["turn_separator"] = task.turn_separator;
      break;
    case TaskKind::passkey:
      json["depths"] = task.depths;
      if (task.lengths.empty()) {
        json["length_x_budget"] = task.length_x_budget;
      } else {
        json["lengths"] = task.lengths;
      }
      json["documents"] = task.documents;
      json["turn_separator"] = task.turn_separator;
      break;
    case TaskKind::grocery:
      json["items"] = task.items;
      json["turns"] = task.turns;
      json["length"] = task.length;
      json["documents"] = task.documents;
      break;
  }
  return json;
}

nlohmann::ordered_json to_json(const EvalConfig& config) {
  nlohmann::ordered_json json;
  json["name"] = config.name;
  json["model"] = config.model;
  json["text"] = config.text;
  json["seed"] = config.seed;
  json["chunk"] = config.chunk;
  json["anchors"] = config.anchors;
  json[config.budgets_in_bytes ? "budget_bytes" : "budgets"] = config.budgets;
  json["policies"] = nlohmann::ordered_json::array();
  for (const PolicyEntry& entry : config.policies) json["policies"].push_back(to_json(entry));
  json["tasks"] = nlohmann::ordered_json::array();
  for (const TaskConfig& task : config.tasks) json["tasks"].push_back(to_json(task));
  return json;
}

}  // namespace kvevict::eval
