#include "harness/text_pieces.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <kvevict/error.hpp>
#include <system_error>
#include <utility>

namespace kvevict::harness {
namespace {

bool is_utf8_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

}  // namespace

TextPieces::TextPieces(const std::string& path, TextPiecesOptions options)
    : options_(std::move(options)), path_(path) {
  KVEVICT_REQUIRE(options_.block_bytes > 0, "TextPieces: block_bytes must be positive");
  if (path == "-") {
    input_ = &std::cin;
  } else {
    std::error_code error;
    if (!std::filesystem::is_regular_file(path, error)) {
      throw Error(fmt::format("input file '{}' does not exist or is not a regular file", path));
    }
    file_.open(path, std::ios::binary);
    if (!file_) throw Error(fmt::format("cannot open input file '{}'", path));
    input_ = &file_;
    const std::uintmax_t size = std::filesystem::file_size(path, error);
    if (!error) expected_bytes_ = size;
  }
  if (options_.limit_bytes > 0 && expected_bytes_ > options_.limit_bytes) {
    expected_bytes_ = options_.limit_bytes;
  }
  next_starts_turn_ = !options_.turn_separator.empty();
  buffer_.reserve(2 * options_.block_bytes);
}

void TextPieces::read_block() {
  std::size_t want = options_.block_bytes;
  if (options_.limit_bytes > 0) {
    want =
        static_cast<std::size_t>(std::min<std::uint64_t>(want, options_.limit_bytes - bytes_read_));
  }
  const std::size_t old_size = buffer_.size();
  buffer_.resize(old_size + want);
  input_->read(buffer_.data() + old_size, static_cast<std::streamsize>(want));
  const auto got = static_cast<std::size_t>(input_->gcount());
  buffer_.resize(old_size + got);
  bytes_read_ += got;
  if (input_->bad()) throw Error(fmt::format("error while reading '{}'", path_));
  const bool limit_reached = options_.limit_bytes > 0 && bytes_read_ >= options_.limit_bytes;
  if (got < want || limit_reached || want == 0) at_end_ = true;
}

bool may_cut_before(std::string_view text, std::size_t p) {
  // Not after other whitespace: a run of whitespace is one pre-token for byte-level BPE
  // ("\n   \n" under Llama 3's `\s*[\r\n]+`, GPT-2's `\s+(?!\S)`), which a cut would split.
  const auto whitespace = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
  };
  return text[p] == ' ' && !whitespace(text[p - 1]);
}

std::size_t TextPieces::cut_point(std::size_t limit) const {
  if (!options_.cut_before_space) return limit;
  // Here limit < buffer_.size(): buffer_[limit] is the first byte of the next piece.
  for (std::size_t p = limit; p > 0; --p) {
    if (may_cut_before(buffer_, p)) return p;
  }
  // No word boundary yet: read on (0) until the buffer is kBlocksWithoutSpace blocks long, then
  // at least do not split a UTF-8 character.
  if (buffer_.size() < kBlocksWithoutSpace * options_.block_bytes) return 0;
  for (std::size_t p = limit; p > 0; --p) {
    if (!is_utf8_continuation(buffer_[p])) return p;
  }
  return limit;
}

void TextPieces::emit(std::size_t length, TextPiece& piece, bool after_separator) {
  piece.text.assign(buffer_, 0, length);
  piece.turn_start = next_starts_turn_;
  piece.space_cut = next_space_cut_;
  buffer_.erase(0, length);
  next_starts_turn_ = after_separator;
  next_space_cut_ =
      !after_separator && options_.cut_before_space && !buffer_.empty() && buffer_.front() == ' ';
}

bool TextPieces::next(TextPiece& piece) {
  const std::string& separator = options_.turn_separator;
  while (true) {
    if (!separator.empty()) {
      const std::size_t found = buffer_.find(separator);
      if (found != std::string::npos) {
        emit(found + separator.size(), piece, /*after_separator=*/true);
        return true;
      }
    }
    if (at_end_) {
      if (buffer_.empty()) return false;
      emit(buffer_.size(), piece, false);
      return true;
    }
    if (buffer_.size() >= options_.block_bytes) {
      // Hold back what could be the start of a separator completed by the next block, and (for a
      // cut before a space) one byte to look at.
      const std::size_t held = std::max<std::size_t>(separator.empty() ? 0 : separator.size() - 1,
                                                     options_.cut_before_space ? 1 : 0);
      const std::size_t limit = buffer_.size() - held;
      if (limit > 0) {
        const std::size_t cut = cut_point(limit);
        if (cut > 0) {
          emit(cut, piece, false);
          return true;
        }
      }
    }
    read_block();
  }
}

}  // namespace kvevict::harness
