// Sharding a grid over machines (`kvevict eval --shard I/N`) and merging the shards' outputs
// (`kvevict eval merge`) into what one run would have written.
#include <fmt/format.h>

#include <charconv>
#include <kvevict/error.hpp>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "common/bounded_json.hpp"
#include "common/input_files.hpp"
#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "eval/sha256.hpp"
#include "harness/report.hpp"

namespace kvevict::eval {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

// results.json holds every cell's details: megabytes for the committed grids, far less than this.
constexpr std::uintmax_t kMaxResultsBytes = std::uintmax_t{1} << 30;
// Missing or duplicate cells named in one message at most.
constexpr std::size_t kListedCells = 5;

// One shard's output directory as its results.json records it.
struct ShardOutput {
  fs::path dir;
  OrderedJson results;
  GridRecord record;
};

// The normalised config (to_json) as parse_eval_config takes it: an unset optional is written as
// null there and left out here.
nlohmann::json parsable_config(const OrderedJson& normalised) {
  nlohmann::json config = normalised;
  if (config.is_object() && config.contains("policies") && config.at("policies").is_array()) {
    for (nlohmann::json& entry : config.at("policies")) {
      if (!entry.is_object()) continue;
      for (const char* key : {"sinks", "catalyst"}) {
        if (entry.contains(key) && entry.at(key).is_null()) entry.erase(key);
      }
    }
  }
  return config;
}

ShardOutput read_shard(const fs::path& dir) {
  const fs::path path = dir / "results.json";
  std::error_code error;
  if (!fs::exists(path, error)) {
    throw Error(
        fmt::format("'{}' holds no results.json: not an output directory of `kvevict eval`, "
                    "or its run was interrupted (run that shard again: it resumes)",
                    dir.string()));
  }
  const std::string source = path.string();
  ShardOutput shard{dir, {}, {}};
  try {
    shard.results = common::parse_json_bounded<OrderedJson>(
        common::read_regular_file(path, "results file", kMaxResultsBytes),
        fmt::format("results file '{}'", source));
  } catch (const OrderedJson::exception& parse_error) {
    throw Error(fmt::format("'{}' is not valid JSON: {}", source, parse_error.what()));
  }
  const OrderedJson& results = shard.results;
  for (const char* key : {"config", "config_sha256", "model", "text"}) {
    if (!results.is_object() || !results.contains(key)) {
      throw Error(
          fmt::format("'{}' has no \"{}\": not the results of `kvevict eval`", source, key));
    }
  }
  GridRecord& record = shard.record;
  record.config = parse_eval_config(parsable_config(results.at("config")), source);
  record.config_sha256 = results.value("config_sha256", "");
  if (record.config_sha256 != sha256_hex(to_json(record.config).dump())) {
    throw Error(
        fmt::format("'{}': \"config\" does not hash to its \"config_sha256\" (edited by "
                    "hand, or written by an incompatible kvevict version)",
                    source));
  }
  record.model = results.at("model");
  record.text = results.at("text");
  // Results written before kvevict-llama eval existed are kvevict's decoder's.
  const OrderedJson engine = results.value("engine", OrderedJson(kReferenceEngine));
  if (!engine.is_string()) throw Error(fmt::format("'{}': \"engine\" must be a string", source));
  record.engine = engine.get<std::string>();
  if (!record.model.is_object() || !record.model.contains("sha256") ||
      !record.model.at("sha256").is_string() || !record.text.is_object() ||
      !record.text.contains("sha256") || !record.text.at("sha256").is_string()) {
    throw Error(fmt::format("'{}': \"model\" and \"text\" must record their \"sha256\"", source));
  }
  record.cells = enumerate_cells(record.config);
  if (results.contains("shard")) {
    const OrderedJson& shard_json = results.at("shard");
    const auto number = [&](const char* key) {
      return shard_json.is_object() && shard_json.contains(key) &&
                     shard_json.at(key).is_number_integer()
                 ? shard_json.at(key).get<std::int64_t>()
                 : std::int64_t{0};
    };
    const std::int64_t index = number("index");
    const std::int64_t count = number("count");
    if (count < 1 || count > std::numeric_limits<int>::max() || index < 1 || index > count) {
      throw Error(
          fmt::format("'{}': \"shard\" must be {{\"index\": I, \"count\": N}} with 1 <= I "
                      "<= N, got {}",
                      source, common::json_preview(shard_json)));
    }
    record.shard = ShardSpec{static_cast<int>(index), static_cast<int>(count)};
    record.cells = shard_cells(record.cells, *record.shard);
  }
  return shard;
}

std::string shard_name(const ShardOutput& shard) {
  return shard.record.shard
             ? fmt::format("'{}' (shard {})", shard.dir.string(), shard.record.shard->text())
             : fmt::format("'{}' (a whole run)", shard.dir.string());
}

// Where two JSON values first differ: its path ("policies[2].params", "seed") and both values.
struct Difference {
  std::string path;
  std::string first;
  std::string second;
};
std::optional<Difference> first_difference(const OrderedJson& a, const OrderedJson& b,
                                           const std::string& path) {
  const auto differ = [&] {
    return Difference{path, common::json_preview(a), common::json_preview(b)};
  };
  if (a.type() != b.type()) return differ();
  if (a.is_object()) {
    std::set<std::string> keys;
    for (const auto& [key, value] : a.items()) keys.insert(key);
    for (const auto& [key, value] : b.items()) keys.insert(key);
    for (const std::string& key : keys) {
      const std::string child = path.empty() ? key : path + "." + key;
      if (!a.contains(key) || !b.contains(key)) {
        return Difference{child, a.contains(key) ? common::json_preview(a.at(key)) : "(absent)",
                          b.contains(key) ? common::json_preview(b.at(key)) : "(absent)"};
      }
      if (auto found = first_difference(a.at(key), b.at(key), child)) return found;
    }
    return std::nullopt;
  }
  if (a.is_array()) {
    if (a.size() != b.size()) return differ();
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (auto found = first_difference(a.at(i), b.at(i), fmt::format("{}[{}]", path, i))) {
        return found;
      }
    }
    return std::nullopt;
  }
  if (a != b) return differ();
  return std::nullopt;
}

// Throws unless `other` ran the grid `first` ran: the same name, config (apart from where the
// model and text lie: shards may run on machines that keep them elsewhere), model and text.
void require_same_grid(const ShardOutput& first, const ShardOutput& other) {
  const auto refuse = [&](const std::string& what) {
    throw Error(fmt::format("{} and {} are not shards of one grid: {}", shard_name(first),
                            shard_name(other), what));
  };
  const GridRecord& a = first.record;
  const GridRecord& b = other.record;
  if (a.config.name != b.config.name) {
    refuse(fmt::format("grid name '{}' vs '{}'", a.config.name, b.config.name));
  }
  OrderedJson config_a = to_json(a.config);
  OrderedJson config_b = to_json(b.config);
  for (const char* path_key : {"model", "text"}) {
    config_a.erase(path_key);
    config_b.erase(path_key);
  }
  if (const std::optional<Difference> difference = first_difference(config_a, config_b, "")) {
    refuse(fmt::format("the configs differ at \"{}\" ({} vs {}; config sha256 {}... vs {}...)",
                       difference->path, difference->first, difference->second,
                       a.config_sha256.substr(0, 16), b.config_sha256.substr(0, 16)));
  }
  if (a.engine != b.engine) refuse(fmt::format("engine '{}' vs '{}'", a.engine, b.engine));
  if (a.model.at("sha256") != b.model.at("sha256")) {
    refuse(fmt::format("model sha256 {} vs {}", a.model.at("sha256").get<std::string>(),
                       b.model.at("sha256").get<std::string>()));
  }
  if (a.text.at("sha256") != b.text.at("sha256")) {
    refuse(fmt::format("text sha256 {} vs {}", a.text.at("sha256").get<std::string>(),
                       b.text.at("sha256").get<std::string>()));
  }
}

std::string list_ids(const std::vector<std::string>& ids) {
  std::string text;
  for (std::size_t i = 0; i < ids.size() && i < kListedCells; ++i) {
    text += (i > 0 ? ", " : "") + ids[i];
  }
  if (ids.size() > kListedCells) text += fmt::format(" and {} more", ids.size() - kListedCells);
  return text;
}

// Shards 1..N of a count N every directory was run with that no directory holds.
std::vector<std::string> absent_shards(const std::vector<ShardOutput>& shards) {
  std::set<int> counts;
  std::set<int> indices;
  for (const ShardOutput& shard : shards) {
    counts.insert(shard.record.shard ? shard.record.shard->count : 1);
    indices.insert(shard.record.shard ? shard.record.shard->index : 1);
  }
  std::vector<std::string> absent;
  if (counts.size() != 1) return absent;
  const int count = *counts.begin();
  for (int index = 1; index <= count; ++index) {
    if (indices.count(index) == 0) absent.push_back(ShardSpec{index, count}.text());
  }
  return absent;
}

}  // namespace

std::string ShardSpec::text() const { return fmt::format("{}/{}", index, count); }

ShardSpec parse_shard(std::string_view text) {
  const auto fail = [&] {
    return Error(
        fmt::format("--shard: expected I/N, shard I of N with 1 <= I <= N (e.g. 2/8), got "
                    "'{}'",
                    text));
  };
  const std::size_t slash = text.find('/');
  if (slash == std::string_view::npos) throw fail();
  const auto number = [&](std::string_view digits, int& value) {
    const char* end = digits.data() + digits.size();
    const auto [stop, error] = std::from_chars(digits.data(), end, value);
    return !digits.empty() && error == std::errc() && stop == end;
  };
  ShardSpec shard;
  if (!number(text.substr(0, slash), shard.index) || !number(text.substr(slash + 1), shard.count) ||
      shard.count < 1 || shard.index < 1 || shard.index > shard.count) {
    throw fail();
  }
  return shard;
}

std::vector<CellSpec> shard_cells(const std::vector<CellSpec>& cells, const ShardSpec& shard) {
  std::vector<CellSpec> slice;
  for (std::size_t position = 0; position < cells.size(); ++position) {
    if (shard.holds(position)) slice.push_back(cells[position]);
  }
  return slice;
}

GridRecord grid_record(const GridContext& grid, std::optional<ShardSpec> shard) {
  GridRecord record;
  record.config = grid.config;
  record.config_sha256 = grid.config_sha256;
  record.model = {{"path", grid.config.model},
                  {"sha256", grid.model_checksum.sha256},
                  {"files", grid.model_checksum.files}};
  record.model.update(grid.engine->model_json());  // format, context_length
  record.engine = grid.engine->name();
  record.text = {
      {"path", grid.config.text}, {"sha256", grid.text_sha256}, {"bytes", grid.text.size()}};
  record.cells = shard ? shard_cells(grid.cells, *shard) : grid.cells;
  record.shard = shard;
  return record;
}

std::string cell_hash(const GridRecord& record, const CellSpec& cell) {
  return sha256_hex(cell_config_json(record.config, record.model.value("sha256", ""),
                                     record.text.value("sha256", ""), record.engine, cell)
                        .dump());
}

MergeSummary merge_shards(const MergeOptions& options) {
  if (options.shards.empty()) throw Error("eval merge: no shard directories given");
  std::vector<ShardOutput> shards;
  for (const fs::path& dir : options.shards) {
    for (const ShardOutput& earlier : shards) {
      std::error_code error;
      if (fs::equivalent(earlier.dir, dir, error)) {
        throw Error(fmt::format("shard directory '{}' is given twice", dir.string()));
      }
    }
    shards.push_back(read_shard(dir));
    require_same_grid(shards.front(), shards.back());
  }
  GridRecord merged = shards.front().record;
  merged.shard.reset();
  merged.cells = enumerate_cells(merged.config);
  const std::string& grid_name = merged.config.name;

  // Each cell's result and the shard it came from: exactly one shard's slice must hold it.
  std::map<std::string, std::pair<OrderedJson, const ShardOutput*>> found;
  std::set<std::string> revisions;
  for (const ShardOutput& shard : shards) {
    for (const CellSpec& cell : shard.record.cells) {
      const fs::path file = shard.dir / "cells" / (cell.id + ".json");
      std::error_code error;
      if (!fs::exists(file, error)) continue;
      const auto previous = found.find(cell.id);
      if (previous != found.end()) {
        throw Error(fmt::format("cell '{}' is in both {} and {}: give each shard once", cell.id,
                                shard_name(*previous->second.second), shard_name(shard)));
      }
      OrderedJson result = read_cell_file(file);
      const std::string expected = cell_hash(merged, cell);
      if (!result.is_object() || result.value("grid", "") != grid_name ||
          result.value("cell_hash", "") != expected) {
        throw Error(
            fmt::format("cell file '{}' was not computed with the config its "
                        "results.json records (grid '{}', config hash {} expected): run "
                        "that shard again with --fresh",
                        file.string(), grid_name, expected));
      }
      revisions.insert(result.value("git_revision", "unknown"));
      found.emplace(cell.id, std::pair{std::move(result), &shard});
    }
  }
  std::vector<std::string> missing;
  for (const CellSpec& cell : merged.cells) {
    if (found.count(cell.id) == 0) missing.push_back(cell.id);
  }
  if (!missing.empty()) {
    const std::vector<std::string> absent = absent_shards(shards);
    throw Error(fmt::format(
        "{} of the {} cells of grid '{}' have no result in the shard directories given: {}{}; a "
        "shard that failed cells resumes when run again",
        missing.size(), merged.cells.size(), grid_name, list_ids(missing),
        absent.empty() ? std::string()
                       : fmt::format(" (no directory holds shard {})", list_ids(absent))));
  }

  MergeSummary summary;
  summary.out = output_directory(options.out, options.committed, grid_name);
  summary.cells = merged.cells.size();
  std::error_code error;
  for (const ShardOutput& shard : shards) {
    if (fs::exists(summary.out, error) && fs::equivalent(summary.out, shard.dir, error)) {
      throw Error(fmt::format("--out '{}' is one of the shard directories: merge into another",
                              summary.out.string()));
    }
  }
  if (!options.fresh && fs::exists(summary.out / "cells", error) &&
      !fs::is_empty(summary.out / "cells", error)) {
    throw Error(
        fmt::format("output directory '{}' already holds cells: choose another --out or "
                    "pass --fresh to discard them",
                    summary.out.string()));
  }
  const fs::path cells_dir = prepare_cells_directory(summary.out, options.fresh);
  // Written as a run writes them (upgraded names included): the merged directory resumes as a
  // run's does.
  for (const auto& [id, source] : found) {
    write_file_atomically(cells_dir / (id + ".json"), harness::dump_json(source.first) + "\n");
  }
  OrderedJson sources = OrderedJson::array();
  for (const ShardOutput& shard : shards) {
    sources.push_back(
        {{"dir", shard.dir.string()},
         {"shard", shard.record.shard ? OrderedJson(shard.record.shard->text()) : nullptr},
         {"cells", shard.record.cells.size()},
         {"git_revision", shard.results.value("git_revision", "unknown")},
         {"machine", shard.results.value("machine", OrderedJson::object())}});
  }
  write_results(merged, summary.out, {{"shards", sources}});
  if (revisions.size() > 1) {
    summary.notes.push_back(fmt::format(
        "the cells were computed by {} builds ({}): differences between them may be the code's",
        revisions.size(), list_ids({revisions.begin(), revisions.end()})));
  }
  return summary;
}

}  // namespace kvevict::eval
