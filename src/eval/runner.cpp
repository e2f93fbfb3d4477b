// Running the grid (one fork()ed child per cell, resumable) and writing its aggregate.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <kvevict/error.hpp>
#include <map>
#include <set>

#include "common/bounded_json.hpp"
#include "common/input_files.hpp"
#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "eval/machine_info.hpp"
#include "eval/sha256.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"

namespace kvevict::eval {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using OrderedJson = nlohmann::ordered_json;

constexpr int kChildFailed = 3;  // a child's exit status after an exception in its cell

// A cell's result or failure message is a few kilobytes; the output directory is the user's, but
// a file there that is not what kvevict wrote must not hang or exhaust the run.
constexpr std::uintmax_t kMaxCellFileBytes = std::uintmax_t{1} << 28;

// The file's text, or "" when it does not exist.
std::string read_file(const fs::path& path) {
  std::error_code error;
  if (!fs::exists(path, error)) return {};
  return common::read_regular_file(path, "cell file", kMaxCellFileBytes);
}

// "compactions" named the decision count before the core stopped compacting (docs/eval.md).
void upgrade_metric_names(OrderedJson& cell) {
  if (!cell.is_object() || !cell.contains("metrics") || !cell.at("metrics").is_object()) return;
  OrderedJson& metrics = cell.at("metrics");
  if (metrics.contains("compactions") && !metrics.contains("decisions")) {
    metrics["decisions"] = metrics.at("compactions");
  }
  metrics.erase("compactions");
}

// "45s", "2m10s", "1h02m".
std::string format_duration(double seconds) {
  const auto total = static_cast<std::int64_t>(std::llround(std::max(seconds, 0.0)));
  if (total < 60) return fmt::format("{}s", total);
  if (total < 3600) return fmt::format("{}m{:02}s", total / 60, total % 60);
  return fmt::format("{}h{:02}m", total / 3600, (total % 3600) / 60);
}

std::string describe_status(int status, const fs::path& failed_file) {
  if (WIFSIGNALED(status)) {
    const int signal = WTERMSIG(status);
    return fmt::format("crashed: signal {} ({})", signal, strsignal(signal));
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::string message = read_file(failed_file);
  while (!message.empty() && message.back() == '\n') message.pop_back();
  if (!message.empty()) return message;
  return fmt::format("exited with status {}", code);
}

// The child's side: run the cell and leave its result (or why it failed) in the cells directory.
[[noreturn]] void run_child(const GridContext& grid, const CellSpec& cell,
                            const fs::path& cells_dir, const GridOptions& options) {
  int code = 0;
  try {
    (void)reset_peak_rss();
    if (options.before_cell) options.before_cell(cell);
    const OrderedJson result = run_cell(grid, cell);
    write_file_atomically(cells_dir / (cell.id + ".json"), harness::dump_json(result) + "\n");
  } catch (const std::exception& error) {
    try {
      write_file_atomically(cells_dir / (cell.id + ".failed"), std::string(error.what()) + "\n");
    } catch (...) {
    }
    code = kChildFailed;
  } catch (...) {
    code = kChildFailed;
  }
  // _exit: the parent's atexit handlers and stdio buffers are not the child's to run or flush.
  _exit(code);
}

// The cells already done in `cells_dir`; throws for another grid's cells or a changed config.
std::set<std::string> done_cells(const GridRecord& record, const fs::path& cells_dir,
                                 std::size_t& foreign_ignored) {
  std::map<std::string, const CellSpec*> by_id;
  for (const CellSpec& cell : record.cells) by_id[cell.id] = &cell;
  std::set<std::string> done;
  foreign_ignored = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(cells_dir)) {
    const fs::path& path = entry.path();
    if (path.extension() == ".tmp") {  // a child killed while writing
      std::error_code error;
      fs::remove(path, error);
      continue;
    }
    if (path.extension() != ".json") continue;
    const OrderedJson cell = read_cell_file(path);
    const std::string cell_grid = cell.is_object() ? cell.value("grid", "") : "";
    if (cell_grid != record.config.name) {
      throw Error(fmt::format(
          "output directory '{}' holds cells of another grid ('{}' in {}), not of '{}': choose "
          "another --out or pass --fresh to discard them",
          cells_dir.parent_path().string(), cell_grid, path.filename().string(),
          record.config.name));
    }
    const std::string id = path.stem().string();
    const auto found = by_id.find(id);
    if (found == by_id.end()) {
      ++foreign_ignored;  // a cell of this grid's name no longer in the config, or another shard's
      continue;
    }
    const std::string expected = cell_hash(record, *found->second);
    if (cell.value("cell_hash", "") != expected) {
      throw Error(fmt::format(
          "cell '{}' in '{}' was computed with a different configuration (model, text, seed, "
          "chunk, anchors, policy or task changed; recorded config hash {}, now {}): pass --fresh "
          "to discard the old results, or use another --out",
          id, cells_dir.string(), cell.value("cell_hash", "none"), expected));
    }
    done.insert(id);
  }
  return done;
}

// Cells of the aggregate sharing a task variant with a `full` cell get the KV reductions.
void add_reductions(OrderedJson& cells) {
  std::map<std::string, const OrderedJson*> full;
  const auto key = [](const OrderedJson& cell) {
    return fmt::format("{}|{}", cell.at("task_index").get<std::size_t>(),
                       cell.at("variant").dump());
  };
  for (const OrderedJson& cell : cells) {
    if (cell.at("policy") == "full") full.emplace(key(cell), &cell);
  }
  for (OrderedJson& cell : cells) {
    const auto found = full.find(key(cell));
    if (found == full.end()) continue;
    const OrderedJson& reference = found->second->at("metrics");
    OrderedJson& metrics = cell.at("metrics");
    for (const auto& [name, source] : {std::pair{"kv_reduction_vs_full", "live_kv_bytes"},
                                       std::pair{"peak_kv_reduction_vs_full", "peak_kv_bytes"}}) {
      const double base = reference.value(source, 0.0);
      metrics[name] =
          base > 0 ? OrderedJson(1.0 - metrics.value(source, 0.0) / base) : OrderedJson(nullptr);
    }
  }
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

std::string csv_value(const OrderedJson& value) {
  if (value.is_null()) return "";
  if (value.is_string()) return csv_field(value.get<std::string>());
  return csv_field(value.dump());
}

// The metric columns every plotting script can count on, in this order; others follow sorted.
const std::vector<std::string>& known_metric_columns() {
  static const std::vector<std::string> columns = {"bits_per_byte",
                                                   "perplexity",
                                                   "tokens_scored",
                                                   "bytes_scored",
                                                   "per_digit",
                                                   "item_recall",
                                                   "exact",
                                                   "documents",
                                                   "wall_seconds",
                                                   "tokens_fed",
                                                   "tokens_per_second",
                                                   "rss_bytes",
                                                   "peak_rss_bytes",
                                                   "live_kv_bytes",
                                                   "peak_kv_bytes",
                                                   "kv_reduction_vs_full",
                                                   "peak_kv_reduction_vs_full",
                                                   "evicted_slots",
                                                   "decisions",
                                                   "catalyst_runs",
                                                   "forwards",
                                                   "forward_seconds",
                                                   "eviction_seconds",
                                                   "eviction_seconds_per_token",
                                                   "head_seconds",
                                                   "attention_seconds",
                                                   "mlp_seconds",
                                                   "policy_seconds",
                                                   "reposition_seconds",
                                                   "catalyst_seconds"};
  return columns;
}

// A Markdown table: rows and columns in first-seen order (columns sorted by `column_order`), each
// entry the mean of the values given for it.
class Table {
 public:
  Table(std::string title, std::string row_header, int digits)
      : title_(std::move(title)), row_header_(std::move(row_header)), digits_(digits) {}

  void add(const std::string& row, const std::string& column, double column_order, double value) {
    if (std::find(rows_.begin(), rows_.end(), row) == rows_.end()) rows_.push_back(row);
    columns_.emplace(column_order, column);
    Entry& entry = entries_[{row, column}];
    if (std::isfinite(value)) {
      entry.sum += value;
      ++entry.count;
    }
    ++entry.cells;
  }

  [[nodiscard]] std::string render() const {
    if (rows_.empty()) return {};
    std::vector<std::string> columns;
    for (const auto& [order, column] : columns_) {
      if (std::find(columns.begin(), columns.end(), column) == columns.end())
        columns.push_back(column);
    }
    std::string out = "### " + title_ + "\n\n| " + row_header_ + " |";
    for (const std::string& column : columns) out += " " + column + " |";
    out += "\n|---|";
    for (std::size_t c = 0; c < columns.size(); ++c) out += "---:|";
    out += "\n";
    for (const std::string& row : rows_) {
      out += "| " + row + " |";
      for (const std::string& column : columns) {
        const auto found = entries_.find({row, column});
        if (found == entries_.end() || found->second.count == 0) {
          out += "  |";
        } else {
          out += fmt::format(" {:.{}f} |", found->second.sum / found->second.count, digits_);
        }
      }
      out += "\n";
    }
    return out + "\n";
  }

 private:
  struct Entry {
    double sum = 0;
    int count = 0;
    int cells = 0;
  };
  std::string title_;
  std::string row_header_;
  int digits_;
  std::vector<std::string> rows_;
  std::multimap<double, std::string> columns_;
  std::map<std::pair<std::string, std::string>, Entry> entries_;
};

double metric(const OrderedJson& cell, const char* name) {
  const OrderedJson& metrics = cell.at("metrics");
  return metrics.contains(name) && metrics.at(name).is_number() ? metrics.at(name).get<double>()
                                                                : std::nan("");
}

}  // namespace

OrderedJson read_cell_file(const fs::path& path) {
  OrderedJson cell;
  try {
    cell = common::parse_json_bounded<OrderedJson>(read_file(path),
                                                   fmt::format("cell file '{}'", path.string()));
  } catch (const OrderedJson::exception& error) {
    throw Error(
        fmt::format("cell file '{}' is not valid JSON ({}): delete it, or run again with "
                    "--fresh",
                    path.string(), error.what()));
  }
  upgrade_metric_names(cell);
  return cell;
}

fs::path prepare_cells_directory(const fs::path& out, bool fresh) {
  const fs::path cells_dir = out / "cells";
  std::error_code error;
  if (fresh) {
    fs::remove_all(cells_dir, error);
    for (const char* name : {"results.json", "results.csv", "results.md"}) {
      fs::remove(out / name, error);
    }
  }
  fs::create_directories(cells_dir, error);
  if (error || !fs::is_directory(cells_dir)) {
    throw Error(fmt::format("cannot create the output directory '{}'", cells_dir.string()));
  }
  return cells_dir;
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  fs::path temporary = path;
  temporary += ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error(fmt::format("cannot write '{}'", temporary.string()));
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  if (error) {
    fs::remove(temporary, error);
    throw Error(fmt::format("cannot move '{}' into place", path.string()));
  }
}

GridSummary run_grid(const GridContext& grid, const GridOptions& options) {
  if (options.jobs < 1) throw Error(fmt::format("--jobs must be at least 1, got {}", options.jobs));
  if (options.out.empty()) throw Error("no output directory given");
  const fs::path cells_dir = prepare_cells_directory(options.out, options.fresh);
  std::error_code error;
  std::size_t foreign = 0;
  const GridRecord record = grid_record(grid, options.shard);
  const std::set<std::string> done = done_cells(record, cells_dir, foreign);

  GridSummary summary;
  summary.cells = record.cells.size();
  std::vector<const CellSpec*> pending;
  for (const CellSpec& cell : record.cells) {
    if (done.count(cell.id) != 0) {
      ++summary.resumed;
    } else {
      pending.push_back(&cell);
    }
  }
  std::ostream* progress = options.progress;
  if (progress != nullptr) {
    *progress << fmt::format("eval {}{}: {} cells, {} done already, {} to run with {} job{}{}\n",
                             grid.config.name,
                             options.shard ? fmt::format(" shard {} of {} cells",
                                                         options.shard->text(), grid.cells.size())
                                           : std::string(),
                             summary.cells, summary.resumed, pending.size(), options.jobs,
                             options.jobs == 1 ? "" : "s",
                             foreign > 0
                                 ? fmt::format(" ({} cells of an older config ignored)", foreign)
                                 : std::string())
              << std::flush;
  }

  struct Running {
    const CellSpec* cell;
    Clock::time_point start;
  };
  std::map<pid_t, Running> running;
  std::size_t next = 0;
  std::size_t finished = 0;
  double finished_seconds = 0;
  while (next < pending.size() || !running.empty()) {
    while (next < pending.size() && static_cast<int>(running.size()) < options.jobs) {
      const CellSpec& cell = *pending[next++];
      fs::remove(cells_dir / (cell.id + ".failed"), error);
      std::cout.flush();
      std::cerr.flush();
      if (progress != nullptr) progress->flush();
      const pid_t pid = fork();
      if (pid < 0) throw Error(fmt::format("fork failed: {}", std::strerror(errno)));
      if (pid == 0) run_child(grid, cell, cells_dir, options);
      running.emplace(pid, Running{&cell, Clock::now()});
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("waitpid failed: {}", std::strerror(errno)));
    }
    const auto found = running.find(pid);
    if (found == running.end()) continue;  // not one of ours
    const CellSpec& cell = *found->second.cell;
    const double seconds =
        std::chrono::duration<double>(Clock::now() - found->second.start).count();
    running.erase(found);
    ++finished;
    finished_seconds += seconds;
    const fs::path result_file = cells_dir / (cell.id + ".json");
    std::string outcome;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && fs::exists(result_file)) {
      ++summary.run;
      try {
        outcome = headline(read_cell_file(result_file)).text;
      } catch (const std::exception& parse_error) {
        outcome = fmt::format("(unreadable result: {})", parse_error.what());
      }
    } else {
      const std::string why = describe_status(status, cells_dir / (cell.id + ".failed"));
      summary.failures.push_back(cell.id + ": " + why);
      outcome = "FAILED: " + why;
    }
    if (progress != nullptr) {
      const std::size_t remaining = pending.size() - finished;
      const double eta =
          finished_seconds / static_cast<double>(finished) * static_cast<double>(remaining) /
          static_cast<double>(std::max<std::size_t>(
              1, std::min<std::size_t>(remaining, static_cast<std::size_t>(options.jobs))));
      *progress << fmt::format("[{}/{}] {}: {} ({:.1f} s{})\n", summary.resumed + finished,
                               summary.cells, cell.describe(grid.config), outcome, seconds,
                               remaining > 0 ? ", eta " + format_duration(eta) : std::string())
                << std::flush;
    }
  }
  write_results(record, options.out);
  return summary;
}

OrderedJson aggregate_json(const GridRecord& record, const fs::path& out) {
  const EvalConfig& config = record.config;
  OrderedJson json;
  json["name"] = config.name;
  json["config"] = to_json(config);
  json["config_sha256"] = record.config_sha256;
  if (record.shard) {
    json["shard"] = {{"index", record.shard->index}, {"count", record.shard->count}};
  }
  json["model"] = record.model;
  json["text"] = record.text;
  json["engine"] = record.engine;
  json["git_revision"] = git_revision();
  json["machine"] = machine_json();
  OrderedJson cells = OrderedJson::array();
  OrderedJson missing = OrderedJson::array();
  for (const CellSpec& cell : record.cells) {
    const fs::path file = out / "cells" / (cell.id + ".json");
    std::error_code error;
    if (!fs::exists(file, error)) {
      std::string why = read_file(out / "cells" / (cell.id + ".failed"));
      while (!why.empty() && why.back() == '\n') why.pop_back();
      missing.push_back(
          {{"id", cell.id}, {"failed", why.empty() ? OrderedJson(nullptr) : OrderedJson(why)}});
      continue;
    }
    OrderedJson result = read_cell_file(file);
    result["label"] = config.policies[cell.policy_index].label;  // labels are not hashed
    cells.push_back(std::move(result));
  }
  add_reductions(cells);
  json["cells"] = std::move(cells);
  json["missing"] = std::move(missing);
  return json;
}

std::string results_csv(const OrderedJson& aggregate) {
  std::vector<std::string> metric_columns = known_metric_columns();
  std::set<std::string> extra;
  for (const OrderedJson& cell : aggregate.at("cells")) {
    for (const auto& [name, value] : cell.at("metrics").items()) {
      if (std::find(metric_columns.begin(), metric_columns.end(), name) == metric_columns.end()) {
        extra.insert(name);
      }
    }
  }
  metric_columns.insert(metric_columns.end(), extra.begin(), extra.end());
  const std::vector<std::string> id_columns = {"id",     "task",   "task_index", "policy", "label",
                                               "budget", "length", "depth",      "turns"};
  std::string out;
  for (const std::string& column : id_columns) out += column + ",";
  for (const std::string& column : metric_columns) out += column + ",";
  out.back() = '\n';
  for (const OrderedJson& cell : aggregate.at("cells")) {
    const OrderedJson& variant = cell.at("variant");
    std::string row;
    for (const std::string& column : id_columns) {
      if (column == "length" || column == "depth" || column == "turns") {
        row += (variant.contains(column) ? csv_value(variant.at(column)) : std::string()) + ",";
      } else {
        row += csv_value(cell.at(column)) + ",";
      }
    }
    const OrderedJson& metrics = cell.at("metrics");
    for (const std::string& column : metric_columns) {
      row += (metrics.contains(column) ? csv_value(metrics.at(column)) : std::string()) + ",";
    }
    row.back() = '\n';
    out += row;
  }
  return out;
}

std::string results_markdown(const GridRecord& record, const OrderedJson& aggregate) {
  const EvalConfig& config = record.config;
  std::string out = fmt::format(
      "# {}\n\nModel `{}` (sha256 `{}`), text `{}`, seed {}, chunk {}{}, "
      "git `{}`. Generated by {}; every cell's details are in "
      "results.json.\n\n",
      config.name, config.model, record.model.value("sha256", "").substr(0, 16), config.text,
      config.seed, config.chunk, config.anchors ? ", <AC> anchors inserted" : "", git_revision(),
      record.engine == kReferenceEngine
          ? std::string("`kvevict eval`")
          : fmt::format("`kvevict-llama eval` (engine {})", record.engine));
  // Byte budgets read "256 KiB" (or "1000 B"), token budgets "64".
  const auto budget_column = [](const OrderedJson& cell) {
    if (cell.at("budget").is_null()) return std::pair<std::string, double>{"-", -1.0};
    const int budget = cell.at("budget").get<int>();
    if (cell.value("budget_unit", "") != "bytes") {
      return std::pair<std::string, double>{fmt::format("{}", budget), budget};
    }
    return std::pair<std::string, double>{
        budget % 1024 == 0 ? fmt::format("{} KiB", budget / 1024) : fmt::format("{} B", budget),
        budget};
  };
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskConfig& task = config.tasks[t];
    std::vector<Table> tables;
    std::map<int, std::size_t> grocery_tables;  // turns -> table
    switch (task.kind) {
      case TaskKind::stream_bpb:
        tables.emplace_back(fmt::format("Task {}: stream_bpb, {} tokens: bits per byte by budget "
                                        "(lower is better)",
                                        t, task.tokens),
                            "policy", 4);
        break;
      case TaskKind::passkey:
        tables.emplace_back(fmt::format("Task {}: passkey, {} documents per cell: per-digit "
                                        "accuracy by length (mean over depths {})",
                                        t, task.documents, nlohmann::json(task.depths).dump()),
                            "policy @ budget", 3);
        tables.emplace_back(fmt::format("Task {}: passkey: per-digit accuracy by depth (mean over "
                                        "lengths)",
                                        t),
                            "policy @ budget", 3);
        break;
      case TaskKind::grocery:
        for (const int turns : task.turns) {
          grocery_tables[turns] = tables.size();
          tables.emplace_back(fmt::format("Task {}: grocery, {} items, {} turns, length {}: item "
                                          "recall by budget",
                                          t, task.items, turns, task.length),
                              "policy", 3);
        }
        break;
      case TaskKind::cost:
        tables.emplace_back(
            fmt::format("Task {}: cost, {} tokens: tokens/s by budget", t, task.tokens), "policy",
            0);
        tables.emplace_back(fmt::format("Task {}: cost: peak RSS (MiB) by budget", t), "policy", 1);
        tables.emplace_back(fmt::format("Task {}: cost: peak KV (KiB) by budget", t), "policy", 1);
        break;
    }
    for (const OrderedJson& cell : aggregate.at("cells")) {
      if (cell.at("task_index").get<std::size_t>() != t) continue;
      const std::string label = cell.at("label").get<std::string>();
      const auto [budget, budget_order] = budget_column(cell);
      switch (task.kind) {
        case TaskKind::stream_bpb:
          tables[0].add(label, budget, budget_order, metric(cell, "bits_per_byte"));
          break;
        case TaskKind::passkey: {
          const std::string row = budget == "-" ? label : label + " @ " + budget;
          const OrderedJson& variant = cell.at("variant");
          const auto length = variant.at("length").get<std::int64_t>();
          const auto depth = variant.at("depth").get<double>();
          tables[0].add(row, std::to_string(length), static_cast<double>(length),
                        metric(cell, "per_digit"));
          tables[1].add(row, fmt::format("{}", depth), depth, metric(cell, "per_digit"));
          break;
        }
        case TaskKind::grocery:
          tables[grocery_tables.at(cell.at("variant").at("turns").get<int>())].add(
              label, budget, budget_order, metric(cell, "item_recall"));
          break;
        case TaskKind::cost:
          tables[0].add(label, budget, budget_order, metric(cell, "tokens_per_second"));
          tables[1].add(label, budget, budget_order,
                        metric(cell, "peak_rss_bytes") / (1024.0 * 1024.0));
          tables[2].add(label, budget, budget_order, metric(cell, "peak_kv_bytes") / 1024.0);
          break;
      }
    }
    for (const Table& table : tables) out += table.render();
  }
  if (!aggregate.at("missing").empty()) {
    out += fmt::format("{} cells have no result yet (see \"missing\" in results.json).\n",
                       aggregate.at("missing").size());
  }
  return out;
}

void write_results(const GridRecord& record, const fs::path& out, const OrderedJson& extra) {
  OrderedJson aggregate = aggregate_json(record, out);
  if (!extra.empty()) {
    // Before the cells, which make the bulk of the file.
    OrderedJson ordered;
    for (const auto& [key, value] : aggregate.items()) {
      if (key == "cells") ordered.update(extra);
      ordered[key] = value;
    }
    aggregate = std::move(ordered);
  }
  write_file_atomically(out / "results.json", harness::dump_json(aggregate) + "\n");
  write_file_atomically(out / "results.csv", results_csv(aggregate));
  write_file_atomically(out / "results.md", results_markdown(record, aggregate));
}

fs::path default_output_root() { return fs::path(KVEVICT_BUILD_DIR) / "eval-results"; }

fs::path output_directory(const fs::path& out, bool committed, std::string_view grid_name) {
  if (committed && !out.empty()) {
    throw Error(fmt::format("--out {} and --committed ({}/{}): give one", out.string(),
                            kCommittedResults, grid_name));
  }
  if (!out.empty()) return out;
  if (committed) return fs::path(kCommittedResults) / grid_name;
  const fs::path root = default_output_root();
  std::error_code error;
  if (!fs::is_directory(root.parent_path(), error)) {
    throw Error(fmt::format(
        "no --out given, and the build tree of the default output ({}) is gone: give --out DIR "
        "(or --committed for {}/{})",
        root.string(), kCommittedResults, grid_name));
  }
  return root / grid_name;
}

bool run_eval_command(const EvalCommand& command, const EngineLoader& load, std::ostream& out,
                      std::ostream& progress) {
  if (command.jobs < 1) throw Error(fmt::format("--jobs must be at least 1, got {}", command.jobs));
  harness::check_threads(command.threads);
  std::optional<ShardSpec> shard;
  if (!command.shard.empty()) shard = parse_shard(command.shard);
  EvalConfig config = load_eval_config(command.config);
  if (!command.model.empty()) config.model = command.model;
  if (!command.text.empty()) config.text = command.text;
  if (command.adjust) command.adjust(config);
  if (command.list) {
    std::vector<CellSpec> cells = enumerate_cells(config);
    if (shard) cells = shard_cells(cells, *shard);
    for (const CellSpec& cell : cells) out << cell.id << "  " << cell.describe(config) << "\n";
    out << cells.size() << " cells\n" << std::flush;
    if (!out) throw Error("error while writing to stdout");
    return true;
  }
  GridContext grid = prepare_grid(std::move(config), load);
  grid.threads = command.threads;
  GridOptions options;
  options.out = output_directory(command.out, command.committed, grid.config.name);
  options.jobs = command.jobs;
  options.fresh = command.fresh;
  options.shard = shard;
  options.progress = &progress;
  const GridSummary summary = run_grid(grid, options);
  std::string report = fmt::format("cells    {} (run {}, resumed {}, failed {})\n", summary.cells,
                                   summary.run, summary.resumed, summary.failures.size());
  for (const std::string& failure : summary.failures) report += "failed   " + failure + "\n";
  const std::string dir = options.out.string();
  report += fmt::format("results  {}/results.json, {}/results.csv, {}/results.md\n", dir, dir, dir);
  out << report << std::flush;
  if (!out) throw Error("error while writing to stdout");
  return summary.failures.empty();
}

}  // namespace kvevict::eval
