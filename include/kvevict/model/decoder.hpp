// Reference Llama decoder over a kvevict::EvictingCache: one sequence, f32 math, Eigen, one thread.
//
// Written like llama2.c: one function runs the layers (embedding, RMSNorm, grouped-query
// attention with RoPE over the evicting cache, SwiGLU MLP), the output head and the surprisal are
// computed beside it, and every buffer is allocated at construction and reused. The decoder is
// the engine side of the kvevict protocol (evicting_cache.hpp): per forward it calls begin_chunk,
// write_chunk per (layer, KV head), hands the policy the signals it declared (attention rows of all
// queries or of the last one, surprisal), calls end_forward, and runs the catalyst prompt when an
// InfiniPot-style policy has filled its pot.
//
// Positions: the chunk's queries of query head h sit at the positions of the newest n slots of KV
// head h / group in that layer (cache.positions(l, g)); keys are rotated to their slots' positions
// by the cache (pre-RoPE storage: a rotated copy per attention; post-RoPE: rotated at append and
// re-rotated by the compaction deltas).
//
// Surprisal (Signal::surprisal): token k of a chunk gets -log softmax(logits of the position before
// it)[token k]. The first token of a chunk uses the last logits of the previous forward, i.e. the
// model's prediction from the context as it stood then (before that forward's eviction); the very
// first token of the stream has no prediction and gets 0.
#pragma once

#include <Eigen/Core>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <kvevict/evicting_cache.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/positions.hpp>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvevict/model/model.hpp"

namespace kvevict::model {

struct DecoderOptions {
  /// How the cache stores keys. Both give the same logits (up to rounding); post_rope is faster
  /// for long caches (no rotation of every cached key at every attention).
  KeyStorage key_storage = KeyStorage::post_rope;
  /// Overrides the policy's default position mode.
  std::optional<PositionMode> position_mode;
  /// Largest chunk forward() accepts (feed() splits longer inputs). Sizes the scratch buffers and,
  /// with the policy's retained_limit(), the cache, so that a bounded policy never reallocates.
  int max_chunk = 64;
  /// RoPE positions with a precomputed cos/sin table (speed only; results are identical).
  /// 0 = max(context_length, 4096), at most 16384.
  int rope_table_positions = 0;
};

struct ForwardRequest {
  bool turn_start = false;  ///< the chunk starts a turn (reaches the policy: SirLLM's before_turn)
  bool all_logits = false;  ///< logits of every token of the chunk, not only of the last one
};

/// What a forward returns. The spans point into the decoder's buffers and stay valid until the
/// next forward() or feed().
struct ForwardResult {
  std::span<const float> logits;  ///< [rows, vocab] row-major: every chunk token, or the last one
  int rows = 0;
  int vocab = 0;
  /// -log p of each token fed (see the header comment), when the policy wants surprisal; else
  /// empty.
  std::span<const float> surprisal;

  /// Logits of the last token fed: [vocab].
  [[nodiscard]] std::span<const float> last() const {
    return logits.subspan(static_cast<std::size_t>(rows - 1) * static_cast<std::size_t>(vocab));
  }
};

/// Counters and wall-clock time (std::chrono::steady_clock, seconds summed over every forward()
/// since construction) of a decoder. Time is split in two disjoint totals, each itemised:
///
///   forward_seconds  = head_seconds + attention_seconds + mlp_seconds + r_f
///   eviction_seconds = policy_seconds + reposition_seconds + catalyst_seconds + r_e
///
/// forward_seconds + eviction_seconds is the wall time of the forward() calls (past their argument
/// checks). The remainders r_f and r_e are never negative (every part is a sub-interval of its
/// total, measured in integer clock ticks): r_f is clock reads and glue between the stages; r_e is
/// the per-token slot bookkeeping every policy pays, the full cache included (appending the chunk's
/// slot metadata and positions, Policy::on_append, growing buffers) and trigger checks. The parts
/// cover stream tokens only; a catalyst prompt's own model compute is catalyst_seconds. Typical
/// use: the overhead of a policy over the model is (policy_seconds + reposition_seconds) /
/// (attention_seconds + mlp_seconds), or with eviction_seconds in the numerator to include
/// everything the policy causes.
///
/// Cost: two to five clock reads per layer and about a dozen per forward (tens of nanoseconds
/// each), none per row or slot. With a full cache policy_seconds and reposition_seconds stay
/// exactly 0.
struct DecoderStats {
  std::int64_t tokens_fed = 0;     ///< stream tokens (catalyst tokens excluded)
  std::int64_t forwards = 0;       ///< forward() calls
  std::int64_t catalyst_runs = 0;  ///< catalyst prompts run (pot distillations)
  /// Model compute on the stream tokens: embedding, layers, head, surprisal (head_seconds +
  /// attention_seconds + mlp_seconds + glue). The policy's observe_* hooks, which run between the
  /// layers, are not in it (they are policy_seconds, in eviction_seconds).
  double forward_seconds = 0;
  /// Everything the policy causes: begin_chunk + end_forward (append, trigger, selection,
  /// compaction), catalyst runs with their forward, and the policy's observe_* hooks (scoring from
  /// attention rows and surprisal during the forward): policy_seconds + reposition_seconds +
  /// catalyst_seconds + slot bookkeeping.
  double eviction_seconds = 0;

  // --- forward_seconds, itemised ---------------------------------------------------------------
  /// Embedding lookup of the chunk, final RMSNorm + classifier (logits), and the surprisal
  /// (-log softmax) when the policy wants it.
  double head_seconds = 0;
  /// Attention blocks of every layer: attention RMSNorm, Q/K/V projections, writing the chunk's
  /// K/V into the cache (with post-RoPE keys: their rotation), RoPE of the queries, keys rotated
  /// for attention (pre-RoPE storage), q.K scores, causal softmax, softmax.V, copying the
  /// probabilities out for a policy that reads them, output projection and residual.
  double attention_seconds = 0;
  /// MLP blocks of every layer: FFN RMSNorm, gate and up projections, SwiGLU, down projection and
  /// residual.
  double mlp_seconds = 0;

  // --- eviction_seconds, itemised --------------------------------------------------------------
  /// The policy's decisions (kvevict::EvictionTiming::policy): observe_attention /
  /// observe_surprisal / observe_catalyst (scoring) and, for every trigger fired, select (scores,
  /// top-k, keep-lists) plus the plan's new positions and rotation deltas. 0 for `full`.
  double policy_seconds = 0;
  /// Applying the plans (kvevict::EvictionTiming::reposition): slot metadata and score columns
  /// compacted, kept key / value rows gathered in place, post-RoPE keys re-rotated by their
  /// position deltas. 0 for `full`.
  double reposition_seconds = 0;
  /// The catalyst prompt runs (InfiniPot, once per pot fill): appending the prompt's slots, its
  /// forward (embedding, attention and MLP over the pot and the prompt) and its rollback,
  /// excluding observe_catalyst and the distillation's selection (policy_seconds) and compaction
  /// (reposition_seconds). 0 for policies without a catalyst.
  double catalyst_seconds = 0;

  std::size_t peak_kv_bytes = 0;  ///< largest live key + value bytes, taken right after appends
};

class Decoder {
 public:
  /// `model` must outlive the decoder. Throws kvevict::Error for an invalid model or options.
  Decoder(const Model& model, std::unique_ptr<Policy> policy, DecoderOptions options = {});

  /// One forward over `tokens` (1 to max_chunk ids), appended to the sequence.
  ForwardResult forward(std::span<const std::int32_t> tokens, ForwardRequest request = {});

  /// Feeds any number of tokens as consecutive forwards of at most `chunk_size` tokens (0 =
  /// max_chunk), also splitting where the policy's pot fills (Policy::pot_room), so the cache never
  /// holds more than the policy's bound plus one chunk. `request.turn_start` applies to the first
  /// chunk; with `request.all_logits` the result holds the logits of every token fed.
  ForwardResult feed(std::span<const std::int32_t> tokens, ForwardRequest request = {},
                     int chunk_size = 0);

  /// The catalyst prompt run when the policy's pot is full (InfiniPot). May be empty (no catalyst
  /// attention: the "w/o CaP" ablation). Required before the pot first fills.
  void set_catalyst(std::vector<std::int32_t> tokens);

  [[nodiscard]] EvictingCache<float>& cache() { return cache_; }
  [[nodiscard]] const EvictingCache<float>& cache() const { return cache_; }
  [[nodiscard]] const Model& model() const { return model_; }
  [[nodiscard]] const DecoderOptions& options() const { return options_; }
  [[nodiscard]] const DecoderStats& stats() const { return stats_; }

 private:
  enum class Pass { stream, catalyst };
  using Clock = std::chrono::steady_clock;
  // The totals behind DecoderStats' seconds, in integer clock ticks (converted once per forward,
  // so that the parts never drift from their sums).
  struct StageTimes {
    Clock::duration forward{};
    Clock::duration eviction{};
    Clock::duration head{};
    Clock::duration attention{};
    Clock::duration mlp{};
    Clock::duration policy{};
    Clock::duration reposition{};
    Clock::duration catalyst{};
  };

  // `times`: where the stream pass adds its head (embedding) / attention / MLP time; nullptr for
  // the catalyst pass (timed as a whole), which then reads no clock.
  void transformer(std::span<const std::int32_t> tokens, Pass pass, StageTimes* times);
  void output_head(int n, bool all_rows);
  void reserve_scratch(int rows);
  void check_tokens(std::span<const std::int32_t> tokens, const char* what) const;
  void note_kv_bytes();

  const Model& model_;
  DecoderOptions options_;
  EvictingCache<float> cache_;
  std::optional<std::vector<std::int32_t>> catalyst_;
  DecoderStats stats_;
  StageTimes times_;
  int scratch_rows_ = 0;
  int logit_rows_ = 0;  // rows of logits_ written by the last forward (0 before the first)

  // Scratch, [rows = max(max_chunk, catalyst length)] x width, row-major.
  std::vector<float> x_;               // [n, dim] residual stream
  std::vector<float> xb_;              // [n, dim] normed input of a block / block output
  std::vector<float> q_;               // [n, heads * head_dim]
  std::vector<float> k_;               // [n, kv_heads * head_dim]
  std::vector<float> v_;               // [n, kv_heads * head_dim]
  std::vector<float> att_;             // [n, heads * head_dim] attention output
  std::vector<float> hb_;              // [n, hidden_dim] gate
  std::vector<float> hb2_;             // [n, hidden_dim] up
  std::vector<float> logits_;          // [max_chunk, vocab]
  std::vector<float> surprisal_;       // [max_chunk]
  std::vector<float> scores_;          // [n, live] one query head's attention; grows with the cache
  std::vector<float> rows_;            // [heads][queries][stride] probabilities for the policy
  std::vector<int> keys_per_kv_head_;  // [kv_heads]
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>
      key_scratch_;  // rotated keys of one KV head (pre-RoPE storage)
  // feed(): every chunk's logits / surprisal when asked for.
  std::vector<float> feed_logits_;
  std::vector<float> feed_surprisal_;
};

}  // namespace kvevict::model
