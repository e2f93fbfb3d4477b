// Reference Llama decoder over a kvevict::EvictingCache: one sequence, f32 math, Eigen, and
// DecoderOptions::threads threads. Many sequences decoded together: DecoderBatch
// (decoder_batch.hpp), whose batch of one this is.
//
// Written like llama2.c: the forward (src/model/decoder_batch.cpp) is one plain loop (embedding,
// then per layer RMSNorm, grouped-query attention with RoPE over the evicting cache, SwiGLU MLP,
// then the output head and the surprisal), every buffer is reused, and the only thing it talks to
// besides the weights is its cache: begin_chunk, write_chunk per (layer, KV head), the signals the
// policy declared (attention rows of all queries or of the last one, surprisal), end_forward, and
// the catalyst prompt when an InfiniPot-style policy has filled its pot.
//
// Positions: the chunk's queries of query head h sit at the positions of their own tokens in the
// cache of KV head h / group (cache.position). Post-RoPE keys are stored rotated to their key
// positions and each query is rotated once per run of slots sharing a pending rotation
// (src/model/attention.hpp); pre-RoPE keys are rotated to their positions at every attention.
//
// Surprisal (Signal::surprisal): token k of a chunk gets -log softmax(logits of the position before
// it)[token k]. The first token of a chunk uses the last logits of the previous forward, i.e. the
// model's prediction from the context as it stood then (before that forward's eviction); the very
// first token of the stream has no prediction and gets 0.
//
// Timing: DecoderOptions::observer (e.g. a kvevict::StageClock) is told the stages of every step:
// head, attention and mlp here, policy and reposition by the cache's Sequence, catalyst for a
// catalyst prompt's forward. No clock is read without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <kvevict/allocation.hpp>
#include <kvevict/error.hpp>
#include <kvevict/evicting_cache.hpp>
#include <kvevict/granularity.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/positions.hpp>
#include <kvevict/timing.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvevict/model/model.hpp"

namespace kvevict::model {

/// What a one-row product (a decode step's, and the output head of a chunk's last token)
/// multiplies Q8_0 and Q4_0 weights with. Other weight types, and the products of several rows
/// (prefill), always use the f32 activations.
enum class DecodeActivations {
  f32,   ///< the f32 activations: logits within f32 rounding of the naive loops (the default)
  q8_0,  ///< the activations rounded to 8 bits per value in blocks of 32, as llama.cpp does for
         ///< these weights, and multiplied in integers: faster (on AVX2 / AVX-512), and every
         ///< logit moves by the rounding (docs/kernels.md)
};

[[nodiscard]] inline std::string_view to_string(DecodeActivations activations) {
  return activations == DecodeActivations::f32 ? "f32" : "q8_0";
}

/// Parses "f32" or "q8_0"; throws kvevict::Error otherwise.
[[nodiscard]] inline DecodeActivations parse_decode_activations(std::string_view text) {
  if (text == "f32") return DecodeActivations::f32;
  if (text == "q8_0") return DecodeActivations::q8_0;
  throw Error("unknown decode activations '" + std::string(text) + "' (expected f32 or q8_0)");
}

struct DecoderOptions {
  /// How the cache stores keys. Both give the same logits (up to rounding); post_rope is faster
  /// for long caches (no rotation of every cached key at every attention).
  KeyStorage key_storage = KeyStorage::post_rope;
  /// How the cache stores keys and values: f32, f16, bf16 or q8_0 (kvevict/kv_type.hpp); the
  /// attention kernels read them in that form.
  KvType kv_type = KvType::f32;
  /// Overrides the policy's default position mode.
  std::optional<PositionMode> position_mode;
  /// Overrides the policy's default granularity.
  std::optional<Granularity> granularity;
  /// One budget for the whole sequence and its split over the units (SequenceConfig's fields of
  /// the same names, policies/allocated.hpp): key and value bytes in kv_type, or tokens summed over
  /// every (layer, KV head); 0 and uniform: the policy alone.
  std::int64_t budget_bytes = 0;
  std::int64_t budget_tokens = 0;
  Allocation allocation = Allocation::uniform;
  int pyramid_beta = 20;
  double adaptive_floor = 0.2;
  /// Largest chunk forward() accepts (feed() splits longer inputs). With the policy's
  /// retained_limit() it sizes the cache, so that a bounded policy never reallocates.
  int max_chunk = 64;
  /// RoPE positions with a precomputed cos/sin table (speed only; results are identical).
  /// 0 = max(context_length, 4096), at most 16384.
  int rope_table_positions = 0;
  /// See kvevict::SequenceConfig::max_pending_rotations.
  int max_pending_rotations = 32;
  /// Threads of a forward, the caller's included: products split by rows of W, attention by KV
  /// heads. The logits are bit-identical for any number (docs/kernels.md).
  int threads = 1;
  /// What decoding multiplies Q8_0 / Q4_0 weights with (DecodeActivations).
  DecodeActivations decode_activations = DecodeActivations::f32;
  /// Stage timing; must outlive the decoder. Null: nothing is timed.
  StageObserver* observer = nullptr;
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

/// Counters of a decoder (times come from DecoderOptions::observer).
struct DecoderStats {
  std::int64_t tokens_fed = 0;     ///< stream tokens (catalyst tokens excluded)
  std::int64_t forwards = 0;       ///< forward() calls
  std::int64_t catalyst_runs = 0;  ///< catalyst prompts run (pot distillations)
  std::size_t peak_kv_bytes = 0;   ///< largest live key + value bytes, taken right after appends
};

class DecoderBatch;  // decoder_batch.hpp

class Decoder {
 public:
  /// `model` must outlive the decoder. Throws kvevict::Error for an invalid model or options.
  Decoder(const Model& model, std::unique_ptr<Policy> policy, DecoderOptions options = {});
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  /// One forward over `tokens` (1 to max_chunk ids), appended to the sequence.
  ForwardResult forward(std::span<const std::int32_t> tokens, ForwardRequest request = {});

  /// Feeds any number of tokens as consecutive forwards of at most `chunk_size` tokens (0 =
  /// max_chunk), also splitting where the policy's pot fills (Sequence::pot_room), so the cache
  /// never holds more than the policy's bound plus one chunk. `request.turn_start` applies to the
  /// first chunk; with `request.all_logits` the result holds the logits of every token fed.
  ForwardResult feed(std::span<const std::int32_t> tokens, ForwardRequest request = {},
                     int chunk_size = 0);

  /// The catalyst prompt run when the policy's pot is full (InfiniPot). May be empty (no catalyst
  /// attention: the "w/o CaP" ablation). Required before the pot first fills.
  void set_catalyst(std::vector<std::int32_t> tokens);

  [[nodiscard]] EvictingCache& cache();
  [[nodiscard]] const EvictingCache& cache() const;
  [[nodiscard]] const Model& model() const { return model_; }
  [[nodiscard]] const DecoderOptions& options() const { return options_; }
  [[nodiscard]] const DecoderStats& stats() const;

 private:
  void check_tokens(std::span<const std::int32_t> tokens, const char* what) const;

  const Model& model_;
  DecoderOptions options_;
  // The forward itself: a DecoderBatch of one sequence (id 0) that multiplies one row by matvec
  // and throws a failure at once (decoder_batch.hpp).
  std::unique_ptr<DecoderBatch> batch_;
  // feed(): every chunk's logits / surprisal when asked for.
  std::vector<float> feed_logits_;
  std::vector<float> feed_surprisal_;
};

}  // namespace kvevict::model
