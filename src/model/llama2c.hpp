// llama2.c checkpoints (Karpathy's run.c "legacy" format, version 0) and tokenizer.bin.
//
// Checkpoint: seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
// a negative vocab_size means the classifier is not tied to the embedding), then f32 weights in
// run.c's order: token_embedding [vocab, dim], rms_att [L, dim], wq [L, dim, dim],
// wk [L, kv_dim, dim], wv [L, kv_dim, dim], wo [L, dim, dim], rms_ffn [L, dim],
// w1 [L, hidden, dim], w2 [L, dim, hidden], w3 [L, hidden, dim], rms_final [dim],
// freq_cis_real and freq_cis_imag [seq_len * head_dim / 2] each (unused: RoPE is computed), and
// wcls [vocab, dim] when untied. Matrices are [out, in] row-major; Q/K rows expect interleaved
// RoPE with theta 10000; RMSNorm epsilon 1e-5.
//
// tokenizer.bin: int32 max_token_length, then per token f32 score, int32 byte length, bytes.
// llama2.c's exporter writes "▁" as a space and BOS / EOS as "\n<s>\n" / "\n</s>\n".
#pragma once

#include <cstdint>
#include <span>

namespace kvevict::model::llama2c {

inline constexpr int kHeaderInts = 7;
inline constexpr std::int64_t kHeaderBytes = kHeaderInts * 4;
inline constexpr double kRopeTheta = 10000.0;
inline constexpr float kNormEps = 1e-5f;
inline constexpr std::int32_t kBosId = 1;
inline constexpr std::int32_t kEosId = 2;
/// The first int32 of llama2.c's newer export versions ("ak42"), which run.c does not read.
inline constexpr std::uint32_t kExportMagic = 0x616b3432;

struct Header {
  std::int32_t dim = 0;
  std::int32_t hidden_dim = 0;
  std::int32_t layers = 0;
  std::int32_t heads = 0;
  std::int32_t kv_heads = 0;
  std::int32_t vocab_size = 0;  ///< negative: untied classifier
  std::int32_t seq_len = 0;
};

/// Number of f32 values after the header a checkpoint with this (validated) header holds.
[[nodiscard]] std::uint64_t expected_floats(const Header& header);

}  // namespace kvevict::model::llama2c
