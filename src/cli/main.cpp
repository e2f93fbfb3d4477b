// `kvevict`: the command-line tool. Subcommands are registered by add_*_command (command.hpp);
// every error is reported here as "kvevict: error: ..." with exit code 2.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <vector>

#include "command.hpp"

namespace {

int run(int argc, char** argv) {
  CLI::App app{"kvevict: KV-cache eviction policies", "kvevict"};
  app.require_subcommand(1);
  const std::vector<kvevict::cli::Command> commands = {
      kvevict::cli::add_replay_command(app),
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
