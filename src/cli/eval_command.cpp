// `kvevict eval CONFIG [--out DIR] [--jobs N] [--shard I/N] [--fresh]`: the benchmark harness.
// Runs the grid a JSON config describes (policies x budgets x tasks over one model; docs/eval.md),
// or one shard of it, each cell in its own child process, resumable, and writes results.json,
// results.csv and results.md. `kvevict eval merge SHARD_DIR... [--out DIR]` combines shards.
#include <fmt/format.h>

#include <functional>
#include <iostream>
#include <kvevict/error.hpp>
#include <kvevict/kv_type.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/options.hpp"
#include "command.hpp"
#include "eval/config.hpp"
#include "eval/grid.hpp"

namespace kvevict::cli {
namespace {

struct EvalOptions {
  eval::EvalCommand command;
  std::string kv_type;
};

// --kv-type: every entry of a config without a K/V axis stored as `kv_type`, labelled as the
// axis would label it.
void override_kv_type(eval::EvalConfig& config, const std::string& kv_type) {
  try {
    (void)parse_kv_type(kv_type);
  } catch (const Error& error) {
    throw Error(fmt::format("--kv-type: {}", error.what()));
  }
  for (eval::PolicyEntry& entry : config.policies) {
    if (entry.kv_type != "f32") {
      throw Error(
          fmt::format("--kv-type: the config already sets a K/V type (entry '{}' is {}); "
                      "edit its \"kv_types\" instead",
                      entry.label, entry.kv_type));
    }
  }
  if (kv_type == "f32") return;
  for (eval::PolicyEntry& entry : config.policies) {
    entry.kv_type = kv_type;
    entry.label += " kv=" + kv_type;
  }
}

struct MergeCommandOptions {
  std::vector<std::string> shards;
  std::string out;
  bool committed = false;
  bool fresh = false;
};

int run_eval(const EvalOptions& options) {
  // A subcommand-less `eval` needs its config; CLI11 cannot require it without requiring it of
  // `eval merge` too.
  if (options.command.config.empty()) {
    throw Error("config is required (kvevict eval CONFIG; see --help)");
  }
  eval::EvalCommand command = options.command;
  if (!options.kv_type.empty()) {
    command.adjust = [kv_type = options.kv_type](eval::EvalConfig& config) {
      override_kv_type(config, kv_type);
    };
  }
  const bool complete = eval::run_eval_command(
      command, [](const std::string& model) { return eval::reference_engine(model); }, std::cout,
      std::cerr);
  return complete ? kExitOk : kExitMismatch;
}

int run_merge(const MergeCommandOptions& options) {
  eval::MergeOptions merge;
  merge.shards.assign(options.shards.begin(), options.shards.end());
  merge.out = options.out;
  merge.committed = options.committed;
  merge.fresh = options.fresh;
  const eval::MergeSummary summary = eval::merge_shards(merge);
  for (const std::string& note : summary.notes) std::cerr << "kvevict: note: " << note << "\n";
  const std::string out = summary.out.string();
  std::cout << fmt::format("cells    {} from {} shard directories\n", summary.cells,
                           options.shards.size())
            << fmt::format("results  {}/results.json, {}/results.csv, {}/results.md\n", out, out,
                           out)
            << std::flush;
  if (!std::cout) throw Error("error while writing to stdout");
  return kExitOk;
}

// `eval merge` runs instead of `eval` when given; main runs the command whose app was parsed.
void add_merge_subcommand(CLI::App& eval_app, std::function<int()>& run_chosen,
                          const std::shared_ptr<EvalOptions>& eval_options) {
  auto options = std::make_shared<MergeCommandOptions>();
  CLI::App* app = eval_app.add_subcommand(
      "merge", "Combine the output directories of `eval --shard` runs into one grid's results");
  app->add_option("shard_dirs", options->shards, "output directories of the shards (any order)")
      ->required();
  add_output_options(*app, options->out, options->committed,
                     "receives cells/ and the results a single run writes");
  app->add_flag("--fresh", options->fresh,
                "discard the output directory's cells and results first");
  app->footer(
      "Reads each directory's results.json and cells/, checks that all ran the same grid (name,\n"
      "config apart from the model and text paths, model and text sha256; the message names what\n"
      "differs) and that every cell of the grid is in exactly one shard's slice, then writes\n"
      "<out>/cells and results.json (with \"shards\": where each came from), results.csv and\n"
      "results.md as `kvevict eval` does. Nothing is written when a check fails (exit status 2).\n"
      "\n"
      "Example:\n"
      "  for i in 1 2 3; do kvevict eval eval/configs/tiny.json --shard $i/3 --out /tmp/s$i; done\n"
      "  kvevict eval merge /tmp/s1 /tmp/s2 /tmp/s3 --out /tmp/tiny");
  run_chosen = [app, options, eval_options] {
    if (app->parsed()) return run_merge(*options);
    return run_eval(*eval_options);
  };
}

}  // namespace

Command add_eval_command(CLI::App& parent) {
  auto options = std::make_shared<EvalOptions>();
  eval::EvalCommand& grid_command = options->command;
  CLI::App* app = parent.add_subcommand(
      "eval", "Run a benchmark grid (policies x budgets x tasks) from a JSON config, resumable");
  (void)add_grid_options(*app, grid_command);
  add_threads_option(*app, grid_command.threads);
  app->add_option("--model", grid_command.model,
                  "use this model instead of the config's \"model\"");
  app->add_option("--kv-type", options->kv_type,
                  "store every policy's keys and values as f32, f16, bf16 or q8_0 (labels get "
                  "\" kv=TYPE\"; for a config without \"kv_types\" or \"kv_type\")");
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
      "--shard I/N runs a deterministic slice, for N machines or array jobs: cell k (0-based,\n"
      "in --list order) belongs to shard k mod N + 1. `kvevict eval merge DIR...` combines the\n"
      "shards' output directories into the results one run writes (docs/eval.md).\n"
      "\n"
      "Outputs go to <build>/eval-results/<config name> (see --out) unless --out DIR says where;\n"
      "--committed writes the committed eval/results/<config name> instead (from the checkout's\n"
      "root: how the committed results are reproduced).\n"
      "\n"
      "Examples:\n"
      "  kvevict eval eval/configs/toy-base-passkey.json\n"
      "  kvevict eval eval/configs/toy-base-passkey.json --committed   # the committed results\n"
      "  kvevict eval eval/configs/toy-base-passkey.json --shard 2/8 --out /scratch/passkey-2\n"
      "  kvevict eval eval/configs/toy-base-stream.json --out /tmp/stream --jobs 2 --fresh\n"
      "  kvevict eval eval/configs/tiny.json --out /tmp/tiny --fresh");
  Command command{app, {}};
  add_merge_subcommand(*app, command.run, options);
  return command;
}

}  // namespace kvevict::cli
