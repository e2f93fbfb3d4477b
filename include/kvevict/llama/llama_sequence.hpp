// LlamaSequence: a kvevict policy over one llama.cpp sequence (kvevict::llama, src/llama/): a
// LlamaSequenceSet of one (llama_sequence_set.hpp has many sequences in one context).
//
// It creates the llama_context itself (so that it can install its graph callback and check the
// parameters before anything runs) and drives it one forward at a time: kvevict gives the chunk
// its positions, llama_decode computes it, the policy gets its signals (token ids; surprisal from
// the logits; the softmax rows of every layer when it reads attention: with flash attention off
// read from the graph's kq_soft_max-<layer> tensors, with it on computed by kvevict from each
// layer's flash-attention node's q, K cells and mask, for the queries the policy reads only) and
// each decision is applied to llama.cpp's cells with llama_memory_seq_rm, plus
// llama_memory_seq_add under the shifting position modes.
//
// What maps to what:
//   - llama.cpp's KV cells are shared by every layer and head, so a decision is one keep-set for
//     the sequence: Granularity::token (the default here), or block:B, which evicts whole blocks
//     of B tokens and so shifts positions (one K-shift) at most once per B tokens.
//   - A kvevict slot is a llama.cpp cell. kvevict picks slots and llama.cpp picks cells, both
//     the lowest free one (SlotReuse::lowest_first; llama.cpp's find_slot scans from the lowest
//     cell a removal freed), so slot i is cell i and the softmax rows are handed to the policy as
//     llama.cpp computed them, without a copy. Should the two ever part, the rows are re-indexed
//     from cells to slots with the cell each token was written to (the K store's set_rows
//     indices, read from the same graph callback), counted in stats().reindexed_layers.
//   - Flash attention (on, or auto where llama.cpp picks it) never forms the softmax: when a
//     layer's GGML_OP_FLASH_ATTN_EXT node is computed, kvevict computes softmax(scale * q.k +
//     mask) over the sequence's cells, slot-indexed, from the node's sources (post-RoPE q, the
//     layer's K cells, the KQ mask) for the rows the policy reads: the last query (TOVA), every
//     query of the chunk (H2O), the catalyst's (InfiniPot). One q.K pass, no V; counted in
//     stats().flash_layers. ALiBi, logit soft-capping and attention sinks are refused there.
//   - Positions: llama.cpp's cell positions are kvevict's positions at all times. `original`
//     removes cells only; `cache_index` and `reset_on_compact` also lower every newer cell by the
//     evictions before it (llama_memory_seq_add), which llama.cpp applies to the stored keys as
//     one RoPE pass (its K-shift) at the next llama_decode. kvevict sees keys as pre-RoPE
//     (KeyStorage::pre_rope): it never asks for a rotation of its own.
//   - InfiniPot's catalyst is decoded in the same sequence after the pot, its attention read, and
//     its cells removed with the distillation (one seq_rm of its positions, the newest).
//
// Errors before anything runs (kvevict::Error): a granularity other than token or block; quantized
// V cells with flash attention off (llama.cpp needs it on for them); a shifting position mode on a
// model whose memory cannot shift
// (llama_memory_can_shift false, e.g. M-RoPE); a bounded policy whose budget plus one chunk does
// not fit in n_ctx; a catalyst-running policy without a catalyst. During the run: a policy that
// evicts the sequence's newest token under `original` positions (llama.cpp requires a sequence's
// positions to continue from its last one); a forward of a policy that reads attention in which a
// layer's attention was not found in the graph (neither kq_soft_max-<layer> nor a flash-attention
// node over cache_k_l<layer>, e.g. another architecture's attention) or is of a kind kvevict does
// not compute under flash attention (ALiBi, soft-capping, sinks); and llama_decode failures, each
// with a message.
#pragma once

#include <llama.h>

#include <cstdint>
#include <kvevict/llama/llama_sequence_set.hpp>
#include <kvevict/policy.hpp>
#include <memory>
#include <span>
#include <vector>

namespace kvevict::llama {

class LlamaSequence final {
 public:
  /// Creates the context over `model` (which must outlive this) from `params`; see the header
  /// comment for what is checked. `params.cb_eval` must be unset (this installs its own).
  LlamaSequence(llama_model* model, llama_context_params params, std::unique_ptr<Policy> policy,
                LlamaSequenceOptions options = {});

  /// One forward over `tokens` (1 to max_chunk), appended to the sequence; then the policy's
  /// decision, and the catalyst when the pot is full. Logits of every token (`all_logits`) or of
  /// the last one. A failure of the sequence is thrown (kvevict::Error).
  LlamaLogits forward(std::span<const std::int32_t> tokens, bool turn_start = false,
                      bool all_logits = false);

  /// Any number of tokens as consecutive forwards of at most max_chunk, also split where the
  /// policy's pot fills (as kvevict's Decoder::feed, so both decide at the same points).
  /// `turn_start` applies to the first forward; with `all_logits` the result holds every token's
  /// logits (valid until the next feed or forward), else the last token's.
  LlamaLogits feed(std::span<const std::int32_t> tokens, bool turn_start = false,
                   bool all_logits = false);

  [[nodiscard]] llama_context* context() { return set_.context(); }
  [[nodiscard]] const Sequence& sequence() const { return set_.sequence(0); }
  [[nodiscard]] const LlamaSequenceStats& stats() const { return set_.stats(0); }
  [[nodiscard]] int vocab() const { return set_.vocab(); }
  [[nodiscard]] int max_chunk() const { return max_chunk_; }
  /// Cells the sequence holds now.
  [[nodiscard]] int live_cells() const { return set_.live_cells(0); }
  /// K and V bytes of one cell over all layers (the cache's types).
  [[nodiscard]] std::size_t bytes_per_cell() const { return set_.bytes_per_cell(); }
  /// Whether the graph callback reads attention (the policy needs it).
  [[nodiscard]] bool reads_attention() const { return set_.reads_attention(0); }
  /// Whether the graph callback reads the keys llama.cpp stores (K-norm, KeyDiff).
  [[nodiscard]] bool reads_keys() const { return set_.reads_keys(0); }

 private:
  LlamaSequenceSet set_;
  int max_chunk_;
  std::vector<float> feed_logits_;  // [tokens, vocab] of the last feed (all_logits)
};

}  // namespace kvevict::llama
