// Fuzz target: the tokenizers (byte-level and SentencePiece BPE) with arbitrary vocabularies and
// text, built directly so that every input reaches encode and decode.
//
// Input: one flags byte, then fuzz_input.hpp's two files: a vocabulary, then the text. The
// vocabulary holds records separated by '\0': a score byte (int8), a type byte, the piece.
//   flags & 1  SentencePiece (else byte-level, vocab 256 + the vocabulary's record count % 8)
//   flags & 2  append the 256 byte pieces <0x00>..<0xFF> (every byte can then be encoded)
//   flags & 4  explicit piece types (type byte % 8) instead of inferred ones
//   flags & 8  add BOS
// Properties: ids are in the vocabulary and decode; where every byte's fallback piece is typed as
// a byte piece (appended byte pieces, inferred types, BOS and EOS not among them), decoding the ids
// gives back the text (SentencePiece: with spaces as "▁", the dummy prefix in front).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <kvevict/error.hpp>
#include <kvevict/model/model.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fuzz_input.hpp"
#include "model/model_io.hpp"

namespace {

using kvevict::model::Tokenizer;

constexpr std::size_t kMaxPieces = 4096;
constexpr std::string_view kSpace = "\xe2\x96\x81";

std::string spaces_as_blanks(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    if (text.substr(i, kSpace.size()) == kSpace) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += text[i++];
    }
  }
  return out;
}

Tokenizer make_tokenizer(std::uint8_t flags, std::string_view vocabulary) {
  Tokenizer tokenizer;
  std::size_t records = 0;
  for (std::size_t start = 0; start <= vocabulary.size() && records < kMaxPieces; ++records) {
    std::size_t end = vocabulary.find('\0', start);
    if (end == std::string_view::npos) end = vocabulary.size();
    const std::string_view record = vocabulary.substr(start, end - start);
    tokenizer.scores.push_back(record.empty() ? 0.0f : static_cast<std::int8_t>(record[0]));
    tokenizer.types.push_back(record.size() < 2 ? 1 : static_cast<std::uint8_t>(record[1]) % 8);
    tokenizer.pieces.emplace_back(record.size() < 2 ? std::string_view() : record.substr(2));
    start = end + 1;
  }
  if ((flags & 1) == 0) {
    tokenizer = Tokenizer{};
    tokenizer.vocab_size = 256 + static_cast<int>(records % 8);
    if (tokenizer.vocab_size > 256) tokenizer.bos_id = 256;
    if (tokenizer.vocab_size > 257) tokenizer.eos_id = 257;
    return tokenizer;
  }
  tokenizer.kind = Tokenizer::Kind::sentencepiece;
  if (flags & 2) {
    static const char* const kHex = "0123456789ABCDEF";
    for (int byte = 0; byte < 256; ++byte) {
      std::string piece = "<0x";  // appended piecewise: GCC 12 warns falsely on "<0x" + ...
      piece += kHex[byte / 16];
      piece += kHex[byte % 16];
      piece += '>';
      tokenizer.pieces.push_back(std::move(piece));
      tokenizer.scores.push_back(0.0f);
      tokenizer.types.push_back(6);
    }
  }
  if ((flags & 4) == 0) tokenizer.types.clear();  // inferred: bos/eos control, <0xXX> byte
  const auto pieces = static_cast<std::int32_t>(tokenizer.pieces.size());
  tokenizer.bos_id = pieces > 1 ? 1 : -1;
  tokenizer.eos_id = pieces > 2 ? 2 : -1;
  tokenizer.vocab_size = pieces;
  return tokenizer;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvevict;
  if (size < 1) return 0;
  const std::uint8_t flags = data[0];
  const fuzz::TwoFiles files =
      fuzz::split_two(std::span(reinterpret_cast<const std::byte*>(data + 1), size - 1));
  const Tokenizer tokenizer = make_tokenizer(flags, fuzz::as_text(files.first));
  const std::string_view text = fuzz::as_text(files.second);
  const bool add_bos = (flags & 8) != 0;
  std::vector<std::int32_t> ids;
  try {
    ids = tokenizer.encode(text, add_bos);
  } catch (const Error&) {
    return 0;  // a byte with no piece, no byte piece and no <unk>
  }
  std::string decoded;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    if (id < 0 || id >= tokenizer.vocab_size) {
      fuzz::property_failed("encode produced id " + std::to_string(id) +
                            " outside the vocabulary of " + std::to_string(tokenizer.vocab_size));
    }
    try {
      if (!(add_bos && tokenizer.bos_id >= 0 && i == 0)) decoded += tokenizer.decode(id);
    } catch (const Error& error) {
      fuzz::property_failed("id " + std::to_string(id) + " does not decode: " + error.what());
    }
  }
  const bool byte_level = tokenizer.kind == Tokenizer::Kind::byte_level;
  // Byte fallback uses the first piece spelling <0xXX> (as llama.cpp does), which decodes to its
  // byte only when it is typed as a byte piece: with inferred types, unless it is BOS or EOS.
  const auto is_byte_piece = [&](std::int32_t id) {
    return id >= 0 &&
           model::detail::byte_piece_value(tokenizer.pieces[static_cast<std::size_t>(id)]) >= 0;
  };
  const bool every_byte =
      byte_level || ((flags & 2) != 0 && (flags & 4) == 0 && !is_byte_piece(tokenizer.bos_id) &&
                     !is_byte_piece(tokenizer.eos_id));
  if (!every_byte) return 0;
  std::string expected(text);
  if (!byte_level) {
    // SentencePiece's dummy prefix (none for empty text), then every space as "▁" again.
    if (!text.empty()) expected.insert(expected.begin(), ' ');
    expected = spaces_as_blanks(expected);
  }
  const std::string got = byte_level ? decoded : spaces_as_blanks(decoded);
  if (got != expected) {
    fuzz::property_failed(
        "decode(encode(text)) differs from the text: " + std::to_string(got.size()) +
        " bytes decoded for " + std::to_string(expected.size()));
  }
  return 0;
}
