#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <kvevict/error.hpp>
#include <utility>

#include "llama/cli/commands.hpp"

namespace kvevict::llama_cli {
namespace {

nlohmann::ordered_json number_or_null(double value) {
  return std::isfinite(value) ? nlohmann::ordered_json(value) : nlohmann::ordered_json(nullptr);
}

void add_totals(nlohmann::ordered_json& json, const cli::LossTotals& totals) {
  json["tokens"] = totals.tokens;
  json["bytes"] = totals.bytes;
  json["bits"] = totals.bits;
  json["bits_per_byte"] = number_or_null(totals.bits_per_byte());
  json["perplexity"] = number_or_null(totals.perplexity());
}

}  // namespace

std::string unescape(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\' || i + 1 == text.size()) {
      out += text[i];
      continue;
    }
    const char next = text[++i];
    if (next == 'n') {
      out += '\n';
    } else if (next == 't') {
      out += '\t';
    } else if (next == 'r') {
      out += '\r';
    } else if (next == '\\') {
      out += '\\';
    } else {
      out += '\\';
      out += next;
    }
  }
  return out;
}

cli::CacheReport cache_report(const llama::LlamaSequence& sequence, std::string policy,
                              double seconds, const StageClock& clock) {
  const SequenceStats& stats = sequence.sequence().stats();
  cli::CacheReport report;
  report.policy = std::move(policy);
  report.tokens = stats.tokens_fed;
  report.live_kv_bytes =
      static_cast<std::size_t>(sequence.live_cells()) * sequence.bytes_per_cell();
  report.peak_kv_bytes =
      static_cast<std::size_t>(sequence.stats().peak_cells) * sequence.bytes_per_cell();
  report.evicted_slots = stats.evicted_slots;
  report.decisions = stats.decisions;
  report.catalyst_runs = sequence.stats().catalyst_runs;
  report.seconds = seconds;
  report.tokens_per_second = seconds > 0 ? static_cast<double>(stats.tokens_fed) / seconds : 0.0;
  report.eviction_seconds = cli::eviction_seconds(clock);
  return report;
}

void print_stream_report(bool json_output, const std::string& model, const std::string& input,
                         const std::string& separator, bool insert_anchors,
                         const std::string& policy_description,
                         const nlohmann::ordered_json& policy, const cli::WindowedLoss& loss,
                         const StreamedText& streamed, const cli::CacheReport& report) {
  const cli::LossTotals& overall = loss.overall();
  if (!json_output) {
    std::string out;
    out += fmt::format("input          {} ({} bytes)\n", input, streamed.input_bytes);
    out += fmt::format("policy         {}\n", policy_description);
    if (!separator.empty()) out += fmt::format("turns          {}\n", streamed.turns);
    if (insert_anchors) {
      out += fmt::format("anchors        {} inserted (fed, not scored)\n", streamed.anchors);
    }
    out += fmt::format("tokens scored  {} ({} bytes)\n", overall.tokens, overall.bytes);
    out += fmt::format("bits per byte  {:.4f}\n", overall.bits_per_byte());
    out += fmt::format("perplexity     {:.4f} per token\n", overall.perplexity());
    out += fmt::format("windows of {} positions:\n", loss.window());
    out += fmt::format("  {:>23}  {:>10}  {:>10}  {:>10}\n", "positions", "tokens", "bits/byte",
                       "perplexity");
    for (const cli::LossWindow& window : loss.windows()) {
      const std::string positions =
          fmt::format("{}-{}", window.first_position, window.first_position + loss.window() - 1);
      out +=
          fmt::format("  {:>23}  {:>10}  {:>10.4f}  {:>10.4f}\n", positions, window.totals.tokens,
                      window.totals.bits_per_byte(), window.totals.perplexity());
    }
    out += cli::format_cache_report(report) + '\n';
    std::cout << out << std::flush;
    return;
  }
  nlohmann::ordered_json json;
  json["model"] = model;
  json["input"] = input;
  json["input_bytes"] = streamed.input_bytes;
  json["policy"] = policy;
  if (!separator.empty()) json["turns"] = streamed.turns;
  if (insert_anchors) json["anchors"] = streamed.anchors;
  add_totals(json, overall);
  json["window"] = loss.window();
  json["windows"] = nlohmann::ordered_json::array();
  for (const cli::LossWindow& window : loss.windows()) {
    nlohmann::ordered_json entry;
    entry["first_position"] = window.first_position;
    add_totals(entry, window.totals);
    json["windows"].push_back(std::move(entry));
  }
  json["cache"] = cli::to_json(report);
  std::cout << cli::dump_json(json) << '\n' << std::flush;
  if (!std::cout) throw Error("error while writing to stdout");
}

}  // namespace kvevict::llama_cli
