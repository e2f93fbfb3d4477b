// The reference decoder's model: configuration, weights (kept in memory in their file's type: f32,
// f16, bf16, Q8_0, Q4_0), tokenizer.
//
// Conventions: a weight matrix is [rows, cols] row-major, rows = output features (PyTorch Linear
// layout), so y = W x. Q and K projections are stored so that RoPE with `config.rope_layout` is
// correct for them as they are: safetensors (Hugging Face) checkpoints are half_split, GGUF (after
// llama.cpp's converter permuted the Q/K rows) and llama2.c checkpoints are interleaved. Writers of
// one format from a model loaded in another permute Q/K rows accordingly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <kvevict/rope.hpp>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::model {

/// Element type of a weight matrix as held in memory: the file's own. Q8_0 and Q4_0 are GGUF's
/// blocks of 32 values along a row: an f16 scale d, then 32 int8 q (Q8_0: value q d) or 16 bytes
/// of 4-bit q, values 0-15 in the low nibbles and 16-31 in the high ones (Q4_0: value (q - 8) d).
enum class DType : std::uint8_t { f32, f16, bf16, q8_0, q4_0 };

/// Values per block: 32 for Q8_0 and Q4_0, 1 for the others.
[[nodiscard]] std::int64_t block_values(DType dtype);
/// Bytes of one block (of one value for f32, f16, bf16).
[[nodiscard]] std::size_t dtype_size(DType dtype);
/// Bytes of `values` values, a multiple of block_values(dtype) (throws kvevict::Error otherwise).
[[nodiscard]] std::size_t dtype_bytes(DType dtype, std::int64_t values);
[[nodiscard]] std::string_view to_string(DType dtype);

/// A [rows, cols] row-major weight matrix whose bytes live in the owning Model's storage.
struct WeightMatrix {
  DType dtype = DType::f32;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  const std::byte* data = nullptr;

  [[nodiscard]] std::size_t row_bytes() const { return dtype_bytes(dtype, cols); }
  [[nodiscard]] std::size_t bytes() const { return static_cast<std::size_t>(rows) * row_bytes(); }
  /// Row r converted to f32 (`cols` values), e.g. an embedding lookup.
  void row_to_f32(std::int64_t r, float* out) const;
};

struct ModelConfig {
  int dim = 0;         ///< model width
  int hidden_dim = 0;  ///< SwiGLU inner width
  int layers = 0;
  int heads = 0;     ///< query heads
  int kv_heads = 0;  ///< key/value heads (GQA when < heads)
  int vocab_size = 0;
  int context_length = 0;  ///< trained context (informational; streams may exceed it)
  double rope_theta = 10000.0;
  RopeLayout rope_layout = RopeLayout::half_split;
  int rotary_dim = 0;  ///< 0 = head_dim
  float norm_eps = 1e-5f;
  bool tied_embeddings = false;

  [[nodiscard]] int head_dim() const { return dim / heads; }
  /// Throws kvevict::Error naming the first inconsistency (non-positive sizes, dim % heads,
  /// heads % kv_heads, odd head_dim, absurd sizes).
  void validate() const;
};

struct LayerWeights {
  std::vector<float> attention_norm;  ///< [dim]
  WeightMatrix wq;                    ///< [heads * head_dim, dim]
  WeightMatrix wk;                    ///< [kv_heads * head_dim, dim]
  WeightMatrix wv;                    ///< [kv_heads * head_dim, dim]
  WeightMatrix wo;                    ///< [dim, heads * head_dim]
  std::vector<float> ffn_norm;        ///< [dim]
  WeightMatrix w_gate;                ///< [hidden_dim, dim]  (w1)
  WeightMatrix w_up;                  ///< [hidden_dim, dim]  (w3)
  WeightMatrix w_down;                ///< [dim, hidden_dim]  (w2)
};

/// Token ids <-> bytes. Byte-level: ids 0..255 are the bytes, specials follow. SentencePiece-style
/// (Llama GGUF vocabularies): pieces with scores, "▁" for spaces, byte fallback "<0xXX>".
struct Tokenizer {
  enum class Kind : std::uint8_t { byte_level, sentencepiece };
  Kind kind = Kind::byte_level;
  std::vector<std::string> pieces;  ///< sentencepiece: piece text per id
  std::vector<float> scores;        ///< sentencepiece: merge priority per id
  std::vector<std::int32_t> types;  ///< sentencepiece: 1 normal, 2 unknown, 3 control, 6 byte
  std::int32_t bos_id = -1;
  std::int32_t eos_id = -1;
  std::int32_t anchor_id = -1;  ///< "<AC>" (AnLLM-AC) when the vocabulary has one
  int vocab_size = 0;

  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text, bool add_bos) const;
  /// The bytes of token `id` (empty for control tokens).
  [[nodiscard]] std::string decode(std::int32_t id) const;
};

struct Model {
  ModelConfig config;
  WeightMatrix token_embedding;  ///< [vocab, dim]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  ///< [dim]
  WeightMatrix output;            ///< [vocab, dim]; aliases token_embedding when tied
  Tokenizer tokenizer;
  std::string format;  ///< "gguf", "safetensors", "llama2c" or "random"
  /// Owns the bytes every WeightMatrix points into.
  std::vector<std::shared_ptr<const void>> storage;

  /// Bytes of all weight matrices and norms (what one decode step reads).
  [[nodiscard]] std::size_t weight_bytes() const;
};

/// Loads a model, choosing the format from the file's magic: GGUF ("GGUF"), safetensors (a
/// .safetensors file, or a directory holding model.safetensors + config.json), llama2.c otherwise.
/// Malformed files throw kvevict::Error naming the problem; nothing is allocated from an
/// unchecked size.
[[nodiscard]] Model load_model(const std::filesystem::path& path);

}  // namespace kvevict::model
