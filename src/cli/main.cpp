// `kvevict`: the command-line tool. Subcommands are registered by add_*_command (command.hpp);
// every error is reported here as "kvevict: error: ..." with exit code 2.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstddef>
#include <exception>
#include <iostream>
#include <kvevict/version.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "command.hpp"
#include "eval/machine_info.hpp"

namespace kvevict::cli {
// Subcommands over the reference decoder (declared here, not in command.hpp, to keep the wiring in
// this file).
Command add_generate_command(CLI::App& parent);
Command add_stream_command(CLI::App& parent);
Command add_info_command(CLI::App& parent);
Command add_random_model_command(CLI::App& parent);
Command add_eval_command(CLI::App& parent);
Command add_policies_command(CLI::App& parent);
Command add_compare_command(CLI::App& parent);
}  // namespace kvevict::cli

namespace {

// Edits (insertions, deletions, substitutions) between `a` and `b`.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// "unknown command 'strem' (did you mean 'stream'?); commands: compare, replay, ...".
std::string unknown_command_message(const CLI::App& app, std::string_view given) {
  std::string names;
  std::string closest;
  std::size_t closest_distance = 3;  // suggest only within two edits
  for (const CLI::App* command : app.get_subcommands(nullptr)) {
    const std::string& name = command->get_name();
    names += (names.empty() ? "" : ", ") + name;
    const std::size_t distance = edit_distance(given, name);
    if (distance < closest_distance) {
      closest_distance = distance;
      closest = name;
    }
  }
  std::string message = "unknown command '" + std::string(given) + "'";
  if (!closest.empty()) message += " (did you mean '" + closest + "'?)";
  return message + "; commands: " + names;
}

int run(int argc, char** argv) {
  CLI::App app{"kvevict: KV-cache eviction policies", "kvevict"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("kvevict ") + kvevict::kVersionString + " (" +
                                        kvevict::eval::git_revision() + ")");
  const std::vector<kvevict::cli::Command> commands = {
      kvevict::cli::add_compare_command(app),       // compare_command.cpp
      kvevict::cli::add_replay_command(app),        // replay_command.cpp
      kvevict::cli::add_generate_command(app),      // generate_command.cpp
      kvevict::cli::add_stream_command(app),        // stream_command.cpp
      kvevict::cli::add_info_command(app),          // info_command.cpp
      kvevict::cli::add_random_model_command(app),  // random_model_command.cpp
      kvevict::cli::add_eval_command(app),          // eval_command.cpp
      kvevict::cli::add_policies_command(app),      // policies_command.cpp
  };
  if (argc >= 2 && argv[1][0] != '-' &&
      app.get_subcommands([&](const CLI::App* command) { return command->check_name(argv[1]); })
          .empty()) {
    std::cerr << "kvevict: error: " << unknown_command_message(app, argv[1]) << '\n';
    return kvevict::cli::kExitError;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForVersion& version) {
    return app.exit(version);
  } catch (const CLI::ParseError& error) {
    std::cerr << "kvevict: error: " << error.what() << "\nRun with --help for more information.\n";
    return kvevict::cli::kExitError;
  }
  for (const kvevict::cli::Command& command : commands) {
    if (command.app->parsed()) return command.run();
  }
  return kvevict::cli::kExitError;  // unreachable: require_subcommand(1)
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "kvevict: error: " << error.what() << "\n";
  } catch (...) {
    std::cerr << "kvevict: error: unknown exception\n";
  }
  return kvevict::cli::kExitError;
}
