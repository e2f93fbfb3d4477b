// The passkey task: a five-digit key hidden at a depth of a filler document of `length` tokens,
// asked for at the end and answered greedily; per-digit accuracy and exact matches.
#include <cstdint>
#include <string>
#include <vector>

#include "eval/documents.hpp"
#include "eval/task_support.hpp"

namespace kvevict::eval::tasks {

void run_passkey(const GridContext& grid, const CellSpec& cell, OrderedJson& result) {
  const EvalConfig& config = grid.config;
  const TaskConfig& task = config.tasks[cell.task_index];
  const Clock::time_point start = Clock::now();
  CacheTotals totals;
  double digits_sum = 0;
  int exact = 0;
  OrderedJson documents = OrderedJson::array();
  for (int d = 0; d < task.documents; ++d) {
    Rng rng(mix_seed({config.seed, hash_name("passkey"), static_cast<std::uint64_t>(d),
                      double_bits(*cell.depth), static_cast<std::uint64_t>(*cell.length)}));
    const PasskeyDocument doc = make_passkey_document(grid.filler, *cell.length, *cell.depth, rng);
    CellSequence sequence(grid, cell);
    if (d == 0) result["policy_setup"] = sequence.policy_json();
    Feeder feeder(grid);
    std::vector<std::int32_t> prompt = bytes_to_tokens(doc.text);
    prompt.insert(prompt.begin(), grid.engine->bos_id());
    const FeedLogits forward = feed_turns(*sequence, feeder, prompt, task.turn_separator);
    const std::size_t live_at_question = sequence->counters().live_kv_bytes;
    const std::string answer = greedy_answer(*grid.engine, *sequence, feeder, forward,
                                             kPasskeyDigits, AnswerEnd::after_max_tokens);
    totals.add(sequence->counters(), live_at_question);
    const double accuracy = per_digit_accuracy(answer, doc.key);
    digits_sum += accuracy;
    exact += answer == doc.key ? 1 : 0;
    documents.push_back({{"key", doc.key},
                         {"answer", answer},
                         {"per_digit", accuracy},
                         {"key_position", doc.key_position}});
  }
  OrderedJson& metrics = result["metrics"];
  totals.write(metrics, seconds_since(start));
  metrics["per_digit"] = digits_sum / task.documents;
  metrics["exact"] = static_cast<double>(exact) / task.documents;
  metrics["documents"] = task.documents;
  result["details"]["documents"] = std::move(documents);
}

}  // namespace kvevict::eval::tasks
