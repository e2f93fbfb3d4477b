// The subcommands of `kvevict-llama` and what they share.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/timing.hpp>
#include <string>

#include "harness/report.hpp"

namespace kvevict::llama_cli {

inline constexpr int kExitError = 2;

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Command add_stream_command(CLI::App& parent);
Command add_generate_command(CLI::App& parent);
Command add_eval_command(CLI::App& parent);
Command add_serve_command(CLI::App& parent);

/// The cache report of `kvevict`, from a LlamaSequence: live and peak KV bytes are llama.cpp's
/// cells in use times the K and V bytes of a cell.
[[nodiscard]] harness::CacheReport cache_report(const llama::LlamaSequence& sequence,
                                                std::string policy, double seconds,
                                                const StageClock& clock);

}  // namespace kvevict::llama_cli
