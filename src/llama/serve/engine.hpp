// The decode side of `kvevict-llama serve`: one thread owns a LlamaSequenceSet (many sequences in
// one llama_context, one llama_decode per step, optionally one KvPool) and the sampling; the HTTP
// handler threads hand it Jobs and read their output through each Job's own channel.
//
// Slots: `parallel` of them, each at most one sequence of the set. A slot remembers every token
// its sequence has consumed (its history), so a request whose prompt extends a free slot's history
// under the same policy continues that sequence and feeds only the new tokens (a chat client
// re-sending the whole conversation): its usage says how many prompt tokens were reused and how
// many of those the cache no longer holds. Any other request takes an empty slot, else the least
// recently used free one (whose conversation is closed).
//
// A step feeds every busy slot: the next chunk of its prompt (at most --chunk tokens, never across
// a full pot, as LlamaSequence::feed splits), or the token it sampled last. Requests join and leave
// between steps (continuous batching). A request cancelled by its client (a stream whose reader
// left) closes its sequence before the next step, freeing its cells.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <kvevict/llama/llama_sequence_set.hpp>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "harness/policy_setup.hpp"
#include "harness/sampling.hpp"
#include "llama/cli/llama_model.hpp"
#include "llama/cli/llama_options.hpp"

namespace kvevict::llama_serve {

/// An error a request ends with: HTTP status, message, OpenAI error type.
struct RequestError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
};

/// What a finished request reports (OpenAI's usage plus kvevict's).
struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int reused_prompt_tokens = 0;     ///< prompt tokens the slot had consumed already (not fed again)
  int evicted_prompt_tokens = 0;    ///< of those, the ones its cache no longer held
  int cache_tokens = 0;             ///< cells the sequence holds at the end
  std::int64_t evicted_tokens = 0;  ///< tokens the sequence's policy (and pool) evicted in all
  int slot = -1;
};

/// One request: its input (set before Engine::submit) and its output channel.
class Job {
 public:
  // Input.
  std::vector<std::int32_t> prompt;
  int max_tokens = 1;
  harness::SamplingOptions sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;  ///< llama-server's field: end-of-generation tokens are text too
  harness::PolicyOptions policy;
  std::string policy_key;  ///< equal keys: equal policies (slot reuse)

  /// What the handler has not read yet.
  struct Update {
    std::string text;  ///< text generated since the last update (whole UTF-8 characters)
    bool started = false;
    bool done = false;
  };
  /// Waits up to `timeout` for new text, the start or the end; takes the new text.
  Update wait(std::chrono::milliseconds timeout);
  /// Waits until the job has a slot (or has ended); true when it got one.
  bool wait_started();
  void cancel() { cancelled_.store(true); }
  [[nodiscard]] bool cancelled() const { return cancelled_.load(); }

  // After done:
  [[nodiscard]] const std::optional<RequestError>& error() const { return error_; }
  [[nodiscard]] const std::string& finish_reason() const { return finish_reason_; }
  [[nodiscard]] const Usage& usage() const { return usage_; }
  [[nodiscard]] const std::string& text() const { return text_; }
  [[nodiscard]] const std::vector<std::int32_t>& tokens() const { return tokens_; }

  // Engine side.
  void start();
  void emit(std::string_view text);
  void finish(std::string finish_reason, const Usage& usage, std::vector<std::int32_t> tokens,
              std::string tail);
  void fail(RequestError error);

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::string text_;  // everything emitted
  std::size_t taken_ = 0;
  bool started_ = false;
  bool done_ = false;
  std::optional<RequestError> error_;
  std::string finish_reason_;
  Usage usage_;
  std::vector<std::int32_t> tokens_;
  std::atomic<bool> cancelled_{false};
};

struct EngineOptions {
  int parallel = 4;
  int queue = 16;
  std::int64_t pool_cells = 0;  ///< one KvPool for all slots; 0: each slot n_ctx / parallel
  int chunk = 64;               ///< most prompt tokens a slot is fed per step
};

struct SlotMetrics {
  bool busy = false;
  bool open = false;
  std::string policy;
  std::int64_t history_tokens = 0;
  int live_cells = 0;
  int peak_cells = 0;
  std::int64_t evicted_tokens = 0;
  double tokens_per_second = 0;  ///< decode rate of its last request
  std::int64_t requests = 0;
  std::vector<std::int64_t> kept_positions;  ///< original positions kept, after its last request
};

struct EngineMetrics {
  std::vector<SlotMetrics> slots;
  std::size_t bytes_per_cell = 0;
  std::int64_t context_cells = 0;
  std::int64_t pool_cells = 0;
  std::int64_t pool_used = 0;
  std::int64_t pool_charged = 0;
  std::int64_t pool_peak = 0;
  std::int64_t pool_cuts = 0;
  std::int64_t pool_pressed_steps = 0;
  std::int64_t steps = 0;
  int queued = 0;
  int active = 0;
  std::int64_t requests_finished = 0;
  std::int64_t requests_failed = 0;
  std::int64_t requests_cancelled = 0;
  std::int64_t prompt_tokens = 0;
  std::int64_t reused_prompt_tokens = 0;
  std::int64_t generated_tokens = 0;
};

class Engine {
 public:
  /// Creates the context (n_ctx = llama.context) and starts the decode thread. `model` must
  /// outlive the engine.
  Engine(const llama_cli::LlamaModel& model, const llama_cli::LlamaOptions& llama,
         const harness::PolicyOptions& defaults, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  enum class Admission { accepted, queue_full, draining };
  /// Queues the job unless parallel + queue jobs are in the engine already, or it drains.
  Admission submit(const std::shared_ptr<Job>& job);
  /// Stops admitting; returns true once no job is left, false at `timeout`.
  bool drain(std::chrono::milliseconds timeout);
  [[nodiscard]] bool draining() const;

  [[nodiscard]] EngineMetrics metrics() const;
  /// Cells one slot may hold: the pool's, or n_ctx / parallel without a pool.
  [[nodiscard]] std::int64_t slot_cells() const;
  [[nodiscard]] const EngineOptions& options() const { return options_; }

 private:
  struct Slot;
  enum class Assigned { started, ended, blocked };

  void run();
  Assigned assign(const std::shared_ptr<Job>& job);
  bool open_sequence(Slot& slot, const Job& job, std::string& failure);
  void close_sequence(Slot& slot);
  void release(Slot& slot);
  void sampled(Slot& slot, std::int32_t token);
  void finish(Slot& slot, std::string reason);
  void fail(Slot& slot, RequestError error);
  void publish();
  [[nodiscard]] bool end_of_generation(std::int32_t token) const;

  const llama_cli::LlamaModel& model_;
  EngineOptions options_;
  std::unique_ptr<llama::LlamaSequenceSet> set_;
  std::vector<Slot> slots_;
  std::uint64_t uses_ = 0;  // slot use counter (least recently used)

  mutable std::mutex mutex_;  // pending_, in_engine_, draining_, stopping_, blocked_
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<std::shared_ptr<Job>> pending_;
  int in_engine_ = 0;  // admitted and not ended
  bool draining_ = false;
  bool stopping_ = false;
  bool blocked_ = false;  // the first pending job waits for a busy slot to end

  mutable std::mutex metrics_mutex_;
  EngineMetrics metrics_;
  std::thread thread_;
};

}  // namespace kvevict::llama_serve
