// Tokenizer: byte-level and SentencePiece-style BPE (as llama.cpp encodes Llama vocabularies).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <kvevict/model/model.hpp>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvevict/error.hpp"
#include "model_io.hpp"

namespace kvevict::model {
namespace {

constexpr std::string_view kSpace = "\xe2\x96\x81";  // "▁" (U+2581), SentencePiece's space

// SentencePiece piece types (as in GGUF's tokenizer.ggml.token_type).
constexpr std::int32_t kNormal = 1;
constexpr std::int32_t kUnknown = 2;
constexpr std::int32_t kControl = 3;
constexpr std::int32_t kUnused = 5;
constexpr std::int32_t kByte = 6;

/// Bytes in the UTF-8 character led by `lead`; a stray continuation or invalid byte counts as a
/// one-byte character (it then falls back to its byte token).
std::size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xe0) == 0xc0) return 2;
  if ((lead & 0xf0) == 0xe0) return 3;
  if ((lead & 0xf8) == 0xf0) return 4;
  return 1;
}

std::int32_t type_of(const Tokenizer& tokenizer, std::int32_t id) {
  const auto index = static_cast<std::size_t>(id);
  if (index < tokenizer.types.size()) return tokenizer.types[index];
  if (id == tokenizer.bos_id || id == tokenizer.eos_id) return kControl;
  if (detail::byte_piece_value(tokenizer.pieces[index]) >= 0) return kByte;
  return kNormal;
}

/// A run of the normalised text; merged-away symbols have length 0.
struct Symbol {
  std::size_t begin = 0;
  std::size_t length = 0;
  int prev = -1;
  int next = -1;
};

/// A candidate merge of two adjacent symbols into the piece `id`.
struct Bigram {
  float score = 0;
  int left = 0;
  int right = 0;
  std::size_t length = 0;  ///< combined text length when proposed (detects stale entries)

  // Highest score first; among equal scores the leftmost pair (SentencePiece / llama.cpp order).
  bool operator<(const Bigram& other) const {
    return score < other.score || (score == other.score && left > other.left);
  }
};

std::vector<std::int32_t> encode_sentencepiece(const Tokenizer& tokenizer, std::string_view text,
                                               std::vector<std::int32_t> ids) {
  // Pieces that text can turn into: control, unknown, unused and byte pieces are only produced
  // explicitly (a literal "<s>" or "<0x41>" in the text stays text).
  std::unordered_map<std::string_view, std::int32_t> lookup;
  lookup.reserve(tokenizer.pieces.size());
  std::int32_t byte_tokens[256];
  std::fill(std::begin(byte_tokens), std::end(byte_tokens), -1);
  std::int32_t unknown_id = -1;
  for (std::size_t i = 0; i < tokenizer.pieces.size(); ++i) {
    const auto id = static_cast<std::int32_t>(i);
    const std::string& piece = tokenizer.pieces[i];
    const std::int32_t type = type_of(tokenizer, id);
    const int byte = detail::byte_piece_value(piece);
    if (byte >= 0 && byte_tokens[byte] < 0) byte_tokens[byte] = id;
    if (type == kUnknown && unknown_id < 0) unknown_id = id;
    if (type == kControl || type == kUnknown || type == kUnused || type == kByte) continue;
    lookup.emplace(piece, id);  // the first of duplicate pieces wins
  }
  const auto score_of = [&](std::int32_t id) {
    const auto index = static_cast<std::size_t>(id);
    return index < tokenizer.scores.size() ? tokenizer.scores[index] : 0.0f;
  };

  // Normalise as llama.cpp does for SentencePiece: a dummy-prefix space, spaces become "▁".
  std::string normalized(kSpace);
  for (const char c : text) {
    if (c == ' ') {
      normalized += kSpace;
    } else {
      normalized += c;
    }
  }

  // One symbol per UTF-8 character.
  std::vector<Symbol> symbols;
  for (std::size_t offset = 0; offset < normalized.size();) {
    const std::size_t length = std::min(utf8_length(static_cast<unsigned char>(normalized[offset])),
                                        normalized.size() - offset);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back(Symbol{offset, length, index - 1, -1});
    if (index > 0) symbols[static_cast<std::size_t>(index) - 1].next = index;
    offset += length;
  }

  // Greedy BPE: repeatedly merge the adjacent pair whose concatenation is a piece with the best
  // score (a priority queue makes it O(n log n); stale entries are skipped when popped).
  std::priority_queue<Bigram> queue;
  const auto propose = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const Symbol& a = symbols[static_cast<std::size_t>(left)];
    const Symbol& b = symbols[static_cast<std::size_t>(right)];
    const std::string_view joined(normalized.data() + a.begin, a.length + b.length);
    const auto found = lookup.find(joined);
    if (found == lookup.end()) return;
    queue.push(Bigram{score_of(found->second), left, right, joined.size()});
  };
  for (std::size_t i = 1; i < symbols.size(); ++i)
    propose(static_cast<int>(i) - 1, static_cast<int>(i));
  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[static_cast<std::size_t>(bigram.left)];
    Symbol& right = symbols[static_cast<std::size_t>(bigram.right)];
    if (left.length == 0 || right.length == 0 || left.length + right.length != bigram.length) {
      continue;  // one side was merged into something else since this pair was proposed
    }
    left.length += right.length;
    right.length = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[static_cast<std::size_t>(right.next)].prev = bigram.left;
    propose(left.prev, bigram.left);
    propose(bigram.left, left.next);
  }

  // Emit: a symbol's piece, else one byte token per byte (byte fallback), else <unk>.
  for (int index = symbols.empty() ? -1 : 0; index >= 0;
       index = symbols[static_cast<std::size_t>(index)].next) {
    const Symbol& symbol = symbols[static_cast<std::size_t>(index)];
    const std::string_view piece(normalized.data() + symbol.begin, symbol.length);
    if (const auto found = lookup.find(piece); found != lookup.end()) {
      ids.push_back(found->second);
      continue;
    }
    for (const char c : piece) {
      const std::int32_t byte_token = byte_tokens[static_cast<unsigned char>(c)];
      KVEVICT_REQUIRE(byte_token >= 0 || unknown_id >= 0,
                      "tokenizer: text has a character with no piece, no byte token and no <unk>");
      ids.push_back(byte_token >= 0 ? byte_token : unknown_id);
      if (byte_token < 0) break;  // one <unk> per character, as SentencePiece emits
    }
  }
  return ids;
}

std::string decode_piece(std::string_view piece) {
  std::string text;
  for (std::size_t i = 0; i < piece.size();) {
    if (piece.substr(i, kSpace.size()) == kSpace) {
      text += ' ';
      i += kSpace.size();
    } else {
      text += piece[i++];
    }
  }
  return text;
}

}  // namespace

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  std::vector<std::int32_t> ids;
  if (add_bos && bos_id >= 0) ids.push_back(bos_id);
  if (kind == Kind::sentencepiece) {
    if (text.empty()) return ids;  // no dummy prefix for empty text (llama.cpp)
    KVEVICT_REQUIRE(text.size() < (std::size_t{1} << 28),
                    "tokenizer: text of " + std::to_string(text.size()) + " bytes is too long");
    return encode_sentencepiece(*this, text, std::move(ids));
  }
  const int limit = vocab_size > 0 ? vocab_size : 256;
  ids.reserve(ids.size() + text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    KVEVICT_REQUIRE(byte < limit, "tokenizer: byte " + std::to_string(byte) +
                                      " has no token in a byte-level vocabulary of " +
                                      std::to_string(limit));
    ids.push_back(byte);
  }
  return ids;
}

std::string Tokenizer::decode(std::int32_t id) const {
  if (kind == Kind::byte_level) {
    const int limit = vocab_size > 0 ? vocab_size : 256;
    KVEVICT_REQUIRE(id >= 0 && id < limit, "tokenizer: token id " + std::to_string(id) +
                                               " is outside the vocabulary of " +
                                               std::to_string(limit));
    if (id < 256) return std::string(1, static_cast<char>(id));
    return {};  // BOS, EOS, anchor and any other special
  }
  const auto piece_count = static_cast<std::int64_t>(pieces.size());
  const std::int64_t limit = std::max<std::int64_t>(vocab_size, piece_count);
  KVEVICT_REQUIRE(id >= 0 && id < limit, "tokenizer: token id " + std::to_string(id) +
                                             " is outside the vocabulary of " +
                                             std::to_string(limit));
  if (id >= piece_count) return {};  // embedding rows beyond the vocabulary (padding)
  const std::string& piece = pieces[static_cast<std::size_t>(id)];
  switch (type_of(*this, id)) {
    case kControl:
    case kUnused:
      return {};
    case kByte:
      if (const int byte = detail::byte_piece_value(piece); byte >= 0) {
        return std::string(1, static_cast<char>(byte));
      }
      break;
    default:
      break;
  }
  return decode_piece(piece);
}

namespace detail {

int byte_piece_value(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int value = 0;
  for (const char c : piece.substr(3, 2)) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return -1;
    }
    value = value * 16 + digit;
  }
  return value;
}

std::vector<std::int32_t> infer_piece_types(const std::vector<std::string>& pieces,
                                            std::int32_t bos_id, std::int32_t eos_id,
                                            std::int32_t unk_id) {
  std::vector<std::int32_t> types(pieces.size(), kNormal);
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const auto id = static_cast<std::int32_t>(i);
    if (id == bos_id || id == eos_id) {
      types[i] = kControl;
    } else if (id == unk_id) {
      types[i] = kUnknown;
    } else if (byte_piece_value(pieces[i]) >= 0) {
      types[i] = kByte;
    }
  }
  return types;
}

std::int32_t find_piece(const Tokenizer& tokenizer, std::string_view text) {
  for (std::size_t i = 0; i < tokenizer.pieces.size(); ++i) {
    if (tokenizer.pieces[i] == text) return static_cast<std::int32_t>(i);
  }
  return -1;
}

}  // namespace detail
}  // namespace kvevict::model
