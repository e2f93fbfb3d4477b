#include "llama/cli/llama_model.hpp"

#include <gguf.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <kvevict/error.hpp>
#include <mutex>

#include "harness/log_loss.hpp"

namespace kvevict::llama_cli {
namespace {

constexpr std::string_view kByteTokenizerModel = "kvevict-bytes";  // src/model/gguf.cpp

// The metadata of a GGUF file that decides how it is tokenized.
struct TokenizerKeys {
  std::string model;  // tokenizer.ggml.model
  std::int32_t bos = -1;
  std::int32_t eos = -1;
  std::int32_t anchor = -1;
};

TokenizerKeys read_tokenizer_keys(const std::string& path) {
  gguf_init_params params{};
  params.no_alloc = true;
  params.ctx = nullptr;
  gguf_context* file = gguf_init_from_file(path.c_str(), params);
  if (file == nullptr) throw Error("'" + path + "' is not a GGUF file llama.cpp can read");
  TokenizerKeys keys;
  const auto string_of = [&](const char* key) -> std::string {
    const std::int64_t id = gguf_find_key(file, key);
    if (id < 0 || gguf_get_kv_type(file, id) != GGUF_TYPE_STRING) return {};
    return gguf_get_val_str(file, id);
  };
  const auto id_of = [&](const char* key) -> std::int32_t {
    const std::int64_t id = gguf_find_key(file, key);
    if (id < 0 || gguf_get_kv_type(file, id) != GGUF_TYPE_UINT32) return -1;
    return static_cast<std::int32_t>(gguf_get_val_u32(file, id));
  };
  keys.model = string_of("tokenizer.ggml.model");
  keys.bos = id_of("tokenizer.ggml.bos_token_id");
  keys.eos = id_of("tokenizer.ggml.eos_token_id");
  keys.anchor = id_of("kvevict.anchor_token_id");
  gguf_free(file);
  return keys;
}

void drop_info_log(ggml_log_level level, const char* text, void* /*user_data*/) {
  if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// kvevict's SentencePiece tokenizer over llama.cpp's vocabulary (pieces, scores, token types).
model::Tokenizer sentencepiece_tokenizer(const llama_vocab* vocab, int size) {
  model::Tokenizer tokenizer;
  tokenizer.kind = model::Tokenizer::Kind::sentencepiece;
  tokenizer.vocab_size = size;
  tokenizer.bos_id = llama_vocab_bos(vocab);
  tokenizer.eos_id = llama_vocab_eos(vocab);
  for (llama_token id = 0; id < size; ++id) {
    tokenizer.pieces.emplace_back(llama_vocab_get_text(vocab, id));
    tokenizer.scores.push_back(llama_vocab_get_score(vocab, id));
    const llama_token_attr attr = llama_vocab_get_attr(vocab, id);
    // GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    std::int32_t type = 1;
    if ((attr & LLAMA_TOKEN_ATTR_UNKNOWN) != 0) type = 2;
    if ((attr & LLAMA_TOKEN_ATTR_CONTROL) != 0) type = 3;
    if ((attr & LLAMA_TOKEN_ATTR_USER_DEFINED) != 0) type = 4;
    if ((attr & LLAMA_TOKEN_ATTR_BYTE) != 0) type = 6;
    tokenizer.types.push_back(type);
  }
  return tokenizer;
}

}  // namespace

void quiet_llama_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    llama_log_set(&drop_info_log, nullptr);
    llama_backend_init();
  });
}

LlamaModel::LlamaModel(const std::string& path, int gpu_layers, LlamaLoad load) {
  quiet_llama_log();
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw Error("model file '" + path + "' does not exist or is not a regular file");
  }
  const TokenizerKeys keys = read_tokenizer_keys(path);
  llama_model_params params = llama_model_default_params();
  params.n_gpu_layers = gpu_layers;
  params.vocab_only = load == LlamaLoad::vocabulary_only;
  llama_model_kv_override overrides[2]{};
  if (keys.model == kByteTokenizerModel) {
    overrides[0].tag = LLAMA_KV_OVERRIDE_TYPE_STR;
    std::strcpy(overrides[0].key, "tokenizer.ggml.model");
    std::strcpy(overrides[0].val_str, "none");
    params.kv_overrides = overrides;  // overrides[1].key is empty: the end of the list
  }
  model_.reset(llama_model_load_from_file(path.c_str(), params));
  if (!model_) throw Error("llama.cpp could not load '" + path + "' (see its log above)");
  vocab_ = llama_model_get_vocab(model_.get());
  vocab_size_ = llama_vocab_n_tokens(vocab_);
  if (keys.model == kByteTokenizerModel) {
    model::Tokenizer tokenizer;
    tokenizer.kind = model::Tokenizer::Kind::byte_level;
    tokenizer.bos_id = keys.bos;
    tokenizer.eos_id = keys.eos;
    tokenizer.anchor_id = keys.anchor;
    tokenizer.vocab_size = vocab_size_;
    tokenizer_ = std::move(tokenizer);
  } else if (llama_vocab_type(vocab_) == LLAMA_VOCAB_TYPE_SPM) {
    tokenizer_ = sentencepiece_tokenizer(vocab_, vocab_size_);
  }
}

std::vector<std::int32_t> LlamaModel::encode(std::string_view text, bool add_bos) const {
  if (tokenizer_) return tokenizer_->encode(text, add_bos);
  const auto length = static_cast<std::int32_t>(text.size());
  std::vector<llama_token> tokens(text.size() + 2);
  std::int32_t count = llama_tokenize(vocab_, text.data(), length, tokens.data(),
                                      static_cast<std::int32_t>(tokens.size()), add_bos, false);
  if (count < 0) {
    tokens.resize(static_cast<std::size_t>(-count));
    count = llama_tokenize(vocab_, text.data(), length, tokens.data(),
                           static_cast<std::int32_t>(tokens.size()), add_bos, false);
  }
  KVEVICT_REQUIRE(count >= 0, "llama.cpp could not tokenize the text");
  tokens.resize(static_cast<std::size_t>(count));
  return tokens;
}

std::string LlamaModel::decode(std::int32_t id) const {
  if (tokenizer_) return tokenizer_->decode(id);
  char buffer[256];
  const std::int32_t length =
      llama_token_to_piece(vocab_, id, buffer, sizeof buffer, /*lstrip=*/0, /*special=*/false);
  if (length >= 0) return std::string(buffer, static_cast<std::size_t>(length));
  std::string piece(static_cast<std::size_t>(-length), '\0');
  const std::int32_t again = llama_token_to_piece(vocab_, id, piece.data(), -length, 0, false);
  KVEVICT_REQUIRE(again == -length, "llama.cpp could not decode token " + std::to_string(id));
  return piece;
}

std::int32_t LlamaModel::eos_id() const {
  return tokenizer_ ? tokenizer_->eos_id : llama_vocab_eos(vocab_);
}

std::int32_t LlamaModel::bos_id() const {
  if (tokenizer_) return tokenizer_->bos_id;
  return llama_vocab_get_add_bos(vocab_) ? llama_vocab_bos(vocab_) : -1;
}

std::vector<std::uint32_t> LlamaModel::token_bytes() const {
  if (tokenizer_) return harness::token_byte_counts(*tokenizer_, vocab_size_);
  // llama.cpp's vocabularies: the bytes of each token's piece (control tokens have none).
  std::vector<std::uint32_t> bytes(static_cast<std::size_t>(vocab_size_));
  for (std::size_t id = 0; id < bytes.size(); ++id) {
    bytes[id] = static_cast<std::uint32_t>(decode(static_cast<std::int32_t>(id)).size());
  }
  return bytes;
}

}  // namespace kvevict::llama_cli
