// The subcommands of `kvevict-llama` and what they share.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <kvevict/llama/llama_sequence.hpp>
#include <kvevict/timing.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "cli_common/log_loss.hpp"
#include "cli_common/report.hpp"

namespace kvevict::llama_cli {

inline constexpr int kExitError = 2;

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Command add_stream_command(CLI::App& parent);
Command add_generate_command(CLI::App& parent);

/// What streaming a text did (for the report).
struct StreamedText {
  std::uint64_t input_bytes = 0;
  std::int64_t turns = 0;
  std::int64_t anchors = 0;  ///< inserted by --insert-anchors
  double seconds = 0;
};

/// "\n", "\t", "\r" and "\\" in a separator given on the command line.
[[nodiscard]] std::string unescape(std::string_view text);

/// The cache report of `kvevict`, from a LlamaSequence: live and peak KV bytes are llama.cpp's
/// cells in use times the K and V bytes of a cell.
[[nodiscard]] cli::CacheReport cache_report(const llama::LlamaSequence& sequence,
                                            std::string policy, double seconds,
                                            const StageClock& clock);

/// `kvevict stream`'s report (text, or one JSON object).
void print_stream_report(bool json, const std::string& model, const std::string& input,
                         const std::string& separator, bool insert_anchors,
                         const std::string& policy_description,
                         const nlohmann::ordered_json& policy, const cli::WindowedLoss& loss,
                         const StreamedText& streamed, const cli::CacheReport& report);

}  // namespace kvevict::llama_cli
