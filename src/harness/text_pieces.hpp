// Reads a text of any length in bounded pieces for `kvevict stream`: memory stays constant, and
// tokenizing the pieces one by one gives the tokens of the whole text.
//
// Where a piece may end: a byte-level tokenizer maps bytes to tokens one to one, so anywhere. A
// SentencePiece tokenizer merges across characters and prepends a "dummy prefix" space to every
// text it encodes, so a piece ends just before a space that follows a character other than
// whitespace; the next piece then starts with that space and the caller encodes it without it
// (`space_cut`), letting the dummy prefix stand for it. The merges do not cross the "▁" that
// begins a word, so the tokens match. Byte-level BPE (llama.cpp's tokenizer in kvevict-llama)
// takes the same cuts and keeps the space: no pre-tokenizer of GPT-2, Llama 3 or Qwen2 joins a
// non-space character to the space after it, and a run of whitespace, which they keep whole, is
// never cut. Without such a space the piece grows up to 16 blocks (1 MiB) and is then cut at a
// UTF-8 character boundary (text without spaces, e.g. Chinese): one extra "▁" token per MiB there.
//
// Turns: with a separator, a piece also ends right after every occurrence of it, and the next
// piece starts a turn (SirLLM evicts before each turn). The separator stays in the text, at the
// end of the turn it closes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <istream>
#include <string>
#include <string_view>

namespace kvevict::harness {

struct TextPiecesOptions {
  std::size_t block_bytes = 64 * 1024;
  std::string turn_separator;     ///< empty: no turns
  bool cut_before_space = false;  ///< SentencePiece (see the header comment)
  std::uint64_t limit_bytes = 0;  ///< read at most this many bytes; 0 = all
};

struct TextPiece {
  std::string text;
  /// The piece starts a turn: the first piece, and every piece after a separator (only when a
  /// separator is set).
  bool turn_start = false;
  /// The piece starts with the space the previous piece was cut before (cut_before_space).
  bool space_cut = false;
};

/// Whether `text` may be cut before byte `p` (0 < p < text.size()) when cutting before spaces: a
/// space that follows a character other than whitespace, so that the next piece starts a word
/// (see the header comment).
[[nodiscard]] bool may_cut_before(std::string_view text, std::size_t p);

class TextPieces {
 public:
  /// `path` "-" reads stdin. Throws kvevict::Error when the file cannot be opened.
  TextPieces(const std::string& path, TextPiecesOptions options);

  /// Fills `piece` with the next piece (never empty); false at the end of the text.
  bool next(TextPiece& piece);

  [[nodiscard]] std::uint64_t bytes_read() const { return bytes_read_; }
  /// Bytes that will be read in all (the file's size, capped by limit_bytes); 0 when unknown
  /// (stdin, a pipe).
  [[nodiscard]] std::uint64_t expected_bytes() const { return expected_bytes_; }

 private:
  void read_block();
  // Where a piece that must end by `limit` (< buffer size) ends; see the header comment.
  [[nodiscard]] std::size_t cut_point(std::size_t limit) const;
  void emit(std::size_t length, TextPiece& piece, bool after_separator);

  static constexpr std::size_t kBlocksWithoutSpace = 16;

  TextPiecesOptions options_;
  std::string path_;
  std::ifstream file_;
  std::istream* input_ = nullptr;
  std::string buffer_;
  std::uint64_t bytes_read_ = 0;
  std::uint64_t expected_bytes_ = 0;
  bool at_end_ = false;
  bool next_starts_turn_ = false;
  bool next_space_cut_ = false;
};

}  // namespace kvevict::harness
