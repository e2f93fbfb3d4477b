// The engine seam of the eval harness: what a cell needs of the model that computes it. `kvevict
// eval` runs kvevict's reference decoder (reference_engine below); `kvevict-llama eval` runs
// llama.cpp through kvevict::llama::LlamaSequence (src/llama/cli/eval_engine.cpp). The tasks
// (cells.cpp) see only these two interfaces, so both engines run the same documents, chunks,
// turns, scoring and answers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <kvevict/model/model.hpp>
#include <kvevict/timing.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "harness/policy_setup.hpp"

namespace kvevict::eval {

/// Logits of a feed: [rows, vocab] row-major, valid until the sequence's next feed.
struct FeedLogits {
  std::span<const float> values;
  int vocab = 0;
  [[nodiscard]] std::span<const float> last() const {
    return values.subspan(values.size() - static_cast<std::size_t>(vocab));
  }
};

/// What a sequence has done so far (a cell sums them over its documents).
struct SequenceCounters {
  std::int64_t tokens_fed = 0;     ///< stream tokens (catalyst tokens excluded)
  std::int64_t forwards = 0;       ///< forwards of the stream
  std::int64_t catalyst_runs = 0;  ///< catalyst prompts run
  std::size_t live_kv_bytes = 0;   ///< K and V bytes the cache holds now
  std::size_t peak_kv_bytes = 0;   ///< the most it held
  std::int64_t evicted_slots = 0;
  std::int64_t decisions = 0;   ///< the policy's eviction decisions
  double forward_seconds = 0;   ///< the model's computation
  double eviction_seconds = 0;  ///< policy + reposition + catalyst
  /// The engine's stages ("attention_seconds", ...): what it can time apart.
  std::vector<std::pair<std::string, double>> stage_seconds;
};

/// One sequence under one cell's policy (a cell runs one per document).
class EvalSequence {
 public:
  virtual ~EvalSequence() = default;
  /// Feeds any number of tokens as forwards of at most the grid's chunk, also split where the
  /// policy's pot fills; the first starts a turn when `turn_start`. Logits of every token fed
  /// (`all_logits`) or of the last one.
  virtual FeedLogits feed(std::span<const std::int32_t> tokens, bool turn_start,
                          bool all_logits) = 0;
  [[nodiscard]] virtual SequenceCounters counters() const = 0;
  /// The cell's "policy_setup" (resolved params, positions, granularity, keys, chunk).
  [[nodiscard]] virtual nlohmann::ordered_json policy_json() const = 0;
};

/// The name of kvevict's reference decoder as an engine.
inline constexpr std::string_view kReferenceEngine = "kvevict";

/// A model loaded once by the grid's parent, with its tokenizer; sequences start from it.
class EvalEngine {
 public:
  virtual ~EvalEngine() = default;
  /// kReferenceEngine, or "llama.cpp ggml <version> commit <commit>": what results record.
  [[nodiscard]] virtual std::string name() const = 0;
  /// {"format", "context_length"} of the model.
  [[nodiscard]] virtual nlohmann::ordered_json model_json() const = 0;

  /// kvevict's tokenizer when it holds the model's vocabulary (byte-level documents and anchors
  /// need it); null when the engine tokenizes with its own (llama.cpp's BPE vocabularies).
  [[nodiscard]] virtual const model::Tokenizer* kvevict_tokenizer() const = 0;
  [[nodiscard]] virtual std::vector<std::int32_t> encode(std::string_view text,
                                                         bool add_bos) const = 0;
  /// The bytes of token `id`'s text (empty for control tokens).
  [[nodiscard]] virtual std::string decode(std::int32_t id) const = 0;
  /// The token a stream starts with; -1 when the model starts without one.
  [[nodiscard]] virtual std::int32_t bos_id() const = 0;
  [[nodiscard]] virtual std::int32_t eos_id() const = 0;
  /// The text bytes of every token of the vocabulary (bits per byte are per byte of text).
  [[nodiscard]] virtual std::vector<std::uint32_t> token_bytes() const = 0;

  /// The policy as the engine's CLI builds it from `options`. Throws kvevict::Error.
  [[nodiscard]] virtual harness::PolicySetup make_setup(
      const harness::PolicyOptions& options) const = 0;
  /// Throws kvevict::Error when the engine cannot run `setup` (checked for every policy entry at
  /// every budget before the grid runs); else returns the tokens a sequence can hold at most
  /// (llama.cpp's context), nullopt for as many as it is fed. Consumes the setup's policy.
  [[nodiscard]] virtual std::optional<std::int64_t> check(harness::PolicySetup& setup) const = 0;
  /// A sequence with the setup's policy (moved into it), `threads` threads, stages timed on
  /// `clock` (which must outlive it).
  [[nodiscard]] virtual std::unique_ptr<EvalSequence> start(harness::PolicySetup& setup,
                                                            int threads,
                                                            StageClock& clock) const = 0;
};

/// Loads the model at a path into an engine (the grid's parent does it once).
using EngineLoader = std::function<std::unique_ptr<EvalEngine>(const std::string& model)>;

/// kvevict's reference decoder over `model` (a file or directory harness::load_model_file reads).
[[nodiscard]] std::unique_ptr<EvalEngine> reference_engine(const std::string& model);

}  // namespace kvevict::eval
