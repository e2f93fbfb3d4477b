// The cost task: the grid's text streamed to each checkpoint, with tokens/s, process memory and
// the cache's bytes and time at each.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "eval/machine_info.hpp"
#include "eval/task_support.hpp"

namespace kvevict::eval::tasks {

void run_cost(const GridContext& grid, const CellSpec& cell, OrderedJson& result) {
  const EvalConfig& config = grid.config;
  const TaskConfig& task = config.tasks[cell.task_index];
  const Clock::time_point start = Clock::now();
  CellSequence sequence(grid, cell);
  result["policy_setup"] = sequence.policy_json();
  CycledText source(grid, task.turn_separator);
  OrderedJson checkpoints = OrderedJson::array();
  std::vector<std::int32_t> chunk;
  std::int64_t fed = 0;
  std::int64_t previous_tokens = 0;
  double previous_seconds = 0;
  for (const std::int64_t checkpoint : task.checkpoints) {
    while (fed < checkpoint) {
      const bool turn_start = source.fill(chunk, config.chunk, fed, checkpoint);
      (void)sequence->feed(chunk, turn_start, /*all_logits=*/false);
    }
    const double seconds = seconds_since(start);
    const ProcessMemory memory = process_memory();
    const SequenceCounters counters = sequence->counters();
    const double interval = seconds - previous_seconds;
    checkpoints.push_back(
        {{"tokens", fed},
         {"seconds", seconds},
         {"interval_tokens_per_second",
          interval > 0 ? static_cast<double>(fed - previous_tokens) / interval : 0.0},
         {"tokens_per_second", seconds > 0 ? static_cast<double>(fed) / seconds : 0.0},
         {"rss_bytes", memory.rss_bytes},
         {"peak_rss_bytes", memory.peak_rss_bytes},
         {"live_kv_bytes", counters.live_kv_bytes},
         {"peak_kv_bytes", counters.peak_kv_bytes},
         {"forward_seconds_per_token", counters.forward_seconds / static_cast<double>(fed)},
         {"eviction_seconds_per_token", counters.eviction_seconds / static_cast<double>(fed)}});
    for (const auto& [name, seconds] : counters.stage_seconds) {
      checkpoints.back()[name.substr(0, name.size() - std::string_view("seconds").size()) +
                         "seconds_per_token"] = seconds / static_cast<double>(fed);
    }
    previous_tokens = fed;
    previous_seconds = seconds;
  }
  CacheTotals totals;
  const SequenceCounters counters = sequence->counters();
  totals.add(counters, counters.live_kv_bytes);
  totals.write(result["metrics"], seconds_since(start));
  result["details"]["checkpoints"] = std::move(checkpoints);
}

}  // namespace kvevict::eval::tasks
