// A GGUF loaded by llama.cpp for `kvevict-llama`, with the tokenizer that goes with it.
//
// Tokens: kvevict's own tokenizer where it reads the vocabulary, so that `kvevict` and
// `kvevict-llama` feed the same ids and count the same bytes:
//   - the GGUFs kvevict writes for its byte-level models (tokenizer.ggml.model = "kvevict-bytes",
//     ids 0..255 the bytes, then BOS, EOS, <AC>), which llama.cpp does not know: loaded with the
//     tokenizer model overridden to "none" (llama.cpp then runs on ids alone);
//   - SentencePiece vocabularies ("llama": Llama 2, TinyLlama), rebuilt from llama.cpp's vocab.
// Other vocabularies (BPE: Llama 3, Qwen, SmolLM2) are tokenized by llama.cpp (stream cuts their
// text only before a space: harness/text_stream.hpp, PieceEncoder).
#pragma once

#include <llama.h>

#include <cstdint>
#include <kvevict/model/model.hpp>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvevict::llama_cli {

struct LlamaModelDeleter {
  void operator()(llama_model* model) const { llama_model_free(model); }
};

/// What of a GGUF LlamaModel loads: everything, or the vocabulary only (llama.cpp's vocab_only:
/// tokenizing with no weights, e.g. llama.cpp's models/ggml-vocab-*.gguf).
enum class LlamaLoad { model, vocabulary_only };

class LlamaModel {
 public:
  /// Loads `path` with `gpu_layers` layers offloaded (-ngl). Throws kvevict::Error.
  LlamaModel(const std::string& path, int gpu_layers, LlamaLoad load = LlamaLoad::model);

  [[nodiscard]] llama_model* get() const { return model_.get(); }
  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text, bool add_bos) const;
  /// The bytes of token `id`'s text (empty for control tokens).
  [[nodiscard]] std::string decode(std::int32_t id) const;
  [[nodiscard]] int vocab_size() const { return vocab_size_; }
  [[nodiscard]] std::int32_t eos_id() const;
  /// The token a stream starts with: kvevict's tokenizer's BOS, or llama.cpp's when its
  /// vocabulary adds one (Llama 3 does, Qwen does not); -1 for none.
  [[nodiscard]] std::int32_t bos_id() const;
  /// kvevict's tokenizer for this vocabulary; null when llama.cpp tokenizes.
  [[nodiscard]] const model::Tokenizer* kvevict_tokenizer() const {
    return tokenizer_ ? &*tokenizer_ : nullptr;
  }
  /// The bytes of every token (stream scoring).
  [[nodiscard]] std::vector<std::uint32_t> token_bytes() const;

 private:
  std::unique_ptr<llama_model, LlamaModelDeleter> model_;
  const llama_vocab* vocab_ = nullptr;
  int vocab_size_ = 0;
  std::optional<model::Tokenizer> tokenizer_;
};

/// Silences llama.cpp's log below warnings (its load messages would bury the report), once.
void quiet_llama_log();

}  // namespace kvevict::llama_cli
