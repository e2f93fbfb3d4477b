#include "llama/serve/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <kvevict/error.hpp>
#include <kvevict/kv_type.hpp>
#include <utility>

#include "llama/serve/text.hpp"

namespace kvevict::llama_serve {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Job

Job::Update Job::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return done_ || taken_ < text_.size(); });
  Update update;
  update.text = text_.substr(taken_);
  taken_ = text_.size();
  update.started = started_;
  update.done = done_;
  return update;
}

bool Job::wait_started() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return started_ || done_; });
  return started_;
}

void Job::start() {
  {
    const std::lock_guard lock(mutex_);
    started_ = true;
  }
  changed_.notify_all();
}

void Job::emit(std::string_view text) {
  if (text.empty()) return;
  {
    const std::lock_guard lock(mutex_);
    text_ += text;
  }
  changed_.notify_all();
}

void Job::finish(std::string finish_reason, const Usage& usage, std::vector<std::int32_t> tokens,
                 std::string tail) {
  {
    const std::lock_guard lock(mutex_);
    text_ += tail;
    finish_reason_ = std::move(finish_reason);
    usage_ = usage;
    tokens_ = std::move(tokens);
    done_ = true;
  }
  changed_.notify_all();
}

void Job::fail(RequestError error) {
  {
    const std::lock_guard lock(mutex_);
    error_ = std::move(error);
    done_ = true;
  }
  changed_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// Engine

struct Engine::Slot {
  int sequence = -1;  // id in the set, -1 when closed
  std::string policy_key;
  std::string policy_name;
  std::vector<std::int32_t> history;  // every token the open sequence consumed
  std::uint64_t last_used = 0;

  // The request in the slot.
  std::shared_ptr<Job> job;
  std::size_t feed_from = 0;   // next prompt token to feed
  std::size_t turn_start = 0;  // the first prompt token this request feeds
  std::size_t fed = 0;         // tokens fed in the current step
  bool generating = false;
  std::int32_t next_token = 0;
  std::optional<harness::Sampler> sampler;
  std::vector<std::int32_t> generated;
  std::string text;          // generated text
  std::size_t sent = 0;      // bytes of `text` emitted
  std::size_t searched = 0;  // bytes of `text` already searched for stop strings
  Usage usage;
  Clock::time_point first_token;

  // Metrics over the slot's life.
  int peak_cells = 0;
  std::int64_t evicted_closed = 0;  // evictions of the sequences it closed
  double tokens_per_second = 0;
  std::int64_t requests = 0;
  std::vector<std::int64_t> kept_positions;
  bool kept_changed = false;  // kept_positions not yet published
};

namespace {

std::vector<std::int64_t> kept_positions(const Sequence& sequence) {
  std::vector<std::int64_t> positions;
  const SlotTable& slots = sequence.slots();
  for (const std::int32_t slot : slots.stream_order(0)) {
    positions.push_back(slots.original_positions(0)[static_cast<std::size_t>(slot)]);
  }
  return positions;
}

// Tokens fed that the cache no longer holds (SequenceStats::evicted_slots counts every layer's and
// head's slots, where llama.cpp's cells are one per token).
std::int64_t evicted_tokens(const Sequence& sequence) {
  return sequence.stats().tokens_fed - sequence.max_live();
}

}  // namespace

Engine::Engine(const llama_cli::LlamaModel& model, const llama_cli::LlamaOptions& llama,
               const harness::PolicyOptions& defaults, EngineOptions options)
    : model_(model), options_(options) {
  const auto most = static_cast<int>(llama_max_parallel_sequences());
  if (options_.parallel < 1 || options_.parallel > most) {
    throw Error(fmt::format("--parallel must be in [1, {}], got {}", most, options_.parallel));
  }
  if (options_.queue < 0) throw Error("--queue must be >= 0");
  if (options_.pool_cells < 0) throw Error("--kv-pool must be >= 0 (0: no pool)");
  if (options_.pool_cells > llama.context) {
    throw Error(
        fmt::format("--kv-pool {} exceeds --ctx-size {}: the pool's cells are the context's",
                    options_.pool_cells, llama.context));
  }
  if (options_.pool_cells == 0 && llama.context / options_.parallel < 1) {
    throw Error(fmt::format("--ctx-size {} gives no cell to each of --parallel {} slots",
                            llama.context, options_.parallel));
  }
  llama::LlamaSequenceSetOptions set_options;
  set_options.max_sequences = options_.parallel;
  set_options.max_chunk = options_.chunk;
  set_options.pool_cells = options_.pool_cells;
  set_ = std::make_unique<llama::LlamaSequenceSet>(
      model.get(), llama_cli::context_params(llama, parse_kv_type(defaults.kv_type)), set_options);
  slots_.resize(static_cast<std::size_t>(options_.parallel));
  metrics_.context_cells = llama.context;
  metrics_.pool_cells = options_.pool_cells;
  metrics_.bytes_per_cell = set_->bytes_per_cell();
  metrics_.slots.resize(slots_.size());
  thread_ = std::thread([this] { run(); });
}

Engine::~Engine() {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  thread_.join();
}

std::int64_t Engine::slot_cells() const {
  if (options_.pool_cells > 0) return options_.pool_cells;
  return metrics_.context_cells / options_.parallel;
}

Engine::Admission Engine::submit(const std::shared_ptr<Job>& job) {
  {
    const std::lock_guard lock(mutex_);
    if (draining_ || stopping_) return Admission::draining;
    if (in_engine_ >= options_.parallel + options_.queue) return Admission::queue_full;
    ++in_engine_;
    pending_.push_back(job);
  }
  work_.notify_all();
  return Admission::accepted;
}

bool Engine::drain(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  draining_ = true;
  return idle_.wait_for(lock, timeout, [&] { return in_engine_ == 0; });
}

bool Engine::draining() const {
  const std::lock_guard lock(mutex_);
  return draining_;
}

EngineMetrics Engine::metrics() const {
  const std::lock_guard lock(metrics_mutex_);
  return metrics_;
}

bool Engine::end_of_generation(std::int32_t token) const {
  if (token == model_.eos_id()) return true;
  // llama.cpp's vocabularies know their other end tokens (<|eot_id|>, <|im_end|>); kvevict's
  // byte-level one has EOS only.
  const model::Tokenizer* tokenizer = model_.kvevict_tokenizer();
  if (tokenizer != nullptr && tokenizer->kind == model::Tokenizer::Kind::byte_level) return false;
  return llama_vocab_is_eog(llama_model_get_vocab(model_.get()), token);
}

void Engine::close_sequence(Slot& slot) {
  if (slot.sequence < 0) return;
  slot.evicted_closed += evicted_tokens(set_->sequence(slot.sequence));
  set_->close(slot.sequence);
  slot.sequence = -1;
  slot.history.clear();
  slot.policy_key.clear();
  slot.policy_name.clear();
  slot.kept_positions.clear();
  slot.kept_changed = true;
}

bool Engine::open_sequence(Slot& slot, const Job& job, std::string& failure) {
  try {
    harness::PolicySetup setup = llama_cli::make_setup(job.policy, model_);
    llama::LlamaSequenceOptions sequence_options;
    sequence_options.position_mode = setup.decoder_options.position_mode;
    sequence_options.granularity = setup.decoder_options.granularity;
    sequence_options.max_chunk = options_.chunk;
    sequence_options.catalyst = setup.catalyst;
    slot.sequence = set_->open(std::move(setup.policy), std::move(sequence_options));
    slot.policy_key = job.policy_key;
    slot.policy_name = setup.name;
    slot.history.clear();
    return true;
  } catch (const std::exception& error) {
    failure = error.what();
    return false;
  }
}

Engine::Assigned Engine::assign(const std::shared_ptr<Job>& job) {
  if (job->cancelled()) {
    job->fail({499, "the client closed the connection"});
    return Assigned::ended;
  }
  // The free slot whose conversation the prompt extends the furthest.
  Slot* chosen = nullptr;
  for (Slot& slot : slots_) {
    if (slot.job || slot.sequence < 0 || slot.policy_key != job->policy_key) continue;
    if (slot.history.empty() || slot.history.size() >= job->prompt.size()) continue;
    if (!std::equal(slot.history.begin(), slot.history.end(), job->prompt.begin())) continue;
    if (chosen == nullptr || slot.history.size() > chosen->history.size()) chosen = &slot;
  }
  const bool reused = chosen != nullptr;
  if (!reused) {
    // An empty slot, else the least recently used free one.
    for (Slot& slot : slots_) {
      if (slot.job) continue;
      if (chosen == nullptr || (slot.sequence < 0 && chosen->sequence >= 0) ||
          ((slot.sequence < 0) == (chosen->sequence < 0) && slot.last_used < chosen->last_used)) {
        chosen = &slot;
      }
    }
    KVEVICT_REQUIRE(chosen != nullptr, "serve: a job was assigned with no free slot");
    close_sequence(*chosen);
    std::string failure;
    if (!open_sequence(*chosen, *job, failure)) {
      // The pool may refuse the policy's charge while other sequences hold theirs: close the idle
      // conversations, then wait for a busy one to end before saying no.
      bool closed_any = false;
      for (Slot& slot : slots_) {
        if (!slot.job && slot.sequence >= 0) {
          close_sequence(slot);
          closed_any = true;
        }
      }
      if (!closed_any || !open_sequence(*chosen, *job, failure)) {
        const bool others_busy = std::any_of(slots_.begin(), slots_.end(),
                                             [](const Slot& s) { return s.job != nullptr; });
        if (others_busy) return Assigned::blocked;
        job->fail({400, "kv_policy: the sequence cannot be opened: " + failure});
        return Assigned::ended;
      }
    }
  }
  Slot& slot = *chosen;
  slot.job = job;
  slot.last_used = ++uses_;
  slot.turn_start = slot.history.size();
  slot.feed_from = slot.history.size();
  slot.generating = false;
  slot.sampler.emplace(job->sampling);
  slot.generated.clear();
  slot.text.clear();
  slot.sent = 0;
  slot.searched = 0;
  slot.usage = Usage{};
  slot.usage.slot = static_cast<int>(&slot - slots_.data());
  slot.usage.prompt_tokens = static_cast<int>(job->prompt.size());
  slot.usage.reused_prompt_tokens = static_cast<int>(slot.history.size());
  if (reused) {
    const int live = set_->sequence(slot.sequence).max_live();
    slot.usage.evicted_prompt_tokens = std::max(0, static_cast<int>(slot.history.size()) - live);
  }
  ++slot.requests;
  job->start();
  return Assigned::started;
}

void Engine::release(Slot& slot) {
  slot.job.reset();
  {
    const std::lock_guard lock(mutex_);
    --in_engine_;
    blocked_ = false;
  }
  idle_.notify_all();
}

void Engine::finish(Slot& slot, std::string reason) {
  const Sequence& sequence = set_->sequence(slot.sequence);
  slot.usage.completion_tokens = static_cast<int>(slot.generated.size());
  slot.usage.cache_tokens = sequence.max_live();
  slot.usage.evicted_tokens = evicted_tokens(sequence);
  const double seconds = std::chrono::duration<double>(Clock::now() - slot.first_token).count();
  slot.tokens_per_second = seconds > 0 && slot.generated.size() > 1
                               ? static_cast<double>(slot.generated.size() - 1) / seconds
                               : 0.0;
  slot.kept_positions = kept_positions(sequence);
  slot.kept_changed = true;
  {
    const std::lock_guard lock(metrics_mutex_);
    ++metrics_.requests_finished;
    metrics_.prompt_tokens += slot.usage.prompt_tokens;
    metrics_.reused_prompt_tokens += slot.usage.reused_prompt_tokens;
    metrics_.generated_tokens += slot.usage.completion_tokens;
  }
  std::string tail = slot.text.substr(slot.sent);
  const std::shared_ptr<Job> job = slot.job;
  release(slot);
  publish();  // before the client hears of the end: /slots and /metrics show it
  job->finish(std::move(reason), slot.usage, slot.generated, std::move(tail));
}

void Engine::fail(Slot& slot, RequestError error) {
  close_sequence(slot);
  {
    const std::lock_guard lock(metrics_mutex_);
    ++metrics_.requests_failed;
  }
  const std::shared_ptr<Job> job = slot.job;
  release(slot);
  publish();
  job->fail(std::move(error));
}

// A sampled token: the end of the request, or text and the next token to feed.
void Engine::sampled(Slot& slot, std::int32_t token) {
  const Job& job = *slot.job;
  if (slot.generated.empty()) slot.first_token = Clock::now();
  if (!job.ignore_eos && end_of_generation(token)) {
    finish(slot, "stop");
    return;
  }
  slot.generated.push_back(token);
  slot.text += model_.decode(token);
  if (const std::optional<std::size_t> at = find_stop(slot.text, job.stop, slot.searched)) {
    slot.text.resize(*at);
    finish(slot, "stop");
    return;
  }
  slot.searched = slot.text.size();
  const std::size_t safe = emittable(slot.text, slot.sent, job.stop);
  if (safe > slot.sent) {
    slot.job->emit(std::string_view(slot.text).substr(slot.sent, safe - slot.sent));
    slot.sent = safe;
  }
  if (static_cast<int>(slot.generated.size()) >= job.max_tokens) {
    finish(slot, "length");  // nothing is fed after the last token (as `generate`)
    return;
  }
  slot.next_token = token;
  slot.generating = true;
}

void Engine::publish() {
  const std::lock_guard lock(metrics_mutex_);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    SlotMetrics& out = metrics_.slots[i];
    out.busy = slot.job != nullptr;
    out.open = slot.sequence >= 0;
    out.policy = slot.policy_name;
    out.history_tokens = static_cast<std::int64_t>(slot.history.size());
    out.live_cells = out.open ? set_->live_cells(slot.sequence) : 0;
    if (out.open)
      slot.peak_cells = std::max(slot.peak_cells, set_->stats(slot.sequence).peak_cells);
    out.peak_cells = slot.peak_cells;
    out.evicted_tokens =
        slot.evicted_closed + (out.open ? evicted_tokens(set_->sequence(slot.sequence)) : 0);
    out.tokens_per_second = slot.tokens_per_second;
    out.requests = slot.requests;
    if (!out.open) {
      out.kept_positions.clear();
    } else if (slot.kept_changed) {
      out.kept_positions = slot.kept_positions;  // copied once per request, not per step
      slot.kept_changed = false;
    }
  }
  if (const KvPool* pool = set_->pool()) {
    metrics_.pool_used = pool->used();
    metrics_.pool_charged = pool->charged();
    metrics_.pool_peak = pool->stats().peak_cells;
    metrics_.pool_cuts = pool->stats().cuts;
    metrics_.pool_pressed_steps = pool->stats().pressed_steps;
  }
  metrics_.steps = set_->stats().steps;
  const std::lock_guard engine_lock(mutex_);
  metrics_.queued = static_cast<int>(pending_.size());
  metrics_.active = static_cast<int>(
      std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.job != nullptr; }));
}

void Engine::run() {
  std::vector<llama::LlamaFeed> feeds;
  std::vector<Slot*> fed;
  for (;;) {
    std::vector<std::shared_ptr<Job>> arrived;
    {
      std::unique_lock lock(mutex_);
      const auto busy = [&] {
        return std::any_of(slots_.begin(), slots_.end(),
                           [](const Slot& s) { return s.job != nullptr; });
      };
      work_.wait(lock, [&] { return stopping_ || (!pending_.empty() && !blocked_) || busy(); });
      if (stopping_) {
        for (const std::shared_ptr<Job>& job : pending_)
          job->fail({503, "the server is stopping", "server_error"});
        in_engine_ -= static_cast<int>(pending_.size());
        pending_.clear();
        lock.unlock();
        for (Slot& slot : slots_) {
          if (slot.job) fail(slot, {503, "the server is stopping", "server_error"});
        }
        break;
      }
      // As many jobs as there are free slots, oldest first.
      int free_slots = static_cast<int>(
          std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.job; }));
      while (!blocked_ && free_slots > 0 && !pending_.empty()) {
        arrived.push_back(std::move(pending_.front()));
        pending_.pop_front();
        --free_slots;
      }
    }
    for (std::size_t i = 0; i < arrived.size(); ++i) {
      const Assigned assigned = assign(arrived[i]);
      if (assigned == Assigned::ended) {
        {
          const std::lock_guard lock(mutex_);
          --in_engine_;
        }
        const std::lock_guard metrics_lock(metrics_mutex_);
        ++(arrived[i]->cancelled() ? metrics_.requests_cancelled : metrics_.requests_failed);
      } else if (assigned == Assigned::blocked) {
        // Back to the front, in order, until a busy slot ends.
        const std::lock_guard lock(mutex_);
        blocked_ = true;
        for (std::size_t j = arrived.size(); j > i; --j) pending_.push_front(arrived[j - 1]);
        break;
      }
    }
    // Before a started request's first token reaches its client: /metrics and /slots show it
    // active from then on (a client that has heard from its request never finds it missing there).
    if (!arrived.empty()) publish();
    idle_.notify_all();

    // Requests whose client left: their sequences are closed, their cells freed.
    for (Slot& slot : slots_) {
      if (slot.job && slot.job->cancelled()) {
        close_sequence(slot);
        {
          const std::lock_guard lock(metrics_mutex_);
          ++metrics_.requests_cancelled;
        }
        slot.job->fail({499, "the client closed the connection"});
        release(slot);
      }
    }

    feeds.clear();
    fed.clear();
    for (Slot& slot : slots_) {
      if (!slot.job) continue;
      if (slot.generating) {
        slot.fed = 1;
        feeds.push_back({slot.sequence, std::span<const std::int32_t>(&slot.next_token, 1)});
      } else {
        const std::vector<std::int32_t>& prompt = slot.job->prompt;
        std::size_t n =
            std::min(static_cast<std::size_t>(options_.chunk), prompt.size() - slot.feed_from);
        // Never across a full pot: it is distilled exactly when full (as LlamaSequence::feed).
        const std::optional<int> room = set_->sequence(slot.sequence).pot_room();
        if (room && *room > 0) n = std::min(n, static_cast<std::size_t>(*room));
        slot.fed = n;
        feeds.push_back({slot.sequence,
                         std::span<const std::int32_t>(prompt).subspan(slot.feed_from, n),
                         slot.feed_from == slot.turn_start});
      }
      fed.push_back(&slot);
    }
    if (feeds.empty()) {
      publish();
      continue;
    }
    try {
      set_->step(feeds);
    } catch (const std::exception& error) {
      for (Slot* slot : fed) {
        fail(*slot, {500, std::string("llama_decode failed: ") + error.what(), "server_error"});
      }
      publish();
      continue;
    }
    for (Slot* slot_pointer : fed) {
      Slot& slot = *slot_pointer;
      if (const std::optional<std::string>& failure = set_->failed(slot.sequence)) {
        fail(slot, {500, "the sequence failed: " + *failure, "server_error"});
        continue;
      }
      if (slot.generating) {
        slot.history.push_back(slot.next_token);
      } else {
        const std::vector<std::int32_t>& prompt = slot.job->prompt;
        const auto from = prompt.begin() + static_cast<std::ptrdiff_t>(slot.feed_from);
        slot.history.insert(slot.history.end(), from, from + static_cast<std::ptrdiff_t>(slot.fed));
        slot.feed_from += slot.fed;
        if (slot.feed_from < prompt.size()) continue;
      }
      sampled(slot, slot.sampler->sample(set_->logits(slot.sequence).last()));
    }
    publish();
  }
  publish();
}

}  // namespace kvevict::llama_serve
