// Subcommands of the `kvevict` CLI. Each lives in its own file and registers itself on the
// top-level app through an add_*_command function; main.cpp only wires them and handles errors.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kvevict::harness {}

namespace kvevict::cli {

// The subcommands are written against the harness the front ends share (src/harness): its names
// are used unqualified here.
using namespace kvevict::harness;  // NOLINT(google-build-using-namespace)

/// Process exit codes shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitMismatch = 1;  ///< ran fine, but a check did not pass
inline constexpr int kExitError = 2;     ///< bad input, bad usage or failure

/// A registered subcommand: its CLI11 app and what to run when it was chosen. `run` returns the
/// exit code and throws on errors (main reports them).
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

/// `kvevict replay FILE [--check] [--output FILE]` (replay_command.cpp).
Command add_replay_command(CLI::App& parent);

}  // namespace kvevict::cli
