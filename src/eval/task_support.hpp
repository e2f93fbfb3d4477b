// What the four task bodies of the eval harness share (task_stream_bpb.cpp, task_passkey.cpp,
// task_grocery.cpp, task_cost.cpp): the engine's sequence set up for a cell, the cache figures a
// cell records, the grid's text cycled into a stream, turns, and greedy answers. Internal to
// src/eval: run_cell (run_cell.cpp) runs a cell through these.
#pragma once

#include <chrono>
#include <cstdint>
#include <kvevict/policies/infinipot.hpp>
#include <kvevict/timing.hpp>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "harness/anchor_inserter.hpp"
#include "harness/policy_setup.hpp"

namespace kvevict::eval::tasks {

using Clock = std::chrono::steady_clock;
using OrderedJson = nlohmann::ordered_json;

// --- The four tasks: each fills the cell's "policy_setup", "metrics" and "details" -------------

void run_stream_bpb(const GridContext& grid, const CellSpec& cell, OrderedJson& result);
void run_passkey(const GridContext& grid, const CellSpec& cell, OrderedJson& result);
void run_grocery(const GridContext& grid, const CellSpec& cell, OrderedJson& result);
void run_cost(const GridContext& grid, const CellSpec& cell, OrderedJson& result);

// --- What they share
// ------------------------------------------------------------------------------

/// Seconds from `start` to now.
[[nodiscard]] double seconds_since(Clock::time_point start);

// The task's question, the catalyst InfiniPot gets where the task has one.
[[nodiscard]] std::optional<std::string> task_question(TaskKind kind);

/// The token of the largest logit (the first of equals).
[[nodiscard]] std::int32_t argmax(std::span<const float> logits);

/// The bytes of `text` as byte-level tokens.
[[nodiscard]] std::vector<std::int32_t> bytes_to_tokens(std::string_view text);

// Sum / max of the sequence figures over the sequences of one cell (one per document).
class CacheTotals {
 public:
  void add(const SequenceCounters& counters, std::size_t live_kv_bytes) {
    tokens_fed_ += counters.tokens_fed;
    forwards_ += counters.forwards;
    catalyst_runs_ += counters.catalyst_runs;
    forward_seconds_ += counters.forward_seconds;
    eviction_seconds_ += counters.eviction_seconds;
    for (const auto& [name, seconds] : counters.stage_seconds) split_[name] += seconds;
    peak_kv_bytes_ = std::max(peak_kv_bytes_, counters.peak_kv_bytes);
    evicted_slots_ += counters.evicted_slots;
    decisions_ += counters.decisions;
    live_kv_bytes_sum_ += static_cast<double>(live_kv_bytes);
    ++sequences_;
  }

  [[nodiscard]] std::int64_t tokens_fed() const { return tokens_fed_; }

  void write(OrderedJson& metrics, double wall_seconds) const {
    metrics["wall_seconds"] = wall_seconds;
    metrics["tokens_fed"] = tokens_fed_;
    metrics["tokens_per_second"] =
        wall_seconds > 0 ? static_cast<double>(tokens_fed_) / wall_seconds : 0.0;
    metrics["live_kv_bytes"] = sequences_ > 0 ? live_kv_bytes_sum_ / sequences_ : 0.0;
    metrics["peak_kv_bytes"] = peak_kv_bytes_;
    metrics["evicted_slots"] = evicted_slots_;
    metrics["decisions"] = decisions_;
    metrics["catalyst_runs"] = catalyst_runs_;
    metrics["forwards"] = forwards_;
    metrics["forward_seconds"] = forward_seconds_;
    metrics["eviction_seconds"] = eviction_seconds_;
    metrics["eviction_seconds_per_token"] =
        tokens_fed_ > 0 ? eviction_seconds_ / static_cast<double>(tokens_fed_) : 0.0;
    for (const auto& [name, seconds] : split_) metrics[name] = seconds;
  }

 private:
  std::int64_t tokens_fed_ = 0;
  std::int64_t forwards_ = 0;
  std::int64_t catalyst_runs_ = 0;
  double forward_seconds_ = 0;
  double eviction_seconds_ = 0;
  std::size_t peak_kv_bytes_ = 0;
  std::int64_t evicted_slots_ = 0;
  std::int64_t decisions_ = 0;
  double live_kv_bytes_sum_ = 0;
  int sequences_ = 0;
  std::map<std::string, double> split_;
};

// The engine's sequence set up for one cell, as the engine's CLI would set it up.
class CellSequence {
 public:
  CellSequence(const GridContext& grid, const CellSpec& cell) {
    const EvalConfig& config = grid.config;
    const PolicyEntry& entry = config.policies[cell.policy_index];
    harness::PolicySetup setup = grid.engine->make_setup(entry.options(cell.budget, config.chunk));
    const TaskKind kind = config.tasks[cell.task_index].kind;
    if (setup.catalyst && !entry.catalyst) {
      if (const std::optional<std::string> question = task_question(kind)) {
        setup.catalyst = grid.engine->encode(*question, /*add_bos=*/false);
        catalyst_ = *question;
      } else {
        catalyst_ = std::string(kInfiniPotGeneralCatalystPrompt);
      }
    } else if (setup.catalyst) {
      catalyst_ = *entry.catalyst;
    }
    sequence_ = grid.engine->start(setup, grid.threads, clock_);
  }
  CellSequence(const CellSequence&) = delete;  // the sequence holds &clock_
  CellSequence& operator=(const CellSequence&) = delete;

  [[nodiscard]] EvalSequence& operator*() { return *sequence_; }
  [[nodiscard]] EvalSequence* operator->() { return sequence_.get(); }

  [[nodiscard]] OrderedJson policy_json() const {
    OrderedJson json = sequence_->policy_json();
    json["catalyst"] = catalyst_ ? OrderedJson(*catalyst_) : OrderedJson(nullptr);
    return json;
  }

 private:
  StageClock clock_;  // before sequence_, which holds a pointer to it
  std::unique_ptr<EvalSequence> sequence_;
  std::optional<std::string> catalyst_;
};

// Tokens through the anchor inserter when the grid inserts anchors.
class Feeder {
 public:
  Feeder(const GridContext& grid) {
    // prepare_grid checked that anchors come with kvevict's tokenizer.
    if (grid.config.anchors) {
      anchors_ = harness::AnchorInserter::for_tokenizer(*grid.engine->kvevict_tokenizer());
    }
  }
  std::vector<std::int32_t> operator()(std::span<const std::int32_t> tokens) {
    if (!anchors_) return {tokens.begin(), tokens.end()};
    std::vector<std::int32_t> out;
    anchors_->push(tokens, out);
    return out;
  }
  [[nodiscard]] std::int32_t anchor_id() const { return anchors_ ? anchors_->anchor_id() : -1; }
  void finish(std::vector<std::int32_t>& out) {
    if (anchors_) anchors_->finish(out);
  }

 private:
  std::optional<harness::AnchorInserter> anchors_;
};

// BOS, then the text's tokens over and over (anchors inserted; a wrap is a document end). With a
// turn separator, the token after each occurrence of it in the text starts a turn.
class CycledText {
 public:
  CycledText(const GridContext& grid, std::string separator)
      : grid_(grid), feeder_(grid), separator_(std::move(separator)) {}

  std::int32_t next() {
    while (position_ >= pending_.size()) {
      pending_.clear();
      position_ = 0;
      separator_at_ = kNone;
      if (!started_) {
        started_ = true;
        if (grid_.engine->bos_id() >= 0) pending_.push_back(grid_.engine->bos_id());
        continue;
      }
      const std::int32_t token = grid_.text_tokens[index_];
      pending_ = feeder_(std::span<const std::int32_t>(&token, 1));
      if (!separator_.empty()) {
        tail_ += grid_.engine->decode(token);
        if (tail_.size() > separator_.size()) tail_.erase(0, tail_.size() - separator_.size());
        if (tail_ == separator_) separator_at_ = pending_.size() - 1;  // the text token is last
      }
      if (++index_ == grid_.text_tokens.size()) {
        index_ = 0;
        feeder_.finish(pending_);
      }
    }
    const std::size_t index = position_++;
    turn_next_ = index == separator_at_;
    if (turn_next_) ++turns_;
    return pending_[index];
  }
  /// Whether the token next() returns next starts a turn.
  [[nodiscard]] bool turn_starts() const { return turn_next_; }
  [[nodiscard]] std::int64_t turns() const { return turns_; }
  [[nodiscard]] std::int32_t anchor_id() const { return feeder_.anchor_id(); }

  /// Up to `size` tokens into `chunk`, fewer where `limit` tokens were handed out in all or where
  /// a turn starts (a turn always starts a chunk). Returns whether the chunk starts a turn.
  bool fill(std::vector<std::int32_t>& chunk, int size, std::int64_t& handed_out,
            std::int64_t limit) {
    chunk.clear();
    bool turn_start = false;
    while (static_cast<int>(chunk.size()) < size && handed_out < limit) {
      if (turn_starts()) {
        if (!chunk.empty()) break;
        turn_start = true;
      }
      chunk.push_back(next());
      ++handed_out;
    }
    return turn_start;
  }

 private:
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  const GridContext& grid_;
  Feeder feeder_;
  std::string separator_;
  std::string tail_;
  std::vector<std::int32_t> pending_;
  std::size_t position_ = 0;
  std::size_t index_ = 0;
  std::size_t separator_at_ = kNone;
  bool started_ = false;
  bool turn_next_ = false;
  std::int64_t turns_ = 0;
};

// Feeds `tokens` (byte-level text) as turns: a new turn (turn_start) begins after every
// occurrence of `separator`, and the first piece starts one too; no separator = one turn.
FeedLogits feed_turns(EvalSequence& sequence, Feeder& feeder, std::span<const std::int32_t> tokens,
                      const std::string& separator);

enum class AnswerEnd {
  after_max_tokens,  ///< exactly max_tokens tokens (passkey digits)
  at_eos_or_period,  ///< EOS (not part of the answer), the first '.', or max_tokens
};

// Greedy decoding of an answer under the cell's policy, starting from the logits of `forward`
// (the question's last forward). Every answer token but the last is fed back (with anchors where
// the grid inserts them); the last is never fed, nothing reads its logits.
std::string greedy_answer(const EvalEngine& engine, EvalSequence& sequence, Feeder& feeder,
                          FeedLogits forward, int max_tokens, AnswerEnd end);

}  // namespace kvevict::eval::tasks
