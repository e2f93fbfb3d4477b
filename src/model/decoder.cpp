#include <algorithm>
#include <cmath>
#include <kvevict/model/decoder.hpp>
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

// Validates the model against its config and builds the cache configuration.
// Slots the decoder's cache reserves before the stream needs more (besides one chunk).
constexpr int kInitialSlots = 1024;
// More threads than any machine the decoder runs on has cores: a typo, not a request.
constexpr int kMaxThreads = 1024;
// Largest scratch buffer a forward may allocate (activations of a chunk, one KV head's attention
// probabilities): 2^28 floats, 1 GiB. Buffers are sized by the chunk actually fed, not by
// max_chunk, so only a long input fed in huge chunks (or a huge model) reaches it.
constexpr std::int64_t kMaxScratchFloats = std::int64_t{1} << 28;
// Activations reserved by the constructor: max_chunk rows if they fit in 16 MiB (a small model's
// prefill then allocates nothing, as an engine's context holds its compute buffers), else as
// many as fit; larger chunks grow them when they arrive.
constexpr std::int64_t kReservedActivationBytes = std::int64_t{16} << 20;

// Floats of one row of the decoder's activations (x, xb, q, k, v, att, hb, hb2).
std::int64_t activation_floats(const ModelConfig& c) {
  const std::int64_t head_dim = c.head_dim();
  return 2 * (std::int64_t{c.dim} + c.hidden_dim + (std::int64_t{c.heads} + c.kv_heads) * head_dim);
}

CacheConfig cache_config(const Model& model, const DecoderOptions& options) {
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
  KVEVICT_REQUIRE(options.max_chunk > 0,
                  "Decoder: max_chunk must be positive, got " + std::to_string(options.max_chunk));
  KVEVICT_REQUIRE(options.rope_table_positions >= 0, "Decoder: rope_table_positions must be >= 0");
  KVEVICT_REQUIRE(options.threads >= 1 && options.threads <= kMaxThreads,
                  "Decoder: threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                      std::to_string(options.threads));

  CacheConfig config;
  config.shape = CacheShape{c.layers, c.heads, c.kv_heads, c.head_dim()};
  config.rope.head_dim = c.head_dim();
  config.rope.rotary_dim = c.rotary_dim;
  config.rope.theta = c.rope_theta;
  config.rope.layout = c.rope_layout;
  config.rope.table_positions = options.rope_table_positions > 0
                                    ? options.rope_table_positions
                                    : std::clamp(c.context_length, 4096, 16384);
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

}  // namespace

namespace {

// What one thread needs for the attention of one KV head at a time.
struct HeadScratch {
  explicit HeadScratch(const Rope& rope) : angles(rope) {}
  QueryAngles angles;                   // query rotations of this forward
  std::vector<KeyRun> runs;             // one KV head's live slots
  std::vector<float> probabilities;     // [group * n, slot_limit] one KV head's softmax rows
  AttentionBuffers buffers;             // attend()'s scratch
  EvictingCache::Matrix key_scratch;    // rotated keys of one KV head (pre-RoPE storage)
  std::vector<std::int64_t> positions;  // [n] query positions in one KV head
};

}  // namespace

struct Decoder::AttentionScratch {
  AttentionScratch(const Rope& rope, int threads) {
    for (int t = 0; t < threads; ++t) per_thread.emplace_back(rope);
  }
  std::vector<HeadScratch> per_thread;  // [threads]
  std::vector<float> rows;              // [heads][queries][stride] probabilities for the policy
};

Decoder::Decoder(const Model& model, std::unique_ptr<Policy> policy, DecoderOptions options)
    : model_(model),
      options_(options),
      cache_(cache_config(model, options), std::move(policy), options.observer),
      attention_(std::make_unique<AttentionScratch>(cache_.rope(), options.threads)),
      pool_(options.threads > 1 ? std::make_unique<ThreadPool>(options.threads) : nullptr) {
  const std::int64_t reserved_rows =
      kReservedActivationBytes / (activation_floats(model_.config) * std::int64_t{sizeof(float)});
  reserve_rows(static_cast<int>(std::clamp<std::int64_t>(reserved_rows, 1, options_.max_chunk)));
}

Decoder::~Decoder() = default;

void Decoder::reserve_rows(int rows) {
  if (rows <= scratch_rows_) return;
  // Grown geometrically up to max_chunk, so that a stream of growing chunks reallocates rarely.
  rows = std::max(rows, std::min(2 * scratch_rows_, options_.max_chunk));
  const ModelConfig& c = model_.config;
  const auto n = static_cast<std::size_t>(rows);
  const auto q_dim = static_cast<std::size_t>(c.heads) * c.head_dim();
  const auto kv_dim = static_cast<std::size_t>(c.kv_heads) * c.head_dim();
  (void)checked_allocation({rows, activation_floats(c)},
                           "Decoder: activations of a " + std::to_string(rows) +
                               "-token chunk (max_chunk, --chunk, sets the largest)",
                           kMaxScratchFloats);
  x_.resize(n * c.dim);
  xb_.resize(n * c.dim);
  q_.resize(n * q_dim);
  k_.resize(n * kv_dim);
  v_.resize(n * kv_dim);
  att_.resize(n * q_dim);
  hb_.resize(n * c.hidden_dim);
  hb2_.resize(n * c.hidden_dim);
  scratch_rows_ = rows;
}

void Decoder::check_tokens(std::span<const std::int32_t> tokens, const char* what) const {
  const int vocab = model_.config.vocab_size;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    KVEVICT_REQUIRE(tokens[i] >= 0 && tokens[i] < vocab,
                    std::string("Decoder: ") + what + " token id " + std::to_string(tokens[i]) +
                        " at index " + std::to_string(i) + " is out of range [0, " +
                        std::to_string(vocab) + ")");
  }
}

void Decoder::note_kv_bytes() {
  stats_.peak_kv_bytes = std::max(stats_.peak_kv_bytes, cache_.memory().live_kv_bytes);
}

void Decoder::set_catalyst(std::vector<std::int32_t> tokens) {
  check_tokens(tokens, "catalyst");
  reserve_rows(static_cast<int>(tokens.size()));
  catalyst_ = std::move(tokens);
}

ForwardResult Decoder::forward(std::span<const std::int32_t> tokens, ForwardRequest request) {
  const int n = static_cast<int>(tokens.size());
  const int vocab = model_.config.vocab_size;
  KVEVICT_REQUIRE(n > 0, "Decoder::forward: empty chunk (a forward needs at least one token)");
  KVEVICT_REQUIRE(n <= options_.max_chunk,
                  "Decoder::forward: chunk of " + std::to_string(n) +
                      " tokens exceeds max_chunk = " + std::to_string(options_.max_chunk) +
                      " (use feed() to split it)");
  check_tokens(tokens, "forward:");
  reserve_rows(n);
  const bool wants_surprisal = cache_.sequence().wants(Signal::surprisal);
  const bool all_rows = request.all_logits || wants_surprisal;
  StageObserver* observer = options_.observer;
  for (HeadScratch& thread : attention_->per_thread) thread.angles.clear();

  // 1. Slots for the chunk (the policy may evict first, before a turn).
  cache_.sequence().begin_chunk(tokens, request.turn_start);
  note_kv_bytes();
  // The first token's surprisal comes from the previous forward's last logits, read before the
  // head overwrites them; the stream's very first token gets 0.
  if (wants_surprisal) {
    const StageScope stage(observer, Stage::head);
    surprisal_.resize(static_cast<std::size_t>(n));
    surprisal_[0] = logit_rows_ == 0
                        ? 0.0f
                        : negative_log_softmax(
                              logits_.data() + static_cast<std::size_t>(logit_rows_ - 1) * vocab,
                              vocab, tokens[0]);
  }
  // 2. The layers; attention rows go to the policy as each layer computes them.
  transformer(tokens, Pass::stream);
  // 3. Logits, and the surprisal of every token after the first.
  {
    const StageScope stage(observer, Stage::head);
    output_head(n, all_rows);
    for (int k = 1; wants_surprisal && k < n; ++k) {
      surprisal_[static_cast<std::size_t>(k)] = negative_log_softmax(
          logits_.data() + static_cast<std::size_t>(k - 1) * vocab, vocab, tokens[k]);
    }
  }
  if (wants_surprisal)
    cache_.sequence().observe_surprisal(std::span<const float>(surprisal_.data(), tokens.size()));
  // 4. Evict, if the policy does so after a forward (or after an anchor).
  cache_.sequence().end_forward();
  // 5. A full pot: run the catalyst prompt, let the policy read its attention, distill.
  if (cache_.sequence().catalyst_pending()) run_catalyst();
  stats_.tokens_fed += n;
  ++stats_.forwards;

  ForwardResult result;
  result.vocab = vocab;
  result.rows = request.all_logits ? n : 1;
  const std::size_t first_row =
      all_rows && !request.all_logits ? static_cast<std::size_t>(n - 1) : 0;
  result.logits = std::span<const float>(logits_.data() + first_row * vocab,
                                         static_cast<std::size_t>(result.rows) * vocab);
  if (wants_surprisal) result.surprisal = std::span<const float>(surprisal_.data(), tokens.size());
  return result;
}

void Decoder::run_catalyst() {
  KVEVICT_REQUIRE(catalyst_.has_value(),
                  "Decoder: policy '" + std::string(cache_.sequence().policy().name()) +
                      "' filled its pot and needs a catalyst prompt: call set_catalyst() first");
  {
    const StageScope stage(options_.observer, Stage::catalyst);
    cache_.sequence().begin_catalyst(*catalyst_);
    note_kv_bytes();
    if (!catalyst_->empty()) transformer(*catalyst_, Pass::catalyst);
  }
  cache_.sequence().end_catalyst();  // rolled back and distilled: the policy's stages
  ++stats_.catalyst_runs;
}

ForwardResult Decoder::feed(std::span<const std::int32_t> tokens, ForwardRequest request,
                            int chunk_size) {
  KVEVICT_REQUIRE(!tokens.empty(), "Decoder::feed: no tokens to feed");
  if (chunk_size == 0) chunk_size = options_.max_chunk;
  KVEVICT_REQUIRE(chunk_size > 0 && chunk_size <= options_.max_chunk,
                  "Decoder::feed: chunk_size " + std::to_string(chunk_size) + " outside [1, " +
                      std::to_string(options_.max_chunk) + "]");
  check_tokens(tokens, "feed:");
  const std::size_t total = tokens.size();
  const auto vocab = static_cast<std::size_t>(model_.config.vocab_size);
  const bool wants_surprisal = cache_.sequence().wants(Signal::surprisal);
  if (request.all_logits) {
    feed_logits_.resize(
        checked_allocation({static_cast<std::int64_t>(total), static_cast<std::int64_t>(vocab)},
                           "Decoder::feed: logits of every token", std::int64_t{1} << 31));
  }
  if (wants_surprisal) feed_surprisal_.resize(total);

  ForwardResult last;
  std::size_t offset = 0;
  while (offset < total) {
    std::size_t n = std::min(static_cast<std::size_t>(chunk_size), total - offset);
    // Never cross a pot boundary: the pot is distilled exactly when it is full.
    const std::optional<int> room = cache_.sequence().pot_room();
    if (room && *room > 0) n = std::min(n, static_cast<std::size_t>(*room));
    last = forward(tokens.subspan(offset, n),
                   ForwardRequest{request.turn_start && offset == 0, request.all_logits});
    if (request.all_logits) {
      std::copy(last.logits.begin(), last.logits.end(), feed_logits_.begin() + offset * vocab);
    }
    if (wants_surprisal) {
      std::copy(last.surprisal.begin(), last.surprisal.end(), feed_surprisal_.begin() + offset);
    }
    offset += n;
  }
  if (request.all_logits) {
    last.logits = feed_logits_;
    last.rows = static_cast<int>(total);
  }
  if (wants_surprisal) last.surprisal = feed_surprisal_;
  return last;
}

// The transformer over a chunk of n tokens whose slots were just given by the cache: leaves the
// final residual stream in x_ ([n, dim]). The catalyst pass is timed as a whole by its caller.
void Decoder::transformer(std::span<const std::int32_t> tokens, Pass pass) {
  const ModelConfig& c = model_.config;
  const int n = static_cast<int>(tokens.size());
  const int hd = c.head_dim();
  const int q_dim = c.heads * hd;
  const int kv_dim = c.kv_heads * hd;
  StageObserver* observer = pass == Pass::stream ? options_.observer : nullptr;

  Eigen::Map<RowMatrix> x(x_.data(), n, c.dim);             // [n, dim] residual stream
  Eigen::Map<RowMatrix> xb(xb_.data(), n, c.dim);           // [n, dim]
  Eigen::Map<RowMatrix> q(q_.data(), n, q_dim);             // [n, heads * head_dim]
  Eigen::Map<RowMatrix> k(k_.data(), n, kv_dim);            // [n, kv_heads * head_dim]
  Eigen::Map<RowMatrix> v(v_.data(), n, kv_dim);            // [n, kv_heads * head_dim]
  Eigen::Map<RowMatrix> att(att_.data(), n, q_dim);         // [n, heads * head_dim]
  Eigen::Map<RowMatrix> hb(hb_.data(), n, c.hidden_dim);    // [n, hidden_dim]
  Eigen::Map<RowMatrix> hb2(hb2_.data(), n, c.hidden_dim);  // [n, hidden_dim]

  // Token embedding: row i of x is the embedding of token i.                    // [n, dim]
  {
    const StageScope stage(observer, Stage::head);
    for (int i = 0; i < n; ++i) model_.token_embedding.row_to_f32(tokens[i], x.row(i).data());
  }

  for (int l = 0; l < c.layers; ++l) {
    const LayerWeights& w = model_.layers[static_cast<std::size_t>(l)];
    {
      const StageScope stage(observer, Stage::attention);
      // Attention RMSNorm.                                                      // [n, dim]
      rmsnorm(xb, x, w.attention_norm, c.norm_eps);
      // Q, K, V projections.                               // [n, q_dim], [n, kv_dim], [n, kv_dim]
      matmul(w.wq, xb, q, products());
      matmul(w.wk, xb, k, products());
      matmul(w.wv, xb, v, products());
      // The chunk's keys (rotated by the cache for post-RoPE storage) and values.  // [n, head_dim]
      for (int g = 0; g < c.kv_heads; ++g) {
        cache_.write_chunk(l, g, k.middleCols(g * hd, hd), v.middleCols(g * hd, hd));
      }
      // The stored keys to a policy that scores them (K-norm, KeyDiff).
      if (pass == Pass::stream && cache_.sequence().wants_keys()) cache_.observe_stored_keys(l);
      // Attention of every query head over its KV head's cache; rows to the policy. // [n, q_dim]
      attention(l, n, pass);
      // Output projection and residual.                                         // [n, dim]
      matmul(w.wo, att, xb, products());
      kernels::add(x.data(), xb.data(), x.size());
    }
    {
      const StageScope stage(observer, Stage::mlp);
      // FFN RMSNorm.                                                            // [n, dim]
      rmsnorm(xb, x, w.ffn_norm, c.norm_eps);
      // Gate and up projections.                                                // [n, hidden_dim]
      matmul(w.w_gate, xb, hb, products());
      matmul(w.w_up, xb, hb2, products());
      // SwiGLU: silu(gate) * up.                                                // [n, hidden_dim]
      kernels::swiglu(hb.data(), hb2.data(), hb.size());
      // Down projection and residual.                                           // [n, dim]
      matmul(w.w_down, hb, xb, products());
      kernels::add(x.data(), xb.data(), x.size());
    }
  }
}

// Attention of layer `layer` for the chunk's n queries (q_ -> att_), over the cache's live slots of
// each KV head. Hands the softmax rows to the policy when it reads them: every query (H2O, the
// catalyst's CaP) or the last (TOVA).
void Decoder::attention(int layer, int n, Pass pass) {
  const ModelConfig& c = model_.config;
  const int hd = c.head_dim();
  const int group = c.heads / c.kv_heads;
  const std::ptrdiff_t q_dim = static_cast<std::ptrdiff_t>(c.heads) * hd;
  AttentionScratch& shared = *attention_;
  const bool all_queries = pass == Pass::stream
                               ? cache_.sequence().wants(Signal::attention_rows)
                               : cache_.sequence().wants(Signal::catalyst_attention);
  const bool last_query =
      pass == Pass::stream && !all_queries && cache_.sequence().wants(Signal::last_attention_row);
  const bool give_rows = all_queries || last_query;
  const int first_row = last_query ? n - 1 : 0;  // first query row handed over
  const int queries = n - first_row;

  // Rows handed to the policy: [heads][queries][stride], stride = the layer's widest slot limit.
  int stride = 0;
  for (int g = 0; g < c.kv_heads; ++g)
    stride = std::max(stride, cache_.sequence().slot_limit(layer, g));
  if (give_rows) {
    shared.rows.resize(checked_allocation({c.heads, queries, stride},
                                          "Decoder: attention rows for the policy",
                                          std::int64_t{1} << 32));
  }

  // One task per KV head, on the scratch of the thread that runs it.
  const auto attend_kv_head = [&](int g, int thread) {
    HeadScratch& scratch = attention_->per_thread[static_cast<std::size_t>(thread)];
    const int limit = cache_.sequence().slot_limit(layer, g);
    // The live slots, by run of equal pending rotation (pre-RoPE keys: rotated to their positions).
    scratch.runs.clear();
    const bool post_rope = options_.key_storage == KeyStorage::post_rope;
    const auto add_run = [&](int begin, int end, std::int64_t rotation) {
      scratch.runs.push_back(KeyRun{begin, end, post_rope ? rotation : 0});
    };
    if (post_rope) {
      cache_.sequence().slots().for_each_key_run(cache_.sequence().unit_of(layer, g), add_run);
    } else {
      cache_.sequence().slots().for_each_position_run(cache_.sequence().unit_of(layer, g), add_run);
    }
    const std::span<const std::int32_t> chunk_slots = cache_.sequence().chunk_slots(layer, g);
    scratch.positions.resize(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      scratch.positions[static_cast<std::size_t>(i)] =
          cache_.sequence().position(layer, g, chunk_slots[static_cast<std::size_t>(i)]);
    }
    // The group's query heads h = g * group + [0, group), stacked: K and V are read once.
    GroupAttention heads;
    heads.queries = q_.data() + static_cast<std::ptrdiff_t>(g) * group * hd;
    heads.query_stride = q_dim;
    heads.heads = group;
    heads.query_positions = scratch.positions;
    heads.query_slots = chunk_slots;
    heads.keys = post_rope
                     ? cache_.stored_keys(layer, g)
                     : StoredRows{reinterpret_cast<const std::uint8_t*>(
                                      cache_.rotated_keys(layer, g, scratch.key_scratch).data()),
                                  KvType::f32, sizeof(float) * static_cast<std::size_t>(hd)};
    heads.values = cache_.stored_values(layer, g);
    heads.slot_limit = limit;
    heads.head_dim = hd;
    heads.runs = scratch.runs;
    scratch.probabilities.resize(checked_allocation(
        {group, n, limit},
        "Decoder: attention probabilities of a " + std::to_string(n) +
            "-token chunk over one KV head (max_chunk, --chunk, sets the largest chunk)",
        kMaxScratchFloats));
    attend(heads, scratch.angles, scratch.probabilities.data(),
           att_.data() + static_cast<std::ptrdiff_t>(g) * group * hd, q_dim, scratch.buffers);
    if (!give_rows) return;
    // Hand the probabilities over, zero past this KV head's slots.   // [group, queries, stride]
    for (int hh = 0; hh < group; ++hh) {
      const int h = g * group + hh;
      for (int i = 0; i < queries; ++i) {
        const float* row = scratch.probabilities.data() +
                           (static_cast<std::size_t>(hh) * n + first_row + i) * limit;
        float* out = shared.rows.data() + (static_cast<std::size_t>(h) * queries + i) * stride;
        std::copy_n(row, limit, out);
        std::fill(out + limit, out + stride, 0.0f);
      }
    }
  };
  if (pool_ != nullptr) {
    pool_->run(c.kv_heads, attend_kv_head);
  } else {
    for (int g = 0; g < c.kv_heads; ++g) attend_kv_head(g, 0);
  }
  if (!give_rows) return;
  if (pass == Pass::stream) {
    cache_.sequence().observe_attention(layer, shared.rows.data(), queries, stride);
  } else {
    cache_.sequence().observe_catalyst(layer, shared.rows.data(), queries, stride);
  }
}

ProductSettings Decoder::products() const { return {pool_.get(), options_.decode_activations}; }

// Final RMSNorm and output head: logits of every chunk token (rows 0..n-1 of logits_) or of the
// last one (row 0). The last token always goes through matvec, so its logits do not depend on
// whether the other rows were asked for.
void Decoder::output_head(int n, bool all_rows) {
  const ModelConfig& c = model_.config;
  const int first = all_rows ? 0 : n - 1;
  const int rows = n - first;
  const std::size_t needed = static_cast<std::size_t>(rows) * c.vocab_size;
  if (logits_.size() < needed) logits_.resize(needed);
  const Eigen::Map<const RowMatrix> x(x_.data() + static_cast<std::size_t>(first) * c.dim, rows,
                                      c.dim);                        // [rows, dim]
  Eigen::Map<RowMatrix> xb(xb_.data(), rows, c.dim);                 // [rows, dim]
  Eigen::Map<RowMatrix> logits(logits_.data(), rows, c.vocab_size);  // [rows, vocab]
  // Final RMSNorm.                                                              // [rows, dim]
  rmsnorm(xb, x, model_.final_norm, c.norm_eps);
  // Classifier: logits = W_out x.                                               // [rows, vocab]
  if (rows > 1) matmul(model_.output, xb.topRows(rows - 1), logits.topRows(rows - 1), products());
  matvec(model_.output, xb_.data() + static_cast<std::size_t>(rows - 1) * c.dim,
         logits_.data() + static_cast<std::size_t>(rows - 1) * c.vocab_size, products());
  logit_rows_ = rows;
}

}  // namespace kvevict::model
