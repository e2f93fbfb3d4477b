// `kvevict replay FILE [--check] [--output FILE]`: runs a kvevict-replay/1 file through the
// policy it names and prints the kept positions (kvevict-replay-result/1), or checks them against
// the file's `expected`.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include "command.hpp"
#include "kvevict/error.hpp"
#include "replay/replay.hpp"

namespace kvevict::cli {
namespace {

struct ReplayOptions {
  std::string file;
  std::string output;
  bool check = false;
};

void write_output(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error("cannot write '" + path + "'");
  out << text;
  out.close();
  if (!out) throw Error("error while writing '" + path + "'");
}

int run_replay_command(const ReplayOptions& options) {
  replay::Replay input;
  replay::ReplayResult result;
  try {
    input = replay::load_replay(options.file);
    if (options.check && !input.expected) {
      throw Error("--check needs an \"expected\" result, the file has none");
    }
    result = replay::run_replay(input);
  } catch (const Error& error) {
    // Messages name a JSON path, a chunk or a policy parameter; say which file they are about.
    throw Error(options.file + ": " + error.what());
  }
  const std::string text = replay::format_result(result);
  if (!options.output.empty()) {
    write_output(options.output, text);
  } else if (!options.check) {
    std::cout << text << std::flush;
    if (!std::cout) throw Error("error while writing the result to stdout");
  }
  if (!options.check) return kExitOk;

  const replay::Comparison comparison = replay::compare_results(*input.expected, result);
  if (comparison.agree) {
    std::cout << "OK: " << input.name << ": " << result.after_chunk.size() << " chunks agree\n";
    return kExitOk;
  }
  std::cerr << "FAIL: " << input.name << ": the replay disagrees with its expected result\n"
            << replay::describe(comparison, input.chunks);
  return kExitMismatch;
}

}  // namespace

Command add_replay_command(CLI::App& parent) {
  auto options = std::make_shared<ReplayOptions>();
  CLI::App* app = parent.add_subcommand(
      "replay",
      "Run a kvevict-replay/1 file through the policy it names; print the kept positions "
      "(kvevict-replay-result/1)");
  app->add_option("file", options->file, "replay file (kvevict-replay/1 JSON)")->required();
  app->add_flag("--check", options->check,
                "compare with the file's \"expected\" result: exit 0 and print OK when every list "
                "agrees, exit 1 with the first disagreement on stderr otherwise; the result is "
                "then only written with --output");
  app->add_option("-o,--out,--output", options->output,
                  "write the result to this file, not stdout");
  return Command{app, [options] { return run_replay_command(*options); }};
}

}  // namespace kvevict::cli
