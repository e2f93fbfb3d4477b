// The stream_bpb task: the grid's text cycled into one stream of `tokens` tokens under the cell's
// policy, scored as `kvevict stream` scores it (bits per byte overall and per window).
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "eval/task_support.hpp"
#include "harness/log_loss.hpp"

namespace kvevict::eval::tasks {

void run_stream_bpb(const GridContext& grid, const CellSpec& cell, OrderedJson& result) {
  const TaskConfig& task = grid.config.tasks[cell.task_index];
  const Clock::time_point start = Clock::now();
  CellSequence sequence(grid, cell);
  result["policy_setup"] = sequence.policy_json();
  CycledText source(grid, task.turn_separator);
  std::vector<std::uint32_t> token_bytes = grid.engine->token_bytes();
  const int vocab = static_cast<int>(token_bytes.size());
  harness::StreamScorer scorer(
      [&sequence](std::span<const std::int32_t> tokens, bool turn_start) {
        return sequence->feed(tokens, turn_start, /*all_logits=*/true).values;
      },
      vocab, task.window, std::move(token_bytes), source.anchor_id());
  std::vector<std::int32_t> chunk;
  std::int64_t handed_out = 0;
  while (handed_out < task.tokens) {
    const bool turn_start = source.fill(chunk, grid.config.chunk, handed_out, task.tokens);
    scorer.feed(chunk, turn_start);
  }
  const harness::WindowedLoss& loss = scorer.loss();
  CacheTotals totals;
  const SequenceCounters counters = sequence->counters();
  totals.add(counters, counters.live_kv_bytes);
  OrderedJson& metrics = result["metrics"];
  totals.write(metrics, seconds_since(start));
  const harness::LossTotals& overall = loss.overall();
  metrics["bits_per_byte"] = overall.bits_per_byte();
  metrics["perplexity"] = overall.perplexity();
  metrics["tokens_scored"] = overall.tokens;
  metrics["bytes_scored"] = overall.bytes;
  if (!task.turn_separator.empty()) metrics["turns"] = source.turns();
  OrderedJson windows = OrderedJson::array();
  for (const harness::LossWindow& window : loss.windows()) {
    windows.push_back({{"first_position", window.first_position},
                       {"tokens", window.totals.tokens},
                       {"bytes", window.totals.bytes},
                       {"bits_per_byte", window.totals.bits_per_byte()}});
  }
  result["details"]["window"] = task.window;
  result["details"]["windows"] = std::move(windows);
}

}  // namespace kvevict::eval::tasks
