// DecoderBatch: the reference decoder over many sequences at once, each its own cache and policy,
// decoded together: one transformer pass per step carries every fed sequence's tokens (continuous
// batching: a sequence is opened or closed between steps), optionally under one KV pool.
//
// A step stacks the chunks of the sequences fed into one [rows, dim] activation block: the
// products with the weights read each weight once for all of them, while the attention of each
// sequence runs over its own cache, and its policy sees only its own rows. It is the reference
// that LlamaSequenceSet (kvevict/llama/llama_sequence_set.hpp) is compared with, batch for batch.
//
// Batched = alone, bit for bit: every product of a batch runs the panel kernel (weight_product,
// src/model/kernels/weight_product.hpp), one row included, and that kernel sums each output in a
// fixed order whatever the number of rows. So a sequence's logits and keep-sets in a batch equal
// those of the same sequence alone in a DecoderBatch, bit for bit, whatever else is fed with it
// (tests/test_decoder_batch.cpp). A Decoder (decoder.hpp) is a batch of one that multiplies one
// row with the fused dequantise-and-dot (matvec) instead: faster for one sequence's decode, and
// its logits differ from a batch's by f32 rounding.
//
// The pool (pool_cells > 0) is a kvevict::KvPool (kv_pool.hpp): a sequence's cells are its
// fullest unit's tokens (Sequence::max_live); before each step, the members over their fair share
// are cut by their own policies, none below its minimum.
//
// Errors: bad input to step() (a sequence not open, fed twice, a chunk of 0 or more than its
// max_chunk tokens, a token outside the vocabulary) throws kvevict::Error before anything
// changes. A failure of one sequence during a step (its policy's decision, its missing catalyst
// prompt, its pool cut) fails that sequence only: failed(id) says why, it must be closed, and the
// other sequences of the step are decoded as if it had not been fed.
#pragma once

#include <cstdint>
#include <kvevict/evicting_cache.hpp>
#include <kvevict/kv_pool.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/timing.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvevict/model/decoder.hpp"
#include "kvevict/model/model.hpp"

namespace kvevict::model {

struct DecoderBatchOptions {
  /// Threads of a step, the caller's included (as DecoderOptions::threads).
  int threads = 1;
  /// One KV pool of this many cells for every sequence (KvPool); 0: no pool.
  std::int64_t pool_cells = 0;
  /// RoPE cos/sin table of every sequence (DecoderOptions::rope_table_positions).
  int rope_table_positions = 0;
  /// Stage timing of the steps (head, attention, mlp) and of every sequence's policy; must
  /// outlive the batch. Null: nothing is timed.
  StageObserver* observer = nullptr;
};

/// One sequence's part of a step.
struct DecoderFeed {
  int sequence = 0;
  std::span<const std::int32_t> tokens;  ///< 1 to the sequence's max_chunk
  ForwardRequest request;
};

class DecoderBatch {
 public:
  /// `model` must outlive the batch. Throws kvevict::Error for an invalid model or options.
  explicit DecoderBatch(const Model& model, DecoderBatchOptions options = {});
  ~DecoderBatch();
  DecoderBatch(const DecoderBatch&) = delete;
  DecoderBatch& operator=(const DecoderBatch&) = delete;

  /// Opens a sequence under `policy` and returns its id, the lowest free one. `options` are its
  /// cache's (key storage, KV type, positions, granularity, budgets, max_chunk, pending
  /// rotations); threads, observer and the RoPE table are the batch's (leave them at their
  /// defaults) and a batch multiplies in f32 (decode_activations f32). In a pool, the sequence
  /// joins it (KvPool::join's errors: the pool cannot hold it).
  int open(std::unique_ptr<Policy> policy, DecoderOptions options = {});
  /// Closes a sequence (it leaves the pool); its id may be reused.
  void close(int id);
  [[nodiscard]] bool is_open(int id) const;
  /// The sequence's catalyst prompt (Decoder::set_catalyst).
  void set_catalyst(int id, std::vector<std::int32_t> tokens);

  /// One transformer pass over every feed's tokens (each sequence at most once), then each fed
  /// sequence's policy decides; a sequence whose pot fills then runs its catalyst prompt alone.
  void step(std::span<const DecoderFeed> feeds);

  /// What the sequence's last step returned (ForwardResult; valid until its next step).
  [[nodiscard]] ForwardResult result(int id) const;
  /// Why the sequence failed in a step (close it), or nullopt.
  [[nodiscard]] const std::optional<std::string>& failed(int id) const;
  [[nodiscard]] EvictingCache& cache(int id);
  [[nodiscard]] const EvictingCache& cache(int id) const;
  [[nodiscard]] const DecoderStats& stats(int id) const;
  /// The pool, when pool_cells > 0.
  [[nodiscard]] const KvPool* pool() const { return pool_ ? pool_.get() : nullptr; }
  [[nodiscard]] const Model& model() const { return model_; }
  [[nodiscard]] const DecoderBatchOptions& options() const { return options_; }

 private:
  friend class Decoder;
  struct Member;
  struct Scratch;
  enum class Pass { stream, catalyst };
  /// Decoder's batch of one: one-row products by matvec (with `activations`), and a failure is
  /// thrown at once rather than recorded (a Decoder has no other sequence to protect).
  DecoderBatch(const Model& model, DecoderBatchOptions options, DecodeActivations activations,
               bool single);
  int open_member(std::unique_ptr<Policy> policy, const DecoderOptions& options);

  void transformer(std::span<Member* const> members, int rows, Pass pass);
  void attention(int layer, Member& member, Pass pass);
  void output_head(std::span<Member* const> members);
  void finish(Member& member);
  void run_catalyst(Member& member);
  void reserve_rows(int rows);
  template <class Work>
  void guarded(Member& member, Work&& work);
  Member& member(int id, const char* call);
  [[nodiscard]] const Member& member(int id, const char* call) const;

  const Model& model_;
  DecoderBatchOptions options_;
  const bool single_;  // a Decoder's batch of one (see the private constructor)
  const DecodeActivations activations_;
  std::vector<std::unique_ptr<Member>> members_;  // [id], null for a free id
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<Scratch> scratch_;
  // This step's members and pool feeds (reused).
  std::vector<Member*> fed_;
  std::vector<KvPool::Feed> pool_feeds_;
};

}  // namespace kvevict::model
