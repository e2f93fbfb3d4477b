#include "harness/report.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <kvevict/error.hpp>
#include <system_error>
#include <utility>

namespace kvevict::harness {

CacheReport make_cache_report(const model::Decoder& decoder, std::string policy,
                              double wall_seconds, const StageClock* clock) {
  const model::DecoderStats& stats = decoder.stats();
  const SequenceStats& sequence = decoder.cache().sequence().stats();
  CacheReport report;
  report.policy = std::move(policy);
  report.tokens = stats.tokens_fed;
  report.live_kv_bytes = decoder.cache().memory().live_kv_bytes;
  report.peak_kv_bytes = stats.peak_kv_bytes;
  report.peak_reserved_kv_bytes = decoder.cache().store().peak_reserved_bytes();
  report.slots_per_head = decoder.cache().sequence().capacity();
  report.evicted_slots = sequence.evicted_slots;
  report.decisions = sequence.decisions;
  report.catalyst_runs = stats.catalyst_runs;
  report.seconds = wall_seconds;
  report.tokens_per_second =
      wall_seconds > 0 ? static_cast<double>(stats.tokens_fed) / wall_seconds : 0.0;
  if (clock != nullptr) report.eviction_seconds = eviction_seconds(*clock);
  const Sequence& seq = decoder.cache().sequence();
  const std::size_t row = decoder.cache().store().kv_bytes_per_slot();
  for (int l = 0; l < seq.config().layers; ++l) {
    std::vector<int>& tokens = report.unit_tokens.emplace_back();
    std::vector<std::size_t>& peak = report.unit_peak_kv_bytes.emplace_back();
    std::vector<std::size_t>& reserved = report.unit_reserved_kv_bytes.emplace_back();
    for (int g = 0; g < seq.config().kv_heads; ++g) {
      tokens.push_back(seq.live(l, g));
      peak.push_back(static_cast<std::size_t>(seq.slots().peak_live(seq.unit_of(l, g))) * row);
      reserved.push_back(static_cast<std::size_t>(decoder.cache().store().head_rows(l, g)) * row);
    }
  }
  return report;
}

nlohmann::ordered_json to_json(const CacheReport& report) {
  nlohmann::ordered_json json;
  json["policy"] = report.policy;
  json["tokens"] = report.tokens;
  json["live_kv_bytes"] = report.live_kv_bytes;
  json["peak_kv_bytes"] = report.peak_kv_bytes;
  json["peak_reserved_kv_bytes"] = report.peak_reserved_kv_bytes;
  json["slots_per_head"] = report.slots_per_head;
  json["evicted_slots"] = report.evicted_slots;
  json["decisions"] = report.decisions;
  json["catalyst_runs"] = report.catalyst_runs;
  json["seconds"] = report.seconds;
  json["tokens_per_second"] = report.tokens_per_second;
  json["eviction_seconds"] = report.eviction_seconds;
  json["unit_tokens"] = report.unit_tokens;
  json["unit_peak_kv_bytes"] = report.unit_peak_kv_bytes;
  json["unit_reserved_kv_bytes"] = report.unit_reserved_kv_bytes;
  return json;
}

std::string format_cache_report(const CacheReport& report) {
  std::string line = fmt::format(
      "{}: {} tokens, live KV {}, peak KV {} ({} allocated), {} slots evicted in {} "
      "decisions",
      report.policy, report.tokens, format_bytes(report.live_kv_bytes),
      format_bytes(report.peak_kv_bytes), format_bytes(report.peak_reserved_kv_bytes),
      report.evicted_slots, report.decisions);
  if (report.catalyst_runs > 0) line += fmt::format(" ({} catalyst runs)", report.catalyst_runs);
  line += fmt::format(", {:.1f} tokens/s, {:.3f} s in eviction", report.tokens_per_second,
                      report.eviction_seconds);
  return line;
}

double eviction_seconds(const StageClock& clock) {
  return clock.seconds(Stage::policy) + clock.seconds(Stage::reposition) +
         clock.seconds(Stage::catalyst);
}

std::string format_bytes(std::uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  const char* const units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  if (value < 10.0) return fmt::format("{:.2f} {}", value, units[unit]);
  return fmt::format("{:.1f} {}", value, units[unit]);
}

std::string dump_json(const nlohmann::ordered_json& json) {
  return json.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

namespace {

// Whether the first bytes of `path` are all printable ASCII or whitespace. No model format starts
// so: GGUF's version and llama2.c's dimensions hold zero bytes, safetensors its u64 length.
bool looks_like_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[64];
  in.read(head, sizeof head);
  const std::streamsize count = in.gcount();
  if (count == 0) return false;
  for (std::streamsize i = 0; i < count; ++i) {
    const auto c = static_cast<unsigned char>(head[i]);
    if (!(std::isprint(c) || c == '\n' || c == '\r' || c == '\t')) return false;
  }
  return true;
}

}  // namespace

model::Model load_model_file(const std::string& path) {
  if (path.empty()) throw Error("--model: no model path given");
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    throw Error(fmt::format("model file '{}' does not exist", path));
  }
  // A text file would otherwise be read as a llama2.c checkpoint (which has no magic) and fail
  // with a message about its header.
  if (std::filesystem::is_regular_file(path, error) && looks_like_text(path)) {
    throw Error(fmt::format(
        "model file '{}' looks like text, not a model (GGUF, safetensors with config.json, or a "
        "llama2.c checkpoint)",
        path));
  }
  try {
    return model::load_model(path);
  } catch (const Error& failure) {
    throw Error(fmt::format("cannot load model '{}': {}", path, failure.what()));
  }
}

bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

void warn(const std::string& message) { std::cerr << "kvevict: warning: " << message << '\n'; }

}  // namespace kvevict::harness
