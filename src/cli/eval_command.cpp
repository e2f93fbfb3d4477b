// `kvevict eval CONFIG [--out DIR] [--jobs N] [--fresh]`: the benchmark harness. Runs the grid a
// JSON config describes (policies x budgets x tasks over one model; docs/eval.md), each cell in
// its own child process, resumable, and writes results.json, results.csv and results.md.
#include <fmt/format.h>

#include <iostream>
#include <kvevict/error.hpp>
#include <memory>
#include <string>

#include "command.hpp"
#include "eval/config.hpp"
#include "eval/grid.hpp"

namespace kvevict::cli {
namespace {

struct EvalOptions {
  std::string config;
  std::string out;
  int jobs = 2;
  bool fresh = false;
  bool list = false;
  std::string model;
  std::string text;
};

int run_eval(const EvalOptions& options) {
  if (options.jobs < 1) throw Error(fmt::format("--jobs must be at least 1, got {}", options.jobs));
  eval::EvalConfig config = eval::load_eval_config(options.config);
  if (!options.model.empty()) config.model = options.model;
  if (!options.text.empty()) config.text = options.text;
  if (options.list) {
    const std::vector<eval::CellSpec> cells = eval::enumerate_cells(config);
    for (const eval::CellSpec& cell : cells) {
      std::cout << cell.id << "  " << cell.describe(config) << "\n";
    }
    std::cout << cells.size() << " cells\n" << std::flush;
    return kExitOk;
  }
  const eval::GridContext grid = eval::prepare_grid(std::move(config));
  eval::GridOptions grid_options;
  grid_options.out = options.out.empty() ? "eval/results/" + grid.config.name : options.out;
  grid_options.jobs = options.jobs;
  grid_options.fresh = options.fresh;
  grid_options.progress = &std::cerr;
  const eval::GridSummary summary = eval::run_grid(grid, grid_options);
  std::string report = fmt::format("cells    {} (run {}, resumed {}, failed {})\n", summary.cells,
                                   summary.run, summary.resumed, summary.failures.size());
  for (const std::string& failure : summary.failures) report += "failed   " + failure + "\n";
  const std::string out = grid_options.out.string();
  report += fmt::format("results  {}/results.json, {}/results.csv, {}/results.md\n", out, out, out);
  std::cout << report << std::flush;
  if (!std::cout) throw Error("error while writing to stdout");
  return summary.failures.empty() ? kExitOk : kExitMismatch;
}

}  // namespace

Command add_eval_command(CLI::App& parent) {
  auto options = std::make_shared<EvalOptions>();
  CLI::App* app = parent.add_subcommand(
      "eval", "Run a benchmark grid (policies x budgets x tasks) from a JSON config, resumable");
  app->add_option("config", options->config, "grid config (JSON; see docs/eval.md)")->required();
  app->add_option("-o,--out", options->out,
                  "output directory (default: eval/results/<config name>); cells/<id>.json holds "
                  "each finished cell");
  app->add_option("-j,--jobs", options->jobs, "cells run at once, each in its own process")
      ->capture_default_str();
  app->add_flag("--fresh", options->fresh,
                "discard the output directory's cells and results and run every cell again");
  app->add_flag("--list", options->list, "print the grid's cells and exit (nothing is loaded)");
  app->add_option("--model", options->model, "use this model instead of the config's \"model\"");
  app->add_option("--text", options->text, "use this text file instead of the config's \"text\"");
  app->footer(
      "Runs every cell of the grid that <out>/cells does not hold yet: a cell is one policy at\n"
      "one budget on one task variant (passkey: one length and depth; grocery: one turn count).\n"
      "Cells run in fork()ed children, --jobs at a time; each writes cells/<id>.json atomically,\n"
      "so an interrupted run resumes where it stopped. A cell recorded with another config (model\n"
      "or text checksum, seed, chunk, policy, task) is an error unless --fresh. A crashing cell\n"
      "is reported and the grid goes on (exit status 1). Progress goes to stderr.\n"
      "\n"
      "Outputs: results.json (config, model sha256, git revision, machine, every cell), "
      "results.csv\n"
      "(one row per cell), results.md (a table per task).\n"
      "\n"
      "Examples:\n"
      "  kvevict eval eval/configs/toy-base-passkey.json\n"
      "  kvevict eval eval/configs/toy-base-stream.json --out /tmp/stream --jobs 2 --fresh\n"
      "  kvevict eval eval/configs/tiny.json --out /tmp/tiny --fresh");
  return Command{app, [options] { return run_eval(*options); }};
}

}  // namespace kvevict::cli
