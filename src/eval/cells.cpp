// The grid's cells: enumeration, preparation (model, text, checks) and running one cell of each
// task over the grid's engine (eval/engine.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <kvevict/error.hpp>
#include <kvevict/policies/infinipot.hpp>
#include <map>
#include <memory>
#include <set>
#include <span>

#include "eval/engine.hpp"
#include "eval/grid.hpp"
#include "eval/machine_info.hpp"
#include "eval/sha256.hpp"
#include "harness/anchor_inserter.hpp"
#include "harness/log_loss.hpp"
#include "harness/policy_setup.hpp"
#include "harness/report.hpp"

namespace kvevict::eval {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using OrderedJson = nlohmann::ordered_json;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Letters, digits, '.', '_' and '-' kept; anything else becomes '_'.
std::string slug(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const bool safe = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-';
    out += safe ? c : '_';
  }
  return out.substr(0, 60);
}

// The task's question, the catalyst InfiniPot gets where the task has one.
std::optional<std::string> task_question(TaskKind kind) {
  if (kind == TaskKind::passkey) return std::string(kPasskeyQuestion);
  if (kind == TaskKind::grocery) return std::string(kGroceryQuestion);
  return std::nullopt;
}

// The passkey lengths a cell list uses at `budget` (nullopt: the union over every budget).
std::vector<std::int64_t> passkey_lengths(const EvalConfig& config, const TaskConfig& task,
                                          std::optional<int> budget) {
  if (!task.lengths.empty()) return task.lengths;
  std::set<std::int64_t> lengths;
  if (budget) {
    for (const std::int64_t factor : task.length_x_budget) lengths.insert(factor * *budget);
  } else {
    for (const PolicyEntry& entry : config.policies) {
      for (const int b : entry.budgets) {
        for (const std::int64_t factor : task.length_x_budget) lengths.insert(factor * b);
      }
    }
  }
  return {lengths.begin(), lengths.end()};
}

// The task entry without the lists that only enumerate variants (depths, lengths, turns), so that
// adding a variant leaves the existing cells' hashes as they are.
OrderedJson task_hash_json(const TaskConfig& task) {
  OrderedJson json = to_json(task);
  json.erase("depths");
  json.erase("lengths");
  json.erase("length_x_budget");
  json.erase("turns");
  return json;
}

// The policy entry without its label (cosmetic) and budgets (they enumerate cells).
OrderedJson policy_hash_json(const PolicyEntry& entry) {
  OrderedJson json = to_json(entry);
  json.erase("label");
  json.erase("budgets");
  return json;
}

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

std::int32_t argmax(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

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

std::vector<std::int32_t> bytes_to_tokens(std::string_view text) {
  std::vector<std::int32_t> tokens;
  tokens.reserve(text.size());
  for (const char c : text) tokens.push_back(static_cast<std::uint8_t>(c));
  return tokens;
}

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

// --- Tasks --------------------------------------------------------------------------------------

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

enum class AnswerEnd {
  after_max_tokens,  ///< exactly max_tokens tokens (passkey digits)
  at_eos_or_period,  ///< EOS (not part of the answer), the first '.', or max_tokens
};

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

// Throws when an unbounded policy at `budget` would feed a sequence more tokens than the engine's
// `capacity` (llama.cpp's context): the longest stream or document of any task, answer tokens
// included (anchors, when inserted, add more).
void check_capacity(const EvalConfig& config, std::optional<int> budget, std::int64_t capacity) {
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskConfig& task = config.tasks[t];
    std::int64_t longest = task.tokens;  // stream_bpb, cost
    if (task.kind == TaskKind::passkey) {
      const std::vector<std::int64_t> lengths = passkey_lengths(config, task, budget);
      if (lengths.empty()) continue;  // no cell
      longest = *std::max_element(lengths.begin(), lengths.end()) + kPasskeyDigits - 1;
    } else if (task.kind == TaskKind::grocery) {
      longest = task.length + kGroceryMaxAnswerTokens - 1;
    }
    if (longest > capacity) {
      throw Error(
          fmt::format("the policy keeps every token and tasks[{}] ({}) feeds up to {} "
                      "tokens, more than the engine's {} cells (kvevict-llama -c)",
                      t, to_string(task.kind), longest, capacity));
    }
  }
}

bool is_file(const fs::path& path) {
  std::error_code error;
  return fs::is_regular_file(path, error);
}

}  // namespace

// --- Cells --------------------------------------------------------------------------------------

OrderedJson CellSpec::variant_json() const {
  OrderedJson json = OrderedJson::object();
  if (length) json["length"] = *length;
  if (depth) json["depth"] = *depth;
  if (turns) json["turns"] = *turns;
  return json;
}

std::string CellSpec::describe(const EvalConfig& config) const {
  std::string text = fmt::format("{} {} budget={}", to_string(config.tasks[task_index].kind),
                                 config.policies[policy_index].label,
                                 budget ? std::to_string(*budget) : std::string("-"));
  if (length) text += fmt::format(" length={}", *length);
  if (depth) text += fmt::format(" depth={}", *depth);
  if (turns) text += fmt::format(" turns={}", *turns);
  return text;
}

std::vector<CellSpec> enumerate_cells(const EvalConfig& config) {
  std::vector<CellSpec> cells;
  std::map<std::string, std::string> slugs;  // slug -> label, to refuse two labels with one id
  for (const PolicyEntry& entry : config.policies) {
    const auto [it, inserted] = slugs.emplace(slug(entry.label), entry.label);
    if (!inserted) {
      throw Error(
          fmt::format("{}: policy labels '{}' and '{}' give the same cell file name '{}': "
                      "rename one",
                      config.source, it->second, entry.label, it->first));
    }
  }
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskConfig& task = config.tasks[t];
    for (std::size_t p = 0; p < config.policies.size(); ++p) {
      const PolicyEntry& entry = config.policies[p];
      std::vector<std::optional<int>> budgets;
      for (const int budget : entry.budgets) budgets.emplace_back(budget);
      if (budgets.empty()) budgets.emplace_back(std::nullopt);
      for (const std::optional<int> budget : budgets) {
        CellSpec base;
        base.task_index = t;
        base.policy_index = p;
        base.budget = budget;
        const std::string prefix =
            fmt::format("t{}-{}-{}-{}", t, to_string(task.kind), slug(entry.label),
                        budget ? fmt::format("b{}", *budget) : std::string("full"));
        switch (task.kind) {
          case TaskKind::stream_bpb:
          case TaskKind::cost:
            base.id = prefix;
            cells.push_back(base);
            break;
          case TaskKind::passkey:
            for (const std::int64_t length : passkey_lengths(config, task, budget)) {
              for (const double depth : task.depths) {
                CellSpec cell = base;
                cell.length = length;
                cell.depth = depth;
                cell.id = fmt::format("{}-L{}-d{}", prefix, length, depth);
                cells.push_back(cell);
              }
            }
            break;
          case TaskKind::grocery:
            for (const int turns : task.turns) {
              CellSpec cell = base;
              cell.length = task.length;
              cell.turns = turns;
              cell.id = fmt::format("{}-T{}", prefix, turns);
              cells.push_back(cell);
            }
            break;
        }
      }
    }
  }
  return cells;
}

ModelChecksum checksum_model(const fs::path& path) {
  std::vector<fs::path> files;
  std::error_code error;
  if (fs::is_directory(path, error)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(path)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
    // A .safetensors model reads config.json beside it (model.cpp): part of the model too.
    const fs::path config = path.parent_path() / "config.json";
    if (path.extension() == ".safetensors" && is_file(config)) files.push_back(config);
  }
  if (files.empty()) throw Error(fmt::format("model directory '{}' holds no files", path.string()));
  ModelChecksum checksum;
  checksum.files = OrderedJson::array();
  std::string listing;
  for (const fs::path& file : files) {
    const std::string sha = sha256_file(file);
    checksum.files.push_back(
        {{"path", file.string()}, {"bytes", fs::file_size(file)}, {"sha256", sha}});
    listing += sha + "  " + file.filename().string() + "\n";
  }
  checksum.sha256 =
      files.size() == 1 ? checksum.files[0]["sha256"].get<std::string>() : sha256_hex(listing);
  return checksum;
}

GridContext prepare_grid(EvalConfig config) {
  return prepare_grid(std::move(config), reference_engine);
}

GridContext prepare_grid(EvalConfig config, const EngineLoader& load) {
  std::vector<CellSpec> cells = enumerate_cells(config);
  std::shared_ptr<const EvalEngine> engine = load(config.model);
  ModelChecksum model_checksum = checksum_model(config.model);

  if (!is_file(config.text)) {
    throw Error(fmt::format("{}: text file '{}' does not exist", config.source, config.text));
  }
  std::ifstream in(config.text, std::ios::binary);
  std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (text.empty())
    throw Error(fmt::format("{}: text file '{}' is empty", config.source, config.text));
  std::vector<std::int32_t> text_tokens = engine->encode(text, /*add_bos=*/false);
  if (text_tokens.empty()) {
    throw Error(fmt::format("{}: text file '{}' holds no tokens", config.source, config.text));
  }
  std::optional<FillerText> filler;
  try {
    filler.emplace(text);
  } catch (const Error& error) {
    throw Error(fmt::format("{}: text file '{}': {}", config.source, config.text, error.what()));
  }

  const model::Tokenizer* tokenizer = engine->kvevict_tokenizer();
  for (std::size_t t = 0; t < config.tasks.size(); ++t) {
    const TaskKind kind = config.tasks[t].kind;
    if ((kind == TaskKind::passkey || kind == TaskKind::grocery) &&
        (tokenizer == nullptr || tokenizer->kind != model::Tokenizer::Kind::byte_level ||
         tokenizer->bos_id < 0)) {
      throw Error(fmt::format(
          "{}: tasks[{}]: the {} task builds byte-level documents and needs a "
          "byte-level tokenizer with BOS; model '{}' has {}",
          config.source, t, to_string(kind), config.model,
          tokenizer == nullptr ? "a vocabulary only llama.cpp tokenizes" : "neither or not both"));
    }
  }
  if (config.anchors) {
    try {
      if (tokenizer == nullptr) {
        throw Error(
            fmt::format("model '{}' has a vocabulary only llama.cpp tokenizes, without "
                        "kvevict's <AC> anchor",
                        config.model));
      }
      (void)harness::AnchorInserter::for_tokenizer(*tokenizer);
    } catch (const Error& error) {
      throw Error(fmt::format("{}: anchors: {}", config.source, error.what()));
    }
  }
  for (std::size_t p = 0; p < config.policies.size(); ++p) {
    const PolicyEntry& entry = config.policies[p];
    std::vector<std::optional<int>> budgets(entry.budgets.begin(), entry.budgets.end());
    if (budgets.empty()) budgets.emplace_back(std::nullopt);
    for (const std::optional<int> budget : budgets) {
      try {
        harness::PolicySetup setup = engine->make_setup(entry.options(budget, config.chunk));
        const bool keeps_every_token = !setup.policy->retained_limit();
        const std::optional<std::int64_t> capacity = engine->check(setup);
        if (keeps_every_token && capacity) check_capacity(config, budget, *capacity);
      } catch (const Error& error) {
        throw Error(fmt::format("{}: policies[{}] ({}){}: {}", config.source, p, entry.label,
                                budget ? fmt::format(" at budget {}", *budget) : std::string(),
                                error.what()));
      }
    }
  }
  std::string config_sha256 = sha256_hex(to_json(config).dump());
  std::string text_sha256 = sha256_hex(text);
  return GridContext{std::move(config),  std::move(engine),        std::move(model_checksum),
                     std::move(text),    std::move(text_sha256),   std::move(text_tokens),
                     std::move(*filler), std::move(config_sha256), std::move(cells)};
}

OrderedJson cell_config_json(const EvalConfig& config, std::string_view model_sha256,
                             std::string_view text_sha256, std::string_view engine,
                             const CellSpec& cell) {
  OrderedJson json;
  json["grid"] = config.name;
  // Paths are left out on purpose: the checksums say what was run, wherever it lies.
  json["model_sha256"] = model_sha256;
  json["text_sha256"] = text_sha256;
  json["seed"] = config.seed;
  json["chunk"] = config.chunk;
  json["anchors"] = config.anchors;
  json["policy"] = policy_hash_json(config.policies[cell.policy_index]);
  json["budget"] = cell.budget ? OrderedJson(*cell.budget) : OrderedJson(nullptr);
  json["task"] = task_hash_json(config.tasks[cell.task_index]);
  json["variant"] = cell.variant_json();
  // Only for another engine than kvevict's decoder, so that kvevict's cells keep their hashes and
  // neither engine resumes the other's cells.
  if (engine != kReferenceEngine) json["engine"] = engine;
  return json;
}

OrderedJson cell_config_json(const GridContext& grid, const CellSpec& cell) {
  return cell_config_json(grid.config, grid.model_checksum.sha256, grid.text_sha256,
                          grid.engine->name(), cell);
}

OrderedJson run_cell(const GridContext& grid, const CellSpec& cell) {
  const EvalConfig& config = grid.config;
  const TaskConfig& task = config.tasks[cell.task_index];
  const PolicyEntry& entry = config.policies[cell.policy_index];
  OrderedJson result;
  const OrderedJson cell_config = cell_config_json(grid, cell);
  result["id"] = cell.id;
  result["grid"] = config.name;
  result["cell_hash"] = sha256_hex(cell_config.dump());
  result["git_revision"] = git_revision();
  result["engine"] = grid.engine->name();
  result["task"] = std::string(to_string(task.kind));
  result["task_index"] = cell.task_index;
  result["policy"] = entry.policy;
  result["label"] = entry.label;
  result["policy_index"] = cell.policy_index;
  result["budget"] = cell.budget ? OrderedJson(*cell.budget) : OrderedJson(nullptr);
  result["variant"] = cell.variant_json();
  result["config"] = cell_config;
  result["policy_setup"] = nullptr;
  result["metrics"] = OrderedJson::object();
  result["details"] = OrderedJson::object();
  switch (task.kind) {
    case TaskKind::stream_bpb:
      run_stream_bpb(grid, cell, result);
      break;
    case TaskKind::passkey:
      run_passkey(grid, cell, result);
      break;
    case TaskKind::grocery:
      run_grocery(grid, cell, result);
      break;
    case TaskKind::cost:
      run_cost(grid, cell, result);
      break;
  }
  const ProcessMemory memory = process_memory();
  result["metrics"]["rss_bytes"] = memory.rss_bytes;
  result["metrics"]["peak_rss_bytes"] = memory.peak_rss_bytes;
  return result;
}

Headline headline(const OrderedJson& cell_result) {
  const std::string task = cell_result.value("task", "");
  const OrderedJson& metrics = cell_result.at("metrics");
  Headline line;
  const auto number = [&](const char* key) {
    return metrics.contains(key) && metrics.at(key).is_number() ? metrics.at(key).get<double>()
                                                                : std::nan("");
  };
  if (task == "stream_bpb") {
    line = {"bits/byte", number("bits_per_byte"), ""};
    line.text = fmt::format("bits/byte {:.4f}", line.value);
  } else if (task == "passkey") {
    line = {"per-digit", number("per_digit"), ""};
    line.text = fmt::format("per-digit {:.3f}, exact {:.3f}", line.value, number("exact"));
  } else if (task == "grocery") {
    line = {"recall", number("item_recall"), ""};
    line.text = fmt::format("recall {:.3f}, exact {:.3f}", line.value, number("exact"));
  } else {
    line = {"tokens/s", number("tokens_per_second"), ""};
    line.text =
        fmt::format("{:.0f} tokens/s, peak RSS {}", line.value,
                    harness::format_bytes(static_cast<std::uint64_t>(number("peak_rss_bytes"))));
  }
  return line;
}

}  // namespace kvevict::eval
