// The grocery task (SirLLM's multi-turn recall): items given over turns of filler, asked for
// back at the end and answered greedily; item recall and exact answers.
#include <cstdint>
#include <string>
#include <vector>

#include "eval/documents.hpp"
#include "eval/task_support.hpp"

namespace kvevict::eval::tasks {

void run_grocery(const GridContext& grid, const CellSpec& cell, OrderedJson& result) {
  const EvalConfig& config = grid.config;
  const TaskConfig& task = config.tasks[cell.task_index];
  const Clock::time_point start = Clock::now();
  CacheTotals totals;
  double recall_sum = 0;
  int exact = 0;
  OrderedJson documents = OrderedJson::array();
  for (int d = 0; d < task.documents; ++d) {
    Rng rng(
        mix_seed({config.seed, hash_name("grocery"), static_cast<std::uint64_t>(d),
                  static_cast<std::uint64_t>(*cell.turns), static_cast<std::uint64_t>(*cell.length),
                  static_cast<std::uint64_t>(task.items)}));
    const GroceryDocument doc =
        make_grocery_document(grid.filler, *cell.length, task.items, *cell.turns, rng);
    CellSequence sequence(grid, cell);
    if (d == 0) result["policy_setup"] = sequence.policy_json();
    Feeder feeder(grid);
    FeedLogits forward;
    for (std::size_t t = 0; t < doc.turns.size(); ++t) {
      std::vector<std::int32_t> tokens = bytes_to_tokens(doc.turns[t]);
      if (t == 0) tokens.insert(tokens.begin(), grid.engine->bos_id());
      forward = sequence->feed(feeder(tokens), /*turn_start=*/true, /*all_logits=*/false);
    }
    const std::size_t live_at_question = sequence->counters().live_kv_bytes;
    const std::string answer = greedy_answer(*grid.engine, *sequence, feeder, forward,
                                             kGroceryMaxAnswerTokens, AnswerEnd::at_eos_or_period);
    totals.add(sequence->counters(), live_at_question);
    const double recall = item_recall(answer, doc.items);
    recall_sum += recall;
    exact += answer == doc.expected_answer ? 1 : 0;
    documents.push_back({{"items", doc.items}, {"answer", answer}, {"item_recall", recall}});
  }
  OrderedJson& metrics = result["metrics"];
  totals.write(metrics, seconds_since(start));
  metrics["item_recall"] = recall_sum / task.documents;
  metrics["exact"] = static_cast<double>(exact) / task.documents;
  metrics["documents"] = task.documents;
  result["details"]["documents"] = std::move(documents);
}

}  // namespace kvevict::eval::tasks
