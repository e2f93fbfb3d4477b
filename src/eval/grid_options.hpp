// The command-line options of a grid run that `kvevict eval` and `kvevict-llama eval` share. Each
// executable adds its own: the model (optional for kvevict, a GGUF for kvevict-llama), threads,
// the K/V type, llama.cpp's options.
#pragma once

#include <CLI/CLI.hpp>

#include "eval/grid.hpp"

namespace kvevict::eval {

/// config (positional), -o/--out, -j/--jobs, --shard, --fresh, --list, --text. Returns the config
/// option: `kvevict eval` leaves it optional (its `merge` subcommand takes none).
inline CLI::Option* add_grid_options(CLI::App& app, EvalCommand& command) {
  CLI::Option* config =
      app.add_option("config", command.config, "grid config (JSON; see docs/eval.md)");
  app.add_option("-o,--out", command.out,
                 "output directory (default: eval/results/<config name>); cells/<id>.json holds "
                 "each finished cell");
  app.add_option("-j,--jobs", command.jobs, "cells run at once, each in its own process")
      ->capture_default_str();
  app.add_option("--shard", command.shard,
                 "run only shard I of N (1 <= I <= N): the cells at positions I-1, I-1+N, ... of "
                 "the grid; combine the shards' outputs with `kvevict eval merge`");
  app.add_flag("--fresh", command.fresh,
               "discard the output directory's cells and results and run every cell again");
  app.add_flag("--list", command.list, "print the grid's cells and exit (nothing is loaded)");
  app.add_option("--text", command.text, "use this text file instead of the config's \"text\"");
  return config;
}

}  // namespace kvevict::eval
