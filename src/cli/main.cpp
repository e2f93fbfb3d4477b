// `kvevict`: the command-line tool. Subcommands are registered by add_*_command (command.hpp);
// every error is reported here as "kvevict: error: ..." with exit code 2.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <vector>

#include "command.hpp"

namespace kvevict::cli {
// Subcommands over the reference decoder (declared here, not in command.hpp, to keep the wiring in
// this file).
Command add_generate_command(CLI::App& parent);
Command add_stream_command(CLI::App& parent);
Command add_info_command(CLI::App& parent);
Command add_random_model_command(CLI::App& parent);
Command add_eval_command(CLI::App& parent);
}  // namespace kvevict::cli

namespace {

int run(int argc, char** argv) {
  CLI::App app{"kvevict: KV-cache eviction policies", "kvevict"};
  app.require_subcommand(1);
  const std::vector<kvevict::cli::Command> commands = {
      kvevict::cli::add_replay_command(app),        // replay_command.cpp
      kvevict::cli::add_generate_command(app),      // generate_command.cpp
      kvevict::cli::add_stream_command(app),        // stream_command.cpp
      kvevict::cli::add_info_command(app),          // info_command.cpp
      kvevict::cli::add_random_model_command(app),  // random_model_command.cpp
      kvevict::cli::add_eval_command(app),          // eval_command.cpp
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return app.exit(help);
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
