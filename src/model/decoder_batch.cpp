// The reference decoder's forward, over one or many sequences (decoder_batch.hpp). Decoder
// (decoder.cpp) is a batch of one.
#include <algorithm>
#include <cmath>
#include <exception>
#include <kvevict/model/decoder_batch.hpp>
#include <string>
#include <utility>

#include "attention.hpp"
#include "kernels/kernels.hpp"
#include "kvevict/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/signals.hpp"
#include "matmul.hpp"
#include "thread_pool.hpp"

namespace kvevict::model {
namespace {

void check_matrix(const WeightMatrix& w, std::int64_t rows, std::int64_t cols, const char* name,
                  int layer) {
  const std::string where =
      layer < 0 ? std::string(name) : "layer " + std::to_string(layer) + " " + std::string(name);
  KVEVICT_REQUIRE(w.data != nullptr, "Decoder: weight " + where + " has no data");
  KVEVICT_REQUIRE(w.rows == rows && w.cols == cols,
                  "Decoder: weight " + where + " is [" + std::to_string(w.rows) + ", " +
                      std::to_string(w.cols) + "], expected [" + std::to_string(rows) + ", " +
                      std::to_string(cols) + "]");
}

void check_norm(const std::vector<float>& norm, int dim, const char* name, int layer) {
  KVEVICT_REQUIRE(
      static_cast<int>(norm.size()) == dim,
      "Decoder: " + (layer < 0 ? std::string() : "layer " + std::to_string(layer) + " ") + name +
          " has " + std::to_string(norm.size()) + " weights, expected " + std::to_string(dim));
}

// Validates the model's weights against its config.
void check_model(const Model& model) {
  const ModelConfig& c = model.config;
  c.validate();
  const std::int64_t q_dim = std::int64_t{c.heads} * c.head_dim();
  const std::int64_t kv_dim = std::int64_t{c.kv_heads} * c.head_dim();
  check_matrix(model.token_embedding, c.vocab_size, c.dim, "token_embedding", -1);
  check_matrix(model.output, c.vocab_size, c.dim, "output", -1);
  check_norm(model.final_norm, c.dim, "final_norm", -1);
  KVEVICT_REQUIRE(static_cast<int>(model.layers.size()) == c.layers,
                  "Decoder: the model has " + std::to_string(model.layers.size()) +
                      " layers, its config says " + std::to_string(c.layers));
  for (int l = 0; l < c.layers; ++l) {
    const LayerWeights& w = model.layers[static_cast<std::size_t>(l)];
    check_norm(w.attention_norm, c.dim, "attention_norm", l);
    check_norm(w.ffn_norm, c.dim, "ffn_norm", l);
    check_matrix(w.wq, q_dim, c.dim, "wq", l);
    check_matrix(w.wk, kv_dim, c.dim, "wk", l);
    check_matrix(w.wv, kv_dim, c.dim, "wv", l);
    check_matrix(w.wo, c.dim, q_dim, "wo", l);
    check_matrix(w.w_gate, c.hidden_dim, c.dim, "w_gate", l);
    check_matrix(w.w_up, c.hidden_dim, c.dim, "w_up", l);
    check_matrix(w.w_down, c.dim, c.hidden_dim, "w_down", l);
  }
}

// Slots a sequence's cache reserves before the stream needs more (besides one chunk).
constexpr int kInitialSlots = 1024;
// More threads than any machine the decoder runs on has cores: a typo, not a request.
constexpr int kMaxThreads = 1024;
// Largest scratch buffer a step may allocate (activations of its rows, one KV head's attention
// probabilities): 2^28 floats, 1 GiB. Buffers are sized by the chunks actually fed, not by
// max_chunk, so only a long input fed in huge chunks (or a huge model) reaches it.
constexpr std::int64_t kMaxScratchFloats = std::int64_t{1} << 28;
// Activations reserved when a sequence opens: its max_chunk rows if they fit in 16 MiB (a small
// model's prefill then allocates nothing, as an engine's context holds its compute buffers), else
// as many as fit; larger steps grow them when they arrive.
constexpr std::int64_t kReservedActivationBytes = std::int64_t{16} << 20;

// Floats of one row of the activations (x, xb, q, k, v, att, hb, hb2).
std::int64_t activation_floats(const ModelConfig& c) {
  const std::int64_t head_dim = c.head_dim();
  return 2 * (std::int64_t{c.dim} + c.hidden_dim + (std::int64_t{c.heads} + c.kv_heads) * head_dim);
}

RopeConfig rope_config(const ModelConfig& c, int table_positions) {
  RopeConfig rope;
  rope.head_dim = c.head_dim();
  rope.rotary_dim = c.rotary_dim;
  rope.theta = c.rope_theta;
  rope.layout = c.rope_layout;
  rope.table_positions =
      table_positions > 0 ? table_positions : std::clamp(c.context_length, 4096, 16384);
  return rope;
}

// A sequence's cache configuration from its options (the model checked by the batch).
CacheConfig cache_config(const Model& model, const DecoderOptions& options,
                         int rope_table_positions) {
  const ModelConfig& c = model.config;
  KVEVICT_REQUIRE(options.max_chunk > 0,
                  "Decoder: max_chunk must be positive, got " + std::to_string(options.max_chunk));
  CacheConfig config;
  config.shape = CacheShape{c.layers, c.heads, c.kv_heads, c.head_dim()};
  config.rope = rope_config(c, rope_table_positions);
  config.sequence.position_mode = options.position_mode;
  config.sequence.granularity = options.granularity;
  config.sequence.key_storage = options.key_storage;
  config.kv_type = options.kv_type;
  config.sequence.max_chunk = options.max_chunk;
  // Memory follows the stream, not the budget nor max_chunk: the store starts at kInitialSlots
  // plus one chunk of at most kInitialSlots and doubles as tokens arrive, up to what the policy
  // may hold (a budget of 16M tokens or a max_chunk of 65,536 over a 300-byte input allocates for
  // the input).
  config.sequence.max_initial_capacity = kInitialSlots + std::min(options.max_chunk, kInitialSlots);
  config.sequence.max_pending_rotations = options.max_pending_rotations;
  config.sequence.budget_bytes = options.budget_bytes;
  config.sequence.budget_tokens = options.budget_tokens;
  config.sequence.allocation = options.allocation;
  config.sequence.pyramid_beta = options.pyramid_beta;
  config.sequence.adaptive_floor = options.adaptive_floor;
  // Attention reads the slot table's runs per KV head on the pool's threads (attend_kv_head).
  config.sequence.attention_views = false;
  return config;
}

// out = x / rms(x) * weight, row by row (llama2.c's rmsnorm, in f32).
void rmsnorm(Eigen::Ref<RowMatrix> out, const Eigen::Ref<const RowMatrix>& x,
             const std::vector<float>& weight, float eps) {
  for (Eigen::Index i = 0; i < x.rows(); ++i) {
    kernels::rmsnorm(x.row(i).data(), weight.data(), x.cols(), eps, out.row(i).data());
  }
}

// -log softmax(logits)[token], with the log-sum-exp accumulated in double.
float negative_log_softmax(const float* logits, int vocab, std::int32_t token) {
  const float max = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - max));
  return static_cast<float>(std::log(sum) + max - logits[token]);
}

// What one thread needs for the attention of one KV head at a time.
struct HeadScratch {
  explicit HeadScratch(const Rope& rope) : angles(rope) {}
  QueryAngles angles;                      // query rotations (the same for every sequence's RoPE)
  std::vector<KeyRun> runs;                // one KV head's live slots
  std::vector<float> probabilities;        // [group * n, slot_limit] one KV head's softmax rows
  AttentionBuffers buffers;                // attend()'s scratch
  EvictingCache::Matrix key_scratch;       // rotated keys of one KV head (pre-RoPE storage)
  std::vector<std::int64_t> positions;     // [n] query positions in one KV head
  std::vector<const float*> warm_columns;  // one KV head's score columns and spare
};

}  // namespace

// One sequence of the batch.
struct DecoderBatch::Member {
  Member(int id, const CacheConfig& config, std::unique_ptr<Policy> policy,
         const DecoderOptions& options, StageObserver* observer)
      : id(id), options(options), cache(config, std::move(policy), observer) {}

  int id;
  DecoderOptions options;
  EvictingCache cache;
  std::optional<std::vector<std::int32_t>> catalyst;
  DecoderStats stats;
  int pool_member = -1;
  std::optional<std::string> failed;
  std::vector<float> logits;     // [logit_rows, vocab] of its last step
  int logit_rows = 0;            // 0 before its first step
  std::vector<float> surprisal;  // [n] of its last step, when its policy wants it
  // Its part of the current pass.
  std::span<const std::int32_t> tokens;  // the chunk, or the catalyst prompt
  ForwardRequest request;
  bool all_rows = false;  // logits of every token computed (asked for, or for the surprisal)
  int first_row = 0;      // its first row in the pass's activations
  int head_row = 0;       // its first row in the output head's
};

// The step's activations, [rows] x width row-major, and the attention's per-thread scratch.
struct DecoderBatch::Scratch {
  Scratch(const RopeConfig& rope_config, int threads) : rope(rope_config) {
    for (int t = 0; t < threads; ++t) per_thread.emplace_back(rope);
  }
  Rope rope;                            // every sequence's RoPE has this configuration
  std::vector<HeadScratch> per_thread;  // [threads]
  std::vector<float> rows;              // [heads][queries][stride] probabilities for a policy
  std::unique_ptr<ThreadPool> pool;     // threads > 1
  int rows_reserved = 0;
  std::vector<float> x;       // [rows, dim] residual stream
  std::vector<float> xb;      // [rows, dim] normed input of a block / block output
  std::vector<float> q;       // [rows, heads * head_dim]
  std::vector<float> k;       // [rows, kv_heads * head_dim]
  std::vector<float> v;       // [rows, kv_heads * head_dim]
  std::vector<float> att;     // [rows, heads * head_dim] attention output
  std::vector<float> hb;      // [rows, hidden_dim] gate
  std::vector<float> hb2;     // [rows, hidden_dim] up
  std::vector<float> logits;  // [head rows, vocab]
  ProductSettings products;
};

DecoderBatch::DecoderBatch(const Model& model, DecoderBatchOptions options)
    : DecoderBatch(model, options, DecodeActivations::f32, /*single=*/false) {}

DecoderBatch::DecoderBatch(const Model& model, DecoderBatchOptions options,
                           DecodeActivations activations, bool single)
    : model_(model), options_(options), single_(single), activations_(activations) {
  check_model(model);
  KVEVICT_REQUIRE(options.threads >= 1 && options.threads <= kMaxThreads,
                  "Decoder: threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                      std::to_string(options.threads));
  KVEVICT_REQUIRE(options.rope_table_positions >= 0, "Decoder: rope_table_positions must be >= 0");
  KVEVICT_REQUIRE(options.pool_cells >= 0, "DecoderBatch: pool_cells must be >= 0, got " +
                                               std::to_string(options.pool_cells));
  scratch_ = std::make_unique<Scratch>(rope_config(model.config, options.rope_table_positions),
                                       options.threads);
  if (options.threads > 1) scratch_->pool = std::make_unique<ThreadPool>(options.threads);
  // A batch multiplies every row with the panel kernel, one row included (the header comment).
  scratch_->products = {scratch_->pool.get(), activations, /*rows_independent=*/!single};
  if (options.pool_cells > 0) pool_ = std::make_unique<KvPool>(options.pool_cells);
}

DecoderBatch::~DecoderBatch() {
  // Members leave the pool before it goes (it points at their sequences).
  for (auto& m : members_) {
    if (m && pool_ && m->pool_member >= 0) pool_->leave(m->pool_member);
  }
}

int DecoderBatch::open(std::unique_ptr<Policy> policy, DecoderOptions options) {
  const DecoderOptions defaults;
  KVEVICT_REQUIRE(options.threads == defaults.threads,
                  "DecoderBatch::open: threads are the batch's (DecoderBatchOptions::threads)");
  KVEVICT_REQUIRE(
      options.observer == nullptr,
      "DecoderBatch::open: the observer is the batch's (DecoderBatchOptions::observer)");
  KVEVICT_REQUIRE(options.rope_table_positions == 0 ||
                      options.rope_table_positions == options_.rope_table_positions,
                  "DecoderBatch::open: the RoPE table is the batch's "
                  "(DecoderBatchOptions::rope_table_positions)");
  KVEVICT_REQUIRE(options.decode_activations == DecodeActivations::f32,
                  "DecoderBatch::open: a batch multiplies in f32 (decode_activations q8_0 is a "
                  "Decoder's option)");
  return open_member(std::move(policy), options);
}

int DecoderBatch::open_member(std::unique_ptr<Policy> policy, const DecoderOptions& options) {
  KVEVICT_REQUIRE(policy != nullptr, "DecoderBatch::open: no policy");
  CacheConfig config = cache_config(model_, options, options_.rope_table_positions);
  // A budget split unevenly over the heads: each head's rows follow its share (compacted slots,
  // the store's blocks sized by use) instead of every head holding the largest share.
  config.sequence.compact_slots =
      options.allocation != Allocation::uniform || policy->uneven_shares();
  int id = 0;
  while (id < static_cast<int>(members_.size()) && members_[static_cast<std::size_t>(id)]) ++id;
  auto m = std::make_unique<Member>(id, config, std::move(policy), options, options_.observer);
  if (pool_) m->pool_member = pool_->join(m->cache.sequence());
  if (id == static_cast<int>(members_.size())) members_.emplace_back();
  members_[static_cast<std::size_t>(id)] = std::move(m);
  const std::int64_t reserved_rows =
      kReservedActivationBytes / (activation_floats(model_.config) * std::int64_t{sizeof(float)});
  reserve_rows(static_cast<int>(std::clamp<std::int64_t>(reserved_rows, 1, options.max_chunk)));
  return id;
}

void DecoderBatch::close(int id) {
  Member& m = member(id, "close");
  if (pool_ && m.pool_member >= 0) pool_->leave(m.pool_member);
  members_[static_cast<std::size_t>(id)].reset();
}

bool DecoderBatch::is_open(int id) const {
  return id >= 0 && id < static_cast<int>(members_.size()) &&
         members_[static_cast<std::size_t>(id)] != nullptr;
}

DecoderBatch::Member& DecoderBatch::member(int id, const char* call) {
  return const_cast<Member&>(std::as_const(*this).member(id, call));
}

const DecoderBatch::Member& DecoderBatch::member(int id, const char* call) const {
  KVEVICT_REQUIRE(is_open(id), std::string("DecoderBatch::") + call + ": no open sequence " +
                                   std::to_string(id));
  return *members_[static_cast<std::size_t>(id)];
}

EvictingCache& DecoderBatch::cache(int id) { return member(id, "cache").cache; }
const EvictingCache& DecoderBatch::cache(int id) const { return member(id, "cache").cache; }
const DecoderStats& DecoderBatch::stats(int id) const { return member(id, "stats").stats; }
const std::optional<std::string>& DecoderBatch::failed(int id) const {
  return member(id, "failed").failed;
}

void DecoderBatch::set_catalyst(int id, std::vector<std::int32_t> tokens) {
  Member& m = member(id, "set_catalyst");
  const int vocab = model_.config.vocab_size;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    KVEVICT_REQUIRE(tokens[i] >= 0 && tokens[i] < vocab,
                    "Decoder: catalyst token id " + std::to_string(tokens[i]) + " at index " +
                        std::to_string(i) + " is out of range [0, " + std::to_string(vocab) + ")");
  }
  reserve_rows(static_cast<int>(tokens.size()));
  m.catalyst = std::move(tokens);
}

// Runs `work` for one member: a batch records its failure (the member is left out of the rest of
// the step, the others go on); a Decoder's batch of one throws it at once.
template <class Work>
void DecoderBatch::guarded(Member& m, Work&& work) {
  if (m.failed) return;
  if (single_) return work();
  try {
    work();
  } catch (const std::exception& error) {
    m.failed = error.what();
  }
}

void DecoderBatch::reserve_rows(int rows) {
  Scratch& s = *scratch_;
  if (rows <= s.rows_reserved) return;
  // Grown geometrically up to the open sequences' chunks together, so that a stream of growing
  // steps reallocates rarely.
  int most_rows = 0;
  for (const auto& m : members_) {
    if (m) most_rows += m->options.max_chunk;
  }
  rows = std::max(rows, std::min(2 * s.rows_reserved, most_rows));
  const ModelConfig& c = model_.config;
  const auto n = static_cast<std::size_t>(rows);
  const auto q_dim = static_cast<std::size_t>(c.heads) * c.head_dim();
  const auto kv_dim = static_cast<std::size_t>(c.kv_heads) * c.head_dim();
  (void)checked_allocation(
      {rows, activation_floats(c)},
      "Decoder: activations of " + std::to_string(rows) +
          " tokens in one step (max_chunk, --chunk, sets a sequence's largest)",
      kMaxScratchFloats);
  s.x.resize(n * c.dim);
  s.xb.resize(n * c.dim);
  s.q.resize(n * q_dim);
  s.k.resize(n * kv_dim);
  s.v.resize(n * kv_dim);
  s.att.resize(n * q_dim);
  s.hb.resize(n * c.hidden_dim);
  s.hb2.resize(n * c.hidden_dim);
  s.rows_reserved = rows;
}

void DecoderBatch::step(std::span<const DecoderFeed> feeds) {
  // Every check before anything changes.
  KVEVICT_REQUIRE(!feeds.empty(), "DecoderBatch::step: no sequence to feed");
  const int vocab = model_.config.vocab_size;
  fed_.clear();
  pool_feeds_.clear();
  for (const DecoderFeed& feed : feeds) {
    Member& m = member(feed.sequence, "step");
    // The message is formed only for an error (a decode step checks this at every token).
    const auto who = [&] {
      return "DecoderBatch::step: sequence " + std::to_string(feed.sequence);
    };
    KVEVICT_REQUIRE(!m.failed, who() + " failed (" + m.failed.value_or("") + "): close it");
    KVEVICT_REQUIRE(std::find(fed_.begin(), fed_.end(), &m) == fed_.end(),
                    who() + " is fed twice in one step");
    const int n = static_cast<int>(feed.tokens.size());
    KVEVICT_REQUIRE(n > 0 && n <= m.options.max_chunk, who() + ": a chunk holds 1 to " +
                                                           std::to_string(m.options.max_chunk) +
                                                           " tokens, got " + std::to_string(n));
    for (std::size_t i = 0; i < feed.tokens.size(); ++i) {
      KVEVICT_REQUIRE(feed.tokens[i] >= 0 && feed.tokens[i] < vocab,
                      who() + ": token id " + std::to_string(feed.tokens[i]) + " at index " +
                          std::to_string(i) + " is out of range [0, " + std::to_string(vocab) +
                          ")");
    }
    fed_.push_back(&m);
    if (pool_) pool_feeds_.push_back({m.pool_member, n});
  }
  if (pool_) {
    // A member whose cut fails fails alone; the others go on.
    pool_->make_room_dropping_failed_cuts(pool_feeds_, [&](const KvPool::CutFailure& failure) {
      const auto cut = std::find_if(members_.begin(), members_.end(), [&](const auto& m) {
        return m && m->pool_member == failure.member();
      });
      KVEVICT_REQUIRE(cut != members_.end(), failure.what());
      (*cut)->failed = failure.what();
      (*cut)->pool_member = -1;
    });
  }

  // 1. Slots for every chunk (a policy may evict first, before a turn); each chunk's rows follow
  //    the previous one's. The first token's surprisal comes from the sequence's previous last
  //    logits; the stream's very first token gets 0.
  int rows = 0;
  for (std::size_t i = 0; i < feeds.size(); ++i) {
    Member& m = *fed_[i];
    guarded(m, [&] {
      m.tokens = feeds[i].tokens;
      m.request = feeds[i].request;
      const bool wants_surprisal = m.cache.sequence().wants(Signal::surprisal);
      m.all_rows = m.request.all_logits || wants_surprisal;
      m.cache.sequence().begin_chunk(m.tokens, m.request.turn_start);
      m.stats.peak_kv_bytes = std::max(m.stats.peak_kv_bytes, m.cache.memory().live_kv_bytes);
      if (wants_surprisal) {
        const StageScope stage(options_.observer, Stage::head);
        m.surprisal.resize(m.tokens.size());
        m.surprisal[0] = m.logit_rows == 0
                             ? 0.0f
                             : negative_log_softmax(
                                   m.logits.data() + static_cast<std::size_t>(m.logit_rows - 1) *
                                                         static_cast<std::size_t>(vocab),
                                   vocab, m.tokens[0]);
      }
    });
    if (m.failed) continue;
    m.first_row = rows;
    rows += static_cast<int>(m.tokens.size());
  }
  std::erase_if(fed_, [](const Member* m) { return m->failed.has_value(); });
  if (fed_.empty()) return;
  for (HeadScratch& thread : scratch_->per_thread) thread.angles.clear();
  reserve_rows(rows);
  // 2. The layers; attention rows go to each policy as each layer computes them.
  transformer(fed_, rows, Pass::stream);
  // 3. Logits.
  output_head(fed_);
  // 4. The surprisal, each decision, each catalyst.
  for (Member* m : fed_) guarded(*m, [&] { finish(*m); });
}

// After the step's pass: a member's surprisal, its decision (after a forward or an anchor), and
// its catalyst prompt when its pot is full.
void DecoderBatch::finish(Member& m) {
  const auto n = static_cast<int>(m.tokens.size());
  const int vocab = model_.config.vocab_size;
  if (m.cache.sequence().wants(Signal::surprisal)) {
    {
      const StageScope stage(options_.observer, Stage::head);
      for (int k = 1; k < n; ++k) {
        m.surprisal[static_cast<std::size_t>(k)] = negative_log_softmax(
            m.logits.data() + static_cast<std::size_t>(k - 1) * vocab, vocab, m.tokens[k]);
      }
    }
    m.cache.sequence().observe_surprisal(
        std::span<const float>(m.surprisal.data(), m.tokens.size()));
  }
  m.cache.sequence().end_forward();
  if (m.cache.sequence().catalyst_pending()) run_catalyst(m);
  m.stats.tokens_fed += n;
  ++m.stats.forwards;
}

// A full pot: the catalyst prompt runs alone through the layers (no logits), the policy reads its
// attention, then Sequence::end_catalyst rolls it back and distills.
void DecoderBatch::run_catalyst(Member& m) {
  KVEVICT_REQUIRE(m.catalyst.has_value(),
                  "Decoder: policy '" + std::string(m.cache.sequence().policy().name()) +
                      "' filled its pot and needs a catalyst prompt: call set_catalyst() first");
  {
    const StageScope stage(options_.observer, Stage::catalyst);
    m.cache.sequence().begin_catalyst(*m.catalyst);
    m.stats.peak_kv_bytes = std::max(m.stats.peak_kv_bytes, m.cache.memory().live_kv_bytes);
    if (!m.catalyst->empty()) {
      // The pass reads the member's tokens: the prompt's, then its chunk's again for result().
      const std::span<const std::int32_t> chunk = std::exchange(m.tokens, *m.catalyst);
      m.first_row = 0;
      Member* const alone[] = {&m};
      transformer(alone, static_cast<int>(m.tokens.size()), Pass::catalyst);
      m.tokens = chunk;
    }
  }
  m.cache.sequence().end_catalyst();  // rolled back and distilled: the policy's stages
  ++m.stats.catalyst_runs;
}

ForwardResult DecoderBatch::result(int id) const {
  const Member& m = member(id, "result");
  ForwardResult result;
  result.vocab = model_.config.vocab_size;
  if (m.logit_rows == 0) return result;
  const auto n = static_cast<int>(m.tokens.size());
  const auto vocab = static_cast<std::size_t>(result.vocab);
  result.rows = m.request.all_logits ? n : 1;
  const std::size_t first_row = m.all_rows && !m.request.all_logits ? n - 1 : 0;
  result.logits = std::span<const float>(m.logits.data() + first_row * vocab,
                                         static_cast<std::size_t>(result.rows) * vocab);
  if (m.cache.sequence().wants(Signal::surprisal)) {
    result.surprisal = std::span<const float>(m.surprisal.data(), m.tokens.size());
  }
  return result;
}

// The transformer over the pass's rows: each member's chunk at its first_row, its slots just given
// by its cache. Leaves the final residual stream in x ([rows, dim]). The catalyst pass is timed as
// a whole by its caller.
void DecoderBatch::transformer(std::span<Member* const> members, int rows, Pass pass) {
  const ModelConfig& c = model_.config;
  const int hd = c.head_dim();
  const int q_dim = c.heads * hd;
  const int kv_dim = c.kv_heads * hd;
  Scratch& s = *scratch_;
  StageObserver* observer = pass == Pass::stream ? options_.observer : nullptr;

  Eigen::Map<RowMatrix> x(s.x.data(), rows, c.dim);             // [rows, dim] residual stream
  Eigen::Map<RowMatrix> xb(s.xb.data(), rows, c.dim);           // [rows, dim]
  Eigen::Map<RowMatrix> q(s.q.data(), rows, q_dim);             // [rows, heads * head_dim]
  Eigen::Map<RowMatrix> k(s.k.data(), rows, kv_dim);            // [rows, kv_heads * head_dim]
  Eigen::Map<RowMatrix> v(s.v.data(), rows, kv_dim);            // [rows, kv_heads * head_dim]
  Eigen::Map<RowMatrix> att(s.att.data(), rows, q_dim);         // [rows, heads * head_dim]
  Eigen::Map<RowMatrix> hb(s.hb.data(), rows, c.hidden_dim);    // [rows, hidden_dim]
  Eigen::Map<RowMatrix> hb2(s.hb2.data(), rows, c.hidden_dim);  // [rows, hidden_dim]

  // Token embedding: row first_row + i is the embedding of a member's token i.   // [rows, dim]
  {
    const StageScope stage(observer, Stage::head);
    for (const Member* m : members) {
      for (std::size_t i = 0; i < m->tokens.size(); ++i) {
        model_.token_embedding.row_to_f32(m->tokens[i],
                                          x.row(m->first_row + static_cast<int>(i)).data());
      }
    }
  }

  for (int l = 0; l < c.layers; ++l) {
    const LayerWeights& w = model_.layers[static_cast<std::size_t>(l)];
    {
      const StageScope stage(observer, Stage::attention);
      // Attention RMSNorm.                                                      // [rows, dim]
      rmsnorm(xb, x, w.attention_norm, c.norm_eps);
      // Q, K, V projections, every member's rows at once.  // [rows, q_dim], [rows, kv_dim] x 2
      matmul(w.wq, xb, q, s.products);
      matmul(w.wk, xb, k, s.products);
      matmul(w.wv, xb, v, s.products);
      for (Member* m : members) {
        guarded(*m, [&] {
          const auto n = static_cast<Eigen::Index>(m->tokens.size());
          // The chunk's keys (rotated by the cache for post-RoPE storage) and values.
          for (int g = 0; g < c.kv_heads; ++g) {  // [n, head_dim]
            m->cache.write_chunk(l, g, k.middleRows(m->first_row, n).middleCols(g * hd, hd),
                                 v.middleRows(m->first_row, n).middleCols(g * hd, hd));
          }
          // The stored keys to a policy that scores them (K-norm, KeyDiff).
          if (pass == Pass::stream && m->cache.sequence().wants_keys()) {
            m->cache.observe_stored_keys(l);
          }
          // Attention of every query head over its KV head's cache; rows to the policy.
          attention(l, *m, pass);  // [n, q_dim]
        });
      }
      // Output projection and residual.                                         // [rows, dim]
      matmul(w.wo, att, xb, s.products);
      kernels::add(x.data(), xb.data(), x.size());
    }
    {
      const StageScope stage(observer, Stage::mlp);
      // FFN RMSNorm.                                                            // [rows, dim]
      rmsnorm(xb, x, w.ffn_norm, c.norm_eps);
      // Gate and up projections.                                          // [rows, hidden_dim]
      matmul(w.w_gate, xb, hb, s.products);
      matmul(w.w_up, xb, hb2, s.products);
      // SwiGLU: silu(gate) * up.                                          // [rows, hidden_dim]
      kernels::swiglu(hb.data(), hb2.data(), hb.size());
      // Down projection and residual.                                           // [rows, dim]
      matmul(w.w_down, hb, xb, s.products);
      kernels::add(x.data(), xb.data(), x.size());
    }
  }
}

// Attention of layer `layer` for a member's n queries (its rows of q -> att), over its cache's live
// slots of each KV head. Hands the softmax rows to its policy when it reads them: every query
// (H2O, the catalyst's CaP) or the last (TOVA).
void DecoderBatch::attention(int layer, Member& m, Pass pass) {
  const ModelConfig& c = model_.config;
  const int hd = c.head_dim();
  const int group = c.heads / c.kv_heads;
  const std::ptrdiff_t q_dim = static_cast<std::ptrdiff_t>(c.heads) * hd;
  const int n = static_cast<int>(m.tokens.size());
  Scratch& s = *scratch_;
  Sequence& sequence = m.cache.sequence();
  const bool all_queries = pass == Pass::stream ? sequence.wants(Signal::attention_rows)
                                                : sequence.wants(Signal::catalyst_attention);
  const bool last_query =
      pass == Pass::stream && !all_queries && sequence.wants(Signal::last_attention_row);
  const bool give_rows = all_queries || last_query;
  // Each KV head's rows handed over right after its attention (the same scores as one call for
  // the layer), so that one KV head's rows are held at a time, not the layer's. Not from the
  // pool's threads: the sequence takes one call at a time.
  const bool rows_per_kv_head =
      give_rows && pass == Pass::stream && s.pool == nullptr && sequence.attention_per_kv_head();
  const int first_row = last_query ? n - 1 : 0;  // first query row handed over
  const int queries = n - first_row;
  float* const q_rows = s.q.data() + static_cast<std::ptrdiff_t>(m.first_row) * q_dim;
  float* const att_rows = s.att.data() + static_cast<std::ptrdiff_t>(m.first_row) * q_dim;

  // Rows handed to the policy: [heads][queries][stride], stride = the layer's widest slot limit
  // ([group][queries][stride] at a time when rows_per_kv_head).
  int stride = 0;
  for (int g = 0; g < c.kv_heads; ++g) stride = std::max(stride, sequence.slot_limit(layer, g));
  if (give_rows) {
    s.rows.resize(checked_allocation({rows_per_kv_head ? group : c.heads, queries, stride},
                                     "Decoder: attention rows for the policy",
                                     std::int64_t{1} << 32));
  }

  // One task per KV head, on the scratch of the thread that runs it.
  const auto attend_kv_head = [&](int g, int thread) {
    HeadScratch& scratch = s.per_thread[static_cast<std::size_t>(thread)];
    const int limit = sequence.slot_limit(layer, g);
    // The live slots, by run of equal pending rotation (pre-RoPE keys: rotated to their positions).
    scratch.runs.clear();
    const bool post_rope = m.options.key_storage == KeyStorage::post_rope;
    const auto add_run = [&](int begin, int end, std::int64_t rotation) {
      scratch.runs.push_back(KeyRun{begin, end, post_rope ? rotation : 0});
    };
    if (post_rope) {
      sequence.slots().for_each_key_run(sequence.unit_of(layer, g), add_run);
    } else {
      sequence.slots().for_each_position_run(sequence.unit_of(layer, g), add_run);
    }
    const std::span<const std::int32_t> chunk_slots = sequence.chunk_slots(layer, g);
    scratch.positions.resize(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      scratch.positions[static_cast<std::size_t>(i)] =
          sequence.position(layer, g, chunk_slots[static_cast<std::size_t>(i)]);
    }
    // The group's query heads h = g * group + [0, group), stacked: K and V are read once.
    GroupAttention heads;
    heads.queries = q_rows + static_cast<std::ptrdiff_t>(g) * group * hd;
    heads.query_stride = q_dim;
    heads.heads = group;
    heads.query_positions = scratch.positions;
    heads.query_slots = chunk_slots;
    heads.keys = post_rope
                     ? m.cache.stored_keys(layer, g)
                     : StoredRows{reinterpret_cast<const std::uint8_t*>(
                                      m.cache.rotated_keys(layer, g, scratch.key_scratch).data()),
                                  KvType::f32, sizeof(float) * static_cast<std::size_t>(hd)};
    heads.values = m.cache.stored_values(layer, g);
    heads.slot_limit = limit;
    heads.head_dim = hd;
    heads.runs = scratch.runs;
    // The score columns the policy's sum reads and the spare it writes, when it is handed rows:
    // asked for during P V, so that the sum after the layer finds them in cache.
    scratch.warm_columns.clear();
    if (give_rows) {
      const SlotTable& table = sequence.slots();
      const int unit = sequence.unit_of(layer, g);
      for (int column = 0; column < table.score_columns(); ++column) {
        scratch.warm_columns.push_back(table.scores(unit, column).data());
      }
      if (table.score_columns() > 0)
        scratch.warm_columns.push_back(table.spare_scores(unit).data());
    }
    heads.warm_columns = scratch.warm_columns;
    float* const out = att_rows + static_cast<std::ptrdiff_t>(g) * group * hd;
    // The group's rows handed over, [group, queries, stride], zero past this KV head's slots: when
    // every row of the chunk is one, attention writes them there directly (no copy).
    const std::size_t rows_before = rows_per_kv_head ? 0 : static_cast<std::size_t>(g) * group;
    float* const handed =
        give_rows ? s.rows.data() + rows_before * static_cast<std::size_t>(queries) * stride
                  : nullptr;
    if (queries == n && handed != nullptr) {
      attend(heads, scratch.angles, handed, stride, out, q_dim, scratch.buffers);
    } else {
      scratch.probabilities.resize(checked_allocation(
          {group, n, limit},
          "Decoder: attention probabilities of a " + std::to_string(n) +
              "-token chunk over one KV head (max_chunk, --chunk, sets the largest chunk)",
          kMaxScratchFloats));
      attend(heads, scratch.angles, scratch.probabilities.data(), limit, out, q_dim,
             scratch.buffers);
      if (handed == nullptr) return;
      // Only the last query's rows are handed over (TOVA's over a chunk): copied.
      for (int hh = 0; hh < group; ++hh) {
        std::copy_n(
            scratch.probabilities.data() + (static_cast<std::size_t>(hh) * n + n - 1) * limit,
            limit, handed + static_cast<std::size_t>(hh) * stride);
      }
    }
    for (int r = 0; r < group * queries; ++r) {
      std::fill_n(handed + static_cast<std::size_t>(r) * stride + limit, stride - limit, 0.0f);
    }
    if (rows_per_kv_head) sequence.observe_attention(layer, g, g + 1, handed, queries, stride);
  };
  if (s.pool != nullptr) {
    s.pool->run(c.kv_heads, attend_kv_head);
  } else {
    for (int g = 0; g < c.kv_heads; ++g) attend_kv_head(g, 0);
  }
  if (!give_rows || rows_per_kv_head) return;
  if (pass == Pass::stream) {
    sequence.observe_attention(layer, s.rows.data(), queries, stride);
  } else {
    sequence.observe_catalyst(layer, s.rows.data(), queries, stride);
  }
}

// Final RMSNorm and output head: the logits of every token of a member's chunk or of its last one
// (all_rows), into its own buffer. A batch multiplies every member's rows at once; a Decoder's
// batch of one multiplies the last row alone by matvec, so that its logits do not depend on
// whether the other rows were asked for.
void DecoderBatch::output_head(std::span<Member* const> members) {
  const ModelConfig& c = model_.config;
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  Scratch& s = *scratch_;
  const StageScope stage(options_.observer, Stage::head);
  int rows = 0;
  for (Member* m : members) {
    m->head_row = rows;
    rows += m->all_rows ? static_cast<int>(m->tokens.size()) : 1;
  }
  if (s.logits.size() < static_cast<std::size_t>(rows) * vocab) {
    s.logits.resize(static_cast<std::size_t>(rows) * vocab);
  }
  Eigen::Map<RowMatrix> xb(s.xb.data(), rows, c.dim);                 // [rows, dim]
  Eigen::Map<RowMatrix> logits(s.logits.data(), rows, c.vocab_size);  // [rows, vocab]
  // Final RMSNorm of the rows asked for.                                        // [rows, dim]
  for (const Member* m : members) {
    const int n = static_cast<int>(m->tokens.size());
    const int first = m->all_rows ? 0 : n - 1;
    const Eigen::Map<const RowMatrix> x(
        s.x.data() + static_cast<std::size_t>(m->first_row + first) * c.dim, n - first, c.dim);
    rmsnorm(xb.middleRows(m->head_row, n - first), x, model_.final_norm, c.norm_eps);
  }
  // Classifier: logits = W_out x.                                               // [rows, vocab]
  if (!single_) {
    matmul(model_.output, xb, logits, s.products);
  } else {
    for (const Member* m : members) {
      const int member_rows = m->all_rows ? static_cast<int>(m->tokens.size()) : 1;
      const int last = m->head_row + member_rows - 1;
      if (member_rows > 1) {
        matmul(model_.output, xb.middleRows(m->head_row, member_rows - 1),
               logits.middleRows(m->head_row, member_rows - 1), s.products);
      }
      matvec(model_.output, xb.row(last).data(), logits.row(last).data(), s.products);
    }
  }
  for (Member* m : members) {
    const int member_rows = m->all_rows ? static_cast<int>(m->tokens.size()) : 1;
    m->logits.assign(
        logits.row(m->head_row).data(),
        logits.row(m->head_row).data() + static_cast<std::size_t>(member_rows) * vocab);
    m->logit_rows = member_rows;
  }
}

}  // namespace kvevict::model
