#include <algorithm>
#include <cmath>
#include <kvevict/model/decoder.hpp>
#include <string>
#include <utility>

#include "kvevict/error.hpp"
#include "kvevict/signals.hpp"
#include "matmul.hpp"

namespace kvevict::model {
namespace {

using RowVector = Eigen::Matrix<float, 1, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::OuterStride<>;

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

  CacheConfig config;
  config.shape = CacheShape{c.layers, c.heads, c.kv_heads, c.head_dim()};
  config.rope.head_dim = c.head_dim();
  config.rope.rotary_dim = c.rotary_dim;
  config.rope.theta = c.rope_theta;
  config.rope.layout = c.rope_layout;
  config.rope.table_positions = options.rope_table_positions > 0
                                    ? options.rope_table_positions
                                    : std::clamp(c.context_length, 4096, 16384);
  config.position_mode = options.position_mode;
  config.key_storage = options.key_storage;
  config.max_chunk = options.max_chunk;
  return config;
}

// out = x / rms(x) * weight, row by row (llama2.c's rmsnorm, in f32).
void rmsnorm(Eigen::Ref<RowMatrix> out, const Eigen::Ref<const RowMatrix>& x,
             const std::vector<float>& weight, float eps) {
  const Eigen::Map<const RowVector> w(weight.data(), static_cast<Eigen::Index>(weight.size()));
  for (Eigen::Index i = 0; i < x.rows(); ++i) {
    const float mean_square = x.row(i).squaredNorm() / static_cast<float>(x.cols());
    const float inverse_rms = 1.0f / std::sqrt(mean_square + eps);
    out.row(i).array() = x.row(i).array() * inverse_rms * w.array();
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

Decoder::Decoder(const Model& model, std::unique_ptr<Policy> policy, DecoderOptions options)
    : model_(model), options_(options), cache_(cache_config(model, options), std::move(policy)) {
  const ModelConfig& c = model_.config;
  // DecoderStats itemises eviction time with the cache's stage timing.
  cache_.set_timing(true);
  reserve_scratch(options_.max_chunk);
  logits_.assign(static_cast<std::size_t>(options_.max_chunk) * c.vocab_size, 0.0f);
  surprisal_.assign(static_cast<std::size_t>(options_.max_chunk), 0.0f);
  keys_per_kv_head_.assign(static_cast<std::size_t>(c.kv_heads), 0);
  const std::optional<int> limit = cache_.policy().retained_limit();
  const std::size_t live = static_cast<std::size_t>(limit ? *limit + options_.max_chunk : 256);
  scores_.resize(static_cast<std::size_t>(options_.max_chunk) * live);
}

void Decoder::reserve_scratch(int rows) {
  if (rows <= scratch_rows_) return;
  const ModelConfig& c = model_.config;
  const auto n = static_cast<std::size_t>(rows);
  const auto q_dim = static_cast<std::size_t>(c.heads) * c.head_dim();
  const auto kv_dim = static_cast<std::size_t>(c.kv_heads) * c.head_dim();
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
  const int n = static_cast<int>(tokens.size());
  reserve_scratch(n);
  // Room for the catalyst on top of the pot, now rather than at the first distillation.
  if (const std::optional<int> limit = cache_.policy().retained_limit()) {
    cache_.store().reserve(*limit + std::max(n, options_.max_chunk));
  }
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
  const bool wants_surprisal = cache_.wants(Signal::surprisal);
  const bool all_rows = request.all_logits || wants_surprisal;

  const Clock::time_point start = Clock::now();
  // The cache's policy / reposition totals may also grow outside forward() (an engine driving the
  // cache directly): only what happens inside this forward is counted.
  const EvictionTiming at_start = cache_.timing();
  // Evict first if the policy does so before a turn, then append the chunk's slots.
  cache_.begin_chunk(tokens, request.turn_start);
  note_kv_bytes();
  const Clock::time_point appended = Clock::now();
  const Clock::duration policy_before_compute = cache_.timing().policy;

  // The first token's surprisal comes from the previous forward's last logits, read before the
  // head overwrites them; the stream's very first token gets 0.
  if (wants_surprisal) {
    surprisal_[0] = logit_rows_ == 0
                        ? 0.0f
                        : negative_log_softmax(
                              logits_.data() + static_cast<std::size_t>(logit_rows_ - 1) * vocab,
                              vocab, tokens[0]);
    times_.head += Clock::now() - appended;
  }
  // Layers over the chunk (attention rows go to the policy), then logits and surprisal.
  transformer(tokens, Pass::stream, &times_);
  const Clock::time_point head_start = Clock::now();
  output_head(n, all_rows);
  if (wants_surprisal) {
    for (int k = 1; k < n; ++k) {
      surprisal_[static_cast<std::size_t>(k)] = negative_log_softmax(
          logits_.data() + static_cast<std::size_t>(k - 1) * vocab, vocab, tokens[k]);
    }
  }
  times_.head += Clock::now() - head_start;
  if (wants_surprisal) {
    cache_.observe_surprisal(std::span<const float>(surprisal_.data(), tokens.size()));
  }
  const Clock::time_point computed = Clock::now();
  // The policy's observe_* hooks ran inside the compute: their time belongs to eviction.
  const Clock::duration observed = cache_.timing().policy - policy_before_compute;

  // Evict if the policy does so after a forward (or after an anchor).
  cache_.end_forward();
  // A full pot: run the catalyst prompt, let the policy read its attention, distill, roll back.
  if (cache_.catalyst_pending()) {
    KVEVICT_REQUIRE(catalyst_.has_value(),
                    "Decoder: policy '" + std::string(cache_.policy().name()) +
                        "' filled its pot and needs a catalyst prompt: call set_catalyst() first");
    const Clock::time_point catalyst_start = Clock::now();
    const EvictionTiming before = cache_.timing();
    cache_.begin_catalyst(*catalyst_);
    note_kv_bytes();
    if (!catalyst_->empty()) transformer(*catalyst_, Pass::catalyst, nullptr);
    cache_.end_catalyst();
    const EvictionTiming& after = cache_.timing();
    // The block minus what the policy and the compaction report inside it.
    times_.catalyst += (Clock::now() - catalyst_start) - (after.policy - before.policy) -
                       (after.reposition - before.reposition);
    ++stats_.catalyst_runs;
  }
  const Clock::time_point done = Clock::now();

  times_.forward += (computed - appended) - observed;
  times_.eviction += (appended - start) + observed + (done - computed);
  const auto to_seconds = [](Clock::duration elapsed) {
    return std::chrono::duration<double>(elapsed).count();
  };
  stats_.forward_seconds = to_seconds(times_.forward);
  stats_.eviction_seconds = to_seconds(times_.eviction);
  stats_.head_seconds = to_seconds(times_.head);
  stats_.attention_seconds = to_seconds(times_.attention);
  stats_.mlp_seconds = to_seconds(times_.mlp);
  times_.policy += cache_.timing().policy - at_start.policy;
  times_.reposition += cache_.timing().reposition - at_start.reposition;
  stats_.policy_seconds = to_seconds(times_.policy);
  stats_.reposition_seconds = to_seconds(times_.reposition);
  stats_.catalyst_seconds = to_seconds(times_.catalyst);
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
  const bool wants_surprisal = cache_.wants(Signal::surprisal);
  if (request.all_logits) feed_logits_.resize(total * vocab);
  if (wants_surprisal) feed_surprisal_.resize(total);

  ForwardResult last;
  std::size_t offset = 0;
  while (offset < total) {
    std::size_t n = std::min(static_cast<std::size_t>(chunk_size), total - offset);
    // Never cross a pot boundary: the pot is distilled exactly when it is full.
    const std::optional<int> room = cache_.policy().pot_room(cache_.pipeline().slots());
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

// The transformer over a chunk of n tokens whose slots were just appended to the cache: leaves the
// final residual stream in x_ ([n, dim]). Pass::stream hands attention rows to observe_attention
// when the policy wants them; Pass::catalyst hands every catalyst query's rows to observe_catalyst.
void Decoder::transformer(std::span<const std::int32_t> tokens, Pass pass, StageTimes* times) {
  const ModelConfig& c = model_.config;
  const int n = static_cast<int>(tokens.size());
  const int hd = c.head_dim();
  const int heads = c.heads;
  const int kv_heads = c.kv_heads;
  const int group = heads / kv_heads;
  const int q_dim = heads * hd;
  const int kv_dim = kv_heads * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  // Which attention probabilities the policy reads, if any.
  const bool all_queries = pass == Pass::stream ? cache_.wants(Signal::attention_rows)
                                                : cache_.wants(Signal::catalyst_attention);
  const bool last_query =
      pass == Pass::stream && !all_queries && cache_.wants(Signal::last_attention_row);
  const bool give_rows = all_queries || last_query;
  const int first_row = last_query ? n - 1 : 0;  // first query row handed over
  const int queries = n - first_row;

  Eigen::Map<RowMatrix> x(x_.data(), n, c.dim);             // [n, dim] residual stream
  Eigen::Map<RowMatrix> xb(xb_.data(), n, c.dim);           // [n, dim]
  Eigen::Map<RowMatrix> q(q_.data(), n, q_dim);             // [n, heads * head_dim]
  Eigen::Map<RowMatrix> k(k_.data(), n, kv_dim);            // [n, kv_heads * head_dim]
  Eigen::Map<RowMatrix> v(v_.data(), n, kv_dim);            // [n, kv_heads * head_dim]
  Eigen::Map<RowMatrix> att(att_.data(), n, q_dim);         // [n, heads * head_dim]
  Eigen::Map<RowMatrix> hb(hb_.data(), n, c.hidden_dim);    // [n, hidden_dim]
  Eigen::Map<RowMatrix> hb2(hb2_.data(), n, c.hidden_dim);  // [n, hidden_dim]

  // Stage timing (stream pass only): lap() adds the time since the last mark to a stage and moves
  // the mark; restart() moves it without counting (the policy's observe_attention times itself).
  Clock::time_point mark = times != nullptr ? Clock::now() : Clock::time_point{};
  const auto lap = [&](Clock::duration StageTimes::*stage) {
    if (times == nullptr) return;
    const Clock::time_point now = Clock::now();
    times->*stage += now - mark;
    mark = now;
  };
  const auto restart = [&] {
    if (times != nullptr) mark = Clock::now();
  };

  // Token embedding: row i of x is the embedding of token i.                    // [n, dim]
  for (int i = 0; i < n; ++i) model_.token_embedding.row_to_f32(tokens[i], x.row(i).data());
  lap(&StageTimes::head);

  for (int l = 0; l < c.layers; ++l) {
    const LayerWeights& w = model_.layers[static_cast<std::size_t>(l)];

    // Attention RMSNorm.                                                        // [n, dim]
    rmsnorm(xb, x, w.attention_norm, c.norm_eps);
    // Q, K, V projections.                                 // [n, q_dim], [n, kv_dim], [n, kv_dim]
    matmul(w.wq, xb, q);
    matmul(w.wk, xb, k);
    matmul(w.wv, xb, v);
    // Store the chunk's pre-RoPE keys and its values in every KV head's cache.  // [n, head_dim]
    for (int g = 0; g < kv_heads; ++g) {
      cache_.write_chunk(l, g, k.middleCols(g * hd, hd), v.middleCols(g * hd, hd));
    }
    // Rotate query head h to the positions of its KV head's newest n slots.    // [n, head_dim]
    for (int h = 0; h < heads; ++h) {
      cache_.rope().rotate_rows(q_.data() + static_cast<std::ptrdiff_t>(h) * hd, q_dim,
                                cache_.positions(l, h / group).last(static_cast<std::size_t>(n)));
    }

    // Rows handed to the policy: [heads][queries][stride], stride = the layer's longest head.
    int stride = 0;
    for (int g = 0; g < kv_heads; ++g) stride = std::max(stride, cache_.live(l, g));
    if (give_rows) {
      const std::size_t needed = static_cast<std::size_t>(heads) * queries * stride;
      if (rows_.size() < needed) rows_.resize(std::max(needed, 2 * rows_.size()));
    }
    if (scores_.size() < static_cast<std::size_t>(n) * stride) {
      scores_.resize(std::max(static_cast<std::size_t>(n) * stride, 2 * scores_.size()));
    }

    // Attention of each query head over its KV head's live slots.
    for (int g = 0; g < kv_heads; ++g) {
      const int live = cache_.live(l, g);
      keys_per_kv_head_[static_cast<std::size_t>(g)] = live;
      // Keys rotated to their slots' positions, and values.                    // [live, head_dim]
      const Eigen::Map<const RowMatrix> keys = cache_.attention_keys(l, g, key_scratch_);
      const Eigen::Map<const RowMatrix> values = cache_.values(l, g);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        // Scores q . k for every query of the chunk and every slot.              // [n, live]
        Eigen::Map<RowMatrix> scores(scores_.data(), n, live);
        scores.noalias() = q.middleCols(h * hd, hd) * keys.transpose();
        // Causal softmax of (q . k) / sqrt(head_dim): query i sees slots [0, live - n + i].
        for (int i = 0; i < n; ++i) {
          const int visible = live - n + i + 1;
          Eigen::Ref<RowVector> row = scores.row(i);
          const float max = row.head(visible).maxCoeff();
          row.head(visible) = ((row.head(visible).array() - max) * scale).exp().matrix();
          row.head(visible) /= row.head(visible).sum();
          row.tail(live - visible).setZero();
        }
        // Weighted sum of the values.                                            // [n, head_dim]
        att.middleCols(h * hd, hd).noalias() = scores * values;
        // Hand the probabilities over, zero past this head's slots.    // [queries, stride]
        if (give_rows) {
          for (int i = 0; i < queries; ++i) {
            float* out = rows_.data() + (static_cast<std::size_t>(h) * queries + i) * stride;
            std::copy_n(scores_.data() + static_cast<std::size_t>(first_row + i) * live, live, out);
            std::fill(out + live, out + stride, 0.0f);
          }
        }
      }
    }
    if (give_rows) {
      lap(&StageTimes::attention);
      const int live = cache_.live(l, 0);
      const std::int64_t first_position = cache_.store().slots().original_positions(
          l, 0)[static_cast<std::size_t>(live - n + first_row)];
      const AttentionRows rows(rows_.data(), heads, group, queries, stride, keys_per_kv_head_,
                               first_position);
      if (pass == Pass::stream) {
        cache_.observe_attention(l, rows);
      } else {
        cache_.observe_catalyst(l, rows);
      }
      restart();
    }

    // Output projection and residual.                                          // [n, dim]
    matmul(w.wo, att, xb);
    x += xb;
    lap(&StageTimes::attention);
    // FFN RMSNorm.                                                              // [n, dim]
    rmsnorm(xb, x, w.ffn_norm, c.norm_eps);
    // Gate and up projections.                                                  // [n, hidden_dim]
    matmul(w.w_gate, xb, hb);
    matmul(w.w_up, xb, hb2);
    // SwiGLU: silu(gate) * up.                                                  // [n, hidden_dim]
    hb.array() = hb.array() / (1.0f + (-hb.array()).exp()) * hb2.array();
    // Down projection and residual.                                             // [n, dim]
    matmul(w.w_down, hb, xb);
    x += xb;
    lap(&StageTimes::mlp);
  }
}

// Final RMSNorm and output head: logits of every chunk token (rows 0..n-1 of logits_) or of the
// last one (row 0). The last token always goes through matvec, so its logits do not depend on
// whether the other rows were asked for.
void Decoder::output_head(int n, bool all_rows) {
  const ModelConfig& c = model_.config;
  const int first = all_rows ? 0 : n - 1;
  const int rows = n - first;
  const Eigen::Map<const RowMatrix> x(x_.data() + static_cast<std::size_t>(first) * c.dim, rows,
                                      c.dim);                        // [rows, dim]
  Eigen::Map<RowMatrix> xb(xb_.data(), rows, c.dim);                 // [rows, dim]
  Eigen::Map<RowMatrix> logits(logits_.data(), rows, c.vocab_size);  // [rows, vocab]
  // Final RMSNorm.                                                              // [rows, dim]
  rmsnorm(xb, x, model_.final_norm, c.norm_eps);
  // Classifier: logits = W_out x.                                               // [rows, vocab]
  if (rows > 1) matmul(model_.output, xb.topRows(rows - 1), logits.topRows(rows - 1));
  matvec(model_.output, xb_.data() + static_cast<std::size_t>(rows - 1) * c.dim,
         logits_.data() + static_cast<std::size_t>(rows - 1) * c.vocab_size);
  logit_rows_ = rows;
}

}  // namespace kvevict::model
