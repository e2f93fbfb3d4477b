// `kvevict-llama`: kvevict's eviction policies over llama.cpp, with the options and reports of
// `kvevict` (stream, generate, eval) plus llama.cpp's own (-t, -ngl, -c, -fa), and `serve` (an
// OpenAI-style HTTP server). Every error is
// reported as "kvevict-llama: error: ..." with exit code 2.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <kvevict/version.hpp>
#include <string>
#include <vector>

#include "llama/cli/commands.hpp"

namespace {

int run(int argc, char** argv) {
  CLI::App app{"kvevict-llama: KV-cache eviction policies over llama.cpp", "kvevict-llama"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("kvevict-llama ") + kvevict::kVersionString);
  const std::vector<kvevict::llama_cli::Command> commands = {
      kvevict::llama_cli::add_generate_command(app),
      kvevict::llama_cli::add_stream_command(app),
      kvevict::llama_cli::add_eval_command(app),
      kvevict::llama_cli::add_serve_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForVersion& version) {
    return app.exit(version);
  } catch (const CLI::ParseError& error) {
    std::cerr << "kvevict-llama: error: " << error.what()
              << "\nRun with --help for more information.\n";
    return kvevict::llama_cli::kExitError;
  }
  for (const kvevict::llama_cli::Command& command : commands) {
    if (command.app->parsed()) return command.run();
  }
  return kvevict::llama_cli::kExitError;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "kvevict-llama: error: " << error.what() << "\n";
  } catch (...) {
    std::cerr << "kvevict-llama: error: unknown exception\n";
  }
  return kvevict::llama_cli::kExitError;
}
