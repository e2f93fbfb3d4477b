// `kvevict`'s cache report from a LlamaSequence.
#include <utility>

#include "llama/cli/commands.hpp"

namespace kvevict::llama_cli {
harness::CacheReport cache_report(const llama::LlamaSequence& sequence, std::string policy,
                                  double seconds, const StageClock& clock) {
  const SequenceStats& stats = sequence.sequence().stats();
  harness::CacheReport report;
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
  report.eviction_seconds = harness::eviction_seconds(clock);
  return report;
}

}  // namespace kvevict::llama_cli
