#include "eval/task_support.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "eval/documents.hpp"

namespace kvevict::eval::tasks {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The task's question, the catalyst InfiniPot gets where the task has one.
std::optional<std::string> task_question(TaskKind kind) {
  if (kind == TaskKind::passkey) return std::string(kPasskeyQuestion);
  if (kind == TaskKind::grocery) return std::string(kGroceryQuestion);
  return std::nullopt;
}

std::int32_t argmax(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

std::vector<std::int32_t> bytes_to_tokens(std::string_view text) {
  std::vector<std::int32_t> tokens;
  tokens.reserve(text.size());
  for (const char c : text) tokens.push_back(static_cast<std::uint8_t>(c));
  return tokens;
}

// Feeds `tokens` (byte-level text) as turns: a new turn (turn_start) begins after every
// occurrence of `separator`, and the first piece starts one too; no separator = one turn.
FeedLogits feed_turns(EvalSequence& sequence, Feeder& feeder, std::span<const std::int32_t> tokens,
                      const std::string& separator) {
  FeedLogits forward;
  std::size_t begin = 0;  // the current turn is [begin, end)
  std::string tail;       // the last separator.size() bytes decoded
  for (std::size_t end = 0; end < tokens.size();) {
    if (!separator.empty()) {
      tail += static_cast<char>(tokens[end]);
      if (tail.size() > separator.size()) tail.erase(0, 1);
    }
    ++end;
    if (end == tokens.size() || (!separator.empty() && tail == separator)) {
      forward = sequence.feed(feeder(tokens.subspan(begin, end - begin)), /*turn_start=*/true,
                              /*all_logits=*/false);
      begin = end;
    }
  }
  return forward;
}

// Greedy decoding of an answer under the cell's policy, starting from the logits of `forward`
// (the question's last forward). Every answer token but the last is fed back (with anchors where
// the grid inserts them); the last is never fed, nothing reads its logits.
std::string greedy_answer(const EvalEngine& engine, EvalSequence& sequence, Feeder& feeder,
                          FeedLogits forward, int max_tokens, AnswerEnd end) {
  std::string answer;
  for (int k = 0; k < max_tokens; ++k) {
    const std::int32_t token = argmax(forward.last());
    if (end == AnswerEnd::at_eos_or_period && token == engine.eos_id()) break;
    answer += engine.decode(token);
    if (k + 1 == max_tokens || (end == AnswerEnd::at_eos_or_period && answer.ends_with('.'))) {
      break;
    }
    forward = sequence.feed(feeder(std::span<const std::int32_t>(&token, 1)), /*turn_start=*/false,
                            /*all_logits=*/false);
  }
  return answer;
}

}  // namespace kvevict::eval::tasks
