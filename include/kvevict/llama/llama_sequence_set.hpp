// LlamaSequenceSet: many sequences of one llama_context decoded together, each under its own
// kvevict policy, optionally sharing one KV pool (kvevict::llama, src/llama/).
//
// The context holds up to max_sequences sequences (llama.cpp's n_seq_max) in one unified KV cache
// (kv_unified: every sequence's cells come from the same n_ctx). A step is one llama_decode whose
// batch carries the tokens of every sequence fed in it (continuous batching: a sequence is opened
// or closed between steps), then each sequence's policy gets its signals and decides, and the
// decisions go to llama.cpp's cells with llama_memory_seq_rm / seq_add on that sequence's id.
//
// Cells are shared by the sequences, so a sequence's slot i is not cell i: each sequence maps its
// slots to the cells llama.cpp wrote its tokens to (layer 0's K store indices, read in the graph
// callback), and the attention rows of its own queries are handed to its policy slot-indexed,
// gathered from the softmax row over all cells (or computed over its own cells with flash
// attention on: llama_sequence.hpp says how). Everything LlamaSequence says of one sequence holds
// for each member; a LlamaSequence is a set of one.
//
// The pool (pool_cells > 0) is a kvevict::KvPool (kv_pool.hpp): before each step, members over
// their fair share are cut by their own policy's ranking so that the cells held plus the step's
// tokens fit in pool_cells. Without it, each sequence is bounded by its own policy only, and a
// step that finds no free cell fails (llama_decode's "no room").
//
// Errors: bad input to step() (a sequence not open, fed twice, a chunk of 0 or more than
// max_chunk tokens, a token outside the vocabulary, a sequence that failed) is refused before
// anything changes. A failure of one sequence during a step (its policy's decision, its attention
// missing from the graph, a pool's cut of it that llama.cpp cannot represent) fails that sequence
// only: failed(id) names it, and it must be closed; the other sequences of the step are
// unaffected. A llama_decode failure fails the step.
#pragma once

#include <llama.h>

#include <cstddef>
#include <cstdint>
#include <kvevict/engine.hpp>
#include <kvevict/granularity.hpp>
#include <kvevict/kv_pool.hpp>
#include <kvevict/policy.hpp>
#include <kvevict/positions.hpp>
#include <kvevict/timing.hpp>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvevict::llama {

/// K and V bytes of one cell of `model` over all its layers, in cell types `type_k` and `type_v`:
/// what a KV pool of N cells holds is N times this (e.g. to size a pool from bytes).
[[nodiscard]] std::size_t cell_bytes(const llama_model* model, ggml_type type_k, ggml_type type_v);

struct LlamaSequenceOptions {
  /// Overrides the policy's position mode.
  std::optional<PositionMode> position_mode;
  /// token (the default) or block:B: llama.cpp's cells are shared by every layer and head.
  std::optional<Granularity> granularity;
  /// Largest chunk a forward accepts; the context's n_batch and n_ubatch are raised to it (and to
  /// the catalyst's length) so that every forward is one ubatch. In a set: at most the set's.
  int max_chunk = 64;
  /// InfiniPot's catalyst prompt (required when the policy runs one; may be empty: no catalyst
  /// attention, the "w/o CaP" ablation).
  std::optional<std::vector<std::int32_t>> catalyst;
  /// Which free slot a new token takes: lowest_first is llama.cpp's order of cells, so that no
  /// attention row needs re-indexing for a sequence alone in its context; newest_freed_first
  /// (kvevict's decoder's) exercises the re-indexing path.
  SlotReuse slot_reuse = SlotReuse::lowest_first;
  /// Stage timing (policy, reposition, catalyst; llama_decode is not split into stages). Must
  /// outlive the sequence.
  StageObserver* observer = nullptr;
  /// In a pool: the fewest cells a cut leaves it (0: its policy's own minimum; KvPool::join).
  int pool_minimum = 0;
};

/// Logits of a forward: [rows, vocab] row-major, valid until the next forward.
struct LlamaLogits {
  std::span<const float> values;
  int rows = 0;
  int vocab = 0;
  [[nodiscard]] std::span<const float> row(int i) const {
    return values.subspan(static_cast<std::size_t>(i) * static_cast<std::size_t>(vocab),
                          static_cast<std::size_t>(vocab));
  }
  [[nodiscard]] std::span<const float> last() const { return row(rows - 1); }
};

struct LlamaSequenceStats {
  std::int64_t forwards = 0;        ///< steps that fed the sequence (catalysts excluded)
  std::int64_t catalyst_runs = 0;   ///< catalyst prompts decoded
  std::int64_t removed_ranges = 0;  ///< llama_memory_seq_rm calls
  std::int64_t shifted_ranges = 0;  ///< llama_memory_seq_add calls
  /// Layers whose softmax rows were gathered from cell order to slot order: 0 while every slot is
  /// the cell of the same index (a sequence alone in its context; see the header comment).
  std::int64_t reindexed_layers = 0;
  /// Layers whose rows kvevict computed from the flash-attention node (flash attention on).
  std::int64_t flash_layers = 0;
  int peak_cells = 0;  ///< most cells the sequence held (right after a decode)
};

struct LlamaSequenceSetOptions {
  /// Sequences open at once (llama.cpp's n_seq_max, at most LLAMA_MAX_SEQ).
  int max_sequences = 1;
  /// Most tokens one sequence is fed in a step (and the longest catalyst): n_batch and n_ubatch
  /// are raised to max_sequences x max_chunk so that every step is one ubatch.
  int max_chunk = 64;
  /// One KV pool of this many cells for all sequences (KvPool), at most n_ctx; 0: no pool.
  std::int64_t pool_cells = 0;
};

/// One sequence's part of a step.
struct LlamaFeed {
  int sequence = 0;
  std::span<const std::int32_t> tokens;  ///< 1 to the sequence's max_chunk
  bool turn_start = false;
  bool all_logits = false;  ///< every token's logits, else the last one's
};

struct LlamaSetStats {
  std::int64_t steps = 0;  ///< llama_decode calls of steps (catalysts excluded)
  int peak_cells = 0;      ///< most cells all sequences held together (right after a decode)
};

class LlamaSequenceSet final {
 public:
  /// Creates the context over `model` (which must outlive this) from `params` (n_seq_max,
  /// kv_unified, n_batch and n_ubatch are set from `options`). `params.cb_eval` must be unset.
  LlamaSequenceSet(llama_model* model, llama_context_params params,
                   LlamaSequenceSetOptions options = {});
  ~LlamaSequenceSet();
  LlamaSequenceSet(const LlamaSequenceSet&) = delete;
  LlamaSequenceSet& operator=(const LlamaSequenceSet&) = delete;

  /// Opens a sequence under `policy` (checked as LlamaSequence checks it) and returns its id, the
  /// lowest free one in [0, max_sequences): its llama.cpp seq_id.
  int open(std::unique_ptr<Policy> policy, LlamaSequenceOptions options = {});
  /// Closes a sequence: its cells are freed (llama_memory_seq_rm) and its id may be reused.
  void close(int id);
  [[nodiscard]] bool is_open(int id) const;

  /// One llama_decode over every feed's tokens (each sequence at most once), then each fed
  /// sequence's policy decides; a sequence whose pot fills then decodes its catalyst alone.
  void step(std::span<const LlamaFeed> feeds);
  /// Logits of the sequence's last step (every token's or the last one's, as it asked).
  [[nodiscard]] LlamaLogits logits(int id) const;
  /// Why the sequence failed in a step (close it), or nullopt.
  [[nodiscard]] const std::optional<std::string>& failed(int id) const;

  [[nodiscard]] const Sequence& sequence(int id) const;
  [[nodiscard]] const LlamaSequenceStats& stats(int id) const;
  [[nodiscard]] int live_cells(int id) const;
  /// Whether the sequence's policy reads attention / the stored keys (the graph callback does).
  [[nodiscard]] bool reads_attention(int id) const;
  [[nodiscard]] bool reads_keys(int id) const;

  [[nodiscard]] llama_context* context() { return context_; }
  [[nodiscard]] const LlamaSequenceSetOptions& options() const { return options_; }
  [[nodiscard]] const LlamaSetStats& stats() const { return stats_; }
  /// The pool, when pool_cells > 0.
  [[nodiscard]] const KvPool* pool() const { return pool_ ? &*pool_ : nullptr; }
  [[nodiscard]] int vocab() const { return vocab_; }
  /// K and V bytes of one cell over all layers (the cache's types).
  [[nodiscard]] std::size_t bytes_per_cell() const { return bytes_per_cell_; }

 private:
  struct Member;  // one sequence's state (src/llama/llama_sequence.cpp)

  void apply(Member& member, const AppliedDecision& decision);
  void decode(std::span<Member* const> members, bool catalyst);
  void finish(Member& member);
  void run_catalyst(Member& member);
  Member& member(int id, const char* call);
  [[nodiscard]] const Member& member(int id, const char* call) const;
  static bool callback(ggml_tensor* tensor, bool ask, void* user_data);

  llama_model* model_;
  llama_context* context_ = nullptr;
  llama_context_params params_{};
  LlamaSequenceSetOptions options_;
  std::vector<std::unique_ptr<Member>> members_;  // [max_sequences], null when closed
  std::vector<Member*> decoding_;                 // members of the llama_decode computing now
  std::optional<KvPool> pool_;
  llama_batch batch_{};
  int batch_capacity_ = 0;
  int vocab_ = 0;
  int n_ctx_ = 0;
  std::size_t bytes_per_cell_ = 0;
  LlamaSetStats stats_;
  std::vector<KvPool::Feed> pool_feeds_;  // scratch
  std::vector<Member*> fed_;              // scratch: the members of a step, in feed order
};

}  // namespace kvevict::llama
