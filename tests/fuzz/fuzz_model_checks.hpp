// What the model fuzz targets check on every model that loads: its tokenizer encodes text and
// decodes every id of its vocabulary, and the format's writer writes what the reader accepted so
// that the reader reads it back with the same configuration.
#pragma once

#include <algorithm>
#include <cstdint>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_input.hpp"

namespace kvevict::fuzz {

/// Text with spaces, digits, SentencePiece's "▁", a literal control piece and byte piece, and
/// invalid UTF-8.
inline constexpr std::string_view kSampleText =
    "Hello, world! The pass key is 12345.\n\n\xe2\x96\x81 <s> <0x41> \xff\xc3";

inline void check_tokenizer(const model::Tokenizer& tokenizer) {
  const int vocab = tokenizer.vocab_size;
  const auto decodes = [&](std::int32_t id) {
    try {
      (void)tokenizer.decode(id);
    } catch (const Error& error) {
      property_failed("token id " + std::to_string(id) + " of a vocabulary of " +
                      std::to_string(vocab) + " does not decode: " + error.what());
    }
  };
  std::vector<std::int32_t> ids;
  try {
    ids = tokenizer.encode(kSampleText, /*add_bos=*/true);
  } catch (const Error&) {
    // A byte-level vocabulary smaller than 256, or a SentencePiece one without byte pieces or
    // <unk>, cannot encode every byte: a documented error.
  }
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= vocab) {
      property_failed("encode produced id " + std::to_string(id) + " outside the vocabulary of " +
                      std::to_string(vocab));
    }
    decodes(id);
  }
  for (std::int32_t id = 0; id < std::min(vocab, 1024); ++id) decodes(id);
  for (const std::int32_t outside : {-1, vocab}) {
    try {
      (void)tokenizer.decode(outside);
      property_failed("token id " + std::to_string(outside) + " decodes, outside a vocabulary of " +
                      std::to_string(vocab));
    } catch (const Error&) {
    }
  }
}

inline void require_same(bool same, std::string_view what) {
  if (!same) property_failed(std::string(what) + " changed when written and read back");
}

/// `write(model)` may refuse a model its format cannot express (kvevict::Error); what it writes,
/// `read` must load, with the same configuration and tokenizer.
template <class Write, class Read>
void check_round_trip(const model::Model& model, Write write, Read read, bool with_tokenizer) {
  decltype(write(model)) written;
  try {
    written = write(model);
  } catch (const Error&) {
    return;
  }
  model::Model again;
  try {
    again = read(written);
  } catch (const Error& error) {
    property_failed(std::string("a model written by kvevict does not load: ") + error.what());
  }
  const model::ModelConfig& a = model.config;
  const model::ModelConfig& b = again.config;
  require_same(a.dim == b.dim && a.hidden_dim == b.hidden_dim && a.layers == b.layers &&
                   a.heads == b.heads && a.kv_heads == b.kv_heads && a.vocab_size == b.vocab_size,
               "the dimensions");
  require_same(a.context_length == b.context_length, "context_length");
  // GGUF stores rope_theta as f32.
  require_same(static_cast<float>(a.rope_theta) == static_cast<float>(b.rope_theta), "rope_theta");
  require_same(a.norm_eps == b.norm_eps, "norm_eps");
  require_same(a.tied_embeddings == b.tied_embeddings, "tied_embeddings");
  require_same(model.weight_bytes() == again.weight_bytes(), "the weight bytes");
  if (!with_tokenizer) return;
  const model::Tokenizer& s = model.tokenizer;
  const model::Tokenizer& t = again.tokenizer;
  require_same(s.kind == t.kind && s.pieces == t.pieces, "the tokenizer's pieces");
  require_same(s.bos_id == t.bos_id && s.eos_id == t.eos_id && s.anchor_id == t.anchor_id,
               "the tokenizer's special ids");
}

}  // namespace kvevict::fuzz
