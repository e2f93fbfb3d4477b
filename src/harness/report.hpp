// Output helpers shared by the `kvevict` subcommands: cache statistics of a decoder run, byte
// sizes for people, JSON that survives invalid UTF-8, and loading a model named on the command
// line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/model/decoder.hpp>
#include <kvevict/model/model.hpp>
#include <kvevict/timing.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::harness {

/// What a decoder run cost: the final line of generate, part of stream's report.
struct CacheReport {
  std::string policy;
  std::int64_t tokens = 0;  ///< stream tokens fed (catalyst tokens excluded)
  std::size_t live_kv_bytes = 0;
  std::size_t peak_kv_bytes = 0;
  /// Key and value bytes the store allocated at most at once: every head the whole capacity,
  /// or under an allocation other than uniform each head what its share uses (KvStore).
  std::size_t peak_reserved_kv_bytes = 0;
  /// Slots per head the sequence may use (Sequence::capacity): what every head's rows span when
  /// they are not sized by use.
  int slots_per_head = 0;
  std::int64_t evicted_slots = 0;  ///< summed over every (layer, KV head)
  std::int64_t decisions = 0;      ///< decisions that evicted something
  std::int64_t catalyst_runs = 0;
  double seconds = 0;            ///< wall time of the run
  double tokens_per_second = 0;  ///< tokens / seconds
  double eviction_seconds = 0;   ///< policy + reposition + catalyst stages (0 when untimed)
  /// Live tokens of each (layer, KV head) at the end, [layer][kv_head]: how the budget was split.
  std::vector<std::vector<int>> unit_tokens;
  /// Key and value bytes of the most tokens each (layer, KV head) held at once, [layer][kv_head].
  std::vector<std::vector<std::size_t>> unit_peak_kv_bytes;
  /// Key and value bytes allocated for each (layer, KV head) at the end, [layer][kv_head].
  std::vector<std::vector<std::size_t>> unit_reserved_kv_bytes;
};

/// The report of `decoder`'s run; `clock`, when the decoder was timed with it, gives the eviction
/// seconds.
[[nodiscard]] CacheReport make_cache_report(const model::Decoder& decoder, std::string policy,
                                            double wall_seconds, const StageClock* clock = nullptr);
/// Seconds the eviction stages took: policy + reposition + catalyst.
[[nodiscard]] double eviction_seconds(const StageClock& clock);
[[nodiscard]] nlohmann::ordered_json to_json(const CacheReport& report);
/// One line: "streaming_llm: 300 tokens, live KV 56.0 KiB, peak KV 60.0 KiB, ...".
[[nodiscard]] std::string format_cache_report(const CacheReport& report);

/// "512 B", "73.0 KiB", "1.50 MiB", "2.25 GiB".
[[nodiscard]] std::string format_bytes(std::uint64_t bytes);

/// `json` as text (indented by 2), with invalid UTF-8 (a model may emit any bytes) replaced by
/// U+FFFD instead of throwing.
[[nodiscard]] std::string dump_json(const nlohmann::ordered_json& json);

/// load_model with a plain message for a path that does not exist.
[[nodiscard]] model::Model load_model_file(const std::string& path);

/// "kvevict: warning: MESSAGE" on stderr: something the user asked for will not do what they
/// probably expect, but the run goes on.
void warn(const std::string& message);

/// Whether stderr is a terminal (progress lines are only drawn there).
[[nodiscard]] bool stderr_is_terminal();

}  // namespace kvevict::harness
